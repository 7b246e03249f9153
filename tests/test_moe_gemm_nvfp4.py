"""NVFP4-weight MoE grouped GEMM (`moe_gemm_nvfp4`, W4A16: bf16 / fp16 activations, E2M1 pairs + E4M3 scales per 16
+ an fp32 global scale per expert) against dispatch/reference/moe_gemm.py, both layouts, fused row weights.

Weights come from the repo's own `nvfp4_quantize` (linear scale layout) of each expert, stacked, so the layout is the
one users get; some tests then overwrite block scales with E4M3 edge bytes (subnormal, zero, the maximum 448).
Rows the kernel must not read are NaN; outputs start as NaN (conftest poison), so a forgotten zero row fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.reference import moe_gemm as ref
from dispatch.reference.quant import nvfp4_quantize
from tests.helpers import DEVICES, assert_close
from tests.test_moe_gemm import Case, _contig, _gpu_case, _poison_rows, _to_cuda, cases
from triton_ops.contract.checks import LowbitInputError
from triton_ops.moe_gemm import grouped as tri
from triton_ops.moe_gemm.config import MoeGemmConfig

# E4M3 scale bytes written over quantized ones: subnormals (2^-9 .. 7 * 2^-9), zero, the largest finite (448)
SCALE_EDITS = {"subnormal": (0x01, 0x08), "zero": (0x00, 0x01), "max": (0x7E, 0x7F)}


def quant_w_nvfp4(w32: torch.Tensor, edit: str | None = None, seed: int = 0):
    """fp32 (E, N, K) -> (codes (E, N, K/2) uint8, scales (E, N, K/16) float8_e4m3fn, global (E,) fp32): each
    expert through nvfp4_quantize (its own computed global scale), stacked. edit: overwrite about a third of the
    block scales with that kind of E4M3 byte (SCALE_EDITS). Runs on w32's device (the quantizer is plain torch)."""
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


def run_nvfp4(case: Case, dtype=torch.bfloat16, edit=None, uint8_scales=False, seed=0, **kw):
    """(got, want) of one layout case with NVFP4 weights and `dtype` activations."""
    wp, ws, wg = quant_w_nvfp4(case.w32, edit, seed)
    if uint8_scales:
        ws = ws.view(torch.uint8)
    a = _poison_rows(case.x.to(dtype), case.dead)
    ids = (case.m_indices, case.masked_m)
    got = tri.moe_gemm_nvfp4(a, wp, ws, wg, *ids, row_weights=case.row_weights, **kw)
    cpu = lambda t: None if t is None else t.cpu()
    want = ref.moe_gemm_nvfp4(*map(cpu, (a, wp, ws, wg, *ids, case.row_weights)))
    return got, want


def check_nvfp4(case: Case, dtype=torch.bfloat16, **kw) -> None:
    got, want = run_nvfp4(case, dtype, **kw)
    what = f"{case.desc} {dtype} {kw}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}"
    assert_close(got.cpu(), want, what)
    assert not torch.isnan(got.float()).any(), f"{what}: NaN in the output (unwritten or poisoned rows)"
    dead_out = got[case.dead]
    assert torch.equal(dead_out, torch.zeros_like(dead_out)), f"{what}: uncomputed rows are not zero"


# ---------------------------------------------------------------------------------------------- properties


@settings(max_examples=20)
@given(case=cases("nvfp4"), fp16=st.booleans(), edit=st.sampled_from([None, "subnormal", "zero", "max"]),
       uint8_scales=st.booleans(), seed=st.integers(0, 2**16))
def test_nvfp4_matches_reference(case, fp16, edit, uint8_scales, seed):
    """E (1-4), rows per expert incl. 0 and all on one expert, both layouts, padding and out-of-range ids, masked
    counts past max_m and negative, row weights; E4M3 scales as quantized or with subnormal / zero / max bytes;
    scales given as float8_e4m3fn or as their uint8 codes."""
    check_nvfp4(case, torch.float16 if fp16 else torch.bfloat16, edit=edit, uint8_scales=uint8_scales, seed=seed)


