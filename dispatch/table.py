"""THE dispatch table: for every op, which backends exist, where they run, and which is preferred.

Plain data: one `Entry` per (op, backend, archs), with the implementation, its `supports` predicate and its
optional `auto_skip` / `specialize` hooks named literally as "module:function" (grep for an op name finds
every row of it). `python -m dispatch` prints it; `registry.select` reads it. Priorities come from the
committed benchmarks (perf/results/); each entry's `why` says what justifies its rank.
"""

from __future__ import annotations

from triton_ops.contract.arch import GPU_ARCHS, KNOWN_ARCHS

from .registry import Entry

ALL = KNOWN_ARCHS
SM80_PLUS = tuple(a for a in GPU_ARCHS if int(a[3:]) >= 80)
CUTE_BLACKWELL = ("sm_100", "sm_103")
# Blackwell (docs/blackwell.md): B200/B300 (sm_100/103), RTX 50xx / RTX PRO (sm_120), GB10 (sm_121). The Triton rows run
# there as on any sm_80+ GPU (SM80_PLUS includes these), and auto takes them, but no Blackwell chip has run them yet:
# tests/test_blackwell_compile.py compiles one kernel per family for each and checks its SASS. `python -m dispatch
# --arch sm_121` prints TRITON_UNRUN_ON_BLACKWELL beside those rows (describe.py).
BLACKWELL_ARCHS = ("sm_100", "sm_103", "sm_120", "sm_121")
TRITON_UNRUN_ON_BLACKWELL = "compiled and SASS-checked in CI, never run on this chip"
CUTE_UNRUN_ON_BLACKWELL = "CuTeDSL build checked in CI, never run on it: refused unless LOWBIT_CUTE_UNVERIFIED=1"

# Triton above torch: in the H200 full-suite run (perf/results/nvidia-h200.jsonl) the Triton backend beat the torch
# backend in 59 of 61 (case, timing) pairs; the two exceptions are host-bound eager decode calls (fp8_group_dequantize
# and plain swiglu at M=16), where both backends cost Python and launch time, not kernel time.
TRITON_GPU = 20
TORCH_REF = 10  # the reference: always runs, on any device
TRITON_INTERPRETER = 0  # correct but slow; only when forced (tests, `python -m dispatch check` on a CPU)
TRITON_SM90_GLUON = 22  # a Hopper-only Triton kernel ahead of the portable one (measured: ATTN_SM90_WHY)
CUTE_UNMEASURED = 15
CUTE_MEASURED_FASTER = 25

INTERPRETER_WHY = "TRITON_INTERPRET=1: for tests, never auto"
REFERENCE_WHY = "pure-torch reference (test oracle, CPU backend)"
FUSED = "fused single pass; bytes equal the reference"
ONE_PASS = "one fused pass; bytes equal the reference"
MOE = "one launch at decode (align: 3 at T*k > 1024); no atomics, deterministic"
ATTN_TL_WHY = "plain Triton FA2-style forward: every arch, masked tiles skipped by loop bounds"
# H100 (docs/attention.md, measured table): hd128 0.72-0.81x FA4-sm90, GPT-OSS hd64 + sinks 0.63-0.73x, DeepSeek
# (192, 128) 0.76-0.78x, the only fast path for those head dims. Ranked above the plain kernel for its TMA + wgmma
# pipeline; below the cute row where that one runs.
ATTN_SM90_WHY = "Gluon TMA + warpgroup-MMA forward (sm_90a, Triton 3.6): 0.72-0.81x FA4 hd128, 0.78x (192, 128) (H100)"
# CuTeDSL sm_90a forward (cute_ops/attention/fmha_sm90.py): GPU tests pass on the H100 and the H200; on the prefill
# benchmark set (H200, persistent grid + O TMA store, fmha_sm90.FOR_CALL): hd128 0.84-1.0x FA4-sm90, GPT-OSS hd64
# causal + sinks 0.91x, window (128, 0) + sinks 0.96x, DeepSeek (192, 128) 0.93x against the Gluon row's 0.68x
# (docs/attention.md, measured table). auto takes it at the head dims it was timed at, 64, 128 and 192 (`auto_skip`
# cute_ops.attention.fmha_sm90:auto_skip_untimed, on the paged row too).
# Paged-prefix prefill on sm_90 (dispatch/composed/paged_prefill.py): one Triton gather of the used pages (FP8
# dequantized) into contiguous K / V, the CuTeDSL forward above, and the plain paged kernel over the sequences with
# an out-of-range page id (flagged by the gather). H200 (CUDA graph, same process): 0.88-0.92x FA4 with
# its page table (Llama hd128 32/8 and GPT-OSS hd64 sinks; the gather is 4-14% of the time), 2.5-3.3x the plain kernel.
ATTN_PAGED_GATHER_WHY = "gather pages to contiguous K / V, then the CuTeDSL sm_90 forward: 0.88-0.92x FA4 paged (H200)"
ATTN_CUTE_WHY = "CuTeDSL TMA + WGMMA forward, ping-pong warpgroups, persistent grid: 0.84-1.0x FA4 (H200)"
# H100 (CUDA graph): bf16 cache 0.88-0.97x cuDNN SDPA on a dense cache (median 0.95x); FP8 cache 1.72x
# our bf16 path and 1.62x cuDNN's bf16 at 16 x 8k (page tiles, V converted to fp16 before its operand layout).
ATTN_DECODE_WHY = "GQA heads packed per KV head; page tiles; split-KV, LSE-merged; 0.88-0.97x cuDNN, FP8 1.7x (H100)"
# H100: the sm_90 wgmma tiles 4.5-7.4x the mma tiles, 0.33-0.45x FlashMLA (docs/attention.md).
# The GPU backend of mla_decode for every call the sm_90 Gluon rows (MLA_SM90_WHY, MLA_SM90_FP8_WHY) refuse.
MLA_DECODE_WHY = "heads sharing keys packed per tile (wgmma on sm_90); FP8 dequant in registers; 0.33-0.45x FlashMLA"
# sm_90 Gluon MLA decode (triton_ops/attention/mla_sm90.py): FlashMLA's structure (Q resident in shared memory, a TMA
# partition loading page tiles that serve K and V, two compute warpgroups handing the row max over within tile
# pairs); bf16 dense cache, D 576, page 64 only. H200 (CUDA graph, docs/attention.md): 0.85-0.93x FlashMLA.
MLA_SM90_WHY = "Gluon TMA page tiles + warpgroup MMA, Q resident (sm_90a, Triton 3.6): bf16 dense; 0.85-0.93x FlashMLA"
# sm_90 Gluon FP8 MLA decode (triton_ops/attention/mla_sm90_fp8.py): a gather / dequantization partition feeding
# the bf16 kernel's two compute warpgroups; the sparse and dense calls on the V3.2 "v32" and V4 "v4" caches. H200
# (CUDA graph, docs/attention.md), sparse v32: 287-292 TFLOP/s, 2.0-2.3x the portable kernel; sparse v4: 2.2x the
# portable kernel. Dense (the list 0 .. capacity - 1, tiles past seqused_k skipped): 1.5-2.3x the portable kernel.
MLA_SM90_FP8_WHY = ("Gluon gather, E4M3 dequant in registers, warpgroup MMA (sm_90a, Triton 3.6): v32 / v4 sparse "
                    "and dense; 1.5-2.3x the portable kernel (H200)")
