"""moe_gemm_blockscaled / moe_gemm_blockscaled_masked: FP4 x FP4 grouped GEMM over group row offsets or the masked
layout, with 128x4-swizzled scales (the sm_100 CuTeDSL UMMA kernel's ops; elsewhere the reference). CPU: the ops
against the quant ops' own dequantizers, the offsets contract (clamped, rows in no group are 0) and the masked one
(counts clamped to [0, max_m], rows past them 0), the launcher's device-side group bounds, argument errors, the table
rows; GPU: sm_100 only (never run here)."""

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


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_masked_op_matches_the_quantizers_math(fmt):
    e, max_m, n, k = 3, 64, 128, 256
    a, sfa, b, sfb, deq_a, deq_b = fp4_grouped_operands(fmt, e * max_m, e, n, k, seed=2)
    masked_m = torch.tensor([64, -3, 100], dtype=torch.int32)  # full, negative (empty), above max_m (clamped)
    alpha = torch.tensor([0.5, 2.0, 1.5])
    out = ops.moe_gemm_blockscaled_masked(a.view(e, max_m, -1), sfa, b, sfb, masked_m, alpha, fmt)
    assert out.shape == (e, max_m, n) and out.dtype == torch.bfloat16
    for x, count in enumerate((64, 0, 64)):
        rows = deq_a[x * max_m:x * max_m + count]
        assert_close(out[x, :count], (alpha[x] * (rows @ deq_b[x].T)).bfloat16(), f"{fmt} expert {x}")
        assert torch.equal(out[x, count:], torch.zeros(max_m - count, n, dtype=torch.bfloat16))


def test_masked_rows_past_the_count_are_zero_and_unread():
    """A partial count: rows past it are 0 whatever a holds there (NaN-free garbage codes) and the computed rows
    equal the offsets form over the same rows."""
    e, max_m, n, k = 2, 128, 128, 128
    a, sfa, b, sfb, _, _ = fp4_grouped_operands("nvfp4", e * max_m, e, n, k, seed=3)
    masked_m = torch.tensor([5, 77], dtype=torch.int32)
    alpha = torch.tensor([1.0, 0.25])
    out = ops.moe_gemm_blockscaled_masked(a.view(e, max_m, -1), sfa, b, sfb, masked_m, alpha, "nvfp4")
    offs = torch.tensor([0, 5, 5], dtype=torch.int32)
    g0 = ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs, alpha, "nvfp4")
    assert torch.equal(out[0, :5], g0[:5])
    assert torch.equal(out[0, 5:], torch.zeros(max_m - 5, n, dtype=torch.bfloat16))
    offs1 = torch.tensor([0, 0, max_m + 77], dtype=torch.int32)
    g1 = ops.moe_gemm_blockscaled(a, sfa, b, sfb, offs1, alpha, "nvfp4")
    assert torch.equal(out[1, :77], g1[max_m:max_m + 77])
    assert torch.equal(out[1, 77:], torch.zeros(max_m - 77, n, dtype=torch.bfloat16))


def test_launcher_group_bounds_follow_the_contract():
    """The sm_100 launcher's (starts, counts), built with device ops: offsets clamped and made non-decreasing as
    the reference does."""
    from cute_ops.gemm import blockscaled_sm100

    m = 512
    for offs in ([0, 128, 128, 512], [64, 32, 10_000], [-5, 256, 128, 384], [0, 0, 0]):
        t = torch.tensor(offs, dtype=torch.int32)
        starts, counts = blockscaled_sm100.offsets_bounds(t, m)
        assert starts.dtype == counts.dtype == torch.int32
        want = [min(max(x, 0), m) for x in offs]
        want = [max(want[: i + 1]) for i in range(len(want))]
        assert starts.tolist() == want[:-1]
        assert counts.tolist() == [b - a for a, b in zip(want[:-1], want[1:], strict=True)]


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


