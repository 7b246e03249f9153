"""DeepSeek MLA decode for Hopper (sm_90a) in Gluon: bf16 dense latent cache, TMA page tiles, warpgroup MMA.
Contract: dispatch/reference/attention.py:mla_decode (the bf16-layout dense calls of it; triton_ops/attention/
mla_decode.py serves the rest: FP8 layouts, sparse index lists, sliding windows, other widths).

Written for Triton 3.6 (the GPU image's) Gluon API, like prefill_sm90.py (whose version gate it shares); other
Triton versions are refused by `supports_mla_decode_sm90` (the module still imports without Gluon).

Shape of the work: one CTA = BLOCK_M = 64 query rows x one sequence x one KV split; 8 warps (two warpgroups).
Rows are the packed (query, head) pairs r = s * H + h of the sequence (Sq 1..8 folds into M: with H = 128 and
Sq = 2, four row blocks), read by TMA from q seen as (B * Sq * H, 576).

* Q (64 x 576 bf16, 72 KB) is loaded once by TMA and stays in shared memory (the A operand of S = Q K^T), as a
  512-column NoPE part and a 64-column RoPE part (TMA boxes and register tiles are powers of two).
* Key tile = one cache page (64 tokens x 576, 72 KB): two TMA loads (NoPE 512 columns, RoPE 64) at row
  page * 64 of the cache seen as (num_blocks * 64, 576), completing on one mbarrier. The value tile is the NoPE
  part of the same buffer: one load serves both MMAs. Two tiles in flight (double buffer): Q 72 + 2 x 72 +
  P 8 = 224 KB of shared memory.
* The two warpgroups split the N dimension of both MMAs (wgmma layout warps [4, 2]): S = Q K^T (64 x 64) as two
  64 x 32 halves (no QK^T is computed twice), then the online softmax (the row max / sum cross the two halves
  through shared memory), P (bf16) written to shared memory, and O (64 x 512 fp32) as two 64 x 256 halves,
  O += P V, each warpgroup reading all of P and its half of V.
* Iteration t: wait for tile t's barrier; S_t = Q K_t^T (two chained async wgmmas: NoPE, RoPE), wait; softmax
  (masked keys -inf); rescale O; P_t to shared memory (fence, CTA barrier); O += P_t V_t, wait; CTA barrier;
  refill the buffer with tile t + 2. A tile is resident for one iteration and its successor's load has a whole
  iteration to land. No wgmma is in flight across the loop's back edge: carrying one (P V of tile t overlapping
  S of tile t + 1) makes ptxas serialize every wgmma of the kernel (C7514), which the compile test checks.
* Schedules (`mla_decode(..., schedule=)`, SCHEDULES; DEFAULT_SCHEDULE = "pingpong_pair"):
  SERIAL: the iteration above.
  OVERLAP (FA3's intra-warpgroup overlap, as prefill_sm90.py): issue S_t, then P_{t-1} V_{t-1}; the softmax of
  tile t runs under that MMA; a tile is then resident from its S to the next step's P V, so its successor's refill
  is issued mid-step (less time to land). Slower than SERIAL on an H200 (0.81-0.90x).
  PINGPONG (`_mla_ws_kernel`, FlashMLA's sm90 structure in Gluon's warp_specialize): a TMA partition (4 warps, 24
  registers) loads Q, then key tile t into slot t % 2 in three parts with their own full / empty mbarriers: NoPE
  half h (256 columns: warpgroup h's O columns, so after the owner's S only warpgroup h reads it and releases it
  alone) and the RoPE part (released by both). Compute warpgroup w (240 registers each, setmaxnreg) owns the tiles
  t = w (mod 2): their whole S (64 x 64, wgmma 64x64, issued part by part as the parts land) and softmax, while O
  stays split by columns (each warpgroup 64 x 256, all tiles). The softmax chain crosses warpgroups: the owner of
  tile t takes the running (m, l) after tile t - 1 from shared memory, writes P_t (bf16) over the RoPE part of
  tile t's slot (free once S_t is done: no extra P buffer, so Q + 2 tiles = 217 KB) and (m_t, l_t), and signals
  one mbarrier; both warpgroups then rescale their O and add P_t V_t. A warpgroup's step (`_ws_pair`) issues S of
  its next tile, then the P V of the other's tile, runs its softmax under that MMA, publishes, adds its own P V:
  while one warpgroup does a softmax the other keeps the tensor cores busy.
  PINGPONG_PV_FIRST: the same, but the P V of the other's tile runs and its buffer is released before waiting for
  the own tile's load. With two buffers the refill of tile t + 2 can only start once both warpgroups are done with
  tile t; in PINGPONG the other warpgroup's release of tile t waits behind its own next tile's load (S first),
  which couples the loads; here it does not.
  PINGPONG_PV_FIRST_C2 / _C4: PINGPONG_PV_FIRST with each 256-column NoPE half of Q and of a key tile loaded as
  2 / 4 column chunks (128 / 64 columns, a full mbarrier each; the empty barriers stay per half, the buffers and
  the P V are unchanged): S of a tile is issued chunk by chunk as the chunks land (K = 128 / 64 per wgmma group),
  so it starts once 16 / 8 KB of the 72 KB tile are in, not 32 KB (FlashMLA pipelines its key tile as nine
  64-column chunks). Each chunk's full barriers are their own allocation: Triton's barrier pass puts a CTA
  barrier between two mbarrier waits on one allocation, so chunk waits on one array would add a bar.sync each.
  C4 holds more wgmma descriptors: ptxas spills a few registers outside the tile loop.
  PINGPONG_PV_FIRST_C4_R1: C4 with fewer CTA barriers per step: one release arrival per warpgroup and slot (its
  NoPE half's barrier, which the producer also waits for, for both warpgroups, before refilling the RoPE part)
  instead of two (one arrival and one bar.sync fewer per release, two releases per warpgroup step), and the
  published m and l of each slot in allocations of their own (no bar.sync between their stores).
  PINGPONG_PAIR (FlashMLA's hand-off within a tile pair (a, a + 1), a even; the same TMA partition, buffers and
  release barriers): both warpgroups issue S of their own tile of the pair at once; only the row max crosses
  between the softmaxes: warpgroup 0 publishes m_a = max(m, rowmax S_a) (an mbarrier of its own) as soon as it has
  it, warpgroup 1 folds it into m_b and publishes m_b, while warpgroup 0 takes its exponentials against m_a and then
  rescales P_a to m_b before publishing it; both P of the pair are then at m_b, so each warpgroup rescales its O
  once per pair and issues P_a V_a and P_b V_b back to back. Each warpgroup sums l over its own tiles only; the two
  sums (both at the final max) are added once, after the last tile. The chain between the warpgroups per pair is
  two row maxima, not two whole softmaxes with the P V and S between them.
  PINGPONG_PAIR_RP: PINGPONG_PAIR in FlashMLA's order: the owner's P V takes P from registers (wgmma's register A
  operand) as soon as its exponentials are taken: warpgroup 0's P_a V_a (O rescaled to m_a) runs while warpgroup
  1 is in its softmax, then O goes from m_a to m_b before P_b V_b; warpgroup 1 issues P_b V_b before it waits for
  P_a.
  The warp-specialized kernel and its schedules are in mla_sm90_ws.py.
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
from triton_ops.attention.mask import key_range
from triton_ops.attention.prefill_sm90 import LOG2E, _version_reason, compile_gluon_sm90, sm90_gluon_reason
from triton_ops.contract.arch import device_index, sm_count
from triton_ops.contract.attention import check_mla_decode
from triton_ops.contract.kv_cache import DS_ROPE

try:  # Gluon's Hopper API (see prefill_sm90.py for the version notes)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    _GLUON_OK = True
except Exception:  # pragma: no cover - refused through prefill_sm90._version_reason

    class _NoGluon:
        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    gluon = _NoGluon()
    _GLUON_OK = False

OP = "mla_decode"
PAGE_SIZE = 64  # tokens per cache page = keys per tile
ROWS = 64  # query rows per CTA
NOPE = 512  # the latent row: NoPE (= the value) + DS_ROPE RoPE columns
NUM_WARPS = 8
PAGE: tl.constexpr = tl.constexpr(PAGE_SIZE)
BLOCK_M: tl.constexpr = tl.constexpr(ROWS)
D_NOPE: tl.constexpr = tl.constexpr(NOPE)
ROPE_W: tl.constexpr = tl.constexpr(DS_ROPE)
MAX_SPLITS = 64
SCHEDULES = ("serial", "overlap", "pingpong", "pingpong_pv_first",  # see the module docstring
             "pingpong_pv_first_c2", "pingpong_pv_first_c4", "pingpong_pv_first_c4_r1", "pingpong_pair",
             "pingpong_pair_rp")
PAIRS = {"pingpong_pair": 1, "pingpong_pair_rp": 2}  # the warp-specialized kernel's PAIR (mla_sm90_ws.py)
# timed best (H200, 7aea59e: 0.77-0.88x FlashMLA, median 0.87x; pingpong_pv_first 0.75-0.82x, serial 0.60-0.65x)
DEFAULT_SCHEDULE = "pingpong_pair"
MIN_SPLIT_PAGES = 4  # below 256 keys a split no longer pays for its partials and the merge


@gluon.jit
def _load_tile(kn_desc, kr_desc, bt_row, p, num_blocks, bar, kn_smem, kr_smem, pred):
    """TMA of page table entry p (NoPE + RoPE parts) into one buffer, completing on `bar` (skipped unless pred)."""
    _load_page(kn_desc, kr_desc, gl.load(bt_row + p, mask=pred, other=0), num_blocks, bar, kn_smem, kr_smem, pred)


@gluon.jit
def _load_page(kn_desc, kr_desc, page, num_blocks, bar, kn_smem, kr_smem, pred):
    """TMA of cache page `page` into one buffer, completing on `bar` (skipped unless pred). A page id outside
    [0, num_blocks) reads past the view's end: zero fill."""
    row = gl.where((page >= 0) & (page < num_blocks), page, num_blocks) * PAGE
    mbarrier.expect(bar, kn_desc.block_type.nbytes + kr_desc.block_type.nbytes, pred=pred)
    _tma_load(kn_desc, [row, 0], bar, kn_smem, pred=pred)
    _tma_load(kr_desc, [row, D_NOPE], bar, kr_smem, pred=pred)


