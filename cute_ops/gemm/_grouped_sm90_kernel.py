"""The sm_90a grouped GEMM kernel class (grouped_sm90.py: what it computes, the roles, the config and the rule).

Imported by grouped_sm90.build only, so importing lowbit never needs nvidia-cutlass-dsl. No
`from __future__ import annotations`: the DSL evaluates the kernel's annotations."""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from triton_ops.contract.moe_gemm import FP8_BLOCK  # K elements per FP8 scale (= one K stage)

from .grouped_sm90 import DESC_BYTES, DTYPES, WG, GemmConfig, block_k, stage_bytes
from .scheduler import BoundedTileScheduler

LOAD_REGS, MMA_REGS = 40, 232
CHUNK = 8  # 2-byte output elements per 16-byte chunk of the smem epilogue


class GroupedGemmSm90:
    """The kernel for one GemmConfig: `__call__` (traced on the host: layouts, TMA atoms, the shared-memory struct,
    grid) launches `kernel`, which splits into the producer (`produce`, `_point_a`) and consumer (`consume` and its
    steps below) roles."""

    def __init__(self, cfg: GemmConfig):
        self.cfg = cfg
        self.fp8 = cfg.dtype == "fp8"
        self.dtype = getattr(cutlass, DTYPES[cfg.dtype])
        self.out_dtype = cutlass.BFloat16 if self.fp8 else self.dtype
        self.bk = block_k(cfg.dtype)
        self.k_tiles = -(-cfg.k // self.bk)
        self.n_tiles = -(-cfg.n // cfg.tile_n)
        self.mma_wgs = cfg.mma_wgs
        self.mma_warps = 4 * self.mma_wgs

    @cute.jit
    def __call__(self, a: cute.Tensor, w: cute.Tensor, out: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor,
                 m_indices, row_weights, workspace: cute.Tensor, a_scale, w_scale, stream):
        cfg = self.cfg
        m = a.shape[0]
        n, k, groups = cfg.n, cfg.k, cfg.num_groups
        # (rows, K, 1): the base descriptor; per group the load warp re-points it (address, rows)
        # FP8 operands arrive as bytes: typed here
        a_ptr = cute.recast_ptr(a.iterator, dtype=self.dtype) if cutlass.const_expr(self.fp8) else a.iterator
        w_ptr = cute.recast_ptr(w.iterator, dtype=self.dtype) if cutlass.const_expr(self.fp8) else w.iterator
        mA = cute.make_tensor(a_ptr, cute.make_layout((m, k, 1), stride=(k, 1, 0)))
        mB = cute.make_tensor(w_ptr, cute.make_layout((n, k, groups), stride=(k, 1, n * k)))

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, cutlass.Float32,
            (self.mma_wgs, 1, 1), tiler_mn=(64, cfg.wave_n))
        a_smem = self._smem_layout(cfg.tile_m)
        b_smem = self._smem_layout(cfg.tile_n)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(g2s, mA, cute.slice_(a_smem, (None, None, 0)),
                                                    (cfg.tile_m, self.bk))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(g2s, mB, cute.slice_(b_smem, (None, None, 0)),
                                                    (cfg.tile_n, self.bk))
        self.tx_bytes = stage_bytes(cfg.tile_m, cfg.tile_n)

        # the shared-memory struct: mbarriers, the A / B rings, and (epilogue="smem") the output staging tile
        if cutlass.const_expr(cfg.epilogue == "smem"):
            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(b_smem)], 1024]
                sC: cute.struct.Align[cute.struct.MemRange[self.out_dtype, cfg.tile_m * cfg.tile_n], 1024]
        else:
            @cute.struct
            class Storage:
                bars: cute.struct.MemRange[cutlass.Int64, cfg.stages * 2]
                sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(a_smem)], 1024]
                sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(b_smem)], 1024]

        self.storage = Storage
        self.kernel(tiled_mma, tma_a, tma_mA, tma_b, tma_mB, mA, out, starts, counts, m_indices, row_weights,
                    workspace, a_scale, w_scale, a_smem, b_smem).launch(
            grid=(cfg.grid, 1, 1), block=(cfg.threads, 1, 1), stream=stream, min_blocks_per_mp=1)

    def _smem_layout(self, rows: int):
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(utils.LayoutEnum.ROW_MAJOR, self.dtype, self.bk), self.dtype)
        return cute.tile_to_shape(atom, (rows, self.bk, self.cfg.stages), order=(0, 1, 2))

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA_tma: cute.Tensor, tma_b: cute.CopyAtom,
               mB_tma: cute.Tensor, mA: cute.Tensor, out: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor,
               m_indices, row_weights, workspace: cute.Tensor, a_scale, w_scale, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.storage)
        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = (storage.sC.get_tensor(cute.make_layout(cfg.tile_m * cfg.tile_n))
              if cutlass.const_expr(cfg.epilogue == "smem") else None)
        ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.bars.data_ptr(), num_stages=cfg.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_warps),
            tx_count=self.tx_bytes)

        sched = BoundedTileScheduler(starts, counts, cfg.num_groups, cfg.tile_m, self.n_tiles)
        wg = cute.arch.make_warp_uniform(tidx // WG)
        if wg == 0:
            cute.arch.warpgroup_reg_dealloc(LOAD_REGS)
            if warp == 0:
                self.produce(sched, bidx, ring, tma_a, mA_tma, tma_b, mB_tma, mA, workspace, sA, sB)
        else:
            cute.arch.warpgroup_reg_alloc(MMA_REGS)
            self.consume(sched, bidx, tidx - WG, ring, tiled_mma, sA, sB, sC, out, m_indices, row_weights, a_scale,
                         w_scale)

    # ------------------------------------------------------------------------------------ producer

    def _slot_ptr(self, workspace, bidx, slot):
        """Pointer (TMA-descriptor typed, 128-byte aligned, global) to this CTA's descriptor slot."""
        ptr = workspace.iterator + (bidx * self.cfg.desc_slots + slot) * (DESC_BYTES // 8)
        return utils.TensorMapManager(utils.TensorMapUpdateMode.GMEM, DESC_BYTES).get_tensormap_ptr(ptr)

    @cute.jit
    def produce(self, sched, bidx, ring, tma_a, mA_tma, tma_b, mB_tma, mA, workspace, sA, sB):
        cfg = self.cfg
        tmaps = utils.TensorMapManager(utils.TensorMapUpdateMode.GMEM, DESC_BYTES)
        # Every slot of this CTA starts as a copy of the base descriptor (its fields other than address, extents
        # and strides: box, swizzle, element type, are the ones every group uses)
        with cute.arch.elect_one():
            for s in cutlass.range_constexpr(cfg.desc_slots):
                cpasync.copy_tensormap(tma_a, self._slot_ptr(workspace, bidx, s))
        cute.arch.sync_warp()
        tmaps.fence_tensormap_initialization()

        gA = cute.local_tile(mA_tma, (cfg.tile_m, self.bk), (None, None, None))  # (bM, bK, RestM, RestK, 1)
        gB = cute.local_tile(mB_tma, (cfg.tile_n, self.bk), (None, None, None))  # (bN, bK, RestN, RestK, G)
        one = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.stages)
        nctas = cutlass.Int32(cfg.grid)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        last_g = cutlass.Int32(-1)
        slot = cutlass.Int32(cfg.desc_slots - 1)
        while g < sched.num_groups:
            m_tile, n_tile, _, _ = sched.coords(t, g, base)
            if g != last_g:
                slot = self._point_a(tma_a, mA, workspace, bidx, sched, g, slot)
                last_g = g
            desc_a = tmaps.get_tensormap_ptr(self._slot_ptr(workspace, bidx, slot), cute.AddressSpace.generic)
            a_src = tAgA[(None, m_tile, None, 0)]
            b_src = tBgB[(None, n_tile, None, g)]
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ring.producer_acquire(state)
                bar = ring.producer_get_barrier(state)
                cute.copy(tma_a, a_src[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar, tma_desc_ptr=desc_a)
                cute.copy(tma_b, b_src[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                ring.producer_commit(state)
                state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)
        ring.producer_tail(state)

    @cute.jit
    def _point_a(self, tma_a, mA, workspace, bidx, sched, g, slot):
        """Re-point A at group g in the next descriptor slot (returned): base = its first row, rows = its count (TMA
        zero-fills past it); published (release) and acquired for this thread's loads."""
        cfg = self.cfg
        slot = slot + 1
        if slot == cfg.desc_slots:
            slot = cutlass.Int32(0)
        group_a = cute.make_tensor(mA.iterator + cutlass.Int64(sched.starts[g]) * cfg.k,
                                   cute.make_layout((sched.counts[g], cfg.k, 1), stride=(cfg.k, 1, 0)))
        desc = self._slot_ptr(workspace, bidx, slot)
        cpasync.update_tma_descriptor(tma_a, group_a, desc)
        cute.arch.sync_warp()
        cpasync.fence_tma_desc_release()
        cpasync.fence_tma_desc_acquire(desc)
        return slot

    # ------------------------------------------------------------------------------------ consumers

    @cute.jit
    def consume(self, sched, bidx, mma_tidx, ring, tiled_mma, sA, sB, sC, out, m_indices, row_weights, a_scale,
                w_scale):
        cfg = self.cfg
        # A / B: the warp group's view (every thread of a warp group sees the same smem descriptors); C: this
        # thread's accumulator elements
        thr_wg = tiled_mma.get_slice((mma_tidx // WG) * WG)
        thr_mma = tiled_mma.get_slice(mma_tidx)
        tCrA = tiled_mma.make_fragment_A(thr_wg.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_wg.partition_B(sB))
        tile_mn = (cfg.tile_m, cfg.tile_n)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor(tile_mn))
        acc = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
        part = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32) if cutlass.const_expr(self.fp8) else None
        scale = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32) if cutlass.const_expr(self.fp8) else None
        overlap = self.fp8 and cfg.promote_run > 0
        # promote_run >= 1: the second partial-sum buffer; two scale slots: this thread's 2 distinct rows' a_scale
        # (sa[2 * slot + half]) and the tile's w_scale (sw2[slot]); the thread's 2 rows (clamped into the group)
        part2 = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32) if cutlass.const_expr(overlap) else None
        sa = cute.make_rmem_tensor(4, cutlass.Float32) if cutlass.const_expr(overlap) else None
        sw2 = cute.make_rmem_tensor(2, cutlass.Float32) if cutlass.const_expr(overlap) else None
        by_row = overlap or cfg.epilogue_prefetch
        rows = cute.make_rmem_tensor(2, cutlass.Int32) if cutlass.const_expr(by_row) else None
        # epilogue_prefetch: this thread's 2 rows' m_indices and row weights, loaded when the tile starts
        row_ids = cute.make_rmem_tensor(2, cutlass.Int32) if cutlass.const_expr(
            cfg.epilogue_prefetch and m_indices is not None) else None
        row_ws = cute.make_rmem_tensor(2, cutlass.Float32) if cutlass.const_expr(
            cfg.epilogue_prefetch and row_weights is not None) else None
        if cutlass.const_expr(by_row):
            # the fragment is ((2 columns, 2 row halves, tile_n / 8), 1, 1): element i is in row half (i // 2) % 2
            assert cute.size(acc) == cfg.tile_n // 2 and cute.size(acc.shape[0][1]) == 2, acc.layout
        res = cute.make_rmem_tensor(tCcC.shape, self.out_dtype)
        keep = cute.make_rmem_tensor(tCcC.shape, cutlass.Boolean)
        k_blocks = cute.size(tCrA, mode=[2])
        if cutlass.const_expr(cfg.wide):
            # waves: the warp group's 64 x wave_n sub-tiles (mw, nw) of the tile, in the full fragment's order
            # (element i of wave w = mw + m_waves * nw is acc[size(part) * w + i]); A / B fragments of each
            # sub-tile's smem rows. Weight scales per chunk of `chunk` columns (one 128-column block each: a 64 x 192
            # wave at column 192 n_tile spans two blocks, split at a multiple of 64)
            m_waves, n_waves = cfg.tile_m // 128, cfg.tile_n // cfg.wave_n
            chunk = FP8_BLOCK if cfg.wave_n % FP8_BLOCK == 0 else 64
            chunks = cfg.wave_n // chunk
            tCrA_w = [tiled_mma.make_fragment_A(thr_wg.partition_A(
                cute.local_tile(sA, (128, self.bk, cfg.stages), (mw, 0, 0)))) for mw in range(m_waves)]
            tCrB_w = [tiled_mma.make_fragment_B(thr_wg.partition_B(
                cute.local_tile(sB, (cfg.wave_n, self.bk, cfg.stages), (nw, 0, 0)))) for nw in range(n_waves)]
            part = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((128, cfg.wave_n))).shape,
                                         cutlass.Float32)
            assert cute.size(part) * m_waves * n_waves == cute.size(acc), (part.layout, acc.layout)
            # ((2 columns, 2 row halves, wave_n / 8 column groups of 8), 1, 1)
            assert cute.size(part.shape[0][1]) == 2 and cute.size(part) == cfg.wave_n // 2, part.layout
            wrows = cute.make_rmem_tensor(2 * m_waves, cutlass.Int32)  # the thread's rows, per wave and row half
            wsa = cute.make_rmem_tensor(2 * m_waves, cutlass.Float32)  # the stage's scales (scale_prefetch:
            wsw = cute.make_rmem_tensor(n_waves * chunks, cutlass.Float32)  # loaded into nsa / nsw a stage ahead)
            nsa = cute.make_rmem_tensor(2 * m_waves, cutlass.Float32)
            nsw = cute.make_rmem_tensor(n_waves * chunks, cutlass.Float32)
            wf = cute.make_rmem_tensor(2 * chunks, cutlass.Float32)
            last_nb = -(-cfg.n // FP8_BLOCK) - 1
        ldc = cfg.n

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.stages)
        nctas = cutlass.Int32(cfg.grid)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            _, n_tile, row_start, row_end = sched.coords(t, g, base)
            acc.fill(0.0)
            if cutlass.const_expr(by_row):
                for h in cutlass.range_constexpr(2):
                    rows[h] = cutlass.min(row_start + tCcC[2 * h][0], row_end - 1)
                    if cutlass.const_expr(row_ids is not None):
                        row_ids[h] = m_indices[rows[h]]
                    if cutlass.const_expr(row_ws is not None):
                        row_ws[h] = row_weights[rows[h]]
            if cutlass.const_expr(overlap):
                # Runs of U = promote_run stages: stage i of a run goes into buffer i % 2 (part / part2); once stage
                # i + 1's WGMMAs are issued, wait_group(1) retires stage i's and its promotion runs while stage
                # i + 1's are on the tensor cores; a run ends with wait_group(0) (nothing in flight across a loop
                # edge: ptxas serializes every WGMMA of the kernel when an in-flight accumulator crosses one).
                # Scale slot b (sa[2b + half], sw2[b]) holds the scales of the run's stages with i % 2 == b.
                if cutlass.const_expr(cfg.scale_prefetch):
                    self._load_scales(sa, sw2, 0, a_scale, w_scale, rows, g, n_tile, 0)
                run = cfg.promote_run
                for tail in cutlass.range_constexpr(2):  # the whole runs, then the rest (a shorter run)
                    length = run if tail == 0 else self.k_tiles % run
                    first = (self.k_tiles // run) * run
                    if cutlass.const_expr(length > 0):
                        for r in cutlass.range(self.k_tiles // run if tail == 0 else 1, unroll=1):
                            kt0 = r * run if tail == 0 else first
                            for i in cutlass.range_constexpr(length):
                                cur, prev = (part, part2) if i % 2 == 0 else (part2, part)
                                if cutlass.const_expr(i > 0):  # the previous stage's scale products (before a
                                    f0 = sa[2 * (1 - i % 2)] * sw2[1 - i % 2]  # prefetch refills its slot)
                                    f1 = sa[2 * (1 - i % 2) + 1] * sw2[1 - i % 2]
                                if cutlass.const_expr(cfg.scale_prefetch):  # the next stage's (clamped at the last)
                                    self._load_scales(sa, sw2, (i + 1) % 2, a_scale, w_scale, rows, g, n_tile,
                                                      cutlass.min(kt0 + i + 1, self.k_tiles - 1))
                                else:
                                    self._load_scales(sa, sw2, i % 2, a_scale, w_scale, rows, g, n_tile, kt0 + i)
                                ring.consumer_wait(read)
                                warpgroup.fence()
                                for kb in cutlass.range_constexpr(k_blocks):
                                    tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                                    cute.gemm(tiled_mma, cur, tCrA[(None, None, kb, read.index)],
                                              tCrB[(None, None, kb, read.index)], cur)
                                warpgroup.commit_group()
                                read.advance()
                                if cutlass.const_expr(i > 0):
                                    warpgroup.wait_group(1)
                                    ring.consumer_release(release)
                                    release.advance()
                                    self._promote(acc, prev, f0, f1)
                            last = (length - 1) % 2
                            f0 = sa[2 * last] * sw2[last]
                            f1 = sa[2 * last + 1] * sw2[last]
                            warpgroup.wait_group(0)
                            ring.consumer_release(release)
                            release.advance()
                            self._promote(acc, part2 if last else part, f0, f1)
                            if cutlass.const_expr(cfg.scale_prefetch and length % 2 == 1):
                                # the next run's first stage reads slot 0; an odd run prefetched it into slot 1
                                for h in cutlass.range_constexpr(2):
                                    sa[h] = sa[2 + h]
                                sw2[0] = sw2[1]
            elif cutlass.const_expr(cfg.wide):
                # Per K stage, wave by wave: WGMMA 64 x 128 x 128 into `part`, wait, acc[wave] += part * a_scale[row] *
                # w_scale[g, 128-column block of the wave, kt] (the other warp group's WGMMAs run meanwhile); the
                # stage is released after its last wave. Same products and FFMAs as the 128 x 128 kernels.
                for j in cutlass.range_constexpr(2 * m_waves):
                    wrows[j] = cutlass.min(row_start + tCcC[cute.size(part) * (j // 2) + 2 * (j % 2)][0], row_end - 1)
                scale_cols = [n_tile * cfg.tile_n + c * chunk for c in range(n_waves * chunks)]
                if cutlass.const_expr(cfg.scale_prefetch):
                    self._load_wave_scales(wsa, wsw, a_scale, w_scale, wrows, g, scale_cols, last_nb, 0)
                for kt in cutlass.range(self.k_tiles, unroll=1):
                    if cutlass.const_expr(cfg.scale_prefetch):  # the next stage's (clamped at the last)
                        self._load_wave_scales(nsa, nsw, a_scale, w_scale, wrows, g, scale_cols, last_nb,
                                               cutlass.min(kt + 1, self.k_tiles - 1))
                    else:
                        self._load_wave_scales(wsa, wsw, a_scale, w_scale, wrows, g, scale_cols, last_nb, kt)
                    ring.consumer_wait(read)
                    for w in cutlass.range_constexpr(m_waves * n_waves):
                        mw, nw = w % m_waves, w // m_waves
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(k_blocks):
                            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                            cute.gemm(tiled_mma, part, tCrA_w[mw][(None, None, kb, read.index)],
                                      tCrB_w[nw][(None, None, kb, read.index)], part)
                        warpgroup.commit_group()
                        warpgroup.wait_group(0)
                        if cutlass.const_expr(w == m_waves * n_waves - 1):
                            ring.consumer_release(read)
                            read.advance()
                        for c in cutlass.range_constexpr(chunks):
                            for h in cutlass.range_constexpr(2):
                                wf[2 * c + h] = wsa[2 * mw + h] * wsw[nw * chunks + c]
                        for i in cutlass.range_constexpr(cute.size(part)):  # column 8 (i // 4) + ..., row half
                            e = cute.size(part) * w + i
                            acc[e] = acc[e] + part[i] * wf[2 * (8 * (i // 4) // chunk) + (i // 2) % 2]
                    if cutlass.const_expr(cfg.scale_prefetch):
                        wsa.store(nsa.load())
                        wsw.store(nsw.load())
            elif cutlass.const_expr(self.fp8):
                # Per 128-wide K stage: WGMMA into `part` (fresh), then acc += part * a_scale[row] * w_scale[tile]
                # in fp32 registers (the contract's per-block scaling; also bounds the FP8 WGMMA's reduced-precision
                # accumulation to one block). Scale rows are clamped into the group (rows past it are not written).
                for kt in cutlass.range(self.k_tiles, unroll=1):
                    sw = w_scale[g, n_tile, kt]
                    ring.consumer_wait(read)
                    warpgroup.fence()
                    # (the accumulate flag is set here, not in a helper: the tracer carries tiled_mma through the
                    # loop only when it sees the assignment in this body)
                    for kb in cutlass.range_constexpr(k_blocks):
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                        cute.gemm(tiled_mma, part, tCrA[(None, None, kb, read.index)],
                                  tCrB[(None, None, kb, read.index)], part)
                    warpgroup.commit_group()
                    # the scale loads go out while the WGMMAs run (one load per distinct row after CSE)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        scale[i] = a_scale[cutlass.min(row_start + tCcC[i][0], row_end - 1), kt] * sw
                    warpgroup.wait_group(0)
                    ring.consumer_release(read)
                    read.advance()
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = acc[i] + part[i] * scale[i]
            else:
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                # K tile 0: issue, keep one WGMMA batch in flight; then each next tile retires the previous one
                ring.consumer_wait(read)
                self._stage_mmas(tiled_mma, acc, tCrA, tCrB, read.index, k_blocks)
                read.advance()
                for _ in cutlass.range(1, self.k_tiles, unroll=1):
                    ring.consumer_wait(read)
                    self._stage_mmas(tiled_mma, acc, tCrA, tCrB, read.index, k_blocks)
                    warpgroup.wait_group(1)
                    ring.consumer_release(release)
                    release.advance()
                    read.advance()
                warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()

            # Epilogue: registers -> global, predicated per row (rows past the group's end belong to others)
            col0 = n_tile * cfg.tile_n
            gC = cute.make_tensor(out.iterator + (cutlass.Int64(row_start) * ldc + col0),
                                  cute.make_layout(tile_mn, stride=(ldc, 1)))
            tCgC = thr_mma.partition_C(gC)
            assert cute.size(tCgC.shape[0][0]) == 2 and tCgC.layout.stride[0][0] == 1, tCgC.layout
            # Per-row loads use the row clamped into the group: always in bounds, and unconditional, so the
            # compiler keeps one load per distinct row of this thread (2 per 64-row warp group tile), not one per
            # element
            if cutlass.const_expr(row_ws is not None):
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] * row_ws[(i // 2) % 2]
            elif cutlass.const_expr(row_weights is not None):
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = acc[i] * row_weights[cutlass.min(row_start + tCcC[i][0], row_end - 1)]
            res.store(acc.load().to(self.out_dtype))
            if cutlass.const_expr(cfg.epilogue == "smem"):
                self._smem_epilogue(sC, res, tCcC, mma_tidx, out, m_indices, g, row_start, row_end, col0)
            else:
                # every load before the first store (a store to `out` could alias them otherwise: no reuse)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r = row_start + tCcC[i][0]
                    ok = (r < row_end) & (col0 + tCcC[i][1] < cfg.n)
                    if cutlass.const_expr(row_ids is not None):
                        ok = ok & (row_ids[(i // 2) % 2] == g)
                    elif cutlass.const_expr(m_indices is not None):
                        ok = ok & (m_indices[cutlass.min(r, row_end - 1)] == g)
                    keep[i] = ok
                # 4-byte stores of column pairs: the accumulator fragment's innermost mode is 2 adjacent columns
                # (checked at compile time), at an even column of a row whose pitch N is a multiple of 8
                for j in cutlass.range_constexpr(cute.size(acc) // 2):
                    if keep[2 * j]:
                        addr = (tCgC.iterator + tCgC.layout(2 * j)).toint()
                        dst = cute.make_tensor(cute.make_ptr(self.out_dtype, addr, cute.AddressSpace.gmem,
                                                             assumed_align=4), cute.make_layout(2))
                        cute.autovec_copy(cute.make_tensor(res.iterator + 2 * j, cute.make_layout(2)), dst)
            t = t + nctas
            g, base = sched.seek(t, g, base)
        self._zero_unowned_rows(out, m_indices, sched, bidx, mma_tidx)

    # ------------------------------------------------------------------- consumer steps (smem epilogue, FP8)

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
