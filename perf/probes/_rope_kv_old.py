"""Session-1 RoPE and DeepSeek-write kernels, kept verbatim as the "old" side of perf/probes/rope_kv_variants.py
(commit 0bcc153: triton_ops/rope.py and the DeepSeek write part of triton_ops/kv_cache.py). Not used by the ops."""

# ruff: noqa
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from dispatch.reference.kv_cache import DS_LAYOUTS, DS_ROPE, DS_SCALE_FLOOR, DYNAMIC_EPS
from triton_ops._formats import amax_nan, cast_out, e4m3_encode
from triton_ops._launch import TL_DTYPE, emulate_formats

ROPE: tl.constexpr = tl.constexpr(DS_ROPE)
SCALE_FLOOR: tl.constexpr = tl.constexpr(DS_SCALE_FLOOR)


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
def _rope_block(src, dst, pos_ptr, cs_ptr, rb, T, H, max_pos, s_t, s_h, d_t, d_h, rot_offset, D,
                HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_R: tl.constexpr,
                IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, COPY: tl.constexpr,
                OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < T * H
    t = rows // H
    h = rows % H
    src_row = src + (t * s_t + h * s_h)[:, None]
    dst_row = dst + (t * d_t + h * d_h)[:, None]
    pos = tl.load(pos_ptr + t, mask=rmask, other=0).to(tl.int64)
    ok = rmask & (pos >= 0) & (pos < max_pos)  # a bad position reads nothing and poisons the slice
    c, s = load_cos_sin(cs_ptr, pos, ok, HALF, HALF_P)
    o1, o2 = pair_offsets(rot_offset, HALF, HALF_P, IS_NEOX)
    m = rmask[:, None] & (tl.arange(0, HALF_P) < HALF)[None, :]
    x1 = load_f32(src_row + o1[None, :], m, EMULATE)
    x2 = load_f32(src_row + o2[None, :], m, EMULATE)
    y1, y2 = rope_pairs(x1, x2, c, s, INVERSE)
    tl.store(dst_row + o1[None, :], cast_out(y1, OUT_DTYPE, EMULATE), mask=m)
    tl.store(dst_row + o2[None, :], cast_out(y2, OUT_DTYPE, EMULATE), mask=m)
    if COPY:  # out of place: the dims outside the rotary slice pass through unchanged (bit copy)
        d = tl.arange(0, D_P)
        keep = (d < D) & ((d < rot_offset) | (d >= rot_offset + 2 * HALF))
        pm = rmask[:, None] & keep[None, :]
        v = tl.load(src_row + d[None, :], mask=pm)
        tl.store(dst_row + d[None, :], v, mask=pm)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr, T, HQ, HK, max_pos,
                 q_st, q_sh, k_st, k_sh, qo_st, qo_sh, ko_st, ko_sh, rot_offset, D, n_q_progs,
                 HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_R: tl.constexpr,
                 IS_NEOX: tl.constexpr, INVERSE: tl.constexpr, COPY: tl.constexpr,
                 OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    # One grid: the first n_q_progs programs rotate q's (token, head) rows, the rest k's.
    pid = tl.program_id(0)
    if pid < n_q_progs:
        _rope_block(q_ptr, qo_ptr, pos_ptr, cs_ptr, pid, T, HQ, max_pos, q_st, q_sh, qo_st, qo_sh, rot_offset, D,
                    HALF, HALF_P, D_P, BLOCK_R, IS_NEOX, INVERSE, COPY, OUT_DTYPE, EMULATE)
    else:
        _rope_block(k_ptr, ko_ptr, pos_ptr, cs_ptr, pid - n_q_progs, T, HK, max_pos, k_st, k_sh, ko_st, ko_sh,
                    rot_offset, D, HALF, HALF_P, D_P, BLOCK_R, IS_NEOX, INVERSE, COPY, OUT_DTYPE, EMULATE)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    block_r: int  # (token, head) rows per program
    num_warps: int


def rope_config(rows: int, d: int, device: torch.device) -> RopeConfig:
    """~4K elements of head per program on the GPU (enough bytes in flight per SM at 4 warps, and many
    programs for small T); the interpreter pays per program, so it takes up to 32K."""
    target = 32768 if device.type == "cpu" else 4096
    block_r = max(1, min(triton.next_power_of_2(max(rows, 1)), target // triton.next_power_of_2(d)))
    return RopeConfig(block_r, 4)


def _launch(q, k, qo, ko, positions, cos_sin_cache, rot_offset, is_neox, inverse, copy):
    t, hq, d = q.shape
    hk = k.shape[1]
    half = cos_sin_cache.shape[1] // 2
    if t == 0 or (hq == 0 and hk == 0) or half == 0:
        return
    cfg = rope_config(max(hq, hk) * t, d, q.device)
    n_q = triton.cdiv(t * hq, cfg.block_r)
    n_k = triton.cdiv(t * hk, cfg.block_r)
    _rope_kernel[(n_q + n_k,)](
        q, k, qo, ko, positions, cos_sin_cache, t, hq, hk, cos_sin_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
        rot_offset, d, n_q,
        HALF=half, HALF_P=triton.next_power_of_2(half), D_P=triton.next_power_of_2(d), BLOCK_R=cfg.block_r,
        IS_NEOX=is_neox, INVERSE=inverse, COPY=copy, OUT_DTYPE=TL_DTYPE[q.dtype],
        EMULATE=emulate_formats(q.device), num_warps=cfg.num_warps, enable_fp_fusion=False)


def rope(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(q, k, qo, ko, positions, cos_sin_cache, rot_offset, is_neox, inverse, True)
    return qo, ko


def rope_(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    if k is None:
        k = q[:, :0]
    _launch(q, k, q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, False)


@dataclasses.dataclass(frozen=True)
class RowsConfig:
    block_r: int  # rows (tokens, or (token, head) pairs) per program
    num_warps: int


def rows_config(rows: int, row_elems: int, device: torch.device) -> RowsConfig:
    """~4K elements per program on the GPU (8 KB of bf16 in flight at 4 warps); the interpreter pays per
    program, so up to 32K there."""
    target = 32768 if device.type == "cpu" else 4096
    block_r = max(1, min(triton.next_power_of_2(max(rows, 1)), target // triton.next_power_of_2(row_elems)))
    return RowsConfig(block_r, 4 if block_r * row_elems <= 4096 else 8)


@triton.jit
def _ds_token_offsets(slot, BS, block_stride, D_NOPE: tl.constexpr, NT: tl.constexpr, V4: tl.constexpr):
    """Byte offsets of a token's NoPE codes, scales and RoPE part (docs/kv_cache_layouts.md), int64.
    V4, per block: BS tokens x (448 E4M3 | 64 bf16), then BS x (7 E8M0 | 1 pad).
    V3.2, per token: 512 E4M3 | 4 fp32 | 64 bf16."""
    blk = slot // BS
    off = slot % BS
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
def _ds_token_block(kv_ptr, slot_ptr, c8, c16, c32, pos_ptr, cs_ptr, pid, T, n_slots, BS, block_stride, kv_st,
                    max_pos, D_NOPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, NT_P: tl.constexpr,
                    V4: tl.constexpr, ROTATE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
                    EMULATE: tl.constexpr):
    """Quantize + write BLOCK_T tokens of kv [T, D_NOPE + 64] into a DeepSeek cache (optionally rotating
    the RoPE part first). All offsets in bytes, int64."""
    HALF: tl.constexpr = ROPE // 2
    tok = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = tok < T
    slot = tl.load(slot_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    ok = tmask & (slot >= 0) & (slot < n_slots)
    data, scale_at, rope_at = _ds_token_offsets(slot, BS, block_stride, D_NOPE, NT, V4)

    # NoPE: per-tile power-of-two scales, E4M3 codes
    j = tl.arange(0, NT_P)
    e = tl.arange(0, TILE)
    col = j[:, None] * TILE + e[None, :]
    nm = ok[:, None, None] & (j < NT)[None, :, None] & (e < TILE)[None, None, :]
    x = load_f32(kv_ptr + tok[:, None, None] * kv_st + col[None, :, :], nm, EMULATE)
    s = tl.maximum(tl.math.div_rn(amax_nan(x, 2), 448.0), SCALE_FLOOR, propagate_nan=tl.PropagateNan.ALL)
    b = s.to(tl.uint32, bitcast=True)
    finite = (b & 0x7F800000) != 0x7F800000
    b = tl.where(finite, (b + 0x7FFFFF) & 0x7F800000, b)  # round up to a power of two; NaN/Inf kept
    s = b.to(tl.float32, bitcast=True)
    codes = e4m3_encode(tl.math.div_rn(x, s[:, :, None]), EMULATE)
    tl.store(c8 + data[:, None, None] + col[None, :, :], codes, mask=nm)
    if V4:
        e8m0 = tl.where((j < NT)[None, :], (b >> 23) & 0xFF, 0).to(tl.uint8)
        sm = ok[:, None] & (j < 8)[None, :]
        tl.store(c8 + scale_at[:, None] + j[None, :], e8m0, mask=sm)
    else:
        sm = ok[:, None] & (j < NT)[None, :]
        tl.store(c32 + (scale_at // 4)[:, None] + j[None, :], b.to(tl.int32, bitcast=True), mask=sm)

    # RoPE part: bf16, rotated first when fused
    o1, o2 = pair_offsets(0, HALF, HALF, IS_NEOX)
    rm = ok[:, None] & (o1 < ROPE)[None, :]
    src = kv_ptr + tok[:, None] * kv_st + D_NOPE
    x1 = load_f32(src + o1[None, :], rm, EMULATE)
    x2 = load_f32(src + o2[None, :], rm, EMULATE)
    if ROTATE:
        pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
        c, sn = load_cos_sin(cs_ptr, pos, tmask & (pos >= 0) & (pos < max_pos), HALF, HALF)
        x1, x2 = rope_pairs(x1, x2, c, sn, False)
    y1 = cast_out(x1, tl.bfloat16, EMULATE).to(tl.int16, bitcast=True)
    y2 = cast_out(x2, tl.bfloat16, EMULATE).to(tl.int16, bitcast=True)
    r16 = c16 + (rope_at // 2)[:, None]
    tl.store(r16 + o1[None, :], y1, mask=rm)
    tl.store(r16 + o2[None, :], y2, mask=rm)


@triton.jit
def _ds_write_kernel(kv_ptr, slot_ptr, c8, c16, c32, pos_ptr, cs_ptr, q_ptr, T, n_slots, BS, block_stride, kv_st,
                     max_pos, HQ, q_st, q_sh, q_rope_at, n_kv_progs,
                     D_NOPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, NT_P: tl.constexpr,
                     V4: tl.constexpr, ROTATE: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_Q: tl.constexpr, Q_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    # Programs [0, n_kv_progs) write the cache; the rest (fused op with q only) rotate q's RoPE in place.
    pid = tl.program_id(0)
    if pid < n_kv_progs:
        _ds_token_block(kv_ptr, slot_ptr, c8, c16, c32, pos_ptr, cs_ptr, pid, T, n_slots, BS, block_stride, kv_st,
                        max_pos, D_NOPE, TILE, NT, NT_P, V4, ROTATE, IS_NEOX, BLOCK_T, EMULATE)
    else:
        _rope_block(q_ptr, q_ptr, pos_ptr, cs_ptr, pid - n_kv_progs, T, HQ, max_pos, q_st, q_sh, q_st, q_sh,
                    q_rope_at, 0, ROPE // 2, ROPE // 2, 1, BLOCK_Q, IS_NEOX, False, False, Q_DTYPE, EMULATE)


def _ds_launch(kv, slot_mapping, cache, layout, positions, cos_sin_cache, q, is_neox):
    t = kv.shape[0]
    L = DS_LAYOUTS[layout]
    c8 = cache.view(torch.uint8)
    # typed views of the same bytes (the op checks guarantee the alignment these need)
    c16 = c8.view(torch.int16)
    c32 = c8.view(torch.int32) if layout == "v32" else c16
    rotate = positions is not None
    hq = 0 if q is None else q.shape[1]
    if t == 0:
        return
    cfg = rows_config(t, L.d, kv.device)
    n_kv = triton.cdiv(t, cfg.block_r)
    qcfg = rows_config(t * hq, DS_ROPE, kv.device)
    n_q = triton.cdiv(t * hq, qcfg.block_r) if hq else 0
    q_arg = q if q is not None else kv
    _ds_write_kernel[(n_kv + n_q,)](
        kv, slot_mapping, c8, c16, c32, positions if rotate else slot_mapping,
        cos_sin_cache if rotate else kv, q_arg, t, cache.shape[0] * cache.shape[1], cache.shape[1], c8.stride(0),
        kv.stride(0), cos_sin_cache.shape[0] if rotate else 0, hq,
        q_arg.stride(0), q_arg.stride(1) if q is not None else 0, (q.shape[-1] - DS_ROPE) if q is not None else 0,
        n_kv, D_NOPE=L.d_nope, TILE=L.tile, NT=L.num_tiles, NT_P=triton.next_power_of_2(L.num_tiles),
        V4=layout == "v4", ROTATE=rotate, IS_NEOX=is_neox, BLOCK_T=cfg.block_r, BLOCK_Q=qcfg.block_r,
        Q_DTYPE=TL_DTYPE[q_arg.dtype], EMULATE=emulate_formats(kv.device), num_warps=cfg.num_warps,
        enable_fp_fusion=False)


def ds_kv_write(kv, slot_mapping, cache, layout):
    _ds_launch(kv, slot_mapping, cache, layout, None, None, None, False)


def ds_rope_quant_append(kv, positions, cos_sin_cache, slot_mapping, cache, layout, q, is_neox):
    _ds_launch(kv, slot_mapping, cache, layout, positions, cos_sin_cache, q, is_neox)


@triton.jit
def _paged_write_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, scache_ptr, T, H, D, n_slots, BS,
                        x_st, x_sh, c_sb, c_so, c_sh, s_sb, s_so, s_sh, eps,
                        DYNAMIC: tl.constexpr, D_P: tl.constexpr, BLOCK_R: tl.constexpr, EMULATE: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < T * H
    t = rows // H
    h = rows % H
    slot = tl.load(slot_ptr + t, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (slot >= 0) & (slot < n_slots)  # -1 (and anything past the cache) is skipped
    blk = slot // BS
    off = slot % BS
    d = tl.arange(0, D_P)
    m = ok[:, None] & (d < D)[None, :]
    x = load_f32(x_ptr + (t * x_st + h * x_sh)[:, None] + d[None, :], m, EMULATE)
    if DYNAMIC:
        s = tl.math.div_rn(tl.maximum(amax_nan(x, 1), eps, propagate_nan=tl.PropagateNan.ALL), 448.0)
        tl.store(scache_ptr + blk * s_sb + off * s_so + h * s_sh, s, mask=ok)
        q = tl.math.div_rn(x, s[:, None])
    else:
        q = tl.math.div_rn(x, tl.load(scale_ptr))
    dst = cache_ptr + (blk * c_sb + off * c_so + h * c_sh)[:, None] + d[None, :]
    tl.store(dst, e4m3_encode(q, EMULATE), mask=m)


def _cache_slots(cache) -> int:
    return cache.shape[0] * cache.shape[1]


def paged_kv_write_fp8(x, slot_mapping, cache, scale, scale_cache):
    t, h, d = x.shape
    if t == 0 or h == 0 or d == 0:
        return
    c = cache.view(torch.uint8)
    dynamic = scale is None
    sc = scale_cache if dynamic else c  # unused pointer when static
    cfg = rows_config(t * h, d, x.device)
    _paged_write_kernel[(triton.cdiv(t * h, cfg.block_r),)](
        x, slot_mapping, c, scale if scale is not None else x, sc, t, h, d, _cache_slots(cache), cache.shape[1],
        x.stride(0), x.stride(1), c.stride(0), c.stride(1), c.stride(2),
        *(scale_cache.stride() if dynamic else (0, 0, 0)), DYNAMIC_EPS,
        DYNAMIC=dynamic, D_P=triton.next_power_of_2(d), BLOCK_R=cfg.block_r, EMULATE=emulate_formats(x.device),
        num_warps=cfg.num_warps)
