"""The prepacked FP4 kernel's tokens-on-M orientation (`MoeGemmConfig(tokens_m=True)`, the prefill variant: the
tokens are the MMA's M side from shared memory, the dequantized weight tile the shared-memory B operand, converted
once per program and K step): the same results as the swap-AB orientation and the contract under the interpreter and
on a GPU, through the plain GEMM, GEMM1 + SwiGLU and the token-order scatter (its sm_90 machine code:
test_moe_gemm_prepacked.py::test_sm90_compile_register_a_wgmma).

Rows the kernel must not read are NaN; outputs start as NaN (conftest poison), so a forgotten zero row fails."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dispatch.reference import moe_gemm as ref
from tests.helpers import DEVICES, assert_close, assert_same_bytes
from tests.test_moe_gemm_prepacked import _check, _contig_case, _gpu_decode_case, _linear_weights
from tests.test_moe_gemm_prepacked_swiglu import _swiglu_layout
from triton_ops.moe_gemm import prepacked as tri
from triton_ops.moe_gemm.config import MoeGemmConfig

# (tokens, weight rows, K step, warps, stages): interpreter-sized tiles, a tile holding two experts, a 256-K step
CPU_TILES = [MoeGemmConfig(16, 64, 128, 1, 4, 1, tokens_m=True), MoeGemmConfig(32, 16, 256, 1, 4, 1, tokens_m=True),
             MoeGemmConfig(64, 32, 128, 1, 8, 1, tokens_m=True)]
# the lab sweep's tokens-on-M prefill tiles (ptxas sm_90, Triton 3.6: 128 x 128 8 warps 226 registers, no spills;
# 128 x 64 4 warps 233; 256 x 128 8 warps x 2 stages spills 11)
GPU_TILES = [MoeGemmConfig(128, 128, 128, 1, 8, 3, tokens_m=True), MoeGemmConfig(128, 128, 128, 1, 8, 4, tokens_m=True),
             MoeGemmConfig(128, 64, 128, 1, 4, 2, tokens_m=True), MoeGemmConfig(256, 128, 128, 1, 8, 2, tokens_m=True)]


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_tokens_m_matches_reference_and_swap_ab(fmt):
    """Interpreter: contiguous rows of 2 experts with padding (-1) and row weights, K = 160 (a padded chunk; the
    256-K step masks past the row), N = 144 (a partial weight tile); against the contract and the swap-AB tile."""
    case = _contig_case(2, [0] * 20 + [-1] * 3 + [1] * 9, k=160, n=144, row_weights=True)
    weights = _linear_weights(fmt, case.w32)
    swap = _check(fmt, case, weights=weights, config=MoeGemmConfig(16, 64, 128, 1, 4, 1))
    for cfg in CPU_TILES:
        got = _check(fmt, case, weights=weights, config=cfg)
        assert_close(got, swap, f"{fmt} {cfg} against swap-AB")


def test_tokens_m_masked_and_fp16():
    """Masked layout (counts 0, past max_m, negative) and NVFP4 with fp16 activations, tokens on M."""
    mm = torch.tensor([5, 0, 9, -2], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 8, 256, generator=g)
    dead = torch.arange(8)[None, :] >= mm.clamp(0, 8)[:, None]
    case = dataclasses.replace(_contig_case(4, [0], k=256, n=48), x=x, dead=dead, m_indices=None, masked_m=mm,
                               w32=torch.randn(4, 48, 256, generator=g) * 0.05, desc="masked")
    cfg = MoeGemmConfig(16, 16, 128, 1, 4, 1, tokens_m=True)
    _check("mxfp4", case, config=cfg)
    _check("nvfp4", case, torch.float16, config=cfg)


def test_tokens_m_configs():
    """Tiles with more than 16 weight rows per warp are refused (Triton 3.6 aborts on them for sm_90)."""
    cfg = MoeGemmConfig(128, 128, 128, 1, 8, 4, tokens_m=True)
    assert tri.prepacked_refusal(cfg) is None
    for bad in (MoeGemmConfig(128, 128, 128, 1, 4, 4, tokens_m=True),
                MoeGemmConfig(128, 256, 128, 1, 8, 2, tokens_m=True)):
        assert "weight rows per warp" in tri.prepacked_refusal(bad)
        assert tri.prepacked_refusal(dataclasses.replace(bad, tokens_m=False)) is None


def _exact(fmt, lead, dead, e, n, k, seed):
    from tests.test_moe_gemm_fused import _exact_operands
    a, _, wp, ws, wg = _exact_operands(fmt, torch.Generator().manual_seed(seed), lead, dead, e, n, k, "cpu")
    vals, scales = ref.moe_gemm_fp4_prepack(wp, ws, fmt)
    return a, vals, scales, wg


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("masked", [False, True])
def test_tokens_m_same_bytes_as_swap_ab(device, fmt, masked):
    """Operands on a coarse grid (every GEMM sum exact): the plain GEMM, GEMM1 + SwiGLU (GPT-OSS, interleaved) and
    the token-order scatter give the swap-AB orientation's bytes; I = 80 (a partial column tile), K = 160."""
    i, k = 80, 160
    lead, dead, mi, mm = _swiglu_layout(masked)
    a, vals, scales, wg = _exact(fmt, lead, dead, 3, 2 * i, k, 31)
    d = lambda t: None if t is None else t.to(device)
    args = (d(a), d(vals), d(scales), d(wg), fmt, d(mi), d(mm))
    swap = MoeGemmConfig(16, 64, 128, 1, 4, 1) if device == "cpu" else MoeGemmConfig(64, 64, 128, 1, 4, 3)
    on_m = dataclasses.replace(swap, tokens_m=True)
    what = f"{fmt} masked={masked} {device}"
    assert_same_bytes(tri.moe_gemm_fp4_prepacked(*args, config=on_m),
                      tri.moe_gemm_fp4_prepacked(*args, config=swap), what)
    sw = (1, "gptoss", 1.702, 7.0)
    assert_same_bytes(tri.moe_gemm_swiglu_fp4_prepacked(*args, *sw, config=on_m),
                      tri.moe_gemm_swiglu_fp4_prepacked(*args, *sw, config=swap), f"{what} swiglu")
    rows = a.shape[:-1].numel()
    src = d(torch.randperm(rows, generator=torch.Generator().manual_seed(2)).to(torch.int32).reshape(a.shape[:-1]))
    scat = dict(dst_rows=src, n_dst=rows)
    assert_same_bytes(tri._launch(fmt, *args[:4], d(mi), d(mm), None, on_m, **scat),
                      tri._launch(fmt, *args[:4], d(mi), d(mm), None, swap, **scat), f"{what} scatter")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_tokens_m_prefill_tiles(fmt, masked):
    """Prefill (256 tokens per expert, GPT-OSS K = 2880): the tokens-on-M tiles against the contract and the
    swap-AB rule's output; contiguous rows not aligned to the tile (experts of 96 / 256 / 160 rows)."""
    case = _gpu_decode_case(masked, e=4, rows=256, n=512)
    weights = _linear_weights(fmt, case.w32)
    swap = _check(fmt, case, device="cuda", weights=weights)
    for cfg in GPU_TILES:
        got = _check(fmt, case, device="cuda", config=cfg, weights=weights)
        assert_close(got, swap, f"{fmt} {cfg} against swap-AB")
    if not masked:
        shifted = _contig_case(3, [0] * 96 + [1] * 256 + [2] * 160, k=2880, n=256, row_weights=True)
        for cfg in GPU_TILES:
            _check(fmt, shifted, device="cuda", config=cfg)
    if fmt == "nvfp4":
        _check(fmt, case, torch.float16, device="cuda", config=GPU_TILES[0], weights=weights)