# H100 (docs/moe_gemm.md, measured table): decode (16 rows / expert) at the copy roof, 1.06-1.11x torch's grouped
# GEMMs; prefill (256 rows / expert) 0.47-0.69x them (tiles not tuned for prefill).
GROUPED_GEMM = "one launch over every expert; padding rows skipped; decode at the copy roof (H100)"
# tl.dot_scaled FP4-weight GEMMs. sm_100 / sm_120: the native block-scaled MMA (UTCQMMA / UTCOMMA / OMMA.SF, compiled
# and SASS-checked in CI, never run on those chips). Rule between this row and the CuTeDSL UMMA GEMM
# (cute_ops/gemm/blockscaled_sm100.py) on sm_100: the Triton row serves the moe_align / moe_masked_layout layouts with
# linear E8M0 scales and bf16 / FP8 activations; the CuTe kernel takes FP4 activations with 128x4-swizzled scales
# (group offsets or the masked layout: its own ops, moe_gemm_blockscaled(_masked)), so it has no row here yet. sm_90:
# upcast + WGMMA (correct, not the fast Hopper path).
CUTE_GEMM_SM100_WHY = ("CuTeDSL tcgen05 block-scaled UMMA (UTCOMMA), TMEM accumulator; NVFP4 / MXFP4; offsets and "
                       "masked layouts, swap-AB tiles for <= 64 rows per expert; compiled for sm_100a, never run on "
                       "Blackwell: refused unless LOWBIT_CUTE_UNVERIFIED=1")
CUTE_GEMM_BF16_SM100_WHY = ("CuTeDSL tcgen05 dense UMMA (UTCHMMA), TMEM accumulator, the block-scaled kernel's "
                            "pipeline without scales; contiguous and masked layouts, row weights; compiled for "
                            "sm_100a, never run on Blackwell: refused unless LOWBIT_CUTE_UNVERIFIED=1")
DOT_SCALED_WHY = "tl.dot_scaled: native block-scaled MMA on Blackwell (compiled only); upcast on Hopper"
# NVFP4 weights, bf16 / fp16 activations: the grouped kernel with e2m1 * e4m3 dequantized in registers (Triton 3.6
# cannot lower tl.dot_scaled with NVFP4 scales on sm_90). H100: decode 1.45x torch._grouped_mm bf16.
NVFP4_W4A16_WHY = "NVFP4 weights dequantized in registers (E4M3 scales per 16, global per expert); 1.45x bf16 decode"
# FP4 weights prepacked once (moe_gemm_fp4_prepack) into a register-fragment layout: swap-AB tiles (weights on the
# warpgroup MMA's M side, from registers), packed bit-trick E2M1 conversion. H200 (docs/moe_gemm.md): decode
# MXFP4 1.015x triton_kernels, 2.54x torch._grouped_mm bf16 (NVFP4 2.69x); prefill 0.77-0.80x triton_kernels.
FP4_PREPACKED_WHY = ("prepacked FP4 weights: swap-AB kernel, register-A wgmma, bit-trick E2M1 (H200 decode: 1.015x "
                     "triton_kernels)")
