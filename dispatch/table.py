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

CUTE_UNMEASURED = 15
CUTE_MEASURED_FASTER = 25
CUTE_ARCHS = ("sm_90", "sm_100", "sm_103")

INTERPRETER_WHY = "TRITON_INTERPRET=1: for tests, never auto"
REFERENCE_WHY = "pure-torch reference (test oracle, CPU backend)"


def _trio(op: str, triton: str, reference: str, why: str, supports: str | None = None,
          ref_fn: str | None = None) -> list[Entry]:
    """The standard rows: Triton on GPUs, Triton under the interpreter (forced only), the torch reference.
    `triton` / `reference` are modules holding functions named after the op (ref_fn overrides the latter)."""
    impl = f"{triton}:{op}"
    return [
        Entry(op, "triton", SM80_PLUS, impl, TRITON_GPU, why, supports),
        Entry(op, "triton", ("cpu",), impl, TRITON_INTERPRETER, INTERPRETER_WHY, supports),
        Entry(op, "torch", ALL, f"{reference}:{ref_fn or op}", TORCH_REF, REFERENCE_WHY),
    ]


def _cute(op: str) -> list[Entry]:
    """CuTeDSL escape hatch (cute_ops/, docs/cute.md) for an RMSNorm op.

    sm_90: ranked above Triton (25 > 20). H200 runs of 2026-11-21 (perf/results): bit-exact in every mode, and
    faster than Triton on every RMSNorm case but one at d98feeb: 32768x4096 plain 1.03x, +residual 1.03x, FP8
    group +residual 1.16x (0.96 of copy); 4096x7168 plain 1.20x, FP8 1.51x, NVFP4 1.12x; eager decode 4-6x
    (host: ~11 us per call against Triton's ~70). The exception: NVFP4 at 32768x4096, where Triton's pair-word
    kernel takes 164 us against 188 (0.87x), and NVFP4 decode under graph replay (6.4 vs 5.6 us).
    Session 5: Triton's two-pass RMSNorm -> FP4 kernel widened that gap (H200 at 9681b5e: NVFP4 32768x4096 143.8
    vs 188.7 us, 4096x7168 42.7 vs 48.8): auto now passes the CuTe rms_norm_nvfp4 row over above DECODE_ROWS
    rows (`auto_skip` = cute_nvfp4_prefill; backend="cute" still runs it) and keeps it for decode, where its
    ~11 us eager call beats Triton's ~50-70 us host path (under graph replay Triton is faster there too: 5.7 vs
    6.5 us; engines that capture graphs can force backend="triton").
    Session 6: Triton's element-wise kernel (cheaper rstd tail, one row block per program) caught up at prefill
    (H200 at c0958b1, Triton vs CuTe: plain 4096x7168 32.8 vs 32.5 us, +residual 60.4 vs 60.5, 32768x4096
    +residual 265.3 vs 264.7; FP8 group +residual 4096x7168 54.8 vs 55.9, 32768x4096 228.3 vs 231.5): within 2%
    either way, so CuTe keeps its rank for the eager decode host path.
    sm_100/103: compiled and SASS-checked only, never run on Blackwell: ranked below Triton (15) and refused
    unless LOWBIT_CUTE_UNVERIFIED=1 (cute_ops.rmsnorm.HARDWARE_STATUS).
    Both refuse host tensors, unaligned rows and NVFP4 without a given global scale, and are unavailable (with
    the reason) when nvidia-cutlass-dsl is not installed."""
    impl, sup = f"cute_ops.rmsnorm:{op}", f"cute_ops.rmsnorm:supports_{op}"
    skip = "dispatch.table:cute_nvfp4_prefill" if op == "rms_norm_nvfp4" else None
    why = ("CuTeDSL; bit-exact; auto takes it at decode only (Triton faster at prefill since session 5)"
           if skip else "CuTeDSL; bit-exact; on par with Triton at prefill, lighter eager calls (H200, perf/results)")
    return [Entry(op, "cute", ("sm_90",), impl, CUTE_MEASURED_FASTER, why, sup, skip),
            Entry(op, "cute", CUTE_ARCHS[1:], impl, CUTE_UNMEASURED,
                  "CuTeDSL; compiled for sm_100a, never run on Blackwell: refused unless LOWBIT_CUTE_UNVERIFIED=1",
                  sup)]


DECODE_ROWS = 64  # the benchmarks' decode bucket (M <= 64 tokens)


