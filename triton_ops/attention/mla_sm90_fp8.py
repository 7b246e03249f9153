"""DeepSeek-V3.2 sparse MLA decode over the FP8 "v32" latent cache for Hopper (sm_90a) in Gluon: FlashMLA's sm90
sparse FP8 structure (a gather / dequantization partition and two compute warpgroups, Gluon's warp_specialize).
Contract: dispatch/reference/attention.py:mla_decode, the sparse "v32" calls with H = 64 or 128 query heads, Sq 1
or 2, v_dim 512 and no window (`supports_mla_decode_sparse_fp8_sm90` names what it refuses; the portable
triton_ops/attention/mla_decode.py serves the rest).

Written for Triton 3.6 (the GPU image's) Gluon API, like mla_sm90.py, whose compute schedule (the tile pair
hand-off of the row max, P over the RoPE part of the slot, the released slots) it reuses function for function;
what differs is where the key tile comes from.

Shape of the work: one CTA = BLOCK_M = 64 query rows = 64 heads of one (sequence, query), which share one index
list, x one KV split of that list (grid (H / 64, B x Sq, splits)). A cache token (v32, 656 B) is 512 E4M3 codes |
4 fp32 scales (one per 128 columns, powers of two) | 64 bf16 RoPE.

* Q (64 x 576 bf16, 72 KB) is loaded once by TMA and stays in shared memory (as two 256-column NoPE halves and the
  64-column RoPE part, as in mla_sm90.py).
* Key tile = 64 consecutive entries of the index list. The gather partition (the launch's 4 warps, the default
  partition) turns index entry -> position -> page (block_table) -> byte offset of the token; an entry < 0, past
  min(seqused_k, the table's capacity), after the query's own position (causal) or behind a page id outside
  [0, num_blocks) is unused: its loads are masked (nothing is read; the row lands as zeros, so a NaN in a slot
  no sequence writes never reaches P V) and its logit bias is -inf. Per tile it writes, into slot t % 2:
  - the RoPE part (64 x 64 bf16) by cp.async (Gluon's ampere async_copy with a pointer tensor: a true gather, zero
    filled where masked, straight into the NVMMA-swizzled tile: no registers);
  - the NoPE part dequantized: E4M3 codes by plain 16-byte loads into registers (a whole tile's codes, 64 x 512,
    are issued before the slot's empty barriers are waited on, so their latency overlaps the wait and the next
    tile's index / page loads), code x the row's fp32 scale (exact: a power of two times an E4M3 value is a bf16
    value), stored as bf16 into the two 256-column halves (warpgroup h's O columns, mla_sm90's buffers);
  - the tile's logit bias (64 fp32: 0 or -inf).
  The codes go through registers rather than a cp.async FP8 staging ring because shared memory has no room for
  one (below) and because they have to pass through registers for the dequantization anyway.
* Compute warpgroups: mla_sm90.py's pair schedule unchanged (`_qk_parts`, `_pair_softmax`, `_pair_lone`,
  `_pair_pv`, `_sum_l`, `_store_out`): warpgroup w owns tiles t = w (mod 2) (S 64 x 64 via warpgroup_mma over Q
  and the dequantized tile, NoPE 512 + RoPE 64), O split by columns (64 x 256 each), online softmax in base 2,
  the masking is the bias row added to S (no positions needed in the compute warpgroups).
* Split-KV: split j covers index entries [j x tps x 64, (j + 1) x tps x 64) (tps tiles per split) with the split
  count from static sizes only (B, Sq, H, topk: CUDA-graph safe); fp32 partials and LSEs go through decode.py's
  split reduction. One split writes bf16 directly. A row that sees no key: out 0, lse -inf.

Budgets. Shared memory: Q 72 KB + 2 slots x (64 x 576 bf16) = 144 KB -> 216 KB, + 512 B of bias, the row-max /
row-sum hand-off (1 KB) and the mbarriers: 223216 B compiled, of the 232448 an H100 / H200 CTA may use; an FP8
staging stage (64 x 656 B = 41 KB) does not fit beside them (a single bf16 slot would, but the pair schedule keeps two
tiles in flight). Registers (64 K per SM, one CTA per SM): the two compute warpgroups take COMPUTE_REGS (192)
each by setmaxnreg (O 64 x 256 fp32 = 128 per thread, S 32, the rest bookkeeping; 176 spills), the gather
partition keeps the rest (65536 - 2 x 128 x 192 = 16384 -> 120 per thread after Triton's reserve: 64 for a
tile's codes in flight, 16 for their scales, the row offsets of this tile and the next). Triton 3.6 compiles it
without spills (the compile test checks the SASS).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton.language as tl

from triton_ops._launch import cdiv, launch
from triton_ops.attention.decode import WIDE_REDUCE_ELEMS, reduce_splits, split_buffers
from triton_ops.attention.gluon_hopper import (
    GLUON_IMPORT_ERROR,
    TensorDescriptor,
    async_copy,
    cta_barrier,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma_load,
    warpgroup_mma_wait,
)
from triton_ops.attention.mla_sm90 import (
    BLOCK_M,
    HALF,
    NOPE,
    PAGE_SIZE,
    ROWS,
    TMA_WARPS,
    _pair_lone,
    _pair_pv,
    _pair_softmax,
    _qk_parts,
    _smem_layout,
    _start,
    _store_out,
    _sum_l,
    choose_splits,
)
from triton_ops.attention.prefill_sm90 import LOG2E, _version_reason, compile_gluon_sm90, sm90_gluon_reason
from triton_ops.contract.arch import device_index, sm_count
from triton_ops.contract.attention import check_mla_decode
from triton_ops.contract.kv_cache import DS_LAYOUTS, DS_ROPE

_GLUON_OK = GLUON_IMPORT_ERROR is None

OP = "mla_decode"
V32 = DS_LAYOUTS["v32"]
TILE_KEYS = PAGE_SIZE  # index entries per key tile (the compute schedule's 64-key tiles)
HEAD_COUNTS = (64, 128)
QUERY_COUNTS = (1, 2)
CODE_COLS = V32.tile  # NoPE columns per fp32 scale: one dequantization chunk
COMPUTE_REGS = 192  # registers per thread of each compute warpgroup (setmaxnreg); the gather partition keeps the rest
TILE: tl.constexpr = tl.constexpr(TILE_KEYS)
CHUNK: tl.constexpr = tl.constexpr(CODE_COLS)
# a token's 656 bytes in 16-byte units (41): byte / bf16 / fp32 offsets are this base x 16 / 8 / 4 plus a
# constant, so the compiler sees 16-byte aligned rows (16-byte vector loads and cp.async)
TOKEN16: tl.constexpr = tl.constexpr(V32.token_bytes // 16)
ROPE_AT_BF16: tl.constexpr = tl.constexpr(V32.rope_at // 2)
SCALE_AT_F32: tl.constexpr = tl.constexpr(V32.scale_at // 4)
ROPE_W: tl.constexpr = tl.constexpr(DS_ROPE)


# ------------------------------------------------------------------------------------------- gather partition


@gluon.jit
def _tile_rows(t, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, bstride16, BS: gl.constexpr,
               CAUSAL: gl.constexpr, row_layout: gl.constexpr):
    """Index entries lo + 64 t .. of the query's list: (each token's offset in 16-byte units, used). Unused: an
    entry past hi (the split's end), < 0, >= min(seqused_k, capacity) (n_valid), after the query (causal), or
    behind a page id outside [0, num_blocks); its offset is 0 (never read: every load of it is masked)."""
    e = lo + t * TILE + gl.arange(0, TILE, layout=row_layout)
    pos = gl.load(i_row + e, mask=e < hi, other=-1)
    ok = (pos >= 0) & (pos < n_valid)
    if CAUSAL:
        ok = ok & (pos <= pos_hi)
    pos = gl.where(ok, pos, 0)
    page = gl.load(bt_row + pos // BS, mask=ok, other=-1)
    ok = ok & (page >= 0) & (page < num_blocks)
    base16 = gl.where(ok, page, 0).to(gl.int64) * bstride16 + (pos % BS) * TOKEN16
    return base16, ok


@gluon.jit
def _codes(kv8, base16, ok, c: gl.constexpr, code_layout: gl.constexpr):
    """E4M3 codes of NoPE columns [128 c, 128 c + 128) as uint8 [64, 128] (16-byte loads); 0 where unused."""
    cols = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(0, code_layout))
    return gl.load(kv8 + gl.expand_dims(base16 * 16, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(ok, 1),
                   other=0)


@gluon.jit
def _dequant_store(codes, scale, dst):
    """codes x their row's scale -> bf16 into dst ([64, 128] of a NoPE half; exact: scales are powers of two)."""
    x = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 1)
    dst.store(x.to(gl.bfloat16))