FP4_PREPACKED_SWIGLU_WHY = ("the prepacked FP4 kernel with the SwiGLU epilogue: one K loop over the gate and up rows "
                            "of each output column, the plain GEMM's tile")
FP4_PREPACKED_COMBINE_WHY = "the prepacked FP4 kernel scattering rows into token order, then the combine (in the layer)"
FP4_PREPACK_WHY = "one-time weight layout change (byte permutation + padding): torch on any device"
# H100 (docs/moe_gemm.md): FP8 GEMM1 + SwiGLU + FP8 1.08x the chain, GEMM2 + combine 1.23x (prefill); MXFP4 GEMM1 0.97x.
GEMM_SWIGLU = "GEMM1 with SwiGLU (+ FP8 1xG quant) in the epilogue: the gate and up outputs never go to memory"
GEMM_SWIGLU_FP4 = ("GEMM1 with SwiGLU and MXFP4 / NVFP4 quant in the epilogue (NVFP4 with computed global scale: "
                   "float out, then the quantizer)")
GEMM_COMBINE = "GEMM2 scattering rows into token order, then the slot-order combine: 2 launches, no atomics"
NORM = "one fused pass (NVFP4 with computed global scale: 2); bytes = reference composition"
# CuTeDSL RMSNorm (cute_ops/, docs/cute.md). sm_90 ranks above Triton (25 > 20): bit-exact in every mode, on par with
# Triton at prefill (H200, docs/rmsnorm.md, measured table: within 2% either way at 4096x7168 and with a residual;
# plain 32768x4096 7% slower), and the lighter eager call at decode. NVFP4 is the exception (CUTE_DECODE_WHY).
CUTE_WHY = "CuTeDSL; bit-exact; on par with Triton at prefill, lighter eager calls (H200, perf/results)"
# NVFP4: Triton's two-pass kernel is faster at prefill (H200, docs/rmsnorm.md, measured table: 32768x4096 141 vs
# 196 us, 4096x7168 42 vs 50), so auto passes the CuTe row over above DECODE_ROWS rows (`cute_nvfp4_prefill`);
# backend="cute" still runs it. Under graph replay Triton is faster at decode too: engines that capture graphs can
# force backend="triton".
CUTE_DECODE_WHY = "CuTeDSL; bit-exact; auto takes it at decode only (Triton's two-pass kernel is faster at prefill)"
# sm_100/103: compiled and SASS-checked only, never run on Blackwell: ranked below Triton and refused unless
# LOWBIT_CUTE_UNVERIFIED=1 (cute_ops.rmsnorm.HARDWARE_STATUS).
CUTE_UNRUN_WHY = "CuTeDSL; compiled for sm_100a, never run on Blackwell: refused unless LOWBIT_CUTE_UNVERIFIED=1"

# CuTeDSL grouped GEMM on sm_90, bf16 / fp16 and FP8 (cute_ops/gemm/grouped_sm90.py: WGMMA, TMA loads through
# per-group descriptors rewritten on the device): GPU tests pass on the H100 and the H200. Timed on the H200 at 128,
# 256 and 512 rows per expert (perf/results/nvidia-h200.jsonl; docs/moe_gemm.md, Measured): FP8 1.06-1.31x
# torch._scaled_grouped_mm (graph) and 2.1-2.5x Triton; bf16 0.97-1.14x torch._grouped_mm (graph) and 1.08-1.42x
# Triton at every timed K, so auto takes both from 128 rows per expert (`auto_skip_fp8`, `auto_skip_bf16`). Both rows
# rank above Triton (CUTE_MEASURED_FASTER) so that their `auto_skip` decides: a row ranked below Triton is never
# reached by auto. tests/test_auto_matches_records.py holds the table against the
# records. backend="cute" forces either.
CUTE_GEMM_FP8_WHY = "CuTeDSL WGMMA grouped GEMM, device-side TMA descriptors: FP8 prefill 2.1-2.5x Triton (H200)"
CUTE_GEMM_BF16_WHY = ("CuTeDSL WGMMA grouped GEMM, device-side TMA descriptors: bf16 from 128 rows/expert, "
                      "1.08-1.42x Triton (H200)")

# DeepSeek-V3.2 indexer scores (triton_ops/attention/indexer.py): 29x the bmm form at V3.2 dims on the H200
# (docs/attention.md, Measured).
INDEX_SCORES_WHY = ("per-head scores kept in registers, key tile reused for every head, fully masked tiles "
                    "skipped: 29x the bmm form at V3.2 prefill dims (H200)")

