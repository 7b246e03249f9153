"""Format constants and layout math (shapes, block sizes, paddings) shared by references and kernels.

Only numbers and shapes live here; the encode/decode math itself is in dispatch/reference/formats.py
(torch) and triton_ops/_formats.py (Triton), which must agree byte for byte.
"""

from __future__ import annotations

import math

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F  # canonical NaN byte lowbit writes (the sign of a NaN input is not kept)

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
NVFP4_AMAX_TO_SCALE = E4M3_MAX * E2M1_MAX  # decode-form global scale = amax / 2688
# A decode-form NVFP4 global scale below this in magnitude counts as 0 when block scales are chosen (it is still
# returned as given / computed). Above it, 1/gs <= 2^118, so inv = (1/gs)/s <= 2^127 stays finite for every
# E4M3 block scale s >= 2^-9; below it the reciprocal overflows (to Inf from gs < 2^-128, for small blocks
# before) and every nonzero code would saturate to +-6. The tensor then quantizes to zeros: its amax is below
# 2688 * 2^-118 ~ 8.1e-33 (computed scale), or the given scale is that far below any real tensor's.
NVFP4_MIN_GLOBAL_SCALE = 2.0**-118
SWIZZLE_ROWS, SWIZZLE_COLS = 128, 4  # the 128x4 scale-factor tile (cuBLAS / CUTLASS block-scaled layout)


def cdiv(n: int, m: int) -> int:
    return -(-n // m)


def round_up(n: int, m: int) -> int:
    return cdiv(n, m) * m


def fp4_scales_shape(lead: tuple, k: int, block: int, swizzle: bool) -> tuple:
    """Shape of an FP4 block-scale tensor: [*lead, k/block] linear, or the padded 128x4 container."""
    if swizzle:
        return (round_up(math.prod(lead), SWIZZLE_ROWS), round_up(k // block, SWIZZLE_COLS))
    return (*lead, k // block)


def fp8_scale_storage(lead: tuple, groups: int, column_major: bool, device) -> torch.Tensor:
    """Scales tensor of logical shape [*lead, groups]. Column-major = DeepGEMM's MN-major TMA-aligned layout:
    storage [groups, round_up(rows, 4)] (16-byte aligned columns), returned as a strided view."""
    rows = math.prod(lead)
    if not column_major:
        return torch.empty(*lead, groups, dtype=torch.float32, device=device)
    storage = torch.empty(groups, round_up(rows, 4), dtype=torch.float32, device=device)
    return storage[:, :rows].t().reshape(*lead, groups)


def contiguous_capacity(num_entries: int, num_experts: int, block_m: int) -> int:
    """Static row count of the MoE contiguous layout: every one of the min(E, N) experts that can be non-empty
    wastes at most block_m - 1 padding rows. Depends on shapes only (CUDA graphs, torch.compile)."""
    return round_up(num_entries + min(num_experts, num_entries) * (block_m - 1), block_m)

MX_ROUNDINGS = ("floor", "rceil")  # MXFP4 scale exponent rules (dispatch/reference/quant.py: mxfp4_scale_exponent)
