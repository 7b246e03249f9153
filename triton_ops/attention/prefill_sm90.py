"""Varlen prefill attention forward for Hopper (sm_90a) in Gluon: a FlashAttention-3-style kernel (TMA + mbarrier
K/V ring, warpgroup MMA, online softmax in registers, P as the register A operand of the second MMA).

Contract: dispatch/reference/attention.py (`attention_varlen`), the same as triton_ops/attention/prefill.py; the
masking bounds are those of triton_ops/attention/mask.py, restated here as Gluon functions (same formulas).

Written for Triton 3.6 (the GPU image's), whose Gluon has Hopper wgmma / mbarrier / TMA; other Triton versions
are refused by `supports_attention_prefill_sm90` (the module still imports without Gluon).

Shape of the work (one CTA = BLOCK_M = 128 query rows of one (sequence, query head); 8 warps = two consumer
warpgroups of 64 rows each, laid out as one [8, 1] wgmma layout, so every row reduction stays inside a warp):

* Q (BLOCK_M x D) is loaded once by TMA into shared memory and stays there (A operand of S = Q K^T).
* K and V stream through a STAGES-deep shared-memory ring, one mbarrier per K slot and per V slot (separate, so
  S = Q K^T can start while V is still landing). The CTA is a single partition: one thread issues the TMA loads
  (all CTA threads first pass a bar.sync, so every warpgroup has retired its wgmma on the slot being refilled).
  A K slot is refilled as soon as S of its tile has been read (mid-iteration), a V slot as soon as P V of its
  tile has completed, so with 2 stages each load has about one full iteration (two 128x128xD MMAs) to land.
* Iteration t (FA3's intra-warpgroup overlap): issue S_t = Q K_t^T (async), issue O += P_{t-1} V_{t-1} (async),
  wait for S_t only, then run the softmax of tile t (mask, max, exp2, sum, P_t in bf16/fp16) while the tensor
  cores are still busy with P_{t-1} V_{t-1}; then wait for that MMA and rescale O by the new correction factor.
  P never goes through shared memory: the wgmma accumulator layout of S is, register for register, the layout of
  the A operand of the P V wgmma (the conversion is asserted trivial at compile time).
* Online softmax in the log2 domain: qk_scale = softmax_scale * log2(e), one exp2 per logit; a sink initialises
  the running max and sum (m = sink * log2(e), l = 1). Rows that see no key end with l = 0: out 0, lse -inf.
* Masking: only key tiles some row may see are visited (`_key_range`: loop bounds). Tile 0 (peeled) is always
  masked; tiles 1.. run in three loops: leading edge tiles, interior tiles (inside `_full_key_range`: no element
  mask), trailing edge tiles (sequence end, causal diagonal, window edges). Masking is a constexpr per loop, not
  a runtime branch per tile: a branch between the P V wgmma and its wait makes ptxas hoist the wait above the
  softmax, which removes the overlap (tests/test_attention_sm90.py checks the SASS for it).

Varlen with TMA: the descriptors are 2-D over the packed tensors, (total, H * D) with the tensor's row stride,
so a tile is [rows, D] at column head * D. A K/V tile that runs past the sequence's last key reads the next
sequence's rows (or TMA zero fill past the tensor end); those keys fail `k < sk` in the element mask, so their
logits are -inf and their P is exactly 0 (0 * a finite V row adds nothing; a neighbouring sequence's V holding
Inf / NaN would leak, as 0 * Inf is NaN: real activations are finite). Q rows past the sequence end are
computed and thrown away: O and lse leave through masked register stores (gl.store with a row mask), never a TMA
store, so no row of another sequence is ever written.

Grid: (num_query_blocks * Hq, B). Heads vary fastest (the Hq / Hkv query heads of a KV head run side by side and
share its K/V tiles in L2), and query blocks are taken last-first so the long causal blocks start early.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton

from triton_ops._launch import launch
from triton_ops.attention.gluon_hopper import (
    GLUON_IMPORT_ERROR,
    TensorDescriptor,
    cta_barrier,
    gl,
    gluon,
    mbarrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton_ops.attention.mask import full_key_range, key_range, visible
from triton_ops.contract.arch import arch_of

OP = "attention_prefill"
TRITON_VERSIONS = ("3.6.",)  # the Gluon API this kernel was written and compile-checked against
HEAD_DIMS = ((64, 64), (128, 128), (192, 128))  # (qk, v) head dims with a configuration (192: DeepSeek MLA prefill)
MAX_BATCH = 65535  # the batch rides the second grid axis
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@gluon.jit
def _issue_load(desc, row, col, bar, smem, pred):
    """TMA of one [rows, D] tile into `smem`, completing on `bar` (skipped, with its byte count, unless pred)."""
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma_load(desc, [row, col], bar, smem, pred=pred)


@gluon.jit
def _issue_qk_load(desc, desc2, row, col, bar, smem, smem2, pred, SPLIT: gl.constexpr):
    """A Q or K tile. SPLIT (head dim 192 = 128 + 64; TMA boxes are powers of two): its two column parts, desc at
    col and desc2 at col + desc's width, completing on one barrier."""
    if SPLIT:
        mbarrier.expect(bar, desc.block_type.nbytes + desc2.block_type.nbytes, pred=pred)
        tma_load(desc, [row, col], bar, smem, pred=pred)
        tma_load(desc2, [row, col + desc.block_type.shape[1]], bar, smem2, pred=pred)
    else:
        _issue_load(desc, row, col, bar, smem, pred)


