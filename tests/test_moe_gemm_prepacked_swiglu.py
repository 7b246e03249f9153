"""GEMM1 + SwiGLU on prepacked FP4 weights (`moe_gemm_swiglu_fp4_prepacked`): one K loop per tile over the gate and
up rows of its output columns (prepacked.py: _swiglu_rows, _gate_up_split), against the chain
moe_gemm_fp4_prepacked -> swiglu (equal bytes) and the contract, under the interpreter and on a GPU (its sm_90
machine code: test_moe_gemm_prepacked.py::test_sm90_compile_register_a_wgmma).

Rows the kernel must not read are NaN; outputs start as NaN (conftest poison), so a forgotten zero row fails."""

from __future__ import annotations

import pytest
import torch

from dispatch.reference import moe_gemm as ref
from tests.helpers import DEVICES, assert_close, assert_same_bytes
from tests.test_moe_gemm import _poison_rows
from tests.test_moe_gemm_prepacked import _contig_case, _gpu_decode_case, _linear_weights
from triton_ops.moe_gemm import prepacked as tri
from triton_ops.moe_gemm.config import MoeGemmConfig


def _swiglu_layout(masked: bool):
    """(lead shape, dead rows, m_indices, masked_m): 3 experts, padding and out-of-range ids / counts."""
    if masked:
        mm = torch.tensor([6, 0, 3], dtype=torch.int32)
        return (3, 6), torch.arange(6)[None, :] >= mm[:, None], None, mm
    mi = torch.tensor([0] * 5 + [-1] + [2] * 7 + [1] * 4 + [7] + [0] * 2, dtype=torch.int32)
    return (mi.numel(),), (mi < 0) | (mi >= 3), mi, None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("masked, interleave, activation", [(False, 0, "silu"), (False, 1, "gptoss"),
                                                            (True, 1, "gptoss"), (True, 0, "silu")])
def test_swiglu_prepacked_equals_the_chain(device, fmt, masked, interleave, activation):
    """moe_gemm_swiglu_fp4_prepacked (one K loop over the gate and up rows of each output column, SwiGLU in the
    epilogue) against the chain moe_gemm_fp4_prepacked -> swiglu: operands on a coarse grid, so every GEMM sum is
    exact and the bytes must be equal; against the contract (moe_gemm_swiglu on the unpacked weights). I = 80 (a
    partial column tile), K = 160 (a padded chunk), dead rows NaN (never read), uncomputed rows 0."""
    from dispatch.ops import swiglu
    from tests.test_moe_gemm_fused import _exact_operands
    g = torch.Generator().manual_seed(21)
    i, k = 80, 160
    lead, dead, mi, mm = _swiglu_layout(masked)
    a, _, wp, ws, wg = _exact_operands(fmt, g, lead, dead, 3, 2 * i, k, "cpu")
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    limit = 7.0 if activation == "gptoss" else None
    dev = lambda t: None if t is None else t.to(device)
    got = tri.moe_gemm_swiglu_fp4_prepacked(dev(a), dev(vals), dev(scales), dev(wg), fmt, dev(mi), dev(mm), interleave,
                                            activation, 1.702, limit)
    h = tri.moe_gemm_fp4_prepacked(dev(a), dev(vals), dev(scales), dev(wg), fmt, dev(mi), dev(mm))
    chain = swiglu(h, interleave=interleave, activation=activation, limit=limit, expert_ids=dev(mi),
                   masked_m=dev(mm), backend="triton")
    what = f"{fmt} masked={masked} interleave={interleave} {activation}"
    assert_same_bytes(got, chain, what)
    want = ref.moe_gemm_swiglu_fp4_prepacked(a, vals, scales, wg, fmt, mi, mm, interleave, activation, 1.702, limit)
    assert_close(got.cpu(), want, what)
    rows = got.cpu()[dead]
    assert torch.equal(rows, torch.zeros_like(rows)), f"{what}: uncomputed rows are not zero"


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_swiglu_prepacked_tiles_equal_the_chain(fmt):
    """Interpreter: the one-pass tile at 16 weight rows (one 16-row gate / up group, 8 output columns), 32 rows with
    a 256-K step (masked past the row) and 64 rows with the prefill flags (tokens by descriptor, scale words, MXFP4
    per-tile fold) gives the bytes of the chain run at the same config, both layouts, GPT-OSS interleave 1 and
    concatenated halves; I = 40 (partial column tiles at every width)."""
    from dispatch.ops import swiglu
    from tests.test_moe_gemm_fused import _exact_operands
    g = torch.Generator().manual_seed(23)
    i, k = 40, 160
    flags = dict(scale_words=True, a_tma=True, fold_scale="tile" if fmt == "mxfp4" else "off")
    for cfg, masked, interleave in ((MoeGemmConfig(16, 16, 128, 1, 4, 1), False, 1),
                                    (MoeGemmConfig(16, 32, 256, 1, 4, 1), True, 0),
                                    (MoeGemmConfig(32, 64, 128, 1, 8, 1, **flags), False, 0)):
        lead, dead, mi, mm = _swiglu_layout(masked)
        a, _, wp, ws, wg = _exact_operands(fmt, g, lead, dead, 3, 2 * i, k, "cpu")
        vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
        act = ("gptoss", 7.0) if interleave else ("silu", None)
        got = tri.moe_gemm_swiglu_fp4_prepacked(a, vals, scales, wg, fmt, mi, mm, interleave, act[0], 1.702, act[1],
                                                config=cfg)
        h = tri.moe_gemm_fp4_prepacked(a, vals, scales, wg, fmt, mi, mm, config=cfg)
        chain = swiglu(h, interleave=interleave, activation=act[0], limit=act[1], expert_ids=mi, masked_m=mm,
                       backend="triton")
        assert_same_bytes(got, chain, f"{fmt} {cfg} masked={masked} interleave={interleave}")