def cute_nvfp4_prefill(x, *rest) -> str | None:
    """auto_skip of the sm_90 CuTe rms_norm_nvfp4 row: prefill-sized calls go to Triton (see _cute)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows > DECODE_ROWS:
        return f"{rows} rows > {DECODE_ROWS}: Triton's two-pass kernel is faster at prefill (H200, session 5)"
    return None


_QUANT, _QUANT_REF = "triton_ops.quant_fp4", "dispatch.reference.quant"
_FUSED = "fused single pass; bytes equal the reference"
_MOE = "one launch at decode (align: 3 at T*k > 1024); no atomics, deterministic"
_NORM = "one fused pass (NVFP4 with computed global scale: 2); bytes = reference composition"

TABLE: dict[str, list[Entry]] = {
    # Quantization primitives (docs/quant.md).
    **{op: _trio(op, mod, _QUANT_REF, _FUSED, sup) for op, mod, sup in (
        ("nvfp4_quantize", _QUANT, f"{_QUANT}:supports_nvfp4_quantize"),
        ("nvfp4_dequantize", _QUANT, None),
        ("mxfp4_quantize", _QUANT, f"{_QUANT}:supports_mxfp4_quantize"),
        ("mxfp4_dequantize", _QUANT, None),
        ("fp8_group_quantize", "triton_ops.quant_fp8", "triton_ops.quant_fp8:supports_quantize"),
        ("fp8_group_dequantize", "triton_ops.quant_fp8", "triton_ops.quant_fp8:supports_dequantize"))},
    # A layout permutation is one torch copy kernel already; a Triton twin would add nothing.
    **{op: [Entry(op, "torch", ALL, f"{_QUANT_REF}:{op}", TORCH_REF, "one permute+copy; nothing to fuse")]
       for op in ("swizzle_scales_128x4", "unswizzle_scales_128x4")},
    # RoPE + paged KV-cache FP8 (docs/rope.md, docs/kv_cache_layouts.md): one Triton pass per call.
    **{op: _trio(op, f"triton_ops.{fam}", f"dispatch.reference.{fam}", "one fused pass; bytes equal the reference")
       for op, fam in (("rope", "rope"), ("rope_", "rope"), ("paged_kv_write_fp8", "kv_cache"),
                       ("paged_kv_gather_fp8", "kv_cache"), ("ds_kv_write", "kv_cache"),
                       ("ds_kv_gather", "kv_cache"), ("ds_rope_quant_append", "kv_cache"))},
    # MoE routing plumbing (docs/moe_layouts.md): router, align, gather, combine.
    **{op: _trio(op, f"triton_ops.{mod}", "dispatch.reference.moe", _MOE, sup) for op, mod, sup in (
        ("moe_route", "moe_routing", "triton_ops.moe_routing:supports_route"),
        ("moe_hash_route", "moe_routing", "triton_ops.moe_routing:supports_route"),
        ("moe_align", "moe_align", "triton_ops.moe_align:supports_align"),
        ("moe_masked_layout", "moe_align", "triton_ops.moe_align:supports_align"),
        ("moe_gather", "moe_align", None), ("moe_combine", "moe_align", None))},
    # RMSNorm (+ residual) and SwiGLU with plain / FP8-group / MXFP4 / NVFP4 outputs (docs/norm_act.md);
    # the RMSNorm ops also have CuTeDSL rows.
    **{op: _trio(op, f"triton_ops.{mod}", f"dispatch.reference.{mod}", _NORM, sup, ref)
       + (_cute(op) if op in ("rms_norm", "rms_norm_fp8_group", "rms_norm_nvfp4") else [])
       for op, mod, ref, sup in (
        ("rms_norm", "rmsnorm", "rms_norm_op", "triton_ops.rmsnorm:supports_rms_norm"),
        ("rms_norm_fp8_group", "rmsnorm", None, "triton_ops.rmsnorm:supports_rms_norm_fp8_group"),
        ("rms_norm_mxfp4", "rmsnorm", None, "triton_ops.rmsnorm:supports_rms_norm"),
        ("rms_norm_nvfp4", "rmsnorm", None, "triton_ops.rmsnorm:supports_rms_norm"),
        ("swiglu", "swiglu", "swiglu_op", "triton_ops.swiglu:supports_swiglu"),
        ("swiglu_fp8_group", "swiglu", None, "triton_ops.swiglu:supports_swiglu_fp8_group"),
        ("swiglu_mxfp4", "swiglu", None, "triton_ops.swiglu:supports_swiglu"),
        ("swiglu_nvfp4", "swiglu", None, "triton_ops.swiglu:supports_swiglu"))},
}
