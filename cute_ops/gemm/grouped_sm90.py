"""Grouped (MoE) bf16 / fp16 / FP8 GEMM for sm_90a: WGMMA, TMA loads, per-group TMA descriptors updated on the device.

    out[r, :] = cast(row_weight[r] * sum_k a[r, k] * w[g, :, k])      for starts[g] <= r < starts[g] + counts[g]

FP8 (E4M3 a and w, fp32 scales): sum_k becomes sum over 128-wide K blocks kb of
(sum_{k in kb} a[r, k] * w[g, n, k]) * a_scale[r, kb] * w_scale[g, n // 128, kb]; out is bf16.

Launchers: cute_ops/gemm/moe_sm90.py (the `moe_gemm_bf16` / `moe_gemm_fp8` backends of the table's "cute" rows).
Compile key and tile rule (GemmConfig, can_implement, pick_config, the FP8 schedule constants): grouped_sm90_config.py.

Operands (K-major, contiguous):

| arg | shape / dtype | what |
| --- | --- | --- |
| a | [M, K] bf16 / fp16 (FP8: uint8 E4M3 codes) | all rows of every group (masked layout: [E * max_m, K]) |
| w | [G, N, K] same dtype | per-group weights |
| out | [M, N] a's dtype (FP8: bf16) | a group's rows get its products, every other row zeros (any initial bytes) |
| starts, counts | [G] int32 | group g's rows: [starts[g], starts[g] + counts[g]), counts >= 0, inside [0, M) |
| m_indices | [M] int32 or None | contiguous layout: a row is written only where m_indices[row] == g |
| row_weights | [M] fp32 or None | multiplies each row before the one rounding |
| workspace | [grid * SLOTS * 16] int64 | per-CTA TMA descriptor slots (128 bytes each, 128-byte aligned) |
| a_scale, w_scale | FP8 only: [M, K/128] fp32 any strides; [G, ceil(N/128), K/128] fp32 | block scales |

With m_indices, a group span that holds padding or other experts' rows still writes only its own rows.
M is symbolic (one compile per (dtype, N, K, G, layout, row weights, tiles)); group sizes are data, read on the
device only: a new routing never recompiles and the launch is CUDA-graph safe.

Device-side descriptor update (what makes the groups' rows exact without host work): the A operand is loaded
through a TMA descriptor whose base address is row starts[g] of `a` and whose row extent is counts[g]. TMA
zero-fills rows past the extent, so a tile never reads another group's rows (nor rows past a masked count),
however the groups are aligned. Each CTA owns SLOTS = stages + 1 descriptor slots in `workspace`; the load warp
initializes them once from the kernel's base descriptor (a grid-constant parameter), and when its tile walk
enters a new group it rewrites the next slot in place (`tensormap.replace` of the global address, the row extent
and the strides), publishes it (`fence.proxy.tensormap::generic.release.gpu`) and acquires it for the TMA unit
(`fence.proxy.tensormap::generic.acquire.gpu`) before the first load through it. A slot is rewritten only after
`stages` further loads were issued, i.e. after every load through its previous contents completed (the producer
re-acquires a stage only once the consumers released it), so no in-flight TMA reads a descriptor being edited.
B is one 3-D descriptor (N, K, G) indexed by the group; out is written from registers (predicated per row), or
(epilogue="smem") staged per warp group in shared memory and written as coalesced 16-byte chunks.

Kernel: persistent (one CTA per SM), one producer warp group (warp 0 issues the TMA loads; the group register
budget is lowered to 40) and tile_m / 64 consumer warp groups (WGMMA 64 x tile_n x 16 from shared memory,
fp32 accumulators in registers, 232 registers each), a `stages`-deep smem ring (PipelineTmaAsync: mbarriers with
transaction bytes). The tile walk is scheduler.BoundedTileScheduler (every role walks the same order).

FP8 promotion schedules (GemmConfig.promote_run, scale_prefetch): promote_run 0 waits for each stage's WGMMAs
(wait_group 0) and then promotes them; the other consumer warp group's WGMMAs keep the tensor cores busy meanwhile.
promote_run U >= 1 issues stage i + 1's WGMMAs (into a second partial-sum buffer) before promoting stage i
(wait_group 1), in runs of U stages that end with wait_group 0: ptxas serializes every WGMMA of the kernel (C7514)
when accumulator registers of an in-flight WGMMA are copied or read across a loop edge, so nothing is in flight
where the dynamic loop turns. scale_prefetch loads each stage's scales during the previous stage's WGMMAs. Every
schedule computes the same FFMA per element and block: outputs are bit-equal. A 64 x 256 FP8 WGMMA does not fit: it
needs 128 accumulator + 128 partial-sum registers per thread.

FP8 wide tiles (GemmConfig.wide, FP8_WIDE; 128 x 256 is the launcher's FP8 prefill tile where N allows): 256 x 128 and
128 x 256 give each of the two consumer warp groups two 64 x 128 sub-tiles (waves: rows r and r + 128, sharing the
stage's B rows; or both 128-column halves, sharing its A rows) and 128 x 192 one 64 x 192 WGMMA (DeepGEMM's unaligned
block N: its columns span two 128-column weight-scale blocks, split at tile column 64 or 128; scales are taken per
64-column chunk). Per stage and wave: WGMMA into the one partial-sum buffer, wait, promote (128 accumulators + 64
partial sums, or 96 + 96, per thread); the other warp group's WGMMAs run meanwhile; scale_prefetch (on by default here)
loads the next stage's scales at the stage's start. A stage feeds 2 x the MMA work of a 128 x 128 one for 1.5 x its
bytes (192 columns: 1.5 x for 1.25 x). The direct epilogue when named; the smem one (128 rows; the rule's) spills ~20
registers per tile, outside the K loop. Same WGMMA per 64 x 128 block and FFMA per element: bit-equal to the other FP8
kernels (the 64 x 192 WGMMA sums each output over the same 4 K32 steps).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

from triton_ops.contract.moe_gemm import FP8_BLOCK  # K elements per FP8 scale (= one K stage)

from .grouped_sm90_config import DESC_BYTES, DTYPES, WG, GemmConfig, block_k, stage_bytes
from .grouped_sm90_steps import ConsumerSteps
from .scheduler import BoundedTileScheduler

LOAD_REGS, MMA_REGS = 40, 232


# ------------------------------------------------------------------------------------------------- kernel


class GroupedGemmSm90(ConsumerSteps):
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


# --------------------------------------------------------------------------------------------- compile


def _fake_args(cfg: GemmConfig):
    fp8 = cfg.dtype == "fp8"
    dt = cutlass.Uint8 if fp8 else getattr(cutlass, DTYPES[cfg.dtype])  # E4M3 codes are passed as bytes
    out_dt = cutlass.BFloat16 if fp8 else dt
    m = cute.sym_int()  # every row count is this one symbol (TVM-FFI checks they agree)
    g, n, k = cfg.num_groups, cfg.n, cfg.k
    a = cute.runtime.make_fake_tensor(dt, (m, k), stride=(k, 1), assumed_align=16)
    w = cute.runtime.make_fake_tensor(dt, (g, n, k), stride=(n * k, k, 1), assumed_align=16)
    out = cute.runtime.make_fake_tensor(out_dt, (m, n), stride=(n, 1), assumed_align=16)
    starts = cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4)
    counts = cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4)
    m_indices = (cute.runtime.make_fake_tensor(cutlass.Int32, (m,), stride=(1,), assumed_align=4)
                 if cfg.layout == "contiguous" else None)
    row_weights = (cute.runtime.make_fake_tensor(cutlass.Float32, (m,), stride=(1,), assumed_align=4)
                   if cfg.row_weights else None)
    workspace = cute.runtime.make_fake_tensor(cutlass.Int64, (cfg.workspace_words,), stride=(1,),
                                              assumed_align=DESC_BYTES)
    a_scale = w_scale = None
    if cfg.dtype == "fp8":  # 1x128 activation scales in any strides (row-major or column-major); weight scales dense
        kb, nb = k // FP8_BLOCK, -(-n // FP8_BLOCK)
        a_scale = cute.runtime.make_fake_tensor(cutlass.Float32, (m, kb), stride=(cute.sym_int64(), cute.sym_int64()),
                                                assumed_align=4)
        w_scale = cute.runtime.make_fake_tensor(cutlass.Float32, (g, nb, kb), stride=(nb * kb, kb, 1), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return a, w, out, starts, counts, m_indices, row_weights, workspace, a_scale, w_scale, stream


def build(cfg: GemmConfig, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options` e.g. keep/dump flags for SASS tests)."""
    return cute.compile(GroupedGemmSm90(cfg), *_fake_args(cfg),
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def dump(cfg: GemmConfig):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from .._sass import compile_and_dump

    return compile_and_dump(lambda extra: build(cfg, extra))