def test_masked_bad_inputs():
    e, max_m = 2, 64
    a, sfa, b, sfb, _, _ = fp4_grouped_operands("nvfp4", e * max_m, e, 128, 128)
    a3, mm, alpha = a.view(e, max_m, -1), torch.tensor([3, 64], dtype=torch.int32), torch.ones(2)
    op = ops.moe_gemm_blockscaled_masked
    with pytest.raises(LowbitInputError, match=r"moe_gemm_blockscaled_masked: argument 'a': expected \[E, max_m"):
        op(a, sfa, b, sfb, mm, alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"moe_gemm_blockscaled_masked: argument 'fmt'"):
        op(a3, sfa, b, sfb, mm, alpha, "fp8")
    with pytest.raises(LowbitInputError, match=r"argument 'a_scale': expected the 128x4-swizzled container"):
        op(a3, sfa[:, :4], b, sfb, mm, alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'b': expected 2 experts"):
        op(a3, sfa, b[:1], sfb[:1], mm, alpha[:1], "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'masked_m': expected shape \(2,\)"):
        op(a3, sfa, b, sfb, mm[:1], alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'masked_m': dtype int64"):
        op(a3, sfa, b, sfb, mm.long(), alpha, "nvfp4")
    with pytest.raises(LowbitInputError, match=r"argument 'alpha': dtype float64"):
        op(a3, sfa, b, sfb, mm, alpha.double(), "nvfp4")


def test_table_rows_and_refusal(monkeypatch):
    """sm_100 / sm_103: the CuTeDSL kernel's row (compiled only: refused unless LOWBIT_CUTE_UNVERIFIED=1), the
    reference everywhere; the listing says the kernel never ran there."""
    from cute_ops.gemm import blockscaled_sm100
    from dispatch.describe import format_table
    from dispatch.table import TABLE

    rows = {(e.backend, e.archs) for e in TABLE["moe_gemm_blockscaled"]}
    assert ("cute", ("sm_100", "sm_103")) in rows and any(b == "torch" for b, _ in rows)
    a, sfa, b, sfb, _, _ = fp4_grouped_operands("nvfp4", 128, 2, 128, 256)
    args = (a, sfa, b, sfb, torch.tensor([0, 64, 128], dtype=torch.int32), torch.ones(2), "nvfp4")
    monkeypatch.delenv(blockscaled_sm100.UNVERIFIED_ENV, raising=False)
    assert "never run on a Blackwell chip" in blockscaled_sm100.supports_moe_gemm_blockscaled(*args)
    monkeypatch.setenv(blockscaled_sm100.UNVERIFIED_ENV, "1")
    assert "sm_100" in blockscaled_sm100.supports_moe_gemm_blockscaled(*args)  # CPU tensors: not this kernel's device
    listing = format_table("sm_100")
    line = next(ln for ln in listing.splitlines() if ln.startswith("moe_gemm_blockscaled"))
    assert "never run on it" in line
    masked = {(e.backend, e.archs) for e in TABLE["moe_gemm_blockscaled_masked"]}
    assert masked == rows
    margs = (a.view(2, 64, -1), sfa, b, sfb, torch.tensor([3, 64], dtype=torch.int32), torch.ones(2), "nvfp4")
    monkeypatch.delenv(blockscaled_sm100.UNVERIFIED_ENV, raising=False)
    assert "never run on a Blackwell chip" in blockscaled_sm100.supports_moe_gemm_blockscaled_masked(*margs)
    monkeypatch.setenv(blockscaled_sm100.UNVERIFIED_ENV, "1")
    assert "sm_100" in blockscaled_sm100.supports_moe_gemm_blockscaled_masked(*margs)


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


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("max_m", [32, 64, 128])  # swap-AB 32- and 64-token tiles, the 128-row tile
def test_gpu_blackwell_masked_op_matches_reference(fmt, max_m, monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs an sm_100 GPU")
    monkeypatch.setitem(os.environ, "LOWBIT_CUTE_UNVERIFIED", "1")
    e, n, k = 4, 256, 512
    a, sfa, b, sfb, _, _ = fp4_grouped_operands(fmt, e * max_m, e, n, k)
    masked_m = torch.tensor([max_m, 0, 5, max_m + 9], dtype=torch.int32)
    alpha = torch.tensor([1.0, 2.0, 0.5, 1.0])
    args = (a.view(e, max_m, -1), sfa, b, sfb, masked_m, alpha)
    want = ops.moe_gemm_blockscaled_masked(*args, fmt)
    got = ops.moe_gemm_blockscaled_masked(*(t.cuda() for t in args), fmt, backend="cute")
    assert_close(got.cpu(), want, f"{fmt} masked max_m={max_m} on sm_100")
