"""DeepSeek MLA decode for Hopper (sm_90a) in Gluon: bf16 dense latent cache, TMA page tiles, warpgroup MMA,
FlashMLA's sm90 structure (a TMA partition and two compute warpgroups, Gluon's warp_specialize).
Contract: dispatch/reference/attention.py:mla_decode (the bf16-layout dense calls of it; triton_ops/attention/
mla_decode.py serves the rest: FP8 layouts, sparse index lists, sliding windows, other widths).

Written for Triton 3.6 (the GPU image's) Gluon API, like prefill_sm90.py (whose version gate it shares); other
Triton versions are refused by `supports_mla_decode_sm90` (the module still imports without Gluon).

Shape of the work: one CTA = BLOCK_M = 64 query rows x one sequence x one KV split. Rows are the packed
(query, head) pairs r = s * H + h of the sequence (Sq 1..8 folds into M: with H = 128 and Sq = 2, four row
blocks), read by TMA from q seen as (B * Sq * H, 576).

* Q (64 x 576 bf16, 72 KB) is loaded once by TMA and stays in shared memory (the A operand of S = Q K^T), as two
  256-column NoPE halves and a 64-column RoPE part (TMA boxes and register tiles are powers of two).
* Key tile = one cache page (64 tokens x 576), at row page * 64 of the cache seen as (num_blocks * 64, 576). The
  value tile is the NoPE part of the same buffer: one load serves both MMAs. Two slots (tile t in slot t % 2).
* The TMA partition (4 warps, 24 registers) loads Q, then tile t in three parts with their own full / empty
  mbarriers: NoPE half h (256 columns: warpgroup h's O columns, so after the owner's S only warpgroup h reads it
  and releases it alone) and the RoPE part (released by both), each as soon as the warpgroups are done with that
  part of tile t - 2.
* Compute warpgroup w (240 registers each, setmaxnreg) owns the tiles t = w (mod 2): their whole S (64 x 64,
  wgmma 64x64, issued part by part as the parts land) and softmax, while O stays split by columns (each warpgroup
  64 x 256 over every tile). Tiles go in pairs (a, a + 1), a even (FlashMLA's hand-off): both warpgroups issue S
  of their own tile of the pair at once; only the row max crosses between the softmaxes: warpgroup 0 publishes
  m_a = max(m, rowmax S_a) (an mbarrier of its own) as soon as it has it, warpgroup 1 folds it into m_b and
  publishes m_b, while warpgroup 0 takes its exponentials against m_a and then rescales P_a to m_b before
  publishing it; both P of the pair are then at m_b, so each warpgroup rescales its O once per pair and issues
  P_a V_a and P_b V_b back to back. P_t (bf16) is written over the RoPE part of tile t's slot (free once S_t is
  done: no extra P buffer, so Q + 2 tiles = 217 KB). Each warpgroup sums l over its own tiles only; the two sums
  (both at the final max) are added once, after the last tile. Every MMA retires inside its pair step (no wgmma
  in flight across a loop's back edge: ptxas would serialize every wgmma of the kernel, which the compile test
  checks).
* Masking: page ids outside [0, num_blocks) load from row num_blocks * 64, past the TMA view's end: the tile is
  zero filled (never read out of bounds) and its keys are masked. Keys past the sequence length in its last page
  are masked, and (cache slots no sequence writes may hold anything, NaN included: 0 x NaN would leak into
  P V) that page's rows past the length are zeroed in shared memory before their P V. Causal among the Sq
  queries: query s sits at position seqused_k - Sq + s, also when seqused_k passes the table's capacity (the keys
  past it are masked: no tile beyond the capacity is loaded).
* Split-KV: grid (row blocks, B, num_splits), num_splits from static sizes only (CUDA-graph safe); split j covers
  pages [j x pps, (j + 1) x pps) of the table's capacity; fp32 partials and LSEs go through decode.py's split
  reduction. One split writes bf16 directly.
* Online softmax in the log2 domain (qk_scale = softmax_scale * log2 e); a row that sees no key ends with l = 0:
  out 0, lse -inf.
"""

from __future__ import annotations

import functools
import math

import torch
import triton.language as tl

