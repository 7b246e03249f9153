"""The public API: `from dispatch import ops; ops.nvfp4_quantize(x)`.

Every function here is a thin typed wrapper over a `torch.ops.lowbit.*` op; `backend="auto"` lets the
dispatch table choose (see `python -m dispatch`).
"""

from ._common import backend_for
from .quant import (
    FP8GroupQuantized,
    MXFP4Quantized,
    NVFP4Quantized,
    fp8_group_dequantize,
    fp8_group_quantize,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_decode_global_scale,
    nvfp4_dequantize,
    nvfp4_encode_global_scale,
    nvfp4_global_scale_from_amax,
    nvfp4_quantize,
    swizzle_scales_128x4,
    unswizzle_scales_128x4,
)

__all__ = [
    "FP8GroupQuantized", "MXFP4Quantized", "NVFP4Quantized", "backend_for",
    "fp8_group_dequantize", "fp8_group_quantize", "mxfp4_dequantize", "mxfp4_quantize",
    "nvfp4_decode_global_scale", "nvfp4_dequantize", "nvfp4_encode_global_scale",
    "nvfp4_global_scale_from_amax", "nvfp4_quantize", "swizzle_scales_128x4", "unswizzle_scales_128x4",
]
