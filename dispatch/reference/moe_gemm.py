"""Reference MoE expert grouped GEMMs (the contract of triton_ops/moe_gemm): out[m, n] = sum_k a[m, k] *
w[e(m), n, k], computed per expert as one fp32 matmul of the dequantized operands, then cast once.

Layouts (docs/moe.md), exactly one of `m_indices` / `masked_m`:
* contiguous: a (M, K), m_indices (M,) int32 expert per row; rows whose id is outside [0, E) (-1 padding
  included) are zero output rows.
* masked: a (E, max_m, K), masked_m (E,) int32; rows >= clamp(masked_m[e], 0, max_m) are zero output rows.

Formats:
* bf16 / fp16: output in a's dtype.
* fp8: E4M3 codes; a scales fp32 (M, K/128) (or (E, max_m, K/128)), w scales fp32 (E, ceil(N/128), K/128),
  value = code * scale of its block; bf16 output.
* mxfp4: E2M1 pairs (E, N, K/2) uint8 (element 2i in the low nibble), E8M0 scales (E, N, K/32) uint8, value =
  e2m1 * 2^(s - 127) (s = 0 -> 2^-127, 0xFF -> NaN); bf16 activations; bf16 output.
* w4a8: the mxfp4 weights with the fp8 activations (E4M3 codes + fp32 1x128 scales); bf16 output.
* nvfp4: E2M1 pairs (E, N, K/2) uint8 as for mxfp4, E4M3 scales (E, N, K/16) (uint8 codes or float8_e4m3fn), fp32
  global scales (E,): value = (e2m1 * e4m3) * global[e] in fp32 (the first product exact, one fp32 rounding for
  the second, as nvfp4_dequantize); bf16 / fp16 activations, output in their dtype.
Optional `row_weights` (fp32, a.shape[:-1]): each computed row is multiplied by its weight before the cast
(the fused top-k weighting of GEMM2); zero rows stay zero.
"""

from __future__ import annotations

import torch

from triton_ops.contract import fp4_prepack as FP
from triton_ops.contract.formats import MXFP4_BLOCK, NVFP4_BLOCK
from triton_ops.contract.moe_gemm import FP8_BLOCK, blockscaled_views, fp4_views, nvfp4_views

from . import swiglu as SW
from .formats import e2m1_decode, unpack_nibbles
from .quant import e8m0_decode, fp8_group_dequantize, unswizzle_scales_128x4


def _grouped(a32: torch.Tensor, w32: torch.Tensor, m_indices, masked_m, row_weights, out_dtype) -> torch.Tensor:
    e, n = w32.shape[0], w32.shape[1]
    rw = None if row_weights is None else row_weights.float()
    if m_indices is not None:
        out = torch.zeros(a32.shape[0], n, dtype=torch.float32, device=a32.device)
        ids = m_indices.long()
        for x in range(e):
            rows = ids == x
            if rows.any():
                y = a32[rows] @ w32[x].T
                out[rows] = y if rw is None else y * rw[rows][:, None]
    else:
        out = torch.zeros(*a32.shape[:2], n, dtype=torch.float32, device=a32.device)
        counts = masked_m.long().clamp(0, a32.shape[1]).tolist()
        for x, c in enumerate(counts):
            if c:
                y = a32[x, :c] @ w32[x].T
                out[x, :c] = y if rw is None else y * rw[x, :c][:, None]
    return out.to(out_dtype)


