"""The MoE layer composition (dispatch/ops/moe_layer.py): contiguous and masked layouts, bf16 / FP8 / MXFP4 / NVFP4
experts, expert parallelism, against the layer's math and against the same composition on the reference backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatch.ops.moe_layer import moe_layer, moe_layer_reference
from tests.helpers import DEVICES, assert_close, assert_same_bytes
from triton_ops.contract.checks import LowbitInputError

T, K, E, H, I = 12, 2, 4, 128, 128


def _silu_act(h):
    return F.silu(h[:, :I]) * h[:, I:]


def _routing(g, device, t=T, e=E):
    ids = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, K, generator=g)
    return ids.to(device), weights.to(device)


def _bf16_experts(g, device):
    w1 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).bfloat16()
    return w1.to(device), w2.to(device)


def _backend(device):
    return "triton" if device == "cpu" else "auto"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_bf16_layer_matches_the_math(device, layout):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g).bfloat16().to(device)
    ids, w = _routing(g, device)
    w1, w2 = _bf16_experts(g, device)
    got = moe_layer(x, ids, w, w1, w2, layout=layout, max_m=T, backend=_backend(device))
    want = moe_layer_reference(x.cpu(), ids.cpu(), w.cpu(), w1.cpu(), w2.cpu(), _silu_act)
    assert_close(got.cpu(), want, f"bf16 {layout}", factor=2)  # h and act are rounded to bf16 between stages


@pytest.mark.parametrize("device", DEVICES)
def test_expert_parallel_rank_sees_only_its_experts(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).bfloat16().to(device)
    ids, w = _routing(g, device)
    w1, w2 = _bf16_experts(g, device)
    local = torch.tensor([0, 1], dtype=torch.int32)  # global experts 0, 1 live here as local 0, 1
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32).to(device)
    got = moe_layer(x, ids, w, w1[local.to(device)], w2[local.to(device)], expert_map=expert_map,
                    backend=_backend(device))
    ids_local = torch.where(ids.cpu() < 2, ids.cpu(), torch.full_like(ids.cpu(), -1))
    want = moe_layer_reference(x.cpu(), ids_local, w.cpu(), w1.cpu()[:2], w2.cpu()[:2], _silu_act)
    assert_close(got.cpu(), want, "expert parallel", factor=2)


def _fp8_weights(g, device):
    w1 = (torch.randn(E, 2 * I, H, generator=g) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    w2 = (torch.randn(E, H, I, generator=g) * 32).clamp(-448, 448).to(torch.float8_e4m3fn)
    s1 = torch.rand(E, 2 * I // 128, H // 128, generator=g) / (32 * H ** 0.5)
    s2 = torch.rand(E, H // 128, I // 128, generator=g) / (32 * I ** 0.5)
    return [t.to(device) for t in (w1, w2, s1, s2)]


def _mxfp4_weights(g, device):
    w1 = torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    w2 = torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8)
    s1 = torch.randint(119, 124, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8)
    s2 = torch.randint(119, 124, (E, H, I // 32), generator=g, dtype=torch.uint8)
    return [t.to(device) for t in (w1, w2, s1, s2)]


def _nvfp4_weights(g, device):
    """NVFP4 experts through the repo's nvfp4_quantize (tests/test_moe_gemm_fused.py:_nvfp4_weights: integer weights,
    a power-of-two factor per block, so GEMM sums on a coarse activation grid are exact), the global scales divided
    by 2^10 (the same codes and block scales, weights of a usual size): w1, w2, s1, s2 and the globals g1, g2."""
    from tests.test_moe_gemm_fused import _nvfp4_weights as nvfp4

    (w1, s1, g1), (w2, s2, g2) = nvfp4(g, E, 2 * I, H, device), nvfp4(g, E, H, I, device)
    return w1, w2, s1, s2, g1 / 1024, g2 / 1024


def _quantized_experts(weights, g, device):
    """(w1, w2, moe_layer's scale keyword arguments) of a quantized weight kind."""
    if weights == "nvfp4":
        w1, w2, s1, s2, g1, g2 = _nvfp4_weights(g, device)
        return w1, w2, dict(w1_scale=s1, w2_scale=s2, w1_global=g1, w2_global=g2)
    w1, w2, s1, s2 = (_fp8_weights if weights == "fp8" else _mxfp4_weights)(g, device)
    return w1, w2, dict(w1_scale=s1, w2_scale=s2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["fp8", "mxfp4", "w4a8", "nvfp4"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_quantized_layer_matches_the_reference_backends(device, weights, layout):
    """The kernels' composition against the same composition on the torch reference backends (both quantize the
    activations identically; the GEMMs accumulate in another order)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=g).bfloat16().to(device)
    ids, w = _routing(g, device)
    w1, w2, scales = _quantized_experts(weights, g, device)
    kw = dict(weights=weights, layout=layout, max_m=T)
    got = moe_layer(x, ids, w, w1, w2, **kw, **scales, backend=_backend(device))
    want = moe_layer(x.cpu(), ids.cpu(), w.cpu(), w1.cpu(), w2.cpu(), **kw,
                     **{k: v.cpu() for k, v in scales.items()}, backend="torch")
    assert bool(torch.isfinite(got).all())
    assert_close(got.cpu(), want, f"{weights} {layout}", factor=2)


def test_bad_arguments_are_named():
    x = torch.zeros(2, H).bfloat16()
    ids, w = torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K)
    w1, w2 = torch.zeros(E, 2 * I, H).bfloat16(), torch.zeros(E, H, I).bfloat16()
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'weights'"):
        moe_layer(x, ids, w, w1, w2, weights="fp4")
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'w1_scale'"):
        moe_layer(x, ids, w, w1, w2, weights="fp8")
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'max_m'"):
        moe_layer(x, ids, w, w1, w2, layout="masked")
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'hidden'"):
        moe_layer([1.0], ids, w, w1, w2)
    w4, s4, g4 = torch.zeros(E, 2 * I, H // 2, dtype=torch.uint8), torch.zeros(E, 2 * I, H // 16), torch.ones(E)
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'w1_scale': NVFP4 weights need"):
        moe_layer(x, ids, w, w4, w4, weights="nvfp4", w1_global=g4, w2_global=g4)
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'w1_global': NVFP4 weights need"):
        moe_layer(x, ids, w, w4, w4, weights="nvfp4", w1_scale=s4, w2_scale=s4, w2_global=g4)
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'w2_global': NVFP4 weights need"):
        moe_layer(x, ids, w, w4, w4, weights="nvfp4", w1_scale=s4, w2_scale=s4, w1_global=g4)
    with pytest.raises(LowbitInputError, match=r"moe_layer: argument 'w1_global': only NVFP4 weights take global "
                                               r"scales \(bf16 weights"):
        moe_layer(x, ids, w, w1, w2, w1_global=g4)
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'w2_global': only NVFP4"):
        moe_layer(x, ids, w, w1, w2, weights="fp8", w1_scale=s4, w2_scale=s4, w2_global=g4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_fused_layer_equals_the_chain(device, weights, layout):
    """fused=True (GEMM1 + SwiGLU epilogue, GEMM2 into token order) against fused=False (separate ops), GPT-OSS
    activation on interleaved gate/up, a shared output and an expert-parallel map. Operands on a coarse grid, so
    every GEMM sum is exact and the tile shapes cannot matter: the bytes must be equal."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randint(-4, 5, (T, H), generator=g) / 4).bfloat16().to(device)
    ids, w = _routing(g, device)
    if weights == "bf16":
        w1 = (torch.randint(-8, 9, (E, 2 * I, H), generator=g) / 64).bfloat16().to(device)
        w2 = (torch.randint(-8, 9, (E, H, I), generator=g) / 64).bfloat16().to(device)
        scales = {}
    elif weights == "fp8":
        w1 = torch.randint(-8, 9, (E, 2 * I, H), generator=g).float().to(torch.float8_e4m3fn).to(device)
        w2 = torch.randint(-8, 9, (E, H, I), generator=g).float().to(torch.float8_e4m3fn).to(device)
        s1 = (2.0 ** torch.randint(-8, -6, (E, 2 * I // 128, H // 128), generator=g).float()).to(device)
        s2 = (2.0 ** torch.randint(-8, -6, (E, H // 128, I // 128), generator=g).float()).to(device)
        scales = dict(w1_scale=s1, w2_scale=s2)
    else:
        w1, w2, scales = _quantized_experts(weights, g, device)
    shared = torch.randn(T, H, generator=g).bfloat16().to(device)
    expert_map = torch.tensor([0, 1, 2, -1], dtype=torch.int32).to(device)
    kw = dict(weights=weights, layout=layout, max_m=4, activation="gptoss", interleave=1, limit=7.0, shared=shared,
              expert_map=expert_map, backend=_backend(device))
    local = {k: v[:3] for k, v in scales.items()}  # the rank's 3 experts
    got = moe_layer(x, ids, w, w1[:3], w2[:3], **kw, **local, fused=True)
    want = moe_layer(x, ids, w, w1[:3], w2[:3], **kw, **local, fused=False)
    assert_same_bytes(got, want, f"{weights} {layout}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_routed_layer_equals_route_then_layer(device, weights):
    """moe_layer_routed = moe_route on the logits, then moe_layer on its ids and weights (DeepSeek-V3 preset); the
    layer's keyword arguments (NVFP4's scales and global scales) pass through."""
    from dispatch.ops import moe_route
    from dispatch.ops.moe_layer import moe_layer_routed

    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g).bfloat16().to(device)
    logits = torch.randn(T, E, generator=g).to(device)
    bias = torch.randn(E, generator=g).to(device)
    if weights == "bf16":
        (w1, w2), scales = _bf16_experts(g, device), {}
    else:
        w1, w2, scales = _quantized_experts(weights, g, device)
    route = dict(scoring="sigmoid", bias=bias, renormalize=True, routed_scaling=2.5, num_groups=2, topk_groups=1)
    b = _backend(device)
    lay = dict(weights=weights, **scales, layout="masked", max_m=T, backend=b)
    got = moe_layer_routed(x, logits, w1, w2, top_k=K, **route, **lay)
    r = moe_route(logits, K, **route, backend=b)
    want = moe_layer(x, r.topk_ids, r.topk_weights, w1, w2, **lay)
    assert_same_bytes(got, want, "routed layer")


def _prepacked(weights, w1, w2, scales):
    """(w1, w2, scale keyword arguments) of the same experts through moe_gemm_fp4_prepack."""
    from dispatch.ops import moe_gemm_fp4_prepack

    v1, p1 = moe_gemm_fp4_prepack(w1, scales["w1_scale"], weights)
    v2, p2 = moe_gemm_fp4_prepack(w2, scales["w2_scale"], weights)
    return v1, v2, {**scales, "w1_scale": p1, "w2_scale": p2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weights", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("layout, fused", [("contiguous", False), ("masked", False), ("contiguous", True),
                                           ("masked", True)])
def test_prepacked_layer_matches_the_linear_layer(device, weights, layout, fused):
    """prepacked=True (both GEMMs on moe_gemm_fp4_prepack's layout through the prepacked kernel; fused: GEMM1 with
    the SwiGLU epilogue) against the layer on the linear weights they were prepacked from: GPT-OSS activation on
    interleaved gate/up, a shared output, an expert-parallel map (the GEMMs sum in another order: close)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).bfloat16().to(device)
    ids, w = _routing(g, device)
    w1, w2, scales = _quantized_experts(weights, g, device)
    v1, v2, packed = _prepacked(weights, w1, w2, scales)
    shared = torch.randn(T, H, generator=g).bfloat16().to(device)
    kw = dict(weights=weights, layout=layout, max_m=4, activation="gptoss", interleave=1, limit=7.0, shared=shared,
              expert_map=torch.tensor([0, 1, 2, -1], dtype=torch.int32).to(device), backend=_backend(device))
    got = moe_layer(x, ids, w, v1[:3], v2[:3], **kw, **{k: v[:3] for k, v in packed.items()}, prepacked=True,
                    fused=fused)
    want = moe_layer(x, ids, w, w1[:3], w2[:3], **kw, **{k: v[:3] for k, v in scales.items()}, fused=False)
    assert bool(torch.isfinite(got).all())
    assert_close(got.cpu(), want.cpu(), f"prepacked {weights} {layout} fused={fused}", factor=2)


@pytest.mark.parametrize("weights, prepacked, fused_ops", [("mxfp4", True, True), ("nvfp4", True, True),
                                                         ("mxfp4", False, False), ("fp8", False, True)])
def test_default_fused_choice(monkeypatch, weights, prepacked, fused_ops):
    """fused=None: the fused GEMM1 + SwiGLU for prepacked FP4 weights and for FP8 on the contiguous layout when the
    chain's GEMM would run Triton (as on the CPU), the chain for linear FP4 weights."""
    import sys

    L = sys.modules[moe_layer.__module__]  # the module (dispatch.ops re-exports the function under its name)
    calls = []
    for name in ("moe_gemm_swiglu", "moe_gemm_swiglu_fp8_group", "moe_gemm_swiglu_fp4_prepacked"):
        def record(*args, _name=name, **kw):
            calls.append(_name)
            raise RuntimeError("stop")
        monkeypatch.setattr(L, name, record)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, w = _routing(g, "cpu")
    w1, w2, scales = _quantized_experts(weights, g, "cpu")
    if prepacked:
        w1, w2, scales = _prepacked(weights, w1, w2, scales)
    try:
        moe_layer(x, ids, w, w1, w2, weights=weights, **scales, activation="gptoss", interleave=1, limit=7.0,
                  prepacked=prepacked, backend=_backend("cpu"))
    except RuntimeError as exc:
        assert str(exc) == "stop"
    assert bool(calls) == fused_ops, calls


@pytest.mark.parametrize("layout, chain_gemm, fused_ops", [("contiguous", "triton", True),
                                                       ("contiguous", "cute", False), ("masked", "triton", False)])
def test_default_fused_choice_fp8(monkeypatch, layout, chain_gemm, fused_ops):
    """fused=None with FP8 weights: fused only on the contiguous layout where the chain's GEMM would not run the
    CuTe kernel (the H200 layer timings: docs/moe_gemm.md)."""
    import sys

    L = sys.modules[moe_layer.__module__]
    calls = []

    def record(*args, **kw):
        calls.append("moe_gemm_swiglu_fp8_group")
        raise RuntimeError("stop")

    asked = []

    def chain_backend(op, *args, backend="auto"):
        asked.append(op)
        return chain_gemm

    monkeypatch.setattr(L, "moe_gemm_swiglu_fp8_group", record)
    monkeypatch.setattr(L, "backend_for", chain_backend)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids, w = _routing(g, "cpu")
    w1, w2, scales = _quantized_experts("fp8", g, "cpu")
    try:
        moe_layer(x, ids, w, w1, w2, weights="fp8", **scales, layout=layout, max_m=T, backend=_backend("cpu"))
    except RuntimeError as exc:
        assert str(exc) == "stop"
    assert bool(calls) == fused_ops, calls
    assert asked == (["moe_gemm_fp8"] if layout == "contiguous" else [])


def test_prepacked_bad_arguments_are_named():
    g = torch.Generator().manual_seed(6)
    x = torch.zeros(2, H).bfloat16()
    ids, w = torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K)
    w1, w2, scales = _quantized_experts("mxfp4", g, "cpu")
    v1, v2, packed = _prepacked("mxfp4", w1, w2, scales)
    with pytest.raises(LowbitInputError, match="moe_layer: argument 'prepacked': only MXFP4 / NVFP4"):
        moe_layer(x, ids, w, v1, v2, weights="w4a8", **packed, prepacked=True)
    # linear weights given as prepacked (the default fused layer's GEMM1 names them; the chain's GEMM1 too)
    with pytest.raises(LowbitInputError, match="moe_gemm_swiglu_fp4_prepacked: argument 'w_values'"):
        moe_layer(x, ids, w, w1, w2, weights="mxfp4", **scales, prepacked=True)
    with pytest.raises(LowbitInputError, match="moe_gemm_fp4_prepacked: argument 'w_values'"):
        moe_layer(x, ids, w, w1, w2, weights="mxfp4", **scales, prepacked=True, fused=False)


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("tokens, layout, fused", [(64, "contiguous", False), (64, "masked", False),
                                                   (1024, "contiguous", False), (64, "contiguous", True),
                                                   (1024, "contiguous", True)])
def test_gpu_prepacked_gptoss_layer(weights, tokens, layout, fused):
    """GPT-OSS-120b sizes (H = I = 2880, top-4) on 32 experts, decode (64 tokens) and prefill (1024 tokens: 128 rows
    per expert, the prefill tile), the chain and fused GEMM1 + SwiGLU: the prepacked layer against the linear one on
    the same GPU."""
    from tests.test_moe_gemm import quant_w_nvfp4

    dev, e, h, i, k = "cuda", 32, 2880, 2880, 4
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(tokens, h, device=dev, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, device=dev, generator=g)[:k] for _ in range(tokens)]).to(torch.int32)
    tw = torch.rand(tokens, k, device=dev, generator=g)
    if weights == "mxfp4":
        w1 = torch.randint(0, 256, (e, 2 * i, h // 2), device=dev, generator=g, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (e, h, i // 2), device=dev, generator=g, dtype=torch.uint8)
        scales = dict(w1_scale=torch.randint(117, 121, (e, 2 * i, h // 32), device=dev, generator=g,
                                             dtype=torch.uint8),
                      w2_scale=torch.randint(117, 121, (e, h, i // 32), device=dev, generator=g, dtype=torch.uint8))
    else:
        w1, s1, g1 = quant_w_nvfp4(torch.randn(e, 2 * i, h, device=dev, generator=g) * 0.02)
        w2, s2, g2 = quant_w_nvfp4(torch.randn(e, h, i, device=dev, generator=g) * 0.02)
        scales = dict(w1_scale=s1, w2_scale=s2, w1_global=g1, w2_global=g2)
    v1, v2, packed = _prepacked(weights, w1, w2, scales)
    kw = dict(weights=weights, layout=layout, max_m=16, activation="gptoss", interleave=1, limit=7.0)
    got = moe_layer(x, ids, tw, v1, v2, **kw, **packed, prepacked=True, fused=fused)
    want = moe_layer(x, ids, tw, w1, w2, **kw, **scales, fused=False)
    assert bool(torch.isfinite(got).all())
    assert_close(got, want, f"GPT-OSS prepacked {weights} T={tokens} {layout} fused={fused}", factor=2)