@gluon.jit
def _zero_rows_from(kn_smem, valid, num_warps: gl.constexpr):
    """Zero rows valid.. of a [PAGE, width] value tile in shared memory (64 columns at a time), then make the
    stores visible to the async proxy (wgmma) and to every warp."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, PAGE, layout=gl.SliceLayout(1, blk))
    keep = gl.expand_dims(rows < valid, 1)
    for c in gl.static_range(kn_smem.shape[1] // 64):
        part = kn_smem.slice(c * 64, 64, dim=1)
        x = part.load(blk)
        part.store(gl.where(keep, x, gl.zeros_like(x)))
    fence_async_shared()
    _cta_barrier()


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
def _softmax_tile(s, k0, lo, hi, page_ok, q_pos, m_i, l_i, qk_scale, CAUSAL: gl.constexpr):
    """Mask the raw logits s of keys k0..k0+63 (`_mask_tile`) and fold them into the running (m, l) (log2 units).
    Returns (P fp32, new m, new l, alpha = the factor O is rescaled by)."""
    s = _mask_tile(s, k0, lo, hi, page_ok, q_pos, CAUSAL)
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = _nz(m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _wait_tile_issue_s(t, kn_smem, kr_smem, q_smem, qr_smem, bars, p0, sk, TAIL: gl.constexpr,
                       s_layout: gl.constexpr, num_warps: gl.constexpr):
    """Wait for key tile t's buffer; TAIL: zero its value rows past the sequence end; issue S_t = Q K_t^T (two
    async wgmma groups: NoPE, RoPE). Returns S's token."""
    slot = t % 2
    k0 = (p0 + t) * PAGE
    mbarrier.wait(bars.index(slot), (t // 2) & 1)
    if TAIL:
        if k0 + PAGE > sk:
            _zero_rows_from(kn_smem.index(slot), sk - k0, num_warps)
    s = warpgroup_mma(q_smem, kn_smem.index(slot).permute((1, 0)), gl.zeros([BLOCK_M, PAGE], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    return warpgroup_mma(qr_smem, kr_smem.index(slot).permute((1, 0)), s, is_async=True)


@gluon.jit
def _tile(t, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, p_smem, bars, kn_desc, kr_desc, bt_row, p0, n_tiles,
          num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL: gl.constexpr, TAIL: gl.constexpr, FIRST: gl.constexpr,
          s_layout: gl.constexpr, o_layout: gl.constexpr, num_warps: gl.constexpr):
    """Key tile t (see the module docstring). FIRST: t = 0 (O starts here). TAIL: the tile may hold the sequence's
    last key (its rows past it are zeroed before P V). Returns (O, m, l). Both MMAs are waited for inside the
    step: a wgmma still in flight across the loop's back edge makes ptxas serialize every wgmma of the kernel."""
    slot = t % 2
    k0 = (p0 + t) * PAGE
    nxt = gl.load(bt_row + p0 + t + 2, mask=t + 2 < n_tiles, other=0)  # the refill's page id, off the refill's path
    s = _wait_tile_issue_s(t, kn_smem, kr_smem, q_smem, qr_smem, bars, p0, sk, TAIL, s_layout, num_warps)
    page = gl.load(bt_row + p0 + t)
    s = warpgroup_mma_wait(0, deps=(s, ))
    p, m_i, l_i, alpha = _softmax_tile(s, k0, lo, hi, (page >= 0) & (page < num_blocks), q_pos, m_i, l_i,
                                       qk_scale, CAUSAL)
    if not FIRST:
        o = _scale_rows(o, alpha)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()  # P complete (both halves) and visible to wgmma
    o = warpgroup_mma(p_smem, kn_smem.index(slot), o, use_acc=not FIRST, is_async=True)
    o = warpgroup_mma_wait(0, deps=(o, ))
    _cta_barrier()  # both warpgroups are done with this buffer and with P: refill it with tile t + 2
    _load_page(kn_desc, kr_desc, nxt, num_blocks, bars.index(slot), kn_smem.index(slot), kr_smem.index(slot),
               t + 2 < n_tiles)
    return o, m_i, l_i


@gluon.jit
def _tile_overlap(t, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, p_smem, bars, kn_desc, kr_desc, bt_row, p0,
                  n_tiles, num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL: gl.constexpr, TAIL: gl.constexpr,
                  FIRST: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, num_warps: gl.constexpr):
    """The OVERLAP schedule's key tile t (FA3's intra-warpgroup overlap): P_{t-1} waits in shared memory and tile
    t - 1 in the other buffer. Issue S_t, then P_{t-1} V_{t-1}; wait for S_t only and run the softmax of tile t
    while the tensor cores do P_{t-1} V_{t-1}; wait for it, refill its buffer with tile t + 1, rescale O, write
    P_t. Both MMAs retire inside the step (nothing in flight across the back edge). The refill is issued later
    than in the plain schedule (tile t + 1 has the rest of this step to land, not a whole step). FIRST: t = 0,
    S and the softmax only."""
    slot = t % 2
    k0 = (p0 + t) * PAGE
    nxt = gl.load(bt_row + p0 + t + 1, mask=t + 1 < n_tiles, other=0)  # the refill's page id
    s = _wait_tile_issue_s(t, kn_smem, kr_smem, q_smem, qr_smem, bars, p0, sk, TAIL, s_layout, num_warps)
    if not FIRST:
        o = warpgroup_mma(p_smem, kn_smem.index(1 - slot), o, is_async=True)
    page = gl.load(bt_row + p0 + t)
    s = warpgroup_mma_wait(1 - FIRST, deps=(s, ))  # S_t done; P_{t-1} V_{t-1} may still run
    p, m_i, l_i, alpha = _softmax_tile(s, k0, lo, hi, (page >= 0) & (page < num_blocks), q_pos, m_i, l_i,
                                       qk_scale, CAUSAL)
    if not FIRST:
        o = warpgroup_mma_wait(0, deps=(o, ))
        _cta_barrier()  # both warpgroups are done with tile t - 1's buffer and with P: refill it with tile t + 1
        _load_page(kn_desc, kr_desc, nxt, num_blocks, bars.index(1 - slot), kn_smem.index(1 - slot),
                   kr_smem.index(1 - slot), t + 1 < n_tiles)
        o = _scale_rows(o, alpha)
    p_smem.store(p.to(gl.bfloat16))
    fence_async_shared()
    _cta_barrier()  # P_t complete (both halves) and visible to wgmma
    return o, m_i, l_i


@gluon.jit
def _store_out(o, m_i, l_i, rows, col0, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
               SQ: gl.constexpr, H: gl.constexpr, FINAL: gl.constexpr, LSE: gl.constexpr):
    """Epilogue: O / l into columns col0.. of the output (bf16 when FINAL, else the fp32 split partial) and (LSE)
    the log-sum-exp; l = 0 where no key was seen (O is 0 there too): out 0, lse -inf. Stores straight from the
    wgmma layout with a row mask (rows past Sq * H belong to the next sequence, or nothing)."""
    o_layout: gl.constexpr = o.type.layout
    seen = l_i > 0.0
    inv = gl.convert_layout(gl.where(seen, 1.0 / l_i, 0.0), gl.SliceLayout(1, o_layout), assert_trivial=True)
    o = o * gl.expand_dims(inv, 1)
    o_rows = gl.convert_layout(rows, gl.SliceLayout(1, o_layout), assert_trivial=True)
    o_cols = col0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, o_layout))
    o_off = (b.to(gl.int64) * o_sb + (o_rows // H) * o_ss + (o_rows % H) * o_sh + split * o_sp)
    o_ptrs = out_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(o_cols, 0)
    o_mask = gl.expand_dims(o_rows < SQ * H, 1)
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


@gluon.jit(do_not_specialize=["num_blocks", "pages_per_split"])
def _mla_sm90_kernel(q_desc, qr_desc, kn_desc, kr_desc, bt_ptr, seq_ptr, out_ptr, lse_ptr, qk_scale, num_blocks,
                     pages_per_split, max_pages, bt_sb, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
                     SQ: gl.constexpr, H: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
                     OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    # wgmma layouts: one warpgroup (4 warps) over the 64 rows, the two warpgroups side by side along N.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                       instr_shape=[16, PAGE // (num_warps // 4), 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                       instr_shape=[16, D_NOPE // (num_warps // 4), 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    b = gl.program_id(1)
    split = gl.program_id(2)
    r0 = gl.program_id(0) * BLOCK_M
    sk, lo, hi, p0, n_tiles = _key_span(seq_ptr, b, split, r0, pages_per_split, max_pages, SQ, H, CAUSAL)

    rows = r0 + gl.arange(0, BLOCK_M, layout=row_layout)
    q_pos = sk - SQ + rows // H
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, D_NOPE], gl.float32, o_layout)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D_NOPE], q_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, ROPE_W], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, D_NOPE], kn_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, ROPE_W], kr_desc.layout)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, PAGE], kr_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.init(bars.index(0), count=1)
    mbarrier.init(bars.index(1), count=1)

    if n_tiles > 0:
        bt_row = bt_ptr + b.to(gl.int64) * bt_sb
        q_row = (b * SQ * H + r0).to(gl.int32)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row, 0], q_bar, q_smem)
        _tma_load(qr_desc, [q_row, D_NOPE], q_bar, qr_smem)
        _load_tile(kn_desc, kr_desc, bt_row, p0, num_blocks, bars.index(0), kn_smem.index(0), kr_smem.index(0),
                   True)
        _load_tile(kn_desc, kr_desc, bt_row, p0 + 1, num_blocks, bars.index(1), kn_smem.index(1),
                   kr_smem.index(1), n_tiles > 1)
        mbarrier.wait(q_bar, 0)
        # The last page holding keys of this sequence (its rows past sk are zeroed before their P V): every
        # tile from there on takes the TAIL path; the others run without the check.
        t_tail = gl.minimum(gl.maximum(sk // PAGE - p0, 1), n_tiles)
        if OVERLAP:
            step: gl.constexpr = _tile_overlap
        else:
            step: gl.constexpr = _tile
        o, m_i, l_i = step(0, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, p_smem, bars, kn_desc, kr_desc, bt_row,
                           p0, n_tiles, num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL, True, True, s_layout,
                           o_layout, num_warps)
        for t in range(1, t_tail):
            o, m_i, l_i = step(t, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, p_smem, bars, kn_desc, kr_desc,
                               bt_row, p0, n_tiles, num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL, False, False,
                               s_layout, o_layout, num_warps)
        for t in range(t_tail, n_tiles):
            o, m_i, l_i = step(t, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, p_smem, bars, kn_desc, kr_desc,
                               bt_row, p0, n_tiles, num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL, True, False,
                               s_layout, o_layout, num_warps)
        if OVERLAP:  # the last tile's P V
            o = warpgroup_mma(p_smem, kn_smem.index((n_tiles - 1) % 2), o, is_async=True)
            o = warpgroup_mma_wait(0, deps=(o, ))

    _store_out(o, m_i, l_i, rows, 0, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ, H,
               FINAL, True)


# ------------------------------------------------------------------------------------------- config


def choose_splits(programs: int, pages: int, sm_count: int | None, overhead_pages: float = 2.0) -> int:
    """KV splits per (row block, sequence), from static sizes only: one 224 KB CTA fits an SM, so minimise
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


def _descriptors(q2d: torch.Tensor, kv2d: torch.Tensor, nope_box: int = NOPE):
    """(Q NoPE, Q RoPE, K NoPE, K RoPE) TMA descriptors over q (rows, 576) and the cache (num_blocks * 64, 576);
    the NoPE boxes are nope_box columns wide (the pingpong schedules load 256-column halves)."""
    def desc(t, rows, cols):
        return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [rows, cols], _smem_layout(rows, cols))

    return (desc(q2d, ROWS, nope_box), desc(q2d, ROWS, DS_ROPE), desc(kv2d, PAGE_SIZE, nope_box),
            desc(kv2d, PAGE_SIZE, DS_ROPE))


def _cache_2d(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache (num_blocks, 64, (1,) 576) as its (num_blocks * 64, 576) token rows (a view)."""
    nb, bs = kv_cache.shape[:2]
    return kv_cache.as_strided((nb * bs, kv_cache.shape[-1]), (kv_cache.stride(1), 1))


@functools.lru_cache(maxsize=256)
def _kernel_and_consts(sq: int, h: int, causal: bool, final: bool, schedule: str):
    """The kernel of `schedule`, its constexprs and its NoPE TMA box width (PINGPONG: num_warps is the TMA
    partition's; the two compute warpgroups are worker partitions). Cached per call shape (callers only read the
    dict): no import or schedule parsing per call."""
    consts = dict(SQ=sq, H=h, CAUSAL=causal, FINAL=final)
    if schedule.startswith("pingpong"):
        from triton_ops.attention.mla_sm90_ws import _mla_ws_kernel  # (that module builds on this one's parts)

        nch = int(schedule.split("_c")[1][0]) if "_c" in schedule else 1  # _c2 / _c4: column chunks per half
        return (_mla_ws_kernel, dict(consts, PV_FIRST="pv_first" in schedule, NCH=nch, R1=schedule.endswith("_r1"),
                                     PAIR=PAIRS.get(schedule, 0), num_warps=4), NOPE // 2 // nch)
    return _mla_sm90_kernel, dict(consts, OVERLAP=schedule == "overlap", num_warps=NUM_WARPS), NOPE


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
               causal: bool, window_left: int, num_splits: int, *, schedule: str | None = None):
    """(out (B, Sq, H, 512) bf16, lse (B, Sq, H) fp32); see the module docstring. Call
    `supports_mla_decode_sm90` first (the dispatcher does). num_splits <= 0 picks the split count from static
    sizes. schedule: one of SCHEDULES (the module docstring), None = DEFAULT_SCHEDULE."""
    schedule = DEFAULT_SCHEDULE if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"lowbit.{OP} (sm_90 Gluon): schedule {schedule!r} is not one of {SCHEDULES}")
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
    kernel, consts, nope_box = _kernel_and_consts(sq, h, bool(causal), splits == 1, schedule)
    launch(kernel, (m_blocks, bsz, splits),
        *_descriptors(q2d, _cache_2d(kv_cache), nope_box), block_table, seqused_k, o_buf, l_buf,
        float(softmax_scale) * LOG2E, kv_cache.shape[0], pps, max_pages, block_table.stride(0),
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), o_sp, l_buf.stride(0), l_buf.stride(1), l_buf.stride(2),
        l_sp, **consts)
    reduce_splits(o_buf, l_buf, out, lse, WIDE_REDUCE_ELEMS)
    return out, lse


