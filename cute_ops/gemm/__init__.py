"""CuTeDSL GEMMs. The shared pieces are their own modules; kernels compose them.

* `scale_layout` (no DSL needed; its two CuTe builders import it lazily): the 128x4 block-scale layout.
  (row, k-block) -> byte in torch, equal to `swizzle_scales_128x4`; the same atom as a CuTe layout over element
  coordinates, from which the kernels build their scale tensors and TMA descriptors.
* `scheduler` (the model needs no DSL; `GroupedTileScheduler` does): static persistent tile order over groups
  whose row extents come from device tensors (offsets, or starts + counts). Python model + device twins.
* the torch twin of this GEMM is dispatch/reference/moe_gemm.py `grouped_blockscaled_gemm` (the contract decoders).
* `blockscaled_sm100` (imports the DSL): grouped (MoE, groups as starts + counts) NVFP4 / MXFP4 block-scaled GEMM
  for sm_100a: tcgen05 UMMA, TMEM accumulator, TMA loads of A / B / both scale tensors, bf16 epilogue; a swap-AB
  variant for decode; the same pipeline with dense bf16 / fp16 operands (tcgen05 kind::f16). `moe_sm100` (torch
  only until a call compiles): its `moe_gemm_blockscaled` / `moe_gemm_blockscaled_masked` backends (offsets and
  masked layouts) and the sm_100 `moe_gemm_bf16` backend (contiguous and masked layouts, row weights). Compiled
  and SASS-inspected on the CPU only, never run on Blackwell hardware: the table rows are refused unless
  LOWBIT_CUTE_UNVERIFIED=1.
* `grouped_sm90` (imports the DSL): bf16 / fp16 / FP8 (block-scaled) grouped GEMM for sm_90a: WGMMA, TMA loads,
  the A operand's TMA descriptor rewritten per group on the device (address + row extent from device tensors).
  `grouped_sm90_config` (no DSL needed): its compile key and tile / FP8 schedule rule (`GemmConfig`, `pick_config`,
  `can_implement`); `grouped_sm90_steps`: its consumer-side steps (smem epilogue, FP8 promotion, scale loads).
  `moe_sm90` (torch only until a call compiles): its `moe_gemm_bf16` / `moe_gemm_fp8` backends (masked and
  contiguous layouts). Runs on the H100 and the H200; auto takes its rows at prefill sizes (`moe_sm90.auto_skip_*`).

Importing this package imports nothing heavy. See docs/cute.md ("Grouped GEMM on sm_90", "Grouped block-scaled GEMM").
"""
