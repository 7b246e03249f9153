"""MoE expert grouped GEMM ops: torch.library registration, fakes, typed public API.

Contract: dispatch/reference/moe_gemm.py; layouts and conventions: docs/moe_gemm.md. The weight formats over the
two activation layouts `moe_align` / `moe_masked_layout` produce:

* contiguous: a (M, K) rows grouped by expert, `m_indices` (M,) int32 expert id per row; -1 (padding) and
  out-of-range ids are never read and their output rows are 0;
* masked: a (E, max_m, K) with `masked_m` (E,) int32 counts (clamped to [0, max_m]); rows past the count are 0.

`row_weights` (fp32, a.shape[:-1]) scales each computed row before its one rounding (GEMM2's top-k weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

from triton_ops.contract.moe_gemm import (
    check_bf16,
    check_fp8,
    check_mxfp4,
    check_row_weights,
    check_w4a4,
    check_w4a8,
)

from ._common import call, lowbit_op


def _out(a: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return a.new_empty((*a.shape[:-1], n), dtype=dtype)


def _check_bf16(a, w, m_indices, masked_m, row_weights):
    check_bf16(a, w, m_indices, masked_m)
    check_row_weights("moe_gemm_bf16", a, row_weights)


def _check_fp8(a, a_scale, w, w_scale, m_indices, masked_m, row_weights):
    check_fp8(a, a_scale, w, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_fp8", a, row_weights)


def _check_mxfp4(a, w_packed, w_scale, m_indices, masked_m, row_weights):
    check_mxfp4(a, w_packed, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_mxfp4", a, row_weights)


def _check_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights):
    check_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_w4a8", a, row_weights)


def _check_w4a4(a_packed, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights):
    check_w4a4(a_packed, a_scale, w_packed, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_w4a4", a_packed, row_weights)


@lowbit_op("moe_gemm_bf16", mutates_args=(), check=_check_bf16)
def _moe_gemm_bf16(a: Tensor, w: Tensor, m_indices: Tensor | None, masked_m: Tensor | None,
                   row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w.shape[1], a.dtype)


@lowbit_op("moe_gemm_fp8", mutates_args=(), check=_check_fp8)
def _moe_gemm_fp8(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, m_indices: Tensor | None,
                  masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w.shape[1], torch.bfloat16)


@lowbit_op("moe_gemm_mxfp4", mutates_args=(), check=_check_mxfp4)
def _moe_gemm_mxfp4(a: Tensor, w_packed: Tensor, w_scale: Tensor, m_indices: Tensor | None,
                    masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w_packed.shape[1], torch.bfloat16)


@lowbit_op("moe_gemm_w4a8", mutates_args=(), check=_check_w4a8)
def _moe_gemm_w4a8(a: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, m_indices: Tensor | None,
                   masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w_packed.shape[1], torch.bfloat16)


@lowbit_op("moe_gemm_w4a4", mutates_args=(), check=_check_w4a4)
def _moe_gemm_w4a4(a_packed: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, m_indices: Tensor | None,
                   masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a_packed, w_packed.shape[1], torch.bfloat16)


def moe_gemm_bf16(a: Tensor, w: Tensor, *, m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                  row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """bf16/fp16 grouped GEMM: out[m] = a[m] @ w[e(m)].T with w (E, N, K); a's dtype out, fp32 accumulation.
    Give `m_indices` (contiguous layout, a 2-D) or `masked_m` (masked layout, a 3-D)."""
    return call("moe_gemm_bf16", a, w, m_indices, masked_m, row_weights, backend)


def moe_gemm_fp8(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, *, m_indices: Tensor | None = None,
                 masked_m: Tensor | None = None, row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """FP8 E4M3 W8A8 with DeepGEMM block scales: a_scale fp32 (*a.shape[:-1], K/128) (row-major, or the
    column-major TMA-aligned layout `fp8_group_quantize(..., column_major_scales=True)` writes), w (E, N, K)
    with w_scale fp32 (E, ceil(N/128), K/128); each K block's partial product is scaled in fp32. bf16 out."""
    return call("moe_gemm_fp8", a, a_scale, w, w_scale, m_indices, masked_m, row_weights, backend)


def moe_gemm_mxfp4(a: Tensor, w_packed: Tensor, w_scale: Tensor, *, m_indices: Tensor | None = None,
                   masked_m: Tensor | None = None, row_weights: Tensor | None = None,
                   backend: str = "auto") -> Tensor:
    """bf16 activations x MXFP4 weights (W4A16, GPT-OSS): w_packed uint8 (E, N, K/2) e2m1 codes, element 2i in
    the low nibble (what `mxfp4_quantize` writes for (E*N, K) rows), w_scale uint8 (E, N, K/32) E8M0
    exponents (linear layout). Dequantized in registers; bf16 out."""
    return call("moe_gemm_mxfp4", a, w_packed, w_scale, m_indices, masked_m, row_weights, backend)


