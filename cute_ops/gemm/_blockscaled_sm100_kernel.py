"""The sm_100a grouped GEMM kernel class (blockscaled_sm100.py: what it computes, the roles, the config and the
rule).

Imported by blockscaled_sm100.build only, so importing lowbit never needs nvidia-cutlass-dsl. No
`from __future__ import annotations`: the DSL evaluates the kernel's annotations."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator

from . import scale_layout
from .blockscaled_sm100 import BLOCK_M, FORMATS, GemmConfig
from .scheduler import BoundedTileScheduler

TMEM_COLS = 512
WARP_EPI, WARP_MMA, WARP_TMA = (0, 1, 2, 3), 4, 5
THREADS = 32 * 6


class GroupedBlockScaledGemmSm100:
    def __init__(self, cfg: GemmConfig):
        f = FORMATS[cfg.fmt]
        self.cfg = cfg
        self.dense = f.dense  # no scale factors: every SF piece (TMA, smem, tcgen05.cp, TMEM columns) is skipped
        self.sf_vec = cfg.sf_vec
        self.sf_dtype = getattr(cutlass, f.sf_dtype) if f.sf_dtype else None
        self.ab_dtype = getattr(cutlass, f.ab_dtype)
        self.out_dtype = getattr(cutlass, f.out_dtype)
        self.tile = (BLOCK_M, cfg.tile_n, f.block_k)  # UMMA (M, N, K) per tile
        # the UMMA N side's scale tile: whole 128-row atoms (a 32 / 64-token tile reads its columns of one)
        self.tile_sfb = (BLOCK_M, scale_layout.round_up(cfg.tile_n, BLOCK_M), f.block_k)
        self.k_tiles = -(-cfg.k // f.block_k)  # dense: a partial last stage is zero-filled by TMA
        self.n_tiles = cfg.n // cfg.cols_per_tile
        self.epi_tile = (BLOCK_M, cfg.epi_cols)

    def _mma_op(self, n: int):
        shape = (BLOCK_M, n, self.tile[2] // 4)
        args = (shape, tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM)
        op = getattr(tcgen05, FORMATS[self.cfg.fmt].mma_op)
        if self.dense:  # tcgen05.mma kind::f16, both operands K-major
            k_major = cute.nvgpu.OperandMajorMode.K
            return op(self.ab_dtype, cutlass.Float32, *args, k_major, k_major)
        return op(self.sf_dtype, *args) if op is tcgen05.MmaMXF4NVF4Op else op(*args)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor | None, sfb: cute.Tensor | None,
                 out: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, alpha: cute.Tensor | None,
                 lo: cute.Tensor | None, m_indices: cute.Tensor | None, row_weights: cute.Tensor | None, stream):
        cfg = self.cfg
        m = a.shape[0]
        n, k, groups = cfg.n, cfg.k, cfg.num_groups
        # Byte tensors from the host (FP4) or 16-bit tensors (dense), typed views here
        mAct = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=self.ab_dtype),
                                cute.make_ordered_layout((m, k, 1), order=(1, 0, 2)))
        mW = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=self.ab_dtype),
                              cute.make_ordered_layout((n, k, groups), order=(1, 0, 2)))
        mSFAct = mSFW = None
        if cutlass.const_expr(not self.dense):
            # the activation scale container has round_up(M, 128) rows (its own extent: M need not be a multiple
            # of 128); scale bytes as their float8 type
            mSFAct = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=self.sf_dtype),
                                      scale_layout.scale_tensor_layout((sfa.shape[0], k, 1), self.sf_vec))
            mSFW = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=self.sf_dtype),
                                    scale_layout.scale_tensor_layout(mW.shape, self.sf_vec))
        if cutlass.const_expr(cfg.swap_ab):
            # UMMA A = the weights (output columns on M), B = the tokens; C = out^T: (n, m) with the token stride n
            mA, mB, mSFA, mSFB = mW, mAct, mSFW, mSFAct
            mC = cute.make_tensor(out.iterator, cute.make_ordered_layout((n, m, 1), order=(0, 1, 2)))
        else:
            mA, mB, mSFA, mSFB = mAct, mW, mSFAct, mSFW
            mC = cute.make_tensor(out.iterator, cute.make_ordered_layout((m, n, 1), order=(1, 0, 2)))

        tiled_mma = cute.make_tiled_mma(self._mma_op(cfg.tile_n))
        stages = cfg.ab_stages
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.tile, self.ab_dtype, stages)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.tile, self.ab_dtype, stages)
        tiled_mma_sfb = sfa_smem = sfb_smem = None
        if cutlass.const_expr(not self.dense):
            # the N-side scales are loaded (and copied to TMEM) as whole 128-row atoms: partitioned by an N = 128
            # MMA
            tiled_mma_sfb = cute.make_tiled_mma(self._mma_op(self.tile_sfb[1]))
            sfa_smem = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.tile, self.sf_vec, stages)
            sfb_smem = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.tile, self.sf_vec, stages)

        one_cta = cute.make_layout((1, 1, 1, 1))
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)

        def stage0(layout):
            return cute.slice_(layout, (None, None, None, 0))

        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(g2s, mA, stage0(a_smem), self.tile, tiled_mma,
                                                         one_cta.shape)
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mB, stage0(b_smem), self.tile, tiled_mma,
                                                         one_cta.shape)
        self.tx_bytes = (cute.size_in_bytes(self.ab_dtype, stage0(a_smem))
                         + cute.size_in_bytes(self.ab_dtype, stage0(b_smem)))
        tma_sfa = tma_mSFA = tma_sfb = tma_mSFB = None
        if cutlass.const_expr(not self.dense):
            # scale tiles: TMA'd with a 16-bit internal element type, as CUTLASS's block-scaled kernels do
            tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(g2s, mSFA, stage0(sfa_smem), self.tile, tiled_mma,
                                                                 one_cta.shape, internal_type=cutlass.Int16)
            tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mSFB, stage0(sfb_smem), self.tile_sfb,
                                                                 tiled_mma_sfb, one_cta.shape,
                                                                 internal_type=cutlass.Int16)
            self.tx_bytes += (cute.size_in_bytes(self.sf_dtype, stage0(sfa_smem))
                              + cute.size_in_bytes(self.sf_dtype, stage0(sfb_smem)))

        @cute.struct
        class Storage:
            ab_bar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            acc_bar: cute.struct.MemRange[cutlass.Int64, cfg.acc_stages * 2]
            tmem_addr: cutlass.Int32

        self.storage = Storage
        # Upper bound of the tile count: the grid never exceeds it nor the SM count. Dense: groups start anywhere
        # (their spans are tile-aligned by the launcher: one more row tile per group at most)
        row_tiles = (m + (cfg.rows_per_tile - 1)) // cfg.rows_per_tile + (groups if cfg.dense else 0)
        max_tiles = row_tiles * self.n_tiles
        grid = cutlass.min(max_tiles, cutlass.Int32(cfg.max_ctas))
        grid = cutlass.max(grid, cutlass.Int32(1))
        self.kernel(tiled_mma, tiled_mma_sfb, tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
                    mC, starts, counts, alpha, lo, m_indices, row_weights, a_smem, b_smem, sfa_smem,
                    sfb_smem).launch(
            grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tiled_mma_sfb: cute.TiledMma | None, tma_a: cute.CopyAtom,
               mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, tma_sfa: cute.CopyAtom | None,
               mSFA: cute.Tensor | None, tma_sfb: cute.CopyAtom | None, mSFB: cute.Tensor | None, mC: cute.Tensor,
               starts: cute.Tensor, counts: cute.Tensor, alpha: cute.Tensor | None, lo: cute.Tensor | None,
               m_indices: cute.Tensor | None, row_weights: cute.Tensor | None, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, sfa_smem: cute.Layout | None, sfb_smem: cute.Layout | None):
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()

        if warp == WARP_TMA:
            for atom in (tma_a, tma_b) if self.dense else (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(self.storage)
        sA = smem.allocate_tensor(self.ab_dtype, a_smem.outer, byte_alignment=1024, swizzle=a_smem.inner)
        sB = smem.allocate_tensor(self.ab_dtype, b_smem.outer, byte_alignment=1024, swizzle=b_smem.inner)
        sSFA = sSFB = None
        if cutlass.const_expr(not self.dense):
            sSFA = smem.allocate_tensor(self.sf_dtype, sfa_smem, byte_alignment=128)
            sSFB = smem.allocate_tensor(self.sf_dtype, sfb_smem, byte_alignment=128)

        thread = pipeline.Agent.Thread
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_bar.data_ptr(), num_stages=cfg.ab_stages,
            producer_group=pipeline.CooperativeGroup(thread), consumer_group=pipeline.CooperativeGroup(thread, 1),
            tx_count=self.tx_bytes)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_bar.data_ptr(), num_stages=cfg.acc_stages,
            producer_group=pipeline.CooperativeGroup(thread),
            consumer_group=pipeline.CooperativeGroup(thread, 32 * len(WARP_EPI)))
        tmem = TmemAllocator(storage.tmem_addr.ptr, allocator_warp_id=WARP_EPI[0],
                             barrier_for_retrieve=pipeline.NamedBarrier(
                                 barrier_id=2, num_threads=32 * (len(WARP_EPI) + 1)))
        epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(WARP_EPI))

        # Global tiles: (bM, bK, RestM, RestK, RestL) etc., partitioned as the MMA sees them
        thr_mma = tiled_mma.get_slice(0)
        tile_mk = cute.slice_(self.tile, (None, 0, None))
        tile_nk = cute.slice_(self.tile, (0, None, None))
        tCgA = thr_mma.partition_A(cute.local_tile(mA, tile_mk, (None, None, None)))
        tCgB = thr_mma.partition_B(cute.local_tile(mB, tile_nk, (None, None, None)))
        tCgSFA = tCgSFB = None
        if cutlass.const_expr(not self.dense):
            tCgSFA = thr_mma.partition_A(cute.local_tile(mSFA, tile_mk, (None, None, None)))
            tCgSFB = tiled_mma_sfb.get_slice(0).partition_B(
                cute.local_tile(mSFB, cute.slice_(self.tile_sfb, (0, None, None)), (None, None, None)))
        tile_mn = cute.slice_(self.tile, (None, None, 0))
        tCgC = thr_mma.partition_C(cute.local_tile(mC, tile_mn, (None, None, None)))
        tCcC = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor(mC.shape), tile_mn,
                                                   (None, None, None)))

        # Accumulator layout (MMA, MMA_M, MMA_N, ACC_STAGE); TMEM address bound later
        acc_shape = tiled_mma.partition_shape_C(self.tile[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, cfg.acc_stages))

        # Groups as (starts, counts): one descriptor per operand, groups addressed by tile coordinates (no
        # descriptor rewrites); rows past a group's count are computed from its own allocation and not written
        sched = BoundedTileScheduler(starts, counts, cfg.num_groups, cfg.rows_per_tile, self.n_tiles)

        if warp == WARP_TMA:
            self.produce(sched, bidx, nctas, ab_pipe, tma_a, tma_b, tma_sfa, tma_sfb, tCgA, tCgB, tCgSFA,
                         tCgSFB, sA, sB, sSFA, sSFB)
        if warp == WARP_MMA:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            self.mma(sched, bidx, nctas, tiled_mma, ab_pipe, acc_pipe, acc_ptr, tCtAcc_fake, sA, sB, sSFA, sSFB,
                     sfa_smem, sfb_smem)
        if warp < WARP_MMA:
            tmem.allocate(TMEM_COLS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            self.epilogue(sched, bidx, nctas, tidx, acc_pipe, acc_ptr, tCtAcc_fake, tCgC, tCcC, alpha, lo,
                          m_indices, row_weights)
            tmem.relinquish_alloc_permit()
            epi_barrier.arrive_and_wait()
            tmem.free(acc_ptr)

    def _tile(self, row_start, n_tile, g):
        """Tile coordinates of the tile whose rows start at row_start (column tile n_tile, group g):
        ((A tile, A l), (B tile, B l), N-side scale atom, (C tile m, C tile n)) in the UMMA's A / B / C terms."""
        rows = self.cfg.rows_per_tile
        act, wgt = (row_start // rows, 0), (n_tile, g)
        if cutlass.const_expr(self.cfg.swap_ab):
            return wgt, act, row_start // BLOCK_M, (n_tile, row_start // rows)
        return act, wgt, n_tile, (row_start // rows, n_tile)

    # ------------------------------------------------------------------------------------ warp roles

    @cute.jit
    def produce(self, sched, bidx, nctas, ab_pipe, tma_a, tma_b, tma_sfa, tma_sfb, tCgA, tCgB, tCgSFA, tCgSFB,
                sA, sB, sSFA, sSFB):
        one = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sA, 0, 3),
                                           cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 3),
                                           cute.group_modes(tCgB, 0, 3))
        if cutlass.const_expr(not self.dense):
            tAsSFA, tAgSFA = cpasync.tma_partition(tma_sfa, 0, one, cute.group_modes(sSFA, 0, 3),
                                                   cute.group_modes(tCgSFA, 0, 3))
            tBsSFB, tBgSFB = cpasync.tma_partition(tma_sfb, 0, one, cute.group_modes(sSFB, 0, 3),
                                                   cute.group_modes(tCgSFB, 0, 3))
            # the scale atoms broadcast over the sf_vec elements (stride 0): drop those modes for the copy
            tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
            tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.ab_stages)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            _, n_tile, row_start, _ = sched.coords(t, g, base)
            (a_t, a_l), (b_t, b_l), sfb_t, _ = self._tile(row_start, n_tile, g)
            gA = tAgA[(None, a_t, None, a_l)]
            gB = tBgB[(None, b_t, None, b_l)]
            if cutlass.const_expr(not self.dense):
                gSFA = tAgSFA[(None, a_t, None, a_l)]
                gSFB = tBgSFB[(None, sfb_t, None, b_l)]
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, gA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, gB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                if cutlass.const_expr(not self.dense):
                    cute.copy(tma_sfa, gSFA[(None, kt)], tAsSFA[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_sfb, gSFB[(None, kt)], tBsSFB[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)
        ab_pipe.producer_tail(state)

    @cute.jit
    def mma(self, sched, bidx, nctas, tiled_mma, ab_pipe, acc_pipe, acc_ptr, tCtAcc_fake, sA, sB, sSFA, sSFB,
            sfa_smem, sfb_smem):
        tCtAcc_all = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        if cutlass.const_expr(not self.dense):
            # scale factors live in TMEM right after the accumulators
            sf_col = tcgen05.find_tmem_tensor_col_offset(tCtAcc_all)
            tCtSFA_layout = blockscaled_utils.make_tmem_layout_sfa(tiled_mma, self.tile, self.sf_vec,
                                                                   cute.slice_(sfa_smem, (None, None, None, 0)))
            tCtSFA = cute.make_tensor(cute.recast_ptr(acc_ptr + sf_col, dtype=self.sf_dtype), tCtSFA_layout)
            sfb_col = sf_col + tcgen05.find_tmem_tensor_col_offset(tCtSFA)
            tCtSFB_layout = blockscaled_utils.make_tmem_layout_sfb(tiled_mma, self.tile, self.sf_vec,
                                                                   cute.slice_(sfb_smem, (None, None, None, 0)))
            tCtSFB = cute.make_tensor(cute.recast_ptr(acc_ptr + sfb_col, dtype=self.sf_dtype), tCtSFB_layout)

            s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._s2t(sSFA, tCtSFA)
            s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._s2t(sSFB, tCtSFB)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.ab_stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.acc_stages)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            tCtAcc = tCtAcc_all[(None, None, None, acc_state.index)]
            tCtSFB_mma = None if self.dense else tCtSFB
            if cutlass.const_expr(self.cfg.tile_n < BLOCK_M):
                # The N side's scales were copied as a whole 128-row atom; one TMEM column holds 32 rows: the MMA
                # reads this tile's rows from column (row_start % 128) / 32 on (CUTLASS's N = 64 shift, generalized)
                _, _, row_start, _ = sched.coords(t, g, base)
                shift = (row_start % BLOCK_M) // 32
                tCtSFB_mma = cute.make_tensor(cute.recast_ptr(acc_ptr + sfb_col + shift, dtype=self.sf_dtype),
                                              tCtSFB_layout)
            acc_pipe.producer_acquire(acc_state)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ab_pipe.consumer_wait(ab_state)
                if cutlass.const_expr(not self.dense):
                    stage = (None, None, None, None, ab_state.index)
                    cute.copy(s2t_sfa, tCsSFA_s2t[stage], tCtSFA_s2t)
                    cute.copy(s2t_sfb, tCsSFB_s2t[stage], tCtSFB_s2t)
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, (kt != 0) | (kb != 0))
                    crd = (None, None, kb, ab_state.index)
                    if cutlass.const_expr(self.dense):
                        cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                    else:
                        sf_crd = (None, None, kb)
                        cute.gemm(tiled_mma, tCtAcc, [tCrA[crd], tCtSFA[sf_crd]], [tCrB[crd], tCtSFB_mma[sf_crd]],
                                  tCtAcc)
                ab_pipe.consumer_release(ab_state)
                ab_state.advance()
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)
        acc_pipe.producer_tail(acc_state)

    def _s2t(self, sSF, tSF):
        """smem -> TMEM copy of one stage's scale factors (tcgen05.cp.4x32x128b), partitioned both sides."""
        sSF_compact = cute.filter_zeros(sSF)
        tSF_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype)
        tiled = tcgen05.make_s2t_copy(atom, tSF_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(sSF_compact))
        return tiled, src, thr.partition_D(tSF_compact)

    def epi_partition(self, tidx, tCtAcc_all):
        """This thread's share of the epilogue: the TMEM -> register copy (tcgen05.ld 32x32b, epi_cols columns), its
        source (T2R, T2R_M, T2R_N, #EPI_M, #EPI_N, ACC_STAGE), and the function that partitions an MMA-partitioned
        C-shaped tensor (tCgC, tCcC) the same way: (T2R, T2R_M, T2R_N, #EPI_M, #EPI_N, RestM, RestN, RestL).
        Traced on the host by tests/test_cute_gemm.py (which output element each register of a thread is)."""
        # (EPI_M, EPI_N, #EPI_M, #EPI_N, ACC_STAGE)
        tAcc_epi = cute.flat_divide(tCtAcc_all[((None, None), 0, 0, None)], self.epi_tile)
        t2r_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(self.cfg.epi_cols)),
                                       cutlass.Float32)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)

        def part(tCxC):
            return thr_t2r.partition_D(cute.flat_divide(tCxC[((None, None), 0, 0, None, None, None)], self.epi_tile))

        return t2r, thr_t2r.partition_S(tAcc_epi), part

    @cute.jit
    def epilogue(self, sched, bidx, nctas, tidx, acc_pipe, acc_ptr, tCtAcc_fake, tCgC, tCcC, alpha, lo, m_indices,
                 row_weights):
        t2r, tTR_tAcc, epi_part = self.epi_partition(tidx, cute.make_tensor(acc_ptr, tCtAcc_fake.layout))
        tTR_gC, tTR_cC = epi_part(tCgC), epi_part(tCcC)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, cutlass.Float32)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.out_dtype)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        n_sub = cute.size(tTR_tAcc, mode=[4])

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.acc_stages)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            _, n_tile, row_start, row_end = sched.coords(t, g, base)
            _, _, _, (c_m, c_n) = self._tile(row_start, n_tile, g)
            gC = tTR_gC[(None, None, None, 0, None, c_m, c_n, 0)]
            cC = tTR_cC[(None, None, None, 0, None, c_m, c_n, 0)]
            row = cC[(0, 0, 0, 0)][0]  # default variant: this thread's accumulator row (its TMEM lane)
            if cutlass.const_expr(self.dense):
                # The launcher aligned the group's span down to a tile boundary: rows before the group's own first
                # row lo[g] belong to others, as do (contiguous layout) rows whose m_indices is not g. Per-row
                # values are loaded at the row clamped into the span (always in bounds), before any store
                keep = (row >= lo[g]) & (row < row_end)
                clamped = cutlass.min(row, row_end - 1)
                if cutlass.const_expr(m_indices is not None):
                    keep = keep & (m_indices[clamped] == g)
                scale = cutlass.Float32(1.0)
                if cutlass.const_expr(row_weights is not None):
                    scale = row_weights[clamped]
            else:
                scale = alpha[g]
                keep = row < row_end
            acc_pipe.consumer_wait(acc_state)
            tAcc = tTR_tAcc[(None, None, None, 0, None, acc_state.index)]
            for sub in cutlass.range_constexpr(n_sub):
                cute.copy(t2r, tAcc[(None, None, None, sub)], tTR_rAcc)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the registers are valid after it
                if cutlass.const_expr(self.dense and row_weights is None):
                    tTR_rC.store(tTR_rAcc.load().to(self.out_dtype))
                else:
                    tTR_rC.store((tTR_rAcc.load() * scale).to(self.out_dtype))
                if cutlass.const_expr(self.cfg.swap_ab):
                    # out^T: this thread's TMEM lane is one output column, its registers the tile's tokens (row
                    # stride N): 2-byte stores (a warp's 32 lanes write 64 contiguous bytes of a row), each on
                    # token < the group's end
                    gC_sub, cC_sub = gC[(None, None, None, sub)], cC[(None, None, None, sub)]
                    for i in cutlass.range_constexpr(cute.size(tTR_rC)):
                        if cC_sub[i][1] < row_end:
                            gC_sub[i] = tTR_rC[i]
                else:
                    # this thread's accumulator row (32x32b: one TMEM lane = one row per thread)
                    if keep:
                        cute.copy(store, tTR_rC, gC[(None, None, None, sub)])
            # every tcgen05.ld of this buffer has completed (waited above): hand it back to the MMA warp
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)
