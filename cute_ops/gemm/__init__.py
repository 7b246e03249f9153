"""CuTeDSL GEMMs. The shared pieces are their own modules; kernels compose them.

* `scale_layout` (no DSL needed; its two CuTe builders import it lazily): the 128x4 block-scale layout.
  (row, k-block) -> byte in torch, equal to `swizzle_scales_128x4`; the same atom as a CuTe layout over element
  coordinates, from which the kernels build their scale tensors and TMA descriptors.
* `scheduler` (the model needs no DSL; `GroupedTileScheduler` does): static persistent tile order over groups
  whose row extents come from device offsets (`moe_align`'s expert_offsets). Python model + device twin.
* the torch twin of this GEMM is dispatch/reference/moe_gemm.py `grouped_blockscaled_gemm` (the contract decoders).
* `blockscaled_sm100` (imports the DSL): grouped (MoE contiguous) NVFP4 / MXFP4 block-scaled GEMM for sm_100a:
  tcgen05 UMMA, TMEM accumulator, TMA loads of A / B / both scale tensors, bf16 epilogue. Compiled and
  SASS-inspected on the CPU only, never run on Blackwell hardware; not in dispatch/table.py.

Importing this package imports nothing heavy. See docs/cute.md ("Grouped block-scaled GEMM").
"""
