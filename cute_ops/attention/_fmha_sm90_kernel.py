"""The sm_90a attention kernel class (fmha_sm90.py: what it computes, the roles, the config and the rule).

Imported by fmha_sm90.build only, so importing lowbit never needs nvidia-cutlass-dsl. No
`from __future__ import annotations`: the DSL evaluates the kernel's annotations."""

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp

from . import mask as mask_mod
from . import scheduler as sched_mod
from . import softmax as sm_mod
from . import wgmma
from .fmha_sm90 import KV_STAGES, REGS, FmhaSm90Config


def group(n):
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)


class FmhaSm90:
    """The kernel for one FmhaSm90Config: `__call__` (traced on the host: layouts, TMA atoms, SharedStorage,
    grid) launches `kernel`, which splits into the producer (`load_tiles` / `load`) and consumer (`consume_tiles` /
    `consume`) roles."""

    def __init__(self, cfg: FmhaSm90Config):
        self.cfg = cfg
        self.d_qk, self.d_v = cfg.head_dim, cfg.head_dim_v  # Q, K, S = Q K^T | V, O += P V, out
        self.spec = cfg.mask
        self.stages = KV_STAGES
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.wgs = cfg.consumer_warpgroups
        self.threads = 128 * (1 + self.wgs)
        self.regs_producer, self.regs_consumer = REGS[self.wgs]

    # ------------------------------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor | None, mCuQ: cute.Tensor, mCuK: cute.Tensor, mSink: cute.Tensor | None,
                 softmax_scale: Float32, window_left: Int32, window_right: Int32, stream):
        d_qk, d_v = self.d_qk, self.d_v
        dt = mQ.element_type
        self.dtype = dt
        total_q, hq = mQ.shape[0], mQ.shape[1]
        total_k, hkv = mK.shape[0], mK.shape[1]

        def seq_view(t, rows, heads, d):  # (tokens, D, heads): TMA boxes of (rows, D) per head
            return cute.make_tensor(t.iterator, cute.make_layout((rows, d, heads),
                                                                 stride=(t.stride[0], 1, t.stride[1])))

        q, k = seq_view(mQ, total_q, hq, d_qk), seq_view(mK, total_k, hkv, d_qk)
        v, o = seq_view(mV, total_k, hkv, d_v), seq_view(mO, total_q, hq, d_v)
        qk_mma, pv_mma = self.make_mmas()
        tm, tn = self.tile_m, self.tile_n
        # D columns in 64-wide 128-byte swizzle atoms (D = 192: three); the TMA atom issues one box per atom
        q_sl = wgmma.smem_layout(dt, tm, d_qk, self.cfg.q_stages if self.cfg.persistent else None)
        k_sl = wgmma.smem_layout(dt, tn, d_qk, self.stages)
        v_sl = wgmma.smem_layout(dt, tn, d_v, self.stages)
        op = cpasync.CopyBulkTensorTileG2SOp()
        q_box = cute.select(q_sl, mode=[0, 1]) if cutlass.const_expr(self.cfg.persistent) else q_sl
        tma_q, tq_ = cpasync.make_tiled_tma_atom(op, q, q_box, (tm, d_qk))
        tma_k, tk_ = cpasync.make_tiled_tma_atom(op, k, cute.select(k_sl, mode=[0, 1]), (tn, d_qk))
        tma_v, tv_ = cpasync.make_tiled_tma_atom(op, v, cute.select(v_sl, mode=[0, 1]), (tn, d_v))
        self.q_bytes = cute.size_in_bytes(dt, q_box)
        self.k_bytes = cute.size_in_bytes(dt, cute.select(k_sl, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(dt, cute.select(v_sl, mode=[0, 1]))
        tma_o, to_, o_sl = None, None, None
        if cutlass.const_expr(self.cfg.o_tma):  # one (64, Dv) box per consumer warpgroup
            o_sl = wgmma.smem_layout(dt, 64, d_v, self.wgs)
            tma_o, to_ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o,
                                                     cute.select(o_sl, mode=[0, 1]), (64, d_v))
        o_elems = cute.cosize(o_sl) if cutlass.const_expr(self.cfg.o_tma) else 0

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[Int64, 2 * self.cfg.q_stages]
            k_bar: cute.struct.MemRange[Int64, 2 * self.stages]
            v_bar: cute.struct.MemRange[Int64, 2 * self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(q_sl)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(k_sl)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(v_sl)], 1024]
            if cutlass.const_expr(o_elems):
                sO: cute.struct.Align[cute.struct.MemRange[dt, o_elems], 1024]

        if cutlass.const_expr(SharedStorage.size_in_bytes() != self.cfg.smem_bytes()):  # __post_init__ rule
            raise AssertionError(f"SMEM {SharedStorage.size_in_bytes()} != {self.cfg.smem_bytes()} bytes")
        self.shared_storage = SharedStorage
        num_batch = mCuQ.shape[0] - 1
        scale_log2 = softmax_scale * Float32(sm_mod.LOG2E)
        grid = sched_mod.launch_grid(total_q, num_batch, hq, tm)
        if cutlass.const_expr(self.cfg.persistent):  # CTAs past the last tile exit at once
            grid = (self.cfg.persistent, 1, 1)
        self.kernel(qk_mma, pv_mma, tma_q, tq_, tma_k, tk_, tma_v, tv_, o, tma_o, to_, mLSE, mCuQ, mCuK, mSink,
                    scale_log2, window_left, window_right, num_batch, hq, hq // hkv, q_sl, k_sl, v_sl, o_sl).launch(
            grid=grid, block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def make_mmas(self):
        """(S = Q K^T: SS, both K-major; O += P V: RS, P from registers, V^T MN-major), fp32 accumulators,
        one m64 warpgroup per 64 rows along M (2 or 3)."""
        dt = self.dtype
        qk = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                               (self.wgs, 1, 1), (64, self.tile_n))
        pv = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                               (self.wgs, 1, 1), (64, self.d_v),
                                               a_source=warpgroup.OperandSource.RMEM)
        return qk, pv

    # ----------------------------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor,
               tma_o: cute.CopyAtom | None, mO_tma: cute.Tensor | None, mLSE: cute.Tensor | None,
               mCuQ: cute.Tensor, mCuK: cute.Tensor, mSink: cute.Tensor | None, scale_log2: Float32,
               window_left: Int32, window_right: Int32, num_batch: Int32, hq: Int32, group_size: Int32,
               q_sl: cute.ComposedLayout, k_sl: cute.ComposedLayout, v_sl: cute.ComposedLayout,
               o_sl: cute.ComposedLayout | None):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp == 0:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
        smem = memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        consumers = group(4 * self.wgs)  # one arrive per consumer warp (lane 0) on release
        q_pipe = pipeline.PipelineTmaAsync.create(
            num_stages=self.cfg.q_stages, producer_group=group(1), consumer_group=consumers, tx_count=self.q_bytes,
            barrier_storage=st.q_bar.data_ptr(), defer_sync=True)
        k_pipe = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages, producer_group=group(1), consumer_group=consumers, tx_count=self.k_bytes,
            barrier_storage=st.k_bar.data_ptr(), defer_sync=True)
        v_pipe = pipeline.PipelineTmaAsync.create(
            num_stages=self.stages, producer_group=group(1), consumer_group=consumers, tx_count=self.v_bytes,
            barrier_storage=st.v_bar.data_ptr(), defer_sync=True)
        pipeline.pipeline_init_arrive(is_relaxed=True)
        sQ = st.sQ.get_tensor(q_sl.outer, swizzle=q_sl.inner)
        sK = st.sK.get_tensor(k_sl.outer, swizzle=k_sl.inner)
        sV = st.sV.get_tensor(v_sl.outer, swizzle=v_sl.inner)
        sO = None
        if cutlass.const_expr(self.cfg.o_tma):
            sO = st.sO.get_tensor(o_sl.outer, swizzle=o_sl.inner)
            if warp == 0:
                cpasync.prefetch_descriptor(tma_o)
        outs = (mO, mLSE, tma_o, mO_tma, sO)
        pipeline.pipeline_init_wait()  # CTA barrier: the mbarrier inits are visible to every warp

        # setmaxnreg first thing in each branch; the tile is computed after it (values carried across it were
        # spilled in the sm100 kernel)
        loads = (tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_pipe, k_pipe, v_pipe)
        if warp < 4:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if cutlass.const_expr(self.cfg.persistent):
                if warp == 0:
                    self.load_tiles(loads, mCuQ, mCuK, num_batch, hq, group_size, window_left, window_right)
            else:
                b, m_block, h, valid = sched_mod.cta_tile(mCuQ, num_batch, hq, self.tile_m,
                                                          self.spec.bounded_right)
                if valid & (warp == 0):
                    q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi = sched_mod.sequence_tiles(
                        self.spec, mCuQ, mCuK, b, m_block, window_left, window_right, self.tile_m, self.tile_n)
                    self.load(*loads, q_start, k_start, m_block, h, h // group_size, n_lo, n_tiles,
                              pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1),
                              pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages))
        elif cutlass.const_expr(self.cfg.persistent):
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consume_tiles(qk_mma, pv_mma, sQ, sK, sV, q_pipe, k_pipe, v_pipe, outs, mCuQ, mCuK, mSink,
                               tidx - 128, scale_log2, window_left, window_right, num_batch, hq)
            self.drain_o_store(tidx - 128)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            b, m_block, h, valid = sched_mod.cta_tile(mCuQ, num_batch, hq, self.tile_m,
                                                      self.spec.bounded_right)
            if valid:
                q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi, sink_log2 = self.tile_args(
                    mCuQ, mCuK, mSink, b, m_block, h, window_left, window_right)
                consumer = pipeline.PipelineUserType.Consumer
                self.consume(qk_mma, pv_mma, sQ, sK, sV, q_pipe, k_pipe, v_pipe, outs, tidx - 128,
                             scale_log2, sink_log2, window_left, window_right, q_start, sq, sk, m_block, h,
                             n_lo, n_tiles, full_lo, full_hi, pipeline.make_pipeline_state(consumer, 1),
                             pipeline.make_pipeline_state(consumer, self.stages),
                             pipeline.make_pipeline_state(consumer, self.stages))
                self.drain_o_store(tidx - 128)

    # ----------------------------------------------------------------------------------------- roles

    # Persistent grid: CTA c takes work items c, c + grid, c + 2 grid, ... of the PACKED order (a static
    # schedule; scheduler.packed_tile_device maps each to (batch, query tile, head)). The producer warp and
    # every consumer warp walk the same sequence on their own; the pipeline states and the ping-pong turn
    # carry over from one tile to the next, and tiles without keys (n_tiles = 0) load nothing on either side.

    @cute.jit
    def first_tile(self, mCuQ, num_batch, hq):
        bx, _, _ = cute.arch.block_idx()
        tile = Int32(bx)
        b, m_block, h, valid = sched_mod.packed_tile_device(mCuQ, num_batch, tile, hq, self.tile_m,
                                                            self.spec.bounded_right)
        return tile, b, m_block, h, valid

    @cute.jit
    def next_tile(self, tile, mCuQ, num_batch, hq):
        nx, _, _ = cute.arch.grid_dim()
        tile = tile + Int32(nx)
        b, m_block, h, valid = sched_mod.packed_tile_device(mCuQ, num_batch, tile, hq, self.tile_m,
                                                            self.spec.bounded_right)
        return tile, b, m_block, h, valid

    @cute.jit
    def load_tiles(self, loads, mCuQ, mCuK, num_batch, hq, group_size, window_left, window_right):
        """The producer warp's loop over its persistent CTA's tiles."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.q_stages)
        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tile, b, m_block, h, valid = self.first_tile(mCuQ, num_batch, hq)
        while valid:
            q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi = sched_mod.sequence_tiles(
                self.spec, mCuQ, mCuK, b, m_block, window_left, window_right, self.tile_m, self.tile_n)
            q_state, kv = self.load(*loads, q_start, k_start, m_block, h, h // group_size, n_lo, n_tiles,
                                    q_state, kv)
            tile, b, m_block, h, valid = self.next_tile(tile, mCuQ, num_batch, hq)

    @cute.jit
    def load(self, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, q_pipe, k_pipe, v_pipe, q_start, k_start,
             m_block, h, hk, n_lo, n_tiles, q_state, kv):
        """TMA loads of one tile (Q, then K_j and V_j for its n_tiles key tiles); returns the advanced
        producer states of the Q and K / V rings."""
        if n_tiles > 0:
            one = cute.make_layout(1)
            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, None, h]), (self.tile_m, self.d_qk),
                                 (m_block, 0))
            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, None, hk]), (self.tile_n, self.d_qk),
                                 (None, 0))
            gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, None, hk]), (self.tile_n, self.d_v),
                                 (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            if cutlass.const_expr(self.cfg.persistent):
                tQsQ = tQsQ[None, q_state.index]
            tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2),
                                               cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 2),
                                               cute.group_modes(gV, 0, 2))
            q_pipe.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=q_pipe.producer_get_barrier(q_state))
            q_state.advance()
            for j in cutlass.range(n_tiles, unroll=1):
                kb = n_lo + j
                k_pipe.producer_acquire(kv)
                cute.copy(tma_k, tKgK[None, kb], tKsK[None, kv.index], tma_bar_ptr=k_pipe.producer_get_barrier(kv))
                v_pipe.producer_acquire(kv)
                cute.copy(tma_v, tVgV[None, kb], tVsV[None, kv.index], tma_bar_ptr=v_pipe.producer_get_barrier(kv))
                kv.advance()
        return q_state, kv

    @cute.jit
    def tile_args(self, mCuQ, mCuK, mSink, b, m_block, h, window_left, window_right):
        """A consumer's per-tile values: sequence_tiles' eight, then the sink's logit in log2 units (None
        without sinks)."""
        q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi = sched_mod.sequence_tiles(
            self.spec, mCuQ, mCuK, b, m_block, window_left, window_right, self.tile_m, self.tile_n)
        sink_log2 = None
        if cutlass.const_expr(mSink is not None):
            sink_log2 = mSink[h] * Float32(sm_mod.LOG2E)
        return q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi, sink_log2

    @cute.jit
    def consume_tiles(self, qk_mma, pv_mma, sQ, sK, sV, q_pipe, k_pipe, v_pipe, outs, mCuQ, mCuK, mSink, t,
                      scale_log2, window_left, window_right, num_batch, hq):
        """A consumer warpgroup's loop over its persistent CTA's tiles. Ping-pong: warpgroup 0 pre-passes
        its first turn once, before the first tile; every tile then ends with the turn passed on, so the token
        goes round unbroken from tile to tile."""
        consumer = pipeline.PipelineUserType.Consumer
        q_st = pipeline.make_pipeline_state(consumer, self.cfg.q_stages)
        k_st = pipeline.make_pipeline_state(consumer, self.stages)
        v_st = pipeline.make_pipeline_state(consumer, self.stages)
        if t // 128 == 0:
            self.turn_pass(0)
        tile, b, m_block, h, valid = self.first_tile(mCuQ, num_batch, hq)
        while valid:
            q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi, sink_log2 = self.tile_args(
                mCuQ, mCuK, mSink, b, m_block, h, window_left, window_right)
            q_st, k_st, v_st = self.consume(qk_mma, pv_mma, sQ, sK, sV, q_pipe, k_pipe, v_pipe, outs, t,
                                            scale_log2, sink_log2, window_left, window_right, q_start, sq, sk,
                                            m_block, h, n_lo, n_tiles, full_lo, full_hi, q_st, k_st, v_st)
            tile, b, m_block, h, valid = self.next_tile(tile, mCuQ, num_batch, hq)

    @cute.jit
    def consume(self, qk_mma, pv_mma, sQ, sK, sV, q_pipe, k_pipe, v_pipe, outs, t, scale_log2, sink_log2,
                window_left, window_right, q_start, sq, sk, m_block, h, n_lo, n_tiles, full_lo, full_hi, q_st,
                k_st, v_st):
        """One tile of a consumer warpgroup: the key-tile loop, then the epilogue; returns the advanced
        consumer states of the Q and K / V rings."""
        wg = t // 128
        thr_qk = qk_mma.get_slice(t)
        thr_pv = pv_mma.get_slice(t)
        wg_qk = qk_mma.get_slice(wg * 128)  # the warpgroup's share of the operands (its 64 rows of Q)
        wg_pv = pv_mma.get_slice(wg * 128)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        if cutlass.const_expr(self.cfg.persistent):
            tSrQ = tSrQ[None, None, None, q_st.index]
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(wgmma.transpose_view(sV)))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.d_v)), Float32)
        acc_o.fill(0.0)
        o_mn = wgmma.acc_mn(acc_o)
        s_coords = wgmma.acc_mn(thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        rows = cute.size(s_coords, mode=[0])  # 2 rows per thread (r and r + 8), tile_n / 4 scores each
        row_m = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
        row_l = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
        row_lo = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        row_hi = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        for r in cutlass.range_constexpr(rows):
            row_m[r], row_l[r] = sm_mod.init_stats(sink_log2)
            q_pos = m_block * self.tile_m + s_coords[r, 0][0] + sk - sq
            row_lo[r], row_hi[r] = mask_mod.row_key_bounds(self.spec, q_pos, sk, window_left, window_right)

        if n_tiles > 0:
            q_pipe.consumer_wait(q_st)
            row_a = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
            step = (wg, wg_qk, tSrQ, tSrK, k_pipe, s_coords, row_m, row_l, row_lo, row_hi, row_a, scale_log2,
                    full_lo, full_hi)
            # ping-pong: warpgroup 0 goes first, its own barrier pre-arrived (persistent: once, in consume_tiles)
            if cutlass.const_expr(not self.cfg.persistent):
                if wg == 0:
                    self.turn_pass(0)
            if cutlass.const_expr(not self.cfg.overlap):
                self.turn_wait(wg)
            if cutlass.const_expr(not self.cfg.overlap):
                for j in cutlass.range(n_tiles, unroll=1):
                    # S_j = Q K_j^T, then P_j; (ping-pong: PV_{j-1} and QK_j were this warpgroup's turn)
                    r_p, k_st = self.scores_to_p(qk_mma, k_st, n_lo + j, *step, pass_turn=True)
                    self.rescale_o(o_mn, row_a)
                    tOrP.store(wgmma.acc_as_a(r_p).load())
                    v_pipe.consumer_wait(v_st)
                    self.turn_wait(wg)
                    wgmma.gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, v_st.index], False)
                    v_pipe.consumer_release(v_st)
                    v_st.advance()
            else:
                # FA3's intra-warpgroup overlap: QK_j and PV_{j-1} in flight together; the softmax of tile j
                # runs while PV_{j-1} still executes (O and P_{j-1}'s registers untouched until it is done)
                r_p, k_st = self.scores_to_p(qk_mma, k_st, n_lo, *step, pass_turn=False)
                tOrP.store(wgmma.acc_as_a(r_p).load())
                for j in cutlass.range(1, n_tiles, unroll=1):
                    k_pipe.consumer_wait(k_st)
                    self.turn_wait(wg)
                    acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
                    wgmma.gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, k_st.index], True, wait=False)
                    v_pipe.consumer_wait(v_st)
                    wgmma.gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, v_st.index], False, wait=False)
                    self.turn_pass(self.next_wg(wg))
                    warpgroup.wait_group(1)  # QK_j done (PV_{j-1} may still run)
                    k_pipe.consumer_release(k_st)
                    k_st.advance()
                    r_p = self.softmax_tile(acc_s, n_lo + j, s_coords, row_m, row_l, row_lo, row_hi, row_a,
                                            scale_log2, full_lo, full_hi)
                    warpgroup.wait_group(0)  # PV_{j-1} done: O and P's registers are free
                    v_pipe.consumer_release(v_st)
                    v_st.advance()
                    self.rescale_o(o_mn, row_a)
                    tOrP.store(wgmma.acc_as_a(r_p).load())
                v_pipe.consumer_wait(v_st)
                wgmma.gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, v_st.index], False)
                v_pipe.consumer_release(v_st)
                v_st.advance()
            if cutlass.const_expr(not self.cfg.overlap):
                self.turn_pass(self.next_wg(wg))
            if cutlass.const_expr(self.cfg.persistent):  # every QK of the tile is done: Q's buffer is free
                q_pipe.consumer_release(q_st)
                q_st.advance()
        self.epilogue(thr_pv, acc_o, o_mn, row_m, row_l, outs[0], outs[1], t, q_start, sq, m_block, h,
                      o_smem=outs[2:])
        return q_st, k_st, v_st

    # Ping-pong turns, one token going round the consumer warpgroups 0 -> 1 (-> 2) -> 0: named barrier 1 + w
    # (256 threads) completes when warpgroup w waits on it and its predecessor has passed it the turn. Per
    # warpgroup and tile: one wait (before PV_j, the wait before QK_0 first) and one pass (after issuing QK_j,
    # and once at the end), strictly alternating, so no barrier ever holds two passes; every warpgroup of a CTA
    # visits the same n_tiles. With the overlap: one wait before QK_j + PV_{j-1} and one pass after, for
    # j >= 1. Warpgroup 0 pre-passes its own first turn, so one pass stays unmatched at exit (as in FA3).

    @cute.jit
    def next_wg(self, wg):
        if cutlass.const_expr(self.wgs == 2):
            nxt = 1 - wg
        else:
            nxt = (wg + 1) % self.wgs
        return nxt

    @staticmethod
    def turn_wait(w):
        cute.arch.barrier(barrier_id=1 + w, number_of_threads=256)

    @staticmethod
    def turn_pass(w):
        cute.arch.barrier_arrive(barrier_id=1 + w, number_of_threads=256)

    @cute.jit
    def scores_to_p(self, qk_mma, k_st, kb, wg, wg_qk, tSrQ, tSrK, k_pipe, s_coords, row_m, row_l, row_lo,
                    row_hi, row_a, scale_log2, full_lo, full_hi, pass_turn: cutlass.Constexpr[bool]):
        """S = Q K_kb^T (waited for, K released), then softmax_tile: (P, the advanced K state; the caller
        rebinds it, a state advanced inside a helper does not reach the caller's loop otherwise). Passes the
        ping-pong turn once the GEMM is issued when asked."""
        acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        k_pipe.consumer_wait(k_st)
        wgmma.gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, k_st.index], True, wait=False)
        if cutlass.const_expr(pass_turn):
            self.turn_pass(self.next_wg(wg))
        warpgroup.wait_group(0)
        k_pipe.consumer_release(k_st)
        k_st.advance()
        r_p = self.softmax_tile(acc_s, kb, s_coords, row_m, row_l, row_lo, row_hi, row_a, scale_log2, full_lo,
                                full_hi)
        return r_p, k_st

    @cute.jit
    def softmax_tile(self, acc_s, kb, s_coords, row_m, row_l, row_lo, row_hi, row_a, scale_log2, full_lo,
                     full_hi, portable: cutlass.Constexpr[bool] = False):
        """Mask (edge tiles), then per row: max over the quad, exp2 to 16-bit P, l and m updated, the rescale
        factor of O in row_a. Returns P in the accumulator's layout (acc_as_a makes it the A operand).
        `portable`: host-lowerable forms and no quad shuffles (the CPU tests run this on the host)."""
        s_mn = wgmma.acc_mn(acc_s)
        if (kb < full_lo) | (kb >= full_hi):  # an edge tile: some key of it is hidden from some row
            for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
                mask_mod.apply_row_bounds(s_mn[r, None], s_coords[r, None], kb * self.tile_n, row_lo[r], row_hi[r])
        r_p = cute.make_rmem_tensor_like(acc_s, self.dtype)
        p_mn = wgmma.acc_mn(r_p)
        n_cols = cute.size(s_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):
            s_row = cute.make_rmem_tensor(cute.make_layout(n_cols), Float32)  # compact copy (register renaming)
            for i in cutlass.range_constexpr(n_cols):
                s_row[i] = s_mn[r, i]
            row_max = wgmma.quad_max(sm_mod.tile_max(s_row, portable), portable)
            m_new, m_safe, a = sm_mod.update_max(row_m[r], row_max, scale_log2, portable)
            p_row = cute.make_rmem_tensor(cute.make_layout(n_cols), self.dtype)
            row_sum = sm_mod.exp2_convert(s_row, p_row, scale_log2, m_safe, chunk=n_cols, portable=portable,
                                          f32x2=False)
            row_l[r] = row_l[r] * a + wgmma.quad_sum(row_sum, portable)
            row_m[r] = m_new
            row_a[r] = a
            for i in cutlass.range_constexpr(n_cols):
                p_mn[r, i] = p_row[i]
        return r_p

    @cute.jit
    def rescale_o(self, o_mn, row_a):
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            for i in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, i] = o_mn[r, i] * row_a[r]

    @cute.jit
    def epilogue(self, thr_pv, acc_o, o_mn, row_m, row_l, mO, mLSE, t, q_start, sq, m_block, h,
                 portable: cutlass.Constexpr[bool] = False, o_smem=None):
        """out = O / l in 16-bit and lse (by the first thread of each quad), for the rows inside the sequence.
        mO: the (tokens, D, heads) view. O from registers, or with o_tma (o_smem = (TMA atom, its tensor, sO))
        through the warpgroup's SMEM slice and a TMA store where the slice may be written whole: it lies inside
        the sequence, or the sequence ends the tensor (the box is clipped there). `portable`: a division for
        rcp.approx (host runs)."""
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, None, h]), (self.tile_m, self.d_v),
                             (m_block, 0))
        g_mn = wgmma.acc_mn(thr_pv.partition_C(gO))
        c_mn = wgmma.acc_mn(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.d_v))))
        lse_row = cute.make_rmem_tensor(cute.make_layout(cute.size(o_mn, mode=[0])), Float32)
        for r in cutlass.range_constexpr(cute.size(o_mn, mode=[0])):
            inv_l, lse_row[r] = sm_mod.finalize(row_m[r], row_l[r], portable)
            for i in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                o_mn[r, i] = o_mn[r, i] * inv_l
        r_o = cute.make_rmem_tensor_like(acc_o, self.dtype)
        r_o.store(acc_o.load().to(self.dtype))
        ro_mn = wgmma.acc_mn(r_o)
        if cutlass.const_expr(o_smem is not None and self.cfg.o_tma):
            wg = t // 128
            row0 = m_block * self.tile_m + wg * 64  # the warpgroup's first row (warpgroup-uniform branch)
            if (row0 < sq) & ((row0 + 64 <= sq) | (q_start + sq == mO.shape[0])):
                self.store_o_tma(r_o, *o_smem, t, q_start, m_block, h)
                self.store_rows(ro_mn, g_mn, c_mn, lse_row, mLSE, t, q_start, sq, m_block, h, False)
            else:
                self.store_rows(ro_mn, g_mn, c_mn, lse_row, mLSE, t, q_start, sq, m_block, h, True)
        else:
            self.store_rows(ro_mn, g_mn, c_mn, lse_row, mLSE, t, q_start, sq, m_block, h, True)

    @cute.jit
    def store_rows(self, ro_mn, g_mn, c_mn, lse_row, mLSE, t, q_start, sq, m_block, h,
                   with_o: cutlass.Constexpr[bool]):
        """Row-predicated stores from registers: O's values (with_o) and the lse of the thread's rows."""
        for r in cutlass.range_constexpr(cute.size(ro_mn, mode=[0])):
            row = m_block * self.tile_m + c_mn[r, 0][0]
            if row < sq:
                if cutlass.const_expr(with_o):
                    for i in cutlass.range_constexpr(cute.size(ro_mn, mode=[1])):
                        g_mn[r, i] = ro_mn[r, i]
                if cutlass.const_expr(mLSE is not None):
                    if t % 4 == 0:
                        mLSE[q_start + row, h] = lse_row[r]

    @cute.jit
    def store_o_tma(self, r_o, tma_o, mO_tma, sO, t, q_start, m_block, h):
        """The warpgroup's 64 rows of O (16-bit, in the accumulator layout) into its SMEM slice (stmatrix), then
        one TMA store of the (64, Dv) box by the warpgroup's first warp. The slice is reused only after that
        warp has seen the previous store's SMEM reads complete (bulk wait_group.read) and the warpgroup has met
        on its epilogue barrier, so the store of tile i drains during tile i + 1."""
        wg = t // 128
        bar = 1 + self.wgs + wg  # named barriers 1 .. wgs are the ping-pong turns
        first_warp = t % 128 < 32
        if first_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        st_atom, thr = self.o_smem_copy(t)
        cute.copy(st_atom, thr.retile(r_o), thr.partition_D(sO[None, None, wg]))
        cute.arch.fence_view_async_shared()  # the generic-proxy writes, visible to the TMA (async proxy)
        cute.arch.barrier(barrier_id=bar, number_of_threads=128)
        if first_warp:
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO_tma[None, None, h]), (64, self.d_v),
                                 (None, 0))
            tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                               cute.group_modes(gO, 0, 2))
            with cute.arch.elect_one():  # one thread issues the store (its warp waits on its bulk group)
                cute.copy(tma_o, tOsO[None, wg], tOgO[None, m_block * self.wgs + wg])
                cute.arch.cp_async_bulk_commit_group()

    def o_smem_copy(self, t):
        """(stmatrix.x4 atom, thread t's slice of its tiled copy) over one warpgroup's (64, Dv) accumulator: the
        thread's O fragment (the same per-thread layout in the 2- or 3-warpgroup MMA) retiled as its source."""
        one_wg = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K,
                                                   OperandMajorMode.MN, Float32, (1, 1, 1), (64, self.d_v),
                                                   a_source=warpgroup.OperandSource.RMEM)
        st_atom = cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), self.dtype)
        return st_atom, cute.make_tiled_copy_C(st_atom, one_wg).get_slice(t % 128)

    @cute.jit
    def drain_o_store(self, t):
        """Before the CTA exits: the warpgroup's last TMA store has read its SMEM."""
        if cutlass.const_expr(self.cfg.o_tma):
            if t % 128 < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
