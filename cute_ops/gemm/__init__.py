"""CuTeDSL GEMMs. The shared pieces are their own modules; kernels compose them.

* `scale_layout` (no DSL needed; its two CuTe builders import it lazily): the 128x4 block-scale layout.
  (row, k-block) -> byte in torch, equal to `swizzle_scales_128x4`; the same atom as a CuTe layout over element
  coordinates, from which the kernels build their scale tensors and TMA descriptors.
* `scheduler` (the model needs no DSL; `GroupedTileScheduler`, defined only with the DSL, does): static
  persistent tile order over groups whose row extents come from device tensors (offsets, or starts + counts).
  Python model + device twins.
* the torch twin of this GEMM is dispatch/reference/moe_gemm.py `grouped_blockscaled_gemm` (the contract decoders).

Each kernel is two modules, the anatomy of docs/contributing.md: a host module (config, rule, build / compiled /
dump, supports, backend entry functions; torch only until a call compiles) and its kernel module `_<kernel>_kernel`
(imports the DSL; imported by the host module's `build` only).

* `blockscaled_sm100` / `_blockscaled_sm100_kernel`: grouped (MoE, groups as starts + counts) NVFP4 / MXFP4
  block-scaled GEMM for sm_100a: tcgen05 UMMA, TMEM accumulator, TMA loads of A / B / both scale tensors, bf16
  epilogue; a swap-AB variant for decode; the same pipeline with dense bf16 / fp16 operands (tcgen05 kind::f16).
  Backends: `moe_gemm_blockscaled` / `moe_gemm_blockscaled_masked` (offsets and masked layouts) and the sm_100
  `moe_gemm_bf16` (contiguous and masked layouts, row weights). Compiled and SASS-inspected on the CPU only, never
  run on Blackwell hardware: the table rows are refused unless LOWBIT_CUTE_UNVERIFIED=1.
* `grouped_sm90` / `_grouped_sm90_kernel`: bf16 / fp16 / FP8 (block-scaled) grouped GEMM for sm_90a: WGMMA, TMA
  loads, the A operand's TMA descriptor rewritten per group on the device (address + row extent from device
  tensors). The host module holds its compile key and tile / FP8 schedule rule (`GemmConfig`, `pick_config`,
  `can_implement`) and the `moe_gemm_bf16` / `moe_gemm_fp8` backends (masked and contiguous layouts). Runs on the
  H100 and the H200; auto takes its rows at prefill sizes (`grouped_sm90.auto_skip_*`).

Importing this package imports nothing heavy. See docs/cute.md ("Grouped GEMM on sm_90", "Grouped block-scaled GEMM").
"""
