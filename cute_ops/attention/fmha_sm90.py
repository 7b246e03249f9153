"""Hopper (sm_90a) forward attention in CuTeDSL: TMA loads, warpgroup MMA (WGMMA), online softmax in registers.

The 128-row tile (two consumer warpgroups) and the 192-row tile (three) run on the H100 and the H200
(HARDWARE_STATUS below; FOR_CALL picks between them); other tile_n / kv_stages values are compiled and SASS-checked
on a CPU only (tests/test_cute_attention_sm90.py).

Contract: dispatch/reference/attention.py (varlen q/k/v, GQA, causal + window bottom-right, sinks, natural-log
LSE); arguments as in launch.py. D = 64 or 128, bf16 or fp16.

One CTA per (query tile of tile_m = 128 or 192 rows, query head), or a persistent grid (below); 1 + tile_m / 64
warpgroups (registers split by setmaxnreg: 24 / 240 / 240 with two consumers, 24 / 160 / 160 / 160 with three):

    warpgroup 0   producer   warp 0 issues the TMA loads: Q once, then K_j and V_j (tile_n keys) through a
                             kv_stages ring each (its other three warps only lower their register limit and leave)
    warpgroups 1+ consumers  each owns 64 query rows (the M mode of the tiled MMA is tile_m / 64 x m64): per key tile
                             S = Q K_j^T (SS WGMMA, fp32 in registers), mask (edge tiles only), online softmax
                             (mask.py / softmax.py, rows reduced over the 4 threads of a quad), P to 16-bit in
                             registers, O *= a, O += P V_j (RS WGMMA: A = P from registers, B = V^T from SMEM);
                             then out = O / l stored row-predicated from registers, and lse.

Schedules (config fields): plain, each WGMMA waited for before the softmax that needs it, the consumer warpgroups
interleaving on their own; `pingpong` (FA3's inter-warpgroup schedule, the default): they take turns on the tensor
core through named barriers (a ring 0 -> 1 (-> 2) -> 0), one's softmax running while the others' PV_{j-1} + QK_j
execute; `overlap` (FA3's intra-warpgroup overlap): QK_j and PV_{j-1} issued together, the softmax of tile j under
PV_{j-1} (bf16 at tile_n = 128 only in practice: with fp16 or another tile_n ptxas serializes the WGMMAs).

Persistent grid (`persistent` = the SM count; for_call's FOR_CALL table turns it on for sliding-window calls, where
a query tile visits only 2-3 key tiles and the per-tile prologue / epilogue dominated, and for hd128): grid = one
CTA per SM, each walking the PACKED tile order with stride grid (scheduler.persistent_tiles is its host
model). The roles loop over the same tile
sequence on their own: the producer warp issues the next tile's Q (a 2-stage Q ring; consumers free a buffer once
the tile's last QK is done) and K / V as soon as the rings have room, so they are in SMEM when the consumers start
it; the pipeline states and the ping-pong token carry over (warpgroup 0 pre-passes its first turn once per CTA), so
one warpgroup's epilogue runs under the other's first GEMMs of the next tile.

O epilogue (`o_tma`, on in every FOR_CALL row): per consumer warpgroup, out = O / l to 16-bit, stmatrix into the
warpgroup's (64, D) SMEM slice, one TMA store, waited for (bulk read) only before the slice's next use, so on the
persistent grid the store drains under the next tile; slices ending inside a sequence other than the last keep
the register stores. Timings in FOR_CALL's comment.

Key tiles run from n_lo upwards (mask.tile_range); a tile is masked only when it is not inside every row's visible
interval. Varlen: TMA boxes start at the sequence's first row; rows past the sequence are read (the next
sequence's rows, or zeros past the tensor), masked to -inf for keys and never stored for queries (they must be
finite, as in FA4 and the sm100 kernel).
"""

import dataclasses
import functools
import typing

from . import launch
from . import mask as mask_mod
from . import scheduler as sched_mod
from . import softmax as sm_mod

SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one sm_90 CTA may use
# setmaxnreg limits per consumer warpgroup count (producer, consumers): 65536 registers per SM, one CTA of
# 128 * (1 + consumers) threads; 3 consumers: 24 * 128 + 160 * 384 <= 65536 (168 would not fit)
REGS = {2: (24, 240), 3: (24, 160)}


