"""Prepacked FP4 weights (`moe_gemm_fp4_prepack` -> `moe_gemm_fp4_prepacked`, MXFP4 / NVFP4 W4A16): the layout
(round trip, element positions, the bit trick), the swap-AB decode kernel against the contract (moe_gemm_mxfp4 /
moe_gemm_nvfp4 on the linear weights) under the interpreter and on a GPU, bad inputs, and its sm_90 machine code.

Rows the kernel must not read are NaN; outputs start as NaN (conftest poison), so a forgotten zero row fails."""

from __future__ import annotations

import dataclasses
import itertools
import os
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference import moe_gemm as ref
from dispatch.reference.formats import e2m1_decode
from tests.helpers import DEVICES, assert_close, assert_same_bytes, examples, run_compile_script
from tests.test_moe_gemm import Case, _contig, _poison_rows, cases, quant_w_mxfp4
from tests.test_moe_gemm_nvfp4 import quant_w_nvfp4
from triton_ops.contract import fp4_prepack as FP
from triton_ops.contract.checks import LowbitInputError
from triton_ops.moe_gemm import prepacked as tri
from triton_ops.moe_gemm.config import MoeGemmConfig, pick_prepacked_config_for_arch, prepacked_swiglu_config

BLOCK = {"mxfp4": 32, "nvfp4": 16}


def _linear_weights(fmt: str, w32: torch.Tensor, edit: str | None = None):
    """(codes (E, N, K/2) uint8, scale bytes (E, N, K/block) uint8, global (E,) fp32 or None) from the repo's
    quantizers."""
    if fmt == "mxfp4":
        codes, scales = quant_w_mxfp4(w32)
        return codes, scales.view(torch.uint8), None
    codes, scales, gs = quant_w_nvfp4(w32, edit)
    return codes, scales.view(torch.uint8), gs


def _contig_case(e, ids, k, n, row_weights=False):
    """A contiguous-layout Case with the given expert id per row."""
    mi, x, dead, w32 = _contig(e, ids, k, n)
    rw = torch.rand(len(ids)) if row_weights else None
    return Case("mxfp4", x, dead, mi, None, w32, rw, f"contiguous ids={ids}")


def _run(fmt, case, dtype=torch.bfloat16, device="cpu", config=None, weights=None):
    """(got, want): the prepacked kernel on `device` and the linear-layout contract on the CPU (weights: the linear
    (codes, scales, global) if already quantized)."""
    wp, ws, wg = weights or _linear_weights(fmt, case.w32)
    a = _poison_rows(case.x.to(dtype), case.dead)
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    dev = lambda t: None if t is None else t.to(device)
    got = tri.moe_gemm_fp4_prepacked(dev(a), dev(vals), dev(scales), dev(wg), fmt, dev(case.m_indices),
                                     dev(case.masked_m), dev(case.row_weights), config=config)
    if fmt == "mxfp4":
        want = ref.moe_gemm_mxfp4(a, wp, ws, case.m_indices, case.masked_m, case.row_weights)
    else:
        want = ref.moe_gemm_nvfp4(a, wp, ws, wg, case.m_indices, case.masked_m, case.row_weights)
    return got, want


def _check(fmt, case, dtype=torch.bfloat16, device="cpu", config=None, weights=None):
    """The kernel's output against the contract (normalized error, no NaN, uncomputed rows 0); returns it."""
    got, want = _run(fmt, case, dtype, device, config, weights)
    what = f"{case.desc} {fmt} {dtype} {config}"
    assert got.dtype == dtype, what
    assert_close(got.cpu(), want, what)
    assert not torch.isnan(got.float()).any(), f"{what}: NaN in the output (unwritten or poisoned rows)"
    dead = got.cpu()[case.dead]
    assert torch.equal(dead, torch.zeros_like(dead)), f"{what}: uncomputed rows are not zero"
    return got


# ---------------------------------------------------------------------------------------------- the layout


