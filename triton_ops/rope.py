"""Rotary position embedding (Triton): q and k in one launch, any head strides, NeoX or GPT-J pairs,
a rotary slice anywhere in the head, forward or inverse, in place or out of place.

Contract: dispatch/reference/rope.py. Bit-exact with it: fp32 products and sums each rounded once, which
needs `enable_fp_fusion=False` at launch (Triton otherwise contracts x*c - y*s into an FMA on the GPU and
the last bit can differ).

Shape of the work (why it is fast): a program owns a (token block, head block) tile, so each token's
(cos, sin) row is loaded once and broadcast over its heads, and (token, head) come from the program ids
(no per-row integer division). GPT-J pairs (2i, 2i+1) are loaded and stored as one machine word per pair
(int32 for 16-bit dtypes, int64 for fp32) when the strides allow it, so the accesses stay contiguous
vectors instead of stride-2 scalars. perf/NOTES.md ("Session 2: RoPE/KV") has the SASS counts.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._formats import cast_out, split_pairs
from ._launch import TL_DTYPE, cdiv, emulate_formats, next_pow2

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
    elif PAIR_KIND == 1:
        return (bits16(y1, tl.float16, EMULATE) | (bits16(y2, tl.float16, EMULATE) << 16)).to(tl.int32, bitcast=True)
    else:
        return (bits16(y1, tl.bfloat16, EMULATE) | (bits16(y2, tl.bfloat16, EMULATE) << 16)).to(tl.int32,
                                                                                              bitcast=True)


@triton.jit
def _rope_tile(src, dst, pos_ptr, cs_ptr, tb, hb, T, H, max_pos, s_t, s_h, d_t, d_h, rot_offset, D,
               HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, COPY: tl.constexpr,
               WORDS: tl.constexpr, PAIR_KIND: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Rotate tokens [tb*BLOCK_T, +BLOCK_T) x heads [hb*BLOCK_H, +BLOCK_H) of src [T, H, D] into dst.
    Element offsets are int64 (t * s_t can pass 2^31). WORDS (GPT-J only): s_t, s_h, d_t, d_h and rot_offset
    are even and both bases word-aligned, so pair i of a row is word (row + rot_offset) / 2 + i."""
    t = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < T
    pos = tl.load(pos_ptr + t, mask=tmask, other=0).to(tl.int64)
    ok = tmask & (pos >= 0) & (pos < max_pos)  # a bad position reads nothing and poisons the slice
    c, s = load_cos_sin(cs_ptr, pos, ok, HALF, HALF_P)
    c = c[:, None, :]
    s = s[:, None, :]
    i = tl.arange(0, HALF_P)
    rows_ok = tmask[:, None] & (h < H)[None, :]
    m = rows_ok[:, :, None] & (i < HALF)[None, None, :]
    src_row = (t * s_t)[:, None] + (h * s_h)[None, :]  # [BLOCK_T, BLOCK_H] element offsets, int64
    dst_row = (t * d_t)[:, None] + (h * d_h)[None, :]
    if WORDS:
        w = tl.load(word_ptr(src, PAIR_KIND) + ((src_row + rot_offset) >> 1)[:, :, None] + i[None, None, :],
                    mask=m, other=0)
        x1, x2 = split_pairs(w, PAIR_KIND)
        y1, y2 = rope_pairs(x1, x2, c, s, INVERSE)
        tl.store(word_ptr(dst, PAIR_KIND) + ((dst_row + rot_offset) >> 1)[:, :, None] + i[None, None, :],
                 join_pairs(y1, y2, PAIR_KIND, EMULATE), mask=m)
    else:
        o1, o2 = pair_offsets(rot_offset, HALF, HALF_P, IS_NEOX)
        x1 = load_f32(src + src_row[:, :, None] + o1[None, None, :], m, EMULATE)
        x2 = load_f32(src + src_row[:, :, None] + o2[None, None, :], m, EMULATE)
        y1, y2 = rope_pairs(x1, x2, c, s, INVERSE)
        tl.store(dst + dst_row[:, :, None] + o1[None, None, :], cast_out(y1, OUT_DTYPE, EMULATE), mask=m)
        tl.store(dst + dst_row[:, :, None] + o2[None, None, :], cast_out(y2, OUT_DTYPE, EMULATE), mask=m)
    if COPY:  # out of place with dims outside the rotary slice: they pass through unchanged (bit copy)
        d = tl.arange(0, D_P)
        keep = (d < D) & ((d < rot_offset) | (d >= rot_offset + 2 * HALF))
        pm = rows_ok[:, :, None] & keep[None, None, :]
        v = tl.load(src + src_row[:, :, None] + d[None, None, :], mask=pm)
        tl.store(dst + dst_row[:, :, None] + d[None, None, :], v, mask=pm)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, T, HQ, HK, max_pos,
                 q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh, rot_offset, D, n_q_hblocks,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, COPY: tl.constexpr,
                 WORDS: tl.constexpr, PAIR_KIND: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    # grid (token blocks, q head blocks + k head blocks)
    tb = tl.program_id(0)
    hb = tl.program_id(1)
    if hb < n_q_hblocks:
        _rope_tile(q_ptr, qo_ptr, pos_ptr, cs_ptr, tb, hb, T, HQ, max_pos, q_st, q_sh, qo_st, qo_sh, rot_offset, D,
                   HALF, HALF_P, D_P, BLOCK_T, BLOCK_H, IS_NEOX, INVERSE, COPY, WORDS, PAIR_KIND, OUT_DTYPE, EMULATE)
    else:
        _rope_tile(k_ptr, ko_ptr, pos_ptr, cs_ptr, tb, hb - n_q_hblocks, T, HK, max_pos, k_st, k_sh, ko_st, ko_sh,
                   rot_offset, D, HALF, HALF_P, D_P, BLOCK_T, BLOCK_H, IS_NEOX, INVERSE, COPY, WORDS, PAIR_KIND,
                   OUT_DTYPE, EMULATE)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    block_t: int  # tokens per program
    block_h: int  # heads per program
    num_warps: int