def fp8_block_dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E4M3 weights (E, N, K) with fp32 128x128 block scales (E, ceil(N/128), K/128) -> fp32."""
    n = codes.shape[1]
    s = scales.float().repeat_interleave(FP8_BLOCK, 1)[:, :n].repeat_interleave(FP8_BLOCK, 2)
    return codes.float() * s


def mxfp4_weight_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """E2M1 pairs (E, N, K/2) + E8M0 scales (E, N, K/32) -> fp32 (E, N, K)."""
    e, n, kh = packed.shape
    vals = e2m1_decode(unpack_nibbles(packed.view(torch.uint8))).reshape(e, n, kh * 2 // MXFP4_BLOCK, MXFP4_BLOCK)
    return (vals * e8m0_decode(scales.view(torch.uint8))[..., None]).reshape(e, n, kh * 2)


def nvfp4_weight_dequantize(packed: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """E2M1 pairs (E, N, K/2) + E4M3 scales (E, N, K/16) + fp32 global scales (E,) -> fp32 (E, N, K)."""
    packed, scales = nvfp4_views(packed, scales)
    e, n, kh = packed.shape
    vals = e2m1_decode(unpack_nibbles(packed)).reshape(e, n, kh * 2 // NVFP4_BLOCK, NVFP4_BLOCK)
    s = scales.view(torch.float8_e4m3fn).float()
    return ((vals * s[..., None]) * global_scale.float().reshape(e, 1, 1, 1)).reshape(e, n, kh * 2)


def moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None):
    return _grouped(a.float(), w.float(), m_indices, masked_m, row_weights, a.dtype)


def moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m, row_weights=None):
    a32 = fp8_group_dequantize(a, a_scale, FP8_BLOCK, torch.float32)
    return _grouped(a32, fp8_block_dequantize(w, w_scale), m_indices, masked_m, row_weights, torch.bfloat16)


def moe_gemm_mxfp4(a, w_packed, w_scale, m_indices, masked_m, row_weights=None):
    w32 = mxfp4_weight_dequantize(w_packed, w_scale)
    return _grouped(a.float(), w32, m_indices, masked_m, row_weights, torch.bfloat16)


def moe_gemm_nvfp4(a, w_packed, w_scale, w_global, m_indices, masked_m, row_weights=None):
    """bf16 / fp16 activations x NVFP4 weights, dequantized to fp32 (nvfp4_weight_dequantize); a's dtype out."""
    w32 = nvfp4_weight_dequantize(w_packed, w_scale, w_global)
    return _grouped(a.float(), w32, m_indices, masked_m, row_weights, a.dtype)


def moe_gemm_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights=None):
    """E4M3 activations (fp32 1x128 scales) x MXFP4 weights: both dequantized exactly to fp32, then the GEMM."""
    a32 = fp8_group_dequantize(a, a_scale, FP8_BLOCK, torch.float32)
    return _grouped(a32, mxfp4_weight_dequantize(w_packed, w_scale), m_indices, masked_m, row_weights,
                    torch.bfloat16)


def moe_gemm_w4a4(a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights=None):
    """MXFP4 activations (packed pairs, E8M0 per 32, linear layout) x MXFP4 weights, dequantized exactly."""
    kh = a.shape[-1]
    a32 = mxfp4_weight_dequantize(a.reshape(1, -1, kh), a_scale.reshape(1, -1, a_scale.shape[-1]))
    a32 = a32.reshape(*a.shape[:-1], 2 * kh)
    return _grouped(a32, mxfp4_weight_dequantize(w_packed, w_scale), m_indices, masked_m, row_weights,
                    torch.bfloat16)


# ------------------------------------------------------------------ prepacked FP4 weights (the Hopper decode layout)


def moe_gemm_fp4_prepack(w_packed, w_scale, fmt: str):
    """The quantizer's linear FP4 weights -> (int32 values (E, N, KP/8), uint8 scales (E, N, SP)), the layout
    of triton_ops/contract/fp4_prepack.py (a byte permutation plus padding: no value changes)."""
    w_packed, w_scale = fp4_views(*nvfp4_views(w_packed, w_scale))  # torch's FP4 / E4M3 / E8M0 dtypes: their bytes
    k = w_packed.shape[-1] * 2
    return FP.prepack_values(w_packed), FP.prepack_scales(w_scale, k, fmt)


def moe_gemm_fp4_unpack(w_values, w_scales, k: int, fmt: str):
    """The inverse of moe_gemm_fp4_prepack for K = k: (linear codes (E, N, K/2), linear scales (E, N, K/block))."""
    return FP.unpack_values(w_values, k), FP.unpack_scales(w_scales, k, fmt)


def moe_gemm_fp4_prepacked(a, w_values, w_scales, w_global, fmt: str, m_indices, masked_m, row_weights=None):
    """a x prepacked FP4 weights: exactly moe_gemm_mxfp4 / moe_gemm_nvfp4 on the unpacked weights."""
    w_packed, w_scale = moe_gemm_fp4_unpack(w_values, w_scales, a.shape[-1], fmt)
    if fmt == "mxfp4":
        return moe_gemm_mxfp4(a, w_packed, w_scale, m_indices, masked_m, row_weights)
    return moe_gemm_nvfp4(a, w_packed, w_scale, w_global, m_indices, masked_m, row_weights)


# ------------------------------------------------------------------ GEMM1 + SwiGLU (+ FP8 1xG quantization)


