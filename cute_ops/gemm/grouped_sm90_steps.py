"""Consumer-side steps of the sm_90a grouped GEMM (cute_ops/gemm/grouped_sm90.py): the smem epilogue, the FP8
promotion and scale loads, one stage's WGMMAs. A mixin of GroupedGemmSm90 (reads self.cfg, self.out_dtype)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup

from .grouped_sm90_config import WG

CHUNK = 8  # 2-byte output elements per 16-byte chunk of the smem epilogue


class ConsumerSteps:
    @cute.jit
    def _smem_epilogue(self, sC, res, tCcC, mma_tidx, out, m_indices, g, row_start, row_end, col0):
        """Stage this warp group's 64 x tile_n output rows in smem, then coalesced predicated 16-byte stores.
        Chunk c of row r (CHUNK columns) sits at chunk c ^ (r % 8) of the row: the fragment's 4-byte writes (8 rows
        x 4 column pairs of one chunk per warp instruction) and the 16-byte reads are bank-conflict free. r is the
        output row (row_start + ...), not the row in the tile: the addresses then change per tile, and the compiler
        does not hoist 32 of them out of the tile loop into registers the main loop needs (spills)."""
        cfg = self.cfg
        wg = mma_tidx // WG
        lt = mma_tidx % WG
        per_row = cfg.tile_n // CHUNK
        passes = 64 * per_row // WG
        base = sC.iterator + wg * 64 * cfg.tile_n
        for j in cutlass.range_constexpr(cute.size(res) // 2):
            rl = tCcC[2 * j][0] - wg * 64
            col = tCcC[2 * j][1]
            off = rl * cfg.tile_n + ((col // CHUNK) ^ ((row_start + rl) % 8)) * CHUNK + col % CHUNK
            staged = cute.make_tensor(cute.make_ptr(self.out_dtype, (base + off).toint(), cute.AddressSpace.smem,
                                                    assumed_align=4), cute.make_layout(2))
            cute.autovec_copy(cute.make_tensor(res.iterator + 2 * j, cute.make_layout(2)), staged)
        # the row predicates (their loads overlap the barrier wait); each thread's chunk rows are lt // per_row +
        # p * (WG // per_row)
        ok = cute.make_rmem_tensor(passes, cutlass.Boolean)
        for p in cutlass.range_constexpr(passes):
            c = lt + p * WG
            r = row_start + wg * 64 + c // per_row
            keep = (r < row_end) & (col0 + (c % per_row) * CHUNK < cfg.n)
            if cutlass.const_expr(m_indices is not None):
                keep = keep & (m_indices[cutlass.min(r, row_end - 1)] == g)
            ok[p] = keep
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=WG)
        chunk = cute.make_rmem_tensor(CHUNK, self.out_dtype)
        for p in cutlass.range_constexpr(passes):
            c = lt + p * WG
            rl = c // per_row
            ch = c % per_row
            src = cute.make_tensor(cute.make_ptr(self.out_dtype, (base + rl * cfg.tile_n + (ch ^ ((row_start + rl) % 8))
                                                                  * CHUNK)
                                                 .toint(), cute.AddressSpace.smem, assumed_align=16),
                                   cute.make_layout(CHUNK))
            cute.autovec_copy(src, chunk)
            if ok[p]:
                dst = cute.make_tensor(cute.make_ptr(self.out_dtype, (out.iterator + (
                    cutlass.Int64(row_start + wg * 64 + rl) * cfg.n + col0 + ch * CHUNK)).toint(),
                    cute.AddressSpace.gmem, assumed_align=16), cute.make_layout(CHUNK))
                cute.autovec_copy(chunk, dst)
        # the next tile's writes reuse these rows
        cute.arch.barrier(barrier_id=1 + wg, number_of_threads=WG)

    @cute.jit
    def _zero_unowned_rows(self, out, m_indices, sched, bidx, mma_tidx):
        """Zeros in every output row no group writes, so the launcher allocates `out` uninitialized (zeroing all of
        it cost 10% of a DeepSeek GEMM2). Contiguous: rows whose id is outside [0, G) (a row with id g lies in g's
        span, which writes it); masked ((G * max_m) rows): rows past their group's count. Disjoint from every
        tile's rows, so it needs no ordering with them. One row per consumer warp at a time, 16-byte stores."""
        cfg = self.cfg
        m = out.shape[0]
        lane = mma_tidx % 32
        warps = cfg.grid * self.mma_warps
        zero = cute.make_rmem_tensor(CHUNK, self.out_dtype)
        zero.fill(0.0)
        r = bidx * self.mma_warps + mma_tidx // 32
        max_m = m // cfg.num_groups
        while r < m:
            owned = False
            if cutlass.const_expr(m_indices is not None):
                gid = m_indices[r]
                owned = (gid >= 0) & (gid < cfg.num_groups)
            else:
                gid = r // max_m
                owned = r - sched.starts[gid] < sched.counts[gid]
            if not owned:
                for c in cutlass.range(lane * CHUNK, cfg.n, 32 * CHUNK, unroll=1):
                    dst = cute.make_tensor(cute.make_ptr(self.out_dtype, (out.iterator + (
                        cutlass.Int64(r) * cfg.n + c)).toint(), cute.AddressSpace.gmem, assumed_align=16),
                        cute.make_layout(CHUNK))
                    cute.autovec_copy(zero, dst)
            r = r + warps

    @staticmethod
    def _promote(acc, part, f0, f1):
        """acc += part * f, f = f0 in the thread's first row half, f1 in its second."""
        for i in range(cute.size(acc)):
            acc[i] = acc[i] + part[i] * (f1 if (i // 2) % 2 else f0)

    @staticmethod
    def _load_scales(sa, sw, slot: int, a_scale, w_scale, rows, g, n_tile, kt):
        """Scale slot `slot` <- stage kt's: the thread's 2 rows' a_scale and the tile's w_scale."""
        sw[slot] = w_scale[g, n_tile, kt]
        for h in range(2):
            sa[2 * slot + h] = a_scale[rows[h], kt]

    @staticmethod
    def _load_wave_scales(sa, sw, a_scale, w_scale, rows, g, cols, last_nb: int, kt):
        """Stage kt's scales of the wave schedule: sa[j] <- a_scale of the thread's row j, sw[c] <- w_scale of the
        128-column block of tile column chunk c (first column cols[c], clamped into the blocks)."""
        for c in range(len(cols)):
            sw[c] = w_scale[g, cutlass.min(cols[c] // 128, last_nb), kt]
        for j in range(cute.size(sa)):
            sa[j] = a_scale[rows[j], kt]

    @staticmethod
    def _stage_mmas(tiled_mma, acc, tCrA, tCrB, stage, k_blocks: int):
        """The WGMMAs of one smem stage accumulating into `acc`, committed as one group."""
        for kb in range(k_blocks):
            crd = (None, None, kb, stage)
            cute.gemm(tiled_mma, acc, tCrA[crd], tCrB[crd], acc)
        warpgroup.commit_group()
