"""MoE expert grouped GEMM ops: torch.library registration, fakes, typed public API.

Contract: dispatch/reference/moe_gemm.py; layouts and conventions: docs/moe_gemm.md. The weight formats over the
two activation layouts `moe_align` / `moe_masked_layout` produce:

* contiguous: a (M, K) rows grouped by expert, `m_indices` (M,) int32 expert id per row; -1 (padding) and
  out-of-range ids are never read and their output rows are 0;
* masked: a (E, max_m, K) with `masked_m` (E,) int32 counts (clamped to [0, max_m]); rows past the count are 0.

`row_weights` (fp32, a.shape[:-1]) scales each computed row before its one rounding (GEMM2's top-k weights).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from triton_ops.contract.formats import fp8_scale_storage
from triton_ops.contract.fp4_prepack import check_fp4_prepacked, check_prepack, prepacked_shapes
from triton_ops.contract.moe_gemm import (
    check_bf16,
    check_blockscaled,
    check_blockscaled_masked,
    check_combine_args,
    check_fp8,
    check_gemm_combine,
    check_gemm_swiglu,
    check_gemm_swiglu_fp4,
    check_mxfp4,
    check_nvfp4,
    check_row_weights,
    check_swiglu_args,
    check_w4a4,
    check_w4a8,
    fp4_views,
    nvfp4_views,
)

from ._common import call, lowbit_op
from ._quant_outputs import _fake_quant
from .quant import FP8GroupQuantized, MXFP4Quantized, NVFP4Quantized, ScaleLayout, _layout_flag


def _out(a: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    return a.new_empty((*a.shape[:-1], n), dtype=dtype)


def _with_row_weights(op: str, check):
    """The op's check: `check` on every argument but the trailing `row_weights`, then the row weights against a."""
    def checked(*args):
        check(*args[:-1])
        check_row_weights(op, args[0], args[-1])
    return checked


_check_bf16 = _with_row_weights("moe_gemm_bf16", check_bf16)
_check_fp8 = _with_row_weights("moe_gemm_fp8", check_fp8)
_check_mxfp4 = _with_row_weights("moe_gemm_mxfp4", check_mxfp4)
_check_nvfp4 = _with_row_weights("moe_gemm_nvfp4", check_nvfp4)
_check_w4a8 = _with_row_weights("moe_gemm_w4a8", check_w4a8)
_check_w4a4 = _with_row_weights("moe_gemm_w4a4", check_w4a4)
_check_fp4_prepacked = _with_row_weights("moe_gemm_fp4_prepacked", check_fp4_prepacked)


@lowbit_op("moe_gemm_blockscaled", mutates_args=(), check=check_blockscaled)
def _moe_gemm_blockscaled(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor, alpha: Tensor,
                          fmt: str, backend: str) -> Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.bfloat16)


@lowbit_op("moe_gemm_blockscaled_masked", mutates_args=(), check=check_blockscaled_masked)
def _moe_gemm_blockscaled_masked(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, masked_m: Tensor,
                                 alpha: Tensor, fmt: str, backend: str) -> Tensor:
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=torch.bfloat16)


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


@lowbit_op("moe_gemm_nvfp4", mutates_args=(), check=_check_nvfp4)
def _moe_gemm_nvfp4(a: Tensor, w_packed: Tensor, w_scale: Tensor, w_global: Tensor, m_indices: Tensor | None,
                    masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w_packed.shape[1], a.dtype)


@lowbit_op("moe_gemm_w4a8", mutates_args=(), check=_check_w4a8)
def _moe_gemm_w4a8(a: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, m_indices: Tensor | None,
                   masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w_packed.shape[1], torch.bfloat16)


@lowbit_op("moe_gemm_w4a4", mutates_args=(), check=_check_w4a4)
def _moe_gemm_w4a4(a: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, m_indices: Tensor | None,
                   masked_m: Tensor | None, row_weights: Tensor | None, backend: str) -> Tensor:
    return _out(a, w_packed.shape[1], torch.bfloat16)


def _check_prepack(w_packed, w_scale, fmt):
    check_prepack(*fp4_views(*nvfp4_views(w_packed, w_scale)), fmt)


@lowbit_op("moe_gemm_fp4_prepack", mutates_args=(), check=_check_prepack)
def _moe_gemm_fp4_prepack(w_packed: Tensor, w_scale: Tensor, fmt: str, backend: str) -> tuple[Tensor, Tensor]:
    e, n, kh = w_packed.shape
    vs, ss = prepacked_shapes(e, n, 2 * kh, fmt)
    return w_packed.new_empty(vs, dtype=torch.int32), w_packed.new_empty(ss, dtype=torch.uint8)