@gluon.jit
def _publish(bar):
    """Make this partition's shared-memory writes visible to wgmma (async proxy) and to every warp, then arrive."""
    fence_async_shared()
    cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _gather(q_desc, qr_desc, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, q_bar, full_n, full_r, empty_n, empty_r,
            kv8, kvb, kv32, i_row, bt_row, q_row, lo, hi, n_tiles, n_valid, pos_hi, num_blocks, bstride16,
            BS: gl.constexpr, CAUSAL: gl.constexpr):
    """The gather partition: Q once (TMA), then key tile t into slot s = t % 2: the RoPE part by cp.async and the
    bias once the warpgroups are done with tile t - 2's RoPE part (which held its P), NoPE half h dequantized once
    warpgroup h is done with tile t - 2's. Tile t's codes and scales are loaded (registers) before those waits,
    tile t + 1's offsets right after."""
    code_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16 B per load, 128 columns
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 B per cp.async, 64 columns
    row_layout: gl.constexpr = gl.SliceLayout(1, code_layout)
    if n_tiles > 0:
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        for h in gl.static_range(2):
            tma_load(q_desc, [q_row, h * HALF], q_bar, q_smem.index(h))
        tma_load(qr_desc, [q_row, 2 * HALF], q_bar, qr_smem.index(0))
    base16, ok = _tile_rows(0, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, bstride16, BS, CAUSAL,
                            row_layout)
    rope_cols = gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, rope_layout))
    for t in range(n_tiles):
        s = t % 2
        ph = (t // 2 - 1) & 1
        c0, c1, c2, c3 = (_codes(kv8, base16, ok, 0, code_layout), _codes(kv8, base16, ok, 1, code_layout),
                          _codes(kv8, base16, ok, 2, code_layout), _codes(kv8, base16, ok, 3, code_layout))
        sc = kv32 + base16 * 4 + SCALE_AT_F32
        s0, s1, s2, s3 = (gl.load(sc, mask=ok, other=0.0), gl.load(sc + 1, mask=ok, other=0.0),
                          gl.load(sc + 2, mask=ok, other=0.0), gl.load(sc + 3, mask=ok, other=0.0))
        next16, next_ok = _tile_rows(t + 1, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, bstride16, BS,
                                     CAUSAL, row_layout)
        if t >= 2:
            mbarrier.wait(empty_r.index(s), ph)
        bias_smem.index(s).store(gl.where(ok, 0.0, float("-inf")))
        r_base = gl.convert_layout(base16 * 8 + ROPE_AT_BF16, gl.SliceLayout(1, rope_layout))
        r_ok = gl.convert_layout(ok, gl.SliceLayout(1, rope_layout))
        async_copy.async_copy_global_to_shared(kr_smem.index(s),
                                               kvb + gl.expand_dims(r_base, 1) + gl.expand_dims(rope_cols, 0),
                                               mask=gl.expand_dims(r_ok, 1))
        async_copy.commit_group()
        if t >= 2:
            mbarrier.wait(empty_n.index(2 * s), ph)
        _dequant_store(c0, s0, kn_smem.index(2 * s).slice(0, CHUNK, dim=1))
        _dequant_store(c1, s1, kn_smem.index(2 * s).slice(CHUNK, CHUNK, dim=1))
        _publish(full_n.index(2 * s))
        if t >= 2:
            mbarrier.wait(empty_n.index(2 * s + 1), ph)
        _dequant_store(c2, s2, kn_smem.index(2 * s + 1).slice(0, CHUNK, dim=1))
        _dequant_store(c3, s3, kn_smem.index(2 * s + 1).slice(CHUNK, CHUNK, dim=1))
        _publish(full_n.index(2 * s + 1))
        async_copy.wait_group(0)
        _publish(full_r.index(s))
        base16, ok = next16, next_ok



# ------------------------------------------------------------------------------------------- compute warpgroups


@gluon.jit
def _sparse_pair_step(a, HAS_B: gl.constexpr, W: gl.constexpr, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem,
                      bias_smem, ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, qk_scale,
                      s_layout: gl.constexpr):
    """Warpgroup W's share of the tile pair (a, a + 1) (HAS_B: tile a + 1 exists; warpgroup 1 owns it): S of its
    own tile plus the tile's bias row (-inf for unused entries), then mla_sm90's softmax hand-off and P V.
    m_i: the running max before the pair (O and l are at it); returns (O, m, l) at the pair's max."""
    ph = (a // 2) & 1  # both slots' phase in this pair
    if W == 0 or HAS_B:
        s = _qk_parts(a + W, W, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, s_layout)
        s = warpgroup_mma_wait(0, deps=(s, ))
        # the bias was written before the RoPE part's barrier (waited in _qk_parts) and is released with it
        bias = bias_smem.index(W).load(gl.SliceLayout(0, s_layout))
        s = s + gl.expand_dims(bias, 0)
        m_new, l_i, alpha = _pair_softmax(s, W, HAS_B, m_i, l_i, ml_smem, kr_smem, mx_bar, sm_bar, ph, qk_scale)
    else:
        m_new, l_i, alpha = _pair_lone(m_i, l_i, ml_smem, mx_bar, ph, s_layout)
    o, m_new = _pair_pv(o, alpha, m_new, W, HAS_B, kn_smem, kr_smem, sm_bar, empty_n, empty_r, ph)
    return o, m_new, l_i


@gluon.jit
def _sparse_compute(W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, ml_smem, q_bar, full_n, full_r,
                    mx_bar, sm_bar, fin_bar, empty_n, empty_r, n_tiles, sk, r0, b, split, qk_scale, out_ptr, lse_ptr,
                    o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
                    FINAL: gl.constexpr):
    """Compute warpgroup W: S and softmax of tiles t = W (mod 2), O columns [256 W, 256 W + 256) of every tile,
    then l summed over both warpgroups and its half of the epilogue (rows r0.. = s x H + heads)."""
    rows, _, m_i, l_i, o = _start(r0, sk, SQ, H)
    s_layout: gl.constexpr = m_i.type.layout.parent
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        for i in range(n_tiles // 2):
            o, m_i, l_i = _sparse_pair_step(2 * i, True, W, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, bias_smem,
                                            ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, qk_scale,
                                            s_layout)
        if n_tiles % 2 == 1:
            o, m_i, l_i = _sparse_pair_step(n_tiles - 1, False, W, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem,
                                            bias_smem, ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r,
                                            qk_scale, s_layout)
        l_i = _sum_l(l_i, W, ml_smem, fin_bar)
    _store_out(o, m_i, l_i, rows, W * HALF, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
               l_sp, SQ, H, FINAL, W == 0)


@gluon.jit(do_not_specialize=["num_blocks", "max_ctx", "tiles_per_split", "topk", "topk_tiles"])
def _mla_sparse_fp8_kernel(q_desc, qr_desc, kv8, kvb, kv32, bt_ptr, seq_ptr, idx_ptr, out_ptr, lse_ptr, qk_scale,
                           num_blocks, max_ctx, tiles_per_split, topk, topk_tiles, bstride16, bt_sb, i_sb, i_ss, o_sb,
                           o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
                           BS: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr, WS_REGS: gl.constexpr,
                           num_warps: gl.constexpr):
    """The gather / dequantization partition (this one, 4 warps) and the two compute warpgroups (workers)."""
    bq = gl.program_id(1)  # b x SQ + s: the (sequence, query) whose index list the CTA reads
    split = gl.program_id(2)
    b = bq // SQ
    sq_i = bq % SQ
    sk = gl.maximum(gl.load(seq_ptr + b), 0)
    lo = split * tiles_per_split * TILE
    hi = gl.minimum(lo + tiles_per_split * TILE, topk)
    # no division here: a tile count the compiler can bound lets it prove _qk_parts' opaque Q index zero for the
    # lone last tile and hoist that tile's 36 wgmma descriptors to the top (spills)
    n_tiles = gl.minimum(gl.maximum(topk_tiles - split * tiles_per_split, 0), tiles_per_split)
    # Q, key slots (NoPE half h of slot s at 2 s + h, the RoPE part later P), as in mla_sm90.py; the bias rows
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], q_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_M, ROPE_W], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [4, TILE, HALF], q_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, TILE, ROPE_W], qr_desc.layout)
    # (a rank-1 layout: indexing the leading dim leaves the rows of rank-1 layouts, as with the mbarrier arrays)
    ml_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    bias_smem = gl.allocate_shared_memory(gl.float32, [2, TILE], ml_layout)
    # (m_a, m_b of the pair, the final l of warpgroup 0, 1), each its own allocation (see mla_sm90.py)
    ml_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
               gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
               gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
               gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full_n = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    empty_n = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sm_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mx_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(4):
        mbarrier.init(full_n.index(i), count=1)
        mbarrier.init(empty_n.index(i), count=1)  # NoPE half h: only warpgroup h reads it after the owner's S
    for i in gl.static_range(2):
        mbarrier.init(full_r.index(i), count=1)
        mbarrier.init(empty_r.index(i), count=2)  # the RoPE part (later P) and the bias: both warpgroups
        mbarrier.init(sm_bar.index(i), count=1)
        mbarrier.init(mx_bar.index(i), count=1)
    mbarrier.init(fin_bar, count=2)
    bt_row = bt_ptr + b.to(gl.int64) * bt_sb
    i_row = idx_ptr + b.to(gl.int64) * i_sb + sq_i * i_ss
    r0 = sq_i * H + gl.program_id(0) * BLOCK_M  # the output rows s x H + h of _store_out
    q_row = (bq * H + gl.program_id(0) * BLOCK_M).to(gl.int32)
    n_valid = gl.minimum(sk, max_ctx)
    pos_hi = sk - SQ + sq_i  # the query's own position
    # (The argument tuples are written out: a tuple assigned to a variable turns its constexprs into tensors.)
    gl.warp_specialize([(_gather, (q_desc, qr_desc, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, q_bar, full_n,
                                   full_r, empty_n, empty_r, kv8, kvb, kv32, i_row, bt_row, q_row, lo, hi, n_tiles,
                                   n_valid, pos_hi, num_blocks, bstride16, BS, CAUSAL)),
                        (_sparse_compute, (0, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, ml_smem, q_bar, full_n,
                                           full_r, mx_bar, sm_bar, fin_bar, empty_n, empty_r, n_tiles, sk, r0, b,
                                           split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss,
                                           l_sh, l_sp, SQ, H, FINAL)),
                        (_sparse_compute, (1, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, ml_smem, q_bar, full_n,
                                           full_r, mx_bar, sm_bar, fin_bar, empty_n, empty_r, n_tiles, sk, r0, b,
                                           split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss,
                                           l_sh, l_sp, SQ, H, FINAL))],
                       [4, 4], [WS_REGS, WS_REGS])


