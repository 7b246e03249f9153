"""MoE GEMM1 with SwiGLU (+ FP8 1xG quantization) in the epilogue (triton_ops/moe_gemm/fused.py).

The contract is the unfused chain: moe_gemm_<kind> (one rounding to its dtype) -> swiglu / swiglu_fp8_group. With
operands whose every partial sum is exact in fp32 (small integers times powers of two), the accumulation order
cannot matter, so the fused kernel's bytes must equal the chain of our own kernels byte for byte (the rounding of
gate/up, the activation and the quantizer all checked); random operands are compared with the reference at the
GEMM tolerance. Rows the kernel must not read hold NaN. NVFP4 weights come from the repo's nvfp4_quantize (one global
scale per expert, tests/test_moe_gemm.py:quant_w_nvfp4)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.reference import moe_gemm as ref
from dispatch.reference.moe import moe_align, moe_masked_layout
from dispatch.reference.quant import fp8_group_dequantize
from tests.helpers import DEVICES, assert_close, assert_same_bytes, examples
from tests.test_moe_gemm import quant_a_fp8, quant_w_fp8, quant_w_mxfp4, quant_w_nvfp4
from triton_ops import swiglu as tsw
from triton_ops.contract.checks import LowbitInputError
from triton_ops.moe import align as tal
from triton_ops.moe_gemm import fused, grouped
from triton_ops.moe_gemm.config import MoeGemmConfig, pick_swiglu_gemm_config_for_arch

KINDS = ("bf16", "fp16", "fp8", "mxfp4", "w4a8", "nvfp4")
FUSED_KINDS = ("bf16", "fp8", "mxfp4", "w4a8", "nvfp4")  # the ops' weight kinds


# ---------------------------------------------------------------------------------------------- operands


def _layout(g, e, masked, rows, k, device):
    """(ids kwargs, dead rows, lead shape) for about `rows` rows per expert: contiguous rows from moe_align with
    padding and an out-of-range id, or masked counts (0, partial, full, over max_m = rows)."""
    if masked:
        max_m = rows
        counts = torch.tensor([[0, max_m // 2, max_m, max_m + 3][int(x)] for x in torch.randint(0, 4, (e,),
                              generator=g)], dtype=torch.int32)
        dead = torch.arange(max_m)[None, :] >= counts.clamp(0, max_m)[:, None]
        return dict(m_indices=None, masked_m=counts.to(device)), dead.to(device), (e, max_m)
    ids = torch.randint(0, e, (max(rows * e // 2, 1), 2), generator=g, dtype=torch.int32)
    m_indices = moe_align(ids, None, e, 8)[2].clone()
    if m_indices.numel() > 3:
        m_indices[1] = e + 2  # an out-of-range id on a real row: padding
    dead = (m_indices < 0) | (m_indices >= e)
    return dict(m_indices=m_indices.to(device), masked_m=None), dead.to(device), (m_indices.numel(),)


def _nvfp4_weights(g, e, n, k, device):
    """NVFP4 (codes, E4M3 scales, fp32 global per expert) of integer weights with a power-of-two factor 1 .. 4 per
    16-wide block, so the E4M3 block scales span few binades (exact sums with _exact_operands' activations), the
    experts far apart (their own global scales)."""
    w32 = torch.randint(-8, 9, (e, n, k // 16, 16), generator=g).float()
    w32 = w32 * 2.0 ** torch.randint(0, 3, (e, n, k // 16, 1), generator=g).float()
    w32 = w32.reshape(e, n, k) * torch.tensor([3.0 ** x for x in range(e)])[:, None, None]
    return quant_w_nvfp4(w32.to(device))


def _exact_mxfp4_weights(g, e, n, k):
    """MXFP4 (E2M1 pairs, E8M0 scales) of any codes with scales 2^-3 .. 2^-1: exact products and sums with
    _exact_operands' activations."""
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(124, 127, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return packed, scales


def _exact_operands(kind, g, lead, dead, e, n2, k, device):
    """Operands whose products and partial sums are exact in fp32 (on every MMA): (a, a_scale, w, w_scale,
    w_global)."""
    a = torch.randint(-4, 5, (*lead, k), generator=g).float() / 2
    if kind in ("fp8", "w4a8"):
        codes = a.to(torch.float8_e4m3fn)
        codes.view(torch.uint8)[dead] = 0x7F  # NaN: never read
        a_s = 2.0 ** torch.randint(0, 2, (*lead, k // 128), generator=g).float()
        a_s[dead] = float("nan")
        if kind == "w4a8":
            return [*(t.to(device) for t in (codes, a_s, *_exact_mxfp4_weights(g, e, n2, k))), None]
        w = torch.randint(-8, 9, (e, n2, k), generator=g).float().to(torch.float8_e4m3fn)
        w_s = 2.0 ** torch.randint(-4, -2, (e, -(-n2 // 128), k // 128), generator=g).float()
        return [*(t.to(device) for t in (codes, a_s, w, w_s)), None]
    dt = torch.float16 if kind == "fp16" else torch.bfloat16
    a = a.to(dt)
    a[dead] = float("nan")
    if kind == "mxfp4":
        return (a.to(device), None, *(t.to(device) for t in _exact_mxfp4_weights(g, e, n2, k)), None)
    if kind == "nvfp4":
        return (a.to(device), None, *_nvfp4_weights(g, e, n2, k, device))
    w = (torch.randint(-16, 17, (e, n2, k), generator=g).float() / 32).to(dt)
    return a.to(device), None, w.to(device), None, None


def _random_operands(kind, g, lead, dead, e, n2, k, device):
    a = torch.randn(*lead, k, generator=g)
    w = torch.randn(e, n2, k, generator=g) / k ** 0.5
    if kind in ("fp8", "w4a8"):
        codes, a_s = quant_a_fp8(a, False)
        codes.view(torch.uint8)[dead] = 0x7F
        a_s[dead] = float("nan")
        return [*(t.to(device) for t in (codes, a_s, *(quant_w_fp8 if kind == "fp8" else quant_w_mxfp4)(w))), None]
    if kind in ("mxfp4", "nvfp4"):
        a = a.bfloat16()
        a[dead] = float("nan")
        w4 = quant_w_mxfp4(w) + (None,) if kind == "mxfp4" else quant_w_nvfp4(w)
        return [None if t is None else t.to(device) for t in (a, None, *w4)]
    dt = torch.float16 if kind == "fp16" else torch.bfloat16
    a = a.to(dt)
    a[dead] = float("nan")
    return a.to(device), None, w.to(dt).to(device), None, None


def _weights(kind):
    return "bf16" if kind == "fp16" else kind


def _chain_gemm(kind, a, a_s, w, w_s, w_g, ids, config=None):
    """The plain GEMM of the chain (config: the same tiles as the fused op's, for the same accumulation order)."""
    ids = dict(**ids, config=config)
    if kind == "nvfp4":
        return grouped.moe_gemm_nvfp4(a, w, w_s, w_g, **ids)
    if kind == "fp8":
        return grouped.moe_gemm_fp8(a, a_s, w, w_s, **ids)
    if kind == "mxfp4":
        return grouped.moe_gemm_mxfp4(a, w, w_s, **ids)
    if kind == "w4a8":
        return grouped.moe_gemm_w4a8(a, a_s, w, w_s, **ids)
    return grouped.moe_gemm_bf16(a, w, **ids)


# ---------------------------------------------------------------------------------------------- bytes = chain


@st.composite
def problems(draw):
    kind = draw(st.sampled_from(KINDS))
    e = draw(st.integers(1, 3))
    i = draw(st.sampled_from([64, 128]))
    k = draw(st.sampled_from([128, 256]))
    interleave = draw(st.sampled_from([0, 1, 8, 64]))
    activation = draw(st.sampled_from(["silu", "gptoss"]))
    limit = draw(st.sampled_from([None, 7.0, 0.75]))
    quant = draw(st.sampled_from([None, (64, False, False), (64, True, True), (i, False, True)]))
    masked = draw(st.booleans())
    rows = draw(st.sampled_from([1, 5, 17, 24]))
    seed = draw(st.integers(0, 2**31 - 1))
    return kind, e, i, k, interleave, activation, limit, quant, masked, rows, seed


def _bytes_equal_chain(kind, e, i, k, interleave, activation, limit, quant, masked, rows, seed, device="cpu",
                       config=None):
    g = torch.Generator().manual_seed(seed)
    ids, dead, lead = _layout(g, e, masked, rows, k, device)
    a, a_s, w, w_s, w_g = _exact_operands(kind, g, lead, dead, e, 2 * i, k, device)
    act = (interleave, activation, 1.702, limit)
    h = _chain_gemm(kind, a, a_s, w, w_s, w_g, ids)
    wk, desc = _weights(kind), f"{kind} E={e} I={i} K={k} il={interleave} {activation} {limit} {quant} {lead}"
    if quant is None:
        got = fused.moe_gemm_swiglu(a, a_s, w, w_s, **ids, weights=wk, interleave=interleave, activation=activation,
                                    alpha=1.702, limit=limit, w_global=w_g, config=config)
        want = tsw.swiglu(h, *act, ids["m_indices"], ids["masked_m"], None)
        assert_same_bytes(got, want, desc)
        return
    group, ue8m0, column_major = quant
    got = fused.moe_gemm_swiglu_fp8_group(a, a_s, w, w_s, **ids, weights=wk, interleave=interleave,
                                          activation=activation, alpha=1.702, limit=limit, group_size=group,
                                          quant_eps=1e-10, ue8m0=ue8m0, column_major=column_major, w_global=w_g,
                                          config=config)
    want = tsw.swiglu_fp8_group(h, *act, ids["m_indices"], ids["masked_m"], None, group, 1e-10, ue8m0, column_major)
    assert_same_bytes(got[0], want[0], f"codes {desc}")
    assert_same_bytes(got[1], want[1], f"scales {desc}")
    assert got[1].stride() == want[1].stride(), f"scale layout {desc}"


@settings(max_examples=examples(30), deadline=None)
@given(p=problems())
def test_bytes_equal_the_unfused_chain(p):
    _bytes_equal_chain(*p)


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_tile_spanning_experts(kind):
    """Unaligned rows: one tile holds several experts, padding and a bad id (one pass per expert, one store)."""
    cfg = MoeGemmConfig(32, 64, 128, group_m=2, num_warps=4, num_stages=1)
    _bytes_equal_chain(kind, 3, 128, 256, 8, "gptoss", 7.0, (64, False, False), False, 30, 5, config=cfg)
    _bytes_equal_chain(kind, 3, 128, 128, 0, "silu", None, None, False, 30, 6, config=cfg)


# ---------------------------------------------------------------------------------------------- vs reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_random_operands_match_the_reference(kind, masked, device):
    g = torch.Generator().manual_seed(11)
    e, i, k = 3, 128, 256
    ids, dead, lead = _layout(g, e, masked, 12, k, device)
    a, a_s, w, w_s, w_g = _random_operands(kind, g, lead, dead, e, 2 * i, k, device)
    act = dict(weights=kind, interleave=1, activation="gptoss", alpha=1.702, limit=7.0)
    got = fused.moe_gemm_swiglu(a, a_s, w, w_s, **ids, **act, w_global=w_g)
    cpu = lambda t: None if t is None else t.cpu()
    want = ref.moe_gemm_swiglu(*map(cpu, (a, a_s, w, w_s, ids["m_indices"], ids["masked_m"])), *act.values(),
                               cpu(w_g))
    assert_close(got.cpu(), want, f"{kind} masked={masked}", factor=2)
    assert bool((got[dead] == 0).all()), "uncomputed rows are not zero"
    q = fused.moe_gemm_swiglu_fp8_group(a, a_s, w, w_s, **ids, **act, group_size=128, quant_eps=1e-10, ue8m0=False,
                                        column_major=False, w_global=w_g)
    assert_close(fp8_group_dequantize(q[0].cpu(), q[1].cpu(), 128, torch.float32).bfloat16(), want,
                 f"fp8 out {kind}", factor=16)


def test_dispatch_op_and_opcheck():
    """The registered ops (triton row under the interpreter, torch row), and torch.library.opcheck."""
    from dispatch import ops
    g = torch.Generator().manual_seed(3)
    ids, dead, lead = _layout(g, 2, False, 8, 128, "cpu")
    a, _, w, *_ = _exact_operands("bf16", g, lead, dead, 2, 128, 128, "cpu")
    y = ops.moe_gemm_swiglu(a, w, **ids, backend="triton")
    assert_same_bytes(y, ops.moe_gemm_swiglu(a, w, **ids, backend="torch"), "triton vs torch (exact operands)")
    q = ops.moe_gemm_swiglu_fp8_group(a, w, **ids, group_size=64, column_major_scales=True, backend="triton")
    r = ops.moe_gemm_swiglu_fp8_group(a, w, **ids, group_size=64, column_major_scales=True, backend="torch")
    assert_same_bytes(q.codes, r.codes, "codes")
    assert_same_bytes(q.scales, r.scales, "scales")
    args = (a, None, w, None, ids["m_indices"], None, "bf16", 0, "silu", 1.702, None, None, "triton")
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_swiglu.default, args,
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------- GEMM2 + combine


def _routed(g, t, top_k, e, masked, max_m, expert_map, device):
    """A real layout of e local experts from routing over len(expert_map) global ones (or e): (ids kwargs,
    src_rows, inv_rows, topk_weights, lead, dead)."""
    n_global = e if expert_map is None else len(expert_map)
    topk = torch.stack([torch.randperm(n_global, generator=g)[:top_k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, top_k, generator=g)
    emap = None if expert_map is None else torch.tensor(expert_map, dtype=torch.int32)
    if masked:
        src, masked_m, _, inv = moe_masked_layout(topk, emap, e, max_m)
        src = src.view(e, max_m)
        ids = dict(m_indices=None, masked_m=masked_m)
        dead = torch.arange(max_m)[None, :] >= masked_m[:, None]
    else:
        src, _, m_indices, _, _, _, inv = moe_align(topk, emap, e, 8)
        ids = dict(m_indices=m_indices, masked_m=None)
        dead = (m_indices < 0) | (m_indices >= e)
    on = lambda x: None if x is None else x.to(device)
    return ({k: on(v) for k, v in ids.items()}, src.to(device), inv.to(device), weights.to(device),
            tuple(src.shape), dead.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_combine_bytes_equal_the_chain(kind, masked, device):
    """Same GEMM (same config, so the same accumulators) scattered into token order, then the slot-order combine:
    the bytes of moe_gemm -> moe_combine, random operands, with a shared output and an expert-parallel map (entries
    routed elsewhere have no row), one expert past max_m (masked: dropped entries)."""
    g = torch.Generator().manual_seed(21)
    e, t, top_k, n, k = 4, 9, 3, 128, 256
    emap = [0, 1, 2, -1, 3]  # 5 global experts, global 3 lives elsewhere
    ids, src, inv, tw, lead, dead = _routed(g, t, top_k, e, masked, 5, emap, device)
    a, a_s, w, w_s, w_g = _random_operands(kind, g, lead, dead, e, n, k, device)
    shared = torch.randn(t, n, generator=g).bfloat16().to(device)
    cfg = MoeGemmConfig(16, 64, 128, group_m=1, num_warps=4, num_stages=2)
    got = fused.moe_gemm_combine(a, a_s, w, w_s, **ids, weights=kind, src_rows=src, inv_rows=inv, topk_weights=tw,
                                 shared=shared, out_dtype=torch.bfloat16, w_global=w_g, config=cfg)
    h = _chain_gemm(kind, a, a_s, w, w_s, w_g, ids, cfg)
    want = tal.moe_combine(h, inv, tw, shared, torch.bfloat16)
    assert_same_bytes(got, want, f"{kind} masked={masked}")
    cpu = lambda x: None if x is None else x.cpu()
    r = ref.moe_gemm_combine(*map(cpu, (a, a_s, w, w_s, ids["m_indices"], ids["masked_m"])), kind, src.cpu(),
                             inv.cpu(), tw.cpu(), shared.cpu(), torch.bfloat16, cpu(w_g))
    assert_close(got.cpu(), r, f"{kind} vs reference", factor=2)


def test_combine_dispatch_op_and_empty():
    from dispatch import ops
    g = torch.Generator().manual_seed(5)
    ids, src, inv, tw, lead, dead = _routed(g, 6, 2, 3, False, 0, None, "cpu")
    a, _, w, *_ = _random_operands("bf16", g, lead, dead, 3, 64, 128, "cpu")
    y = ops.moe_gemm_combine(a, w, src, inv, tw, **ids, backend="triton")
    assert_close(y, ops.moe_gemm_combine(a, w, src, inv, tw, **ids, backend="torch"), "triton vs torch", factor=2)
    args = (a, None, w, None, ids["m_indices"], None, "bf16", src, inv, tw, None, torch.bfloat16, None, "triton")
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_combine.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    # every entry routed elsewhere: no layout row, the output is the shared part only
    ids, src, inv, tw, lead, dead = _routed(g, 4, 2, 3, False, 0, [-1, -1, -1, -1], "cpu")
    a = torch.randn(*lead, 128).bfloat16()
    shared = torch.randn(4, 64).bfloat16()
    y = fused.moe_gemm_combine(a, None, w, None, **ids, weights="bf16", src_rows=src, inv_rows=inv, topk_weights=tw,
                               shared=shared, out_dtype=torch.bfloat16)
    assert_same_bytes(y, shared, "no local entry: y = shared")
    with pytest.raises(LowbitInputError, match=r"moe_gemm_combine: argument 'src_rows': expected shape"):
        fused.moe_gemm_combine(a, None, w, None, **ids, weights="bf16", src_rows=src[:-1], inv_rows=inv,
                               topk_weights=tw, shared=None, out_dtype=torch.bfloat16)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_combine: argument 'topk_weights': shape"):
        fused.moe_gemm_combine(a, None, w, None, **ids, weights="bf16", src_rows=src, inv_rows=inv,
                               topk_weights=tw[:, :1], shared=None, out_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_are_named():
    a = torch.randn(4, 128).bfloat16()
    w = torch.randn(2, 256, 128).bfloat16()
    mi = torch.zeros(4, dtype=torch.int32)
    kw = dict(m_indices=mi, masked_m=None, interleave=0, activation="silu", alpha=1.702, limit=None)
    f = fused.moe_gemm_swiglu
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'weights'"):
        f(a, None, w, None, weights="fp4", **kw)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'w': N=255 is odd"):
        f(a, None, w[:, :255], None, weights="bf16", **kw)
    with pytest.raises(LowbitInputError, match=r"argument 'interleave': I = 128 is not a multiple of the gran"):
        f(a, None, w, None, weights="bf16", **{**kw, "interleave": 3})
    with pytest.raises(LowbitInputError, match=r"argument 'activation'"):
        f(a, None, w, None, weights="bf16", **{**kw, "activation": "gelu"})
    with pytest.raises(LowbitInputError, match=r"argument 'limit'"):
        f(a, None, w, None, weights="bf16", **{**kw, "limit": -1.0})
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'a_scale': bf16 weights take no"):
        f(a, torch.ones(4, 1), w, None, weights="bf16", **kw)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'a': dtype bfloat16"):
        f(a, torch.ones(4, 1), w, torch.ones(2, 2, 1), weights="fp8", **kw)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'm_indices': give exactly one"):
        f(a, None, w, None, weights="bf16", **{**kw, "masked_m": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_fp8_group: argument 'group_size': I = 128"):
        fused.moe_gemm_swiglu_fp8_group(a, None, w, None, weights="bf16", **kw, group_size=96, quant_eps=1e-10,
                                        ue8m0=False, column_major=False)
    assert "power of two" in fused.supports_moe_gemm_swiglu_fp8_group(a, None, w, None, mi, None, "bf16", 0,
                                                                      "silu", 1.702, None, 64 + 32)


def test_nvfp4_global_scale_is_checked():
    """w_global: required exactly for NVFP4 weights, fp32 (E,) on the weights' device; named errors otherwise."""
    g = torch.Generator().manual_seed(8)
    ids, dead, lead = _layout(g, 2, False, 4, 64, "cpu")
    a, _, w, w_s, w_g = _exact_operands("nvfp4", g, lead, dead, 2, 64, 64, "cpu")
    kw = dict(**ids, weights="nvfp4", interleave=0, activation="silu", alpha=1.702, limit=None)
    f = fused.moe_gemm_swiglu
    arg = r"moe_gemm_swiglu: argument 'w_global'"
    with pytest.raises(LowbitInputError, match=rf"{arg}: NVFP4 weights need w_global"):
        f(a, None, w, w_s, **kw)
    with pytest.raises(LowbitInputError, match=rf"{arg}: expected shape \(2,\), got \(1,\)"):
        f(a, None, w, w_s, **kw, w_global=w_g[:1])
    with pytest.raises(LowbitInputError, match=rf"{arg}: expected shape \(2,\), got \(2, 1\)"):
        f(a, None, w, w_s, **kw, w_global=w_g[:, None])
    with pytest.raises(LowbitInputError, match=rf"{arg}: dtype bfloat16"):
        f(a, None, w, w_s, **kw, w_global=w_g.bfloat16())
    with pytest.raises(LowbitInputError, match=rf"{arg}: expected a torch.Tensor"):
        f(a, None, w, w_s, **kw, w_global=1.0)
    with pytest.raises(LowbitInputError, match=rf"{arg}: is on meta but 'a' is on cpu"):
        f(a, None, w, w_s, **kw, w_global=w_g.to("meta"))
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'a_scale': NVFP4 W4A16 takes"):
        f(a, torch.ones(a.shape[0], 1), w, w_s, **kw, w_global=w_g)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu: argument 'w_scale': expected shape \(2, 64, 4\)"):
        f(a, None, w, w_s[:, :, :2], **kw, w_global=w_g)
    wb = torch.zeros(2, 64, 64).bfloat16()
    with pytest.raises(LowbitInputError, match=rf"{arg}: only NVFP4 weights take a global scale \(bf16 weights"):
        f(a, None, wb, None, **{**kw, "weights": "bf16"}, w_global=w_g)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_fp8_group: argument 'w_global': NVFP4 weights need"):
        fused.moe_gemm_swiglu_fp8_group(a, None, w, w_s, **kw, group_size=32, quant_eps=1e-10, ue8m0=False,
                                        column_major=False)
    ids, src, inv, tw, lead, dead = _routed(g, 4, 2, 2, False, 0, None, "cpu")
    a = torch.randn(*lead, 64).bfloat16()
    cw = dict(**ids, weights="nvfp4", src_rows=src, inv_rows=inv, topk_weights=tw, shared=None,
              out_dtype=torch.bfloat16)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_combine: argument 'w_global': expected shape \(2,\)"):
        fused.moe_gemm_combine(a, None, w, w_s, **cw, w_global=w_g[:1])
    with pytest.raises(LowbitInputError, match=r"moe_gemm_combine: argument 'w_global': NVFP4 weights need"):
        fused.moe_gemm_combine(a, None, w, w_s, **cw)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_combine: argument 'w_global': only NVFP4"):
        fused.moe_gemm_combine(a, None, wb, None, **{**cw, "weights": "bf16"}, w_global=w_g)


def test_nvfp4_dispatch_ops_and_opcheck():
    """The registered ops with NVFP4 weights: the wrappers' w_global keyword, the Triton row against the torch row
    (the reference rounds e2m1 * e4m3 * global per weight, the kernel multiplies the sums: a tolerance), fp16
    activations (a's dtype out), and torch.library.opcheck of the schemas with a global scale."""
    from dispatch import ops
    g = torch.Generator().manual_seed(12)
    ids, src, inv, tw, lead, dead = _routed(g, 6, 2, 3, False, 0, None, "cpu")
    a, _, w1, s1, g1 = _random_operands("nvfp4", g, lead, dead, 3, 128, 64, "cpu")
    _, _, w2, s2, g2 = _random_operands("nvfp4", g, lead, dead, 3, 64, 64, "cpu")
    a = a.half()
    mi = ids["m_indices"]
    y = ops.moe_gemm_swiglu(a, w1, w_scale=s1, w_global=g1, weights="nvfp4", m_indices=mi, backend="triton")
    assert y.dtype == torch.float16
    want = ops.moe_gemm_swiglu(a, w1, w_scale=s1, w_global=g1, weights="nvfp4", m_indices=mi, backend="torch")
    assert_close(y, want, "nvfp4 swiglu triton vs torch", factor=2)
    q = ops.moe_gemm_swiglu_fp8_group(a, w1, w_scale=s1, w_global=g1, weights="nvfp4", m_indices=mi, group_size=64,
                                      backend="triton")
    assert_close(fp8_group_dequantize(q.codes, q.scales, 64, torch.float32).half(), want, "nvfp4 fp8 out", factor=16)
    y2 = ops.moe_gemm_combine(y, w2, src, inv, tw, w_scale=s2, w_global=g2, weights="nvfp4", m_indices=mi,
                              backend="triton")
    assert_close(y2, ops.moe_gemm_combine(y, w2, src, inv, tw, w_scale=s2, w_global=g2, weights="nvfp4",
                                          m_indices=mi, backend="torch"), "nvfp4 combine triton vs torch", factor=2)
    u8 = s1.view(torch.uint8)
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_swiglu.default,
                          (a, None, w1, u8, mi, None, "nvfp4", 0, "silu", 1.702, None, g1, "triton"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_combine.default,
                          (y, None, w2, s2.view(torch.uint8), mi, None, "nvfp4", src, inv, tw, None, torch.bfloat16,
                           g2, "triton"), test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("arch", ["cpu", "sm_80", "sm_90", "sm_100"])
def test_default_configs_are_valid(arch):
    """GEMM1 + SwiGLU picks a valid tile for every weight kind whose columns hold whole FP8 groups."""
    for m in (1, 16, 64, 4096):
        for kind in FUSED_KINDS:
            for min_n in (16, 128):
                cfg = pick_swiglu_gemm_config_for_arch(kind, m, 2048, 7168, arch, min_n)
                assert cfg.refusal(kind) is None and cfg.block_n % min_n == 0, (kind, m, cfg)


def test_empty_layouts():
    w = torch.randn(2, 256, 128).bfloat16()
    a = torch.randn(0, 128).bfloat16()
    y = fused.moe_gemm_swiglu(a, None, w, None, torch.zeros(0, dtype=torch.int32), None, "bf16", 0, "silu", 1.7,
                              None)
    assert y.shape == (0, 128)
    q = fused.moe_gemm_swiglu_fp8_group(a, None, w, None, torch.zeros(0, dtype=torch.int32), None, "bf16", 0, "silu",
                                        1.7, None, 128, 1e-10, False, False)
    assert q[0].shape == (0, 128) and q[1].shape == (0, 1)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, (128, False, True)], ids=["bf16-out", "fp8-out"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_gpu_bytes_equal_the_chain(kind, masked, quant):
    """Decode (16 rows per expert) and prefill-like (256) tiles at a DeepSeek-sized K, exact operands."""
    for rows, il in ((16, 0), (256, 1)):
        _bytes_equal_chain(kind, 8, 512, 1024, il, "silu" if il == 0 else "gptoss", None if il == 0 else 7.0, quant,
                           masked, rows, 1, device="cuda")


# ---------------------------------------------------------------------------------------------- compile-only

_COMPILE = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels, not the interpreter's stand-ins
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton_ops.moe_gemm import fused as F, grouped as G
    from triton_ops.moe_gemm.config import pick_config_for_arch, pick_swiglu_gemm_config_for_arch

    def compile_(kern, ptrs, consts, cfg):
        names = [p.name for p in kern.params]
        sig = {p.name: "i32" for p in kern.params if not p.is_constexpr}
        sig.update(ptrs)
        sig.update({n: "fp32" for n in ("alpha", "limit", "fp8_eps") if n in sig})
        consts = {**consts, "EMULATE": False, "F32_DOT": False, "OUT_DTYPE": tl.bfloat16,
                  "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "GROUP_M": cfg.group_m}
        sig.update(dict.fromkeys(consts, "constexpr"))
        # what a launch tells the compiler: 16-byte aligned pointers, sizes and row strides multiples of 16
        aligned = [*ptrs, *(n for n in ("K", "N", "I", "stride_am", "stride_ae", "stride_we", "stride_wn",
                                        "stride_om") if n in sig)]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        c = triton.compile(triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return (c.asm["ptx"].count("wgmma.mma_async"), c.asm["ttgir"].count("async_copy_global_to_local"),
                c.metadata.shared)

    for kind in ("bf16", "fp8", "mxfp4", "w4a8", "nvfp4"):
        ptrs = dict(a_ptr="*u8" if kind in ("fp8", "w4a8") else "*bf16", as_ptr="*fp32",
                    w_ptr="*bf16" if kind == "bf16" else "*u8", ws_ptr="*fp32" if kind == "fp8" else "*u8",
                    ids_ptr="*i32")
        for fmt in (0, 1):
            cfg = pick_swiglu_gemm_config_for_arch(kind, 4096, 2048, 7168, "sm_90", 128 if fmt else 16)
            consts = dict(KIND=G.KIND_CODE[kind], MASKED=False, INTERLEAVE=1, GPTOSS=True, CLAMP=True, DIV_RN=False,
                          FMT=fmt, GROUP=128, UE8M0=False, MX_RCEIL=False, SWIZZLE=False, HW_FP4=False)
            out = dict(out_ptr="*u8" if fmt else "*bf16", scale_ptr="*fp32", gs_ptr="*fp32")
            print("swiglu", kind, fmt, *compile_(F._moe_gemm_swiglu_kernel, {**ptrs, **out}, consts, cfg))
        cfg = pick_config_for_arch(kind, 4096, 7168, 2048, "sm_90")
        consts = dict(KIND=G.KIND_CODE[kind], MASKED=False, HAS_RW=False, SCATTER=True, DOT_SCALED=False)
        print("scatter", kind, 0, *compile_(G._moe_gemm_kernel, {**ptrs, "rw_ptr": "*fp32", "out_ptr": "*bf16",
                                                                 "dst_ptr": "*i32"}, consts, cfg))
    # the plain GEMM with NVFP4 weights: GPT-OSS GEMM1 prefill, row weights
    cfg = pick_config_for_arch("nvfp4", 4096, 5760, 2880, "sm_90")
    ptrs = dict(a_ptr="*bf16", as_ptr="*fp32", w_ptr="*u8", ws_ptr="*u8", ids_ptr="*i32", rw_ptr="*fp32",
                out_ptr="*bf16", dst_ptr="*i32")
    consts = dict(KIND=G.KIND_CODE["nvfp4"], MASKED=False, HAS_RW=True, SCATTER=False, DOT_SCALED=False)
    print("plain", "nvfp4", 0, *compile_(G._moe_gemm_kernel, ptrs, consts, cfg))
""")
SM90_SHARED = 232448  # bytes of shared memory one CTA may use on an H100


@pytest.mark.slow  # sm_90 SASS properties of a kernel the GPU suite runs: the slow run
def test_sm90_compile_uses_wgmma():
    """Compile the prefill configs for sm_90 without a GPU (a fresh process: the interpreter's kernels cannot be
    compiled): GEMM1 + SwiGLU (bf16 and FP8 outputs, interleaved gate/up rows) and the scattering GEMM2, every
    weight kind (NVFP4 included), and the plain GEMM with NVFP4 weights and row weights, on wgmma with pipelined
    (async-copy) operand loads within the SM's shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln.split() for ln in res.stdout.splitlines() if ln.startswith(("swiglu", "scatter", "plain"))]
    assert len(lines) == 16, res.stdout
    for what, kind, fmt, wgmma, async_copies, shared in lines:
        assert int(wgmma) > 0, f"{what} {kind} fmt={fmt}: no wgmma"
        assert int(async_copies) > 0, f"{what} {kind} fmt={fmt}: operand loads not pipelined (no async copy)"
        assert int(shared) <= SM90_SHARED, f"{what} {kind} fmt={fmt}: {shared} B of shared memory"


def test_torch_compile_fullgraph():
    """The fused ops and W4A8 inside one torch.compile(fullgraph=True) graph (aot_eager: the fakes and the schema),
    same bytes as eager."""
    from dispatch import ops
    g = torch.Generator().manual_seed(9)
    ids, src, inv, tw, lead, dead = _routed(g, 6, 2, 3, False, 0, None, "cpu")
    a, a_s, w1, w1_s, _ = _exact_operands("w4a8", g, lead, dead, 3, 256, 128, "cpu")
    _, _, w2, w2_s, _ = _exact_operands("w4a8", g, lead, dead, 3, 128, 128, "cpu")

    def layer(a, a_s, w1, w1_s, w2, w2_s, mi, src, inv, tw):
        q = ops.moe_gemm_swiglu_fp8_group(a, w1, a_scale=a_s, w_scale=w1_s, weights="w4a8", m_indices=mi,
                                          backend="triton")
        h = ops.moe_gemm_w4a8(q.codes, q.scales, w2, w2_s, m_indices=mi, backend="triton")
        y = ops.moe_gemm_combine(q.codes, w2, src, inv, tw, a_scale=q.scales, w_scale=w2_s, weights="w4a8",
                                 m_indices=mi, backend="triton")
        return h, y

    args = (a, a_s, w1, w1_s, w2, w2_s, ids["m_indices"], src, inv, tw)
    want = layer(*args)
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(*args)
    for x, y, what in zip(got, want, ("w4a8 GEMM2", "GEMM2 + combine"), strict=True):
        assert_same_bytes(x, y, what)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_gpu_combine_and_layer_graph(kind):
    """GEMM2 into token order at a decode size (64 tokens, top-8, 64 experts, N 512, K 1024) against the chain on the
    same GPU (same kernel and config: same bytes); the fused layer against the chain, and captured in a CUDA graph
    and replayed (same bytes as eager)."""
    from dispatch import ops
    from dispatch.ops.moe_layer import moe_layer
    g = torch.Generator().manual_seed(13)
    ids, src, inv, tw, lead, dead = _routed(g, 64, 8, 64, False, 0, None, "cuda")
    a, a_s, w, w_s, w_g = _random_operands(kind, g, lead, dead, 64, 512, 1024, "cuda")
    got = ops.moe_gemm_combine(a, w, src, inv, tw, a_scale=a_s, w_scale=w_s, weights=kind, m_indices=ids["m_indices"],
                               w_global=w_g)
    h = _chain_gemm(kind, a, a_s, w, w_s, w_g, ids)
    assert_same_bytes(got, tal.moe_combine(h, inv, tw, None, torch.bfloat16), f"{kind} combine")
    if kind == "bf16":
        return
    # the layer: 16 experts, top-4, hidden 1024, I 512 (weights quantized on the GPU: the CPU reference quantizers
    # are slow at this size)
    x = torch.randn(64, 1024, generator=g).bfloat16().cuda()
    topk = torch.stack([torch.randperm(16, generator=g)[:4] for _ in range(64)]).to(torch.int32).cuda()
    tw = torch.rand(64, 4, generator=g).cuda()
    quant = {"fp8": quant_w_fp8, "nvfp4": quant_w_nvfp4}.get(kind, quant_w_mxfp4)
    w1, s1, *g1 = quant(torch.randn(16, 1024, 1024, generator=g).cuda() / 32)
    w2, s2, *g2 = quant(torch.randn(16, 1024, 512, generator=g).cuda() / 23)
    kw = dict(weights=kind, w1_scale=s1, w2_scale=s2, layout="masked", max_m=16, fused=True)
    if kind == "nvfp4":
        kw.update(w1_global=g1[0], w2_global=g2[0])
    eager = moe_layer(x, topk, tw, w1, w2, **kw)
    # GEMM1's tiles differ between the paths, so the MMA order may too: a tolerance here (bytes: exact operands)
    assert_close(eager, moe_layer(x, topk, tw, w1, w2, **{**kw, "fused": False}), f"{kind} fused layer vs chain",
                 factor=2)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_layer(x, topk, tw, w1, w2, **kw)  # warm-up (compiles) off the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_layer(x, topk, tw, w1, w2, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bytes(out, eager, f"{kind} layer under CUDA-graph replay")