def _swiglu_gpu(fmt, case, interleave, activation):
    """(fused, chain, contract) of GEMM1 + SwiGLU on a case's weights (case.w32: the (E, 2I, K) gate / up rows) on
    the GPU at the rule's tile; the contract on the CPU."""
    from dispatch.ops import swiglu
    wp, ws, wg = _linear_weights(fmt, case.w32)
    a = _poison_rows(case.x.bfloat16(), case.dead)
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    limit = 7.0 if activation == "gptoss" else None
    d = lambda t: None if t is None else t.cuda()
    args = (d(a), d(vals), d(scales), d(wg), fmt, d(case.m_indices), d(case.masked_m))
    got = tri.moe_gemm_swiglu_fp4_prepacked(*args, interleave, activation, 1.702, limit)
    chain = swiglu(tri.moe_gemm_fp4_prepacked(*args), interleave=interleave, activation=activation, limit=limit,
                   expert_ids=d(case.m_indices), masked_m=d(case.masked_m), backend="triton")
    want = ref.moe_gemm_swiglu_fp4_prepacked(a, vals, scales, wg, fmt, case.m_indices, case.masked_m, interleave,
                                             activation, 1.702, limit)
    return got, chain, want


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("rows", [16, 256])
@pytest.mark.parametrize("masked, interleave, activation", [(False, 1, "gptoss"), (True, 0, "silu")])
def test_gpu_swiglu_prepacked_tiles(fmt, rows, masked, interleave, activation):
    """GPT-OSS K = 2880, I = 600 (a partial 64-column tile), 4 experts x `rows` tokens: the rule's decode tile
    (16 tokens x 128 weight rows = 64 output columns) and prefill tile (128 x 128 x 8 warps, tokens by TMA, MXFP4
    scale words and the per-tile fold). The fused op gives the chain's bytes (same config, so the same K order of
    every accumulator) and matches the contract; uncomputed rows 0. Contiguous prefill also with experts of 96 /
    256 / 160 rows (tiles holding two experts)."""
    case = _gpu_decode_case(masked, e=4, rows=rows, n=1200)
    cases_ = [case]
    if rows > 16 and not masked:
        cases_.append(_contig_case(3, [0] * 96 + [1] * 256 + [2] * 160, k=2880, n=1200))
    for c in cases_:
        got, chain, want = _swiglu_gpu(fmt, c, interleave, activation)
        what = f"{fmt} {c.desc} interleave={interleave} {activation}"
        assert_same_bytes(got, chain, what)
        assert_close(got.cpu(), want, what)
        dead = got.cpu()[c.dead]
        assert torch.equal(dead, torch.zeros_like(dead)), f"{what}: uncomputed rows are not zero"
