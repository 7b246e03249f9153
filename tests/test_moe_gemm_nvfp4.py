"""NVFP4-weight MoE grouped GEMM (`moe_gemm_nvfp4`, W4A16: bf16 / fp16 activations, E2M1 pairs + E4M3 scales per 16
+ an fp32 global scale per expert): the cases of its own against dispatch/reference/moe_gemm.py (K tails, NaN scale
bytes, a zero global scale, the sm_90 tiles), the registered op and its input checks. The property test and the
layout edges every kind shares are in tests/test_moe_gemm.py (kind "nvfp4").

Weights come from the repo's own `nvfp4_quantize` (linear scale layout) of each expert, stacked (quant_w_nvfp4), so
the layout is the one users get; some tests then overwrite block scales with E4M3 edge bytes (subnormal, zero, the
maximum 448). Rows the kernel must not read are NaN; outputs start as NaN (conftest poison), so a forgotten zero row
fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dispatch.reference import moe_gemm as ref
from tests.helpers import DEVICES, assert_close
from tests.test_moe_gemm import Case, _check, _contig, _gpu_case, _to_cuda, quant_w_nvfp4
from triton_ops.contract.checks import LowbitInputError
from triton_ops.moe_gemm import grouped as tri
from triton_ops.moe_gemm.config import MoeGemmConfig

# ---------------------------------------------------------------------------------------------- edges


def test_block_k_16_and_k_tail():
    """BLOCK_K 16 (one scale per step) and K = 208 (not a multiple of 32 or of the 128-wide step: a masked tail)."""
    m_indices, x, dead, w32 = _contig(2, [0, 1, 1, -1, 0, 0, 1, 5], k=208, n=48)
    case = Case("nvfp4", x, dead, m_indices, None, w32, None, "nvfp4 K=208")
    _check(case, config=MoeGemmConfig(16, 16, 16, group_m=1, num_warps=4, num_stages=1))
    _check(case)


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
    _check(case, config=cfg)


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
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
def test_gpu_realistic_fp16(masked):
    """Prefill-like tiles (64 rows per expert: 64 x 128 x 128), K = 1024, fp16 activations (bf16: test_moe_gemm.py
    test_gpu_realistic)."""
    _check(_to_cuda(_gpu_case("nvfp4", masked)), dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("edit", ["subnormal", "zero", "max"])
def test_gpu_decode_and_row_weights(edit):
    """Decode sizes (few rows per expert -> 16-row tiles, 4 stages), row weights, E4M3 edge scales (as quantized:
    test_moe_gemm.py test_gpu_decode_and_row_weights)."""
    case = _to_cuda(_gpu_case("nvfp4", False, e=64, rows=16, n=2048, k=1024, row_weights=True))
    _check(case, edit=edit)


@pytest.mark.gpu
def test_gpu_prefill_tile_gpt_oss_k():
    """The 128 x 128 x 64 prefill tile at GPT-OSS's K = 2880 (45 K steps, no tail), 256 rows per expert."""
    case = _gpu_case("nvfp4", False, e=4, rows=2048, n=512, k=2880)
    _check(dataclasses.replace(_to_cuda(case), desc="gpu nvfp4 prefill K=2880"))