@dataclasses.dataclass(frozen=True)
class FmhaSm90Config(launch.AttentionConfig):
    """The compile key (launch.AttentionConfig) for sm_90a."""

    arch: str = "sm_90a"
    NAME = "fmha_sm90"
    ARCH_PREFIX = "sm_90"
    ARCH_WHY = "WGMMA kernel needs sm_90a"
    # FA3's inter-warpgroup ping-pong: the consumer warpgroups take turns on the tensor core (named barriers),
    # so one's softmax overlaps the others' GEMMs. On by default: H100, hd128 causal 4 x 4096, 0.87x FA4 against
    # 0.79x without it; `overlap` measured 0.84x alone and 0.83x with ping-pong, so it is off by default (FOR_CALL
    # turns it on for the 192-row hd64 tile).
    pingpong: bool = True
    # FA3's intra-warpgroup overlap: QK_{j} issued together with PV_{j-1}, the softmax of tile j under PV_{j-1}.
    overlap: bool = False
    # Query rows per CTA: 64 per consumer warpgroup, 128 (two) or 192 (three; FA3 / FA4 use 192 x 128 at hd64,
    # where a key tile carries half the MMA work per softmax element of hd128 and a third warpgroup's softmax can
    # hide under the other two's GEMMs). 192 at hd64 compiles without spills at 160 registers (FOR_CALL's hd64 rule).
    tile_m: int = 128
    tile_n: int = 128  # keys per K/V tile: a multiple of 16 (the P V k-step), at most 256 (WGMMA N, TMA box)
    kv_stages: int = 2  # K/V ring depth; SMEM at D=128: Q 32 KiB + 2 x (K 32 + V 32) KiB
    # Persistent grid of this many CTAs (the SM count; 0: one CTA per tile). Each CTA walks the PACKED tile order
    # with stride `persistent` (a static schedule); Q gets a 2-stage ring, so the producer loads the next tile's Q
    # and first K / V tiles while the consumers still work on this one, and the pipelines' phases and the
    # ping-pong turn carry over from tile to tile: the next tile's loads and one warpgroup's first GEMMs overlap
    # the other's epilogue. For short key ranges (a 128-key window: 2-3 key tiles per query tile), where the
    # per-tile prologue / epilogue is not hidden: H200 GPT-OSS window 0.80x FA4 against 0.65x with one CTA per
    # tile (docs/attention.md).
    persistent: int = 0
    # O epilogue through SMEM: each consumer warpgroup writes its 64 x D slice of out = O / l into its own SMEM
    # buffer (stmatrix) and one warp issues a TMA store (UTMASTG) of it, waited for (bulk read done) only before
    # the warpgroup's next epilogue reuses the buffer, so the store drains while the next tile's GEMMs run. Slices
    # that end inside a sequence other than the last are stored from registers as without it (a TMA box would
    # write into the next sequence's rows). SMEM: + tile_m x D 16-bit. Every FOR_CALL rule turns it on.
    o_tma: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.tile_m not in (128, 192):
            raise ValueError(f"tile_m {self.tile_m} not in (128, 192) (64 rows per consumer warpgroup)")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n {self.tile_n}: needs a multiple of 16 in [16, 256]")
        if not 1 <= self.kv_stages <= 8:
            raise ValueError(f"kv_stages {self.kv_stages} not in [1, 8]")
        if self.persistent < 0 or (self.persistent and self.schedule != "packed"):
            raise ValueError(f"persistent {self.persistent}: a CTA count >= 0, with the packed schedule only")
        # ptxas spills at 160 registers beyond these (nvidia-cutlass-dsl 4.8.1, sm_90a): S (tile_n / 2 fp32 per
        # thread) and O (head_dim / 2) live together; with the overlap P_{j-1} (tile_n / 4) as well. Compiled:
        # hd64 x 128 137 registers, x 160 156, overlap x 128 157; spills: hd64 x 192, hd128 x 128, overlap x 144.
        if self.tile_m == 192 and (self.head_dim + self.tile_n > 224 or (self.overlap and self.tile_n > 128)):
            raise ValueError(f"tile_m 192 (160 registers) with head_dim {self.head_dim}, tile_n {self.tile_n}, "
                             f"overlap {self.overlap}: spills (needs head_dim + tile_n <= 224, overlap tile_n <= 128)")
        # with the persistent grid the tile loop's state adds registers: 192 x 128 with overlap spills (35 STL)
        if self.tile_m == 192 and self.overlap and self.persistent:
            raise ValueError("tile_m 192 with overlap on the persistent grid spills (160 registers)")
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(f"SMEM {self.smem_bytes()} bytes > {SMEM_BYTES}: fewer kv_stages or smaller tiles")

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def q_stages(self) -> int:
        """Q buffers: 2 with the persistent grid (the next tile's Q loads during this one), else 1."""
        return 2 if self.persistent else 1

    def smem_bytes(self) -> int:
        """Dynamic SMEM of the kernel's SharedStorage: the mbarriers (padded to the 1024-byte alignment of the
        swizzled tiles), q_stages of Q, kv_stages of K and V (16-bit), and the O staging tile with o_tma."""
        rows = (self.q_stages + self.o_tma) * self.tile_m + 2 * self.kv_stages * self.tile_n
        tiles = 2 * self.head_dim * rows
        return 1024 + tiles

    @classmethod
    def for_call(cls, q, causal: bool, window_left: int, window_right: int, sinks, arch: str):
        """The shared rule, then FOR_CALL's row for (head dim, sliding window, causal): tile_m, the overlap (bf16
        only: with fp16 ptxas serializes its WGMMAs), the persistent grid (one CTA per SM) and the O epilogue."""
        cfg = super().for_call(q, causal, window_left, window_right, sinks, arch)
        row = FOR_CALL[cfg.head_dim, window_left >= 0, bool(causal)]
        return dataclasses.replace(cfg, tile_m=row.tile_m, overlap=row.overlap and cfg.dtype == "bf16",
                                   persistent=_sm_count(q) if row.persistent else 0, o_tma=row.o_tma)


