"""Rotary position embedding (Triton): q and k in one launch, any head strides, NeoX or GPT-J pairs,
a rotary slice anywhere in the head, forward or inverse, in place or out of place.

Contract: dispatch/reference/rope.py. Bit-exact with it: fp32 products and sums each rounded once, which
needs `enable_fp_fusion=False` at launch (Triton otherwise contracts x*c - y*s into an FMA on the GPU and
the last bit can differ). The kernel is memory bound; the extra instructions cost nothing measurable.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._formats import cast_out
from ._launch import TL_DTYPE, emulate_formats


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