# ------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class SparseFp8Sm90Config:
    num_splits: int  # KV splits of each (sequence, query)'s index list: the grid's third axis; 1 writes bf16
    tiles_per_split: int  # 64-entry key tiles per split (num_splits x tiles_per_split covers topk)
    compute_regs: int  # registers per thread of each compute warpgroup (setmaxnreg); the gather partition: the rest


def sparse_fp8_sm90_config(batch: int, sq: int, h: int, topk: int, sm: int | None,
                           num_splits: int = 0) -> SparseFp8Sm90Config:
    """From static sizes only (CUDA-graph safe). num_splits <= 0: mla_sm90.choose_splits over the CTAs
    (B x Sq x H / 64, one 218 KB CTA per SM) and the list's tiles; a forced count is clamped to the tiles. The
    split count is then trimmed so that no split is empty."""
    tiles = cdiv(max(topk, 1), TILE_KEYS)
    programs = batch * sq * (h // ROWS)
    splits = num_splits if num_splits > 0 else choose_splits(programs, tiles, sm)
    tps = cdiv(tiles, max(1, min(splits, tiles)))
    return SparseFp8Sm90Config(cdiv(tiles, tps), tps, COMPUTE_REGS)


# ------------------------------------------------------------------------------------------- checks


def supports_mla_decode_sparse_fp8_sm90(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale,
                                        causal, window_left, num_splits) -> str | None:
    """None when this kernel takes the call, else why not."""
    reason = sm90_gluon_reason(q)
    if reason:
        return reason
    if layout != "v32":
        return f"layout {layout!r}: this kernel reads the DeepSeek-V3.2 FP8 'v32' cache only"
    if indices is None:
        return "sparse calls only (an index list per query)"
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} is not bf16"
    bsz, sq, h, d = q.shape
    if d != V32.d or v_dim != NOPE:
        return f"D {d}, v_dim {v_dim}: this kernel is for D = {V32.d}, v_dim = {NOPE}"
    if h not in HEAD_COUNTS:
        return f"{h} query heads: this kernel takes {' or '.join(map(str, HEAD_COUNTS))} (64-row blocks of heads)"
    if sq not in QUERY_COUNTS:
        return f"{sq} queries per sequence: this kernel takes {' or '.join(map(str, QUERY_COUNTS))}"
    if int(window_left) >= 0:
        return f"window_left {window_left}: no sliding window here"
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale {softmax_scale} is not a positive finite number"
    if kv_cache.dtype not in (torch.uint8, torch.float8_e4m3fn) or kv_cache.shape[-1] != V32.token_bytes:
        return f"cache {kv_cache.dtype} {tuple(kv_cache.shape)}: expected {V32.token_bytes}-byte v32 tokens"
    if kv_cache.stride(1) != V32.token_bytes or kv_cache.stride(-1) != 1:
        return f"cache strides {kv_cache.stride()}: each block's tokens must be packed"
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "the cache base and block stride must be 16-byte aligned (16-byte gathers)"
    if bsz * sq > 65535 or bsz * sq * h >= 2**31:
        return f"batch {bsz} x {sq} queries is too large for one grid / 32-bit rows"
    return None


