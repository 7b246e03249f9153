"""DeepSeek MLA decode over the FP8 latent caches "v32" (V3.2) and "v4" (V4) for Hopper (sm_90a) in Gluon, sparse
(an index list per query) and dense (every key below seqused_k): FlashMLA's sm90 sparse FP8 structure (a gather /
dequantization partition and two compute warpgroups, Gluon's warp_specialize). Contract:
dispatch/reference/attention.py:mla_decode, the "v32" and "v4" calls with H = 64 or 128 query heads, Sq 1 or 2,
v_dim 512 (v4 also 448) and no window (`supports_mla_decode_fp8_sm90` names what it refuses; the portable
triton_ops/attention/mla_decode.py serves the rest). The sparse and dense calls (constexpr DENSE) of both layouts
pass their GPU tests on an H200 and are timed there (docs/attention.md).

Dense = sparse with the implicit list 0 .. capacity - 1 (capacity = block_table.shape[1] x block_size): list entry
e is position e (no index list is read), masked as in sparse mode (past min(seqused_k, capacity), causal, bad page
ids). The split rule takes the capacity in place of topk (static); each split's tile count is dynamic: both
partitions take only the split's tiles below the sequence's end (and, causal, the query's position), so a 1k-token
sequence in a 128k-capacity table costs 16 tiles, and a split past the end takes none (out 0, lse -inf partials).

Written for Triton 3.6 (the GPU image's) Gluon API, like mla_sm90.py, whose compute schedule (the tile pair
hand-off of the row max, P over the RoPE part of the slot, the released slots) it reuses function for function;
what differs is where the key tile comes from. One kernel serves both layouts (constexpr V4): the compute
warpgroups differ only in whether S has a separate RoPE part; the gather partition is the layout's.

Shape of the work: one CTA = BLOCK_M = 64 query rows = 64 heads of one (sequence, query), which share one index
list, x one KV split of that list (grid (H / 64, B x Sq, splits)). A cache token:
  v32 (656 B): 512 E4M3 codes | 4 fp32 scales (one per 128 columns, powers of two) | 64 bf16 RoPE; D = 576, the
    value is the 512 NoPE columns.
  v4 (per block: block_size x 576 data bytes, then block_size x 8 scale bytes; the block padded to a multiple of
    576 bytes): 448 E4M3 codes | 64 bf16 RoPE, and 7 E8M0 scales (one per 64 columns) | 1 pad; D = 512, the value
    is the whole 512-column row, RoPE columns included (v_dim 512), or its NoPE part (448: the same O, its last 64
    columns not stored).

* Q is loaded once by TMA and stays in shared memory: v32 (64 x 576 bf16, 72 KB) as two 256-column NoPE halves and
  the 64-column RoPE part, as in mla_sm90.py; v4 (64 x 512, 64 KB) as two 256-column halves (the RoPE columns are
  half 1's last 64).
* Key tile = 64 consecutive entries of the index list. The gather partition (the launch's 4 warps, the default
  partition) turns index entry -> position -> page (block_table) -> byte offset of the token; an entry < 0, past
  min(seqused_k, the table's capacity), after the query's own position (causal) or behind a page id outside
  [0, num_blocks) is unused: its loads are masked (nothing is read; the row lands as zeros, so a NaN in a slot
  no sequence writes never reaches P V) and its logit bias is -inf. Per tile it writes, into slot t % 2:
  - the RoPE columns (64 x 64 bf16) by cp.async (Gluon's ampere async_copy with a pointer tensor: a true gather,
    zero filled where masked, straight into the NVMMA-swizzled tile: no registers): v32 into the slot's RoPE part,
    v4 into columns 192..255 of the slot's half 1;
  - the NoPE part dequantized: E4M3 codes by plain 16-byte loads into registers (a whole tile's codes, 64 x 512 or 64 x
    448, are issued before the slot's empty barriers are waited on, so their latency overlaps the wait; the index
    entries are loaded two tiles ahead and the block-table pages one tile ahead, each first used a tile later, so the
    gather loop waits on no load but the codes'), code x the row's scale (v32: the fp32 scale of 128 columns; v4: the
    E8M0 scale of 64 columns, 2^(e - 127) as the reference decodes it: e = 0 is 2^-127, 0xFF NaN; exact either way while
    the product is a normal number: a power of two times an E4M3 value is a bf16 value), stored as bf16 into the two
    256-column halves (warpgroup h's O columns, mla_sm90's buffers);
  - the tile's logit bias (64 fp32: 0 or -inf).
  The codes go through registers rather than a cp.async FP8 staging ring because shared memory has no room for
  one (below) and because they have to pass through registers for the dequantization anyway.
* Compute warpgroups: mla_sm90.py's pair schedule unchanged (`_qk_parts`, `_pair_softmax`, `_pair_lone`,
  `_pair_pv`, `_sum_l`, `_store_out`): warpgroup w owns tiles t = w (mod 2) (S 64 x 64 via warpgroup_mma over Q
  and the dequantized tile: v32 NoPE 512 + RoPE 64, v4 the two halves), O split by columns (64 x 256 each; v4's
  half 1 carries the RoPE columns into O's last 64), online softmax in base 2, the masking is the bias row added
  to S (no positions needed in the compute warpgroups). P goes over v32's RoPE part of the slot; v4 keeps a
  64 x 64 P buffer per slot in its place.
* Split-KV: split j covers index entries [j x tps x 64, (j + 1) x tps x 64) (tps tiles per split) with the split
  count from static sizes only (B, Sq, H, topk or the dense capacity: CUDA-graph safe); fp32 partials and LSEs go
  through decode.py's split reduction. One split writes bf16 directly. A row that sees no key: out 0, lse -inf.

Budgets. Shared memory (v32): Q 72 KB + 2 slots x (64 x 576 bf16) = 144 KB -> 216 KB, + 512 B of bias, the row-max
/ row-sum hand-off (1 KB) and the mbarriers: 223216 B compiled, of the 232448 an H100 / H200 CTA may use; an FP8
staging stage (64 x 656 B = 41 KB) does not fit beside them (a single bf16 slot would, but the pair schedule keeps two
tiles in flight). v4: Q 64 KB + 2 slots x 64 KB + 2 P buffers x 8 KB -> 215008 B compiled. Registers (64 K per SM,
one CTA per SM): the two compute warpgroups take COMPUTE_REGS (v32 192, v4 200) each by setmaxnreg (O 64 x 256 fp32
= 128 per thread, S 32, the rest bookkeeping; v32 spills at 176, v4 at 192), the gather partition keeps the rest
(v32: 65536 - 2 x 128 x 192 = 16384 -> 120 per thread after Triton's reserve: 64 for a tile's codes in flight, 16
for their scales, the row offsets of this tile, the next tile's pages and slots and the entries of the one after;
v4: 104, with 56 for the codes and 4 for the scale words, carrying the next tile's pages and slots rather than its
offsets). Triton 3.6 compiles both without spills
(the compile test checks the SASS). Dense v32 (a tile count from seqused_k, a per-thread value where sparse's is
uniform) spills 2-3 values per compute warpgroup, stored before the pair loop and reloaded for the lone last tile:
once per CTA, never inside the loop (the compile test bounds them); dense v4 compiles without spills.
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
from triton_ops.attention.prefill_sm90 import LOG2E, compile_gluon_sm90, require_gluon_compile, sm90_gluon_reason
from triton_ops.contract.arch import device_index, sm_count
from triton_ops.contract.attention import check_mla_decode
from triton_ops.contract.kv_cache import DS_LAYOUTS, DS_ROPE

OP = "mla_decode"
V32 = DS_LAYOUTS["v32"]
V4 = DS_LAYOUTS["v4"]
LAYOUTS = ("v32", "v4")
# value widths per layout: v32's NoPE part; v4's NoPE part (O's last 64 columns not stored) or its whole row
V_DIMS = {"v32": (NOPE,), "v4": (V4.d_nope, NOPE)}
TILE_KEYS = PAGE_SIZE  # index entries per key tile (the compute schedule's 64-key tiles)
HEAD_COUNTS = (64, 128)
QUERY_COUNTS = (1, 2)
CODE_COLS = V32.tile  # NoPE columns per fp32 scale: one dequantization chunk
# registers per thread of each compute warpgroup (setmaxnreg), per layout; the gather partition keeps the rest. v4's
# gather holds 56 registers of codes per tile (v32's 64) and 4 of scale words (v32's 16), and v4's compute
# warpgroups spill 2 values at 192 (v32's do not): 200 / 104 compile without spills on both sides
COMPUTE_REGS = {"v32": 192, "v4": 200}
TILE: tl.constexpr = tl.constexpr(TILE_KEYS)
CHUNK: tl.constexpr = tl.constexpr(CODE_COLS)
# a token's 656 bytes in 16-byte units (41): byte / bf16 / fp32 offsets are this base x 16 / 8 / 4 plus a
# constant, so the compiler sees 16-byte aligned rows (16-byte vector loads and cp.async)
TOKEN16: tl.constexpr = tl.constexpr(V32.token_bytes // 16)
ROPE_AT_BF16: tl.constexpr = tl.constexpr(V32.rope_at // 2)
SCALE_AT_F32: tl.constexpr = tl.constexpr(V32.scale_at // 4)
ROPE_W: tl.constexpr = tl.constexpr(DS_ROPE)
# v4: a token's 576 data bytes (448 codes | 64 bf16 RoPE) in 16-byte units (36: 16-byte aligned rows as above); its
# 8 scale bytes (7 E8M0 | pad) are two 32-bit words of the block's scale part, which follows the block's
# block_size x 576 data bytes
V4_DATA16: tl.constexpr = tl.constexpr((V4.d_nope + 2 * DS_ROPE) // 16)
V4_ROPE_AT_BF16: tl.constexpr = tl.constexpr(V4.rope_at // 2)
V4_CHUNK: tl.constexpr = tl.constexpr(V4.tile)  # NoPE columns per E8M0 scale


# ------------------------------------------------------------------------------------------- gather partition


@gluon.jit
def _tile_entries(t, i_row, lo, hi, DENSE: gl.constexpr, row_layout: gl.constexpr):
    """The positions of index entries lo + 64 t .. of the query's list, as loaded (-1 past hi, the split's end);
    DENSE: the implicit list 0 .. capacity - 1 (entry e is position e; i_row is not read). The gather loads them a
    tile before it loads their pages (`_tile_pages`), so neither load's latency is waited on in the loop."""
    e = lo + t * TILE + gl.arange(0, TILE, layout=row_layout)
    if DENSE:
        # hi >= 0, so pos = e; an offset the compiler cannot fold keeps it from hoisting the rows' tile-invariant
        # slot and offset parts out of the gather loop (live across it, they spill the gather's 120 registers)
        return e + (hi >> 31)
    else:
        return gl.load(i_row + e, mask=e < hi, other=-1)