@settings(max_examples=examples(30))
@given(fmt=st.sampled_from(["mxfp4", "nvfp4"]), e=st.integers(1, 3), n=st.integers(1, 9),
       chunks=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_prepack_round_trip_is_exact(fmt, e, n, chunks, seed):
    """Any codes and scale bytes (NaN scales included), K any multiple of the block (padded to 128): unpack of the
    prepacked weights is the original bytes; the op (auto backend) equals the reference; shapes as documented."""
    k = chunks * BLOCK[fmt]
    g = torch.Generator().manual_seed(seed)
    wp = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    ws = torch.randint(0, 256, (e, n, k // BLOCK[fmt]), generator=g, dtype=torch.uint8)
    vals, scales = ops.moe_gemm_fp4_prepack(wp, ws, fmt)
    # torch's own dtypes for the same bytes (packed FP4 codes, E8M0 / E4M3 scales) give the same result
    views = {"mxfp4": getattr(torch, "float8_e8m0fnu", None), "nvfp4": torch.float8_e4m3fn}
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is not None and views[fmt] is not None:
        v2, s2 = ops.moe_gemm_fp4_prepack(wp.view(fp4), ws.view(views[fmt]), fmt)
        assert torch.equal(v2, vals) and torch.equal(s2, scales)
    assert (tuple(vals.shape), tuple(scales.shape)) == FP.prepacked_shapes(e, n, k, fmt)
    assert vals.dtype == torch.int32 and scales.dtype == torch.uint8
    back_w, back_s = ref.moe_gemm_fp4_unpack(vals, scales, k, fmt)
    assert torch.equal(back_w, wp) and torch.equal(back_s, ws)
    kp = FP.padded_k(k)
    pad = scales[..., k // BLOCK[fmt]:]
    assert torch.equal(pad, torch.full_like(pad, FP.UNIT_SCALE[fmt])), "padding scales are not the unit scale"
    codes = FP.unpack_values(vals, kp)
    assert not codes[..., k // 2:].any(), "padding codes are not zero"


def test_prepack_element_positions():
    """Element k of a row sits where the layout says: word 16 u + 4 c + t, half b, slot p = 2 s + h (sign at
    SIGN_BIT[p], magnitude at MAG_BITS[p]), with k = 128 u + 32 t + 16 s + 8 h + 2 c + b."""
    g = torch.Generator().manual_seed(1)
    k = 288
    wp = torch.randint(0, 256, (2, 3, k // 2), generator=g, dtype=torch.uint8)
    words = FP.prepack_values(wp).to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack((wp & 15, wp >> 4), -1).reshape(2, 3, k).to(torch.int64)
    for kk in range(k):
        u, r = divmod(kk, 128)
        t, r = divmod(r, 32)
        s, r = divmod(r, 16)
        h, r = divmod(r, 8)
        c, b = divmod(r, 2)
        half = (words[..., 16 * u + 4 * c + t] >> (16 * b)) & 0xFFFF
        p = 2 * s + h
        got = ((half >> FP.SIGN_BIT[p]) & 1) << 3
        for j, pos in enumerate(FP.MAG_BITS[p]):
            got |= ((half >> pos) & 1) << (2 - j)
        assert torch.equal(got, codes[..., kk]), kk


def _kernel_bits(w: torch.Tensor, p: int, fp16: bool) -> torch.Tensor:
    """The kernel's extraction (prepacked._pair_bits) in torch: int64 words -> the pair's 16-bit halves' bits."""
    m = 0x81C081C0
    if p == 0:
        bits = w & m
    elif p == 1:
        bits = (w << 3) & m
    elif p == 2:
        bits = (w << 6) & m
    else:
        bits = ((w << 1) & 0x80008000) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040)
    if fp16:
        bits = (bits & 0x80008000) | ((bits & 0x01C001C0) << 3)
    return bits & 0xFFFFFFFF


def test_bit_trick_is_exact_for_every_code():
    """Every code in every slot of both halves, prepacked, then the kernel's mask-and-shift extraction: bf16 bits =
    e2m1 * 2^-126 (code 1 the bf16 subnormal 2^-127), fp16 bits = e2m1 * 2^-14 (code 1 the fp16 subnormal 2^-15);
    times 2^126 / 2^14 the e2m1 value, signed zero included, and no bits of other slots or the other half leak in."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (64, 128), generator=g, dtype=torch.uint8)
    codes[:, :16] = torch.arange(16, dtype=torch.uint8)  # every code at positions of every slot and half
    codes[:16, :] = torch.arange(16, dtype=torch.uint8)[:, None]
    wp = (codes[:, 0::2] | (codes[:, 1::2] << 4))[None]
    words = FP.prepack_values(wp)[0].to(torch.int64) & 0xFFFFFFFF  # (64, 16)
    want = e2m1_decode(codes).double()
    for dtype, bias in ((torch.bfloat16, 2.0 ** 126), (torch.float16, 2.0 ** 14)):
        got = torch.empty(64, 128, dtype=torch.float64)
        for p in range(4):
            bits = _kernel_bits(words, p, dtype == torch.float16)
            for b in range(2):
                v = ((bits >> (16 * b)) & 0xFFFF).to(torch.int32).to(torch.int16).view(dtype).double() * bias
                for c in range(4):
                    for t in range(4):
                        k = 32 * t + 16 * (p // 2) + 8 * (p % 2) + 2 * c + b
                        got[:, k] = v[:, 4 * c + t]
        assert torch.equal(got, want), f"{dtype}: {(got != want).nonzero()[:5].tolist()}"
        assert torch.equal(torch.signbit(got), torch.signbit(want)), f"{dtype}: signed zeros"


# ---------------------------------------------------------------------------------------------- the kernel


@settings(max_examples=examples(8))
@given(case=cases("mxfp4"), nvfp4=st.booleans(), fp16=st.booleans())
def test_prepacked_matches_reference(case, nvfp4, fp16):
    """Interpreter: E 1-4, both layouts (padding, out-of-range ids, masked counts past max_m and negative), row
    weights, K 128 / 160 / 256 (a partial 128-K chunk), weights from the repo's quantizers."""
    fmt = "nvfp4" if nvfp4 else "mxfp4"
    _check(fmt, case, torch.float16 if nvfp4 and fp16 else torch.bfloat16)


def _edge_weights(fmt: str, e: int, n: int, k: int, device: str):
    """Every code at every K position, scales at the edges: MXFP4 E8M0 0 (2^-127: subnormal products), 1, 2, 126,
    127, 128, 140; NVFP4 E4M3 subnormals 0x01-0x07, zero, 0x38, 448 (0x7E); global scales 1. Finite values."""
    g = torch.Generator().manual_seed(5)
    wp = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    edge = [0, 1, 2, 126, 127, 128, 140] if fmt == "mxfp4" else [1, 2, 3, 7, 0, 0x38, 0x7E]
    pick = torch.randint(0, len(edge), (e, n, k // BLOCK[fmt]), generator=g)
    ws = torch.tensor(edge, dtype=torch.uint8)[pick]
    wg = torch.ones(e) if fmt == "nvfp4" else None
    return wp, ws, wg


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("device", DEVICES)
def test_one_hot_rows_give_the_weights_exactly(fmt, device):
    """a = one-hot rows (row r selects K column r): out[r, n] = w[e, n, r], so every dequantized weight (every code,
    edge scales, the subnormal products of E8M0 0 / E4M3 subnormals) is checked bit for bit."""
    e, n, k = 2, 64, 256
    wp, ws, wg = _edge_weights(fmt, e, n, k, device)
    w32 = (ref.mxfp4_weight_dequantize(wp, ws) if fmt == "mxfp4"
           else ref.nvfp4_weight_dequantize(wp, ws, wg))  # (E, N, K) fp32
    # (E * K, K): expert x's rows x*K .. x*K+K-1; 2^20 keeps the fp32 sums of the smallest weights (2^-128 for E8M0
    # 0) out of fp32's subnormals, so the MMA's handling of those is not what this checks
    a = (torch.eye(k) * 2.0 ** 20).repeat(e, 1).bfloat16()
    mi = torch.arange(e, dtype=torch.int32).repeat_interleave(k)
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    dev = lambda t: None if t is None else t.to(device)
    got = ops.moe_gemm_fp4_prepacked(dev(a), dev(vals), dev(scales), fmt=fmt, w_global=dev(wg), m_indices=dev(mi),
                                     backend="triton")
    want = (w32.transpose(1, 2).reshape(e * k, n) * 2.0 ** 20 + 0.0).bfloat16()  # a sum of +-0 products: +0
    assert_same_bytes(got.cpu(), want, f"{fmt} one-hot rows")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_nan_scales_and_tiles_spanning_experts(fmt):
    """NaN scale bytes (E8M0 0xFF, E4M3 0x7F) give NaN outputs where the reference has them; a contiguous tile whose
    rows span several experts (ids 0, 2, -1, 1 in one 16-row tile) runs one pass per expert."""
    case = _contig_case(3, [0] * 3 + [2] * 5 + [-1] * 2 + [1] * 6 + [0] * 4, k=256, n=64)
    wp, ws, wg = _linear_weights(fmt, case.w32)
    ws = ws.clone()
    ws[1, 5, 2] = 0xFF if fmt == "mxfp4" else 0x7F
    a = _poison_rows(case.x.bfloat16(), case.dead)
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    got = tri.moe_gemm_fp4_prepacked(a, vals, scales, wg, fmt, case.m_indices, None,
                                     config=MoeGemmConfig(16, 64, 128, 1, 4, 1))
    want = (ref.moe_gemm_mxfp4(a, wp, ws, case.m_indices, None) if fmt == "mxfp4"
            else ref.moe_gemm_nvfp4(a, wp, ws, wg, case.m_indices, None))
    assert torch.isnan(want.float()).any()
    assert_close(got, want, f"{fmt} NaN scale")


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_expert_slots(fmt):
    """expert_slots: a contiguous 16-row tile holding experts 0, 2, (padding), 1 and 0 again (a second run of 0) and
    a tile of one expert: with 2, 3 and 5 slots (fewer, as many and more slots than experts in the tile) the same
    bytes as one slot, the padding rows 0 and the row weights applied once; GEMM1 + SwiGLU and the scatter of the
    combine too; refused on the masked layout, below 1 and by the linear-layout kernels' config check."""
    case = _contig_case(3, [0] * 3 + [2] * 5 + [-1] * 2 + [1] * 4 + [0] * 2 + [1] * 16, k=256, n=64,
                        row_weights=True)
    weights = _linear_weights(fmt, case.w32)
    base = MoeGemmConfig(16, 32, 128, 1, 4, 1)
    want, _ = _run(fmt, case, config=base, weights=weights)
    for slots in (2, 3, 5):
        got = _check(fmt, case, config=dataclasses.replace(base, expert_slots=slots), weights=weights)
        assert_same_bytes(got, want, f"{fmt} expert_slots={slots}")
    wp, ws, wg = weights
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    a = _poison_rows(case.x.bfloat16(), case.dead)
    swiglu = lambda cfg: tri.moe_gemm_swiglu_fp4_prepacked(a, vals, scales, wg, fmt, case.m_indices, None, False,
                                                           "silu", 1.0, None, config=cfg)
    assert_same_bytes(swiglu(dataclasses.replace(base, expert_slots=3)), swiglu(base), f"{fmt} swiglu slots")
    rows = len(case.m_indices)  # each layout row to a slot of 16 tokens x top-2, in a shuffled order
    src = torch.randperm(rows, generator=torch.Generator().manual_seed(1)).int()
    inv = torch.empty(rows, dtype=torch.int32)
    inv[src.long()] = torch.arange(rows, dtype=torch.int32)
    topk = torch.rand(rows // 2, 2)
    combine = lambda cfg: tri.moe_gemm_combine_fp4_prepacked(a, vals, scales, wg, fmt, case.m_indices, None, src,
                                                             inv.view(rows // 2, 2), topk, None, torch.float32,
                                                             config=cfg)
    assert_same_bytes(combine(dataclasses.replace(base, expert_slots=2)), combine(base), f"{fmt} combine slots")
    masked = _gpu_decode_case(True, e=4, rows=4, n=32, k=256)
    with pytest.raises(ValueError, match="expert_slots > 1 is for the contiguous layout"):
        _run(fmt, masked, config=dataclasses.replace(base, expert_slots=2))
    with pytest.raises(ValueError, match="expert_slots=0 < 1"):
        _run(fmt, case, config=dataclasses.replace(base, expert_slots=0))
    # the linear-layout kernels have no slots, fold or register cap: their config check refuses them
    assert "prepacked FP4 kernel's option" in dataclasses.replace(base, expert_slots=2).refusal(fmt)
    assert "prepacked MXFP4 kernel's option" in dataclasses.replace(base, fold_scale="loop").refusal(fmt)
    assert "prepacked FP4 kernel's option" in dataclasses.replace(base, max_registers=168).refusal(fmt)
    with pytest.raises(ValueError, match="fold_scale='on' is none of"):
        _run(fmt, case, config=dataclasses.replace(base, fold_scale="on"))


def test_configs():
    """Larger K steps (a step past the row's last chunk: masked) and token tiles than the default, a partial last
    weight tile (N = 144: rows past N read clamped, never stored): the same results; configs the layout cannot run
    refused."""
    case = _contig_case(2, [0] * 20 + [1] * 12, k=160, n=144, row_weights=True)
    for cfg in (MoeGemmConfig(32, 64, 256, 1, 4, 1), MoeGemmConfig(16, 128, 128, 1, 4, 1),
                MoeGemmConfig(64, 64, 128, 1, 8, 1)):  # a prefill-style tile holding both experts
        _check("mxfp4", case, config=cfg)
    with pytest.raises(ValueError, match="multiple of the layout's 128"):
        _run("mxfp4", case, config=MoeGemmConfig(16, 64, 64, 1, 4, 1))
    for arch, fmt in itertools.product(("cpu", "sm_80", "sm_90", "sm_100", "sm_120"), ("mxfp4", "nvfp4")):
        for m in (1, 16, 17, 32, 64, 256):
            cfg = pick_prepacked_config_for_arch(m, 5760, 2880, arch, fmt)
            assert tri.prepacked_refusal(cfg) is None, (arch, m, cfg)
            assert cfg.block_m >= min(m, 64), (arch, m, cfg)
    # MXFP4 decode: the folded loop under the 168-register cap
    assert pick_prepacked_config_for_arch(16, 5760, 2880, "sm_90", "mxfp4") == MoeGemmConfig(
        16, 128, 128, 1, 4, 4, fold_scale="loop", max_registers=168)
    assert pick_prepacked_config_for_arch(32, 5760, 2880, "sm_90", "mxfp4") == MoeGemmConfig(32, 128, 128, 1, 4, 4)
    assert pick_prepacked_config_for_arch(16, 5760, 2880, "sm_90", "nvfp4") == MoeGemmConfig(16, 128, 128, 1, 4, 4)
    # expert slots: as many as the 16-token tile is expected to hold experts (contiguous layout, up to 4)
    for m, slots in ((1, 4), (4, 4), (5, 3), (8, 2), (9, 1), (24, 1)):
        assert pick_prepacked_config_for_arch(m, 5760, 2880, "sm_90", "mxfp4").expert_slots == slots, m
        assert pick_prepacked_config_for_arch(m, 5760, 2880, "sm_90", "mxfp4", masked=True).expert_slots == 1, m
    fast = dict(scale_words=True, fold_scale="tile", a_tma=True)
    assert pick_prepacked_config_for_arch(255, 5760, 2880, "sm_90", "mxfp4") == MoeGemmConfig(128, 128, 128, 1, 8, 3,
                                                                                              **fast)
    assert pick_prepacked_config_for_arch(255, 5760, 2880, "sm_90", "nvfp4") == MoeGemmConfig(128, 128, 128, 1, 8, 3,
                                                                                              a_tma=True)
    # GEMM1 + SwiGLU: the plain tile, 4 stages at the prefill tile
    prefill = pick_prepacked_config_for_arch(255, 5760, 2880, "sm_90", "mxfp4")
    assert prepacked_swiglu_config(prefill) == dataclasses.replace(prefill, num_stages=4)
    decode = pick_prepacked_config_for_arch(16, 5760, 2880, "sm_90", "mxfp4")
    assert prepacked_swiglu_config(decode) == decode


# ---------------------------------------------------------------------------------------------- GEMM2 + combine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("masked", [False, True])
def test_combine_prepacked_equals_the_chain(device, fmt, masked):
    """moe_gemm_combine_fp4_prepacked (GEMM2 rows scattered into token order, then the slot-order combine) against
    the chain moe_gemm_fp4_prepacked -> moe_combine on the same layout (exact operands: equal bytes), and against
    the contract; 20 tokens top-2 over 3 experts with one expert not local (-1 slots), a shared output, max_m 4
    (masked: entries dropped)."""
    from dispatch.ops import moe_align, moe_combine, moe_masked_layout
    from tests.test_moe_gemm_fused import _exact_operands
    g = torch.Generator().manual_seed(22)
    t, top_k, n, k = 20, 2, 80, 160
    ids = torch.stack([torch.randperm(4, generator=g)[:top_k] for _ in range(t)]).to(torch.int32)
    emap = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    if masked:
        lay = moe_masked_layout(ids, 3, 4, expert_map=emap, backend="torch")
        src, place = lay.src_rows, dict(masked_m=lay.masked_m)
        dead = torch.arange(4)[None, :] >= lay.masked_m[:, None]
    else:
        lay = moe_align(ids, 3, 16, expert_map=emap, backend="torch")
        src, place = lay.sorted_token_ids, dict(m_indices=lay.m_indices)
        dead = lay.m_indices < 0
    a, _, wp, ws, wg = _exact_operands(fmt, g, tuple(src.shape), dead, 3, n, k, "cpu")
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    tw = torch.rand(t, top_k, generator=g)
    shared = torch.randn(t, n, generator=g).bfloat16()
    d = lambda x: None if x is None else x.to(device)
    kw = dict(fmt=fmt, w_global=d(wg), **{key: d(v) for key, v in place.items()}, shared=d(shared),
              out_dtype=torch.float32, backend="triton")
    got = ops.moe_gemm_combine_fp4_prepacked(d(a), d(vals), d(scales), d(src), d(lay.inv_rows), d(tw), **kw)
    h = ops.moe_gemm_fp4_prepacked(d(a), d(vals), d(scales), fmt=fmt, w_global=d(wg), backend="triton",
                                   **{key: d(v) for key, v in place.items()})
    chain = moe_combine(h, d(lay.inv_rows), d(tw), shared=d(shared), out_dtype=torch.float32, backend="triton")
    assert_same_bytes(got, chain, f"{fmt} masked={masked}")
    want = ref.moe_gemm_combine_fp4_prepacked(a, vals, scales, wg, fmt, place.get("m_indices"),
                                              place.get("masked_m"), src, lay.inv_rows, tw, shared, torch.float32)
    # the GEMM rows are rounded to bf16 before the fp32 combine: bf16's tolerance
    assert_close(got.cpu(), want, f"{fmt} masked={masked} against the contract", dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------- bad inputs


def test_bad_inputs():
    """Linear weights passed as prepacked, shapes for another K, wrong format / global scale: named errors."""
    a = torch.randn(4, 640).bfloat16()  # K = 640: the MXFP4 / NVFP4 scale rows differ (32 / 48 B)
    mi = torch.zeros(4, dtype=torch.int32)
    wp, ws = quant_w_mxfp4(torch.randn(2, 64, 640))
    ws = ws.view(torch.uint8)
    vals, scales = ops.moe_gemm_fp4_prepack(wp, ws, "mxfp4")
    call = lambda *args, **kw: ops.moe_gemm_fp4_prepacked(*args, m_indices=mi, **kw)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_fp4_prepacked: argument 'w_values': dtype uint8: expected "
                                               r"the int32 words"):
        call(a, wp, ws, fmt="mxfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'w_values': expected prepacked shape \(2, 64, 80\) for "
                                               r"K=640"):
        call(a, vals[:, :, :32].contiguous(), scales, fmt="mxfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'w_scales': expected prepacked nvfp4 scale shape "
                                               r"\(2, 64, 48\) for K=640"):
        call(a, vals, scales, fmt="nvfp4", w_global=torch.ones(2))
    with pytest.raises(LowbitInputError, match=r"argument 'w_scales': expected prepacked mxfp4 scale shape"):
        call(a, vals, ws, fmt="mxfp4")  # the linear scales (K/32 = 20 per row) where 32 are expected
    with pytest.raises(LowbitInputError, match=r"argument 'fmt': expected one of"):
        call(a, vals, scales, fmt="fp4")
    with pytest.raises(LowbitInputError, match=r"argument 'w_global': MXFP4 weights have no global scale"):
        call(a, vals, scales, fmt="mxfp4", w_global=torch.ones(2))
    with pytest.raises(LowbitInputError, match=r"argument 'a': dtype float16"):
        call(a.half(), vals, scales, fmt="mxfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'w_values': must be contiguous"):
        call(a, vals.transpose(0, 1).contiguous().transpose(0, 1), scales, fmt="mxfp4")
    with pytest.raises(LowbitInputError, match=r"moe_gemm_fp4_prepack: argument 'w_scale': expected shape "
                                               r"\(2, 64, 20\)"):
        ops.moe_gemm_fp4_prepack(wp, ws[:, :, :10], "mxfp4")
    with pytest.raises(LowbitInputError, match=r"moe_gemm_fp4_prepack: argument 'fmt'"):
        ops.moe_gemm_fp4_prepack(wp, ws, "int4")
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_fp4_prepacked: argument 'interleave': I = 32 is "
                                               r"not a multiple of the granularity 3"):
        ops.moe_gemm_swiglu_fp4_prepacked(a, vals, scales, fmt="mxfp4", m_indices=mi, interleave=3)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_fp4_prepacked: argument 'w_values': expected "
                                               r"prepacked shape"):
        ops.moe_gemm_swiglu_fp4_prepacked(a, vals[:, :, :32].contiguous(), scales, fmt="mxfp4", m_indices=mi)
    src, inv, tw = torch.arange(4, dtype=torch.int32), torch.arange(4, dtype=torch.int32)[:, None], torch.ones(4, 1)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_combine_fp4_prepacked: argument 'shared': expected shape "
                                               r"\(4, 64\)"):
        ops.moe_gemm_combine_fp4_prepacked(a, vals, scales, src, inv, tw, fmt="mxfp4", m_indices=mi,
                                           shared=torch.zeros(4, 32))
    nv_s = torch.zeros(2, 64, 40, dtype=torch.uint8)
    nv_vals, nv_scales = ops.moe_gemm_fp4_prepack(wp, nv_s, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'w_global': NVFP4 weights need"):
        call(a, nv_vals, nv_scales, fmt="nvfp4")


def test_opcheck_and_compile():
    """Schema, fakes and autograd registration of both ops; the prepacked GEMM inside torch.compile(fullgraph)."""
    wp, ws = quant_w_mxfp4(torch.randn(2, 64, 128))
    ws = ws.view(torch.uint8)
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_fp4_prepack, (wp, ws, "mxfp4", "torch"))
    vals, scales = ops.moe_gemm_fp4_prepack(wp, ws, "mxfp4")
    a = torch.randn(8, 128).bfloat16()
    mi = torch.tensor([0] * 5 + [1] * 3, dtype=torch.int32)
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_fp4_prepacked,
                          (a, vals, scales, None, "mxfp4", mi, None, None, "torch"))
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_swiglu_fp4_prepacked,
                          (a, vals[:, :32].contiguous(), scales[:, :32].contiguous(), None, "mxfp4", mi, None, 1,
                           "gptoss", 1.702, 7.0, "torch"))
    rows = torch.arange(8, dtype=torch.int32)
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_combine_fp4_prepacked,
                          (a, vals, scales, None, "mxfp4", mi, None, rows, rows[:, None], torch.ones(8, 1), None,
                           torch.bfloat16, "torch"))
    f = lambda a, v, s, mi: ops.moe_gemm_fp4_prepacked(a, v, s, fmt="mxfp4", m_indices=mi, backend="torch")
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(a, vals, scales, mi)
    assert_same_bytes(got, f(a, vals, scales, mi), "compiled")


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_decode_case(masked: bool, e=16, rows=16, n=1024, k=2880):
    """Decode: `rows` tokens per expert (GPT-OSS K = 2880: 22.5 chunks of 128), random weights."""
    g = torch.Generator().manual_seed(11)
    w32 = torch.randn(e, n, k, generator=g) * 0.05
    if masked:
        mm = torch.tensor([rows, 0, rows // 2, rows + 3] * (e // 4), dtype=torch.int32)
        x = torch.randn(e, rows, k, generator=g)
        dead = torch.arange(rows)[None, :] >= mm.clamp(0, rows)[:, None]
        return Case("mxfp4", x, dead, None, mm, w32, None, f"masked decode E={e} max_m={rows}")
    mi = torch.arange(e, dtype=torch.int32).repeat_interleave(rows)
    mi[5] = -1
    x = torch.randn(mi.numel(), k, generator=g)
    rw = torch.rand(mi.numel(), generator=g)
    return Case("mxfp4", x, (mi < 0), mi, None, w32, rw, f"contiguous decode E={e} rows={rows}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_decode_matches_reference_and_old_kernel(fmt, masked):
    """GPT-OSS K at decode (16 tokens per expert), both layouts, row weights (contiguous): against the contract, and
    close to the linear-layout kernel's output on the same GPU (fp32 sums in another order)."""
    _check_gpu_against_old_kernel(fmt, _gpu_decode_case(masked))


def _check_gpu_against_old_kernel(fmt, case):
    """The prepacked kernel on the GPU against the contract and the linear-layout kernel; the linear weights."""
    from triton_ops.moe_gemm import grouped
    wp, ws, wg = _linear_weights(fmt, case.w32)
    got = _check(fmt, case, device="cuda", weights=(wp, ws, wg))
    a = _poison_rows(case.x.bfloat16(), case.dead).cuda()
    ids = [None if t is None else t.cuda() for t in (case.m_indices, case.masked_m, case.row_weights)]
    old = (grouped.moe_gemm_mxfp4(a, wp.cuda(), ws.cuda(), *ids) if fmt == "mxfp4"
           else grouped.moe_gemm_nvfp4(a, wp.cuda(), ws.cuda(), wg.cuda(), *ids))
    assert_close(got, old, f"{fmt} {case.desc} against the linear-layout kernel")
    return wp, ws, wg


@pytest.mark.gpu
def test_gpu_nvfp4_fp16_and_tiles():
    """NVFP4 with fp16 activations (the fp16 bit trick) and the tile sweep's configs on a GPU."""
    case = _gpu_decode_case(False, e=8, rows=32, n=512)
    _check("nvfp4", case, torch.float16, device="cuda")
    for cfg in (MoeGemmConfig(16, 64, 128, 1, 4, 4), MoeGemmConfig(32, 128, 256, 1, 4, 3),
                MoeGemmConfig(16, 256, 128, 1, 8, 4), MoeGemmConfig(64, 128, 128, 1, 4, 3)):
        _check("mxfp4", case, device="cuda", config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_expert_slots(fmt):
    """Decode tiles of 16 tokens over experts of 8 rows (two experts a tile), one padding row: 2 and 3 expert slots
    give the bytes of one slot and match the contract."""
    case = _gpu_decode_case(False, e=16, rows=8)
    weights = _linear_weights(fmt, case.w32)
    base = MoeGemmConfig(16, 128, 128, 1, 4, 3)
    want, _ = _run(fmt, case, device="cuda", config=base, weights=weights)
    for slots in (2, 3):
        got = _check(fmt, case, device="cuda", config=dataclasses.replace(base, expert_slots=slots),
                     weights=weights)
        assert_same_bytes(got.cpu(), want.cpu(), f"{fmt} expert_slots={slots}")


PREFILL_TILES = [MoeGemmConfig(128, 128, 128, 1, 8, 4), MoeGemmConfig(128, 128, 128, 1, 8, 3),
                 MoeGemmConfig(128, 128, 128, 1, 8, 3, scale_words=True),
                 MoeGemmConfig(64, 128, 128, 1, 8, 4), MoeGemmConfig(128, 64, 128, 1, 4, 3),
                 MoeGemmConfig(128, 128, 256, 1, 8, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_prefill_tiles(fmt, masked):
    """Prefill (256 tokens per expert, GPT-OSS K): the rule's tile (128 tokens x 128 weight rows, 8 warps) and the
    sweep's against the contract and the linear-layout kernel; contiguous rows not aligned to the tile (experts of
    96 / 256 / 160 rows: 128-token tiles holding two experts, one pass each)."""
    case = _gpu_decode_case(masked, e=4, rows=256, n=512)
    wp, ws, wg = _check_gpu_against_old_kernel(fmt, case)
    for cfg in PREFILL_TILES:
        _check(fmt, case, device="cuda", config=cfg, weights=(wp, ws, wg))
    if not masked:
        shifted = _contig_case(3, [0] * 96 + [1] * 256 + [2] * 160, k=2880, n=256, row_weights=True)
        _check(fmt, shifted, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_gpu_prefill_variants_same_bytes(fmt):
    """GPT-OSS K at prefill (4 experts x 256 rows, N 512): the rule (scale_words, MXFP4 per-tile fold) and every
    variant give the bytes of the plain 128 x 128 tile; MXFP4 scale bytes above 128 in the rows of one weight tile
    (that tile runs the unfolded loop) and in none; the tokens by TMA on both layouts."""
    for masked in (False, True):
        case = _gpu_decode_case(masked, e=4, rows=256, n=512)
        _check(fmt, case, device="cuda", config=MoeGemmConfig(128, 128, 128, 1, 8, 3, a_tma=True, scale_words=True))
    case = _gpu_decode_case(False, e=4, rows=256, n=512)
    wp, ws, wg = _linear_weights(fmt, case.w32)
    plain = MoeGemmConfig(128, 128, 128, 1, 8, 3)
    variants = [None, dataclasses.replace(plain, scale_words=True), dataclasses.replace(plain, a_tma=True),
                dataclasses.replace(plain, a_tma=True, scale_words=True)]
    if fmt == "mxfp4":
        variants += [dataclasses.replace(plain, fold_scale="tile", scale_words=w) for w in (False, True)]
    for big in ((False, True) if fmt == "mxfp4" else (False,)):
        if big:
            ws = ws.clone()
            ws[1, 130:140, :5] = 140  # rows of the second weight tile of expert 1
        want, _ = _run(fmt, case, device="cuda", config=plain, weights=(wp, ws, wg))
        for cfg in variants:
            got, _ = _run(fmt, case, device="cuda", config=cfg, weights=(wp, ws, wg))
            assert_same_bytes(got, want, f"{fmt} big={big} {cfg}")


@pytest.mark.gpu
def test_gpu_cuda_graph():
    """Captured in a CUDA graph and replayed: the same bytes as eager."""
    from tests.helpers import assert_graph_replay_matches_eager
    case = _gpu_decode_case(True, e=8, n=512)
    wp, ws, _ = _linear_weights("mxfp4", case.w32)
    vals, scales = ops.moe_gemm_fp4_prepack(wp.cuda(), ws.cuda(), "mxfp4")
    a, mm = case.x.bfloat16().cuda(), case.masked_m.cuda()
    assert_graph_replay_matches_eager(
        lambda: ops.moe_gemm_fp4_prepacked(a, vals, scales, fmt="mxfp4", masked_m=mm), "prepacked graph")


# ---------------------------------------------------------------------------------------------- sm_90 compile

_COMPILE = textwrap.dedent("""
    import os, re, subprocess, tempfile
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton_ops.moe_gemm import prepacked as P
    from triton_ops.moe_gemm.config import MoeGemmConfig, pick_prepacked_config_for_arch

    kern = P._fp4_prepacked_kernel
    LINE = re.compile(r"/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")

    def k_loop(sass):  # (instructions, HMUL2, spills) of the innermost loop holding HGMMA (a backward branch's body)
        ins = [(int(a, 16), op, rest) for a, op, rest in LINE.findall(sass)]
        best = None
        for addr, op, rest in ins:
            m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
            if m and int(m.group(1), 16) < addr:
                body = [o for a, o, _ in ins if int(m.group(1), 16) <= a <= addr]
                if any(o.startswith("HGMMA") for o in body) and (best is None or len(body) < len(best)):
                    best = body
        return len(best), sum(o.startswith("HMUL2") for o in best), sum(o in ("STL", "LDL") for o in best)

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    print("triton", triton.__version__)
    # decode (16 tokens per expert), mid (64) and prefill (256) tiles of the rule; GEMM1 + SwiGLU (GPT-OSS, the
    # plain GEMM's tiles) and GEMM2 scattered into token order (scatter); the plain prefill tile (m = the config)
    for m, nv, dt, masked, sw, scatter in (
            (16, False, "bf16", False, False, False), (16, True, "fp16", True, False, False),
            (64, False, "bf16", False, False, False), (256, False, "bf16", False, False, False),
            (256, True, "bf16", False, False, False), (16, False, "bf16", False, True, False),
            (256, False, "bf16", False, True, False), (16, False, "bf16", True, False, True),
            (256, True, "bf16", False, False, True), (16, True, "bf16", False, False, False),
            (16, True, "bf16", False, True, False), (256, True, "bf16", False, True, False),
            (MoeGemmConfig(128, 128, 128, num_warps=8, num_stages=3, group_m=1), False, "bf16", False, False, False),
            (MoeGemmConfig(128, 128, 128, num_warps=8, num_stages=3, group_m=1), True, "bf16", False, False, False)):
        if isinstance(m, int):
            cfg = pick_prepacked_config_for_arch(m, 5760, 2880, "sm_90", "nvfp4" if nv else "mxfp4")
        else:
            cfg, m = m, "plain"
        names = [p.name for p in kern.params]
        sig = {p.name: "i32" for p in kern.params if not p.is_constexpr}
        a = "*bf16" if dt == "bf16" else "*fp16"
        sig.update(a_ptr=a, v_ptr="*i32", s_ptr="*u8", g_ptr="*fp32", ids_ptr="*i32", rw_ptr="*fp32", out_ptr=a,
                   dst_ptr="*i32", alpha="fp32", limit="fp32")
        consts = dict(NVFP4=nv, MASKED=masked, HAS_RW=False, DTYPE=tl.bfloat16 if dt == "bf16" else tl.float16,
                      F32_DOT=False, EMULATE=False, SWIGLU=sw, INTERLEAVE=1 if sw else 0, GPTOSS=sw, CLAMP=sw,
                      DIV_RN=False, SCATTER=scatter, BLOCK_W=cfg.block_n, BLOCK_T=cfg.block_m, BLOCK_K=cfg.block_k,
                      SCALES_AS_WORDS=cfg.scale_words, FOLD_MX=P._FOLD_MX[cfg.fold_scale], A_DESC=cfg.a_tma,
                      SLOTS=cfg.expert_slots)
        sig.update(dict.fromkeys(consts, "constexpr"))
        if cfg.a_tma:  # the tokens through a host tensor descriptor, as the launcher passes them
            sig["a_ptr"] = f"tensordesc<{dt}[{cfg.block_m},{cfg.block_k}]>"
        aligned = ["v_ptr", "s_ptr", "out_ptr", "K", "N", "KW", "KS", "stride_am", "stride_ae"]
        aligned += [] if cfg.a_tma else ["a_ptr"]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        c = triton.compile(triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {})))
        ptx = c.asm["ptx"]
        assert ("cp.async.bulk.tensor" in ptx) == cfg.a_tma, (m, cfg)  # the tokens by TMA exactly where asked
        # register A: `wgmma... {acc}, {a regs}, b_desc, ...` (a shared A would be a 64-bit descriptor)
        wgmma_a = r"wgmma\\.mma_async\\.sync\\.aligned\\.m64n\\d+k16\\.f32\\.\\w+\\.\\w+ \\{[^}]*\\}, (\\{|%rd)"
        reg_a = [op for op in re.findall(wgmma_a, ptx) if op == "{"]
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(c.asm["cubin"])
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", f.name], capture_output=True,
                              text=True).stdout
        # SASS: register A `HGMMA... R, R, gdesc[..]` (a shared A would be `HGMMA... R, gdesc[..], R`)
        hgmma_reg_a = len(re.findall(r"HGMMA\\.64x\\d+x16\\.F32\\S* R\\d+, R\\d+, gdesc", sass))
        spills = len(re.findall(r"\\b(?:STL|LDL)\\b", sass))
        vec16 = sass.count("LDGSTS.E.BYPASS.128")
        loop, hmul2, loop_spills = k_loop(sass)
        # registers per thread; shared-memory stores (STS / STSM); layout conversions of fp32 values (TTGIR)
        regs = re.search(r"REG:(\\d+)", subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage", f.name],
                                                      capture_output=True, text=True).stdout).group(1)
        os.unlink(f.name)
        sts = len(re.findall(r"\\bSTSM?[. ]", sass))
        cvt32 = len(re.findall(r"ttg\\.convert_layout [^\\n]*xf32", c.asm["ttgir"]))
        print("cfg", f"{dt}/m={m}/swiglu={int(sw)}/scatter={int(scatter)}", int(nv), ptx.count("wgmma.mma_async"),
              len(reg_a), hgmma_reg_a, spills, vec16, ptx.count("fma.rn.bf16x2") + ptx.count("fma.rn.f16x2"),
              c.metadata.shared, loop, hmul2, regs, sts, cvt32, cfg.block_n, cfg.block_k, loop_spills,
              cfg.max_registers)
""")


def _triton36_env_set() -> bool:
    import triton
    return bool(os.environ.get("LOWBIT_TRITON36_PATH")) or triton.__version__.startswith("3.6")


@pytest.mark.slow  # sm_90 SASS properties of a kernel the GPU suite runs: the slow run
def test_sm90_compile_register_a_wgmma():
    """sm_90a with Triton 3.6 (the GPU image's; LOWBIT_TRITON36_PATH points at an install elsewhere), the rule's
    decode tiles (MXFP4 bf16 contiguous, NVFP4 fp16 masked), its mid tile, its prefill tile (8 warps; MXFP4 and
    NVFP4), the GEMM1 + SwiGLU tiles (the plain rule's decode and prefill tiles, MXFP4 and NVFP4) and the
    token-order scatter (GEMM2 + combine) and the plain prefill tile: every MMA is a warpgroup MMA whose A operand
    (the dequantized weights) is registers (PTX `{...}` operand, SASS `HGMMA ... R, gdesc`); the weights arrive by
    16-byte async copies, the conversion is packed fma.rn.{bf16,f16}x2, no spills (a tile under a register cap:
    none in the K loop, at most 8 spill instructions outside it, once per tile), shared memory within an SM. The
    MXFP4 decode rule: the folded loop (64 packed multiplies per 128-K step) in at most 168 registers. The one-pass
    SwiGLU tile against the plain GEMM's tile of the same config: the same K loop (instruction count within 4, the same
    packed multiplies), no more registers than it (+8), no layout conversion of the fp32 accumulator (the gate / up
    split is register relabelling) and no more shared-memory stores (only the transposed output store's)."""
    if not _triton36_env_set():
        pytest.skip("set LOWBIT_TRITON36_PATH to a Triton 3.6 install to compile for sm_90")
    script = _COMPILE
    path = os.environ.get("LOWBIT_TRITON36_PATH")
    if path:
        script = f"import sys; sys.path.insert(0, {path!r})\n" + script
    out = run_compile_script(script, timeout=600)
    assert "triton 3.6" in out, out
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("cfg")]
    assert len(lines) == 14, out
    loops, epi = {}, {}
    for _, dt, nv, wgmma, reg_a, hgmma_reg_a, spills, vec16, fma, shared, loop, hmul2, *rest in lines:
        loops[dt, nv] = int(loop), int(hmul2)
        regs, sts, cvt32, bn, bk, loop_spills, cap = map(int, rest)
        epi[dt, nv] = regs, sts, cvt32, (bn, bk)
        what = f"{dt} nvfp4={nv}"
        assert int(wgmma) > 0 and int(reg_a) == int(wgmma), f"{what}: {reg_a} of {wgmma} wgmma with register A"
        assert int(hgmma_reg_a) > 0, f"{what}: no HGMMA with a register A operand in the SASS"
        assert loop_spills == 0 and int(spills) <= (8 if cap else 0), f"{what}: {spills} local-memory spills"
        assert int(vec16) > 0, f"{what}: no 16-byte async copies"
        assert int(fma) >= 8, f"{what}: the packed conversion is missing ({fma} fma.rn.*x2)"
        assert int(shared) <= 232448, f"{what}: {shared} B of shared memory"
    # the prefill rule's K loop (one 128-K step, per thread) against the plain tile: MXFP4 one multiply per pair
    # (the per-tile fold) and no scale layout conversion; NVFP4 the tokens by TMA (no more instructions)
    rule_mx, rule_nv = loops["bf16/m=256/swiglu=0/scatter=0", "0"], loops["bf16/m=256/swiglu=0/scatter=0", "1"]
    plain_mx, plain_nv = loops["bf16/m=plain/swiglu=0/scatter=0", "0"], loops["bf16/m=plain/swiglu=0/scatter=0", "1"]
    assert plain_mx[1] == 64 and rule_mx[1] == 32, (rule_mx, plain_mx)
    assert rule_mx[0] <= 0.85 * plain_mx[0], (rule_mx, plain_mx)
    assert rule_nv[0] <= plain_nv[0], (rule_nv, plain_nv)
    # the MXFP4 decode rule: the folded loop (one multiply per pair) in 168 registers: 3 CTAs of 4 warps per SM
    dec_mx = loops["bf16/m=16/swiglu=0/scatter=0", "0"]
    assert dec_mx[1] == 64 and dec_mx[0] <= 0.85 * 526, dec_mx
    assert epi["bf16/m=16/swiglu=0/scatter=0", "0"][0] <= 168, epi["bf16/m=16/swiglu=0/scatter=0", "0"]
    for m, nv in (("16", "0"), ("16", "1"), ("256", "0"), ("256", "1")):
        plain, fused = f"bf16/m={m}/swiglu=0/scatter=0", f"bf16/m={m}/swiglu=1/scatter=0"
        (p_loop, p_mul), (f_loop, f_mul) = loops[plain, nv], loops[fused, nv]
        (p_regs, p_sts, _, p_tile), (f_regs, f_sts, f_cvt, f_tile) = epi[plain, nv], epi[fused, nv]
        what = (f"SwiGLU m={m} nvfp4={nv} (registers, shared stores, fp32 conversions, tile; loop, HMUL2): "
                f"{epi[fused, nv]} {loops[fused, nv]}, plain {epi[plain, nv]} {loops[plain, nv]}")
        assert f_tile == p_tile and abs(f_loop - p_loop) <= 4 and f_mul == p_mul, what
        assert f_regs <= p_regs + 8 and f_cvt == 0 and f_sts <= p_sts, what


# ---------------------------------------------------------------------------------------------- kernel variants


def _variant_configs(fmt: str, base: MoeGemmConfig):
    """The variants of `base` for `fmt`: scale bytes in the words' shape, the tokens by descriptor, and (MXFP4) the
    per-tile folded multiply."""
    out = [dataclasses.replace(base, scale_words=True), dataclasses.replace(base, a_tma=True)]
    if fmt == "mxfp4":
        out += [dataclasses.replace(base, fold_scale=f, scale_words=w, a_tma=t)
                for w, t in ((False, False), (True, False), (False, True)) for f in ("tile", "loop")]
    return out


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.slow), *DEVICES[1:]])  # cpu: slow run
def test_variants_give_the_same_bytes(fmt, device):
    """scale_words / a_tma / fold_scale against the default kernel: equal bytes (the same exact products, summed in
    the same order): one-hot rows (every code, the edge scales; <= 128 so every tile folds, then tiles with larger
    ones), 128- and 256-K steps (the masked step), and quantized weights at K 160 (a padded chunk,
    a partial K step)."""
    e, n, k = 2, 64, 256
    wp, ws, wg = _edge_weights(fmt, e, n, k, device)
    if fmt == "mxfp4":
        ws = ws.clamp(max=FP.FOLD_MAX_SCALE)
    a = (torch.eye(k) * 2.0 ** 20).repeat(e, 1).bfloat16()
    mi = torch.arange(e, dtype=torch.int32).repeat_interleave(k)
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    dev = lambda t: None if t is None else t.to(device)
    run = lambda cfg, a=a, mi=mi, vals=vals, scales=scales, wg=wg: tri.moe_gemm_fp4_prepacked(
        dev(a), dev(vals), dev(scales), dev(wg), fmt, dev(mi), None, config=cfg).cpu()
    for base in (MoeGemmConfig(16, 64, 128, 1, 4, 1), MoeGemmConfig(32, 64, 256, 1, 4, 1)):
        want = run(base)
        for cfg in _variant_configs(fmt, base):
            assert_same_bytes(run(cfg), want, f"{fmt} one-hot {cfg}")
    if fmt == "mxfp4":  # scale bytes above 128 in the rows of some tiles only: those run the unfolded loop
        wp, ws, wg = _edge_weights(fmt, e, n, k, device)
        ws[0, :32] = ws[0, :32].clamp(max=FP.FOLD_MAX_SCALE)
        assert int(ws.max()) > FP.FOLD_MAX_SCALE
        vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
        run = lambda cfg, a=a, mi=mi, vals=vals, scales=scales: tri.moe_gemm_fp4_prepacked(
            dev(a), dev(vals), dev(scales), None, fmt, dev(mi), None, config=cfg).cpu()
        base = MoeGemmConfig(16, 32, 128, 1, 4, 1)
        want = run(base)
        for cfg in (dataclasses.replace(base, fold_scale=f, scale_words=w) for f in ("tile", "loop") for w in (0, 1)):
            assert_same_bytes(run(cfg), want, f"{fmt} one-hot, scales > 128 in some tiles, {cfg}")
    case = _contig_case(2, [0] * 20 + [1] * 12, k=160, n=80, row_weights=True)
    weights = _linear_weights(fmt, case.w32)
    if fmt == "mxfp4":
        assert int(weights[1].max()) <= FP.FOLD_MAX_SCALE  # every tile folds
    base = MoeGemmConfig(16, 64, 128, 1, 4, 1)
    want, _ = _run(fmt, case, device=device, config=base, weights=weights)
    for cfg in _variant_configs(fmt, base):
        got = _check(fmt, case, device=device, config=cfg, weights=weights)
        assert_same_bytes(got.cpu(), want.cpu(), f"{fmt} {case.desc} {cfg}")


def test_fold_in_loop_redoes_the_tiles_past_128():
    """fold_scale="loop" (interpreter): one-hot rows whose scale bytes reach 255 in some tiles (those tiles' folded
    sums are not finite and are redone with two multiplies; NaN scales included) give the default kernel's bytes;
    so do tiles whose tokens hold inf (their redo gives the same inf / NaN)."""
    e, n, k = 2, 32, 128
    wp, ws, _ = _edge_weights("mxfp4", e, n, k, "cpu")
    ws[0, :16] = ws[0, :16].clamp(max=FP.FOLD_MAX_SCALE)
    ws[1, 20, 2] = 255  # NaN
    assert int(ws.max()) > FP.FOLD_MAX_SCALE
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, "mxfp4")
    a = (torch.eye(k) * 2.0 ** 20).repeat(e, 1).bfloat16()
    a[3, 5] = float("inf")
    mi = torch.arange(e, dtype=torch.int32).repeat_interleave(k)
    base = MoeGemmConfig(16, 16, 128, 1, 4, 1)
    run = lambda cfg: tri.moe_gemm_fp4_prepacked(a, vals, scales, None, "mxfp4", mi, None, config=cfg)
    want = run(base)
    assert not want.isfinite().all()
    assert_same_bytes(run(dataclasses.replace(base, fold_scale="loop")), want, "fold in the loop, scales past 128")


@settings(max_examples=examples(6))
@given(case=cases("mxfp4"), nvfp4=st.booleans())
def test_fast_variants_match_reference(case, nvfp4):
    """Interpreter: the tokens by tensor descriptor (rows outside the tile's expert, NaN-poisoned dead rows and rows
    past the tensor loaded as they are, never stored), scale_words and the per-tile fold on both layouts against the
    contract."""
    fmt = "nvfp4" if nvfp4 else "mxfp4"
    cfg = MoeGemmConfig(16, 64, 128, 1, 4, 1, scale_words=True, a_tma=True, fold_scale="off" if nvfp4 else "tile")
    _check(fmt, case, config=cfg)


def test_fold_scale_refusals():
    """fold_scale is MXFP4 only."""
    case = _contig_case(1, [0] * 4, k=128, n=16)
    with pytest.raises(ValueError, match="fold_scale is for MXFP4"):
        _run("nvfp4", case, config=MoeGemmConfig(16, 16, 128, 1, 4, 1, fold_scale="tile"))