def moe_gemm_w4a8(a: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, *,
                  m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                  row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """FP8 activations x MXFP4 weights (W4A8): a E4M3 with fp32 1x128 scales (`fp8_group_quantize`, row- or
    column-major scales), weights as `moe_gemm_mxfp4` takes them. Through `tl.dot_scaled`: the native
    block-scaled MMA on Blackwell, an upcast + WGMMA on Hopper. bf16 out."""
    return call("moe_gemm_w4a8", a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights, backend)


def moe_gemm_w4a4(a_packed: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, *,
                  m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                  row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """MXFP4 activations x MXFP4 weights (W4A4): a_packed uint8 (*rows, K/2) and a_scale uint8 (*rows, K/32)
    as `mxfp4_quantize(x, scale_layout="linear")` writes them; weights as `moe_gemm_mxfp4` takes them. Through
    `tl.dot_scaled` (native FP4 MMA on Blackwell, upcast on Hopper). bf16 out."""
    return call("moe_gemm_w4a4", a_packed, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights, backend)


# ------------------------------------------------------------------------------------------ self-check


def self_check_cases() -> list:
    """Cases for `python -m dispatch check`: DeepSeek-like experts, contiguous layout from moe_align."""
    from ..reference.moe import moe_align
    from ..selfcheck import Case, normalized_error

    def layout(dev, small, e, k, n):
        g = torch.Generator().manual_seed(3)
        t, top_k = (24, 2) if small else (512, 8)
        ids = torch.randint(0, e, (t, top_k), generator=g, dtype=torch.int32)
        m_indices = moe_align(ids, None, e, 16 if small else 128)[2]
        rows = m_indices.shape[0]
        a = torch.randn(rows, k, generator=g)
        w = torch.randn(e, n, k, generator=g) / k ** 0.5
        return a.to(dev), w.to(dev), m_indices.to(dev), g

    def bf16(dev, small):
        a, w, mi, _ = layout(dev, small, 4 if small else 64, 128 if small else 2048, 128 if small else 1024)
        return (a.bfloat16(), w.bfloat16(), mi, None, None)

    def fp8(dev, small):
        k = 256 if small else 2048
        a, w, mi, g = layout(dev, small, 4 if small else 64, k, 128 if small else 1024)
        a8 = a.clamp(-448, 448).to(torch.float8_e4m3fn)
        w8 = (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        a_s = torch.rand(a.shape[0], k // 128, generator=g).to(dev) + 0.5
        w_s = torch.rand(w.shape[0], -(-w.shape[1] // 128), k // 128, generator=g).to(dev) / 64
        return (a8, a_s, w8, w_s, mi, None, None)

    def mxfp4(dev, small):
        k = 128 if small else 2048
        a, w, mi, g = layout(dev, small, 4 if small else 32, k, 128 if small else 1024)
        packed = torch.randint(0, 256, (w.shape[0], w.shape[1], k // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 128, (w.shape[0], w.shape[1], k // 32), generator=g, dtype=torch.uint8)
        return (a.bfloat16(), packed.to(dev), scales.to(dev), mi, None, None)

    def w4(dev, small, fp4_acts):
        k = 128 if small else 2048
        a, w, mi, g = layout(dev, small, 4 if small else 32, k, 128 if small else 1024)
        packed = torch.randint(0, 256, (w.shape[0], w.shape[1], k // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 128, (w.shape[0], w.shape[1], k // 32), generator=g, dtype=torch.uint8)
        rows = a.shape[0]
        if fp4_acts:
            acts = (torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8).to(dev),
                    torch.randint(122, 130, (rows, k // 32), generator=g, dtype=torch.uint8).to(dev))
        else:
            acts = ((a * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                    (torch.rand(rows, k // 128, generator=g) / 64).to(dev))
        return (*acts, packed.to(dev), scales.to(dev), mi, None, None)

    def close(out, ref):
        err = normalized_error(out, ref)
        return err <= 2e-2, f"normalized error {err:.2e}"

    return [
        Case("moe_gemm_bf16", bf16, close, label="contiguous, moe_align rows"),
        Case("moe_gemm_fp8", fp8, close, label="contiguous, 1x128 / 128x128 scales"),
        Case("moe_gemm_mxfp4", mxfp4, close, label="contiguous, W4A16"),
        Case("moe_gemm_w4a8", lambda d, s: w4(d, s, False), close, label="contiguous, FP8 x MXFP4"),
        Case("moe_gemm_w4a4", lambda d, s: w4(d, s, True), close, label="contiguous, MXFP4 x MXFP4"),
    ]