@lowbit_op("moe_gemm_fp4_prepacked", mutates_args=(), check=_check_fp4_prepacked)
def _moe_gemm_fp4_prepacked(a: Tensor, w_values: Tensor, w_scales: Tensor, w_global: Tensor | None, fmt: str,
                            m_indices: Tensor | None, masked_m: Tensor | None, row_weights: Tensor | None,
                            backend: str) -> Tensor:
    return _out(a, w_values.shape[1], a.dtype)


def _check_swiglu_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, interleave, activation,
                                alpha, limit):
    op = "moe_gemm_swiglu_fp4_prepacked"
    check_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, op=op)
    check_swiglu_args(op, w_values.shape[1], interleave, activation, alpha, limit, w_name="w_values")


@lowbit_op("moe_gemm_swiglu_fp4_prepacked", mutates_args=(), check=_check_swiglu_fp4_prepacked)
def _moe_gemm_swiglu_fp4_prepacked(a: Tensor, w_values: Tensor, w_scales: Tensor, w_global: Tensor | None, fmt: str,
                                   m_indices: Tensor | None, masked_m: Tensor | None, interleave: int,
                                   activation: str, alpha: float, limit: float | None, backend: str) -> Tensor:
    return _out(a, w_values.shape[1] // 2, a.dtype)


def _check_combine_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, src_rows, inv_rows,
                                 topk_weights, shared, out_dtype):
    op = "moe_gemm_combine_fp4_prepacked"
    check_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, op=op)
    check_combine_args(op, a, w_values.shape[1], src_rows, inv_rows, topk_weights, shared, out_dtype)


@lowbit_op("moe_gemm_combine_fp4_prepacked", mutates_args=(), check=_check_combine_fp4_prepacked)
def _moe_gemm_combine_fp4_prepacked(a: Tensor, w_values: Tensor, w_scales: Tensor, w_global: Tensor | None,
                                    fmt: str, m_indices: Tensor | None, masked_m: Tensor | None, src_rows: Tensor,
                                    inv_rows: Tensor, topk_weights: Tensor, shared: Tensor | None,
                                    out_dtype: torch.dtype, backend: str) -> Tensor:
    return a.new_empty((inv_rows.shape[0], w_values.shape[1]), dtype=out_dtype)


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


