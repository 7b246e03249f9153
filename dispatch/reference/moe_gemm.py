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
Optional `row_weights` (fp32, a.shape[:-1]): each computed row is multiplied by its weight before the cast
(the fused top-k weighting of GEMM2); zero rows stay zero.
"""

from __future__ import annotations

import torch

from .formats import e2m1_decode, unpack_nibbles
from .quant import e8m0_decode, fp8_group_dequantize

FP8_BLOCK = 128
MXFP4_BLOCK = 32


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


def moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None):
    return _grouped(a.float(), w.float(), m_indices, masked_m, row_weights, a.dtype)


def moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m, row_weights=None):
    a32 = fp8_group_dequantize(a, a_scale, FP8_BLOCK, torch.float32)
    return _grouped(a32, fp8_block_dequantize(w, w_scale), m_indices, masked_m, row_weights, torch.bfloat16)


def moe_gemm_mxfp4(a, w_packed, w_scale, m_indices, masked_m, row_weights=None):
    w32 = mxfp4_weight_dequantize(w_packed, w_scale)
    return _grouped(a.float(), w32, m_indices, masked_m, row_weights, torch.bfloat16)
