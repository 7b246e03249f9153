"""The public API: `from dispatch import ops; ops.nvfp4_quantize(x)`.

Every function here is a thin typed wrapper over a `torch.ops.lowbit.*` op; `backend="auto"` lets the
dispatch table choose (see `python -m dispatch`).
"""

from ..rope_cache import LinearScaling, Llama3Scaling, YarnScaling, ds_kv_cache_empty, rope_cos_sin_cache
from ._common import backend_for
from .attention import (
    attention,
    attention_decode,
    attention_prefill,
    attention_prefill_paged,
    merge_attn_states,
    mla_decode,
    mla_index_scores,
)
from .kv_cache import (
    ds_kv_gather,
    ds_kv_write,
    ds_rope_quant_append,
    paged_kv_gather_fp8,
    paged_kv_write_fp8,
)
from .moe import (
    ContiguousLayout,
    GatheredFP8,
    MaskedLayout,
    Routing,
    moe_align,
    moe_combine,
    moe_gather,
    moe_gather_fp8,
    moe_hash_route,
    moe_masked_layout,
    moe_route,
)
from .moe_gemm import (
    moe_gemm_bf16,
    moe_gemm_blockscaled,
    moe_gemm_blockscaled_masked,
    moe_gemm_combine,
    moe_gemm_combine_fp4_prepacked,
    moe_gemm_fp4_prepack,
    moe_gemm_fp4_prepacked,
    moe_gemm_fp8,
    moe_gemm_mxfp4,
    moe_gemm_nvfp4,
    moe_gemm_swiglu,
    moe_gemm_swiglu_fp4_prepacked,
    moe_gemm_swiglu_fp8_group,
    moe_gemm_swiglu_mxfp4,
    moe_gemm_swiglu_nvfp4,
    moe_gemm_w4a4,
    moe_gemm_w4a8,
)
from .moe_layer import moe_layer, moe_layer_routed
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
from .rmsnorm import (
    RMSNormOutput,
    RMSNormQuantOutput,
    rms_norm,
    rms_norm_fp8_group,
    rms_norm_mxfp4,
    rms_norm_nvfp4,
)
from .rope import RopeOutput, rope, rope_
from .swiglu import swiglu, swiglu_fp8_group, swiglu_mxfp4, swiglu_nvfp4

__all__ = [
    "FP8GroupQuantized", "MXFP4Quantized", "NVFP4Quantized", "backend_for",
    "fp8_group_dequantize", "fp8_group_quantize", "mxfp4_dequantize", "mxfp4_quantize",
    "nvfp4_decode_global_scale", "nvfp4_dequantize", "nvfp4_encode_global_scale",
    "nvfp4_global_scale_from_amax", "nvfp4_quantize", "swizzle_scales_128x4", "unswizzle_scales_128x4",
    # rope, kv_cache
    "RopeOutput", "LinearScaling", "Llama3Scaling", "YarnScaling", "ds_kv_cache_empty", "rope_cos_sin_cache",
    "ds_kv_gather", "ds_kv_write", "ds_rope_quant_append", "paged_kv_gather_fp8",
    "paged_kv_write_fp8", "rope", "rope_",
    # rmsnorm, swiglu (+ quantized outputs)
    "RMSNormOutput", "RMSNormQuantOutput", "rms_norm", "rms_norm_fp8_group", "rms_norm_mxfp4", "rms_norm_nvfp4",
    "swiglu", "swiglu_fp8_group", "swiglu_mxfp4", "swiglu_nvfp4",
    # moe plumbing
    "ContiguousLayout", "GatheredFP8", "MaskedLayout", "Routing", "moe_align", "moe_combine", "moe_gather",
    "moe_gather_fp8", "moe_hash_route", "moe_masked_layout", "moe_route",
    # attention
    "attention", "attention_decode", "attention_prefill", "attention_prefill_paged", "merge_attn_states",
    "mla_decode", "mla_index_scores",
    # moe_gemm
    "moe_gemm_bf16", "moe_gemm_blockscaled", "moe_gemm_blockscaled_masked", "moe_gemm_fp4_prepack",
    "moe_gemm_fp4_prepacked", "moe_gemm_fp8", "moe_gemm_mxfp4",
    "moe_gemm_w4a4", "moe_gemm_w4a8", "moe_gemm_nvfp4", "moe_gemm_swiglu", "moe_gemm_swiglu_fp4_prepacked",
    "moe_gemm_swiglu_fp8_group", "moe_gemm_swiglu_mxfp4", "moe_gemm_swiglu_nvfp4", "moe_gemm_combine",
    "moe_gemm_combine_fp4_prepacked", "moe_layer", "moe_layer_routed",
]
