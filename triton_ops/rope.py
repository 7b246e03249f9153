"""Rotary position embedding (Triton): q and k in one launch, any head strides, NeoX or GPT-J pairs,
a rotary slice anywhere in the head, forward or inverse, in place or out of place.

Contract: dispatch/reference/rope.py. Bit-exact with it: fp32 products and sums each rounded once, which
needs `enable_fp_fusion=False` at launch (Triton otherwise contracts x*c - y*s into an FMA on the GPU and
the last bit can differ).

Shape of the work (why it is fast): a program owns a (token block, head block) tile, so each token's
(cos, sin) row is loaded once and broadcast over its heads, and (token, head) come from the program ids
(no per-row integer division). GPT-J pairs (2i, 2i+1) are loaded and stored as one machine word per pair
(int32 for 16-bit dtypes, int64 for fp32) when the strides allow it, so the accesses stay contiguous
vectors instead of stride-2 scalars. docs/design_notes.md has the SASS counts.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._formats import cast_out, round_pairs, split_pairs
from ._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2

PAIR_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # split_pairs' IN_KIND


@triton.jit
def load_f32(ptrs, mask, EMULATE: tl.constexpr):
    """Masked load as fp32 (0 where masked). The interpreter's bf16 -> fp32 conversion flushes or garbles
    bf16 subnormals (-3.7e-40 -> -0.0), so on the emulated path bf16 is widened from its bits instead."""
    if EMULATE and ptrs.dtype.element_ty == tl.bfloat16:
        b = tl.load(ptrs.to(tl.pointer_type(tl.uint16), bitcast=True), mask=mask, other=0)
        return (b.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def rope_pairs(x1, x2, c, s, INVERSE: tl.constexpr):
    """Rotate pairs (x1, x2) by the angle whose (cos, sin) is (c, s); by minus that angle if INVERSE.
    Negating s is exact, so the inverse rounds exactly as the reference's x1*c + x2*s."""
    if INVERSE:
        s = -s
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def load_cos_sin(cs_ptr, pos, ok, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """(cos, sin) [R, HALF_P] for positions pos [R] (int64); NaN where ok is false (bad position or row)."""
    i = tl.arange(0, HALF_P)
    m = ok[:, None] & (i < HALF)[None, :]
    base = cs_ptr + pos[:, None] * (2 * HALF) + i[None, :]
    c = tl.load(base, mask=m, other=float("nan"))
    s = tl.load(base + HALF, mask=m, other=float("nan"))
    return c, s


@triton.jit
def load_cos_sin_tile(cs_ptr, pos, ok, BLOCK_H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """(cos, sin) [R, BLOCK_H, HALF_P] (the same row for every head), loaded straight in the layout of a
    [R, BLOCK_H, HALF_P] data tile. Loading [R, HALF_P] and broadcasting lets Triton pick the load's layout
    on its own, and for some tiles (DeepSeek's 4 tokens x 16 heads) it then moves (cos, sin) into the tile's
    layout through shared memory + barriers, which also hold back every load behind them. The repeats over
    a thread's heads are L1 hits."""
    i = tl.arange(0, HALF_P)
    m = tl.broadcast_to((ok[:, None] & (i < HALF)[None, :])[:, None, :], [pos.shape[0], BLOCK_H, HALF_P])
    base = tl.broadcast_to((cs_ptr + pos[:, None] * (2 * HALF) + i[None, :])[:, None, :],
                           [pos.shape[0], BLOCK_H, HALF_P])
    c = tl.load(base, mask=m, other=float("nan"))
    s = tl.load(base + HALF, mask=m, other=float("nan"))
    return c, s


@triton.jit
def load_cos_sin_rows(cs_ptr, pos, ok, BLOCK_H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
                      CS_ROWS: tl.constexpr):
    """(cos, sin) for a [R, BLOCK_H, HALF_P] tile: CS_ROWS loads each token's row once ([R, HALF_P]) and
    broadcasts it over the heads; otherwise load_cos_sin_tile."""
    if CS_ROWS:
        c, s = load_cos_sin(cs_ptr, pos, ok, HALF, HALF_P)
        return c[:, None, :], s[:, None, :]
    else:
        return load_cos_sin_tile(cs_ptr, pos, ok, BLOCK_H, HALF, HALF_P)


@triton.jit
def pair_offsets(rot_offset, HALF: tl.constexpr, HALF_P: tl.constexpr, IS_NEOX: tl.constexpr):
    """Head-dim offsets [HALF_P] of the first and second element of each rotary pair."""
    i = tl.arange(0, HALF_P)
    if IS_NEOX:
        o1 = rot_offset + i
        o2 = o1 + HALF
    else:
        o1 = rot_offset + 2 * i
        o2 = o1 + 1
    return o1, o2


@triton.jit
def word_ptr(ptr, PAIR_KIND: tl.constexpr):
    """The same address as a pointer to pair words: int64 for fp32 elements, int32 for 16-bit ones."""
    if PAIR_KIND == 2:
        return ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    else:
        return ptr.to(tl.pointer_type(tl.int32), bitcast=True)


@triton.jit
def bits16(x, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> the 16-bit pattern of its RNE cast to OUT_DTYPE (bf16 or fp16), as uint32."""
    return cast_out(x, OUT_DTYPE, EMULATE).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def join_pairs(y1, y2, PAIR_KIND: tl.constexpr, EMULATE: tl.constexpr):
    """Inverse of split_pairs after rounding: (even, odd) fp32 -> one word holding both, rounded to the
    element dtype (PAIR_KIND 0 bf16 / 1 fp16 -> int32, 2 fp32 -> int64)."""
    if PAIR_KIND == 2:
        a = y1.to(tl.uint32, bitcast=True).to(tl.uint64)
        b = y2.to(tl.uint32, bitcast=True).to(tl.uint64)
        return (a | (b << 32)).to(tl.int64, bitcast=True)
    elif EMULATE:
        dt = tl.float16 if PAIR_KIND == 1 else tl.bfloat16
        return (bits16(y1, dt, EMULATE) | (bits16(y2, dt, EMULATE) << 16)).to(tl.int32, bitcast=True)
    else:  # one cvt.rn.{bf16,f16}x2.f32 per pair (F2FP.PACK_AB) instead of two F2F + PRMT/LOP: same RNE bits
        w, _, _ = round_pairs(y1, y2, PAIR_KIND, EMULATE)
        return w


@triton.jit
def _rope_rows(t, h, T, H, s_t, s_h, d_t, d_h):
    """Row masks and int64 element offsets [BLOCK_T, BLOCK_H] of tokens t (int64) x heads h in src and dst."""
    rows_ok = (t < T)[:, None] & (h < H)[None, :]
    return rows_ok, (t * s_t)[:, None] + (h * s_h)[None, :], (t * d_t)[:, None] + (h * d_h)[None, :]


@triton.jit
def _rope_load(src, src_row, rows_ok, rot_offset, HALF: tl.constexpr, HALF_P: tl.constexpr,
               IS_NEOX: tl.constexpr, WORDS: tl.constexpr, PAIR_KIND: tl.constexpr, EMULATE: tl.constexpr,
               EVICT: tl.constexpr = ""):
    """The rotary slice of rows src_row: (pair words, same) if WORDS, else (x1, x2) as fp32. Masks depend only
    on the row bounds, never on the positions, so these loads issue before the position -> (cos, sin) chain.
    WORDS (GPT-J only): strides, rot_offset and base are even / word-aligned, so pair i of a row is word
    (row + rot_offset) / 2 + i."""
    i = tl.arange(0, HALF_P)
    m = rows_ok[:, :, None] & (i < HALF)[None, None, :]
    if WORDS:
        w = tl.load(word_ptr(src, PAIR_KIND) + ((src_row + rot_offset) >> 1)[:, :, None] + i[None, None, :],
                    mask=m, other=0, eviction_policy=EVICT)
        return w, w
    else:
        o1, o2 = pair_offsets(rot_offset, HALF, HALF_P, IS_NEOX)
        x1 = load_f32(src + src_row[:, :, None] + o1[None, None, :], m, EMULATE)
        x2 = load_f32(src + src_row[:, :, None] + o2[None, None, :], m, EMULATE)
        return x1, x2


@triton.jit
def _rope_keep_mask(rows_ok, rot_offset, D, HALF: tl.constexpr, D_P: tl.constexpr):
    d = tl.arange(0, D_P)
    keep = (d < D) & ((d < rot_offset) | (d >= rot_offset + 2 * HALF))
    return rows_ok[:, :, None] & keep[None, None, :]


@triton.jit
def _rope_store(dst, dst_row, rows_ok, a, b, c, s, rot_offset, HALF: tl.constexpr, HALF_P: tl.constexpr,
                IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, WORDS: tl.constexpr, PAIR_KIND: tl.constexpr,
                OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, EVICT: tl.constexpr = ""):
    """Rotate what _rope_load returned by (c, s) [BLOCK_T, BLOCK_H, HALF_P] and store it to rows dst_row."""
    i = tl.arange(0, HALF_P)
    m = rows_ok[:, :, None] & (i < HALF)[None, None, :]
    if WORDS:
        x1, x2 = split_pairs(a, PAIR_KIND)
        y1, y2 = rope_pairs(x1, x2, c, s, INVERSE)
        tl.store(word_ptr(dst, PAIR_KIND) + ((dst_row + rot_offset) >> 1)[:, :, None] + i[None, None, :],
                 join_pairs(y1, y2, PAIR_KIND, EMULATE), mask=m, eviction_policy=EVICT)
    else:
        y1, y2 = rope_pairs(a, b, c, s, INVERSE)
        o1, o2 = pair_offsets(rot_offset, HALF, HALF_P, IS_NEOX)
        tl.store(dst + dst_row[:, :, None] + o1[None, None, :], cast_out(y1, OUT_DTYPE, EMULATE), mask=m)
        tl.store(dst + dst_row[:, :, None] + o2[None, None, :], cast_out(y2, OUT_DTYPE, EMULATE), mask=m)


@triton.jit
def _rope_tile(src, dst, pos_ptr, cs_ptr, tb, hb, T, H, max_pos, s_t, s_h, d_t, d_h, rot_offset, D,
               HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, COPY: tl.constexpr,
               WORDS: tl.constexpr, PAIR_KIND: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
               ISSUE_FIRST: tl.constexpr, CS_ROWS: tl.constexpr = False, EVICT: tl.constexpr = ""):
    """Rotate tokens [tb*BLOCK_T, +BLOCK_T) x heads [hb*BLOCK_H, +BLOCK_H) of src [T, H, D] into dst (one
    tensor; _rope_kernel does q and k together). Order as in _rope_kernel: the position load, every data load,
    (ISSUE_FIRST: a barrier, so ptxas cannot sink them), then the (cos, sin) rows that wait on the positions."""
    t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < T
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    rows_ok, src_row, dst_row = _rope_rows(t, h, T, H, s_t, s_h, d_t, d_h)
    a, b = _rope_load(src, src_row, rows_ok, rot_offset, HALF, HALF_P, IS_NEOX, WORDS, PAIR_KIND, EMULATE, EVICT)
    if COPY:  # out of place with dims outside the rotary slice: they pass through unchanged (bit copy)
        pm = _rope_keep_mask(rows_ok, rot_offset, D, HALF, D_P)
        d = tl.arange(0, D_P)
        v = tl.load(src + src_row[:, :, None] + d[None, None, :], mask=pm)
    if ISSUE_FIRST:
        tl.debug_barrier()
    ok = tmask & (pos >= 0) & (pos < max_pos)  # a bad position reads nothing and poisons the slice
    c, s = load_cos_sin_rows(cs_ptr, pos, ok, BLOCK_H, HALF, HALF_P, CS_ROWS)
    _rope_store(dst, dst_row, rows_ok, a, b, c, s, rot_offset, HALF, HALF_P, IS_NEOX, INVERSE, WORDS, PAIR_KIND,
                OUT_DTYPE, EMULATE, EVICT)
    if COPY:
        tl.store(dst + dst_row[:, :, None] + d[None, None, :], v, mask=pm)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, T, HQ, HK, max_pos,
                 q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh, rot_offset, D, NB,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HAS_Q: tl.constexpr, HAS_K: tl.constexpr,
                 IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, COPY: tl.constexpr, WORDS: tl.constexpr,
                 PAIR_KIND: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                 ISSUE_FIRST: tl.constexpr, CS_ROWS: tl.constexpr = False, EVICT: tl.constexpr = ""):
    # 1-D grid, NB head-block pairs per token block, head blocks fastest: consecutive programs walk one token
    # row after another (contiguous streams, the token's position and (cos, sin) row reused while in cache).
    # Program (tb, hb) rotates q heads [hb*BLOCK_HQ, +BLOCK_HQ) and k heads [hb*BLOCK_HK, +BLOCK_HK) of its
    # tokens: BLOCK_HK is sized so the NB blocks cover k too (Hk=8 with one q block: BLOCK_HK=8), so there are
    # no k-only programs, no k tile padded to q's width, and one (cos, sin) chain per program. Every data load
    # (q, k, pass-through) is issued before anything waits on the positions. ISSUE_FIRST puts a CTA barrier
    # between them and the (cos, sin) loads: without it ptxas sinks each data load next to its first use (to
    # save registers), i.e. behind the position -> (cos, sin) chain, and a program costs three memory latencies
    # in a row (position, (cos, sin), data) instead of two with the data in flight from the start (sm_90
    # SASS in docs/design_notes.md). The barrier does not wait for the loads themselves.
    # CS_ROWS: (cos, sin) loaded once per token ([BLOCK_T, HALF_P]) and broadcast over the heads instead of in
    # the tile's layout (for GPT-J word tiles 2-3x fewer load instructions and registers, no smem).
    pid = tl.program_id(0)
    tb = pid // NB
    hb = pid - tb * NB
    t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    if HAS_Q:
        hq = hb * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        q_ok, q_row, qo_row = _rope_rows(t, hq, T, HQ, q_st, q_sh, qo_st, qo_sh)
        qa, qb = _rope_load(q_ptr, q_row, q_ok, rot_offset, HALF, HALF_P, IS_NEOX, WORDS, PAIR_KIND, EMULATE, EVICT)
    if HAS_K:
        hk = hb * BLOCK_HK + tl.arange(0, BLOCK_HK)
        k_ok, k_row, ko_row = _rope_rows(t, hk, T, HK, k_st, k_sh, ko_st, ko_sh)
        ka, kb = _rope_load(k_ptr, k_row, k_ok, rot_offset, HALF, HALF_P, IS_NEOX, WORDS, PAIR_KIND, EMULATE, EVICT)
    if COPY:  # out of place with dims outside the rotary slice: they pass through unchanged (bit copy)
        d = tl.arange(0, D_P)
        if HAS_Q:
            q_pm = _rope_keep_mask(q_ok, rot_offset, D, HALF, D_P)
            qv = tl.load(q_ptr + q_row[:, :, None] + d[None, None, :], mask=q_pm)
        if HAS_K:
            k_pm = _rope_keep_mask(k_ok, rot_offset, D, HALF, D_P)
            kv = tl.load(k_ptr + k_row[:, :, None] + d[None, None, :], mask=k_pm)
    if ISSUE_FIRST:
        tl.debug_barrier()
    ok = tmask & (pos >= 0) & (pos < max_pos)  # a bad position reads nothing and poisons the slice
    if HAS_Q:
        c, s = load_cos_sin_rows(cs_ptr, pos, ok, BLOCK_HQ, HALF, HALF_P, CS_ROWS)
        _rope_store(qo_ptr, qo_row, q_ok, qa, qb, c, s, rot_offset, HALF, HALF_P, IS_NEOX, INVERSE, WORDS,
                    PAIR_KIND, OUT_DTYPE, EMULATE, EVICT)
        if COPY:
            tl.store(qo_ptr + qo_row[:, :, None] + d[None, None, :], qv, mask=q_pm)
    if HAS_K:
        c, s = load_cos_sin_rows(cs_ptr, pos, ok, BLOCK_HK, HALF, HALF_P, CS_ROWS)
        _rope_store(ko_ptr, ko_row, k_ok, ka, kb, c, s, rot_offset, HALF, HALF_P, IS_NEOX, INVERSE, WORDS,
                    PAIR_KIND, OUT_DTYPE, EMULATE, EVICT)
        if COPY:
            tl.store(ko_ptr + ko_row[:, :, None] + d[None, None, :], kv, mask=k_pm)


ROPE_ELEMS = 8192  # rotary elements per program at prefill on the GPU (16 KB of bf16 read, 16 KB written)
ROPE_MIN_PROGRAMS = 264  # ~2 per SM: below that, smaller programs (decode)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    block_t: int  # tokens per program
    block_hq: int  # q heads per program
    block_hk: int  # k heads per program (the same tokens as its q heads)
    num_warps: int
    issue_first: bool = True  # barrier between the data loads and the (cos, sin) loads (see _rope_kernel)
    cs_rows: bool = False  # (cos, sin) loaded once per token and broadcast over the heads (see _rope_kernel)
    evict_first: bool = False  # evict_first hint on the streamed q / k loads and stores


def rope_config(t: int, hq: int, hk: int, rot: int, device: torch.device) -> RopeConfig:
    """Tile of a program: block_t tokens x (block_hq q heads + block_hk k heads) of the rotary slice.

    Why these sizes (H200, docs/design_notes.md): the kernel is latency-bound per program
    (position -> (cos, sin) row is a dependent chain of two memory latencies), so a program should carry
    enough bytes to cover it: ~ROPE_ELEMS rotary elements (8192: a token of 64 q + 8 k heads x 128 is 9216),
    q heads first (one (cos, sin) row serves all of a token's heads), then tokens. k rides along with q:
    block_hk = Hk / (number of q head blocks) so no program is k-only or k-padded. 4 warps at up to ~64
    elements per thread (8 x 16-byte vectors of bf16), 8 above. Short batches (decode) take smaller programs
    until there are ~2 per SM. Interpreter: up to 32K elements (it pays per program)."""
    rot_p = next_pow2(rot)
    if device.type == "cpu":
        target = 32768
    else:
        target = ROPE_ELEMS
        while target > 1024 and t * (hq + hk) * rot_p // target < ROPE_MIN_PROGRAMS:
            target //= 2
    rows = max(1, target // rot_p)
    block_hq = min(next_pow2(max(hq, 1)), rows) if hq else 1
    nb = -(-hq // block_hq) if hq else 1
    block_hk = min(next_pow2(max(-(-hk // nb), 1)), rows)
    nb = max(nb, -(-hk // block_hk))
    heads = (block_hq if hq else 0) + (block_hk if hk else 0)
    fit = max(1, rows // max(heads, 1))
    block_t = min(next_pow2(max(t, 1)), 1 << (fit.bit_length() - 1))  # powers of two (tl.arange)
    elems = block_t * heads * rot_p
    # cs_rows: per-token (cos, sin) rows broadcast over the heads. sm_90 SASS (triton 3.6): rope_
    # DeepSeek-V4 2 tokens x 64 heads 108 -> 62 registers (4 -> 8 CTAs/SM), 24 -> 10 LDG.128; NeoX 64q+8k
    # 124 -> 84; 32q+8k 64 -> 64 with 4 fewer loads; no shared memory in any of them.
    return RopeConfig(block_t, block_hq, block_hk, 4 if elems <= 9216 else 8, cs_rows=True)


def pairs_as_words(is_neox: bool, rot_offset: int, *tensors) -> bool:
    """GPT-J pairs can move as whole words when every row and the slice start at an even element of a
    word-aligned base (always true for contiguous tensors and their head views with an even rot_offset)."""
    if is_neox or rot_offset % 2:
        return False
    for x in tensors:
        if x.stride(0) % 2 or x.stride(1) % 2 or x.data_ptr() % (2 * x.element_size()):
            return False
    return True


def _launch(q, k, qo, ko, positions, cos_sin_cache, rot_offset, is_neox, inverse, copy, cfg=None):
    t, hq, d = q.shape
    hk = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if t == 0 or (hq == 0 and hk == 0) or half == 0:
        return
    cfg = cfg or rope_config(t, hq, hk, 2 * half, q.device)
    nb = max(cdiv(hq, cfg.block_hq), cdiv(hk, cfg.block_hk))
    words = pairs_as_words(is_neox, rot_offset, q, k, qo, ko)
    copy = copy and 2 * half < d
    n_prog = cdiv(t, cfg.block_t) * nb
    evict = "evict_first" if cfg.evict_first else ""
    launch(_rope_kernel, (n_prog,),
        q, k, qo, ko, positions, cos_sin_cache, t, hq, hk, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        rot_offset, d, nb,
        HALF=half, HALF_P=next_pow2(half), D_P=next_pow2(d), BLOCK_T=cfg.block_t, BLOCK_HQ=cfg.block_hq,
        BLOCK_HK=cfg.block_hk, HAS_Q=hq > 0, HAS_K=hk > 0, IS_NEOX=is_neox, INVERSE=inverse,
        COPY=copy, WORDS=words, PAIR_KIND=PAIR_KIND[q.dtype], OUT_DTYPE=TL_DTYPE[q.dtype],
        EMULATE=emulate_formats(q.device), ISSUE_FIRST=cfg.issue_first, CS_ROWS=cfg.cs_rows, EVICT=evict,
        num_warps=cfg.num_warps, enable_fp_fusion=False)


def rope(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, cfg: RopeConfig | None = None):
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, qo, ko, positions, cos_sin_cache, rot_offset, is_neox, inverse, True, cfg)
    return qo, ko


def rope_(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, cfg: RopeConfig | None = None):
    if k is None:
        k = q[:, :0]
    _launch(q, k, q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, False, cfg)