@gluon.jit
def _tile_slots(t, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, BS: gl.constexpr, CAUSAL: gl.constexpr,
                DENSE: gl.constexpr, row_layout: gl.constexpr):
    """Index entries lo + 64 t .. of the query's list: (each token's page, slot in the page, used). Unused: an
    entry past hi (the split's end), < 0, >= min(seqused_k, capacity) (n_valid), after the query (causal), or
    behind a page id outside [0, num_blocks); its page and slot are 0 (never read: every load of it is masked)."""
    pos = _tile_entries(t, i_row, lo, hi, DENSE, row_layout)
    page, slot, ok = _tile_pages(pos, t, lo, hi, n_valid, pos_hi, bt_row, BS, CAUSAL, DENSE, row_layout)
    page, ok = _page_checked(page, ok, num_blocks)
    return page, slot, ok


@gluon.jit
def _tile_pages(pos, t, lo, hi, n_valid, pos_hi, bt_row, BS: gl.constexpr, CAUSAL: gl.constexpr,
                DENSE: gl.constexpr, row_layout: gl.constexpr):
    """The positions `pos` of tile t's entries -> (their page ids as loaded, slots, used so far): the block-table
    load is issued here and its value first used by `_page_checked`."""
    if DENSE:
        e = lo + t * TILE + gl.arange(0, TILE, layout=row_layout)
        ok = (e < hi) & (pos < n_valid)
    else:
        ok = (pos >= 0) & (pos < n_valid)
    if CAUSAL:
        ok = ok & (pos <= pos_hi)
    pos = gl.where(ok, pos, 0)
    return gl.load(bt_row + pos // BS, mask=ok, other=-1), pos % BS, ok


@gluon.jit
def _page_checked(page, ok, num_blocks):
    """(page, used) with page ids outside [0, num_blocks) unused (page 0: never read)."""
    ok = ok & (page >= 0) & (page < num_blocks)
    return gl.where(ok, page, 0), ok


@gluon.jit
def _tile_rows(t, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, bstride16, BS: gl.constexpr,
               CAUSAL: gl.constexpr, DENSE: gl.constexpr, row_layout: gl.constexpr):
    """v32: (each token's offset in 16-byte units, used) of `_tile_slots`' entries."""
    page, slot, ok = _tile_slots(t, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, BS, CAUSAL, DENSE,
                                 row_layout)
    return page.to(gl.int64) * bstride16 + slot * TOKEN16, ok


@gluon.jit
def _v4_offsets(page, slot, bstride16, BS: gl.constexpr):
    """v4: (the tokens' data offsets in 16-byte units, their scale words' offsets in 32-bit units) of `_tile_slots`'
    pages and slots (the block's scale part starts after its BS x 576 data bytes)."""
    block16 = page.to(gl.int64) * bstride16
    return block16 + slot * V4_DATA16, (block16 + BS * V4_DATA16) * 4 + slot * 2


@gluon.jit
def _codes(kv8, base16, ok, c: gl.constexpr, WIDTH: gl.constexpr, code_layout: gl.constexpr):
    """E4M3 codes of NoPE columns [WIDTH c, WIDTH c + WIDTH) as uint8 [64, WIDTH] (16-byte loads); 0 where
    unused."""
    cols = c * WIDTH + gl.arange(0, WIDTH, layout=gl.SliceLayout(0, code_layout))
    return gl.load(kv8 + gl.expand_dims(base16 * 16, 1) + gl.expand_dims(cols, 0), mask=gl.expand_dims(ok, 1),
                   other=0)


@gluon.jit
def _dequant_store(codes, scale, dst):
    """codes x their row's scale -> bf16 into dst ([64, width] of a NoPE half; exact: scales are powers of two)."""
    x = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scale, 1)
    dst.store(x.to(gl.bfloat16))