class CallRule(typing.NamedTuple):
    tile_m: int = 128
    overlap: bool = False  # bf16 only
    persistent: bool = False  # one CTA per SM
    o_tma: bool = False


# for_call's rule per (head dim, sliding window (window_left >= 0), causal): the fastest variant on the H200 prefill
# case set beside FA4 in one process (CUDA events; docs/attention.md names the record):
#   hd64 no window: FA3 / FA4's 192-row tile with overlap and the O TMA store: GPT-OSS causal + sinks 2 x 8192 0.912x
#     FA4 (0.868x with register stores; the persistent grid does not fit 192 x 128 + overlap in 160 registers).
#   windows: the persistent grid + O TMA store: GPT-OSS hd64 64 / 8 window (128, 0) + sinks 2 x 8192 0.961x FA4
#     against 0.799x persistent alone, 0.644x one CTA per tile (192 rows 0.846x, with overlap 0.918x).
#   hd128: the persistent grid + O TMA store: Llama 32 / 8 causal 8 x 2048 1.004x (0.884x one CTA per tile),
#     4 x 4096 0.929x, 2 x 8192 0.932x, 1 x 16384 0.886x (0.914x one CTA per tile), varlen 0.836x; non-causal
#     8 x 2048 0.976x (0.895x), 1 x 16384 0.874x (0.880x). hd128 with a window takes the hd64 window rule.
FOR_CALL = {
    (64, False, False): CallRule(tile_m=192, overlap=True, o_tma=True),  # as causal
    (64, False, True): CallRule(tile_m=192, overlap=True, o_tma=True),
    (64, True, False): CallRule(persistent=True, o_tma=True),  # as causal
    (64, True, True): CallRule(persistent=True, o_tma=True),
    (128, False, False): CallRule(persistent=True, o_tma=True),
    (128, False, True): CallRule(persistent=True, o_tma=True),
    (128, True, False): CallRule(persistent=True, o_tma=True),  # as hd64
    (128, True, True): CallRule(persistent=True, o_tma=True),  # as hd64
}


def _sm_count(q) -> int:
    """SMs of q's device (an H100 SXM's 132 for host tensors: the CPU compile tests)."""
    if not q.is_cuda:
        return 132
    from triton_ops.contract.arch import device_index, sm_count

    return sm_count(device_index(q.device))


