"""The group-bounds kernel of the grouped GEMMs (host module: group_bounds.py). Imported only when
nvidia-cutlass-dsl is installed.

One CTA of THREADS threads, any row count (rows and groups are symbolic: one compile per layout, workspace and
arch). What it computes is group_bounds.py's contract:
* contiguous: pass 1 sets every group to (first = rows, last = -1); pass 2 strides over the rows and, at the
  first row of a run of equal ids, atomic-mins the row into the group's first, at the last row of a run
  atomic-maxes it into the group's last (only run edges touch memory: a sorted layout's long runs cost no
  contention); pass 3 turns (first, last) into (start, count). Passes are separated by CTA barriers, and pass 3
  reads through atomics, so it sees every pass-2 update whatever the L1 holds.
* masked: start = g * max_m, count = clamp(masked_m[g], 0, max_m).
The GEMM's descriptor workspace, when given, is zeroed by the same threads first.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

THREADS = 1024
UNROLL = 4


class GroupBounds:
    def __init__(self, cfg):
        self.cfg = cfg

    @cute.jit
    def __call__(self, src: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, workspace, max_m: Int32,
                 stream: cuda.CUstream):
        self.kernel(src, starts, counts, workspace, max_m).launch(grid=[1, 1, 1], block=[THREADS, 1, 1],
                                                                  stream=stream)

    @cute.kernel
    def kernel(self, src: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, workspace, max_m: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        groups = starts.shape[0]
        if const_expr(workspace is not None):
            for i in cutlass.range(tidx, workspace.shape[0], THREADS):
                workspace[i] = Int64(0)
        if const_expr(self.cfg.layout == "masked"):
            for g in cutlass.range(tidx, groups, THREADS):
                starts[g] = g * max_m
                counts[g] = cutlass.min(cutlass.max(src[g], Int32(0)), max_m)
        else:
            rows = src.shape[0]
            for g in cutlass.range(tidx, groups, THREADS):
                starts[g] = rows
                counts[g] = Int32(-1)
            cute.arch.barrier()
            # UNROLL rows per thread and round, their loads issued before any is used (indices clamped in range,
            # so no load is predicated): one memory latency per round instead of per row
            last_row = rows - 1
            for base in cutlass.range(tidx, rows, THREADS * UNROLL):
                for j in cutlass.range_constexpr(UNROLL):
                    r = base + j * THREADS
                    at = cutlass.min(r, last_row)
                    g = src[at]
                    prev = src[cutlass.max(at - 1, Int32(0))]
                    nxt = src[cutlass.min(at + 1, last_row)]
                    if r < rows:
                        if g >= 0:
                            if g < groups:
                                if r == 0 or prev != g:
                                    cute.arch.atomic_min(starts.iterator + g, r)
                                if r == last_row or nxt != g:
                                    cute.arch.atomic_max(counts.iterator + g, r)
            cute.arch.barrier()
            for g in cutlass.range(tidx, groups, THREADS):
                first = cute.arch.atomic_add(starts.iterator + g, Int32(0))
                last = cute.arch.atomic_add(counts.iterator + g, Int32(0))
                counts[g] = cutlass.max(last - first + 1, Int32(0))
                starts[g] = cutlass.min(first, cutlass.max(rows - 1, Int32(0)))