@gluon.jit
def _publish(bar):
    """Make this partition's shared-memory writes visible to wgmma (async proxy) and to every warp, then arrive."""
    fence_async_shared()
    cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _e8m0(word, k: gl.constexpr):
    """The fp32 scale of E8M0 byte k of a (little-endian) 32-bit scale word, decoded as the reference decodes it:
    2^(e - 127), e = 0 -> 2^-127 (an fp32 subnormal), 0xFF -> NaN."""
    e = (word >> (8 * k)) & 0xFF
    return gl.where(e == 0xFF, 0x7FC00000, gl.where(e == 0, 0x00400000, e << 23)).to(gl.float32, bitcast=True)


@gluon.jit
def _gather(q_desc, qr_desc, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, q_bar, full_n, full_r, empty_n, empty_r,
            kv8, kvb, kv32, i_row, bt_row, q_row, lo, hi, n_tiles, n_valid, pos_hi, num_blocks, bstride16,
            BS: gl.constexpr, CAUSAL: gl.constexpr, V4: gl.constexpr, DENSE: gl.constexpr):
    """The gather partition of the cache layout (V4: the v4 cache, else v32); DENSE: no index list."""
    if V4:
        _gather_v4(q_desc, q_smem, kn_smem, bias_smem, q_bar, full_n, full_r, empty_n, empty_r, kv8, kvb, kv32, i_row,
                   bt_row, q_row, lo, hi, n_tiles, n_valid, pos_hi, num_blocks, bstride16, BS, CAUSAL, DENSE)
    else:
        _gather_v32(q_desc, qr_desc, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, q_bar, full_n, full_r, empty_n,
                    empty_r, kv8, kvb, kv32, i_row, bt_row, q_row, lo, hi, n_tiles, n_valid, pos_hi, num_blocks,
                    bstride16, BS, CAUSAL, DENSE)