@gluon.jit
def _qk_mma(q_smem, q2_smem, k_tile, k2_tile, acc, SPLIT: gl.constexpr):
    """S = Q K^T issued async (SPLIT: two chained wgmmas over the head dim's two parts, one accumulator)."""
    s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), acc, use_acc=False, is_async=True)
    if SPLIT:
        s = warpgroup_mma(q2_smem, k2_tile.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax_tile(s, n, m_i, l_i, q_pos, sk, qk_scale, MASK: gl.constexpr, CAUSAL: gl.constexpr,
                  WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, p_layout: gl.constexpr, DTYPE: gl.constexpr):
    """Fold the raw logits s ([BLOCK_M, BLOCK_N], keys n..n+BLOCK_N-1) into the running (m, l) (log2 units).
    Returns (P in DTYPE as the A operand of the P V wgmma, new m, new l, alpha = the factor O is rescaled by).
    MASK: apply the element mask (edge tiles). It is a constexpr on purpose: a runtime branch between the P V
    wgmma and its wait makes ptxas hoist the wait above the softmax (no overlap)."""
    BLOCK_N: gl.constexpr = s.shape[1]
    if MASK:
        k_pos = n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        ok = visible(gl.expand_dims(q_pos, 1), gl.expand_dims(k_pos, 0), sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)  # qk_scale > 0 (supports_* refuses others)
    # A row that has seen nothing yet (m = -inf) subtracts 0 instead: exp2(-inf - 0) = 0, never NaN.
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    # The wgmma accumulator layout of S holds, thread for thread, the registers of the A operand layout of the
    # P V wgmma (same warps, same 16-row atoms, k_width 2): a register-only conversion, checked here.
    p_op = gl.convert_layout(p.to(DTYPE), p_layout, assert_trivial=True)
    return p_op, m_new, l_i, alpha


@gluon.jit
def _tile_step(t, p, o, m_i, l_i, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_bars, v_bars, k_row, k_col,
               v_col, n_start, n_tiles, q_pos, sk, qk_scale, k2_desc, q2_smem, k2_smem, MASK: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, STAGES: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, SPLIT: gl.constexpr):
    """Key tile t >= 1: S_t = Q K_t^T and O += P_{t-1} V_{t-1} in flight together, the softmax of S_t under the
    second, then the rescale of O. Refills K slot t % STAGES (tile t + STAGES) once S_t is read and V slot
    (t - 1) % STAGES (tile t - 1 + STAGES) once P_{t-1} V_{t-1} is done. Returns (P_t, O, m, l)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    DTYPE: gl.constexpr = q_desc.dtype
    slot = t % STAGES
    prev = (t - 1) % STAGES
    mbarrier.wait(k_bars.index(slot), (t // STAGES) & 1)
    s_tok = _qk_mma(q_smem, q2_smem, k_smem.index(slot), k2_smem.index(slot),
                    gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), SPLIT)
    mbarrier.wait(v_bars.index(prev), ((t - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))  # S_t done; P_{t-1} V_{t-1} may still run
    cta_barrier()  # K slot `slot` is read in every warpgroup: refill it
    _issue_qk_load(k_desc, k2_desc, k_row + n_start + (t + STAGES) * BLOCK_N, k_col, k_bars.index(slot),
                   k_smem.index(slot), k2_smem.index(slot), t + STAGES < n_tiles, SPLIT)
    p_new, m_i, l_i, alpha = _softmax_tile(s, n_start + t * BLOCK_N, m_i, l_i, q_pos, sk, qk_scale, MASK, CAUSAL,
                                           WINDOW_LEFT, WINDOW_RIGHT, p_layout, DTYPE)
    # P_{t-1} is a register operand of the MMA in flight: keep it alive through the wait.
    o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    cta_barrier()  # V slot `prev` is read in every warpgroup: refill it
    _issue_load(v_desc, k_row + n_start + (t - 1 + STAGES) * BLOCK_N, v_col, v_bars.index(prev), v_smem.index(prev),
                t - 1 + STAGES < n_tiles)
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout), assert_trivial=True), 1)
    return p_new, o, m_i, l_i


@gluon.jit
def _attend(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, q_row, q_col, k_row, k_col,
            v_col, n_start, n_tiles, f_lo, f_hi, q_pos, sk, qk_scale, m_i, l_i, q2_desc, k2_desc, q2_smem, k2_smem,
            CAUSAL: gl.constexpr, WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, STAGES: gl.constexpr,
            s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, SPLIT: gl.constexpr):
    """The pipelined key loop over n_tiles >= 1 tiles from key n_start. Returns (O unnormalised, m, l)."""
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    DV: gl.constexpr = v_desc.block_type.shape[1]
    DTYPE: gl.constexpr = q_desc.dtype

    # Prologue: Q, then the first STAGES K / V tiles (as many as exist).
    _issue_qk_load(q_desc, q2_desc, q_row, q_col, q_bar, q_smem, q2_smem, True, SPLIT)
    for i in gl.static_range(STAGES):
        _issue_qk_load(k_desc, k2_desc, k_row + n_start + i * BLOCK_N, k_col, k_bars.index(i), k_smem.index(i),
                       k2_smem.index(i), i < n_tiles, SPLIT)
        _issue_load(v_desc, k_row + n_start + i * BLOCK_N, v_col, v_bars.index(i), v_smem.index(i), i < n_tiles)

    # Tile 0 (always masked: one tile): S only, there is no P V to overlap with yet.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_tok = _qk_mma(q_smem, q2_smem, k_smem.index(0), k2_smem.index(0),
                    gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), SPLIT)
    s = warpgroup_mma_wait(0, deps=(s_tok, ))
    cta_barrier()  # every warpgroup is done reading K slot 0: refill it
    _issue_qk_load(k_desc, k2_desc, k_row + n_start + STAGES * BLOCK_N, k_col, k_bars.index(0), k_smem.index(0),
                   k2_smem.index(0), STAGES < n_tiles, SPLIT)
    p, m_i, l_i, alpha = _softmax_tile(s, n_start, m_i, l_i, q_pos, sk, qk_scale, True, CAUSAL, WINDOW_LEFT,
                                       WINDOW_RIGHT, p_layout, DTYPE)
    o = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)

    # Tiles 1..n_tiles-1 in three loops, so that masking is decided per loop, not per tile: [1, t_a) and
    # [t_b, n_tiles) are edge tiles (element mask), [t_a, t_b) are seen entirely by every row (key range
    # [f_lo, f_hi)). Tile t covers keys n_start + t * BLOCK_N ...
    t_lo = gl.minimum((f_lo - n_start + BLOCK_N - 1) // BLOCK_N, n_tiles)  # f_lo >= n_start
    t_hi = gl.maximum(gl.minimum(gl.maximum(f_hi - n_start, 0) // BLOCK_N, n_tiles), t_lo)
    t_a = gl.maximum(t_lo, 1)
    t_b = gl.maximum(t_hi, t_a)
    for t in range(1, t_a):
        p, o, m_i, l_i = _tile_step(t, p, o, m_i, l_i, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_bars,
                                    v_bars, k_row, k_col, v_col, n_start, n_tiles, q_pos, sk, qk_scale, k2_desc,
                                    q2_smem, k2_smem, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, STAGES, s_layout,
                                    o_layout, p_layout, SPLIT)
    for t in range(t_a, t_b):
        p, o, m_i, l_i = _tile_step(t, p, o, m_i, l_i, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_bars,
                                    v_bars, k_row, k_col, v_col, n_start, n_tiles, q_pos, sk, qk_scale, k2_desc,
                                    q2_smem, k2_smem, False, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, STAGES, s_layout,
                                    o_layout, p_layout, SPLIT)
    for t in range(t_b, n_tiles):
        p, o, m_i, l_i = _tile_step(t, p, o, m_i, l_i, q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, k_bars,
                                    v_bars, k_row, k_col, v_col, n_start, n_tiles, q_pos, sk, qk_scale, k2_desc,
                                    q2_smem, k2_smem, True, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, STAGES, s_layout,
                                    o_layout, p_layout, SPLIT)

    # Last P V.
    last = n_tiles - 1
    mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(last % STAGES), o, is_async=True)
    o, p = warpgroup_mma_wait(0, deps=(o_tok, p))
    return o, m_i, l_i


@gluon.jit(do_not_specialize=["total_q", "total_k"])
def _attn_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_ptr, lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, total_q, total_k,
                          qk_scale, q2_desc, k2_desc, HQ: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                          WINDOW_LEFT: gl.constexpr, WINDOW_RIGHT: gl.constexpr, HAS_SINK: gl.constexpr,
                          STAGES: gl.constexpr, SPLIT_D: gl.constexpr, num_warps: gl.constexpr):
    """SPLIT_D > 0: the qk head dim is q_desc's width + SPLIT_D, read through a second pair of descriptors
    (q2_desc / k2_desc: the last SPLIT_D columns); otherwise q2_desc / k2_desc are unused."""
    SPLIT: gl.constexpr = SPLIT_D > 0
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    DQK: gl.constexpr = q_desc.block_type.shape[1] + SPLIT_D
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    DV: gl.constexpr = v_desc.block_type.shape[1]
    DTYPE: gl.constexpr = q_desc.dtype

    # wgmma layouts: 16-row atoms over all warps along M ([8, 1]: two warpgroups of 64 rows), full N per atom.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    pid = gl.program_id(0)
    b = gl.program_id(1)
    h = pid % HQ
    start_m = (gl.num_programs(0) // HQ - 1 - pid // HQ) * BLOCK_M  # last query blocks first
    kvh = h // GROUP
    # The sequence's rows, clamped into the tensors whatever cu_seqlens say (never out of bounds).
    q0 = gl.minimum(gl.maximum(gl.load(cu_q_ptr + b), 0), total_q)
    sq = gl.minimum(gl.maximum(gl.load(cu_q_ptr + b + 1) - q0, 0), total_q - q0)
    if start_m >= sq:
        return
    k0 = gl.minimum(gl.maximum(gl.load(cu_k_ptr + b), 0), total_k)
    sk = gl.minimum(gl.maximum(gl.load(cu_k_ptr + b + 1) - k0, 0), total_k - k0)

    # Key tiles: [n_start, n_start + n_tiles * BLOCK_N) covers every key some row may see; tiles inside
    # [f_lo, f_hi) are seen by every row (no element mask).
    q_pos_lo = start_m + (sk - sq)
    q_pos_hi = gl.minimum(start_m + BLOCK_M, sq) - 1 + (sk - sq)
    lo, hi = key_range(q_pos_lo, q_pos_hi, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    f_lo, f_hi = full_key_range(q_pos_lo, q_pos_hi, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    n_start = (lo // BLOCK_N) * BLOCK_N
    n_tiles = gl.where(hi > lo, (hi - n_start + BLOCK_N - 1) // BLOCK_N, 0)

    rows = gl.arange(0, BLOCK_M, layout=row_layout)
    q_pos = q_pos_lo + rows
    if HAS_SINK:
        m_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout) + gl.load(sink_ptr + h) * 1.4426950408889634
        l_i = gl.full([BLOCK_M], 1.0, gl.float32, row_layout)
    else:
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)

    DA: gl.constexpr = q_desc.block_type.shape[1]
    q_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, DA], q_desc.layout)
    k_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, DA], k_desc.layout)
    if SPLIT:
        q2_smem = gl.allocate_shared_memory(DTYPE, [BLOCK_M, SPLIT_D], q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, SPLIT_D], k2_desc.layout)
    else:
        q2_smem = q_smem
        k2_smem = k_smem
    v_smem = gl.allocate_shared_memory(DTYPE, [STAGES, BLOCK_N, DV], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    o = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)
    if n_tiles > 0:
        o, m_i, l_i = _attend(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, q0 + start_m,
                              h * DQK, k0, kvh * DQK, kvh * DV, n_start, n_tiles, f_lo, f_hi, q_pos, sk, qk_scale,
                              m_i, l_i, q2_desc, k2_desc, q2_smem, k2_smem, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, STAGES,
                              s_layout, o_layout, p_layout, SPLIT)

    # Epilogue: l = 0 only where no key (and no sink) was seen; O is 0 there too, so out = 0, lse = -inf.
    seen = l_i > 0.0
    lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    inv = gl.convert_layout(gl.where(seen, 1.0 / l_i, 0.0), gl.SliceLayout(1, o_layout), assert_trivial=True)
    out = (o * gl.expand_dims(inv, 1)).to(DTYPE)
    valid = sq - start_m
    gl.store(lse_ptr + (q0 + start_m + rows).to(gl.int64) * HQ + h, lse, mask=rows < valid)
    # O leaves through registers (16-byte vectors per thread) with a row mask: never past the sequence end.
    # (The layout change goes through shared memory that Q / K / V no longer need: no TMA is in flight here.)
    TPW_N: gl.constexpr = DV // 8
    st_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TPW_N, TPW_N], [num_warps, 1], [1, 0])
    out = gl.convert_layout(out, st_layout)
    o_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, st_layout))
    o_cols = gl.arange(0, DV, layout=gl.SliceLayout(0, st_layout))
    o_off = (q0 + start_m + o_rows).to(gl.int64) * (HQ * DV) + h * DV  # out is ours: contiguous
    gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(o_cols, 0), out,
             mask=gl.expand_dims(o_rows < valid, 1))


# ------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Sm90PrefillConfig:
    """Tiling of the sm_90 kernel (BLOCK_M = 16 * num_warps: one 16-row wgmma atom per warp)."""

    block_m: int  # query rows per CTA
    block_n: int  # keys per K / V tile
    stages: int  # depth of the K ring and of the V ring
    num_warps: int  # 8: two consumer warpgroups


@functools.lru_cache(maxsize=64)
def sm90_prefill_config(dqk: int, dv: int) -> Sm90PrefillConfig:
    """Analytical choice (not yet tuned on hardware). 128 x 128 tiles with two warpgroups, as FA3 for these head
    dims. Shared memory: Q 128 x D plus STAGES x (K + V) 128 x D tiles (the epilogue's O layout change reuses that
    space): hd 128 -> 32 + 2 x 64 = 160 KB of 227 (3 stages, 224 KB, would leave no room); hd 64 -> 16 + 3 x 32 =
    112 KB. Registers (per thread, of 255; ptxas: ~210 at hd 128, ~170 at hd 64, no spills): S 64 fp32, O Dv / 2
    fp32, P 32 (packed 16-bit) twice while the P V MMA of the previous tile overlaps the softmax of this one."""
    if (dqk, dv) == (128, 128):
        return Sm90PrefillConfig(block_m=128, block_n=128, stages=2, num_warps=8)
    if (dqk, dv) == (64, 64):
        return Sm90PrefillConfig(block_m=128, block_n=128, stages=3, num_warps=8)
    if (dqk, dv) == (192, 128):  # Q 48 KB + 2 x (K 48 + V 32) KB = 208 KB
        return Sm90PrefillConfig(block_m=128, block_n=128, stages=2, num_warps=8)
    raise ValueError(f"no sm_90 prefill configuration for head dims ({dqk}, {dv})")


@functools.lru_cache(maxsize=64)
def _smem_layout(block_rows: int, d: int, torch_dtype: torch.dtype):
    """NVMMA shared layout (128-byte swizzle at D >= 64) of a [block_rows, d] tile: TMA's and wgmma's."""
    return gl.NVMMASharedLayout.get_default_for([block_rows, d], _GL_DTYPE()[torch_dtype])


@functools.cache
def _GL_DTYPE():  # noqa: N802 - a constant, built lazily (gl may be missing)
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def _descriptor(t: torch.Tensor, block_rows: int, width: int | None = None):
    """2-D TMA descriptor over a packed (total, H, D) tensor seen as (total, H * D), tiles [block_rows, width]
    (default D; a power of two: a split head dim takes one descriptor per part)."""
    total, heads, d = t.shape
    width = width or d
    row_stride = t.stride(0) if total > 1 else heads * d  # a single row's stride is never used
    return TensorDescriptor(t, [total, heads * d], [row_stride, 1], [block_rows, width],
                            _smem_layout(block_rows, width, t.dtype))


def _qk_descriptors(q, k, cfg):
    """(q_desc, k_desc, q2_desc, k2_desc, SPLIT_D): a power-of-two qk head dim is one descriptor each (the second
    pair repeats the first, unused); 192 is 128 + 64, two column parts per tile (TMA boxes are powers of two)."""
    d = q.shape[2]
    if d & (d - 1) == 0:
        qd, kd = _descriptor(q, cfg.block_m), _descriptor(k, cfg.block_n)
        return qd, kd, qd, kd, 0
    a = 1 << (d.bit_length() - 1)
    return (_descriptor(q, cfg.block_m, a), _descriptor(k, cfg.block_n, a), _descriptor(q, cfg.block_m, d - a),
            _descriptor(k, cfg.block_n, d - a), d - a)


# ------------------------------------------------------------------------------------------- checks


@functools.cache
def _version_reason() -> str | None:
    if GLUON_IMPORT_ERROR is not None:
        return f"Gluon's Hopper API is not importable from triton {triton.__version__} ({GLUON_IMPORT_ERROR})"
    if not triton.__version__.startswith(TRITON_VERSIONS):
        return (f"written for the Gluon API of triton {' / '.join(v + 'x' for v in TRITON_VERSIONS)}; "
                f"found triton {triton.__version__}")
    return None


def require_gluon_compile(any_version: bool = False) -> None:
    """The compile-only entries' gate: this Triton's Gluon is the one the kernels are written for, or (any_version)
    at least importable, to check the source's portability to another Triton; else RuntimeError with the reason."""
    reason = _version_reason()
    if reason and not (any_version and GLUON_IMPORT_ERROR is None):
        raise RuntimeError(reason)


def sm90_gluon_reason(t: torch.Tensor) -> str | None:
    """Why a Gluon sm_90 kernel cannot run on t's device with this Triton, or None."""
    reason = _version_reason()
    if reason:
        return reason
    if t.device.type != "cuda":
        return f"needs CUDA tensors, got {t.device}"
    arch = arch_of(t.device)
    if arch != "sm_90":
        return f"written for sm_90 (Hopper wgmma / TMA), this device is {arch}"
    return None


def _tma_reason(name: str, t: torch.Tensor) -> str | None:
    """Can a 2-D (total, H * D) descriptor with [rows, D] tiles read t (total, H, D)?"""
    total, heads, d = t.shape
    if t.stride(2) != 1:
        return f"{name}: the head dim must be contiguous (stride 1), got strides {t.stride()}"
    if heads > 1 and t.stride(1) != d:
        return f"{name}: heads must be packed (stride(1) == head dim {d}) for the 2-D TMA view, got {t.stride()}"
    if total > 1 and (t.stride(0) * t.element_size()) % 16:  # (one row: `_descriptor` ignores its stride)
        return f"{name}: TMA needs 16-byte aligned row strides, got {t.stride(0)} elements"
    if t.data_ptr() % 16:
        return f"{name}: TMA needs a 16-byte aligned base address"
    return None


def supports_attention_prefill_sm90(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                    causal, window_left, window_right, sinks, return_lse) -> str | None:
    """None when the sm_90 Gluon kernel takes this call, else why not."""
    reason = sm90_gluon_reason(q)
    if reason:
        return reason
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype} is not bf16 / fp16"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"k / v dtypes ({k.dtype}, {v.dtype}) differ from q's {q.dtype}"
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return "expected packed q / k / v of 3 dims (total, heads, head dim)"
    dims = (q.shape[2], v.shape[2])
    if dims not in HEAD_DIMS or k.shape[2] != q.shape[2]:
        return f"head dims (qk {q.shape[2]}, v {v.shape[2]}) are not one of {HEAD_DIMS}"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return f"{k.shape[1]} KV heads do not divide q's {q.shape[1]} heads"
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale {softmax_scale} is not a positive finite number"
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        return "cu_seqlens must be int32"
    if int(window_left) < -1 or int(window_right) < -1:
        return f"window ({window_left}, {window_right}): each bound is -1 (unbounded) or >= 0"
    if cu_seqlens_q.shape[0] - 1 > MAX_BATCH:
        return f"batch {cu_seqlens_q.shape[0] - 1} is above {MAX_BATCH} (one grid axis)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = _tma_reason(name, t)
        if reason:
            return reason
    if sinks is not None and (sinks.device != q.device or sinks.numel() != q.shape[1]):
        return f"sinks must hold one logit per query head ({q.shape[1]},) on {q.device}"
    return None