def moe_gemm_nvfp4(a: Tensor, w_packed: Tensor, w_scale: Tensor, w_global: Tensor, *,
                   m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                   row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """bf16 / fp16 activations x NVFP4 weights (W4A16): w_packed uint8 (E, N, K/2) e2m1 codes (element 2i in the
    low nibble), w_scale (E, N, K/16) E4M3 block scales (uint8 codes or float8_e4m3fn; the linear layout), w_global
    fp32 (E,) decode-form global scale per expert: value = e2m1 * e4m3 * w_global[e]. What `nvfp4_quantize(w[e])`
    writes for each expert (codes, scales, global_scale), stacked. K a multiple of 16. Out: a's dtype."""
    return call("moe_gemm_nvfp4", a, w_packed, w_scale, w_global, m_indices, masked_m, row_weights, backend)


def moe_gemm_fp4_prepack(w_packed: Tensor, w_scale: Tensor, fmt: Literal["mxfp4", "nvfp4"], *,
                         backend: str = "auto") -> tuple[Tensor, Tensor]:
    """One-time weight preparation for `moe_gemm_fp4_prepacked`: the quantizer's linear FP4 weights (w_packed
    (E, N, K/2) uint8 / float4_e2m1fn_x2 codes, w_scale (E, N, K/block): MXFP4 E8M0 per 32 or NVFP4 E4M3 per 16)
    -> (values int32 (E, N, KP/8), scales uint8 (E, N, SP)), KP = K rounded up to 128, SP = KP/block rounded up to
    16: the nibbles reordered
    so each thread of the Hopper decode kernel loads its MMA fragment with one 16-byte load and converts it with
    packed bit operations (layout: triton_ops/contract/fp4_prepack.py). No value changes (exact round trip)."""
    return call("moe_gemm_fp4_prepack", w_packed, w_scale, fmt, backend)


def moe_gemm_fp4_prepacked(a: Tensor, w_values: Tensor, w_scales: Tensor, *, fmt: Literal["mxfp4", "nvfp4"],
                           w_global: Tensor | None = None, m_indices: Tensor | None = None,
                           masked_m: Tensor | None = None, row_weights: Tensor | None = None,
                           backend: str = "auto") -> Tensor:
    """moe_gemm_mxfp4 (fmt="mxfp4", bf16 a) / moe_gemm_nvfp4 (fmt="nvfp4", bf16 / fp16 a, fp32 (E,) w_global) on
    weights prepacked by `moe_gemm_fp4_prepack`: same contract (the reference unpacks and runs those), a's dtype
    out. The GPU kernel is the swap-AB decode kernel (weights on the warpgroup MMA's M side, from registers)."""
    return call("moe_gemm_fp4_prepacked", a, w_values, w_scales, w_global, fmt, m_indices, masked_m, row_weights,
                backend)


def moe_gemm_swiglu_fp4_prepacked(a: Tensor, w_values: Tensor, w_scales: Tensor, *, fmt: Literal["mxfp4", "nvfp4"],
                                  w_global: Tensor | None = None, m_indices: Tensor | None = None,
                                  masked_m: Tensor | None = None, interleave: int = 0,
                                  activation: Literal["silu", "gptoss"] = "silu", alpha: float = 1.702,
                                  limit: float | None = None, backend: str = "auto") -> Tensor:
    """GEMM1 + SwiGLU on prepacked FP4 weights: `moe_gemm_swiglu` (weights=fmt) on the weights
    `moe_gemm_fp4_prepack` prepacked, (E, 2I, ...) gate|up halves or interleaved at `interleave`. Bytes =
    moe_gemm_fp4_prepacked -> swiglu given the same accumulators; (rows, I) in a's dtype."""
    return call("moe_gemm_swiglu_fp4_prepacked", a, w_values, w_scales, w_global, fmt, m_indices, masked_m,
                *_sw(interleave, activation, alpha, limit), backend)


def moe_gemm_combine_fp4_prepacked(a: Tensor, w_values: Tensor, w_scales: Tensor, src_rows: Tensor, inv_rows: Tensor,
                                   topk_weights: Tensor, *, fmt: Literal["mxfp4", "nvfp4"],
                                   w_global: Tensor | None = None, m_indices: Tensor | None = None,
                                   masked_m: Tensor | None = None, shared: Tensor | None = None,
                                   out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> Tensor:
    """GEMM2 into token order + the combine on prepacked FP4 weights: `moe_gemm_combine` (weights=fmt) on the
    weights `moe_gemm_fp4_prepack` prepacked. Bytes = moe_gemm_fp4_prepacked -> moe_combine; (T, N) in out_dtype."""
    return call("moe_gemm_combine_fp4_prepacked", a, w_values, w_scales, w_global, fmt, m_indices, masked_m, src_rows,
                inv_rows, topk_weights, shared, out_dtype, backend)


def moe_gemm_w4a8(a: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, *,
                  m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                  row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """FP8 activations x MXFP4 weights (W4A8): a E4M3 with fp32 1x128 scales (`fp8_group_quantize`, row- or
    column-major scales), weights as `moe_gemm_mxfp4` takes them. Through `tl.dot_scaled`: the native
    block-scaled MMA on Blackwell, an upcast + WGMMA on Hopper. bf16 out."""
    return call("moe_gemm_w4a8", a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights, backend)


def moe_gemm_w4a4(a: Tensor, a_scale: Tensor, w_packed: Tensor, w_scale: Tensor, *,
                  m_indices: Tensor | None = None, masked_m: Tensor | None = None,
                  row_weights: Tensor | None = None, backend: str = "auto") -> Tensor:
    """MXFP4 activations x MXFP4 weights (W4A4): a uint8 (*rows, K/2) and a_scale uint8 (*rows, K/32)
    as `mxfp4_quantize(x, scale_layout="linear")` writes them; weights as `moe_gemm_mxfp4` takes them. Through
    `tl.dot_scaled` (native FP4 MMA on Blackwell, upcast on Hopper). bf16 out."""
    return call("moe_gemm_w4a4", a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights, backend)


# ------------------------------------------------------------------------ GEMM1 + SwiGLU (+ FP8 1xG quant)


def _check_gemm_swiglu(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                       w_global):
    check_gemm_swiglu("moe_gemm_swiglu", weights, a, a_scale, w, w_scale, m_indices, masked_m, interleave,
                      activation, alpha, limit, w_global=w_global)


def _check_gemm_swiglu_fp8(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                           limit, group_size, quant_eps, ue8m0, column_major, w_global):
    check_gemm_swiglu("moe_gemm_swiglu_fp8_group", weights, a, a_scale, w, w_scale, m_indices, masked_m,
                      interleave, activation, alpha, limit, group_size, quant_eps, w_global=w_global)


def _check_gemm_swiglu_mxfp4(*args):
    check_gemm_swiglu_fp4("mxfp4", *args)


def _check_gemm_swiglu_nvfp4(*args):
    check_gemm_swiglu_fp4("nvfp4", *args)


def _swiglu_out_dtype(a: Tensor, weights: str) -> torch.dtype:
    return a.dtype if weights in ("bf16", "nvfp4") else torch.bfloat16


@lowbit_op("moe_gemm_swiglu", mutates_args=(), check=_check_gemm_swiglu)
def _moe_gemm_swiglu(a: Tensor, a_scale: Tensor | None, w: Tensor, w_scale: Tensor | None,
                     m_indices: Tensor | None, masked_m: Tensor | None, weights: str, interleave: int,
                     activation: str, alpha: float, limit: float | None, w_global: Tensor | None,
                     backend: str) -> Tensor:
    return _out(a, w.shape[1] // 2, _swiglu_out_dtype(a, weights))


@lowbit_op("moe_gemm_swiglu_fp8_group", mutates_args=(), check=_check_gemm_swiglu_fp8)
def _moe_gemm_swiglu_fp8_group(a: Tensor, a_scale: Tensor | None, w: Tensor, w_scale: Tensor | None,
                               m_indices: Tensor | None, masked_m: Tensor | None, weights: str, interleave: int,
                               activation: str, alpha: float, limit: float | None, group_size: int,
                               quant_eps: float, ue8m0: bool, column_major: bool, w_global: Tensor | None,
                               backend: str) -> tuple[Tensor, Tensor]:
    i = w.shape[1] // 2
    return (_out(a, i, torch.float8_e4m3fn),
            fp8_scale_storage(tuple(a.shape[:-1]), i // group_size, column_major, a.device))


@lowbit_op("moe_gemm_swiglu_mxfp4", mutates_args=(), check=_check_gemm_swiglu_mxfp4)
def _moe_gemm_swiglu_mxfp4(a: Tensor, a_scale: Tensor | None, w: Tensor, w_scale: Tensor | None,
                           m_indices: Tensor | None, masked_m: Tensor | None, weights: str, interleave: int,
                           activation: str, alpha: float, limit: float | None, rounding: str, swizzle: bool,
                           w_global: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    return _fake_quant(a, tuple(a.shape[:-1]), w.shape[1] // 2, "mxfp4", (rounding, swizzle))


@lowbit_op("moe_gemm_swiglu_nvfp4", mutates_args=(), check=_check_gemm_swiglu_nvfp4)
def _moe_gemm_swiglu_nvfp4(a: Tensor, a_scale: Tensor | None, w: Tensor, w_scale: Tensor | None,
                           m_indices: Tensor | None, masked_m: Tensor | None, weights: str, interleave: int,
                           activation: str, alpha: float, limit: float | None, global_scale: Tensor | None,
                           swizzle: bool, w_global: Tensor | None, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_quant(a, tuple(a.shape[:-1]), w.shape[1] // 2, "nvfp4", (global_scale, swizzle))


def _sw(interleave, activation, alpha, limit):
    return int(interleave), activation, float(alpha), None if limit is None else float(limit)


def moe_gemm_swiglu(a: Tensor, w: Tensor, *, a_scale: Tensor | None = None, w_scale: Tensor | None = None,
                    weights: Literal["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"] = "bf16",
                    m_indices: Tensor | None = None, masked_m: Tensor | None = None, interleave: int = 0,
                    activation: Literal["silu", "gptoss"] = "silu", alpha: float = 1.702, limit: float | None = None,
                    backend: str = "auto", w_global: Tensor | None = None) -> Tensor:
    """MoE GEMM1 with SwiGLU in its epilogue: y = swiglu(a @ w[e].T) over the layout, w (E, 2I, K) with gate|up
    halves (interleave 0) or chunks of `interleave` rows alternating gate/up. Operands as moe_gemm_<weights>
    takes them (fp8: a_scale + w_scale; mxfp4: packed w + w_scale; nvfp4: packed w + E4M3 w_scale + fp32 (E,)
    w_global, which only nvfp4 takes). Bytes = moe_gemm_<weights> -> swiglu (same activation arguments;
    uncomputed rows 0) given the same accumulators. Out: (rows, I), a's dtype for bf16/fp16 and nvfp4, else
    bf16."""
    return call("moe_gemm_swiglu", a, a_scale, w, w_scale, m_indices, masked_m, weights,
                *_sw(interleave, activation, alpha, limit), w_global, backend)


def moe_gemm_swiglu_fp8_group(a: Tensor, w: Tensor, *, a_scale: Tensor | None = None, w_scale: Tensor | None = None,
                              weights: Literal["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"] = "bf16",
                              m_indices: Tensor | None = None, masked_m: Tensor | None = None, interleave: int = 0,
                              activation: Literal["silu", "gptoss"] = "silu", alpha: float = 1.702,
                              limit: float | None = None, group_size: int = 128, quant_eps: float = 1e-10,
                              ue8m0: bool = False, column_major_scales: bool = False,
                              backend: str = "auto", w_global: Tensor | None = None) -> FP8GroupQuantized:
    """moe_gemm_swiglu with its output quantized to FP8 E4M3 1 x group_size groups in the same pass: the codes
    and scales fp8_group_quantize writes (what moe_gemm_fp8 reads as GEMM2's activations). Bytes = moe_gemm ->
    swiglu_fp8_group. w_global: NVFP4's global scales (nvfp4 only), as moe_gemm_swiglu."""
    return FP8GroupQuantized(*call("moe_gemm_swiglu_fp8_group", a, a_scale, w, w_scale, m_indices, masked_m,
                                   weights, *_sw(interleave, activation, alpha, limit), int(group_size),
                                   float(quant_eps), bool(ue8m0), bool(column_major_scales), w_global, backend))


def moe_gemm_swiglu_mxfp4(a: Tensor, w: Tensor, *, a_scale: Tensor | None = None, w_scale: Tensor | None = None,
                          weights: Literal["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"] = "bf16",
                          m_indices: Tensor | None = None, masked_m: Tensor | None = None, interleave: int = 0,
                          activation: Literal["silu", "gptoss"] = "silu", alpha: float = 1.702,
                          limit: float | None = None, rounding: Literal["floor", "rceil"] = "floor",
                          scale_layout: ScaleLayout = "linear", backend: str = "auto",
                          w_global: Tensor | None = None) -> MXFP4Quantized:
    """moe_gemm_swiglu with its output quantized to MXFP4 in the same pass (I a multiple of 32): codes uint8
    (rows, I/2) and E8M0 scales as swiglu_mxfp4 writes them. scale_layout "linear" (rows, I/32): what
    moe_gemm_w4a4 takes as activations; "swizzled" (the 128x4 container of the rows, masked layout: of the
    E * max_m rows): what moe_gemm_blockscaled takes. Bytes = moe_gemm_<weights> -> swiglu_mxfp4; uncomputed rows
    hold zero bytes."""
    swizzle = _layout_flag("moe_gemm_swiglu_mxfp4", scale_layout)
    return MXFP4Quantized(*call("moe_gemm_swiglu_mxfp4", a, a_scale, w, w_scale, m_indices, masked_m, weights,
                                *_sw(interleave, activation, alpha, limit), rounding, swizzle, w_global, backend))


def moe_gemm_swiglu_nvfp4(a: Tensor, w: Tensor, *, a_scale: Tensor | None = None, w_scale: Tensor | None = None,
                          weights: Literal["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"] = "bf16",
                          m_indices: Tensor | None = None, masked_m: Tensor | None = None, interleave: int = 0,
                          activation: Literal["silu", "gptoss"] = "silu", alpha: float = 1.702,
                          limit: float | None = None, global_scale: Tensor | None = None,
                          scale_layout: ScaleLayout = "linear", backend: str = "auto",
                          w_global: Tensor | None = None) -> NVFP4Quantized:
    """moe_gemm_swiglu with its output quantized to NVFP4 (I a multiple of 16): codes, E4M3 scales (linear or the
    128x4 container) and the fp32 global scale, as swiglu_nvfp4 writes them. global_scale: a scalar or one per
    expert (E,) (fp32, decode form): quantized in the GEMM's epilogue; None: amax of the whole output / 2688, the
    float output quantized afterwards (two more passes over it). Bytes = moe_gemm_<weights> -> swiglu_nvfp4; rows
    not computed hold zero bytes. w_global: the NVFP4 weights' global scales (weights="nvfp4" only)."""
    swizzle = _layout_flag("moe_gemm_swiglu_nvfp4", scale_layout)
    return NVFP4Quantized(*call("moe_gemm_swiglu_nvfp4", a, a_scale, w, w_scale, m_indices, masked_m, weights,
                                *_sw(interleave, activation, alpha, limit), global_scale, swizzle, w_global,
                                backend))


# ---------------------------------------------------------------- GEMM2 scattered into token order + combine


def _check_gemm_combine(a, a_scale, w, w_scale, m_indices, masked_m, weights, src_rows, inv_rows, topk_weights,
                        shared, out_dtype, w_global):
    check_gemm_combine("moe_gemm_combine", weights, a, a_scale, w, w_scale, m_indices, masked_m, src_rows, inv_rows,
                       topk_weights, shared, out_dtype, w_global)


@lowbit_op("moe_gemm_combine", mutates_args=(), check=_check_gemm_combine)
def _moe_gemm_combine(a: Tensor, a_scale: Tensor | None, w: Tensor, w_scale: Tensor | None,
                      m_indices: Tensor | None, masked_m: Tensor | None, weights: str, src_rows: Tensor,
                      inv_rows: Tensor, topk_weights: Tensor, shared: Tensor | None, out_dtype: torch.dtype,
                      w_global: Tensor | None, backend: str) -> Tensor:
    return a.new_empty((inv_rows.shape[0], w.shape[1]), dtype=out_dtype)


def moe_gemm_combine(a: Tensor, w: Tensor, src_rows: Tensor, inv_rows: Tensor, topk_weights: Tensor, *,
                     a_scale: Tensor | None = None, w_scale: Tensor | None = None,
                     weights: Literal["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"] = "bf16",
                     m_indices: Tensor | None = None, masked_m: Tensor | None = None, shared: Tensor | None = None,
                     out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto",
                     w_global: Tensor | None = None) -> Tensor:
    """MoE GEMM2 into token order: y[t] = sum_j topk_weights[t, j] * (a @ w[e].T)[row of (t, j)] (+ shared[t]),
    (T, N) in out_dtype. The GEMM's epilogue scatters each row (rounded to the GEMM's dtype) to its entry t * k + j
    (src_rows: moe_align's sorted_token_ids / moe_masked_layout's src_rows), then a combine sums each token's k
    slots in slot order in fp32 (no atomics). Bytes = moe_gemm_<weights> -> moe_combine (inv_rows: the same
    layout's). w_global: NVFP4's fp32 (E,) global scales (nvfp4 only)."""
    return call("moe_gemm_combine", a, a_scale, w, w_scale, m_indices, masked_m, weights, src_rows, inv_rows,
                topk_weights, shared, out_dtype, w_global, backend)


def moe_gemm_blockscaled(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, offsets: Tensor, alpha: Tensor,
                         fmt: str = "nvfp4", *, backend: str = "auto") -> Tensor:
    """FP4 x FP4 grouped GEMM over group row offsets (Blackwell's block-scaled MMA): a [M, K/2] E2M1 pairs with
    a_scale in the 128x4-swizzled layout (`nvfp4_quantize` / `mxfp4_quantize(..., scale_layout="swizzled")`), b
    [G, N, K/2] with one swizzled scale container per group, offsets [G + 1] int32 group row starts and end
    (`moe_align`'s expert offsets with block_m 128; the sm_100 kernel needs them multiples of 128 and does not check
    the values: a device read), alpha [G] fp32 (NVFP4: the product of the two global scales).
    out [M, N] bf16; rows in no group are 0. sm_100: the CuTeDSL tcgen05 kernel (compiled only, never run on a
    Blackwell chip: by LOWBIT_CUTE_UNVERIFIED=1); elsewhere the reference."""
    return call("moe_gemm_blockscaled", a, a_scale, b, b_scale, offsets, alpha, fmt, backend)


def moe_gemm_blockscaled_masked(a: Tensor, a_scale: Tensor, b: Tensor, b_scale: Tensor, masked_m: Tensor,
                                alpha: Tensor, fmt: str = "nvfp4", *, backend: str = "auto") -> Tensor:
    """moe_gemm_blockscaled over the masked layout: a [E, max_m, K/2] E2M1 pairs, a_scale the 128x4-swizzled
    container of its E * max_m rows (the quantizer's output for the [E * max_m, K] view), b / b_scale / alpha as
    moe_gemm_blockscaled, masked_m [E] int32 rows per expert (clamped to [0, max_m]; a device read, no host sync on
    the kernel path). out [E, max_m, N] bf16, rows past an expert's count 0. sm_100: the CuTeDSL tcgen05 kernel
    (swap-AB tiles for max_m <= 64; compiled only, never run on a Blackwell chip: by LOWBIT_CUTE_UNVERIFIED=1);
    elsewhere the reference."""
    return call("moe_gemm_blockscaled_masked", a, a_scale, b, b_scale, masked_m, alpha, fmt, backend)


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

    def mxfp4_weights(dev, small):
        """(a fp32, packed MXFP4 weights, E8M0 scales, m_indices, generator, K) of the MXFP4-weight cases."""
        k = 128 if small else 2048
        a, w, mi, g = layout(dev, small, 4 if small else 32, k, 128 if small else 1024)
        packed = torch.randint(0, 256, (w.shape[0], w.shape[1], k // 2), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 128, (w.shape[0], w.shape[1], k // 32), generator=g, dtype=torch.uint8)
        return a, packed.to(dev), scales.to(dev), mi, g, k

    def mxfp4(dev, small):
        a, packed, scales, mi, _, _ = mxfp4_weights(dev, small)
        return (a.bfloat16(), packed, scales, mi, None, None)

    def nvfp4(dev, small):
        """NVFP4 weights from random bytes: any code, E4M3 scales 2^-4 .. 2^0 (0x20-0x38), a global per expert."""
        a, packed, _, mi, g, k = mxfp4_weights(dev, small)
        e, n = packed.shape[:2]
        scales = torch.randint(0x20, 0x39, (e, n, k // 16), generator=g, dtype=torch.uint8)
        w_global = torch.rand(e, generator=g) + 0.5
        return (a.bfloat16(), packed, scales.to(dev), w_global.to(dev), mi, None, None)

    def prepacked(dev, small, fmt):
        """The MXFP4 / NVFP4 cases' weights through the prepack (reference: the unpacked weights' contract)."""
        from ..reference.moe_gemm import moe_gemm_fp4_prepack
        if fmt == "mxfp4":
            a, packed, scales, mi, _, _ = mxfp4(dev, small)
            w_global = None
        else:
            a, packed, scales, w_global, mi, _, _ = nvfp4(dev, small)
        vals, sc = moe_gemm_fp4_prepack(packed, scales, fmt)
        return (a, vals, sc, w_global, fmt, mi, None, None)

    def swiglu_prepacked(dev, small):
        """GPT-OSS GEMM1 + SwiGLU on the prepacked MXFP4 case's weights (interleaved gate/up, clamp 7)."""
        a, vals, sc, _, fmt, mi, _, _ = prepacked(dev, small, "mxfp4")
        return (a, vals, sc, None, fmt, mi, None, 1, "gptoss", 1.702, 7.0)

    def combine_prepacked(dev, small):
        """The NVFP4 GEMM2 + combine case's weights through the prepack."""
        from ..reference.moe_gemm import moe_gemm_fp4_prepack
        a, _, packed, scales, mi, _, _, src, inv, tw, _, out_dtype, w_global = combine_nv(dev, small)
        vals, sc = moe_gemm_fp4_prepack(packed, scales, "nvfp4")
        return (a, vals, sc, w_global, "nvfp4", mi, None, src, inv, tw, None, out_dtype)

    def prepack(dev, small):
        _, packed, scales, _, _, _, _ = nvfp4(dev, small)
        return (packed, scales, "nvfp4")

    def w4(dev, small, fp4_acts):
        a, packed, scales, mi, g, k = mxfp4_weights(dev, small)
        rows = a.shape[0]
        if fp4_acts:
            acts = (torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8).to(dev),
                    torch.randint(122, 130, (rows, k // 32), generator=g, dtype=torch.uint8).to(dev))
        else:
            acts = ((a * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                    (torch.rand(rows, k // 128, generator=g) / 64).to(dev))
        return (*acts, packed, scales, mi, None, None)

    def swiglu_fp8(dev, small):
        a8, a_s, w8, w_s, mi, _, _ = fp8(dev, small)
        return (a8, a_s, w8, w_s, mi, None, "fp8", 0, "silu", 1.702, None, 64 if small else 128, 1e-10, False,
                False, None)

    def swiglu_mx(dev, small):
        a, packed, scales, mi, _, _ = mxfp4(dev, small)
        return (a, None, packed, scales, mi, None, "mxfp4", 1, "gptoss", 1.702, 7.0, None)

    def swiglu_nv(dev, small):
        a, packed, scales, w_global, mi, _, _ = nvfp4(dev, small)
        return (a, None, packed, scales, mi, None, "nvfp4", 0, "silu", 1.702, None, w_global)

    def swiglu_mx_out(dev, small):
        """GPT-OSS GEMM1 + SwiGLU on the MXFP4 case's weights, MXFP4 out with swizzled scales."""
        return (*swiglu_mx(dev, small)[:11], "floor", True, None)

    def swiglu_nv_out(dev, small):
        """The NVFP4 GEMM1 + silu case, NVFP4 out with one global scale per expert."""
        a, a_s, packed, scales, mi, mm, kind, il, act, alpha, limit, w_global = swiglu_nv(dev, small)
        gs = torch.full((packed.shape[0],), 0.01, device=dev)
        return (a, a_s, packed, scales, mi, mm, kind, il, act, alpha, limit, gs, False, w_global)

    def close_fp4(out, ref):
        # FP4 bytes: the GEMM sums differ from the reference's in order, so a rounded gate/up value (and the FP4
        # code or block scale it lands on) may differ by a step; require >= 99% equal bytes
        from ..selfcheck import byte_mismatches
        bad = sum(byte_mismatches(x, y) for x, y in zip(out, ref, strict=True))
        total = sum(x.numel() * x.element_size() for x in out)
        return bad <= max(1, total // 100), f"{bad} of {total} bytes differ"

    def combine(dev, small):
        g = torch.Generator().manual_seed(4)
        e, t, top_k, n, k = (4, 24, 2, 128, 128) if small else (64, 512, 8, 1024, 2048)
        ids = torch.randint(0, e, (t, top_k), generator=g, dtype=torch.int32)
        src, _, mi, _, _, _, inv = moe_align(ids, None, e, 16 if small else 128)
        a = torch.randn(src.shape[0], k, generator=g).bfloat16()
        w = (torch.randn(e, n, k, generator=g) / k ** 0.5).bfloat16()
        tw = torch.rand(t, top_k, generator=g)
        return tuple(x.to(dev) if isinstance(x, torch.Tensor) else x
                     for x in (a, None, w, None, mi, None, "bf16", src, inv, tw, None, torch.bfloat16, None))

    def combine_nv(dev, small):
        """GEMM2 with NVFP4 weights: the bf16 case's layout, its weights' shapes as NVFP4 bytes."""
        a, _, w, _, mi, _, _, src, inv, tw, _, out_dtype, _ = combine(dev, small)
        g = torch.Generator().manual_seed(6)
        e, n, k = w.shape
        packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8).to(dev)
        scales = torch.randint(0x20, 0x39, (e, n, k // 16), generator=g, dtype=torch.uint8).to(dev)
        w_global = (torch.rand(e, generator=g) / k ** 0.5).to(dev)
        return (a, None, packed, scales, mi, None, "nvfp4", src, inv, tw, None, out_dtype, w_global)

    def close_fp8(out, ref):
        from ..reference.quant import fp8_group_dequantize
        group = out[0].shape[-1] // out[1].shape[-1]
        err = normalized_error(*(fp8_group_dequantize(c, s, group, torch.float32) for c, s in (out, ref)))
        return err <= 3e-2, f"normalized error of the dequantized values {err:.2e}"

    def blockscaled(dev, small):
        g, n, k = (2, 128, 256) if small else (8, 1024, 2048)
        m = 128 * g
        gen = torch.Generator().manual_seed(5)
        cols = -(-(k // 16) // 4) * 4
        codes = lambda *shape: torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).to(dev)
        scales = lambda *shape: torch.randint(0x30, 0x40, shape, generator=gen, dtype=torch.uint8).to(dev)  # ~0.5-1
        offsets = torch.arange(0, m + 1, 128, dtype=torch.int32)
        offsets[1] = 0  # an empty first group
        alpha = (torch.rand(g, generator=gen) + 0.5).to(dev)
        return (codes(m, k // 2), scales(m, cols), codes(g, n, k // 2), scales(g, n, cols), offsets.to(dev), alpha,
                "nvfp4")

    def blockscaled_masked(dev, small):
        a, sfa, b, sfb, _, alpha, fmt = blockscaled(dev, small)
        e = b.shape[0]
        masked_m = torch.tensor([100, 128] + [7] * (e - 2), dtype=torch.int32)[:e]
        return (a.view(e, 128, -1), sfa, b, sfb, masked_m.to(dev), alpha, fmt)

    def close(out, ref):
        err = normalized_error(out, ref)
        return err <= 2e-2, f"normalized error {err:.2e}"

    return [
        Case("moe_gemm_swiglu_fp8_group", swiglu_fp8, close_fp8, label="FP8 W8A8 GEMM1 + silu + 1xG quant"),
        Case("moe_gemm_swiglu", swiglu_mx, close, label="MXFP4 GEMM1 + GPT-OSS swiglu, interleaved"),
        Case("moe_gemm_swiglu_mxfp4", swiglu_mx_out, close_fp4, label="MXFP4 GEMM1 + GPT-OSS swiglu + MXFP4 out"),
        Case("moe_gemm_swiglu_nvfp4", swiglu_nv_out, close_fp4, label="NVFP4 GEMM1 + silu + NVFP4 out, gs per expert"),
        Case("moe_gemm_swiglu", swiglu_nv, close, label="NVFP4 GEMM1 + silu"),
        Case("moe_gemm_combine", combine, close, label="bf16 GEMM2 into token order + combine"),
        Case("moe_gemm_combine", combine_nv, close, label="NVFP4 GEMM2 into token order + combine"),
        Case("moe_gemm_bf16", bf16, close, label="contiguous, moe_align rows"),
        Case("moe_gemm_fp8", fp8, close, label="contiguous, 1x128 / 128x128 scales"),
        Case("moe_gemm_mxfp4", mxfp4, close, label="contiguous, W4A16"),
        Case("moe_gemm_nvfp4", nvfp4, close, label="contiguous, NVFP4 W4A16"),
        Case("moe_gemm_w4a8", lambda d, s: w4(d, s, False), close, label="contiguous, FP8 x MXFP4"),
        Case("moe_gemm_fp4_prepack", prepack, label="NVFP4 weights to the prepacked layout"),
        Case("moe_gemm_fp4_prepacked", lambda d, s: prepacked(d, s, "mxfp4"), close, label="prepacked MXFP4 W4A16"),
        Case("moe_gemm_fp4_prepacked", lambda d, s: prepacked(d, s, "nvfp4"), close, label="prepacked NVFP4 W4A16"),
        Case("moe_gemm_swiglu_fp4_prepacked", swiglu_prepacked, close, label="prepacked MXFP4 GEMM1 + GPT-OSS swiglu"),
        Case("moe_gemm_combine_fp4_prepacked", combine_prepacked, close, label="prepacked NVFP4 GEMM2 + combine"),
        Case("moe_gemm_w4a4", lambda d, s: w4(d, s, True), close, label="contiguous, MXFP4 x MXFP4"),
        Case("moe_gemm_blockscaled", blockscaled, close, label="NVFP4 x NVFP4, group offsets, swizzled scales"),
        Case("moe_gemm_blockscaled_masked", blockscaled_masked, close, label="NVFP4 x NVFP4, masked layout"),
    ]
