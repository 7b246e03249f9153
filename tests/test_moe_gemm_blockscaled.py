"""moe_gemm_blockscaled: FP4 x FP4 grouped GEMM over group row offsets with 128x4-swizzled scales (the sm_100
CuTeDSL UMMA kernel's op; elsewhere the reference). CPU: the op against the quant ops' own dequantizers, the offsets
contract (clamped, rows in no group are 0), argument errors, the table rows; GPU: sm_100 only (never run here)."""

from __future__ import annotations

import os

import pytest
import torch

from dispatch import ops
from tests.helpers import assert_close, fp4_grouped_operands
from triton_ops.contract.checks import LowbitInputError


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_op_matches_the_quantizers_math(fmt):
    g, n, k = 3, 128, 256
    offs = torch.tensor([0, 128, 128, 256], dtype=torch.int32)  # group 1 empty; rows 256..383 in no group
    a, sfa, b, sfb, deq_a, deq_b = fp4_grouped_operands(fmt, 384, g, n, k)
    alpha = torch.tensor([0.5, 2.0, 1.0])
    out = ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs, alpha, fmt)
    assert out.shape == (384, n) and out.dtype == torch.bfloat16
    for e in range(g):
        lo, hi = int(offs[e]), int(offs[e + 1])
        assert_close(out[lo:hi], (alpha[e] * (deq_a[lo:hi] @ deq_b[e].T)).bfloat16(), f"{fmt} group {e}")
    assert torch.equal(out[256:], torch.zeros(128, n, dtype=torch.bfloat16)), "rows in no group must be 0"


def test_offsets_are_clamped():
    """Offsets past M, or going backwards, never read or write out of bounds: groups are clamped to [0, M]."""
    a, sfa, b, sfb, deq_a, deq_b = fp4_grouped_operands("mxfp4", 128, 2, 128, 128, seed=1)
    offs = torch.tensor([64, 32, 10_000], dtype=torch.int32)  # group 0 backwards (empty), group 1 = rows 64..127
    out = ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs, torch.ones(2), "mxfp4")
    assert torch.equal(out[:64], torch.zeros(64, 128, dtype=torch.bfloat16))
    assert_close(out[64:], (deq_a[64:] @ deq_b[1].T).bfloat16(), "group 1 clamped to M")


def test_bad_inputs():
    a, sfa, b, sfb, _, _ = fp4_grouped_operands("nvfp4", 128, 2, 128, 128)
    offs, alpha = torch.tensor([0, 64, 128], dtype=torch.int32), torch.ones(2)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_blockscaled: argument 'fmt'"):
        ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs, alpha, "fp8")
    with pytest.raises(LowbitInputError, match=r"argument 'a_scale': expected the 128x4-swizzled container"):
        ops.moe_gemm_blockscaled(a, sfa[:, :4], b, sfb, offs, alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'b': expected \[G, N, K/2=64\]"):
        ops.moe_gemm_blockscaled(a, sfa, b[:, :, :32], sfb, offs, alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'offsets': expected shape \(3,\)"):
        ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs[:2], alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'offsets': dtype int64"):
        ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs.long(), alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'alpha': dtype float64"):
        ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs, alpha.double(), "nvfp4")


def test_table_rows_and_refusal(monkeypatch):
    """sm_100 / sm_103: the CuTeDSL kernel's row (compiled only: refused unless LOWBIT_CUTE_UNVERIFIED=1), the
    reference everywhere; the listing says the kernel never ran there."""
    from cute_ops.gemm import moe_sm100
    from dispatch.describe import format_table
    from dispatch.table import TABLE

    rows = {(e.backend, e.archs) for e in TABLE["moe_gemm_blockscaled"]}
    assert ("cute", ("sm_100", "sm_103")) in rows and any(b == "torch" for b, _ in rows)
    a, sfa, b, sfb, _, _ = fp4_grouped_operands("nvfp4", 128, 2, 128, 256)
    args = (a, sfa, b, sfb, torch.tensor([0, 64, 128], dtype=torch.int32), torch.ones(2), "nvfp4")
    monkeypatch.delenv(moe_sm100.UNVERIFIED_ENV, raising=False)
    assert "never run on a Blackwell chip" in moe_sm100.supports_moe_gemm_blockscaled(*args)
    monkeypatch.setenv(moe_sm100.UNVERIFIED_ENV, "1")
    assert "sm_100" in moe_sm100.supports_moe_gemm_blockscaled(*args)  # CPU tensors: not this kernel's device
    listing = format_table("sm_100")
    line = next(ln for ln in listing.splitlines() if ln.startswith("moe_gemm_blockscaled"))
    assert "never run on it" in line


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_blackwell_op_matches_reference(fmt, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs an sm_100 GPU")
    monkeypatch.setitem(os.environ, "LOWBIT_CUTE_UNVERIFIED", "1")
    a, sfa, b, sfb, _, _ = fp4_grouped_operands(fmt, 512, 4, 256, 512)
    offs = torch.tensor([0, 128, 128, 384, 512], dtype=torch.int32)
    alpha = torch.tensor([1.0, 2.0, 0.5, 1.0])
    want = ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs, alpha, fmt)
    got = ops.moe_gemm_blockscaled(*(t.cuda() for t in (a, sfa, b, sfb, offs, alpha)), fmt, backend="cute")
    assert_close(got.cpu(), want, f"{fmt} on sm_100")
