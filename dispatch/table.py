"""THE dispatch table: for every op, which backends exist, where they run, and which is preferred.

Data only. `python -m dispatch` prints it; `registry.select` reads it. Priorities come from the committed
benchmarks (perf/results/); each entry's `why` says what justifies its rank. Backends of other op
families add their rows here, not in if-chains elsewhere.
"""

from __future__ import annotations

from .arch import GPU_ARCHS, KNOWN_ARCHS
from .registry import Entry

ALL = KNOWN_ARCHS
SM80_PLUS = tuple(a for a in GPU_ARCHS if int(a[3:]) >= 80)

TRITON_GPU = 20  # measured faster than torch eager and torch.compile on H100 (perf/results/)
TORCH_REF = 10  # the reference: always runs, on any device
TRITON_INTERPRETER = 0  # correct but slow; only when forced (tests, `python -m dispatch check` on a CPU)

_REF = "dispatch.reference.quant"


def _family(op: str, triton_module: str, triton_supports: str | None = None) -> list[Entry]:
    """The standard trio: Triton on GPUs, Triton under the interpreter (forced only), the torch reference."""
    impl = f"{triton_module}:{op}"
    return [
        Entry(op, "triton", SM80_PLUS, impl, TRITON_GPU, "fused single pass; bytes equal the reference",
              triton_supports),
        Entry(op, "triton", ("cpu",), impl, TRITON_INTERPRETER, "TRITON_INTERPRET=1: for tests, never auto",
              triton_supports),
        Entry(op, "torch", ALL, f"{_REF}:{op}", TORCH_REF, "pure-torch reference (test oracle, CPU backend)"),
    ]


TABLE: dict[str, list[Entry]] = {
    "nvfp4_quantize": _family("nvfp4_quantize", "triton_ops.quant_fp4"),
    "nvfp4_dequantize": _family("nvfp4_dequantize", "triton_ops.quant_fp4"),
    "mxfp4_quantize": _family("mxfp4_quantize", "triton_ops.quant_fp4"),
    "mxfp4_dequantize": _family("mxfp4_dequantize", "triton_ops.quant_fp4"),
    "fp8_group_quantize": _family("fp8_group_quantize", "triton_ops.quant_fp8",
                                  "triton_ops.quant_fp8:supports_quantize"),
    "fp8_group_dequantize": _family("fp8_group_dequantize", "triton_ops.quant_fp8",
                                    "triton_ops.quant_fp8:supports_dequantize"),
    # A layout permutation is one torch copy kernel already; a Triton twin would add nothing.
    "swizzle_scales_128x4": [
        Entry("swizzle_scales_128x4", "torch", ALL, f"{_REF}:swizzle_scales_128x4", TORCH_REF,
              "one permute+copy; nothing to fuse"),
    ],
    "unswizzle_scales_128x4": [
        Entry("unswizzle_scales_128x4", "torch", ALL, f"{_REF}:unswizzle_scales_128x4", TORCH_REF,
              "one permute+copy; nothing to fuse"),
    ],
    # RoPE + paged KV-cache FP8 (docs/rope.md, docs/kv_cache_layouts.md): one Triton pass per call.
    **{op: [
        Entry(op, "triton", SM80_PLUS, f"triton_ops.{fam}:{op}", TRITON_GPU,
              "one fused pass; bytes equal the reference"),
        Entry(op, "triton", ("cpu",), f"triton_ops.{fam}:{op}", TRITON_INTERPRETER,
              "TRITON_INTERPRET=1: for tests, never auto"),
        Entry(op, "torch", ALL, f"dispatch.reference.{fam}:{op}", TORCH_REF,
              "pure-torch reference (test oracle, CPU backend)"),
    ] for op, fam in (("rope", "rope"), ("rope_", "rope"), ("paged_kv_write_fp8", "kv_cache"),
                      ("paged_kv_gather_fp8", "kv_cache"), ("ds_kv_write", "kv_cache"), ("ds_kv_gather", "kv_cache"),
                      ("ds_rope_quant_append", "kv_cache"))},
}