# ------------------------------------------------------------------------------------------- entry


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float, causal: bool, window_left: int, window_right: int,
                      sinks: torch.Tensor | None, return_lse: bool, *, cfg: Sm90PrefillConfig | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen attention on sm_90 (see the module docstring): (out (total_q, Hq, Dv) in q's dtype, lse
    (total_q, Hq) fp32 natural log, sink included). The lse is always computed; return_lse is for the caller.
    Call `supports_attention_prefill_sm90` first (the dispatcher does); inputs are not re-validated here."""
    if _version_reason():
        raise RuntimeError(f"lowbit.{OP} (sm_90 Gluon): {_version_reason()}")
    total_q, hq, dqk = q.shape
    dv = v.shape[2]
    out = torch.empty((total_q, hq, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((total_q, hq), dtype=torch.float32, device=q.device)
    batch = cu_seqlens_q.shape[0] - 1
    if total_q == 0 or hq == 0 or batch <= 0 or max_seqlen_q <= 0:
        return out, lse
    cfg = cfg or sm90_prefill_config(dqk, dv)
    if k.shape[0] == 0:  # no keys anywhere (every row gives 0 / -inf or the sink); TMA needs a non-empty tensor
        k = k.new_zeros((1, *k.shape[1:]))
        v = v.new_zeros((1, *v.shape[1:]))
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()
    grid = (-(-int(max_seqlen_q) // cfg.block_m) * hq, batch)
    q_desc, k_desc, q2_desc, k2_desc, split_d = _qk_descriptors(q, k, cfg)
    launch(
        _attn_fwd_sm90_kernel, grid, q_desc, k_desc, _descriptor(v, cfg.block_n), out, lse,
        cu_seqlens_q if sinks is None else sinks, cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0],
        float(softmax_scale) * LOG2E, q2_desc, k2_desc, HQ=hq, GROUP=hq // k.shape[1], CAUSAL=bool(causal),
        WINDOW_LEFT=int(window_left), WINDOW_RIGHT=int(window_right), HAS_SINK=sinks is not None,
        STAGES=cfg.stages, SPLIT_D=split_d, num_warps=cfg.num_warps)
    return out, lse


# ------------------------------------------------------------------------------------------- compile-only


def compile_sm90(dqk: int = 128, dv: int = 128, dtype: torch.dtype = torch.bfloat16, hq: int = 8, hkv: int = 1,
                 causal: bool = True, window: tuple[int, int] = (-1, -1), sink: bool = False,
                 cfg: Sm90PrefillConfig | None = None):
    """Compile the kernel for sm_90a without a GPU (host tensors only describe the arguments); returns Triton's
    compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`). For tests and inspection."""
    require_gluon_compile()
    cfg = cfg or sm90_prefill_config(dqk, dv)
    total = 256
    q = torch.empty(total, hq, dqk, dtype=dtype)
    k = torch.empty(total, hkv, dqk, dtype=dtype)
    v = torch.empty(total, hkv, dv, dtype=dtype)
    out = torch.empty(total, hq, dv, dtype=dtype)
    lse = torch.empty(total, hq)
    cu = torch.zeros(2, dtype=torch.int32)
    q_desc, k_desc, q2_desc, k2_desc, split_d = _qk_descriptors(q, k, cfg)
    args = dict(q_desc=q_desc, k_desc=k_desc, v_desc=_descriptor(v, cfg.block_n), o_ptr=out, lse_ptr=lse,
                sink_ptr=torch.empty(hq) if sink else cu, cu_q_ptr=cu, cu_k_ptr=cu, total_q=total, total_k=total,
                qk_scale=0.1, q2_desc=q2_desc, k2_desc=k2_desc)
    consts = dict(HQ=hq, GROUP=hq // hkv, CAUSAL=causal, WINDOW_LEFT=window[0], WINDOW_RIGHT=window[1],
                  HAS_SINK=sink, STAGES=cfg.stages, SPLIT_D=split_d, num_warps=cfg.num_warps)
    return compile_gluon_sm90(_attn_fwd_sm90_kernel, args, consts, ("total_q", "total_k"))


def compile_gluon_sm90(fn, args: dict, consts: dict, unspecialized: tuple[str, ...] = ()):
    """Compile the Gluon kernel fn for sm_90a without a GPU. args: the non-constexpr arguments by name (host
    tensors and descriptors only describe them), consts: the constexprs and num_warps, unspecialized: the
    do_not_specialize int arguments (i32)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    sig = {}
    for p in fn.params:
        if p.name in consts:
            sig[p.name] = "constexpr"
        elif p.name in unspecialized:
            sig[p.name] = "i32"
        else:
            sig[p.name] = mangle_type(args[p.name])
    # As a launch specializes them: pointers 16-byte aligned (torch allocations are), the ints not (do_not_specialize).
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in args.items()
             if isinstance(v, torch.Tensor)}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=consts["num_warps"]))