def _kernel_class():
    """Built on first use (needs nvidia-cutlass-dsl). No `from __future__ import annotations` here: the DSL
    evaluates the kernel's annotations."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.memory as memory
    import cutlass.pipeline as pipeline
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass import Float32, Int32, Int64
    from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
    from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp

    from . import wgmma

    def group(n):
        return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)

    class FmhaSm90:
        def __init__(self, cfg: FmhaSm90Config):
            self.cfg = cfg
            self.d = cfg.head_dim
            self.spec = cfg.mask
            self.stages = cfg.kv_stages
            self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
            self.wgs = cfg.consumer_warpgroups
            self.threads = 128 * (1 + self.wgs)
            self.regs_producer, self.regs_consumer = REGS[self.wgs]

        # ------------------------------------------------------------------------------------- host side

        @cute.jit
        def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                     mLSE: cute.Tensor | None, mCuQ: cute.Tensor, mCuK: cute.Tensor, mSink: cute.Tensor | None,
                     softmax_scale: Float32, window_left: Int32, window_right: Int32, max_seqlen_q: Int32,
                     stream):
            d = self.d
            dt = mQ.element_type
            self.dtype = dt
            total_q, hq = mQ.shape[0], mQ.shape[1]
            total_k, hkv = mK.shape[0], mK.shape[1]

            def seq_view(t, rows, heads):  # (tokens, D, heads): TMA boxes of (rows, D) per head
                return cute.make_tensor(t.iterator, cute.make_layout((rows, d, heads),
                                                                     stride=(t.stride[0], 1, t.stride[1])))

            q, k, v, o = seq_view(mQ, total_q, hq), seq_view(mK, total_k, hkv), seq_view(mV, total_k, hkv), \
                seq_view(mO, total_q, hq)
            qk_mma, pv_mma = self.make_mmas()
            tm, tn = self.tile_m, self.tile_n
            q_sl = wgmma.smem_layout(dt, tm, d, self.cfg.q_stages if self.cfg.persistent else None)
            k_sl = wgmma.smem_layout(dt, tn, d, self.stages)
            v_sl = wgmma.smem_layout(dt, tn, d, self.stages)
            op = cpasync.CopyBulkTensorTileG2SOp()
            q_box = cute.select(q_sl, mode=[0, 1]) if cutlass.const_expr(self.cfg.persistent) else q_sl
            tma_q, tq_ = cpasync.make_tiled_tma_atom(op, q, q_box, (tm, d))
            tma_k, tk_ = cpasync.make_tiled_tma_atom(op, k, cute.select(k_sl, mode=[0, 1]), (tn, d))
            tma_v, tv_ = cpasync.make_tiled_tma_atom(op, v, cute.select(v_sl, mode=[0, 1]), (tn, d))
            self.q_bytes = cute.size_in_bytes(dt, q_box)
            self.kv_bytes = cute.size_in_bytes(dt, cute.select(k_sl, mode=[0, 1]))
            tma_o, to_, o_sl = None, None, None
            if cutlass.const_expr(self.cfg.o_tma):  # one (64, D) box per consumer warpgroup
                o_sl = wgmma.smem_layout(dt, 64, d, self.wgs)
                tma_o, to_ = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o,
                                                         cute.select(o_sl, mode=[0, 1]), (64, d))
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
            grid = sched_mod.launch_grid(self.cfg.schedule, total_q, num_batch, hq, max_seqlen_q, tm)
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
                                                   (self.wgs, 1, 1), (64, self.d),
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
                num_stages=self.stages, producer_group=group(1), consumer_group=consumers, tx_count=self.kv_bytes,
                barrier_storage=st.k_bar.data_ptr(), defer_sync=True)
            v_pipe = pipeline.PipelineTmaAsync.create(
                num_stages=self.stages, producer_group=group(1), consumer_group=consumers, tx_count=self.kv_bytes,
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
                    b, m_block, h, valid = sched_mod.cta_tile(self.cfg.schedule, mCuQ, num_batch, hq, self.tile_m,
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
                b, m_block, h, valid = sched_mod.cta_tile(self.cfg.schedule, mCuQ, num_batch, hq, self.tile_m,
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
                gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, None, h]), (self.tile_m, self.d),
                                     (m_block, 0))
                gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, None, hk]), (self.tile_n, self.d),
                                     (None, 0))
                gV = cute.local_tile(cute.domain_offset((k_start, 0), mV[None, None, hk]), (self.tile_n, self.d),
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
            if cutlass.const_expr(self.cfg.pingpong):
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
            acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.d)), Float32)
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
                if cutlass.const_expr(self.cfg.pingpong):  # warpgroup 0 goes first: its own barrier pre-arrived
                    if cutlass.const_expr(not self.cfg.persistent):  # (persistent: once, in consume_tiles)
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
                        if cutlass.const_expr(self.cfg.pingpong):
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
                        if cutlass.const_expr(self.cfg.pingpong):
                            self.turn_wait(wg)
                        acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
                        wgmma.gemm(qk_mma, acc_s, tSrQ, tSrK[None, None, None, k_st.index], True, wait=False)
                        v_pipe.consumer_wait(v_st)
                        wgmma.gemm(pv_mma, acc_o, tOrP, tOrV[None, None, None, v_st.index], False, wait=False)
                        if cutlass.const_expr(self.cfg.pingpong):
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
                if cutlass.const_expr(self.cfg.pingpong and not self.cfg.overlap):
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
            if cutlass.const_expr(self.cfg.pingpong and pass_turn):
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
                m_new, m_safe, a = sm_mod.update_max(row_m[r], row_max, scale_log2, self.cfg.rescale_threshold,
                                                     portable)
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
            gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, None, h]), (self.tile_m, self.d),
                                 (m_block, 0))
            g_mn = wgmma.acc_mn(thr_pv.partition_C(gO))
            c_mn = wgmma.acc_mn(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.d))))
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
            one TMA store of the (64, D) box by the warpgroup's first warp. The slice is reused only after that
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
                gO = cute.local_tile(cute.domain_offset((q_start, 0), mO_tma[None, None, h]), (64, self.d), (None, 0))
                tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                with cute.arch.elect_one():  # one thread issues the store (its warp waits on its bulk group)
                    cute.copy(tma_o, tOsO[None, wg], tOgO[None, m_block * self.wgs + wg])
                    cute.arch.cp_async_bulk_commit_group()

        def o_smem_copy(self, t):
            """(stmatrix.x4 atom, thread t's slice of its tiled copy) over one warpgroup's (64, D) accumulator: the
            thread's O fragment (the same per-thread layout in the 2- or 3-warpgroup MMA) retiled as its source."""
            one_wg = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K,
                                                       OperandMajorMode.MN, Float32, (1, 1, 1), (64, self.d),
                                                       a_source=warpgroup.OperandSource.RMEM)
            st_atom = cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), self.dtype)
            return st_atom, cute.make_tiled_copy_C(st_atom, one_wg).get_slice(t % 128)

        @cute.jit
        def drain_o_store(self, t):
            """Before the CTA exits: the warpgroup's last TMA store has read its SMEM."""
            if cutlass.const_expr(self.cfg.o_tma):
                if t % 128 < 32:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)

    return FmhaSm90


