"""SwiGLU (+ quantized outputs, MoE layouts): float output within 1 ulp of the reference (exp is not
correctly rounded anywhere), quantized bytes == foundation quantizer applied to the backend's own float
output (exact), pinned layouts, padding rows, NaN, empty inputs, errors, opcheck, torch.compile, GPU-only."""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import triton_ops.swiglu as triton_swiglu
from dispatch import ops
from dispatch.reference import swiglu as ref
from tests.helpers import (
    DEVICES,
    as_bytes,
    assert_close,
    assert_graph_replay_matches_eager,
    assert_same_bytes,
    make_values,
)
from triton_ops.contract.checks import LowbitInputError

QUANTS = ("none", "fp8_group", "mxfp4", "nvfp4")
HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-23}


def _quant_call(quant, x, backend, layout="linear", gs=None, group=64, **kw):
    if quant == "none":
        return [ops.swiglu(x, backend=backend, **kw)]
    if quant == "fp8_group":
        return list(ops.swiglu_fp8_group(x, group_size=group, backend=backend, **kw))
    if quant == "mxfp4":
        return list(ops.swiglu_mxfp4(x, scale_layout=layout, backend=backend, **kw))
    return list(ops.swiglu_nvfp4(x, global_scale=gs, scale_layout=layout, backend=backend, **kw))


def _to(t, device):
    return None if t is None else t.to(device)


