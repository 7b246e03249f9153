"""MoE grouped GEMMs (triton_ops/moe_gemm) against dispatch/reference/moe_gemm.py: bf16/fp16, FP8 W8A8 block-scaled,
MXFP4 W4A16 / W4A8 / W4A4 and NVFP4 W4A16, contiguous (moe_align's m_indices) and masked (masked_m) layouts, fused row
weights. NVFP4's own edges, dispatch and input checks: tests/test_moe_gemm_nvfp4.py.

Inputs the kernels must not read are poisoned: padding / uncomputed rows of a hold NaN (codes and scales too), and
outputs come from torch.empty (NaN under the conftest poison), so a row the kernel forgets to zero fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.reference import moe_gemm as ref
from dispatch.reference.formats import e4m3_encode
from dispatch.reference.moe import moe_align
from dispatch.reference.quant import fp8_group_quantize, mxfp4_quantize, nvfp4_quantize
from tests.helpers import assert_close, examples
from triton_ops.contract.checks import LowbitInputError
from triton_ops.moe_gemm import grouped as tri
from triton_ops.moe_gemm.config import MoeGemmConfig, pick_config, pick_config_for_arch


def assert_close_normalized(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The shared normalized-error rule (tests/helpers.assert_close) with the output dtype's tolerance."""
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert_close(got, want, what)


# ---------------------------------------------------------------------------------------------- operands