from triton_ops._launch import launch
from triton_ops.attention.decode import MAX_Q, WIDE_REDUCE_ELEMS, reduce_splits, split_buffers
from triton_ops.attention.gluon_hopper import (
    TensorDescriptor,
    cta_barrier,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton_ops.attention.mask import key_range
from triton_ops.attention.prefill_sm90 import LOG2E, compile_gluon_sm90, require_gluon_compile, sm90_gluon_reason
from triton_ops.contract.arch import device_index, sm_count
from triton_ops.contract.attention import check_mla_decode
from triton_ops.contract.kv_cache import DS_ROPE

OP = "mla_decode"
PAGE_SIZE = 64  # tokens per cache page = keys per tile
ROWS = 64  # query rows per CTA
NOPE = 512  # the latent row: NoPE (= the value) + DS_ROPE RoPE columns
TMA_WARPS = 4  # the launch's num_warps: the TMA partition's; the two compute warpgroups are worker partitions
PAGE: tl.constexpr = tl.constexpr(PAGE_SIZE)
BLOCK_M: tl.constexpr = tl.constexpr(ROWS)
D_NOPE: tl.constexpr = tl.constexpr(NOPE)
HALF: tl.constexpr = tl.constexpr(NOPE // 2)
ROPE_W: tl.constexpr = tl.constexpr(DS_ROPE)
# Registers per thread of each compute warpgroup (setmaxnreg): 12 warps at launch hold 168 each; the TMA
# partition keeps the rest (24).
WS_REGS: tl.constexpr = tl.constexpr(240)
MAX_SPLITS = 64
MIN_SPLIT_PAGES = 4  # below 256 keys a split no longer pays for its partials and the merge


@gluon.jit
def _zero_rows_from(kn_smem, valid):
    """Zero rows valid.. of a [PAGE, width] value tile in shared memory (64 columns at a time; the calling
    warpgroup's 4 warps), then make the stores visible to the async proxy (wgmma) and to every warp."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, PAGE, layout=gl.SliceLayout(1, blk))
    keep = gl.expand_dims(rows < valid, 1)
    for c in gl.static_range(kn_smem.shape[1] // 64):
        part = kn_smem.slice(c * 64, 64, dim=1)
        x = part.load(blk)
        part.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()
    cta_barrier()


@gluon.jit
def _mask_tile(s, k0, lo, hi, page_ok, q_pos, CAUSAL: gl.constexpr):
    """The raw logits s of keys k0..k0+63 with the keys outside [lo, hi), of a bad page or (causal) after the row's
    query set to -inf."""
    k_pos = k0 + gl.arange(0, PAGE, layout=gl.SliceLayout(0, s.type.layout))
    ok = gl.expand_dims((k_pos >= lo) & (k_pos < hi) & page_ok, 0)
    if CAUSAL:
        ok = ok & (gl.expand_dims(k_pos, 0) <= gl.expand_dims(q_pos, 1))
    return gl.where(ok, s, float("-inf"))


@gluon.jit
def _nz(m):
    """m with -inf (a row that has seen no key yet) as 0, for exponents: exp2(-inf - 0) = 0, never NaN."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _scale_rows(o, f):
    """O with row r multiplied by f[r] (f in the row slice of S's wgmma layout: a register-only conversion)."""
    return o * gl.expand_dims(gl.convert_layout(f, gl.SliceLayout(1, o.type.layout), assert_trivial=True), 1)
@gluon.jit
def _store_out(o, m_i, l_i, rows, col0, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
               SQ: gl.constexpr, H: gl.constexpr, FINAL: gl.constexpr, LSE: gl.constexpr, DV: gl.constexpr):
    """Epilogue: O / l into columns col0.. of the output (bf16 when FINAL, else the fp32 split partial) and (LSE)
    the log-sum-exp; l = 0 where no key was seen (O is 0 there too): out 0, lse -inf. Stores straight from the
    wgmma layout with a row mask (rows past Sq * H belong to the next sequence, or nothing) and, where the output
    has fewer than 512 columns (DV), a column mask."""
    o_layout: gl.constexpr = o.type.layout
    seen = l_i > 0.0
    inv = gl.convert_layout(gl.where(seen, 1.0 / l_i, 0.0), gl.SliceLayout(1, o_layout), assert_trivial=True)
    o = o * gl.expand_dims(inv, 1)
    o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout), assert_trivial=True)
    o_cols = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o_layout))
    o_off = (b.to(gl.int64) * o_sb + (o_rows // H) * o_ss + (o_rows % H) * o_sh + split * o_sp)
    o_ptrs = out_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(o_cols, 0)
    o_mask = gl.expand_dims(o_rows < SQ * H, 1)
    if DV < 2 * HALF:
        o_mask = o_mask & gl.expand_dims(o_cols < DV, 0)
    if FINAL:
        gl.store(o_ptrs, o.to(gl.bfloat16), mask=o_mask)
    else:
        gl.store(o_ptrs, o, mask=o_mask)
    if LSE:
        lse = gl.where(seen, (m_i + gl.log2(gl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(lse_ptr + b.to(gl.int64) * l_sb + (rows // H) * l_ss + (rows % H) * l_sh + split * l_sp, lse,
                 mask=rows < SQ * H)


@gluon.jit
def _key_span(seq_ptr, b, split, r0, pages_per_split, max_pages, SQ: gl.constexpr, H: gl.constexpr,
              CAUSAL: gl.constexpr):
    """Sequence b's length sk and the keys [lo, hi) that row block r0.. of split `split` sees: tiles p0.. (n).
    The queries sit at sk - SQ + s even when sk passes the table's capacity; the keys past it are masked (hi)."""
    sk = gl.maximum(gl.load(seq_ptr + b), 0)
    s_lo = r0 // H
    s_hi = gl.minimum((r0 + BLOCK_M - 1) // H, SQ - 1)
    lo, hi = key_range(sk - SQ + s_lo, sk - SQ + s_hi, sk, CAUSAL, -1, -1)
    hi = gl.minimum(hi, max_pages * PAGE)
    lo = gl.maximum(lo, split * pages_per_split * PAGE)
    hi = gl.minimum(hi, (split + 1) * pages_per_split * PAGE)
    p0 = lo // PAGE
    return sk, lo, hi, p0, gl.where(hi > lo, (hi + PAGE - 1) // PAGE - p0, 0)




# ------------------------------------------------------------------------------------------- partitions


@gluon.jit
def _producer(q_desc, qr_desc, kn_desc, kr_desc, q_smem, qr_smem, kn_smem, kr_smem, q_bar, full_n, full_r, empty_n,
              empty_r, bt_row, q_row, p0, n_tiles, num_blocks):
    """The TMA partition: Q once, then key tile t into slot s = t % 2 in three parts, each as soon as the
    warpgroups are done with that part of tile t - 2: the NoPE half h = s (warpgroup s's O columns: free when
    warpgroup s is done with the tile), the other half, the RoPE part (which held P: free when both are done)."""
    if n_tiles > 0:
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        for h in gl.static_range(2):
            tma_load(q_desc, [q_row, h * HALF], q_bar, q_smem.index(h))
        tma_load(qr_desc, [q_row, D_NOPE], q_bar, qr_smem.index(0))
    for t in range(n_tiles):
        s = t % 2
        page = gl.load(bt_row + p0 + t)
        row = gl.where((page >= 0) & (page < num_blocks), page, num_blocks) * PAGE  # past the end: zero fill
        for k in gl.static_range(2):
            h = s * (1 - k) + (1 - s) * k  # the owner's half first
            if t >= 2:
                mbarrier.wait(empty_n.index(2 * s + h), (t // 2 - 1) & 1)
            mbarrier.expect(full_n.index(2 * s + h), kn_desc.block_type.nbytes)
            tma_load(kn_desc, [row, h * HALF], full_n.index(2 * s + h), kn_smem.index(2 * s + h))
        if t >= 2:
            mbarrier.wait(empty_r.index(s), (t // 2 - 1) & 1)
        mbarrier.expect(full_r.index(s), kr_desc.block_type.nbytes)
        tma_load(kr_desc, [row, D_NOPE], full_r.index(s), kr_smem.index(s))


@gluon.jit
def _release(o, slot, empty_n, empty_r, W: gl.constexpr):
    """Wait for every MMA of warpgroup W, then release its NoPE half of buffer `slot` and its share of the RoPE
    part (one arrival each for the four warps)."""
    o = warpgroup_mma_wait(0, deps=(o, ))
    _free(slot, empty_n, empty_r, W)
    return o


@gluon.jit
def _free(slot, empty_n, empty_r, W: gl.constexpr):
    """`_release` after the caller's own wait for the MMAs that read buffer `slot`."""
    cta_barrier()
    mbarrier.arrive(empty_n.index(2 * slot + W))
    mbarrier.arrive(empty_r.index(slot))


@gluon.jit
def _issue_s(t, W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, p0, sk, s_layout: gl.constexpr):
    """Warpgroup W's own tile t (slot W): the sequence's last page first has its rows past sk zeroed (before any
    P V reads them), then `_qk_parts`. Returns S's token (async)."""
    k0 = (p0 + t) * PAGE
    if k0 + PAGE > sk:  # the sequence's last page: its rows past sk are zeroed before any P V
        for h in gl.static_range(2):
            mbarrier.wait(full_n.index(2 * W + h), (t // 2) & 1)
        _zero_rows_from(kn_smem.index(2 * W), sk - k0)
        _zero_rows_from(kn_smem.index(2 * W + 1), sk - k0)
    return _qk_parts(t, W, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, True, s_layout)


@gluon.jit
def _qk_parts(t, W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, ROPE_PART: gl.constexpr,
              s_layout: gl.constexpr):
    """Warpgroup W's own tile t (slot W): issue S_t = Q K_t^T part by part as the parts land (the own NoPE half
    first, then the other, then the RoPE part). ROPE_PART False (a 512-column key whose two halves hold the whole
    row, RoPE included: mla_sm90_fp8.py's v4 cache): S is the two halves; full_r is still waited, since what the
    caller reads after S (that kernel's bias row) is published with it. Returns S's token (async)."""
    ph = (t // 2) & 1
    # The buffer indices' offset qz = t >> 30 (0) is opaque to the compiler: the Q and key descriptors are
    # rebuilt per tile instead of being hoisted out of the loop (36 64-bit values per tile: spills)
    qz = t >> 30
    s = gl.zeros([BLOCK_M, PAGE], gl.float32, s_layout)
    for k in gl.static_range(2):  # the own half first
        hk = (W + k) % 2
        mbarrier.wait(full_n.index(2 * W + hk), ph)
        s = warpgroup_mma(q_smem.index(hk + qz), kn_smem.index(2 * W + hk + qz).permute((1, 0)), s,
                          use_acc=k > 0, is_async=True)
    mbarrier.wait(full_r.index(W), ph)
    if ROPE_PART:
        s = warpgroup_mma(qr_smem.index(qz), kr_smem.index(W + qz).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _start(r0, sk, SQ: gl.constexpr, H: gl.constexpr):
    """A compute warpgroup's start: (its rows r0.., their query positions, m = -inf, l = 0, O = 0 (64 x 256)) in
    the wgmma layouts of one warpgroup (S 64 x 64, O 64 x 256); m's layout is a slice of S's."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PAGE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = r0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)
    return rows, sk - SQ + rows // H, m_i, l_i, gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)


@gluon.jit
def _pair_step(a, HAS_B: gl.constexpr, W: gl.constexpr, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, ml_smem,
               full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks, lo, hi, sk, q_pos, qk_scale,
               CAUSAL: gl.constexpr, s_layout: gl.constexpr):
    """Warpgroup W's share of the tile pair (a, a + 1) (HAS_B: tile a + 1 exists; warpgroup 1 owns it): S of its
    own tile, masked (`_mask_tile`), then `_pair_softmax` (or `_pair_lone`) and `_pair_pv`. m_i: the running max
    before the pair (O and l are at it); returns (O, m, l) at the pair's max."""
    ph = (a // 2) & 1  # both slots' phase in this pair
    if W == 0 or HAS_B:
        t = a + W
        k0 = (p0 + t) * PAGE
        s = _issue_s(t, W, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, p0, sk, s_layout)
        page = gl.load(bt_row + p0 + t)
        s = warpgroup_mma_wait(0, deps=(s, ))
        s = _mask_tile(s, k0, lo, hi, (page >= 0) & (page < num_blocks), q_pos, CAUSAL)
        m_new, l_i, alpha = _pair_softmax(s, W, HAS_B, m_i, l_i, ml_smem, kr_smem, mx_bar, sm_bar, ph, qk_scale)
    else:
        m_new, l_i, alpha = _pair_lone(m_i, l_i, ml_smem, mx_bar, ph, s_layout)
    o, m_new = _pair_pv(o, alpha, m_new, W, HAS_B, kn_smem, kr_smem, sm_bar, empty_n, empty_r, ph)
    return o, m_new, l_i


@gluon.jit
def _pair_softmax(s, W: gl.constexpr, HAS_B: gl.constexpr, m_i, l_i, ml_smem, kr_smem, mx_bar, sm_bar, ph, qk_scale):
    """The softmax of warpgroup W's own tile of the pair (masked raw logits s). Only the row max crosses between
    the softmaxes: warpgroup 0 publishes m_a = max(m_i, rowmax S_a) as soon as it has it, warpgroup 1 folds it
    into m_b, publishes m_b; warpgroup 0 then rescales its P_a (exponentials already taken against m_a) to m_b
    before publishing it, so both P of the pair are at m_b. l: each warpgroup sums its own tiles only
    (reconciled at the end). P (bf16) goes over the RoPE part of the own slot. Returns (m, l, alpha = the factor
    O is rescaled by)."""
    row_layout: gl.constexpr = m_i.type.layout
    m_own = gl.max(s, 1) * qk_scale
    if W == 0:
        m_a = gl.maximum(m_i, m_own)
        ml_smem[0].store(m_a)
        cta_barrier()
        mbarrier.arrive(mx_bar.index(0))  # m_a: warpgroup 1's softmax needs no more than this
        p = gl.exp2(s * qk_scale - gl.expand_dims(_nz(m_a), 1))
        rs = gl.sum(p, 1)
        if HAS_B:
            mbarrier.wait(mx_bar.index(1), ph)
            m_new = ml_smem[1].load(row_layout)
            c = gl.exp2(m_a - _nz(m_new))  # P_a from m_a to the pair's max
            p = p * gl.expand_dims(c, 1)
            rs = rs * c
        else:
            m_new = m_a
    else:
        mbarrier.wait(mx_bar.index(0), ph)
        m_new = gl.maximum(ml_smem[0].load(row_layout), m_own)
        ml_smem[1].store(m_new)
        cta_barrier()
        mbarrier.arrive(mx_bar.index(1))
        p = gl.exp2(s * qk_scale - gl.expand_dims(_nz(m_new), 1))
        rs = gl.sum(p, 1)
    alpha = gl.exp2(m_i - _nz(m_new))
    l_i = l_i * alpha + rs
    kr_smem.index(W).store(p.to(gl.bfloat16))  # P over the RoPE part of the own tile (its S is done)
    fence_async_shared()
    cta_barrier()
    mbarrier.arrive(sm_bar.index(W))
    return m_new, l_i, alpha


@gluon.jit
def _pair_lone(m_i, l_i, ml_smem, mx_bar, ph, s_layout: gl.constexpr):
    """Warpgroup 1 with a lone last tile a (warpgroup 0's): O and l to m_a. Returns (m, l, alpha)."""
    mbarrier.wait(mx_bar.index(0), ph)
    m_new = ml_smem[0].load(gl.SliceLayout(1, s_layout))
    alpha = gl.exp2(m_i - _nz(m_new))
    return m_new, l_i * alpha, alpha


@gluon.jit
def _pair_pv(o, alpha, m_new, W: gl.constexpr, HAS_B: gl.constexpr, kn_smem, kr_smem, sm_bar, empty_n, empty_r, ph):
    """O rescaled by alpha, then P_a V_a and P_b V_b on warpgroup W's 256 columns, back to back (P from shared
    memory); each slot released once its MMA is done. Returns (O, m) (m passes the wait that releases slot 0).
    """
    o = _scale_rows(o, alpha)
    if W == 1:
        mbarrier.wait(sm_bar.index(0), ph)
    o = warpgroup_mma(kr_smem.index(0), kn_smem.index(W), o, is_async=True)
    if HAS_B:
        if W == 0:
            mbarrier.wait(sm_bar.index(1), ph)
        o = warpgroup_mma(kr_smem.index(1), kn_smem.index(2 + W), o, is_async=True)
        # P_a V_a done (O itself stays untouched while P_b V_b runs): slot 0 is free for tile a + 2
        m_new = warpgroup_mma_wait(1, deps=(m_new, ))
        _free(0, empty_n, empty_r, W)
        o = _release(o, 1, empty_n, empty_r, W)
    else:
        o = _release(o, 0, empty_n, empty_r, W)
    return o, m_new


@gluon.jit
def _sum_l(l_i, W: gl.constexpr, ml_smem, fin_bar):
    """Both warpgroups' l (each over its own tiles, both at the final max): the row sum is theirs added."""
    ml_smem[2 + W].store(l_i)
    cta_barrier()
    mbarrier.arrive(fin_bar)
    mbarrier.wait(fin_bar, 0)
    return l_i + ml_smem[3 - W].load(l_i.type.layout)


@gluon.jit
def _compute(W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, mx_bar, sm_bar,
             fin_bar, empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0, b, split, qk_scale, out_ptr,
             lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
             CAUSAL: gl.constexpr, FINAL: gl.constexpr):
    """Compute warpgroup W: S and softmax of tiles t = W (mod 2), O columns [256 W, 256 W + 256) of every tile
    (`_pair_step` per tile pair), then l summed over both warpgroups and its half of the epilogue."""
    rows, q_pos, m_i, l_i, o = _start(r0, sk, SQ, H)
    s_layout: gl.constexpr = m_i.type.layout.parent
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        for i in range(n_tiles // 2):
            o, m_i, l_i = _pair_step(2 * i, True, W, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, full_n,
                                     full_r, mx_bar, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks, lo, hi, sk,
                                     q_pos, qk_scale, CAUSAL, s_layout)
        if n_tiles % 2 == 1:
            o, m_i, l_i = _pair_step(n_tiles - 1, False, W, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, ml_smem,
                                     full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks, lo, hi,
                                     sk, q_pos, qk_scale, CAUSAL, s_layout)
        l_i = _sum_l(l_i, W, ml_smem, fin_bar)
    # Epilogue: this warpgroup's 256 columns; warpgroup 0 writes the LSE.
    _store_out(o, m_i, l_i, rows, W * HALF, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
               l_sp, SQ, H, FINAL, W == 0, D_NOPE)


@gluon.jit(do_not_specialize=["num_blocks", "pages_per_split"])
def _mla_sm90_kernel(q_desc, qr_desc, kn_desc, kr_desc, bt_ptr, seq_ptr, out_ptr, lse_ptr, qk_scale, num_blocks,
                     pages_per_split, max_pages, bt_sb, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
                     SQ: gl.constexpr, H: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
                     num_warps: gl.constexpr):
    """The TMA loads (this partition, 4 warps) and the two compute warpgroups (worker partitions)."""
    b = gl.program_id(1)
    split = gl.program_id(2)
    r0 = gl.program_id(0) * BLOCK_M
    sk, lo, hi, p0, n_tiles = _key_span(seq_ptr, b, split, r0, pages_per_split, max_pages, SQ, H, CAUSAL)
    # Q as two 256-column halves + RoPE; key buffers: NoPE half h of slot s at index 2 s + h (warpgroup h's O
    # columns), the RoPE part (later P) of slot s. 64 + 8 + 4 x 32 + 2 x 8 KB.
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], q_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_M, ROPE_W], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [4, PAGE, HALF], kn_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, ROPE_W], kr_desc.layout)
    # (m_a, m_b of the pair, the final l of warpgroup 0, 1), each its own allocation: Triton's barrier pass puts a
    # CTA barrier between two accesses of one allocation
    ml_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    ml_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
               gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
               gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
               gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout))
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    full_n = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())  # NoPE half h of slot s: 2 s + h
    empty_n = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sm_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # P of slot s published
    mx_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # the row max of slot s published
    fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())  # both warpgroups' final l written
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(4):
        mbarrier.init(full_n.index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(empty_n.index(i), count=1)  # NoPE half h: only warpgroup h reads it after the owner's S
    for i in gl.static_range(2):
        mbarrier.init(full_r.index(i), count=1)
        mbarrier.init(empty_r.index(i), count=2)  # the RoPE part holds P, read by both warpgroups
        mbarrier.init(sm_bar.index(i), count=1)
    mbarrier.init(mx_bar.index(0), count=1)
    mbarrier.init(mx_bar.index(1), count=1)
    mbarrier.init(fin_bar, count=2)
    bt_row = bt_ptr + b.to(gl.int64) * bt_sb
    q_row = (b * SQ * H + r0).to(gl.int32)
    # (The argument tuples are written out: a tuple assigned to a variable turns its constexprs into tensors.)
    gl.warp_specialize([(_producer, (q_desc, qr_desc, kn_desc, kr_desc, q_smem, qr_smem, kn_smem, kr_smem, q_bar,
                                     full_n, full_r, empty_n, empty_r, bt_row, q_row, p0, n_tiles, num_blocks)),
                        (_compute, (0, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, mx_bar,
                                    sm_bar, fin_bar, empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0,
                                    b, split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
                                    l_sp, SQ, H, CAUSAL, FINAL)),
                        (_compute, (1, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, mx_bar,
                                    sm_bar, fin_bar, empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0,
                                    b, split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
                                    l_sp, SQ, H, CAUSAL, FINAL))],
                       [4, 4], [WS_REGS, WS_REGS])


# ------------------------------------------------------------------------------------------- config


def choose_splits(programs: int, pages: int, sm_count: int | None, overhead_pages: float = 2.0) -> int:
    """KV splits per (row block, sequence), from static sizes only: one 217 KB CTA fits an SM, so minimise
    waves x (pages per split + a per-split overhead of ~2 page tiles: prologue, partial write, merge share)."""
    if sm_count is None or programs <= 0 or pages <= 0:
        return 1
    best, best_cost = 1, math.inf
    for s in range(1, max(1, min(MAX_SPLITS, pages // MIN_SPLIT_PAGES)) + 1):
        cost = -(-programs * s // sm_count) * (pages / s + overhead_pages)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


@functools.lru_cache(maxsize=8)
def _smem_layout(rows: int, cols: int):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _descriptors(q2d: torch.Tensor, kv2d: torch.Tensor):
    """(Q NoPE, Q RoPE, K NoPE, K RoPE) TMA descriptors over q (rows, 576) and the cache (num_blocks * 64, 576);
    the NoPE boxes are 256-column halves (one per compute warpgroup)."""
    def desc(t, rows, cols):
        return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, cols], _smem_layout(rows, cols))

    return (desc(q2d, ROWS, NOPE // 2), desc(q2d, ROWS, DS_ROPE), desc(kv2d, PAGE_SIZE, NOPE // 2),
            desc(kv2d, PAGE_SIZE, DS_ROPE))


def _cache_2d(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache (num_blocks, 64, (1,) 576) as its (num_blocks * 64, 576) token rows (a view)."""
    nb, bs = kv_cache.shape[:2]
    return kv_cache.as_strided((nb * bs, kv_cache.shape[-1]), (kv_cache.stride(1), 1))


@functools.lru_cache(maxsize=256)
def _consts(sq: int, h: int, causal: bool, final: bool) -> dict:
    """The kernel's constexprs, cached per call shape (callers only read the dict)."""
    return dict(SQ=sq, H=h, CAUSAL=causal, FINAL=final, num_warps=TMA_WARPS)


# ------------------------------------------------------------------------------------------- checks


def supports_mla_decode_sm90(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal,
                             window_left, num_splits) -> str | None:
    """None when the sm_90 Gluon kernel takes this call, else why not."""
    reason = sm90_gluon_reason(q)
    if reason:
        return reason
    if layout != "bf16" or kv_cache.dtype != torch.bfloat16:
        return f"bf16 latent cache only (layout {layout!r}: the FP8 layouts stay on the portable kernel)"
    if indices is not None:
        return "dense only (sparse index lists stay on the portable kernel)"
    if q.dtype != torch.bfloat16:
        return f"q dtype {q.dtype} is not bf16"
    if q.shape[-1] != NOPE + DS_ROPE or v_dim != NOPE:
        return f"D {q.shape[-1]}, v_dim {v_dim}: this kernel is for D = {NOPE + DS_ROPE}, v_dim = {NOPE}"
    if kv_cache.shape[1] != PAGE_SIZE:
        return f"page size {kv_cache.shape[1]}: one key tile is one page of {PAGE_SIZE} tokens"
    if int(window_left) >= 0:
        return f"window_left {window_left}: no sliding window here"
    if q.shape[1] > MAX_Q:
        return f"{q.shape[1]} queries per sequence > {MAX_Q}"
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        return f"softmax_scale {softmax_scale} is not a positive finite number"
    if kv_cache.stride(-1) != 1 or (kv_cache.dim() == 4 and kv_cache.shape[2] != 1):
        return "cache rows must be unit-stride (one latent head)"
    if kv_cache.shape[0] > 1 and kv_cache.stride(0) != PAGE_SIZE * kv_cache.stride(1):
        return f"pages must be packed (stride(0) == 64 x token stride) for the 2-D TMA view, got {kv_cache.stride()}"
    if (kv_cache.stride(1) * 2) % 16 or kv_cache.data_ptr() % 16:
        return "TMA needs a 16-byte aligned cache base and token stride"
    if kv_cache.shape[0] * PAGE_SIZE >= 2**31:
        return "the cache holds >= 2^31 tokens (TMA coordinates are 32-bit)"
    if q.shape[0] * q.shape[1] * q.shape[2] >= 2**31 or q.shape[0] > 65535:
        return f"batch {q.shape[0]} x {q.shape[1]} x {q.shape[2]} rows is too large for one grid / 32-bit rows"
    return None


# ------------------------------------------------------------------------------------------- entry


def mla_decode(q, kv_cache, block_table, seqused_k, indices, layout: str, v_dim: int, softmax_scale: float,
               causal: bool, window_left: int, num_splits: int):
    """(out (B, Sq, H, 512) bf16, lse (B, Sq, H) fp32); see the module docstring. Call
    `supports_mla_decode_sm90` first (the dispatcher does). num_splits <= 0 picks the split count from static
    sizes."""
    check_mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal,
                     window_left, num_splits)
    reason = supports_mla_decode_sm90(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale,
                                      causal, window_left, num_splits)
    if reason:
        raise ValueError(f"lowbit.{OP} (sm_90 Gluon): {reason}")
    bsz, sq, h, d = q.shape
    out = torch.empty(bsz, sq, h, NOPE, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, sq, h, dtype=torch.float32, device=q.device)
    max_pages = block_table.shape[1]
    if out.numel() == 0:
        return out, lse
    m_blocks = -(-(sq * h) // ROWS)
    if num_splits > 0:
        splits = num_splits
    else:
        splits = choose_splits(m_blocks * bsz, max_pages, sm_count(device_index(q.device)))
    splits = max(1, min(splits, max(max_pages, 1)))
    pps = max(1, -(-max_pages // splits))
    o_buf, l_buf, o_sp, l_sp = split_buffers(out, lse, splits)
    if max_pages == 0 or kv_cache.shape[0] == 0:  # no keys at all: out 0, lse -inf
        out.zero_()
        lse.fill_(-math.inf)
        return out, lse
    q2d = q.reshape(bsz * sq * h, d)
    if q2d.stride(1) != 1 or (q2d.stride(0) * 2) % 16 or q2d.data_ptr() % 16:
        q2d = q2d.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    launch(_mla_sm90_kernel, (m_blocks, bsz, splits),
        *_descriptors(q2d, _cache_2d(kv_cache)), block_table, seqused_k, o_buf, l_buf,
        float(softmax_scale) * LOG2E, kv_cache.shape[0], pps, max_pages, block_table.stride(0),
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), o_sp, l_buf.stride(0), l_buf.stride(1), l_buf.stride(2),
        l_sp, **_consts(sq, h, bool(causal), splits == 1))
    reduce_splits(o_buf, l_buf, out, lse, WIDE_REDUCE_ELEMS)
    return out, lse


# ------------------------------------------------------------------------------------------- compile-only


def compile_sm90(sq: int = 1, h: int = 128, causal: bool = True, final: bool = False, any_version: bool = False):
    """Compile the kernel for sm_90a without a GPU (host tensors only describe the arguments); returns Triton's
    compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`). For tests and inspection. any_version: compile
    with a Triton other than the one the kernel is run with (3.6), as a check of the source's portability."""
    require_gluon_compile(any_version)
    bsz, nb, max_pages = 2, 8, 4
    q = torch.empty(bsz * sq * h, NOPE + DS_ROPE, dtype=torch.bfloat16)
    kv = torch.empty(nb * PAGE_SIZE, NOPE + DS_ROPE, dtype=torch.bfloat16)
    bt = torch.empty(bsz, max_pages, dtype=torch.int32)
    seq = torch.empty(bsz, dtype=torch.int32)
    out = torch.empty(bsz, sq, h, 2, NOPE)
    lse = torch.empty(bsz, sq, h, 2)
    qd, qrd, knd, krd = _descriptors(q, kv)
    args = dict(q_desc=qd, qr_desc=qrd, kn_desc=knd, kr_desc=krd, bt_ptr=bt, seq_ptr=seq, out_ptr=out, lse_ptr=lse,
                qk_scale=0.1, num_blocks=nb, pages_per_split=2, max_pages=max_pages, bt_sb=max_pages,
                o_sb=out.stride(0), o_ss=out.stride(1), o_sh=out.stride(2), o_sp=out.stride(3), l_sb=lse.stride(0),
                l_ss=lse.stride(1), l_sh=lse.stride(2), l_sp=lse.stride(3))
    return compile_gluon_sm90(_mla_sm90_kernel, args, _consts(sq, h, causal, final), ("num_blocks", "pages_per_split"))