# ---------------------------------------------------------------------------------------------- edges


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tile_spanning_experts_with_row_weights(dtype):
    """Unaligned rows (one tile holds four experts, padding and bad ids in between): one pass per expert, each with
    its own global scale."""
    ids = [2, 0, 0, -1, 3, 3, 1, 9, 2, 2, -1, 0, 1, 1, 3, -4] * 2
    m_indices, x, dead, w32 = _contig(4, ids, k=256)
    w32 = w32 * torch.tensor([1.0, 100.0, 0.01, 3.0])[:, None, None]  # global scales far apart
    case = Case("nvfp4", x, dead, m_indices, None, w32, torch.rand(len(ids)), "nvfp4 mixed tile")
    check_nvfp4(case, dtype, config=MoeGemmConfig(32, 64, 128, group_m=2, num_warps=4, num_stages=1))


def test_block_k_16_and_k_tail():
    """BLOCK_K 16 (one scale per step) and K = 208 (not a multiple of 32 or of the 128-wide step: a masked tail)."""
    m_indices, x, dead, w32 = _contig(2, [0, 1, 1, -1, 0, 0, 1, 5], k=208, n=48)
    case = Case("nvfp4", x, dead, m_indices, None, w32, None, "nvfp4 K=208")
    check_nvfp4(case, config=MoeGemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1))
    check_nvfp4(case)


def test_all_padding_and_empty():
    m_indices, x, dead, w32 = _contig(2, [-1] * 16 + [5] * 3)
    check_nvfp4(Case("nvfp4", x, dead, m_indices, None, w32, None, "nvfp4 all padding"))
    m_indices, x, dead, w32 = _contig(2, [])
    check_nvfp4(Case("nvfp4", x, dead, m_indices, None, w32, None, "nvfp4 no rows"))


def test_nan_scale_byte_and_zero_global():
    """An E4M3 NaN scale byte (0x7F) makes its rows NaN, as in the reference; a zero global scale zeroes its expert."""
    m_indices, x, dead, w32 = _contig(2, [0, 0, 1, 1], k=64, n=32)
    wp, ws, wg = quant_w_nvfp4(w32)
    ws.view(torch.uint8)[0, 3, 1] = 0x7F
    wg[1] = 0.0
    a = x.bfloat16()
    got = tri.moe_gemm_nvfp4(a, wp, ws, wg, m_indices, None)
    want = ref.moe_gemm_nvfp4(a, wp, ws, wg, m_indices, None)
    assert bool(torch.isnan(got[:2, 3]).all()) and bool(torch.isnan(want[:2, 3]).all())
    assert bool((got[2:] == 0).all()) and bool((want[2:] == 0).all())
    keep = torch.ones(32, dtype=torch.bool)
    keep[3] = False
    assert_close(got[:2, keep], want[:2, keep], "finite columns")


@pytest.mark.parametrize("rows", [16, 4096], ids=["decode", "prefill"])
def test_gpu_tile_configs_under_the_interpreter(rows):
    """The configs the sm_90 rule picks (decode 16 x 64 x 128, 4 stages; prefill 128 x 128 x 64, 8 warps) at
    GPT-OSS's K = 2880, run by the interpreter: the tiles the GPU runs, on a small problem."""
    from triton_ops.moe_gemm.config import pick_config_for_arch
    cfg = pick_config_for_arch("nvfp4", rows, 5760, 2880, "sm_90")
    ids = [0] * 20 + [-1] * 4 + [1] * 9 + [7] + [1] * 2
    m_indices, x, dead, w32 = _contig(2, ids, k=2880, n=80)
    case = Case("nvfp4", x, dead, m_indices, None, w32, torch.rand(len(ids)), f"nvfp4 sm_90 config {cfg}")
    check_nvfp4(case, config=cfg)


# ---------------------------------------------------------------------------------------------- dispatch