# ------------------------------------------------------------------------------------------- compile-only


def compile_sm90(sq: int = 1, h: int = 128, causal: bool = True, final: bool = False, any_version: bool = False,
                 schedule: str = "serial"):
    """Compile the kernel for sm_90a without a GPU (host tensors only describe the arguments); returns Triton's
    compiled kernel (`.asm["ptx"]`, `.asm["cubin"]`, `.metadata`). For tests and inspection. any_version: compile
    with a Triton other than the one the kernel is run with (3.6), as a check of the source's portability."""
    reason = _version_reason()
    if reason and not (any_version and _GLUON_OK):
        raise RuntimeError(reason)
    bsz, nb, max_pages = 2, 8, 4
    q = torch.empty(bsz * sq * h, NOPE + DS_ROPE, dtype=torch.bfloat16)
    kv = torch.empty(nb * PAGE_SIZE, NOPE + DS_ROPE, dtype=torch.bfloat16)
    bt = torch.empty(bsz, max_pages, dtype=torch.int32)
    seq = torch.empty(bsz, dtype=torch.int32)
    out = torch.empty(bsz, sq, h, 2, NOPE)
    lse = torch.empty(bsz, sq, h, 2)
    kernel, consts, nope_box = _kernel_and_consts(sq, h, causal, final, schedule)
    qd, qrd, knd, krd = _descriptors(q, kv, nope_box)
    args = dict(q_desc=qd, qr_desc=qrd, kn_desc=knd, kr_desc=krd, bt_ptr=bt, seq_ptr=seq, out_ptr=out, lse_ptr=lse,
                qk_scale=0.1, num_blocks=nb, pages_per_split=2, max_pages=max_pages, bt_sb=max_pages,
                o_sb=out.stride(0), o_ss=out.stride(1), o_sh=out.stride(2), o_sp=out.stride(3), l_sb=lse.stride(0),
                l_ss=lse.stride(1), l_sh=lse.stride(2), l_sp=lse.stride(3))
    return compile_gluon_sm90(kernel, args, consts, ("num_blocks", "pages_per_split"))