@gluon.jit
def _gather_v32(q_desc, qr_desc, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, q_bar, full_n, full_r, empty_n,
                empty_r, kv8, kvb, kv32, i_row, bt_row, q_row, lo, hi, n_tiles, n_valid, pos_hi, num_blocks, bstride16,
                BS: gl.constexpr, CAUSAL: gl.constexpr, DENSE: gl.constexpr):
    """The v32 gather partition: Q once (TMA), then key tile t into slot s = t % 2: the RoPE part by cp.async and the
    bias once the warpgroups are done with tile t - 2's RoPE part (which held its P), NoPE half h dequantized once
    warpgroup h is done with tile t - 2's. Tile t's codes and scales are loaded (registers) before those waits, tile
    t + 1's pages and tile t + 2's entries right after (`_tile_pages`, `_tile_entries`), tile t + 1's offsets at
    the end."""
    code_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # 16 B per load, 128 columns
    rope_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16 B per cp.async, 64 columns
    row_layout: gl.constexpr = gl.SliceLayout(1, code_layout)
    if n_tiles > 0:
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        for h in gl.static_range(2):
            tma_load(q_desc, [q_row, h * HALF], q_bar, q_smem.index(h))
        tma_load(qr_desc, [q_row, 2 * HALF], q_bar, qr_smem.index(0))
    base16, ok = _tile_rows(0, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, bstride16, BS, CAUSAL, DENSE,
                            row_layout)
    pos = _tile_entries(1, i_row, lo, hi, DENSE, row_layout)
    rope_cols = gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, rope_layout))
    for t in range(n_tiles):
        s = t % 2
        ph = (t // 2 - 1) & 1
        c0, c1, c2, c3 = (_codes(kv8, base16, ok, 0, CHUNK, code_layout),
                          _codes(kv8, base16, ok, 1, CHUNK, code_layout),
                          _codes(kv8, base16, ok, 2, CHUNK, code_layout),
                          _codes(kv8, base16, ok, 3, CHUNK, code_layout))
        sc = kv32 + base16 * 4 + SCALE_AT_F32
        s0, s1, s2, s3 = (gl.load(sc, mask=ok, other=0.0), gl.load(sc + 1, mask=ok, other=0.0),
                          gl.load(sc + 2, mask=ok, other=0.0), gl.load(sc + 3, mask=ok, other=0.0))
        # tile t + 1's pages (its entries were loaded a tile ago), tile t + 2's entries: both used a tile later
        page, slot, page_ok = _tile_pages(pos, t + 1, lo, hi, n_valid, pos_hi, bt_row, BS, CAUSAL, DENSE,
                                          row_layout)
        pos = _tile_entries(t + 2, i_row, lo, hi, DENSE, row_layout)
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
        page, ok = _page_checked(page, page_ok, num_blocks)
        base16 = page.to(gl.int64) * bstride16 + slot * TOKEN16


@gluon.jit
def _gather_v4(q_desc, q_smem, kn_smem, bias_smem, q_bar, full_n, full_r, empty_n, empty_r, kv8, kvb, kv32, i_row,
               bt_row, q_row, lo, hi, n_tiles, n_valid, pos_hi, num_blocks, bstride16, BS: gl.constexpr,
               CAUSAL: gl.constexpr, DENSE: gl.constexpr):
    """The v4 gather partition: Q once (TMA, its two 256-column halves: the RoPE columns are half 1's last 64),
    then key tile t into slot s = t % 2: the bias once the warpgroups are done with tile t - 2's P (full_r guards
    the bias alone here: there is no separate RoPE part); NoPE half 0 (E8M0 chunks 0-3) dequantized once
    warpgroup 0 is done with tile t - 2's half 0; half 1 once warpgroup 1 is done with its: chunks 4-6 dequantized
    into its columns 0..191 and the bf16 RoPE by cp.async into its columns 192..255. Tile t's codes and scale
    words are loaded (registers) before those waits, tile t + 1's pages and tile t + 2's entries right after, tile
    t + 1's page checks at the end."""
    code_layout: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # 16 B per load, 64 columns
    row_layout: gl.constexpr = gl.SliceLayout(1, code_layout)
    if n_tiles > 0:
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        for h in gl.static_range(2):
            tma_load(q_desc, [q_row, h * HALF], q_bar, q_smem.index(h))
    page, slot, ok = _tile_slots(0, i_row, lo, hi, n_valid, pos_hi, bt_row, num_blocks, BS, CAUSAL, DENSE,
                                 row_layout)
    pos = _tile_entries(1, i_row, lo, hi, DENSE, row_layout)
    rope_cols = gl.arange(0, ROPE_W, layout=gl.SliceLayout(0, code_layout))
    for t in range(n_tiles):
        s = t % 2
        ph = (t // 2 - 1) & 1
        base16, sc4 = _v4_offsets(page, slot, bstride16, BS)
        c0, c1, c2, c3, c4, c5, c6 = (_codes(kv8, base16, ok, 0, V4_CHUNK, code_layout),
                                      _codes(kv8, base16, ok, 1, V4_CHUNK, code_layout),
                                      _codes(kv8, base16, ok, 2, V4_CHUNK, code_layout),
                                      _codes(kv8, base16, ok, 3, V4_CHUNK, code_layout),
                                      _codes(kv8, base16, ok, 4, V4_CHUNK, code_layout),
                                      _codes(kv8, base16, ok, 5, V4_CHUNK, code_layout),
                                      _codes(kv8, base16, ok, 6, V4_CHUNK, code_layout))
        # (unused rows: the words are 0, so the scales are 2^-127 and the codes 0: zeros, never NaN)
        w0, w1 = gl.load(kv32 + sc4, mask=ok, other=0), gl.load(kv32 + sc4 + 1, mask=ok, other=0)
        # tile t + 1's pages (its entries were loaded a tile ago), tile t + 2's entries: both used a tile later
        page, slot, page_ok = _tile_pages(pos, t + 1, lo, hi, n_valid, pos_hi, bt_row, BS, CAUSAL, DENSE,
                                          row_layout)
        pos = _tile_entries(t + 2, i_row, lo, hi, DENSE, row_layout)
        if t >= 2:
            mbarrier.wait(empty_r.index(s), ph)
        bias_smem.index(s).store(gl.where(ok, 0.0, float("-inf")))
        _publish(full_r.index(s))
        if t >= 2:
            mbarrier.wait(empty_n.index(2 * s), ph)
        half = kn_smem.index(2 * s)
        _dequant_store(c0, _e8m0(w0, 0), half.slice(0, V4_CHUNK, dim=1))
        _dequant_store(c1, _e8m0(w0, 1), half.slice(V4_CHUNK, V4_CHUNK, dim=1))
        _dequant_store(c2, _e8m0(w0, 2), half.slice(2 * V4_CHUNK, V4_CHUNK, dim=1))
        _dequant_store(c3, _e8m0(w0, 3), half.slice(3 * V4_CHUNK, V4_CHUNK, dim=1))
        _publish(full_n.index(2 * s))
        if t >= 2:
            mbarrier.wait(empty_n.index(2 * s + 1), ph)
        half = kn_smem.index(2 * s + 1)
        async_copy.async_copy_global_to_shared(half.slice(HALF - ROPE_W, ROPE_W, dim=1),
                                               kvb + gl.expand_dims(base16 * 8 + V4_ROPE_AT_BF16, 1)
                                               + gl.expand_dims(rope_cols, 0), mask=gl.expand_dims(ok, 1))
        async_copy.commit_group()
        _dequant_store(c4, _e8m0(w1, 0), half.slice(0, V4_CHUNK, dim=1))
        _dequant_store(c5, _e8m0(w1, 1), half.slice(V4_CHUNK, V4_CHUNK, dim=1))
        _dequant_store(c6, _e8m0(w1, 2), half.slice(2 * V4_CHUNK, V4_CHUNK, dim=1))
        async_copy.wait_group(0)
        _publish(full_n.index(2 * s + 1))
        page, ok = _page_checked(page, page_ok, num_blocks)



# ------------------------------------------------------------------------------------------- compute warpgroups


@gluon.jit
def _biased_pair_step(a, HAS_B: gl.constexpr, W: gl.constexpr, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem,
                      bias_smem, ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, qk_scale,
                      ROPE_PART: gl.constexpr, s_layout: gl.constexpr):
    """Warpgroup W's share of the tile pair (a, a + 1) (HAS_B: tile a + 1 exists; warpgroup 1 owns it): S of its
    own tile (ROPE_PART: v32's separate RoPE part joins it) plus the tile's bias row (-inf for unused entries),
    then mla_sm90's softmax hand-off and P V. m_i: the running max before the pair (O and l are at it); returns
    (O, m, l) at the pair's max."""
    ph = (a // 2) & 1  # both slots' phase in this pair
    if W == 0 or HAS_B:
        s = _qk_parts(a + W, W, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, ROPE_PART, s_layout)
        s = warpgroup_mma_wait(0, deps=(s, ))
        # the bias was written before full_r's arrival (waited in _qk_parts) and is released with the P buffer
        bias = bias_smem.index(W).load(gl.SliceLayout(0, s_layout))
        s = s + gl.expand_dims(bias, 0)
        m_new, l_i, alpha = _pair_softmax(s, W, HAS_B, m_i, l_i, ml_smem, kr_smem, mx_bar, sm_bar, ph, qk_scale)
    else:
        m_new, l_i, alpha = _pair_lone(m_i, l_i, ml_smem, mx_bar, ph, s_layout)
    o, m_new = _pair_pv(o, alpha, m_new, W, HAS_B, kn_smem, kr_smem, sm_bar, empty_n, empty_r, ph)
    return o, m_new, l_i


@gluon.jit
def _fp8_compute(W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, ml_smem, q_bar, full_n, full_r,
                    mx_bar, sm_bar, fin_bar, empty_n, empty_r, n_tiles, sk, r0, b, split, qk_scale, out_ptr, lse_ptr,
                    o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
                    FINAL: gl.constexpr, ROPE_PART: gl.constexpr, DV: gl.constexpr):
    """Compute warpgroup W: S and softmax of tiles t = W (mod 2), O columns [256 W, 256 W + 256) of every tile,
    then l summed over both warpgroups and its half of the epilogue (rows r0.. = s x H + heads; the output's DV
    columns: v4's 448-column value drops O's last 64)."""
    rows, _, m_i, l_i, o = _start(r0, sk, SQ, H)
    s_layout: gl.constexpr = m_i.type.layout.parent
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        for i in range(n_tiles // 2):
            o, m_i, l_i = _biased_pair_step(2 * i, True, W, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, bias_smem,
                                            ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, qk_scale,
                                            ROPE_PART, s_layout)
        if n_tiles % 2 == 1:
            o, m_i, l_i = _biased_pair_step(n_tiles - 1, False, W, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem,
                                            bias_smem, ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r,
                                            qk_scale, ROPE_PART, s_layout)
        l_i = _sum_l(l_i, W, ml_smem, fin_bar)
    _store_out(o, m_i, l_i, rows, W * HALF, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
               l_sp, SQ, H, FINAL, W == 0, DV)


@gluon.jit
def _dense_tiles(sk, split, tiles_per_split, max_ctx, sq_i, SQ: gl.constexpr, CAUSAL: gl.constexpr):
    """A dense split's tile count: its tiles that hold a key the query can see, i.e. positions below
    min(seqused_k, capacity) and (causal) not after the query's own position sk - SQ + sq_i; 0 .. tiles_per_split
    (0: the split sees no key). Both partitions take this count, so no tile past the sequence is gathered."""
    end = gl.minimum(sk, max_ctx)
    if CAUSAL:
        end = gl.minimum(end, sk - SQ + sq_i + 1)
    used = (gl.maximum(end, 0) + TILE - 1) // TILE
    return gl.minimum(gl.maximum(used - split * tiles_per_split, 0), tiles_per_split)


@gluon.jit(do_not_specialize=["num_blocks", "max_ctx", "tiles_per_split", "topk", "topk_tiles"])
def _mla_fp8_kernel(q_desc, qr_desc, kv8, kvb, kv32, bt_ptr, seq_ptr, idx_ptr, out_ptr, lse_ptr, qk_scale,
                           num_blocks, max_ctx, tiles_per_split, topk, topk_tiles, bstride16, bt_sb, i_sb, i_ss, o_sb,
                           o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
                           BS: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr, WS_REGS: gl.constexpr,
                           V4: gl.constexpr, DV: gl.constexpr, DENSE: gl.constexpr, num_warps: gl.constexpr):
    """The gather / dequantization partition (this one, 4 warps) and the two compute warpgroups (workers). V4:
    the v4 cache (qr_desc is q_desc: Q has no separate RoPE part), else v32. DV: the output's value columns.
    DENSE: no index list (idx_ptr is not read): the list is 0 .. capacity - 1 (topk = capacity), and a split takes
    only its tiles below the sequence's end (`_dense_tiles`)."""
    bq = gl.program_id(1)  # b x SQ + s: the (sequence, query) whose index list the CTA reads
    split = gl.program_id(2)
    b = bq // SQ
    sq_i = bq % SQ
    sk = gl.maximum(gl.load(seq_ptr + b), 0)
    lo = split * tiles_per_split * TILE
    hi = gl.minimum(lo + tiles_per_split * TILE, topk)
    if DENSE:
        n_tiles = _dense_tiles(sk, split, tiles_per_split, max_ctx, sq_i, SQ, CAUSAL)
    else:
        # no division here: a tile count the compiler can bound lets it prove _qk_parts' opaque Q index zero for the
        # lone last tile and hoist that tile's 36 wgmma descriptors to the top (spills)
        n_tiles = gl.minimum(gl.maximum(topk_tiles - split * tiles_per_split, 0), tiles_per_split)
    # Q, key slots (NoPE half h of slot s at 2 s + h, the RoPE part later P), as in mla_sm90.py; the bias rows.
    # v4: Q and the key tile are two 512-column halves (RoPE in half 1's last 64 columns); kr_smem holds P only
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], q_desc.layout)
    if V4:
        qr_smem = q_smem  # unused: no separate RoPE part
    else:
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
    ROPE_PART: gl.constexpr = not V4
    # (The argument tuples are written out: a tuple assigned to a variable turns its constexprs into tensors.)
    gl.warp_specialize([(_gather, (q_desc, qr_desc, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, q_bar, full_n,
                                   full_r, empty_n, empty_r, kv8, kvb, kv32, i_row, bt_row, q_row, lo, hi, n_tiles,
                                   n_valid, pos_hi, num_blocks, bstride16, BS, CAUSAL, V4, DENSE)),
                        (_fp8_compute, (0, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, ml_smem, q_bar, full_n,
                                           full_r, mx_bar, sm_bar, fin_bar, empty_n, empty_r, n_tiles, sk, r0, b,
                                           split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss,
                                           l_sh, l_sp, SQ, H, FINAL, ROPE_PART, DV)),
                        (_fp8_compute, (1, q_smem, qr_smem, kn_smem, kr_smem, bias_smem, ml_smem, q_bar, full_n,
                                           full_r, mx_bar, sm_bar, fin_bar, empty_n, empty_r, n_tiles, sk, r0, b,
                                           split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss,
                                           l_sh, l_sp, SQ, H, FINAL, ROPE_PART, DV))],
                       [4, 4], [WS_REGS, WS_REGS])


# ------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class Fp8Sm90Config:
    num_splits: int  # KV splits of each (sequence, query)'s index list: the grid's third axis; 1 writes bf16
    tiles_per_split: int  # 64-entry key tiles per split (num_splits x tiles_per_split covers the list)
    compute_regs: int  # registers per thread of each compute warpgroup (setmaxnreg); the gather partition: the rest


def fp8_sm90_config(batch: int, sq: int, h: int, keys: int, sm: int | None, num_splits: int = 0, *,
                    layout: str) -> Fp8Sm90Config:
    """From static sizes only (CUDA-graph safe). keys: the list's length (sparse: topk; dense: the table's
    capacity, block_table.shape[1] x block_size). num_splits <= 0: mla_sm90.choose_splits over the CTAs
    (B x Sq x H / 64, one 210-218 KB CTA per SM) and the list's tiles; a forced count is clamped to the tiles. The
    split count is then trimmed so that no split of the list is empty (a dense split past its sequence's end takes
    no tile: out 0, lse -inf partials). The compute warpgroups' registers: the layout's."""
    tiles = cdiv(max(keys, 1), TILE_KEYS)
    programs = batch * sq * (h // ROWS)
    splits = num_splits if num_splits > 0 else choose_splits(programs, tiles, sm)
    tps = cdiv(tiles, max(1, min(splits, tiles)))
    return Fp8Sm90Config(cdiv(tiles, tps), tps, COMPUTE_REGS[layout])


# ------------------------------------------------------------------------------------------- checks


def supports_mla_decode_fp8_sm90(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale,
                                        causal, window_left, num_splits) -> str | None:
    """None when this kernel takes the call, else why not."""
    reason = sm90_gluon_reason(q)
    if reason:
        return reason
    if layout not in LAYOUTS:
        return f"layout {layout!r}: this kernel reads the DeepSeek FP8 caches {' and '.join(map(repr, LAYOUTS))} only"
    cache = DS_LAYOUTS[layout]
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} is not bf16"
    bsz, sq, h, d = q.shape
    if d != cache.d or v_dim not in V_DIMS[layout]:
        return (f"D {d}, v_dim {v_dim}: with layout {layout!r} this kernel is for D = {cache.d}, v_dim "
                f"{' or '.join(map(str, V_DIMS[layout]))}")
    if h not in HEAD_COUNTS:
        return f"{h} query heads: this kernel takes {' or '.join(map(str, HEAD_COUNTS))} (64-row blocks of heads)"
    if sq not in QUERY_COUNTS:
        return f"{sq} queries per sequence: this kernel takes {' or '.join(map(str, QUERY_COUNTS))}"
    if int(window_left) >= 0:
        return f"window_left {window_left}: no sliding window here"
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale {softmax_scale} is not a positive finite number"
    if kv_cache.dtype not in (torch.uint8, torch.float8_e4m3fn) or kv_cache.shape[-1] != cache.token_bytes:
        return f"cache {kv_cache.dtype} {tuple(kv_cache.shape)}: expected {cache.token_bytes}-byte {layout} tokens"
    if kv_cache.stride(1) != cache.token_bytes or kv_cache.stride(-1) != 1:
        return f"cache strides {kv_cache.stride()}: each block's tokens must be packed"
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) % 16 or kv_cache.data_ptr() % 16:
        return "the cache base and block stride must be 16-byte aligned (16-byte gathers)"
    if bsz * sq > 65535 or bsz * sq * h >= 2**31:
        return f"batch {bsz} x {sq} queries is too large for one grid / 32-bit rows"
    return None


# ------------------------------------------------------------------------------------------- entry


@functools.lru_cache(maxsize=256)
def _consts(sq: int, h: int, bs: int, causal: bool, final: bool, compute_regs: int, layout: str,
            v_dim: int, dense: bool) -> dict:
    """The kernel's constexprs, cached per call shape (callers only read the dict)."""
    return dict(SQ=sq, H=h, BS=bs, CAUSAL=causal, FINAL=final, WS_REGS=compute_regs, V4=layout == "v4", DV=v_dim,
                DENSE=dense, num_warps=TMA_WARPS)


def _q_descriptors(q2d: torch.Tensor, layout: str):
    """(Q NoPE, Q RoPE) TMA descriptors over q (rows, D): 256-column halves, then v32's 64-column RoPE part
    (v4: the halves hold the whole row; the second descriptor is the first again, unused)."""
    def desc(cols):
        return TensorDescriptor(q2d, list(q2d.shape), [q2d.stride(0), 1], [ROWS, cols], _smem_layout(ROWS, cols))

    halves = desc(NOPE // 2)
    return halves, (halves if layout == "v4" else desc(DS_ROPE))


def _cache_views(kv_cache: torch.Tensor, layout: str):
    """(uint8, bf16 views of the cache's bytes, its 32-bit view (v32: fp32 scales; v4: int32 E8M0 scale words),
    block stride in 16-byte units)."""
    c8 = kv_cache.view(torch.uint8)
    return c8, c8.view(torch.bfloat16), c8.view(torch.int32 if layout == "v4" else torch.float32), c8.stride(0) // 16


def mla_decode(q, kv_cache, block_table, seqused_k, indices, layout: str, v_dim: int, softmax_scale: float,
               causal: bool, window_left: int, num_splits: int, cfg: Fp8Sm90Config | None = None):
    """(out (B, Sq, H, v_dim) bf16, lse (B, Sq, H) fp32); see the module docstring. indices None: the dense call
    (every position below seqused_k). num_splits <= 0 picks the split count from static sizes; cfg overrides the
    configuration."""
    check_mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal,
                     window_left, num_splits)
    reason = supports_mla_decode_fp8_sm90(q, kv_cache, block_table, seqused_k, indices, layout, v_dim,
                                                 softmax_scale, causal, window_left, num_splits)
    if reason:
        raise ValueError(f"lowbit.{OP} (FP8 sm_90 Gluon): {reason}")
    bsz, sq, h, d = q.shape
    nb, bs = kv_cache.shape[:2]
    capacity = block_table.shape[1] * bs
    dense = indices is None
    # the list's length (dense: every position the table can hold); a dense call passes the table as the index
    # pointer with zero strides (never read)
    keys = capacity if dense else indices.shape[2]
    idx, i_sb, i_ss = (block_table, 0, 0) if dense else (indices, indices.stride(0), indices.stride(1))
    cfg = cfg or fp8_sm90_config(bsz, sq, h, keys, sm_count(device_index(q.device)), num_splits, layout=layout)
    out = torch.empty(bsz, sq, h, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, sq, h, dtype=torch.float32, device=q.device)
    o_buf, l_buf, o_sp, l_sp = split_buffers(out, lse, cfg.num_splits)
    q2d = q.reshape(bsz * sq * h, d)
    if q2d.stride(1) != 1 or (q2d.stride(0) * 2) % 16 or q2d.data_ptr() % 16:
        q2d = q2d.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    kv8, kvb, kv32, bstride16 = _cache_views(kv_cache, layout)
    launch(_mla_fp8_kernel, (h // ROWS, bsz * sq, cfg.num_splits),
        *_q_descriptors(q2d, layout), kv8, kvb, kv32, block_table, seqused_k, idx, o_buf, l_buf,
        float(softmax_scale) * LOG2E, nb, capacity, cfg.tiles_per_split, keys, cdiv(keys, TILE_KEYS), bstride16,
        block_table.stride(0), i_sb, i_ss, o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), o_sp,
        l_buf.stride(0), l_buf.stride(1), l_buf.stride(2), l_sp,
        **_consts(sq, h, bs, bool(causal), cfg.num_splits == 1, cfg.compute_regs, layout, v_dim, dense))
    reduce_splits(o_buf, l_buf, out, lse, WIDE_REDUCE_ELEMS)
    return out, lse


# ------------------------------------------------------------------------------------------- compile-only


def compile_sm90(sq: int = 1, h: int = 128, causal: bool = True, final: bool = False, bs: int = 64,
                 compute_regs: int | None = None, any_version: bool = False, layout: str = "v32",
                 v_dim: int = NOPE, dense: bool = False):
    """Compile the kernel for sm_90a without a GPU (host tensors only describe the arguments); returns Triton's
    compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`). For tests and inspection. any_version: compile
    with a Triton other than the one the kernel is run with (3.6), as a check of the source's portability.
    layout: "v32" or "v4" (a cache shaped as FlashMLA allocates it: v4 blocks padded to a multiple of 576 bytes);
    compute_regs: the layout's COMPUTE_REGS unless given; v_dim: one of the layout's V_DIMS; dense: the call without
    an index list (the list is the table's capacity)."""
    require_gluon_compile(any_version)
    bsz, nb, max_pages, topk = 2, 8, 4, 256
    cache = DS_LAYOUTS[layout]
    q = torch.empty(bsz * sq * h, cache.d, dtype=torch.bfloat16)
    blocks = torch.empty(nb, cache.padded_block_bytes(bs), dtype=torch.uint8)
    kv = blocks[:, : bs * cache.token_bytes].view(nb, bs, cache.token_bytes)
    kv8, kvb, kv32, bstride16 = _cache_views(kv, layout)
    bt = torch.empty(bsz, max_pages, dtype=torch.int32)
    seq = torch.empty(bsz, dtype=torch.int32)
    idx = torch.empty(bsz, sq, topk, dtype=torch.int32)
    out = torch.empty(bsz, sq, h, 2, v_dim)
    lse = torch.empty(bsz, sq, h, 2)
    qd, qrd = _q_descriptors(q, layout)
    args = dict(q_desc=qd, qr_desc=qrd, kv8=kv8, kvb=kvb, kv32=kv32, bt_ptr=bt, seq_ptr=seq, idx_ptr=idx,
                out_ptr=out, lse_ptr=lse, qk_scale=0.1, num_blocks=nb, max_ctx=max_pages * bs, tiles_per_split=2,
                topk=topk, topk_tiles=topk // TILE_KEYS, bstride16=bstride16, bt_sb=max_pages, i_sb=idx.stride(0),
                i_ss=idx.stride(1),
                o_sb=out.stride(0), o_ss=out.stride(1), o_sh=out.stride(2), o_sp=out.stride(3), l_sb=lse.stride(0),
                l_ss=lse.stride(1), l_sh=lse.stride(2), l_sp=lse.stride(3))
    regs = COMPUTE_REGS[layout] if compute_regs is None else compute_regs
    return compile_gluon_sm90(_mla_fp8_kernel, args, _consts(sq, h, bs, causal, final, regs, layout, v_dim, dense),
                              ("num_blocks", "max_ctx", "tiles_per_split", "topk", "topk_tiles"))