# ------------------------------------------------------------------------------------------- entry


@functools.lru_cache(maxsize=256)
def _consts(sq: int, h: int, bs: int, causal: bool, final: bool, compute_regs: int) -> dict:
    """The kernel's constexprs, cached per call shape (callers only read the dict)."""
    return dict(SQ=sq, H=h, BS=bs, CAUSAL=causal, FINAL=final, WS_REGS=compute_regs, num_warps=TMA_WARPS)


def _q_descriptors(q2d: torch.Tensor):
    """(Q NoPE, Q RoPE) TMA descriptors over q (rows, 576): 256-column NoPE halves, the 64-column RoPE part."""
    def desc(cols):
        return TensorDescriptor(q2d, list(q2d.shape), [q2d.stride(0), 1], [ROWS, cols], _smem_layout(ROWS, cols))

    return desc(NOPE // 2), desc(DS_ROPE)


def _cache_views(kv_cache: torch.Tensor):
    """(uint8, bf16, fp32 views of the cache's bytes, block stride in 16-byte units)."""
    c8 = kv_cache.view(torch.uint8)
    return c8, c8.view(torch.bfloat16), c8.view(torch.float32), c8.stride(0) // 16


def mla_decode(q, kv_cache, block_table, seqused_k, indices, layout: str, v_dim: int, softmax_scale: float,
               causal: bool, window_left: int, num_splits: int, cfg: SparseFp8Sm90Config | None = None):
    """(out (B, Sq, H, 512) bf16, lse (B, Sq, H) fp32); see the module docstring. num_splits <= 0 picks the split
    count from static sizes; cfg overrides the configuration."""
    check_mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal,
                     window_left, num_splits)
    reason = supports_mla_decode_sparse_fp8_sm90(q, kv_cache, block_table, seqused_k, indices, layout, v_dim,
                                                 softmax_scale, causal, window_left, num_splits)
    if reason:
        raise ValueError(f"lowbit.{OP} (sparse FP8 sm_90 Gluon): {reason}")
    bsz, sq, h, d = q.shape
    topk = indices.shape[2]
    cfg = cfg or sparse_fp8_sm90_config(bsz, sq, h, topk, sm_count(device_index(q.device)), num_splits)
    out = torch.empty(bsz, sq, h, NOPE, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, sq, h, dtype=torch.float32, device=q.device)
    o_buf, l_buf, o_sp, l_sp = split_buffers(out, lse, cfg.num_splits)
    q2d = q.reshape(bsz * sq * h, d)
    if q2d.stride(1) != 1 or (q2d.stride(0) * 2) % 16 or q2d.data_ptr() % 16:
        q2d = q2d.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    kv8, kvb, kv32, bstride16 = _cache_views(kv_cache)
    nb, bs = kv_cache.shape[:2]
    launch(_mla_sparse_fp8_kernel, (h // ROWS, bsz * sq, cfg.num_splits),
        *_q_descriptors(q2d), kv8, kvb, kv32, block_table, seqused_k, indices, o_buf, l_buf,
        float(softmax_scale) * LOG2E, nb, block_table.shape[1] * bs, cfg.tiles_per_split, topk,
        cdiv(topk, TILE_KEYS), bstride16, block_table.stride(0), indices.stride(0), indices.stride(1),
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), o_sp, l_buf.stride(0), l_buf.stride(1),
        l_buf.stride(2), l_sp,
        **_consts(sq, h, bs, bool(causal), cfg.num_splits == 1, cfg.compute_regs))
    reduce_splits(o_buf, l_buf, out, lse, WIDE_REDUCE_ELEMS)
    return out, lse