def quant_w_fp8(w: torch.Tensor):
    """fp32 (E, N, K) -> E4M3 codes and fp32 128x128 block scales (E, ceil(N/128), K/128), amax / 448."""
    e, n, k = w.shape
    nb = -(-n // 128)
    wp = torch.zeros(e, nb * 128, k, device=w.device)
    wp[:, :n] = w
    blk = wp.view(e, nb, 128, k // 128, 128)
    s = blk.abs().amax((2, 4)).clamp(min=1e-10) / 448
    codes = e4m3_encode(blk / s[:, :, None, :, None]).reshape(e, nb * 128, k)[:, :n].contiguous()
    return codes, s


def quant_w_mxfp4(w: torch.Tensor):
    """fp32 (E, N, K) -> E2M1 pairs (E, N, K/2) and E8M0 scales (E, N, K/32) (OCP floor rule)."""
    e, n, k = w.shape
    codes, scales = mxfp4_quantize(w.reshape(e * n, k), "floor", False)
    return codes.view(e, n, k // 2), scales.view(e, n, k // 32)


# E4M3 scale bytes written over quantized NVFP4 ones: subnormals (2^-9 .. 7 * 2^-9), zero, the largest finite (448)
SCALE_EDITS = {"subnormal": (0x01, 0x08), "zero": (0x00, 0x01), "max": (0x7E, 0x7F)}


def quant_w_nvfp4(w32: torch.Tensor, edit: str | None = None, seed: int = 0):
    """fp32 (E, N, K) -> (codes (E, N, K/2) uint8, scales (E, N, K/16) float8_e4m3fn, global (E,) fp32): each
    expert through nvfp4_quantize (its own computed global scale), stacked, so the layout is the one users get.
    edit: overwrite about a third of the block scales with that kind of E4M3 byte (SCALE_EDITS). Runs on w32's
    device (the quantizer is plain torch)."""
    qs = [nvfp4_quantize(w32[e], None, False) for e in range(w32.shape[0])]
    codes = torch.stack([q[0] for q in qs])
    scales = torch.stack([q[1] for q in qs])
    gs = torch.stack([q[2] for q in qs]).float()
    if edit is not None and scales.numel():
        g = torch.Generator().manual_seed(seed)
        lo, hi = SCALE_EDITS[edit]
        pick = (torch.rand(scales.shape, generator=g) < 1 / 3).to(scales.device)
        new = torch.randint(lo, hi, scales.shape, generator=g, dtype=torch.uint8).to(scales.device)
        s8 = scales.view(torch.uint8)
        s8[pick] = new[pick]
    return codes, scales, gs


def quant_a_fp8(x: torch.Tensor, column_major: bool):
    return fp8_group_quantize(x, 128, 1e-10, False, column_major)


def _poison_rows(t: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """NaN (codes 0x7F for fp8) in the rows the kernel must not read."""
    t = t.clone()
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8)[dead] = 0x7F
    else:
        t[dead] = float("nan")
    return t


@dataclasses.dataclass
class Case:
    """One grouped-GEMM problem: x fp32 activations in the layout, ids (m_indices or masked_m), weights w32."""

    kind: str
    x: torch.Tensor  # (M, K) or (E, max_m, K) fp32
    dead: torch.Tensor  # bool, rows that are not computed (poisoned)
    m_indices: torch.Tensor | None
    masked_m: torch.Tensor | None
    w32: torch.Tensor  # (E, N, K)
    row_weights: torch.Tensor | None
    desc: str

    def run(self, fn_tri, fn_ref, column_major: bool = False, dtype: torch.dtype = torch.bfloat16,
            edit: str | None = None, uint8_scales: bool = False, seed: int = 0, **kw):
        """(got, want) for this case in this kind. column_major: FP8 activation scales (fp8, w4a8). NVFP4: dtype of
        the activations, quant_w_nvfp4's scale edit and seed, uint8_scales (scales given as their uint8 codes)."""
        ids = (self.m_indices, self.masked_m)
        rw = dict(row_weights=self.row_weights)
        if self.kind == "nvfp4":  # the reference on the CPU
            wp, ws, wg = quant_w_nvfp4(self.w32, edit, seed)
            ws = ws.view(torch.uint8) if uint8_scales else ws
            a = _poison_rows(self.x.to(dtype), self.dead)
            cpu = lambda t: None if t is None else t.cpu()
            return fn_tri(a, wp, ws, wg, *ids, **rw, **kw), fn_ref(*map(cpu, (a, wp, ws, wg, *ids, self.row_weights)))
        if self.kind == "fp8":
            a, sa = quant_a_fp8(self.x, column_major)
            a = _poison_rows(a, self.dead)
            sa[self.dead] = float("nan")  # in place: keeps the column-major strides
            w, sw = quant_w_fp8(self.w32)
            return fn_tri(a, sa, w, sw, *ids, **rw, **kw), fn_ref(a, sa, w, sw, *ids, **rw)
        if self.kind == "w4a8":
            a, sa = quant_a_fp8(self.x, column_major)
            a = _poison_rows(a, self.dead)
            sa[self.dead] = float("nan")
            wp, ws = quant_w_mxfp4(self.w32)
            return fn_tri(a, sa, wp, ws, *ids, **rw, **kw), fn_ref(a, sa, wp, ws, *ids, **rw)
        if self.kind == "w4a4":
            k = self.x.shape[-1]
            ap, sa = mxfp4_quantize(self.x.reshape(-1, k), "floor", False)
            ap, sa = ap.view(*self.x.shape[:-1], k // 2).clone(), sa.view(*self.x.shape[:-1], k // 32).clone()
            ap[self.dead], sa[self.dead] = 0x77, 0xFF  # +-6 codes, NaN scales: rows that must not be read
            wp, ws = quant_w_mxfp4(self.w32)
            return fn_tri(ap, sa, wp, ws, *ids, **rw, **kw), fn_ref(ap, sa, wp, ws, *ids, **rw)
        if self.kind == "mxfp4":
            wp, ws = quant_w_mxfp4(self.w32)
            a = _poison_rows(self.x.bfloat16(), self.dead)
            return fn_tri(a, wp, ws, *ids, **rw, **kw), fn_ref(a, wp, ws, *ids, **rw)
        dt = torch.float16 if self.kind == "fp16" else torch.bfloat16
        a = _poison_rows(self.x.to(dt), self.dead)
        w = self.w32.to(dt)
        return fn_tri(a, w, *ids, **rw, **kw), fn_ref(a, w, *ids, **rw)


ENTRIES = {"bf16": (tri.moe_gemm_bf16, ref.moe_gemm_bf16), "fp16": (tri.moe_gemm_bf16, ref.moe_gemm_bf16),
           "fp8": (tri.moe_gemm_fp8, ref.moe_gemm_fp8), "mxfp4": (tri.moe_gemm_mxfp4, ref.moe_gemm_mxfp4),
           "w4a8": (tri.moe_gemm_w4a8, ref.moe_gemm_w4a8), "w4a4": (tri.moe_gemm_w4a4, ref.moe_gemm_w4a4),
           "nvfp4": (tri.moe_gemm_nvfp4, ref.moe_gemm_nvfp4)}
K_CHOICES = {"bf16": [128, 200, 256], "fp16": [128, 256], "fp8": [128, 256], "mxfp4": [128, 160, 256],
             "w4a8": [128, 256], "w4a4": [64, 160, 256], "nvfp4": [128, 160, 208]}


@st.composite
def cases(draw, kind: str):
    e = draw(st.integers(1, 4))
    n = draw(st.sampled_from([128, 144, 256]))
    k = draw(st.sampled_from(K_CHOICES[kind]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    w32 = torch.randn(e, n, k, generator=g) * 0.1
    masked = draw(st.booleans())
    if masked:
        max_m = draw(st.sampled_from([1, 8, 17, 40]))
        counts = [draw(st.sampled_from([0, 1, max_m // 2, max_m, max_m + 5, -3])) for _ in range(e)]
        masked_m = torch.tensor(counts, dtype=torch.int32)
        x = torch.randn(e, max_m, k, generator=g)
        dead = torch.arange(max_m)[None, :] >= masked_m.clamp(0, max_m)[:, None]
        m_indices, desc = None, f"masked E={e} max_m={max_m} counts={counts}"
        rw_shape = (e, max_m)
    else:
        t = draw(st.integers(0, 20))
        top_k = draw(st.integers(1, 2)) if e > 1 else 1
        dist = draw(st.sampled_from(["uniform", "one_expert", "skip_first"]))
        if dist == "uniform":
            ids = torch.rand(t, e, generator=g).argsort(-1)[:, :top_k].to(torch.int32)
        elif dist == "one_expert":  # every entry on the last expert (others get 0 rows)
            ids = torch.full((t, top_k), e - 1, dtype=torch.int32)
        else:  # expert 0 gets no rows
            ids = torch.randint(min(1, e - 1), e, (t, top_k), generator=g, dtype=torch.int32)
        block_m = draw(st.sampled_from([1, 8, 16, 32]))
        m_indices = moe_align(ids, None, e, block_m)[2].clone()
        bad = draw(st.sampled_from([0, 1, 3]))  # out-of-range ids on a few real rows: padding, rows -> 0
        if bad and m_indices.numel():
            pos = torch.randperm(m_indices.numel(), generator=g)[:bad]
            m_indices[pos] = torch.tensor([e, e + 7, -5], dtype=torch.int32)[: pos.numel()]
        x = torch.randn(m_indices.numel(), k, generator=g)
        dead = (m_indices < 0) | (m_indices >= e)
        masked_m, desc = None, f"contiguous E={e} T={t} k={top_k} {dist} bm={block_m} bad={bad}"
        rw_shape = (m_indices.numel(),)
    rw = torch.rand(rw_shape, generator=g) if draw(st.booleans()) else None
    return Case(kind, x, dead, m_indices, masked_m, w32, rw, f"{kind} {desc} N={n} K={k} rw={rw is not None}")


def _check(case: Case, **kw):
    fn_tri, fn_ref = ENTRIES[case.kind]
    got, want = case.run(fn_tri, fn_ref, **kw)
    assert_close_normalized(got, want, f"{case.desc} {kw}" if kw else case.desc)
    assert not torch.isnan(got.float()).any(), f"{case.desc}: NaN in the output (unwritten or poisoned rows)"
    dead_out = got[case.dead]
    assert torch.equal(dead_out, torch.zeros_like(dead_out)), f"{case.desc}: uncomputed rows are not zero"


# ---------------------------------------------------------------------------------------------- properties


@settings(max_examples=examples(25))
@given(case=cases("bf16"))
def test_bf16_matches_reference(case):
    _check(case)


@settings(max_examples=examples(6))
@given(case=cases("fp16"))
def test_fp16_matches_reference(case):
    _check(case)


@settings(max_examples=examples(20))
@given(case=cases("fp8"), column_major=st.booleans())
def test_fp8_matches_reference(case, column_major):
    _check(case, column_major=column_major)


@settings(max_examples=examples(16))
@given(case=cases("mxfp4"), dot_scaled=st.booleans())
def test_mxfp4_matches_reference(case, dot_scaled):
    _check(case, dot_scaled=dot_scaled)


@settings(max_examples=examples(12))
@given(case=cases("w4a8"), column_major=st.booleans())
def test_w4a8_matches_reference(case, column_major):
    _check(case, column_major=column_major)


@settings(max_examples=examples(12))
@given(case=cases("w4a4"))
def test_w4a4_matches_reference(case):
    _check(case)


@settings(max_examples=examples(20))
@given(case=cases("nvfp4"), fp16=st.booleans(), edit=st.sampled_from([None, "subnormal", "zero", "max"]),
       uint8_scales=st.booleans(), seed=st.integers(0, 2**16))
def test_nvfp4_matches_reference(case, fp16, edit, uint8_scales, seed):
    """bf16 / fp16 activations; E4M3 scales as quantized or with subnormal / zero / max bytes; scales given as
    float8_e4m3fn or as their uint8 codes."""
    _check(case, dtype=torch.float16 if fp16 else torch.bfloat16, edit=edit, uint8_scales=uint8_scales, seed=seed)


# ---------------------------------------------------------------------------------------------- edges


def _contig(e, ids_list, k=128, n=128):
    m_indices = torch.tensor(ids_list, dtype=torch.int32)
    x = torch.randn(len(ids_list), k)
    dead = (m_indices < 0) | (m_indices >= e)
    return m_indices, x, dead, torch.randn(e, n, k) * 0.1


@pytest.mark.parametrize("kind, dtype", [*((k, torch.bfloat16) for k in ("bf16", "fp8", "mxfp4", "w4a8", "w4a4",
                                                                         "nvfp4")), ("nvfp4", torch.float16)],
                         ids=["bf16", "fp8", "mxfp4", "w4a8", "w4a4", "nvfp4", "nvfp4-fp16"])
def test_tile_spanning_experts_with_row_weights(kind, dtype):
    """Unaligned rows (one tile holds four experts, padding and bad ids in between): one pass per expert. NVFP4: the
    experts' weights at magnitudes far apart (so are their global scales), bf16 and fp16 activations."""
    ids = [2, 0, 0, -1, 3, 3, 1, 9, 2, 2, -1, 0, 1, 1, 3, -4] * 2
    m_indices, x, dead, w32 = _contig(4, ids, k=256)
    kw = {}
    if kind == "nvfp4":
        w32 = w32 * torch.tensor([1.0, 100.0, 0.01, 3.0])[:, None, None]
        kw = dict(dtype=dtype)
    rw = torch.rand(len(ids))
    _check(Case(kind, x, dead, m_indices, None, w32, rw, f"{kind} mixed tile"),
           config=MoeGemmConfig(32, 64, 128, group_m=2, num_warps=4, num_stages=1), **kw)


@pytest.mark.parametrize("kind", ["bf16", "fp8", "mxfp4", "w4a8", "w4a4", "nvfp4"])
def test_all_padding_and_empty(kind):
    m_indices, x, dead, w32 = _contig(2, [-1] * 16 + [5] * 3)
    _check(Case(kind, x, dead, m_indices, None, w32, None, f"{kind} all padding"))
    m_indices, x, dead, w32 = _contig(2, [])
    _check(Case(kind, x, dead, m_indices, None, w32, None, f"{kind} no rows"))


def test_strided_operands():
    """a a row slice of a wider buffer, w every other expert of a larger stack (strides passed, no copies)."""
    e, n, k = 3, 128, 128
    m_indices = torch.tensor([0, 0, 1, 2, 2, 2, -1, 1], dtype=torch.int32)
    wide = torch.randn(8, k + 64).bfloat16()
    a = wide[:, :k]
    w = (torch.randn(2 * e, n, k) * 0.1).bfloat16()[::2]
    assert_close_normalized(tri.moe_gemm_bf16(a, w, m_indices, None), ref.moe_gemm_bf16(a, w, m_indices, None),
                            "strided")


@pytest.mark.parametrize("arch", ["cpu", "sm_80", "sm_89", "sm_90", "sm_100"])
def test_default_configs_are_valid(arch):
    """Every rule's pick runs its kind (fp8: BLOCK_K 128); decode picks small BLOCK_M, prefill 128."""
    for kind in ("bf16", "fp8", "mxfp4", "w4a8", "w4a4", "nvfp4"):
        for m in (1, 16, 32, 64, 128, 4096):
            cfg = pick_config_for_arch(kind, m, 4096, 7168, arch)
            assert cfg.refusal(kind) is None, (kind, m, cfg)
            if kind in ("fp8", "w4a8"):
                assert cfg.block_k == 128
        assert pick_config_for_arch(kind, 4, 4096, 7168, arch).block_m == 16
        if arch != "cpu":
            assert pick_config_for_arch(kind, 4096, 4096, 7168, arch).block_m == 128
    assert pick_config("bf16", 4, 256, 256, torch.device("cpu")).block_m == 16


# ---------------------------------------------------------------------------------------------- bad input


def _fp8_operands(e=2, n=128, k=256, m=8):
    a, sa = quant_a_fp8(torch.randn(m, k), False)
    w, sw = quant_w_fp8(torch.randn(e, n, k))
    return a, sa, w, sw, torch.zeros(m, dtype=torch.int32)


def test_fp8_bad_inputs():
    a, sa, w, sw, mi = _fp8_operands()
    with pytest.raises(LowbitInputError, match=r"moe_gemm_fp8: argument 'a': K=192 is not a multiple of 128"):
        a2, sa2, w2, sw2, _ = _fp8_operands(k=192 * 2)
        tri.moe_gemm_fp8(a2[:, :192], sa2[:, :1], w2[:, :, :192], sw2[:, :, :1], mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'a_scale': expected shape \(8, 2\)"):
        tri.moe_gemm_fp8(a, sa[:, :1], w, sw, mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'w_scale': expected shape \(2, 1, 2\)"):
        tri.moe_gemm_fp8(a, sa, w, sw[:, :, :1], mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'a_scale': dtype bfloat16"):
        tri.moe_gemm_fp8(a, sa.bfloat16(), w, sw, mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'w': dtype bfloat16"):
        tri.moe_gemm_fp8(a, sa, w.bfloat16(), sw, mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'm_indices': give exactly one"):
        tri.moe_gemm_fp8(a, sa, w, sw, mi, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(LowbitInputError, match=r"argument 'm_indices': dtype int64"):
        tri.moe_gemm_fp8(a, sa, w, sw, mi.long(), None)
    with pytest.raises(LowbitInputError, match=r"argument 'a': the masked layout takes a 3-D"):
        tri.moe_gemm_fp8(a, sa, w, sw, None, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="block_k=128"):
        tri.moe_gemm_fp8(a, sa, w, sw, mi, None, config=MoeGemmConfig(16, 64, 64, 1, 4, 1))
    assert "multiple of 128" in tri.supports_moe_gemm_fp8(a[:, :192], sa, w, sw, mi, None)
    assert tri.supports_moe_gemm_fp8(a, sa, w, sw, mi, None) is None


def test_bf16_and_mxfp4_bad_inputs():
    a = torch.randn(4, 128).bfloat16()
    w = torch.randn(2, 64, 128).bfloat16()
    mi = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_bf16: argument 'w': dtype float16 differs"):
        tri.moe_gemm_bf16(a, w.half(), mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'w': expected \(E, N, K=128\)"):
        tri.moe_gemm_bf16(a, w[:, :, :64], mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'm_indices': expected shape \(4,\)"):
        tri.moe_gemm_bf16(a, w, mi[:3], None)
    with pytest.raises(LowbitInputError, match=r"argument 'masked_m': expected shape \(2,\)"):
        tri.moe_gemm_bf16(a.view(2, 2, 128), w, None, mi)
    with pytest.raises(LowbitInputError, match=r"argument 'row_weights': expected shape \(4,\)"):
        tri.moe_gemm_bf16(a, w, mi, None, row_weights=torch.ones(5))
    with pytest.raises(LowbitInputError, match=r"argument 'a': dtype float32"):
        tri.moe_gemm_bf16(a.float(), w.float(), mi, None)
    wp, ws = quant_w_mxfp4(torch.randn(2, 64, 128))
    with pytest.raises(LowbitInputError, match=r"moe_gemm_mxfp4: argument 'w_scale': expected shape \(2, 64, 4\)"):
        tri.moe_gemm_mxfp4(a, wp, ws[:, :, :2], mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'a': K=144 is not a multiple of 32"):
        tri.moe_gemm_mxfp4(torch.randn(4, 144).bfloat16(), wp, ws, mi, None)
    with pytest.raises(LowbitInputError, match=r"argument 'a': dtype float16"):
        tri.moe_gemm_mxfp4(a.half(), wp, ws, mi, None)
    assert "bf16" in tri.supports_moe_gemm_mxfp4(a.half(), wp, ws, mi, None)
    assert tri.supports_moe_gemm_bf16(a, w, mi, None) is None


# ---------------------------------------------------------------------------------------------- GPU


def _gpu_case(kind, masked, e=8, rows=512, n=1024, k=1024, row_weights=False):
    g = torch.Generator().manual_seed(7)
    w32 = torch.randn(e, n, k, generator=g) * 0.05
    if masked:
        max_m = rows // e * 2
        masked_m = torch.randint(0, max_m + 1, (e,), generator=g, dtype=torch.int32)
        x = torch.randn(e, max_m, k, generator=g)
        dead = torch.arange(max_m)[None, :] >= masked_m[:, None]
        m_indices, rw_shape = None, (e, max_m)
    else:
        ids = torch.rand(rows // 2, e, generator=g).argsort(-1)[:, :2].to(torch.int32)
        m_indices = moe_align(ids, None, e, 64)[2]
        x = torch.randn(m_indices.numel(), k, generator=g)
        dead = m_indices < 0
        masked_m, rw_shape = None, (m_indices.numel(),)
    rw = torch.rand(rw_shape, generator=g) if row_weights else None
    return Case(kind, x, dead, m_indices, masked_m, w32, rw, f"gpu {kind} masked={masked}")


def _to_cuda(case: Case) -> Case:
    on = lambda t: None if t is None else t.cuda()
    return dataclasses.replace(case, x=case.x.cuda(), dead=case.dead.cuda(), m_indices=on(case.m_indices),
                               masked_m=on(case.masked_m), w32=case.w32.cuda(), row_weights=on(case.row_weights))


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("kind", ["bf16", "fp16", "fp8", "mxfp4", "w4a8", "w4a4", "nvfp4"])
def test_gpu_realistic(kind, masked):
    _check(_to_cuda(_gpu_case(kind, masked)))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8", "mxfp4", "w4a8", "w4a4", "nvfp4"])
def test_gpu_decode_and_row_weights(kind):
    """Decode sizes (few rows per expert -> small BLOCK_M), fused row weights, fp8 column-major scales."""
    case = _to_cuda(_gpu_case(kind, False, e=64, rows=16, n=2048, k=1024, row_weights=True))
    _check(case, **({"column_major": True} if kind in ("fp8", "w4a8") else {}))


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_gpu_mxfp4_dot_scaled(masked):
    _check(_to_cuda(_gpu_case("mxfp4", masked)), dot_scaled=True)


def test_w4_bad_inputs():
    a, sa = quant_a_fp8(torch.randn(8, 256), False)
    wp, ws = quant_w_mxfp4(torch.randn(2, 64, 256))
    mi = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_w4a8: argument 'a': dtype bfloat16"):
        tri.moe_gemm_w4a8(a.float().bfloat16(), sa, wp, ws, mi, None)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_w4a8: argument 'a_scale': expected shape \(8, 2\)"):
        tri.moe_gemm_w4a8(a, sa[:, :1], wp, ws, mi, None)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_w4a8: argument 'w': expected packed"):
        tri.moe_gemm_w4a8(a, sa, wp[:, :, :64], ws, mi, None)
    ap, sap = mxfp4_quantize(torch.randn(8, 256), "floor", False)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_w4a4: argument 'a_scale': expected shape \(8, 8\)"):
        tri.moe_gemm_w4a4(ap, sap[:, :4], wp, ws, mi, None)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_w4a4: argument 'w_scale': expected shape \(2, 64, 8\)"):
        tri.moe_gemm_w4a4(ap, sap, wp, ws[:, :, :4], mi, None)
    with pytest.raises(ValueError, match="w4a8 needs block_k=128"):
        tri.moe_gemm_w4a8(a, sa, wp, ws, mi, None, config=MoeGemmConfig(16, 64, 64, 1, 4, 1))
