"""Paged KV-cache FP8 writes and gathers (Triton): generic E4M3 caches and the DeepSeek V3.2 / V4 byte
layouts, plus the fused RoPE + quantize + paged append for DeepSeek caches (q's RoPE in the same launch).

Contract: dispatch/reference/kv_cache.py; byte pictures: docs/kv_cache.md. The DeepSeek caches
are uint8 buffers; the kernels take typed views of the same storage (int16 for the bf16 RoPE part, int32
for V3.2's fp32 scales) so every store is a natural-width store, with byte offsets divided by the width.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops.contract.kv_cache import DS_LAYOUTS, DS_ROPE, DS_SCALE_FLOOR, DYNAMIC_EPS

from ._formats import amax_nan, cast_out, e4m3_decode_fast, e4m3_encode, split_pairs
from ._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2
from .rope import (
    PAIR_KIND,
    _rope_tile,
    bits16,
    join_pairs,
    load_cos_sin,
    load_f32,
    pair_offsets,
    pairs_as_words,
    rope_pairs,
    word_ptr,
)

ROPE: tl.constexpr = tl.constexpr(DS_ROPE)  # jit code reads module globals only as constexprs
SCALE_FLOOR: tl.constexpr = tl.constexpr(DS_SCALE_FLOOR)


GATHER_ELEMS = 4096  # output elements per program at prefill on the GPU (4 x 16-byte vectors per thread at 4 warps)
GATHER_MIN_PROGRAMS = 256  # ~2 per SM: below that many token blocks, smaller programs


@dataclasses.dataclass(frozen=True)
class GatherConfig:
    block_t: int  # tokens per program
    block_h: int  # heads per program (generic cache; 1 for DeepSeek)
    num_warps: int


def gather_config(tokens: int, block_h: int, row_p: int, vec: int, device: torch.device) -> GatherConfig:
    """Tile of a gather: block_h x row_p (power-of-two) output elements per token, vec elements per 16-byte
    vector. GPU: GATHER_ELEMS elements per program and 4 vectors per thread when there are enough tokens
    (T=16384, H*D=512: 2048 programs of 8 tokens, one wave at <= 32 registers); fewer tokens per program
    (one at decode, T <= 256) and one vector per thread otherwise, so that short batches still spread over
    the SMs (each program is one dependent slot -> cache -> out chain). Interpreter: up to 32K elements (it
    pays per program)."""
    row = block_h * row_p
    if device.type == "cpu":
        return GatherConfig(max(1, min(next_pow2(tokens), 32768 // row)), block_h, 4)
    block_t = max(1, min(GATHER_ELEMS // row, next_pow2(tokens // GATHER_MIN_PROGRAMS + 1) // 2))
    per_thread = 4 if block_t * row >= GATHER_ELEMS else 1
    return GatherConfig(block_t, block_h, max(1, min(8, block_t * row // (vec * 32 * per_thread))))


# ------------------------------------------------------------------------------------------ generic


@triton.jit
def _paged_write_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, scache_ptr, T, H, D, n_slots, BS,
                        x_st, x_sh, c_sb, c_so, c_sh, s_sb, s_so, s_sh, eps,
                        DYNAMIC: tl.constexpr, D_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                        EMULATE: tl.constexpr, ISSUE_FIRST: tl.constexpr):
    # grid (token blocks, head blocks): (token, head) from the program ids, the slot split once per token in
    # 32 bits (launcher: < 2^31 slots), so no per-row 64-bit division. x is loaded for every in-bounds row
    # (not only rows with a valid slot): its load then does not wait for the slot load, and the skipped rows'
    # values are never stored. ISSUE_FIRST: a barrier keeps ptxas from sinking the x loads behind the slot
    # math (see rope._rope_kernel).
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < T
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    d = tl.arange(0, D_P)
    xm = (tmask[:, None] & (h < H)[None, :])[:, :, None] & (d < D)[None, None, :]
    x = load_f32(x_ptr + (t * x_st)[:, None, None] + (h * x_sh)[None, :, None] + d[None, None, :], xm, EMULATE)
    if ISSUE_FIRST:
        tl.debug_barrier()
    ok = (tmask & (slot >= 0) & (slot < n_slots))[:, None] & (h < H)[None, :]  # -1 / past the cache: skipped
    s32 = slot.to(tl.int32)
    blk = (s32 // BS).to(tl.int64)
    off = (s32 % BS).to(tl.int64)
    m = ok[:, :, None] & (d < D)[None, None, :]
    if DYNAMIC:
        s = tl.math.div_rn(tl.maximum(amax_nan(x, 2), eps, propagate_nan=tl.PropagateNan.ALL), 448.0)
        tl.store(scache_ptr + (blk * s_sb + off * s_so)[:, None] + (h * s_sh)[None, :], s, mask=ok)
        q = tl.math.div_rn(x, s[:, :, None])  # s is not a power of two: a true IEEE division
    else:
        q = tl.math.div_rn(x, tl.load(scale_ptr))
    dst = cache_ptr + (blk * c_sb + off * c_so)[:, None, None] + (h * c_sh)[None, :, None] + d[None, None, :]
    tl.store(dst, e4m3_encode(q, EMULATE), mask=m)


@triton.jit
def _paged_gather_kernel(cache_ptr, slot_ptr, scale_ptr, scache_ptr, out_ptr, N, n_slots,
                         c_sb, c_so, c_sh, s_sb, s_so, s_sh, BS: tl.constexpr,
                         H: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr, DYNAMIC: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, VEC: tl.constexpr, SLOT32: tl.constexpr,
                         OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    # grid (token blocks, head blocks), tile [BLOCK_H, BLOCK_T, D_P]: (token, head) from the program ids, no
    # per-row division. Heads are the outer tile axis so that a thread's vectors repeat over heads of one
    # token: the slot load and split (by the constexpr block size: a shift or a multiply-high) and the
    # token's 64-bit offsets are done once per token and thread, not once per vector. Invalid rows fold into
    # the row's scale: codes load as 0 there and the scale becomes 0 (slot -1) or NaN (bad slot), so 0 * s
    # is the pad value with one multiply per element and no per-element select. E4M3 -> fp32 by the hardware
    # conversion (cvt e4m3x2 -> f16x2 -> f32, exact) instead of the integer decode.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tmask = t < N
    hmask = h < H
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0) & (slot < n_slots)
    if SLOT32:  # launcher: < 2^31 slots, so valid slots split in 32 bits
        s32 = slot.to(tl.int32)
        blk = (s32 // BS).to(tl.int64)
        off = (s32 % BS).to(tl.int64)
    else:
        blk = slot // BS
        off = slot % BS
    h64 = h.to(tl.int64)
    okh = hmask[:, None] & ok[None, :]  # [BLOCK_H, BLOCK_T]
    pad = tl.where(slot == -1, 0.0, float("nan"))[None, :]
    if DYNAMIC:
        s = tl.load(scache_ptr + (h64 * s_sh)[:, None] + (blk * s_sb + off * s_so)[None, :], mask=okh, other=0.0)
    else:
        s = tl.load(scale_ptr)  # a scalar; where() broadcasts it (adding it to zeros would turn -0 into +0)
    s = tl.where(ok[None, :], s, pad)
    # VEC = 16 bytes of output per thread: capping the codes' contiguity at VEC gives the code load (VEC
    # bytes) the store's layout, so codes -> values -> stores stay in registers (no shared-memory shuffle).
    d = tl.max_contiguous(tl.arange(0, D_P), VEC)
    if D == D_P:
        dm = tl.full([1, 1, D_P], 1, tl.int1)
    else:
        dm = (d < D)[None, None, :]
    src = cache_ptr + ((h64 * c_sh)[:, None] + (blk * c_sb + off * c_so)[None, :])[:, :, None] + d[None, None, :]
    codes = tl.load(src, mask=okh[:, :, None] & dm, other=0)
    v = e4m3_decode_fast(codes, EMULATE) * s[:, :, None]
    dst = out_ptr + (h * D)[:, None, None] + (t * (H * D))[None, :, None] + d[None, None, :]
    tl.store(dst, cast_out(v, OUT_DTYPE, EMULATE), mask=(hmask[:, None] & tmask[None, :])[:, :, None] & dm)


def _cache_slots(cache) -> int:
    return cache.shape[0] * cache.shape[1]


@dataclasses.dataclass(frozen=True)
class WriteConfig:
    block_t: int  # tokens per program
    block_h: int  # heads per program
    num_warps: int
    issue_first: bool = True  # barrier after the data loads (see _paged_write_kernel)


def write_config(t: int, h: int, d_p: int, device: torch.device) -> WriteConfig:
    """GPU: ~4K elements per program (8 tokens x 8 heads x 64 at GPT-OSS's kv shape), one token per program
    for short (decode) batches; interpreter: 32K."""
    target = 32768 if device.type == "cpu" else 4096
    block_h = min(next_pow2(h), max(1, target // d_p))
    block_t = 1 if (device.type != "cpu" and t <= 256) else max(1, min(next_pow2(t), target // (d_p * block_h)))
    return WriteConfig(block_t, block_h, 4 if block_t * block_h * d_p <= 4096 else 8)


def paged_kv_write_fp8(x, slot_mapping, cache, scale, scale_cache, cfg: WriteConfig | None = None):
    t, h, d = x.shape
    if t == 0 or h == 0 or d == 0:
        return
    if _cache_slots(cache) >= 2**31:
        raise ValueError("lowbit.paged_kv_write_fp8: argument 'cache': the kernel splits slots in 32 bits "
                         "(< 2^31 slots)")
    c = cache.view(torch.uint8)
    dynamic = scale is None
    sc = scale_cache if dynamic else c  # unused pointer when static
    d_p = next_pow2(d)
    cfg = cfg or write_config(t, h, d_p, x.device)
    block_t, block_h = cfg.block_t, cfg.block_h
    launch(_paged_write_kernel, (cdiv(t, block_t), cdiv(h, block_h)),
        x, slot_mapping, c, scale if scale is not None else x, sc, t, h, d, _cache_slots(cache), cache.shape[1],
        x.stride(0), x.stride(1), c.stride(0), c.stride(1), c.stride(2),
        *(scale_cache.stride() if dynamic else (0, 0, 0)), DYNAMIC_EPS,
        DYNAMIC=dynamic, D_P=d_p, BLOCK_T=block_t, BLOCK_H=block_h, EMULATE=emulate_formats(x.device),
        ISSUE_FIRST=cfg.issue_first, num_warps=cfg.num_warps)


def paged_kv_gather_fp8(cache, slots, scale, scale_cache, out_dtype, cfg: GatherConfig | None = None):
    n = slots.shape[0]
    _, _, h, d = cache.shape
    out = torch.empty(n, h, d, dtype=out_dtype, device=cache.device)
    if out.numel() == 0:
        return out
    c = cache.view(torch.uint8)
    dynamic = scale is None
    d_p = next_pow2(d)
    vec = min(16 // out.element_size(), d_p)
    n_slots = _cache_slots(cache)
    cfg = cfg or gather_config(n, min(next_pow2(h), max(1, GATHER_ELEMS // d_p)), d_p, vec, cache.device)
    launch(_paged_gather_kernel, (cdiv(n, cfg.block_t), cdiv(h, cfg.block_h)),
        c, slots, scale if scale is not None else out, scale_cache if dynamic else out, out, n,
        n_slots, c.stride(0), c.stride(1), c.stride(2), *(scale_cache.stride() if dynamic else (0, 0, 0)),
        BS=cache.shape[1], H=h, D=d, D_P=d_p, DYNAMIC=dynamic, BLOCK_T=cfg.block_t, BLOCK_H=cfg.block_h, VEC=vec,
        SLOT32=n_slots < 2**31, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(cache.device),
        num_warps=cfg.num_warps)
    return out


# ----------------------------------------------------------------------------------------- DeepSeek


@triton.jit
def _ds_token_offsets(slot, BS, block_stride, D_NOPE: tl.constexpr, NT: tl.constexpr, V4: tl.constexpr):
    """Byte offsets of a token's NoPE codes, scales and RoPE part (docs/kv_cache.md), int64.
    V4, per block: BS tokens x (448 E4M3 | 64 bf16), then BS x (7 E8M0 | 1 pad).
    V3.2, per token: 512 E4M3 | 4 fp32 | 64 bf16.
    The launchers guarantee num_blocks * block_size < 2^31, so the slot splits with a 32-bit division (a
    64-bit one is a ~70-instruction subroutine call); only masked-off lanes can hold larger values."""
    s32 = slot.to(tl.int32)
    blk = (s32 // BS).to(tl.int64)
    off = (s32 % BS).to(tl.int64)
    if V4:
        data = blk * block_stride + off * (D_NOPE + 2 * ROPE)
        scale_at = blk * block_stride + BS * (D_NOPE + 2 * ROPE) + off * 8
        rope_at = data + D_NOPE
    else:
        data = blk * block_stride + off * (D_NOPE + 4 * NT + 2 * ROPE)
        scale_at = data + D_NOPE
        rope_at = scale_at + 4 * NT
    return data, scale_at, rope_at


@triton.jit
def _ds_kv_tile(kv_ptr, slot_ptr, c8, c16, c32, pos_ptr, cs_ptr, tb, T, n_slots, BS, block_stride, kv_st,
                max_pos, D_NOPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, NT_P: tl.constexpr,
                V4: tl.constexpr, ROTATE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
                ALIGNED: tl.constexpr, KV_WORDS: tl.constexpr, KV_KIND: tl.constexpr, EMULATE: tl.constexpr,
                ISSUE_FIRST: tl.constexpr):
    """Quantize + write BLOCK_T tokens of kv [T, D_NOPE + 64] into a DeepSeek cache (optionally rotating
    the RoPE part first). Cache offsets in bytes, int64.

    ALIGNED: the cache base and block stride are multiples of 16 bytes. Every token record then starts
    16-byte aligned (656, 576, 528, 448 and 512 are multiples of 16; V4 scale rows of 8 bytes are 8-aligned),
    which the compiler cannot see through the slot gather; the hints let it emit 16-byte stores (the
    codes) instead of one store per byte, and the bf16 RoPE pairs go out as 32-bit words.
    KV_WORDS: GPT-J kv pairs can be loaded as words (even row stride, aligned base).
    Loads: kv (NoPE and RoPE part) for every in-bounds token, so they do not wait on the slot load (rows with
    a skipped slot are never stored), and (ISSUE_FIRST) a barrier keeps ptxas from sinking them behind the
    slot -> offsets and position -> (cos, sin) chains (see rope._rope_kernel)."""
    HALF: tl.constexpr = ROPE // 2
    tok = tb.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    slot = tl.load(slot_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    if ROTATE:
        pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    j = tl.arange(0, NT_P)
    e = tl.arange(0, TILE)
    col = j[:, None] * TILE + e[None, :]
    x = load_f32(kv_ptr + (tok * kv_st)[:, None, None] + col[None, :, :],
                 (tmask[:, None] & (j < NT)[None, :])[:, :, None], EMULATE)
    i = tl.arange(0, HALF)
    rm = tmask[:, None]
    src = (tok * kv_st + D_NOPE)[:, None]  # element offsets of the RoPE part
    if IS_NEOX:
        x1 = load_f32(kv_ptr + src + i[None, :], rm, EMULATE)
        x2 = load_f32(kv_ptr + src + HALF + i[None, :], rm, EMULATE)
    elif KV_WORDS:
        x1, x2 = split_pairs(tl.load(word_ptr(kv_ptr, KV_KIND) + (src >> 1) + i[None, :], mask=rm, other=0), KV_KIND)
    else:
        x1 = load_f32(kv_ptr + src + 2 * i[None, :], rm, EMULATE)
        x2 = load_f32(kv_ptr + src + 2 * i[None, :] + 1, rm, EMULATE)
    if ISSUE_FIRST:
        tl.debug_barrier()
    ok = tmask & (slot >= 0) & (slot < n_slots)
    data, scale_at, rope_at = _ds_token_offsets(slot, BS, block_stride, D_NOPE, NT, V4)
    if ALIGNED:
        data = tl.multiple_of(data, 16)
        rope_at = tl.multiple_of(rope_at, 16)
        scale_at = tl.multiple_of(scale_at, 8 if V4 else 16)

    # NoPE: per-tile power-of-two scales, E4M3 codes
    tile_ok = ok[:, None] & (j < NT)[None, :]
    s = tl.maximum(tl.math.div_rn(amax_nan(x, 2), 448.0), SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    b = s.to(tl.uint32, bitcast=True)
    finite = (b & 0x7F800000) != 0x7F800000
    b = tl.where(finite, (b + 0x7FFFFF) & 0x7F800000, b)  # round up to a power of two; NaN/Inf kept
    # s is a power of two in [2^-13, 2^120] (or Inf/NaN), so 1/s is exact and x * (1/s) rounds exactly as
    # the reference's x / s (Inf: both give +-0 or NaN; NaN: NaN): one multiply instead of an IEEE division.
    inv = tl.math.div_rn(1.0, b.to(tl.float32, bitcast=True))
    codes = e4m3_encode(x * inv[:, :, None], EMULATE)
    tl.store(c8 + data[:, None, None] + col[None, :, :], codes, mask=tile_ok[:, :, None])
    if V4:
        e8m0 = tl.where((j < NT)[None, :], (b >> 23) & 0xFF, 0).to(tl.uint8)  # 7 exponents + the zero pad
        tl.store(c8 + scale_at[:, None] + j[None, :], e8m0, mask=ok[:, None])
    else:
        tl.store(c32 + (scale_at >> 2)[:, None] + j[None, :], b.to(tl.int32, bitcast=True), mask=tile_ok)

    # RoPE part: bf16, rotated first when fused
    rm = ok[:, None]
    if ROTATE:
        c, sn = load_cos_sin(cs_ptr, pos, tmask & (pos >= 0) & (pos < max_pos), HALF, HALF)
        x1, x2 = rope_pairs(x1, x2, c, sn, False)
    if ALIGNED and not IS_NEOX:
        r32 = tl.multiple_of(rope_at >> 2, 4)
        tl.store(c32 + r32[:, None] + i[None, :], join_pairs(x1, x2, 0, EMULATE), mask=rm)
    else:
        o1, o2 = pair_offsets(0, HALF, HALF, IS_NEOX)
        r16 = rope_at >> 1
        if ALIGNED:
            r16 = tl.multiple_of(r16, 8)
        tl.store(c16 + r16[:, None] + o1[None, :], bits16(x1, tl.bfloat16, EMULATE).to(tl.int16), mask=rm)
        tl.store(c16 + r16[:, None] + o2[None, :], bits16(x2, tl.bfloat16, EMULATE).to(tl.int16), mask=rm)


@triton.jit
def _ds_write_kernel(kv_ptr, slot_ptr, c8, c16, c32, pos_ptr, cs_ptr, q_ptr, T, n_slots, BS, block_stride, kv_st,
                     max_pos, HQ, q_st, q_sh, q_rope_at,
                     D_NOPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, NT_P: tl.constexpr,
                     V4: tl.constexpr, ROTATE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_H: tl.constexpr, ALIGNED: tl.constexpr, KV_WORDS: tl.constexpr, KV_KIND: tl.constexpr,
                     Q_WORDS: tl.constexpr, Q_KIND: tl.constexpr, Q_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                     ISSUE_FIRST: tl.constexpr, HAS_Q: tl.constexpr = True, CS_ROWS: tl.constexpr = False,
                     EVICT: tl.constexpr = ""):
    # grid (token blocks, 1 + q head blocks): column 0 writes the cache, the others (fused op with q) rotate
    # BLOCK_T tokens x BLOCK_H heads of q's RoPE part in place, so q's heads spread over many programs.
    # HAS_Q (constexpr): without q the q branch is not compiled at all; compiled but dead it would still set the
    # kernel's register count and shared memory (ds_kv_write on sm_90: 126 registers = 4 CTAs/SM and 2 KB smem
    # with it; docs/kv_cache.md).
    tb = tl.program_id(0)
    hb = tl.program_id(1)
    if HAS_Q:
        kv_program = hb == 0
    else:
        kv_program: tl.constexpr = True  # a compile-time branch: the q part below is not compiled
    if kv_program:
        _ds_kv_tile(kv_ptr, slot_ptr, c8, c16, c32, pos_ptr, cs_ptr, tb, T, n_slots, BS, block_stride, kv_st,
                    max_pos, D_NOPE, TILE, NT, NT_P, V4, ROTATE, IS_NEOX, BLOCK_T, ALIGNED, KV_WORDS, KV_KIND,
                    EMULATE, ISSUE_FIRST)
    else:
        _rope_tile(q_ptr, q_ptr, pos_ptr, cs_ptr, tb, hb - 1, T, HQ, max_pos, q_st, q_sh, q_st, q_sh, q_rope_at, 0,
                   ROPE // 2, ROPE // 2, 1, BLOCK_T, BLOCK_H, IS_NEOX, False, False, Q_WORDS, Q_KIND, Q_DTYPE,
                   EMULATE, ISSUE_FIRST, CS_ROWS, EVICT)


@dataclasses.dataclass(frozen=True)
class DsConfig:
    block_t: int  # tokens per program (kv column and q programs alike)
    block_h: int  # q heads per program (fused op with q)
    num_warps: int
    issue_first: bool = True  # barrier after the data loads (see _ds_kv_tile, rope._rope_kernel)
    cs_rows: bool = False  # q programs: (cos, sin) once per token, broadcast over the heads (rope.RopeConfig)
    evict_first: bool = False  # q programs: evict_first hint on q's loads and stores


def ds_config(t: int, device: torch.device, with_q: bool = True) -> DsConfig:
    """GPU: 4 tokens (~2.3K kv elements) and 16 q heads (4 x 16 x 64 = 4K RoPE elements) per program; 8 tokens
    for a kv-only write (6-9% faster at T=16384 on the H200; with q, 8 tokens at 8 warps is not faster:
    docs/kv_cache.md, alternatives measured); one token per program for short (decode) batches so the work
    spreads over the SMs. Interpreter: big tiles (it pays per program)."""
    if device.type == "cpu":
        return DsConfig(32, 16, 4)
    return DsConfig(1 if t <= 256 else 4 if with_q else 8, 16, 4)


def _ds_launch(kv, slot_mapping, cache, layout, positions, cos_sin_cache, q, is_neox, cfg=None):
    t = kv.shape[0]
    if t == 0:
        return
    L = DS_LAYOUTS[layout]
    c8 = cache.view(torch.uint8)
    n_slots = cache.shape[0] * cache.shape[1]
    if n_slots >= 2**31:
        raise ValueError(f"lowbit.{'ds_kv_write' if positions is None else 'ds_rope_quant_append'}: argument "
                         f"'cache': {n_slots} slots; the kernel splits slots in 32 bits (< 2^31 slots)")
    # typed views of the same bytes (the op checks guarantee the alignment these need)
    aligned = c8.data_ptr() % 16 == 0 and (cache.shape[0] == 1 or c8.stride(0) % 16 == 0)
    c16 = c8.view(torch.int16)
    c32 = c8.view(torch.int32) if layout == "v32" or aligned else c16
    rotate = positions is not None
    hq = 0 if q is None else q.shape[1]
    cfg = cfg or ds_config(t, kv.device, q is not None)
    block_t, block_h = cfg.block_t, cfg.block_h
    n_q = cdiv(hq, block_h) if hq else 0
    q_arg = q if q is not None else kv
    q_rope_at = (q.shape[-1] - DS_ROPE) if q is not None else 0
    q_words = q is not None and pairs_as_words(is_neox, q_rope_at, q)
    kv_words = not is_neox and kv.stride(0) % 2 == 0 and kv.data_ptr() % (2 * kv.element_size()) == 0
    launch(_ds_write_kernel, (cdiv(t, block_t), 1 + n_q),
        kv, slot_mapping, c8, c16, c32, positions if rotate else slot_mapping,
        cos_sin_cache if rotate else kv, q_arg, t, n_slots, cache.shape[1], c8.stride(0),
        kv.stride(0), cos_sin_cache.shape[0] if rotate else 0, hq,
        q_arg.stride(0), q_arg.stride(1) if q is not None else 0, q_rope_at,
        D_NOPE=L.d_nope, TILE=L.tile, NT=L.num_tiles, NT_P=next_pow2(L.num_tiles),
        V4=layout == "v4", ROTATE=rotate, IS_NEOX=is_neox, BLOCK_T=block_t, BLOCK_H=block_h, ALIGNED=aligned,
        KV_WORDS=kv_words, KV_KIND=PAIR_KIND[kv.dtype], Q_WORDS=q_words, Q_KIND=PAIR_KIND[q_arg.dtype],
        Q_DTYPE=TL_DTYPE[q_arg.dtype], EMULATE=emulate_formats(kv.device), ISSUE_FIRST=cfg.issue_first,
        HAS_Q=n_q > 0, CS_ROWS=cfg.cs_rows, EVICT="evict_first" if cfg.evict_first else "",
        num_warps=cfg.num_warps, enable_fp_fusion=False)


def ds_kv_write(kv, slot_mapping, cache, layout, cfg: DsConfig | None = None):
    _ds_launch(kv, slot_mapping, cache, layout, None, None, None, False, cfg)


def ds_rope_quant_append(kv, positions, cos_sin_cache, slot_mapping, cache, layout, q, is_neox,
                         cfg: DsConfig | None = None):
    _ds_launch(kv, slot_mapping, cache, layout, positions, cos_sin_cache, q, is_neox, cfg)


@triton.jit
def _bf16_bits_to_f32(bits16):
    """int16 bf16 bits -> fp32, exact (on the bits: the interpreter's bf16 -> fp32 cast mangles subnormals)."""
    return (bits16.to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _ds_gather_kernel(c8, c16, c32, slot_ptr, out_ptr, N, n_slots, block_stride, BS: tl.constexpr,
                      D_NOPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, NT_P: tl.constexpr,
                      V4: tl.constexpr, BLOCK_T: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
                      OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """BLOCK_T tokens per program, tile [NT_P, BLOCK_T, TILE]: NoPE tile j of each token (the tile index outer,
    so a thread's vectors repeat over the tiles of one token and the slot split and 64-bit token offsets
    happen once per token and thread). V4 (7 tiles of 64) puts its RoPE part in the 8th tile slot, so the
    tile is the whole 512-wide output row; V3.2 (4 tiles of 128) adds a [BLOCK_T, 64] RoPE tile. Invalid
    tokens fold into the tile scale (codes and RoPE load as 0; scale 0 for slot -1, NaN for a bad slot): one
    multiply per element, no per-element select. E4M3 -> fp32 by the hardware conversion (exact; NaN codes
    give NaN) instead of the integer decode, which was most of the old kernel's ~1 warp instruction per
    element. ALIGNED: as in _ds_kv_tile (16-byte records)."""
    D: tl.constexpr = D_NOPE + ROPE
    MERGED: tl.constexpr = NT_P == NT + 1 and TILE == ROPE
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < N
    slot = tl.load(slot_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0) & (slot < n_slots)
    pad = tl.where(slot == -1, 0.0, float("nan"))  # per token: slot -1 reads zeros, a bad slot NaN
    data, scale_at, rope_at = _ds_token_offsets(slot, BS, block_stride, D_NOPE, NT, V4)
    r16 = rope_at >> 1  # element offset of the RoPE part in the int16 view
    if ALIGNED:
        data = tl.multiple_of(data, 16)
        r16 = tl.multiple_of(r16, 8)
        scale_at = tl.multiple_of(scale_at, 8 if V4 else 16)
    j = tl.arange(0, NT_P)
    # VEC = 16 bytes of output per thread; capping the contiguity at VEC gives the byte loads the stores'
    # layout (VEC codes per thread), so nothing goes through shared memory between load and store.
    e = tl.max_contiguous(tl.arange(0, TILE), VEC)
    col = (j[:, None] * TILE + e[None, :])[:, None, :]  # [NT_P, 1, TILE] output column
    sm = (j < NT)[:, None] & ok[None, :]  # [NT_P, BLOCK_T]
    if V4:  # E8M0: 0xFF is NaN, 0 is 2^-127 (an fp32 subnormal), else the byte is the fp32 exponent field
        eb = tl.load(c8 + j[:, None] + scale_at[None, :], mask=sm, other=127).to(tl.uint32)
        sb = tl.where(eb == 0xFF, 0x7FC00000, tl.where(eb == 0, 0x00400000, eb << 23))
        s = sb.to(tl.float32, bitcast=True)
    else:
        s = tl.load(c32 + j[:, None] + (scale_at >> 2)[None, :], mask=sm, other=0).to(tl.float32, bitcast=True)
    if MERGED:
        s = tl.where((j < NT)[:, None], s, 1.0)  # the RoPE slot: bf16 values times 1 (exact)
    s = tl.where(ok[None, :], s, pad[None, :])
    codes = tl.load(c8 + data[None, :, None] + col, mask=sm[:, :, None], other=0)
    v = e4m3_decode_fast(codes, EMULATE)
    if MERGED:
        rm = ((j == NT)[:, None] & ok[None, :])[:, :, None]
        rb = tl.load(c16 + r16[None, :, None] + (col - D_NOPE), mask=rm, other=0)  # col - D_NOPE = e in tile NT
        v = tl.where((j < NT)[:, None, None], v, _bf16_bits_to_f32(rb))
        om = tmask[None, :, None]
    else:
        om = (j < NT)[:, None, None] & tmask[None, :, None]
    v = v * s[:, :, None]
    tl.store(out_ptr + (tok * D)[None, :, None] + col, cast_out(v, OUT_DTYPE, EMULATE), mask=om)
    if not MERGED:
        r = tl.max_contiguous(tl.arange(0, ROPE), VEC)
        rb = tl.load(c16 + r16[:, None] + r[None, :], mask=ok[:, None], other=0)
        rv = _bf16_bits_to_f32(rb) * tl.where(ok, 1.0, pad)[:, None]
        tl.store(out_ptr + (tok * D + D_NOPE)[:, None] + r[None, :], cast_out(rv, OUT_DTYPE, EMULATE),
                 mask=tmask[:, None])


def ds_kv_gather(cache, slots, layout, out_dtype, cfg: GatherConfig | None = None):
    L = DS_LAYOUTS[layout]
    n = slots.shape[0]
    out = torch.empty(n, L.d, dtype=out_dtype, device=cache.device)
    if n == 0:
        return out
    c8 = cache.view(torch.uint8)
    n_slots = cache.shape[0] * cache.shape[1]
    if n_slots >= 2**31:
        raise ValueError("lowbit.ds_kv_gather: argument 'cache': the kernel splits slots in 32 bits (< 2^31 slots)")
    aligned = c8.data_ptr() % 16 == 0 and (cache.shape[0] == 1 or c8.stride(0) % 16 == 0)
    c16 = c8.view(torch.int16)
    c32 = c8.view(torch.int32) if layout == "v32" else c16
    nt_p = next_pow2(L.num_tiles + (1 if layout == "v4" else 0))  # V4: 7 NoPE tiles + the RoPE part
    vec = 16 // out.element_size()
    cfg = cfg or gather_config(n, 1, nt_p * L.tile, vec, cache.device)
    launch(_ds_gather_kernel, (cdiv(n, cfg.block_t),),
        c8, c16, c32, slots, out, n, n_slots, c8.stride(0), BS=cache.shape[1],
        D_NOPE=L.d_nope, TILE=L.tile, NT=L.num_tiles, NT_P=nt_p, V4=layout == "v4", BLOCK_T=cfg.block_t, VEC=vec,
        ALIGNED=aligned, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(cache.device),
        num_warps=cfg.num_warps)
    return out