def rope_config(t: int, h: int, rot: int, device: torch.device) -> RopeConfig:
    """~4K rotary elements per program on the GPU (16 per thread at 4 warps: enough bytes in flight, and
    many programs for small T); the interpreter pays per program, so it takes up to 32K. Heads first (one
    cos/sin row serves all of a token's heads), then tokens."""
    target = 32768 if device.type == "cpu" else 4096
    rows = max(1, target // next_pow2(rot))
    block_h = min(next_pow2(max(h, 1)), rows)
    block_t = max(1, min(next_pow2(max(t, 1)), rows // block_h))
    return RopeConfig(block_t, block_h, 4)


def pairs_as_words(is_neox: bool, rot_offset: int, *tensors) -> bool:
    """GPT-J pairs can move as whole words when every row and the slice start at an even element of a
    word-aligned base (always true for contiguous tensors and their head views with an even rot_offset)."""
    if is_neox or rot_offset % 2:
        return False
    for x in tensors:
        if x.stride(0) % 2 or x.stride(1) % 2 or x.data_ptr() % (2 * x.element_size()):
            return False
    return True


def _launch(q, k, qo, ko, positions, cos_sin_cache, rot_offset, is_neox, inverse, copy):
    t, hq, d = q.shape
    hk = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if t == 0 or (hq == 0 and hk == 0) or half == 0:
        return
    cfg = rope_config(t, max(hq, hk), 2 * half, q.device)
    n_q = cdiv(hq, cfg.block_h)
    n_k = cdiv(hk, cfg.block_h)
    words = pairs_as_words(is_neox, rot_offset, q, k, qo, ko)
    _rope_kernel[(cdiv(t, cfg.block_t), n_q + n_k)](
        q, k, qo, ko, positions, cos_sin_cache, t, hq, hk, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        rot_offset, d, n_q,
        HALF=half, HALF_P=next_pow2(half), D_P=next_pow2(d), BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h,
        IS_NEOX=is_neox, INVERSE=inverse, COPY=copy and 2 * half < d, WORDS=words, PAIR_KIND=PAIR_KIND[q.dtype],
        OUT_DTYPE=TL_DTYPE[q.dtype], EMULATE=emulate_formats(q.device), num_warps=cfg.num_warps,
        enable_fp_fusion=False)


def rope(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, qo, ko, positions, cos_sin_cache, rot_offset, is_neox, inverse, True)
    return qo, ko


def rope_(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    if k is None:
        k = q[:, :0]
    _launch(q, k, q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, False)