@pytest.mark.parametrize("device", DEVICES)
def test_dispatch_op_and_opcheck(device):
    """The registered op (Triton row, torch row), float4 / float8 views accepted, and torch.library.opcheck."""
    from dispatch import ops
    g = torch.Generator().manual_seed(5)
    e, n, k = 3, 64, 128
    wp, ws, wg = (t.to(device) for t in quant_w_nvfp4(torch.randn(e, n, k, generator=g) * 0.1))
    m_indices = torch.tensor([0, 0, 2, 2, -1, 1, 7, 1], dtype=torch.int32, device=device)
    a = torch.randn(8, k, generator=g).bfloat16().to(device)
    got = ops.moe_gemm_nvfp4(a, wp, ws, wg, m_indices=m_indices, backend="triton")
    want = ops.moe_gemm_nvfp4(a, wp, ws, wg, m_indices=m_indices, backend="torch")
    assert_close(got.cpu(), want.cpu(), "triton vs torch")
    assert torch.equal(ops.moe_gemm_nvfp4(a, wp, ws.view(torch.uint8), wg, m_indices=m_indices, backend="triton"),
                       got), "uint8 scale codes"
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is not None:
        assert torch.equal(ops.moe_gemm_nvfp4(a, wp.view(fp4), ws, wg, m_indices=m_indices, backend="triton"), got)
    args = (a, wp, ws.view(torch.uint8), wg, m_indices, None, None, "triton")
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_nvfp4.default, args,
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_inputs_are_named():
    e, n, k = 2, 64, 128
    wp, ws, wg = quant_w_nvfp4(torch.randn(e, n, k))
    a = torch.randn(4, k).bfloat16()
    mi = torch.zeros(4, dtype=torch.int32)
    op = r"moe_gemm_nvfp4: argument"
    with pytest.raises(LowbitInputError, match=rf"{op} 'a': dtype float32"):
        tri.moe_gemm_nvfp4(a.float(), wp, ws, wg, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'a': K=24 is not a multiple of 16"):
        tri.moe_gemm_nvfp4(torch.randn(4, 24).bfloat16(), wp[:, :, :12], ws[:, :, :1], wg, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w': expected packed \(E, N, K/2=64\)"):
        tri.moe_gemm_nvfp4(a, wp[:, :, :32], ws, wg, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w': dtype int8"):
        tri.moe_gemm_nvfp4(a, wp.view(torch.int8), ws, wg, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w_scale': expected shape \(2, 64, 8\)"):
        tri.moe_gemm_nvfp4(a, wp, ws[:, :, :4], wg, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w_scale': dtype bfloat16"):
        tri.moe_gemm_nvfp4(a, wp, ws.float().bfloat16(), wg, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w_global': expected shape \(2,\)"):
        tri.moe_gemm_nvfp4(a, wp, ws, wg[:1], mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w_global': expected shape \(2,\)"):
        tri.moe_gemm_nvfp4(a, wp, ws, wg[0], mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w_global': dtype bfloat16"):
        tri.moe_gemm_nvfp4(a, wp, ws, wg.bfloat16(), mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'w_global': expected a torch.Tensor"):
        tri.moe_gemm_nvfp4(a, wp, ws, 1.0, mi, None)
    with pytest.raises(LowbitInputError, match=rf"{op} 'row_weights': expected shape \(4,\)"):
        tri.moe_gemm_nvfp4(a, wp, ws, wg, mi, None, row_weights=torch.ones(3))
    with pytest.raises(LowbitInputError, match=rf"{op} 'm_indices': give exactly one"):
        tri.moe_gemm_nvfp4(a, wp, ws, wg, None, None)
    assert "not bf16 / fp16" in tri.supports_moe_gemm_nvfp4(a.float(), wp, ws, wg, mi, None)
    assert tri.supports_moe_gemm_nvfp4(a, wp, ws, wg, mi, None) is None


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_gpu_realistic(masked, dtype):
    """Prefill-like tiles (64 rows per expert: 64 x 128 x 128), K = 1024."""
    check_nvfp4(_to_cuda(_gpu_case("nvfp4", masked)), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("edit", [None, "subnormal", "zero", "max"])
def test_gpu_decode_and_row_weights(edit):
    """Decode sizes (few rows per expert -> 16-row tiles, 4 stages), row weights, E4M3 edge scales."""
    case = _to_cuda(_gpu_case("nvfp4", False, e=64, rows=16, n=2048, k=1024, row_weights=True))
    check_nvfp4(case, edit=edit)


@pytest.mark.gpu
def test_gpu_prefill_tile_gpt_oss_k():
    """The 128 x 128 x 64 prefill tile at GPT-OSS's K = 2880 (45 K steps, no tail), 256 rows per expert."""
    case = _gpu_case("nvfp4", False, e=4, rows=2048, n=512, k=2880)
    check_nvfp4(dataclasses.replace(_to_cuda(case), desc="gpu nvfp4 prefill K=2880"))