def check_swiglu(x, device, quant, layout="linear", gs=None, group=64, **kw):
    """Float output within one output ulp of the reference (and equal for > 99%); quantized bytes exactly the
    reference quantizer of the backend's own float output, and >= 99% equal to the reference composition."""
    dkw = {k: _to(v, device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    y = ops.swiglu(x.to(device), backend="triton", **dkw).cpu()
    y_ref = ops.swiglu(x, backend="torch", **kw)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    nan = y_ref.isnan()
    assert torch.equal(y.isnan(), nan), "NaN positions differ"
    # Overflow: +-Inf stands for the next power of two past the largest finite value (2^16 fp16, 2^128 bf16/fp32),
    # so Inf on both sides is equal and max-finite against Inf is the one ulp it is (not Inf - Inf = NaN).
    top = 2.0 ** (math.frexp(torch.finfo(y.dtype).max)[1])
    a, b = (t.double()[~nan].clamp(-top, top) for t in (y, y_ref))
    # fp32 output: exp/sigmoid differences show directly (a few fp32 ulps); 16-bit outputs: <= 1 ulp, rarely
    tol = 2.0**-19 if y.dtype == torch.float32 else 2 * HALF_ULP[y.dtype]
    assert ((a - b).abs() <= tol * b.abs() + 1e-30).all(), "float output off by more than the tolerance"
    if y.dtype != torch.float32 and a.numel():
        assert (a != b).float().mean() <= 0.01
    if quant == "none":
        return
    got = _quant_call(quant, x.to(device), "triton", layout, _to(gs, device), group, **dkw)
    qkw = dict(group_size=group, swizzle=layout == "swizzled", global_scale=gs)
    want_given_y = ref.quantize_swiglu_output(y, kw.get("expert_ids"), kw.get("masked_m"), quant, **qkw)
    for i, (g, w) in enumerate(zip(got, want_given_y, strict=True)):
        assert g.stride() == w.stride() or g.numel() == 0
        if device == "cuda":  # one instruction sequence per element: the fused y IS the float kernel's y
            assert_same_bytes(g, w, f"{quant} output {i} vs quantizer(own y)")
        elif g.numel():  # interpreter: numpy's exp differs between its SIMD body and scalar tail, so the
            # fused kernel's y (other tile shapes) can differ by an ulp from the float kernel's y
            assert (as_bytes(g) != as_bytes(w)).float().mean() <= 0.005, f"{quant} output {i} vs quantizer(own y)"
    want = _quant_call(quant, x, "torch", layout, gs, group, **kw)
    for g, w in zip(got, want, strict=True):
        ga, wa = as_bytes(g), as_bytes(w)
        assert (ga != wa).float().mean() <= 0.01 if ga.numel() else True


def _x(lead, i, dtype=torch.bfloat16, dist="normal", seed=0, scale=3.0):
    rows = 1
    for d in lead:
        rows *= d
    return (make_values(rows, 2 * i, dist, seed) * scale).reshape(*lead, 2 * i).to(dtype)


VARIANTS = [dict(activation="silu"), dict(activation="silu", limit=7.0),
            dict(activation="gptoss", alpha=1.702, limit=7.0), dict(activation="gptoss", alpha=1.0)]


# ----------------------------------------------------------------------------------------- properties


@pytest.mark.parametrize("device", DEVICES)
@given(lead=st.sampled_from([(1,), (5,), (2, 3), (9,)]), i_mult=st.sampled_from([1, 2, 3]),
       interleave=st.sampled_from([0, 1, 2, 8]), variant=st.sampled_from(range(len(VARIANTS))),
       quant=st.sampled_from(QUANTS), layout=st.sampled_from(["linear", "swizzled"]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       out_dtype=st.sampled_from([None, torch.bfloat16]), gs_mode=st.sampled_from(["computed", "given"]),
       dist=st.sampled_from(["normal", "heavy_tail", "mixed_scale"]), seed=st.integers(0, 2**20))
def test_swiglu_dense(device, lead, i_mult, interleave, variant, quant, layout, dtype, out_dtype, gs_mode, dist,
                      seed):
    x = _x(lead, 64 * i_mult, dtype, dist, seed)
    gs = torch.tensor(0.002) if gs_mode == "given" and quant == "nvfp4" else None
    check_swiglu(x, device, quant, layout, gs, interleave=interleave, out_dtype=out_dtype, **VARIANTS[variant])


@pytest.mark.parametrize("device", DEVICES)
@given(moe=st.sampled_from(["contiguous", "masked"]), quant=st.sampled_from(QUANTS),
       layout=st.sampled_from(["linear", "swizzled"]), per_expert=st.booleans(), seed=st.integers(0, 2**20),
       interleave=st.sampled_from([0, 8]))
def test_swiglu_moe(device, moe, quant, layout, per_expert, seed, interleave):
    g = torch.Generator().manual_seed(seed)
    n_exp = 3
    if moe == "contiguous":
        x = _x((40,), 128, seed=seed)
        kw = dict(expert_ids=torch.randint(-1, n_exp, (40,), generator=g, dtype=torch.int32))
    else:
        x = _x((n_exp, 12, ), 128, seed=seed)
        kw = dict(masked_m=torch.tensor([0, 5, 12], dtype=torch.int32))
    gs = None
    if quant == "nvfp4":
        gs = torch.rand(n_exp, generator=g) * 0.004 + 1e-4 if per_expert else torch.tensor(0.003)
    check_swiglu(x, device, quant, layout, gs, interleave=interleave, activation="silu", limit=7.0, **kw)


@pytest.mark.parametrize("device", DEVICES)
@given(layout_kind=st.sampled_from(["dense", "contiguous", "masked"]), layout=st.sampled_from(["linear", "swizzled"]),
       interleave=st.sampled_from([0, 1, 8]), dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       special=st.sampled_from([None, "nan", "inf", "zeros"]), seed=st.integers(0, 2**20))
def test_swiglu_nvfp4_computed_gs_split(device, layout_kind, layout, interleave, dtype, special, seed):
    """Long batches with a computed NVFP4 global scale store y and its amax, then run the NVFP4 quantizer
    (triton_ops/swiglu.py: NVFP4_COMPUTED_GS_SPLIT_ROWS, forced on here for small shapes): the same contract."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(activation="gptoss", alpha=1.702, limit=7.0)
    if layout_kind == "dense":
        x = _x((6,), 64, dtype, "mixed_scale", seed)
    elif layout_kind == "contiguous":
        x = _x((40,), 128, dtype, seed=seed)
        kw["expert_ids"] = torch.randint(-1, 3, (40,), generator=g, dtype=torch.int32)
    else:
        x = _x((3, 12), 128, dtype, seed=seed)
        kw["masked_m"] = torch.tensor([0, 5, 12], dtype=torch.int32)
    rows = x.reshape(-1, x.shape[-1])
    if special == "zeros":
        rows.zero_()
    elif special is not None:
        rows[1, 2] = float(special)
    with mock.patch.object(triton_swiglu, "NVFP4_COMPUTED_GS_SPLIT_ROWS", 0):
        check_swiglu(x, device, "nvfp4", layout, None, interleave=interleave, **kw)


# ------------------------------------------------------------------------------------------ pinned cases


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_layouts_match_slicing(device):
    """interleave=1 is GPT-OSS's x[..., ::2] / x[..., 1::2]; interleave=0 is [gate | up]; g=8 chunks of 8."""
    x = _x((4,), 64)
    gate, up = x[..., ::2].float(), x[..., 1::2].float()
    y1 = ops.swiglu(x.to(device), interleave=1, backend="triton").cpu().float()
    want = torch.nn.functional.silu(gate) * up
    assert torch.allclose(y1, want, rtol=2**-7, atol=1e-6)
    y0 = ops.swiglu(x.to(device), interleave=0, backend="triton").cpu().float()
    want0 = torch.nn.functional.silu(x[..., :64].float()) * x[..., 64:].float()
    assert torch.allclose(y0, want0, rtol=2**-7, atol=1e-6)
    x8 = x.reshape(4, 8, 2, 8)
    want8 = torch.nn.functional.silu(x8[:, :, 0].float()) * x8[:, :, 1].float()
    y8 = ops.swiglu(x.to(device), interleave=8, backend="triton").cpu().float()
    assert torch.allclose(y8, want8.reshape(4, 64), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_gptoss_matches_model_code(device):
    """GPT-OSS's swiglu (alpha 1.702, limit 7, even/odd interleave), written as in the model code."""
    x = _x((6,), 64, scale=6.0)
    gl, lin = x[..., ::2].float().clamp(max=7.0), x[..., 1::2].float().clamp(-7.0, 7.0)
    want = gl * torch.sigmoid(1.702 * gl) * (lin + 1)
    y = ops.swiglu(x.to(device), interleave=1, activation="gptoss", alpha=1.702, limit=7.0, backend="triton")
    assert_close(y.cpu().float(), want, "gptoss swiglu", dtype=y.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_nvfp4_degenerate_expert_scales(device):
    """Per-expert NVFP4 global scales of 0, NaN and a tiny one (the fused epilogue's exact per-element path)
    next to a normal expert and padding rows (which must stay zero bytes whatever path their tile takes); y
    holds +-Inf, +-0 and negatives. Gates are >= 20 or <= -100, where silu is g or -0 whatever exp's last bit,
    so y is exact on every backend and the bytes must equal the reference's."""
    g = torch.Generator().manual_seed(5)
    gate = torch.where(torch.rand(12, 64, generator=g) < 0.5, torch.rand(12, 64, generator=g) * 40 + 20,
                       -100.0 - torch.rand(12, 64, generator=g) * 100)
    up = torch.randn(12, 64, generator=g)
    gate[0, 2], up[0, 2] = 3e38, 3e38  # y = +Inf
    gate[5, 9], up[5, 9] = 3e38, -3e38  # y = -Inf
    x = torch.cat([gate, up], 1).bfloat16()
    ids = torch.tensor([0, 0, -1, 1, 1, 2, 2, -1, 3, 3, 3, -1], dtype=torch.int32)
    gs = torch.tensor([0.0, float("nan"), 1e-35, 0.01])
    for layout in ("linear", "swizzled"):
        got = _quant_call("nvfp4", x.to(device), "triton", layout, gs.to(device), expert_ids=ids.to(device))
        want = _quant_call("nvfp4", x, "torch", layout, gs, expert_ids=ids)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(a.cpu(), b, f"nvfp4 {layout} output {i}")
    assert int(got[0][2].sum()) == 0 and int(got[1].view(torch.uint8).sum()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_padding_rows_zero_and_unread(device):
    """Padding rows are never read (NaN there does not leak) and come out as zeros / zero scale bytes."""
    x = _x((6,), 64)
    x[1] = float("nan")
    ids = torch.tensor([0, -1, 1, 1, -1, 0], dtype=torch.int32)
    y = ops.swiglu(x.to(device), expert_ids=ids.to(device), backend="triton").cpu()
    assert (y[1] == 0).all() and (y[4] == 0).all() and y.isfinite().all()
    gs = torch.tensor([0.01, 0.02], device=device)
    q = ops.swiglu_nvfp4(x.to(device), expert_ids=ids.to(device), global_scale=gs, backend="triton")
    assert int(q.codes[1].sum()) == 0 and int(q.scales[1].view(torch.uint8).sum()) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_nan_propagates(device):
    """NaN in gate or up -> NaN output (the clamp propagates NaN); quantized: the foundation's NaN rules."""
    x = _x((2,), 64)
    x[0, 3] = float("nan")  # gate col 3
    x[1, 64 + 5] = float("nan")  # up col 5
    for quant in QUANTS:
        check_swiglu(x, device, quant, limit=7.0)
    y = ops.swiglu(x.to(device), limit=7.0, backend="triton").cpu()
    assert y[0, 3].isnan() and y[1, 5].isnan() and y.isnan().sum() == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_swiglu_empty(device, quant):
    check_swiglu(torch.empty(0, 256, dtype=torch.bfloat16), device, quant, "swizzled")


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call,op,arg", [
    (lambda: ops.swiglu(torch.randn(2, 63)), "swiglu", "x"),
    (lambda: ops.swiglu(torch.randn(2, 64), interleave=3), "swiglu", "interleave"),
    (lambda: ops.swiglu(torch.randn(2, 64), activation="gelu"), "swiglu", "activation"),
    (lambda: ops.swiglu(torch.randn(2, 64), limit=-1.0), "swiglu", "limit"),
    (lambda: ops.swiglu_mxfp4(torch.randn(2, 96)), "swiglu_mxfp4", "x"),  # I = 48
    (lambda: ops.swiglu_nvfp4(torch.randn(2, 5760 + 8)), "swiglu_nvfp4", "x"),
    (lambda: ops.swiglu(torch.randn(2, 64), expert_ids=torch.zeros(3, dtype=torch.int32)), "swiglu", "expert_ids"),
    (lambda: ops.swiglu(torch.randn(2, 64), expert_ids=torch.zeros(2)), "swiglu", "expert_ids"),
    (lambda: ops.swiglu(torch.randn(2, 64), masked_m=torch.zeros(2, dtype=torch.int32)), "swiglu", "masked_m"),
    (lambda: ops.swiglu_nvfp4(torch.randn(2, 64), global_scale=torch.ones(3)), "swiglu_nvfp4", "global_scale"),
    (lambda: ops.swiglu(torch.randn(2, 64), out_dtype=torch.int8), "swiglu", "out_dtype"),
])
def test_swiglu_bad_input(call, op, arg):
    with pytest.raises(LowbitInputError, match=rf"lowbit\.{op}: argument '{arg}'"):
        call()


# --------------------------------------------------------------------------------- torch integration


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_swiglu_opcheck(backend):
    x = _x((3,), 64)
    ids = torch.tensor([0, -1, 1], dtype=torch.int32)
    lb = torch.ops.lowbit
    torch.library.opcheck(lb.swiglu, (x, 1, "gptoss", 1.702, 7.0, None, None, torch.bfloat16, backend))
    torch.library.opcheck(lb.swiglu_fp8_group, (x, 0, "silu", 1.702, None, ids, None, None, 64, 1e-10, False, True,
                                                backend))
    torch.library.opcheck(lb.swiglu_mxfp4, (x, 8, "silu", 1.702, 7.0, None, None, None, "rceil", True, backend))
    torch.library.opcheck(lb.swiglu_nvfp4, (x, 0, "silu", 1.702, None, ids, None, None, torch.ones(2) * 0.01, True,
                                            backend))


def test_swiglu_compile_fullgraph():
    x = _x((3,), 64)

    def f(x):
        q = ops.swiglu_nvfp4(x, interleave=1, activation="gptoss", limit=7.0, backend="triton")
        return ops.swiglu(x, backend="triton"), q.codes, q.scales, q.global_scale

    for a, b in zip(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x), strict=True):
        assert_same_bytes(a, b, "compiled")


# --------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_swiglu_cuda_graph():
    x = _x((16,), 2048).cuda()
    ids = torch.zeros(16, dtype=torch.int32, device="cuda")
    fns = [lambda: ops.swiglu_nvfp4(x, interleave=8, limit=7.0, scale_layout="swizzled"),
           lambda: ops.swiglu_fp8_group(x, expert_ids=ids),
           lambda: ops.swiglu(x, interleave=1, activation="gptoss", limit=7.0)]
    for fn in fns:
        assert_graph_replay_matches_eager(fn)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("interleave", [0, 1, 8])
def test_swiglu_large_gpu(quant, interleave):
    x = _x((512,), 3072, dist="mixed_scale", seed=3)
    check_swiglu(x, "cuda", quant, "swizzled", None, 128, interleave=interleave, activation="gptoss", limit=7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("moe", [False, True])
def test_swiglu_nvfp4_computed_gs_long_batch_gpu(moe):
    """Rows past NVFP4_COMPUTED_GS_SPLIT_ROWS (not patched): the float output + amax, then the NVFP4 quantizer."""
    rows = max(triton_swiglu.NVFP4_COMPUTED_GS_SPLIT_ROWS, 1)
    x = _x((rows,), 1024, dist="mixed_scale", seed=5)
    kw = dict(expert_ids=(torch.arange(rows, dtype=torch.int32) % 5) - 1) if moe else {}
    check_swiglu(x, "cuda", "nvfp4", "swizzled", None, interleave=1, activation="gptoss", limit=7.0, **kw)


@pytest.mark.gpu
def test_swiglu_inductor():
    x = _x((8,), 256).cuda()
    f = lambda x: ops.swiglu_mxfp4(x, interleave=1).codes  # noqa: E731
    assert_same_bytes(torch.compile(f, fullgraph=True)(x), f(x), "inductor")