def _gemm(weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global=None):
    """moe_gemm_<weights> (the plain reference, w_global: NVFP4's global scales)."""
    if weights == "nvfp4":
        return moe_gemm_nvfp4(a, w, w_scale, w_global, m_indices, masked_m)
    if weights == "fp8":
        return moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m)
    if weights == "mxfp4":
        return moe_gemm_mxfp4(a, w, w_scale, m_indices, masked_m)
    if weights == "w4a8":
        return moe_gemm_w4a8(a, a_scale, w, w_scale, m_indices, masked_m)
    return moe_gemm_bf16(a, w, m_indices, masked_m)


def moe_gemm_swiglu(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                    w_global=None):
    """The chain moe_gemm_<weights> -> swiglu over the same layout: h = the GEMM's output (rounded to its dtype),
    y = swiglu(h) (w (E, 2I, K): gate|up halves or interleaved at `interleave`), uncomputed rows 0. w_global:
    NVFP4's fp32 (E,) global scales (None for the other kinds)."""
    h = _gemm(weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    return SW.swiglu(h, interleave, activation, alpha, limit, m_indices, masked_m)


def moe_gemm_swiglu_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, interleave, activation,
                                  alpha, limit):
    """moe_gemm_swiglu (weights = fmt) on the unpacked weights."""
    w_packed, w_scale = moe_gemm_fp4_unpack(w_values, w_scales, a.shape[-1], fmt)
    return moe_gemm_swiglu(a, None, w_packed, w_scale, m_indices, masked_m, fmt, interleave, activation, alpha,
                           limit, w_global)


def moe_gemm_combine_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, src_rows, inv_rows,
                                   topk_weights, shared, out_dtype):
    """moe_gemm_combine (weights = fmt) on the unpacked weights."""
    w_packed, w_scale = moe_gemm_fp4_unpack(w_values, w_scales, a.shape[-1], fmt)
    return moe_gemm_combine(a, None, w_packed, w_scale, m_indices, masked_m, fmt, src_rows, inv_rows, topk_weights,
                            shared, out_dtype, w_global)