DECODE_ROWS = 64  # the benchmarks' decode bucket (M <= 64 tokens)


def cute_nvfp4_prefill(x, *rest) -> str | None:
    """auto_skip of the sm_90 CuTe rms_norm_nvfp4 row: prefill-sized calls go to Triton (see CUTE_DECODE_WHY)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if rows > DECODE_ROWS:
        return f"{rows} rows > {DECODE_ROWS}: Triton's two-pass kernel is faster at prefill (H200 benchmarks)"
    return None


def triton_rows(op: str, impl: str, why: str, *, supports: str | None = None) -> tuple[Entry, Entry]:
    """The two Triton rows every Triton op has: GPUs (sm_80+), and the CPU interpreter (forced only)."""
    return (Entry(op, "triton", SM80_PLUS, impl, TRITON_GPU, why, supports),
            Entry(op, "triton", ("cpu",), impl, TRITON_INTERPRETER, INTERPRETER_WHY, supports))


ROWS: tuple[Entry, ...] = (
    # quant (docs/quant.md)
    *triton_rows("nvfp4_quantize", "triton_ops.quant:nvfp4_quantize", FUSED,
                 supports="triton_ops.quant:supports_nvfp4_quantize"),
    Entry("nvfp4_quantize", "torch", ALL, "dispatch.reference.quant:nvfp4_quantize", TORCH_REF, REFERENCE_WHY),
    *triton_rows("nvfp4_dequantize", "triton_ops.quant:nvfp4_dequantize", FUSED),
    Entry("nvfp4_dequantize", "torch", ALL, "dispatch.reference.quant:nvfp4_dequantize", TORCH_REF, REFERENCE_WHY),
    *triton_rows("mxfp4_quantize", "triton_ops.quant:mxfp4_quantize", FUSED,
                 supports="triton_ops.quant:supports_mxfp4_quantize"),
    Entry("mxfp4_quantize", "torch", ALL, "dispatch.reference.quant:mxfp4_quantize", TORCH_REF, REFERENCE_WHY),
    *triton_rows("mxfp4_dequantize", "triton_ops.quant:mxfp4_dequantize", FUSED),
    Entry("mxfp4_dequantize", "torch", ALL, "dispatch.reference.quant:mxfp4_dequantize", TORCH_REF, REFERENCE_WHY),
    *triton_rows("fp8_group_quantize", "triton_ops.quant:fp8_group_quantize", FUSED,
                 supports="triton_ops.quant:supports_fp8_group_quantize"),
    Entry("fp8_group_quantize", "torch", ALL, "dispatch.reference.quant:fp8_group_quantize", TORCH_REF, REFERENCE_WHY),
    *triton_rows("fp8_group_dequantize", "triton_ops.quant:fp8_group_dequantize", FUSED,
                 supports="triton_ops.quant:supports_fp8_group_dequantize"),
    Entry("fp8_group_dequantize", "torch", ALL, "dispatch.reference.quant:fp8_group_dequantize",
          TORCH_REF, REFERENCE_WHY),
    # A layout permutation is one torch copy kernel already; a Triton twin would add nothing.
    Entry("swizzle_scales_128x4", "torch", ALL, "dispatch.reference.quant:swizzle_scales_128x4",
          TORCH_REF, "one permute+copy; nothing to fuse"),
    Entry("unswizzle_scales_128x4", "torch", ALL, "dispatch.reference.quant:unswizzle_scales_128x4",
          TORCH_REF, "one permute+copy; nothing to fuse"),
    # rope (docs/rope.md)
    *triton_rows("rope", "triton_ops.rope:rope", ONE_PASS),
    Entry("rope", "torch", ALL, "dispatch.reference.rope:rope", TORCH_REF, REFERENCE_WHY),
    *triton_rows("rope_", "triton_ops.rope:rope_", ONE_PASS),
    Entry("rope_", "torch", ALL, "dispatch.reference.rope:rope_", TORCH_REF, REFERENCE_WHY),
    # kv_cache (docs/kv_cache.md)
    *triton_rows("paged_kv_write_fp8", "triton_ops.kv_cache:paged_kv_write_fp8", ONE_PASS),
    Entry("paged_kv_write_fp8", "torch", ALL, "dispatch.reference.kv_cache:paged_kv_write_fp8",
          TORCH_REF, REFERENCE_WHY),
    *triton_rows("paged_kv_gather_fp8", "triton_ops.kv_cache:paged_kv_gather_fp8", ONE_PASS),
    Entry("paged_kv_gather_fp8", "torch", ALL, "dispatch.reference.kv_cache:paged_kv_gather_fp8",
          TORCH_REF, REFERENCE_WHY),
    *triton_rows("ds_kv_write", "triton_ops.kv_cache:ds_kv_write", ONE_PASS),
    Entry("ds_kv_write", "torch", ALL, "dispatch.reference.kv_cache:ds_kv_write", TORCH_REF, REFERENCE_WHY),
    *triton_rows("ds_kv_gather", "triton_ops.kv_cache:ds_kv_gather", ONE_PASS),
    Entry("ds_kv_gather", "torch", ALL, "dispatch.reference.kv_cache:ds_kv_gather", TORCH_REF, REFERENCE_WHY),
    *triton_rows("ds_rope_quant_append", "triton_ops.kv_cache:ds_rope_quant_append", ONE_PASS),
    Entry("ds_rope_quant_append", "torch", ALL, "dispatch.reference.kv_cache:ds_rope_quant_append",
          TORCH_REF, REFERENCE_WHY),
    # moe (docs/moe.md): router, align, gather, combine
    *triton_rows("moe_route", "triton_ops.moe.routing:moe_route", MOE,
                 supports="triton_ops.moe.routing:supports_route"),
    Entry("moe_route", "torch", ALL, "dispatch.reference.moe:moe_route", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_hash_route", "triton_ops.moe.routing:moe_hash_route", MOE,
                 supports="triton_ops.moe.routing:supports_route"),
    Entry("moe_hash_route", "torch", ALL, "dispatch.reference.moe:moe_hash_route", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_align", "triton_ops.moe.align:moe_align", MOE, supports="triton_ops.moe.align:supports_align"),
    Entry("moe_align", "torch", ALL, "dispatch.reference.moe:moe_align", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_masked_layout", "triton_ops.moe.align:moe_masked_layout", MOE,
                 supports="triton_ops.moe.align:supports_align"),
    Entry("moe_masked_layout", "torch", ALL, "dispatch.reference.moe:moe_masked_layout", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gather", "triton_ops.moe.align:moe_gather", MOE),
    Entry("moe_gather", "torch", ALL, "dispatch.reference.moe:moe_gather", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_combine", "triton_ops.moe.align:moe_combine", MOE),
    Entry("moe_combine", "torch", ALL, "dispatch.reference.moe:moe_combine", TORCH_REF, REFERENCE_WHY),
    # rmsnorm (docs/rmsnorm.md); CuTeDSL rows: see CUTE_WHY
    *triton_rows("rms_norm", "triton_ops.rmsnorm:rms_norm", NORM, supports="triton_ops.rmsnorm:supports_rms_norm"),
    Entry("rms_norm", "torch", ALL, "dispatch.reference.rmsnorm:rms_norm_op", TORCH_REF, REFERENCE_WHY),
    Entry("rms_norm", "cute", ("sm_90",), "cute_ops.rmsnorm:rms_norm",
          CUTE_MEASURED_FASTER, CUTE_WHY,
          supports="cute_ops.rmsnorm:supports_rms_norm",
          specialize="cute_ops.rmsnorm:specialize_rms_norm"),
    Entry("rms_norm", "cute", CUTE_BLACKWELL, "cute_ops.rmsnorm:rms_norm", CUTE_UNMEASURED, CUTE_UNRUN_WHY,
          supports="cute_ops.rmsnorm:supports_rms_norm",
          specialize="cute_ops.rmsnorm:specialize_rms_norm"),
    *triton_rows("rms_norm_fp8_group", "triton_ops.rmsnorm:rms_norm_fp8_group", NORM,
                 supports="triton_ops.rmsnorm:supports_rms_norm_fp8_group"),
    Entry("rms_norm_fp8_group", "torch", ALL, "dispatch.reference.rmsnorm:rms_norm_fp8_group",
          TORCH_REF, REFERENCE_WHY),
    Entry("rms_norm_fp8_group", "cute", ("sm_90",), "cute_ops.rmsnorm:rms_norm_fp8_group",
          CUTE_MEASURED_FASTER, CUTE_WHY,
          supports="cute_ops.rmsnorm:supports_rms_norm_fp8_group",
          specialize="cute_ops.rmsnorm:specialize_rms_norm_fp8_group"),
    Entry("rms_norm_fp8_group", "cute", CUTE_BLACKWELL, "cute_ops.rmsnorm:rms_norm_fp8_group",
          CUTE_UNMEASURED, CUTE_UNRUN_WHY,
          supports="cute_ops.rmsnorm:supports_rms_norm_fp8_group",
          specialize="cute_ops.rmsnorm:specialize_rms_norm_fp8_group"),
    *triton_rows("rms_norm_mxfp4", "triton_ops.rmsnorm:rms_norm_mxfp4", NORM,
                 supports="triton_ops.rmsnorm:supports_rms_norm"),
    Entry("rms_norm_mxfp4", "torch", ALL, "dispatch.reference.rmsnorm:rms_norm_mxfp4", TORCH_REF, REFERENCE_WHY),
    *triton_rows("rms_norm_nvfp4", "triton_ops.rmsnorm:rms_norm_nvfp4", NORM,
                 supports="triton_ops.rmsnorm:supports_rms_norm"),
    Entry("rms_norm_nvfp4", "torch", ALL, "dispatch.reference.rmsnorm:rms_norm_nvfp4", TORCH_REF, REFERENCE_WHY),
    Entry("rms_norm_nvfp4", "cute", ("sm_90",), "cute_ops.rmsnorm:rms_norm_nvfp4",
          CUTE_MEASURED_FASTER, CUTE_DECODE_WHY,
          supports="cute_ops.rmsnorm:supports_rms_norm_nvfp4",
          specialize="cute_ops.rmsnorm:specialize_rms_norm_nvfp4",
          auto_skip="dispatch.table:cute_nvfp4_prefill"),
    Entry("rms_norm_nvfp4", "cute", CUTE_BLACKWELL, "cute_ops.rmsnorm:rms_norm_nvfp4", CUTE_UNMEASURED, CUTE_UNRUN_WHY,
          supports="cute_ops.rmsnorm:supports_rms_norm_nvfp4",
          specialize="cute_ops.rmsnorm:specialize_rms_norm_nvfp4"),
    # swiglu (docs/swiglu.md)
    *triton_rows("swiglu", "triton_ops.swiglu:swiglu", NORM, supports="triton_ops.swiglu:supports_swiglu"),
    Entry("swiglu", "torch", ALL, "dispatch.reference.swiglu:swiglu_op", TORCH_REF, REFERENCE_WHY),
    *triton_rows("swiglu_fp8_group", "triton_ops.swiglu:swiglu_fp8_group", NORM,
                 supports="triton_ops.swiglu:supports_swiglu_fp8_group"),
    Entry("swiglu_fp8_group", "torch", ALL, "dispatch.reference.swiglu:swiglu_fp8_group", TORCH_REF, REFERENCE_WHY),
    *triton_rows("swiglu_mxfp4", "triton_ops.swiglu:swiglu_mxfp4", NORM, supports="triton_ops.swiglu:supports_swiglu"),
    Entry("swiglu_mxfp4", "torch", ALL, "dispatch.reference.swiglu:swiglu_mxfp4", TORCH_REF, REFERENCE_WHY),
    *triton_rows("swiglu_nvfp4", "triton_ops.swiglu:swiglu_nvfp4", NORM, supports="triton_ops.swiglu:supports_swiglu"),
    Entry("swiglu_nvfp4", "torch", ALL, "dispatch.reference.swiglu:swiglu_nvfp4", TORCH_REF, REFERENCE_WHY),
    # moe_gemm (docs/moe_gemm.md): expert grouped GEMMs over the moe_align / moe_masked_layout layouts
    *triton_rows("moe_gemm_bf16", "triton_ops.moe_gemm.grouped:moe_gemm_bf16", GROUPED_GEMM,
                 supports="triton_ops.moe_gemm.grouped:supports_moe_gemm_bf16"),
    Entry("moe_gemm_bf16", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_bf16", TORCH_REF, REFERENCE_WHY),
    Entry("moe_gemm_bf16", "cute", ("sm_90",), "cute_ops.gemm.grouped_sm90:moe_gemm_bf16", CUTE_MEASURED_FASTER,
          CUTE_GEMM_BF16_WHY, supports="cute_ops.gemm.grouped_sm90:supports_moe_gemm_bf16",
          auto_skip="cute_ops.gemm.grouped_sm90:auto_skip_bf16"),
    Entry("moe_gemm_bf16", "cute", CUTE_BLACKWELL, "cute_ops.gemm.blockscaled_sm100:moe_gemm_bf16", CUTE_UNMEASURED,
          CUTE_GEMM_BF16_SM100_WHY, supports="cute_ops.gemm.blockscaled_sm100:supports_moe_gemm_bf16"),
    *triton_rows("moe_gemm_fp8", "triton_ops.moe_gemm.grouped:moe_gemm_fp8", GROUPED_GEMM,
                 supports="triton_ops.moe_gemm.grouped:supports_moe_gemm_fp8"),
    Entry("moe_gemm_fp8", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_fp8", TORCH_REF, REFERENCE_WHY),
    Entry("moe_gemm_fp8", "cute", ("sm_90",), "cute_ops.gemm.grouped_sm90:moe_gemm_fp8", CUTE_MEASURED_FASTER,
          CUTE_GEMM_FP8_WHY, supports="cute_ops.gemm.grouped_sm90:supports_moe_gemm_fp8",
          auto_skip="cute_ops.gemm.grouped_sm90:auto_skip_fp8"),
    *triton_rows("moe_gemm_mxfp4", "triton_ops.moe_gemm.grouped:moe_gemm_mxfp4", GROUPED_GEMM,
                 supports="triton_ops.moe_gemm.grouped:supports_moe_gemm_mxfp4"),
    Entry("moe_gemm_mxfp4", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_mxfp4", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_nvfp4", "triton_ops.moe_gemm.grouped:moe_gemm_nvfp4", NVFP4_W4A16_WHY,
                 supports="triton_ops.moe_gemm.grouped:supports_moe_gemm_nvfp4"),
    Entry("moe_gemm_nvfp4", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_nvfp4", TORCH_REF, REFERENCE_WHY),
    # FP4 x FP4 over group offsets or the masked layout, with swizzled scales: the sm_100 CuTeDSL UMMA kernel (compiled
    # only: refused unless LOWBIT_CUTE_UNVERIFIED=1; swap-AB tiles for masked max_m <= 64) and the reference; the
    # moe_align-layout FP4 GEMMs with linear scales are the Triton dot_scaled rows of moe_gemm_w4a4 / moe_gemm_w4a8
    # (DOT_SCALED_WHY)
    Entry("moe_gemm_blockscaled", "cute", CUTE_BLACKWELL, "cute_ops.gemm.blockscaled_sm100:moe_gemm_blockscaled",
          CUTE_UNMEASURED, CUTE_GEMM_SM100_WHY, "cute_ops.gemm.blockscaled_sm100:supports_moe_gemm_blockscaled"),
    Entry("moe_gemm_blockscaled", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_blockscaled", TORCH_REF,
          REFERENCE_WHY),
    Entry("moe_gemm_blockscaled_masked", "cute", CUTE_BLACKWELL,
          "cute_ops.gemm.blockscaled_sm100:moe_gemm_blockscaled_masked", CUTE_UNMEASURED, CUTE_GEMM_SM100_WHY,
          "cute_ops.gemm.blockscaled_sm100:supports_moe_gemm_blockscaled_masked"),
    Entry("moe_gemm_blockscaled_masked", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_blockscaled_masked",
          TORCH_REF, REFERENCE_WHY),
    # prepacked FP4 weights (moe_gemm_fp4_prepack's layout): the swap-AB decode kernel; the prepack is torch work
    Entry("moe_gemm_fp4_prepack", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_fp4_prepack", TORCH_REF,
          FP4_PREPACK_WHY),
    *triton_rows("moe_gemm_fp4_prepacked", "triton_ops.moe_gemm.prepacked:moe_gemm_fp4_prepacked", FP4_PREPACKED_WHY,
                 supports="triton_ops.moe_gemm.prepacked:supports_moe_gemm_fp4_prepacked"),
    Entry("moe_gemm_fp4_prepacked", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_fp4_prepacked", TORCH_REF,
          REFERENCE_WHY),
    *triton_rows("moe_gemm_swiglu_fp4_prepacked", "triton_ops.moe_gemm.prepacked:moe_gemm_swiglu_fp4_prepacked",
                 FP4_PREPACKED_SWIGLU_WHY, supports="triton_ops.moe_gemm.prepacked:supports_moe_gemm_fp4_prepacked"),
    Entry("moe_gemm_swiglu_fp4_prepacked", "torch", ALL,
          "dispatch.reference.moe_gemm:moe_gemm_swiglu_fp4_prepacked", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_combine_fp4_prepacked", "triton_ops.moe_gemm.prepacked:moe_gemm_combine_fp4_prepacked",
                 FP4_PREPACKED_COMBINE_WHY, supports="triton_ops.moe_gemm.prepacked:supports_moe_gemm_fp4_prepacked"),
    Entry("moe_gemm_combine_fp4_prepacked", "torch", ALL,
          "dispatch.reference.moe_gemm:moe_gemm_combine_fp4_prepacked", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_w4a8", "triton_ops.moe_gemm.grouped:moe_gemm_w4a8", DOT_SCALED_WHY,
                 supports="triton_ops.moe_gemm.grouped:supports_moe_gemm_w4a8"),
    Entry("moe_gemm_w4a8", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_w4a8", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_w4a4", "triton_ops.moe_gemm.grouped:moe_gemm_w4a4", DOT_SCALED_WHY,
                 supports="triton_ops.moe_gemm.grouped:supports_moe_gemm_w4a4"),
    Entry("moe_gemm_w4a4", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_w4a4", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_swiglu", "triton_ops.moe_gemm.fused:moe_gemm_swiglu", GEMM_SWIGLU,
                 supports="triton_ops.moe_gemm.fused:supports_moe_gemm_swiglu"),
    Entry("moe_gemm_swiglu", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_swiglu", TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_swiglu_fp8_group", "triton_ops.moe_gemm.fused:moe_gemm_swiglu_fp8_group", GEMM_SWIGLU,
                 supports="triton_ops.moe_gemm.fused:supports_moe_gemm_swiglu_fp8_group"),
    Entry("moe_gemm_swiglu_fp8_group", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_swiglu_fp8_group",
          TORCH_REF, REFERENCE_WHY),
    *triton_rows("moe_gemm_swiglu_mxfp4", "triton_ops.moe_gemm.fused:moe_gemm_swiglu_mxfp4", GEMM_SWIGLU_FP4,
                 supports="triton_ops.moe_gemm.fused:supports_moe_gemm_swiglu"),
    Entry("moe_gemm_swiglu_mxfp4", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_swiglu_mxfp4", TORCH_REF,
          REFERENCE_WHY),
    *triton_rows("moe_gemm_swiglu_nvfp4", "triton_ops.moe_gemm.fused:moe_gemm_swiglu_nvfp4", GEMM_SWIGLU_FP4,
                 supports="triton_ops.moe_gemm.fused:supports_moe_gemm_swiglu"),
    Entry("moe_gemm_swiglu_nvfp4", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_swiglu_nvfp4", TORCH_REF,
          REFERENCE_WHY),
    *triton_rows("moe_gemm_combine", "triton_ops.moe_gemm.fused:moe_gemm_combine", GEMM_COMBINE,
                 supports="triton_ops.moe_gemm.fused:supports_moe_gemm_combine"),
    Entry("moe_gemm_combine", "torch", ALL, "dispatch.reference.moe_gemm:moe_gemm_combine", TORCH_REF, REFERENCE_WHY),
    # attention (docs/attention.md). sm_90: CuTeDSL at hd128 (ATTN_CUTE_WHY), then the Gluon warpgroup-MMA kernel, then
    # plain Triton (ATTN_SM90_WHY).
    Entry("attention_prefill", "triton", ("sm_90",), "triton_ops.attention.prefill_sm90:attention_prefill",
          TRITON_SM90_GLUON, ATTN_SM90_WHY, "triton_ops.attention.prefill_sm90:supports_attention_prefill_sm90"),
    Entry("attention_prefill", "cute", ("sm_90",), "cute_ops.attention.fmha_sm90:attention_prefill",
          CUTE_MEASURED_FASTER, ATTN_CUTE_WHY, "cute_ops.attention.fmha_sm90:supports_attention_prefill",
          auto_skip="cute_ops.attention.fmha_sm90:auto_skip_untimed",
          specialize="cute_ops.attention.fmha_sm90:specialize_attention_prefill"),
    *triton_rows("attention_prefill", "triton_ops.attention.prefill:attention_prefill", ATTN_TL_WHY,
                 supports="triton_ops.attention.prefill:supports_attention_prefill"),
    Entry("attention_prefill", "torch", ALL, "dispatch.reference.attention:attention_prefill", TORCH_REF,
          REFERENCE_WHY),
    # sm_90: gather the used pages into contiguous K / V, then the cute forward (ATTN_PAGED_GATHER_WHY).
    Entry("attention_prefill_paged", "cute", ("sm_90",), "dispatch.composed.paged_prefill:attention_prefill_paged",
          CUTE_MEASURED_FASTER, ATTN_PAGED_GATHER_WHY,
          "dispatch.composed.paged_prefill:supports_attention_prefill_paged",
          auto_skip="cute_ops.attention.fmha_sm90:auto_skip_untimed",  # the forward's timed head dims (q first)
          specialize="dispatch.composed.paged_prefill:specialize_attention_prefill_paged"),
    *triton_rows("attention_prefill_paged", "triton_ops.attention.prefill:attention_prefill_paged", ATTN_TL_WHY,
                 supports="triton_ops.attention.prefill:supports_attention_prefill_paged"),
    Entry("attention_prefill_paged", "torch", ALL, "dispatch.reference.attention:attention_prefill_paged",
          TORCH_REF, REFERENCE_WHY),
    *triton_rows("attention_decode", "triton_ops.attention.decode:attention_decode", ATTN_DECODE_WHY,
                 supports="triton_ops.attention.decode:supports_attention_decode"),
    Entry("attention_decode", "torch", ALL, "dispatch.reference.attention:attention_decode", TORCH_REF,
          REFERENCE_WHY),
    Entry("mla_decode", "triton", ("sm_90",), "triton_ops.attention.mla_sm90:mla_decode", TRITON_SM90_GLUON,
          MLA_SM90_WHY, "triton_ops.attention.mla_sm90:supports_mla_decode_sm90"),
    Entry("mla_decode", "triton", ("sm_90",), "triton_ops.attention.mla_sm90_fp8:mla_decode", TRITON_SM90_GLUON,
          MLA_SM90_FP8_WHY, "triton_ops.attention.mla_sm90_fp8:supports_mla_decode_fp8_sm90"),
    *triton_rows("mla_decode", "triton_ops.attention.mla_decode:mla_decode", MLA_DECODE_WHY,
                 supports="triton_ops.attention.mla_decode:supports_mla_decode"),
    Entry("mla_decode", "torch", ALL, "dispatch.reference.attention:mla_decode", TORCH_REF, REFERENCE_WHY),
    *triton_rows("mla_index_scores", "triton_ops.attention.indexer:mla_index_scores", INDEX_SCORES_WHY,
                 supports="triton_ops.attention.indexer:supports_mla_index_scores"),
    Entry("mla_index_scores", "torch", ALL, "dispatch.reference.attention:mla_index_scores", TORCH_REF,
          REFERENCE_WHY),
    *triton_rows("merge_attn_states", "triton_ops.attention.merge:merge_attn_states", ONE_PASS,
                 supports="triton_ops.attention.merge:supports_merge_attn_states"),
    Entry("merge_attn_states", "torch", ALL, "dispatch.reference.attention:merge_attn_states", TORCH_REF,
          REFERENCE_WHY),
)

TABLE: dict[str, list[Entry]] = {}
for _entry in ROWS:
    TABLE.setdefault(_entry.op, []).append(_entry)
