"""The sm_100a attention kernel class (fmha_sm100.py: the roles, the per-tile protocol and the TMEM map).

Imported by fmha_sm100.build only, so importing lowbit never needs nvidia-cutlass-dsl. No
`from __future__ import annotations`: the DSL evaluates the kernel's annotations."""

import cutlass
import cutlass.cute as cute
import cutlass.memory as memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.nvgpu.tcgen05 import OperandSource
from cutlass.experimental.primitives.nvvm_wrapper import tcgen05_fence  # no stable wrapper in 4.8 yet

from . import mask as mask_mod
from . import scheduler as sched_mod
from . import softmax as sm_mod
from .fmha_sm100 import TILE_M, TILE_N, FmhaSm100Config


def group(n):
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)


class FmhaSm100:
    """The kernel for one FmhaSm100Config: `__call__` (traced on the host) launches `kernel`; `attend` branches into
    the roles `load`, `mma`, `softmax` and `correction` (with `epilogue`)."""

    SOFTMAX_WARPS = (0, 1, 2, 3)
    CORRECTION_WARPS = (4, 5, 6, 7)
    MMA_WARP = 8
    LOAD_WARP = 9
    IDLE_WARPS = (10, 11)  # complete the third warpgroup: setmaxnreg acts on whole warpgroups
    THREADS = 32 * 12
    # Registers per thread after setmaxnreg (the launch gives 65536 / 384 -> 168 each): the softmax warps hold
    # a row of S (128 fp32) next to P (64 packed), the correction warps one 32-column chunk of O.
    REGS_SOFTMAX = 200
    REGS_CORRECTION = 96
    REGS_OTHER = 80
    TMEM_S = 0
    TMEM_O = 128
    TMEM_P = 256
    TMEM_COLS = 512  # power of two >= 320
    CORR_CHUNK = 32  # O columns per TMEM load/scale/store round trip in the rescale
    EPI_CHUNK = 32  # O columns per TMEM load in the epilogue (64 bytes of 16-bit output per thread)
    MSG_STAGES = 2

    def __init__(self, cfg: FmhaSm100Config):
        self.cfg = cfg
        self.d = cfg.head_dim
        self.spec = cfg.mask
        self.kv_stages = cfg.kv_stages
        self.qk_tiler = (TILE_M, TILE_N, self.d)
        self.pv_tiler = (TILE_M, self.d, TILE_N)
        # retrieve barrier: every warp that touches TMEM (softmax, correction, MMA)
        self.tmem_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * 9)
        self.corr_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * 4)

    # ------------------------------------------------------------------------------------- host side

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor | None, mCuQ: cute.Tensor, mCuK: cute.Tensor, mSink: cute.Tensor | None,
                 softmax_scale: Float32, window_left: Int32, window_right: Int32, stream):
        d = self.d
        dt = mQ.element_type
        self.dtype = dt
        total_q, hq = mQ.shape[0], mQ.shape[1]
        total_k, hkv = mK.shape[0], mK.shape[1]
        # MMA views: q/k/o (seq, D, head) K-major; v (D, seq, head): MN-major B operand of O += P V
        q = cute.make_tensor(mQ.iterator, cute.make_layout((total_q, d, hq), stride=(mQ.stride[0], 1,
                                                                                    mQ.stride[1])))
        k = cute.make_tensor(mK.iterator, cute.make_layout((total_k, d, hkv), stride=(mK.stride[0], 1,
                                                                                     mK.stride[1])))
        v = cute.make_tensor(mV.iterator, cute.make_layout((d, total_k, hkv), stride=(1, mV.stride[0],
                                                                                     mV.stride[1])))
        o = cute.make_tensor(mO.iterator, cute.make_layout((total_q, d, hq), stride=(mO.stride[0], 1,
                                                                                    mO.stride[1])))
        cta_group = tcgen05.CtaGroup.ONE
        qk_mma, pv_mma = self.make_mmas()
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk_mma.thr_id.shape,))

        q_sl = sm100_utils.make_smem_layout_a(qk_mma, self.qk_tiler, dt, 1)
        k_sl = sm100_utils.make_smem_layout_b(qk_mma, self.qk_tiler, dt, self.kv_stages)
        v_sl = sm100_utils.make_smem_layout_b(pv_mma, self.pv_tiler, dt, self.kv_stages)
        p_tl = sm100_utils.make_smem_layout_a(pv_mma, self.pv_tiler, dt, 1)  # P's TMEM operand layout

        load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        q_sl1 = cute.select(q_sl, mode=[0, 1, 2])
        k_sl1 = cute.select(k_sl, mode=[0, 1, 2])
        v_sl1 = cute.select(v_sl, mode=[0, 1, 2])
        tma_q, tq_ = cute.nvgpu.make_tiled_tma_atom_A(load_op, q, q_sl1, self.qk_tiler, qk_mma,
                                                      cluster_vmnk.shape)
        tma_k, tk_ = cute.nvgpu.make_tiled_tma_atom_B(load_op, k, k_sl1, self.qk_tiler, qk_mma,
                                                      cluster_vmnk.shape)
        tma_v, tv_ = cute.nvgpu.make_tiled_tma_atom_B(load_op, v, v_sl1, self.pv_tiler, pv_mma,
                                                      cluster_vmnk.shape)
        self.q_bytes = cute.size_in_bytes(dt, q_sl1)
        self.k_bytes = cute.size_in_bytes(dt, k_sl1)
        self.v_bytes = cute.size_in_bytes(dt, v_sl1)

        @cute.struct
        class SharedStorage:
            q_bar: cute.struct.MemRange[Int64, 2]
            k_bar: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            v_bar: cute.struct.MemRange[Int64, 2 * self.kv_stages]
            s_bar: cute.struct.MemRange[Int64, 2]
            p_bar: cute.struct.MemRange[Int64, 2]
            o_bar: cute.struct.MemRange[Int64, 2]
            pv_bar: cute.struct.MemRange[Int64, 2]
            msg_bar: cute.struct.MemRange[Int64, 2 * self.MSG_STAGES]
            tmem_addr: Int32
            tile: cute.struct.MemRange[Int32, 4]  # (batch, m-tile, head) of this CTA, for the roles
            msg: cute.struct.MemRange[Float32, TILE_M * 2 * self.MSG_STAGES]  # [row, (a | m, l), stage]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(q_sl)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(k_sl)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(v_sl)], 1024]

        self.shared_storage = SharedStorage

        num_batch = mCuQ.shape[0] - 1
        group_size = hq // hkv
        scale_log2 = softmax_scale * Float32(sm_mod.LOG2E)
        grid = sched_mod.launch_grid(total_q, num_batch, hq, TILE_M)
        self.kernel(qk_mma, pv_mma, tma_q, tq_, tma_k, tk_, tma_v, tv_, o, mLSE, mCuQ, mCuK, mSink,
                    scale_log2, window_left, window_right, num_batch, hq, group_size,
                    q_sl, k_sl, v_sl, p_tl).launch(grid=grid, block=[self.THREADS, 1, 1],
                                                   cluster=(1, 1, 1), stream=stream, min_blocks_per_mp=1)

    def make_mmas(self):
        """(QK^T: SS, K-major x K-major; PV: TS, P from TMEM, V MN-major), fp32 accumulators, one CTA."""
        dt = self.dtype
        one = tcgen05.CtaGroup.ONE
        qk = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, one,
                                                self.qk_tiler[:2])
        pv = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32, one,
                                                self.pv_tiler[:2], OperandSource.TMEM)
        return qk, pv

    @staticmethod
    def fence_before():
        """tcgen05.fence::before_thread_sync: order this thread's finished TMEM loads/stores (and MMAs) before
        the mbarrier arrive that publishes them (PTX memory model for tcgen05 across threads)."""
        tcgen05_fence("before_thread_sync")

    @staticmethod
    def fence_after():
        """tcgen05.fence::after_thread_sync: order later tcgen05 ops (ld/st/mma) after the wait just done."""
        tcgen05_fence("after_thread_sync")

    # ----------------------------------------------------------------------------------- device side

    @cute.kernel
    def kernel(self, qk_mma: cute.TiledMma, pv_mma: cute.TiledMma, tma_q: cute.CopyAtom, mQ: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor | None, mCuQ: cute.Tensor, mCuK: cute.Tensor, mSink: cute.Tensor | None,
               scale_log2: Float32, window_left: Int32, window_right: Int32, num_batch: Int32, hq: Int32,
               group_size: Int32, q_sl: cute.ComposedLayout, k_sl: cute.ComposedLayout,
               v_sl: cute.ComposedLayout, p_tl: cute.ComposedLayout):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()

        # ---- which tile (every warp computes the same answer)
        b, m_block, h, valid = sched_mod.cta_tile(mCuQ, num_batch, hq, TILE_M,
                                                  self.spec.bounded_right)
        if valid:
            self.attend(qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, mO, mLSE, mCuQ, mCuK, mSink,
                        scale_log2, window_left, window_right, group_size, q_sl, k_sl, v_sl, p_tl,
                        warp, tidx, b, m_block, h)

    @cute.jit
    def attend(self, qk_mma, pv_mma, tma_q, mQ, tma_k, mK, tma_v, mV, mO, mLSE, mCuQ, mCuK, mSink,
               scale_log2, window_left, window_right, group_size, q_sl, k_sl, v_sl, p_tl, warp, tidx,
               b, m_block, h):
        if warp == self.LOAD_WARP:
            cpasync.prefetch_descriptor(tma_q)
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)

        smem = memory.SmemAllocator()
        st = smem.allocate(self.shared_storage)
        one = group(1)
        wg = group(128)
        q_prod, q_cons = pipeline.PipelineTmaUmma.create(
            num_stages=1, producer_group=one, consumer_group=one, tx_count=self.q_bytes,
            barrier_storage=st.q_bar.data_ptr(), defer_sync=True).make_participants()
        k_prod, k_cons = pipeline.PipelineTmaUmma.create(
            num_stages=self.kv_stages, producer_group=one, consumer_group=one, tx_count=self.k_bytes,
            barrier_storage=st.k_bar.data_ptr(), defer_sync=True).make_participants()
        v_prod, v_cons = pipeline.PipelineTmaUmma.create(
            num_stages=self.kv_stages, producer_group=one, consumer_group=one, tx_count=self.v_bytes,
            barrier_storage=st.v_bar.data_ptr(), defer_sync=True).make_participants()
        # S full (MMA commit) / S read (softmax arrive)
        s_prod, s_cons = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=wg, barrier_storage=st.s_bar.data_ptr(),
            defer_sync=True).make_participants()
        # P written (softmax arrive) / P consumed (commit after PV)
        p_prod, p_cons = pipeline.PipelineAsyncUmma.create(
            num_stages=1, producer_group=wg, consumer_group=one, barrier_storage=st.p_bar.data_ptr(),
            defer_sync=True).make_participants()
        # O rescaled for step j (correction arrive) / seen by the MMA warp
        o_prod, o_cons = pipeline.PipelineAsyncUmma.create(
            num_stages=1, producer_group=wg, consumer_group=one, barrier_storage=st.o_bar.data_ptr(),
            defer_sync=True).make_participants()
        # PV_j complete (MMA commit) / O read or rescaled (correction arrive)
        pv_prod, pv_cons = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one, consumer_group=wg, barrier_storage=st.pv_bar.data_ptr(),
            defer_sync=True).make_participants()
        # softmax -> correction messages in SMEM: a_j per tile, then the final (m, l)
        msg_prod, msg_cons = pipeline.PipelineAsync.create(
            num_stages=self.MSG_STAGES, producer_group=wg, consumer_group=wg,
            barrier_storage=st.msg_bar.data_ptr(), defer_sync=True).make_participants()
        tmem = memory.TmemAllocator(st.tmem_addr.ptr, barrier_for_retrieve=self.tmem_bar,
                                   allocator_warp_id=self.CORRECTION_WARPS[0], arch="sm_100")
        pipeline.pipeline_init_arrive(is_relaxed=True)

        sQ = st.sQ.get_tensor(q_sl.outer, swizzle=q_sl.inner)
        sK = st.sK.get_tensor(k_sl.outer, swizzle=k_sl.inner)
        sV = st.sV.get_tensor(v_sl.outer, swizzle=v_sl.inner)
        sMsg = st.msg.get_tensor(cute.make_layout((TILE_M, 2, self.MSG_STAGES)))
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        # The roles read the tile's coordinates back from SMEM after their setmaxnreg: kept in registers
        # across it, ptxas moved them through local memory.
        sTile = st.tile.get_tensor(cute.make_layout(4))
        if tidx == 0:
            sTile[0] = b
            sTile[1] = m_block
            sTile[2] = h
        pipeline.pipeline_init_wait()  # CTA barrier: mbarrier inits and sTile visible to all

        # Each role changes its register limit first thing in its own branch (setmaxnreg acts per warpgroup:
        # warps 8-11 all drop to REGS_OTHER). Done once before the branches instead, ptxas sees paths with
        # different limits merge and spills heavily.
        if warp >= self.IDLE_WARPS[0]:
            cute.arch.setmaxregister_decrease(self.REGS_OTHER)
        if warp == self.LOAD_WARP:
            cute.arch.setmaxregister_decrease(self.REGS_OTHER)
            b, m_block, h, q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi = self.tile_info(
                sTile, mCuQ, mCuK, window_left, window_right)
            self.load(tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, qk_thr, pv_thr, q_prod, k_prod, v_prod,
                      q_start, k_start, m_block, h, h // group_size, n_lo, n_tiles)
        if warp == self.MMA_WARP:
            cute.arch.setmaxregister_decrease(self.REGS_OTHER)
            n_tiles = self.tile_info(sTile, mCuQ, mCuK, window_left, window_right)[8]
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.mma(qk_mma, pv_mma, qk_thr, pv_thr, sQ, sK, sV, p_tl, tmem_ptr, q_cons, k_cons, v_cons,
                     s_prod, p_cons, o_cons, pv_prod, n_tiles)
        if warp < self.CORRECTION_WARPS[0]:
            cute.arch.setmaxregister_increase(self.REGS_SOFTMAX)
            b, m_block, h, q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi = self.tile_info(
                sTile, mCuQ, mCuK, window_left, window_right)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            sink_log2 = None
            if cutlass.const_expr(mSink is not None):
                sink_log2 = mSink[h] * Float32(sm_mod.LOG2E)
            self.softmax(qk_thr, tmem_ptr, sMsg, s_cons, p_prod, msg_prod, tidx, scale_log2, sink_log2,
                         m_block, sq, sk, window_left, window_right, n_lo, n_tiles, full_lo, full_hi)
        if (warp >= self.CORRECTION_WARPS[0]) & (warp < self.MMA_WARP):
            cute.arch.setmaxregister_decrease(self.REGS_CORRECTION)
            b, m_block, h, q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi = self.tile_info(
                sTile, mCuQ, mCuK, window_left, window_right)
            tmem.allocate(self.TMEM_COLS)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction(pv_thr, tmem_ptr, sMsg, msg_cons, pv_cons, o_prod, tidx, mO, mLSE, q_start, sq,
                            m_block, h, n_tiles)
            tmem.relinquish_alloc_permit()
            self.fence_before()
            self.corr_bar.arrive_and_wait()  # every correction warp's last TMEM load is done
            self.fence_after()
            tmem.free(tmem_ptr)

    @cute.jit
    def tile_info(self, sTile, mCuQ, mCuK, window_left, window_right):
        """(b, m_block, h, q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi): this CTA's tile, its
        sequence and its key tiles. Every role computes it after its setmaxnreg (values carried across
        setmaxnreg from the shared prologue were spilled by ptxas)."""
        b = sTile[0]
        m_block = sTile[1]
        h = sTile[2]
        return (b, m_block, h, *sched_mod.sequence_tiles(self.spec, mCuQ, mCuK, b, m_block, window_left,
                                                         window_right, TILE_M, TILE_N))

    # ----------------------------------------------------------------------------------------- roles

    @cute.jit
    def load(self, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, qk_thr, pv_thr, q_prod, k_prod, v_prod,
             q_start, k_start, m_block, h, hk, n_lo, n_tiles):
        if n_tiles > 0:
            # the sequence's rows start at cu_seqlens; tiles index from there (TMA zero-fills past the tensor)
            gQ = cute.flat_divide(cute.domain_offset((q_start, 0, 0), mQ), cute.select(self.qk_tiler, [0, 2]))
            gK = cute.flat_divide(cute.domain_offset((k_start, 0, 0), mK), cute.select(self.qk_tiler, [1, 2]))
            gV = cute.flat_divide(cute.domain_offset((0, k_start, 0), mV), cute.select(self.pv_tiler, [1, 2]))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                               cute.group_modes(qk_thr.partition_A(gQ), 0, 3))
            tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                               cute.group_modes(qk_thr.partition_B(gK), 0, 3))
            tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                               cute.group_modes(pv_thr.partition_B(gV), 0, 3))
            hq_ = q_prod.acquire_and_advance()
            cute.copy(tma_q, tQgQ[None, m_block, 0, h], tQsQ[None, hq_.index], tma_bar_ptr=hq_.barrier)
            for j in cutlass.range(n_tiles, unroll=1):
                kb = n_lo + j
                hk_ = k_prod.acquire_and_advance()
                cute.copy(tma_k, tKgK[None, kb, 0, hk], tKsK[None, hk_.index], tma_bar_ptr=hk_.barrier)
                hv_ = v_prod.acquire_and_advance()
                cute.copy(tma_v, tVgV[None, 0, kb, hk], tVsV[None, hv_.index], tma_bar_ptr=hv_.barrier)

    @cute.jit
    def mma(self, qk_mma, pv_mma, qk_thr, pv_thr, sQ, sK, sV, p_tl, tmem_ptr, q_cons, k_cons, v_cons,
            s_prod, p_cons, o_cons, pv_prod, n_tiles):
        # Private MMA objects: setting ACCUMULATE rewrites an atom's runtime field inside this warp's branch,
        # and the kernel-argument MMAs are still used by the other roles' (later-traced) branches.
        qk_mma, pv_mma = self.make_mmas()
        qk_thr = qk_mma.get_slice(0)
        pv_thr = pv_mma.get_slice(0)
        tSrQ = qk_thr.make_fragment_A(sQ)
        tSrK = qk_thr.make_fragment_B(sK)
        tOrV = pv_thr.make_fragment_B(sV)
        tStS = self.s_tmem(qk_thr, tmem_ptr)
        tOtO = self.o_tmem(pv_thr, tmem_ptr)
        tOrP = self.p_tmem(pv_thr, p_tl, tmem_ptr)
        if n_tiles > 0:
            hq_ = q_cons.wait_and_advance()
            tSrQ0 = tSrQ[None, None, None, hq_.index]
            # S_0 = Q K_0^T
            hk_ = k_cons.wait_and_advance()
            hs_ = s_prod.acquire_and_advance()
            self.fence_after()
            self.gemm(qk_mma, tStS, tSrQ0, tSrK[None, None, None, hk_.index], False)
            hs_.commit()
            hk_.release()
            for j in cutlass.range(n_tiles, unroll=1):
                if j + 1 < n_tiles:  # S_{j+1} while softmax works on tile j (S was read: acquire)
                    hk_ = k_cons.wait_and_advance()
                    hs_ = s_prod.acquire_and_advance()  # softmax has read S_j
                    self.fence_after()
                    self.gemm(qk_mma, tStS, tSrQ0, tSrK[None, None, None, hk_.index], False)
                    hs_.commit()
                    hk_.release()
                # O += P_j V_j once P_j is in TMEM and O holds the rescaled sum of tiles < j
                hp_ = p_cons.wait_and_advance()
                ho_ = o_cons.wait_and_advance()
                hv_ = v_cons.wait_and_advance()
                hpv_ = pv_prod.acquire_and_advance()
                self.fence_after()
                self.gemm(pv_mma, tOtO, tOrP, tOrV[None, None, None, hv_.index], j > 0)
                hpv_.commit()
                hv_.release()
                hp_.release()
                ho_.release()
            hq_.release()

    @cute.jit
    def gemm(self, tiled_mma, acc, a, b, accumulate):
        for kp in cutlass.range_constexpr(cute.size(a, mode=[2])):
            tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate | (kp != 0))
            cute.gemm(tiled_mma, acc, a[None, None, kp], b[None, None, kp], acc)

    @cute.jit
    def softmax(self, qk_thr, tmem_ptr, sMsg, s_cons, p_prod, msg_prod, tidx, scale_log2, sink_log2,
                m_block, sq, sk, window_left, window_right, n_lo, n_tiles, full_lo, full_hi):
        t = tidx % 128
        tStS = self.s_tmem(qk_thr, tmem_ptr)
        tScS = qk_thr.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        ld_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tmem_ld = tcgen05.make_tmem_copy(ld_atom, tStS)
        thr_ld = tmem_ld.get_slice(t)
        tLtS = thr_ld.partition_S(tStS)
        tLcS = thr_ld.partition_D(tScS)
        # P: TILE_N 16-bit values per row = TILE_N / 2 fp32 columns
        p_cols = TILE_N * self.dtype.width // 32
        tStP = cute.make_tensor(tmem_ptr + self.TMEM_P,
                                cute.composition(tStS.layout, cute.make_layout((TILE_M, p_cols))))
        tScP = cute.make_tensor(tScS.iterator, cute.composition(tScS.layout, cute.make_layout((TILE_M, p_cols))))
        st_atom = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        tmem_st = tcgen05.make_tmem_copy(st_atom, tStP)
        thr_st = tmem_st.get_slice(t)
        tSt_P = thr_st.partition_D(tStP)
        tSc_P = thr_st.partition_S(tScP)

        row = tLcS[0][0]
        q_pos = m_block * TILE_M + row + sk - sq
        row_lo, row_hi = mask_mod.row_key_bounds(self.spec, q_pos, sk, window_left, window_right)
        m, l = sm_mod.init_stats(sink_log2)
        for j in cutlass.range(n_tiles, unroll=1):
            kb = n_lo + j
            hs_ = s_cons.wait_and_advance()
            self.fence_after()
            rS = cute.make_rmem_tensor(tLcS.shape, Float32)
            cute.copy(tmem_ld, tLtS, rS)
            cute.arch.fence_view_async_tmem_load()
            self.fence_before()
            hs_.release()  # S may be overwritten by QK_{j+1}
            if (kb < full_lo) | (kb >= full_hi):  # an edge tile: some key of it is hidden from some row
                mask_mod.apply_row_bounds(rS, tLcS, kb * TILE_N, row_lo, row_hi)
            m_new, m_safe, a = sm_mod.update_max(m, sm_mod.tile_max(rS), scale_log2)
            hm_ = msg_prod.acquire_and_advance()  # correction can rescale O while we exponentiate
            sMsg[t, 0, hm_.index] = a
            hm_.commit()
            rP = cute.make_rmem_tensor(tSc_P.shape, Float32)  # 16-bit pairs, as STTM stores them
            rP16 = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=self.dtype),
                                    cute.make_layout(cute.size(rS)))
            row_sum = sm_mod.exp2_convert(rS, rP16, scale_log2, m_safe)
            l = l * a + row_sum
            m = m_new
            hp_ = p_prod.acquire_and_advance()  # PV_{j-1} has read P_{j-1}
            self.fence_after()
            cute.copy(tmem_st, rP, tSt_P)
            cute.arch.fence_view_async_tmem_store()
            self.fence_before()
            hp_.commit()
        hm_ = msg_prod.acquire_and_advance()
        sMsg[t, 0, hm_.index] = m
        sMsg[t, 1, hm_.index] = l
        hm_.commit()

    @cute.jit
    def correction(self, pv_thr, tmem_ptr, sMsg, msg_cons, pv_cons, o_prod, tidx, mO, mLSE, q_start, sq,
                   m_block, h, n_tiles):
        t = tidx % 128
        tOtO = self.o_tmem(pv_thr, tmem_ptr)
        for j in cutlass.range(n_tiles, unroll=1):
            hm_ = msg_cons.wait_and_advance()
            a = sMsg[t, 0, hm_.index]
            hm_.release()
            if j > 0:
                hpv_ = pv_cons.wait_and_advance()  # PV_{j-1} is in O
                self.fence_after()
                if cute.arch.vote_any_sync(a != Float32(1.0)):  # some row's max grew past the threshold
                    self.rescale_o(pv_thr, tOtO, t, a)
                hpv_.release()
            ho_ = o_prod.acquire_and_advance()
            self.fence_before()
            ho_.commit()
        hm_ = msg_cons.wait_and_advance()
        m = sMsg[t, 0, hm_.index]
        l = sMsg[t, 1, hm_.index]
        hm_.release()
        inv_l, lse = sm_mod.finalize(m, l)
        self.epilogue(pv_thr, tOtO, pv_cons, t, mO, mLSE, q_start, sq, m_block, h, n_tiles, inv_l, lse)

    @cute.jit
    def rescale_o(self, pv_thr, tOtO, t, a):
        """O[row t] *= a, CORR_CHUNK columns per round trip; load and store atoms from the same tiled view,
        so their register <-> column maps agree."""
        c = self.CORR_CHUNK
        tOtO_c = cute.make_tensor(tOtO.iterator, cute.composition(tOtO.layout, cute.make_layout((TILE_M, c))))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(c)), Float32), tOtO_c)
        st = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(c)), Float32), tOtO_c)
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((TILE_M, self.d)))
        tOcO_c = cute.make_tensor(tOcO.iterator, cute.composition(tOcO.layout, cute.make_layout((TILE_M, c))))
        thr_ld = ld.get_slice(t)
        tL = thr_ld.partition_S(tOtO_c)
        tLc = thr_ld.partition_D(tOcO_c)  # the register side's shape
        tS = st.get_slice(t).partition_D(tOtO_c)
        for i in cutlass.range_constexpr(self.d // c):
            r = cute.make_rmem_tensor(tLc.shape, Float32)
            cute.copy(ld, cute.make_tensor(tL.iterator + i * c, tL.layout), r)
            for e in cutlass.range_constexpr(0, cute.size(r), 2):
                r[e], r[e + 1] = cute.arch.mul_packed_f32x2((r[e], r[e + 1]), (a, a))
            cute.copy(st, r, cute.make_tensor(tS.iterator + i * c, tS.layout))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def epilogue(self, pv_thr, tOtO, pv_cons, t, mO, mLSE, q_start, sq, m_block, h, n_tiles, inv_l, lse):
        c = self.EPI_CHUNK
        gO = cute.local_tile(cute.domain_offset((q_start, 0, 0), mO), (TILE_M, self.d), (m_block, 0, h))
        tOgO = pv_thr.partition_C(gO)
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((TILE_M, self.d)))
        sub = cute.make_layout((TILE_M, c))
        tOtO_c = cute.make_tensor(tOtO.iterator, cute.composition(tOtO.layout, sub))
        tOgO_c = cute.make_tensor(tOgO.iterator, cute.composition(tOgO.layout, sub))
        tOcO_c = cute.make_tensor(tOcO.iterator, cute.composition(tOcO.layout, sub))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(c)), Float32), tOtO_c)
        thr = ld.get_slice(t)
        tLt = thr.partition_S(tOtO_c)
        tLg = thr.partition_D(tOgO_c)
        tLc = thr.partition_D(tOcO_c)
        row = m_block * TILE_M + tLc[0][0]
        row_ok = row < sq
        if n_tiles > 0:
            hpv_ = pv_cons.wait_and_advance()  # PV_{n-1} is in O
            self.fence_after()
            for i in cutlass.range_constexpr(self.d // c):
                r = cute.make_rmem_tensor(tLc.shape, Float32)
                cute.copy(ld, cute.make_tensor(tLt.iterator + i * c, tLt.layout), r)
                for e in cutlass.range_constexpr(0, cute.size(r), 2):
                    r[e], r[e + 1] = cute.arch.mul_packed_f32x2((r[e], r[e + 1]), (inv_l, inv_l))
                r16 = cute.make_rmem_tensor(tLc.shape, self.dtype)
                r16.store(r.load().to(self.dtype))
                if row_ok:
                    cute.autovec_copy(r16, cute.make_tensor(tLg.iterator + i * c, tLg.layout))
            hpv_.release()
        else:  # no key tile: out = 0 (the lse below is -inf, or the sink's logit)
            for i in cutlass.range_constexpr(self.d // c):
                r16 = cute.make_rmem_tensor(tLc.shape, self.dtype)
                r16.fill(0.0)
                if row_ok:
                    cute.autovec_copy(r16, cute.make_tensor(tLg.iterator + i * c, tLg.layout))
        if cutlass.const_expr(mLSE is not None):
            if row_ok:
                mLSE[q_start + row, h] = lse

    # ------------------------------------------------------------------------------------ TMEM views

    def s_tmem(self, qk_thr, tmem_ptr):
        frag = qk_thr.make_fragment_C(qk_thr.partition_shape_C(self.qk_tiler[:2]))
        return cute.make_tensor(tmem_ptr + self.TMEM_S, frag.layout)

    def o_tmem(self, pv_thr, tmem_ptr):
        frag = pv_thr.make_fragment_C(pv_thr.partition_shape_C(self.pv_tiler[:2]))
        return cute.make_tensor(tmem_ptr + self.TMEM_O, frag.layout)

    def p_tmem(self, pv_thr, p_tl, tmem_ptr):
        """P as the A operand of O += P V, read from TMEM columns TMEM_P.. (16-bit pairs per column)."""
        frag = pv_thr.make_fragment_A(cute.make_tensor(tmem_ptr, p_tl.outer))[None, None, None, 0]
        return cute.make_tensor(cute.recast_ptr(tmem_ptr + self.TMEM_P, dtype=frag.element_type), frag.layout)