@functools.cache
def kernel_class():
    return _kernel_class()


# ------------------------------------------------------------------------------------------ compile


def build(cfg: FmhaSm90Config, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options`: keep/dump flags for the SASS tests)."""
    return launch.build(kernel_class()(cfg), cfg, extra_options)


def compiled(cfg: FmhaSm90Config):
    """The TVM-FFI callable for `cfg`, through lowbit's compile cache."""
    return launch.compiled(build, cfg)


def dump(cfg: FmhaSm90Config):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    return launch.dump(build, cfg)


# ------------------------------------------------------------------------------------------ backend entry

HARDWARE_STATUS = ("runs on the H100 and the H200: the shared attention GPU tests (causal, windows, sinks, GQA, "
                   "varlen, LSE; every schedule variant) pass")
# The head dims auto takes this kernel at: the ones timed against FA4 and the Gluon kernel (docs/attention.md).
MEASURED_HEAD_DIMS = (64, 128)


def supports_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_left, window_right, sinks, return_lse) -> str | None:
    """Why `attention_prefill` below cannot take these arguments (None: it can); the triton backend's signature."""
    why = launch.check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    if why is not None:
        return why
    from .._compile import target_arch

    arch = target_arch(q.device.index)
    if not arch.startswith("sm_90"):
        return f"WGMMA kernel: needs sm_90a, device is {arch}"
    return None


def auto_skip_untimed(q, *args, **kwargs) -> str | None:
    """auto_skip of the sm_90 cute attention_prefill row: auto takes it at the head dims where it was timed faster
    than the Gluon kernel (MEASURED_HEAD_DIMS); other head dims keep the Triton kernels until timed."""
    if q.shape[-1] in MEASURED_HEAD_DIMS:
        return None
    return f"cute_ops.attention.fmha_sm90: head dim {q.shape[-1]} not timed on a GPU yet (backend='cute' runs it)"


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float | None, causal: bool, window_left: int, window_right: int, sinks,
                      return_lse: bool):
    """(out (total_q, Hq, D) in q's dtype, lse (total_q, Hq) fp32): the triton backend's signature and contract.
    lse is always computed."""
    from .._compile import target_arch

    cfg = FmhaSm90Config.for_call(q, causal, window_left, window_right, sinks, target_arch(q.device.index))
    fn = compiled(cfg) if q.shape[0] else None
    return launch.run(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, softmax_scale, window_left,
                      window_right, sinks)


def specialize_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                 softmax_scale, causal: bool, window_left: int, window_right: int, sinks,
                                 return_lse: bool):
    """A launcher prepared for this exact call signature (the dispatch table's `specialize` hook;
    launch.prepared), or None where `attention_prefill` must run."""
    from .._compile import target_arch

    if not launch.preparable(q, cu_seqlens_q, cu_seqlens_k, sinks):
        return None
    fn = compiled(FmhaSm90Config.for_call(q, causal, window_left, window_right, sinks, target_arch(q.device.index)))
    return launch.prepared(fn, attention_prefill, q, max_seqlen_q, softmax_scale, window_left, window_right)