def moe_gemm_swiglu_fp8_group(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                              limit, group_size, quant_eps, ue8m0, column_major, w_global=None):
    """moe_gemm_swiglu, then fp8_group_quantize of its (rounded) output: the chain moe_gemm -> swiglu_fp8_group."""
    h = _gemm(weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    return SW.swiglu_fp8_group(h, interleave, activation, alpha, limit, m_indices, masked_m, None, group_size,
                               quant_eps, ue8m0, column_major)


def moe_gemm_swiglu_mxfp4(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                          rounding, swizzle, w_global=None):
    """The chain moe_gemm_<weights> -> swiglu_mxfp4 (the GEMM's dtype in, no out_dtype)."""
    h = _gemm(weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    return SW.swiglu_mxfp4(h, interleave, activation, alpha, limit, m_indices, masked_m, None, rounding, swizzle)


def moe_gemm_swiglu_nvfp4(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                          global_scale, swizzle, w_global=None):
    """The chain moe_gemm_<weights> -> swiglu_nvfp4: global_scale a scalar, one per expert (the op requires one for
    every expert, E' >= E) or None (amax of the whole output / 2688)."""
    h = _gemm(weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    return SW.swiglu_nvfp4(h, interleave, activation, alpha, limit, m_indices, masked_m, None, global_scale, swizzle)


def moe_gemm_combine(a, a_scale, w, w_scale, m_indices, masked_m, weights, src_rows, inv_rows, topk_weights, shared,
                     out_dtype, w_global=None):
    """The chain moe_gemm_<weights> -> moe_combine: y[t] = sum_j topk_weights[t, j] * h[inv_rows[t, j]] (slot order,
    fp32, rows -1 skipped) + shared[t], one rounding to out_dtype; h the GEMM's rounded output. src_rows (the
    layout's entry per row) is where a fused kernel scatters h; the layout makes it the inverse of inv_rows."""
    from .moe import moe_combine

    h = _gemm(weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    return moe_combine(h, inv_rows, topk_weights, shared, out_dtype)


# ------------------------------------------------------------------ block-scaled FP4 x FP4 (sm_100 UMMA kernels)

FP4_SF_VEC = {"nvfp4": 16, "mxfp4": 32}


def fp4_blockscaled_decode(codes: torch.Tensor, swizzled_scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """[rows, K/2] packed e2m1 codes + their 128x4-swizzled scale container -> fp32 [rows, K] (NVFP4: e4m3 scales
    per 16, no global scale here; MXFP4: E8M0 per 32)."""
    rows, k = codes.shape[0], codes.shape[1] * 2
    sf_vec = FP4_SF_VEC[fmt]
    kblocks = k // sf_vec
    sbytes = unswizzle_scales_128x4(swizzled_scales.reshape(-1).view(torch.uint8), rows, kblocks)
    s = sbytes.view(torch.float8_e4m3fn).float() if fmt == "nvfp4" else e8m0_decode(sbytes)
    vals = e2m1_decode(unpack_nibbles(codes.view(torch.uint8))).reshape(rows, kblocks, sf_vec)
    return (vals * s[..., None]).reshape(rows, k)


def _blockscaled_groups(a, sfa, b, sfb, starts, counts, alpha, fmt: str, out: torch.Tensor | None):
    """out[r] = bf16(alpha[g] * dec(a[r]) @ dec(b[g]).T) for starts[g] <= r < starts[g] + counts[g] (python ints);
    other rows keep out's values (0 when out is None)."""
    m, (g, n, _) = a.shape[0], b.shape
    if out is None:
        out = torch.zeros(m, n, dtype=torch.bfloat16, device=a.device)
    a32 = fp4_blockscaled_decode(a, sfa, fmt)
    for e in range(g):
        lo, hi = starts[e], starts[e] + counts[e]
        if hi > lo:
            w = fp4_blockscaled_decode(b[e], sfb[e], fmt)
            out[lo:hi] = (alpha[e].float() * (a32[lo:hi] @ w.T)).to(torch.bfloat16)
    return out


def grouped_blockscaled_gemm(a, sfa, b, sfb, offsets, alpha, fmt: str, out: torch.Tensor | None = None):
    """a [M, K/2] u8 with sfa (swizzled, all M rows), b [G, N, K/2] u8 with sfb [G, ...] (each group's own
    swizzled container), offsets [G + 1] int32, alpha [G] fp32 -> out [M, N] bf16:
    out[r] = bf16(alpha[g] * dec(a[r]) @ dec(b[g]).T) for offsets[g] <= r < offsets[g + 1]; rows in no group keep
    out's values (0 when out is None). fp32 products and sums: a GPU comparison needs a tolerance, not bit equality."""
    offs = [int(x) for x in offsets.tolist()]
    counts = [hi - lo for lo, hi in zip(offs[:-1], offs[1:], strict=True)]
    return _blockscaled_groups(a, sfa, b, sfb, offs[:-1], counts, alpha, fmt, out)


def moe_gemm_blockscaled(a, a_scale, b, b_scale, offsets, alpha, fmt: str):
    """The `moe_gemm_blockscaled` contract: offsets are clamped to [0, M] and each is raised to the largest one before
    it, so groups never overlap; group g owns rows [offsets[g], offsets[g + 1]) of those (empty when equal), out =
    bf16(alpha[g] * dec(a) @ dec(b[g]).T) there, and rows in no group are 0."""
    m = a.shape[0]
    offs = offsets.to(torch.int64).clamp(0, m)
    offs = torch.maximum(offs, torch.cat([offs[:1], torch.cummax(offs, 0).values[:-1]]))  # ends never before starts
    return grouped_blockscaled_gemm(*blockscaled_views(a, a_scale, b, b_scale), offs, alpha.float(), fmt)


def moe_gemm_blockscaled_masked(a, a_scale, b, b_scale, masked_m, alpha, fmt: str):
    """The `moe_gemm_blockscaled_masked` contract: a [E, max_m, K/2] with a_scale the swizzled container of its
    E * max_m rows; out [E, max_m, N] bf16, rows r < clamp(masked_m[e], 0, max_m) of expert e = bf16(alpha[e] *
    dec(a[e, r]) @ dec(b[e]).T), every other row 0."""
    e, max_m, kh = a.shape
    counts = masked_m.to(torch.int64).clamp(0, max_m).tolist()
    a2, sfa, b, sfb = blockscaled_views(a.reshape(e * max_m, kh), a_scale, b, b_scale)
    out = _blockscaled_groups(a2, sfa, b, sfb, [x * max_m for x in range(e)], counts, alpha.float(), fmt, None)
    return out.view(e, max_m, b.shape[1])
