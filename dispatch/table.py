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

# Measured (perf/results/nvidia-h200.jsonl, H200, 2026-11-21): the Triton backend beat the torch backend in 59 of
# 61 (case, timing) pairs; the two exceptions are host-bound eager decode calls (fp8_group_dequantize and plain
# swiglu at M=16), where both backends cost ~60-200 us of Python and launch time, not kernel time.
TRITON_GPU = 20
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
    "nvfp4_quantize": _family("nvfp4_quantize", "triton_ops.quant_fp4", "triton_ops.quant_fp4:supports_nvfp4_quantize"),
    "nvfp4_dequantize": _family("nvfp4_dequantize", "triton_ops.quant_fp4"),
    "mxfp4_quantize": _family("mxfp4_quantize", "triton_ops.quant_fp4", "triton_ops.quant_fp4:supports_mxfp4_quantize"),
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
    # MoE routing plumbing (docs/moe_layouts.md): router, align, gather, combine; Triton on GPUs.
    **{op: [
        Entry(op, "triton", SM80_PLUS, f"triton_ops.{mod}:{op}", TRITON_GPU,
              "one launch at decode (align: 3 at T*k > 1024); no atomics, deterministic", sup),
        Entry(op, "triton", ("cpu",), f"triton_ops.{mod}:{op}", TRITON_INTERPRETER,
              "TRITON_INTERPRET=1: for tests, never auto", sup),
        Entry(op, "torch", ALL, f"dispatch.reference.moe:{op}", TORCH_REF,
              "pure-torch reference (test oracle, CPU backend)"),
    ] for op, mod, sup in (("moe_route", "moe_routing", "triton_ops.moe_routing:supports_route"),
                           ("moe_hash_route", "moe_routing", "triton_ops.moe_routing:supports_route"),
                           ("moe_align", "moe_align", "triton_ops.moe_align:supports_align"),
                           ("moe_masked_layout", "moe_align", "triton_ops.moe_align:supports_align"),
                           ("moe_gather", "moe_align", None), ("moe_combine", "moe_align", None))},
    # RMSNorm (+ residual) and SwiGLU with plain / FP8-group / MXFP4 / NVFP4 outputs (docs/norm_act.md).
    **{op: [
        Entry(op, "triton", SM80_PLUS, f"triton_ops.{mod}:{op}", TRITON_GPU,
              "one fused pass (NVFP4 with computed global scale: 2); bytes = reference composition", sup),
        Entry(op, "triton", ("cpu",), f"triton_ops.{mod}:{op}", TRITON_INTERPRETER,
              "TRITON_INTERPRET=1: for tests, never auto", sup),
        Entry(op, "torch", ALL, f"dispatch.reference.{mod}:{ref}", TORCH_REF,
              "pure-torch reference (test oracle, CPU backend)"),
    ] for op, mod, ref, sup in (
        ("rms_norm", "rmsnorm", "rms_norm_op", "triton_ops.rmsnorm:supports_rms_norm"),
        ("rms_norm_fp8_group", "rmsnorm", "rms_norm_fp8_group", "triton_ops.rmsnorm:supports_rms_norm_fp8_group"),
        ("rms_norm_mxfp4", "rmsnorm", "rms_norm_mxfp4", "triton_ops.rmsnorm:supports_rms_norm"),
        ("rms_norm_nvfp4", "rmsnorm", "rms_norm_nvfp4", "triton_ops.rmsnorm:supports_rms_norm"),
        ("swiglu", "swiglu", "swiglu_op", "triton_ops.swiglu:supports_swiglu"),
        ("swiglu_fp8_group", "swiglu", "swiglu_fp8_group", "triton_ops.swiglu:supports_swiglu_fp8_group"),
        ("swiglu_mxfp4", "swiglu", "swiglu_mxfp4", "triton_ops.swiglu:supports_swiglu"),
        ("swiglu_nvfp4", "swiglu", "swiglu_nvfp4", "triton_ops.swiglu:supports_swiglu"))},
}

# CuTeDSL escape hatch (cute_ops/, docs/cute.md): the same RMSNorm ops as extra rows. Ranked below Triton
# (15 < 20). Its first GPU run (H200, 2026-11-21) was faster than Triton at decode (1.2x, M=16 N=7168) but not
# bit-exact, so every row refuses with that reason unless LOWBIT_CUTE_UNVERIFIED=1 (cute_ops.rmsnorm); it also
# refuses host tensors, unaligned rows and NVFP4 without a given global scale, and is unavailable (with the
# reason) when nvidia-cutlass-dsl is not installed.
CUTE_UNMEASURED = 15
CUTE_ARCHS = ("sm_90", "sm_100", "sm_103")
for _op in ("rms_norm", "rms_norm_fp8_group", "rms_norm_nvfp4"):
    TABLE[_op].append(Entry(_op, "cute", CUTE_ARCHS, f"cute_ops.rmsnorm:{_op}", CUTE_UNMEASURED,
                            "CuTeDSL; failed bit-exactness on the H200: refused until a GPU run passes",
                            f"cute_ops.rmsnorm:supports_{_op}"))
del _op