# ------------------------------------------------------------------------------------------- compile-only


def compile_sm90(sq: int = 1, h: int = 128, causal: bool = True, final: bool = False, bs: int = 64,
                 compute_regs: int = COMPUTE_REGS, any_version: bool = False):
    """Compile the kernel for sm_90a without a GPU (host tensors only describe the arguments); returns Triton's
    compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`). For tests and inspection. any_version: compile
    with a Triton other than the one the kernel is run with (3.6), as a check of the source's portability."""
    reason = _version_reason()
    if reason and not (any_version and _GLUON_OK):
        raise RuntimeError(reason)
    bsz, nb, max_pages, topk = 2, 8, 4, 256
    q = torch.empty(bsz * sq * h, V32.d, dtype=torch.bfloat16)
    kv = torch.empty(nb, bs, V32.token_bytes, dtype=torch.uint8)
    kv8, kvb, kv32, bstride16 = _cache_views(kv)
    bt = torch.empty(bsz, max_pages, dtype=torch.int32)
    seq = torch.empty(bsz, dtype=torch.int32)
    idx = torch.empty(bsz, sq, topk, dtype=torch.int32)
    out = torch.empty(bsz, sq, h, 2, NOPE)
    lse = torch.empty(bsz, sq, h, 2)
    qd, qrd = _q_descriptors(q)
    args = dict(q_desc=qd, qr_desc=qrd, kv8=kv8, kvb=kvb, kv32=kv32, bt_ptr=bt, seq_ptr=seq, idx_ptr=idx,
                out_ptr=out, lse_ptr=lse, qk_scale=0.1, num_blocks=nb, max_ctx=max_pages * bs, tiles_per_split=2,
                topk=topk, topk_tiles=topk // TILE_KEYS, bstride16=bstride16, bt_sb=max_pages, i_sb=idx.stride(0),
                i_ss=idx.stride(1),
                o_sb=out.stride(0), o_ss=out.stride(1), o_sh=out.stride(2), o_sp=out.stride(3), l_sb=lse.stride(0),
                l_ss=lse.stride(1), l_sh=lse.stride(2), l_sp=lse.stride(3))
    return compile_gluon_sm90(_mla_sparse_fp8_kernel, args, _consts(sq, h, bs, causal, final, compute_regs),
                              ("num_blocks", "max_ctx", "tiles_per_split", "topk", "topk_tiles"))
