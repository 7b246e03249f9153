"""Gather of a paged K / V cache into contiguous varlen K / V (Triton): the first step of the gathered paged-prefix
prefill (dispatch/composed/paged_prefill.py composes it with a contiguous forward and the flagged fixup).

Contract: dispatch/reference/attention.py `gather_paged` (positions 0..n_b-1 of sequence b read through its
block-table row), with n_b = clamp(seqused_k[b], 0, capacity) and capacity = block_table.shape[1] * block_size.

Layout of the result (static sizes, no host read of a device value): k (B * capacity + PAD_ROWS, Hkv, Dqk) and v
(B * capacity + PAD_ROWS, Hkv, Dv) in the output dtype; sequence b owns rows cu_k[b]:cu_k[b + 1] with
cu_k = [0, cumsum(n)] (computed on the device); the PAD_ROWS rows after cu_k[B] are written as zeros, the rest
never. The buffers are sized by the block table's width: the op's arguments bound the keys by nothing smaller
without reading seqused_k on the host. With a sliding window (window_left >= 0) the keys no query sees, those
before n_b - Sq_b - window_left, are left out (Sq_b from cu_seqlens_q, on the device): bottom-right alignment
keeps the visibility of the rest, so a 128-key window gathers about Sq_b + 128 keys per sequence whatever its
prefix.

FP8 E4M3 caches (float8_e4m3fn or uint8 bytes) are dequantized in the same pass: value = code * scale (per-tensor
fp32 scale), rounded once to the output dtype (RNE). 16-bit caches without scales are copied bit for bit.

Keys the contiguous kernel cannot mask: a page id outside [0, num_blocks) (its rows are written as zeros, never
read) and seqused_k[b] past the capacity. Either sets flags[b] = 1 (flags must start at 0): the caller recomputes
those sequences with a kernel that masks per key (the plain paged prefill, `FLAGGED`).

Shape of the work: one program per (BLOCK_T positions, sequence); the row is the slot's Hkv * D contiguous
elements, copied in BLOCK_C-column chunks; the block-table entry is loaded once per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out, e4m3_decode_fast
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2, prepare
from triton_ops.contract.attention import FP8_KV

BLOCK_T = 32  # positions per program
# zero rows written after the last gathered key: a contiguous consumer's last K / V tile (up to 256 keys in the cute
# and Gluon kernels) reads past it and masks those keys, and a masked key adds 0 * V, so V there must be finite
PAD_ROWS = 256
MAX_BLOCK_C = 512  # columns per chunk: 32 x 512 elements = 16 KB of bf16 per chunk and program


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src_row, dst_row, row_ok, scale_ptr, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
               FP8: tl.constexpr, SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """dst[dst_row, :WIDTH] = src[src_row, :WIDTH] (dequantized: code * scale); row_ok False: the row is written
    as zeros and not read. Rows are element offsets (int64); dst_row < 0: not written."""
    write = dst_row >= 0
    if SCALE:
        scale = tl.load(scale_ptr)
    for c0 in tl.static_range(0, WIDTH, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cm = c < WIDTH
        ld = row_ok[:, None] & cm[None, :]
        if FP8:
            x = e4m3_decode_fast(tl.load(src_ptr + src_row[:, None] + c[None, :], mask=ld, other=0), EMULATE)
            if SCALE:
                x = x * scale
            x = cast_out(x, OUT_DTYPE, EMULATE)
        elif SCALE:
            x = tl.load(src_ptr + src_row[:, None] + c[None, :], mask=ld, other=0).to(tl.float32) * scale
            x = cast_out(x, OUT_DTYPE, EMULATE)
        else:  # a bit-exact copy
            x = tl.load(src_ptr + src_row[:, None] + c[None, :], mask=ld, other=0)
        tl.store(dst_ptr + dst_row[:, None] + c[None, :], x, mask=write[:, None] & cm[None, :])


@triton.jit
def _prefix_kernel(used_ptr, cu_q_ptr, cu_ptr, start_ptr, flag_ptr, batch, cap, window_left, START: tl.constexpr,
                   BLOCK: tl.constexpr):
    """One program, before the gather: n_b = clamp(seqused_k[b], 0, cap), less (START) the keys no query sees,
    start_b = max(n_b - Sq_b - window_left, 0); cu_k = [0, cumsum(n)]; flags[b] = seqused_k[b] > cap (the gather
    adds out-of-range page ids). So a call needs no zeroed buffer and no host-side tensor op."""
    tl.store(cu_ptr, 0)
    carry = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    for b0 in range(0, batch, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        live = b < batch
        used = tl.load(used_ptr + b, mask=live, other=0)
        n = tl.minimum(tl.maximum(used, 0), cap)
        if START:
            sq = tl.maximum(tl.load(cu_q_ptr + b + 1, mask=live, other=0) - tl.load(cu_q_ptr + b, mask=live, other=0),
                            0)
            first = tl.maximum(n - sq - window_left, 0)
            tl.store(start_ptr + b, first, mask=live)
            n = n - first
        tl.store(flag_ptr + b, (used > cap).to(tl.int32), mask=live)
        tl.store(cu_ptr + 1 + b, carry + tl.cumsum(n, 0), mask=live)
        carry += tl.sum(n, 0)


@triton.jit
def _gather_kernel(k_ptr, v_ptr, ko_ptr, vo_ptr, bt_ptr, used_ptr, cu_ptr, start_ptr, flag_ptr, ks_ptr, vs_ptr,
                   num_pages, bt_cols, bt_stride, k_sb, k_st, v_sb, v_st, batch,
                   PAGE_SIZE: tl.constexpr, START: tl.constexpr, PAD: tl.constexpr, WK: tl.constexpr,
                   WV: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_CK: tl.constexpr, BLOCK_CV: tl.constexpr, FP8: tl.constexpr,
                   SCALE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    t0 = tl.program_id(0) * BLOCK_T
    b = tl.program_id(1)
    if b == batch - 1:
        if t0 < PAD:  # zero rows after the last key: a consumer's last K / V tile reads them (and masks them)
            pad = tl.load(cu_ptr + batch).to(tl.int64) + t0 + tl.arange(0, BLOCK_T)
            none = tl.zeros([BLOCK_T], dtype=tl.int64)
            _copy_rows(k_ptr, ko_ptr, none, pad * WK, none != 0, ks_ptr, WK, BLOCK_CK, FP8, False, OUT_DTYPE,
                       EMULATE)
            _copy_rows(v_ptr, vo_ptr, none, pad * WV, none != 0, vs_ptr, WV, BLOCK_CV, FP8, False, OUT_DTYPE,
                       EMULATE)
    used = tl.load(used_ptr + b)
    cap = bt_cols * PAGE_SIZE
    n = tl.minimum(tl.maximum(used, 0), cap)  # keys past the table: flagged by _prefix_kernel
    first = 0
    if START:  # keys before `first` are seen by no query (a window): not gathered
        first = tl.load(start_ptr + b)
    if t0 >= n - first:
        return
    j = t0 + tl.arange(0, BLOCK_T)  # gathered row of the sequence; its key position is first + j
    live = j < n - first
    pos = first + j
    page = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + pos // PAGE_SIZE, mask=live, other=0)
    ok = live & (page >= 0) & (page < num_pages)
    if tl.max((live & ~ok).to(tl.int32), 0) > 0:  # an out-of-range page id: masked by contract
        tl.store(flag_ptr + b, 1)
    page = tl.where(ok, page, 0).to(tl.int64)
    slot = (pos % PAGE_SIZE).to(tl.int64)
    dst = tl.where(live, tl.load(cu_ptr + b).to(tl.int64) + j, -1)
    _copy_rows(k_ptr, ko_ptr, page * k_sb + slot * k_st, dst * WK, ok, ks_ptr, WK, BLOCK_CK, FP8, SCALE,
               OUT_DTYPE, EMULATE)
    _copy_rows(v_ptr, vo_ptr, page * v_sb + slot * v_st, dst * WV, ok, vs_ptr, WV, BLOCK_CV, FP8, SCALE,
               OUT_DTYPE, EMULATE)


def gather_reason(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  seqused_k: torch.Tensor) -> str | None:
    """Why `gather_paged_kv` cannot take these caches (None: it can)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.stride(3) != 1 or c.stride(2) != c.shape[3]:
            return f"{name}: each slot's (Hkv, D) must be contiguous, got shape {tuple(c.shape)} strides {c.stride()}"
    if block_table.dim() != 2 or block_table.stride(1) != 1 or block_table.dtype != torch.int32:
        return "block_table must be int32 (B, max_blocks) with unit column stride"
    if seqused_k.dtype != torch.int32 or seqused_k.dim() != 1 or seqused_k.stride(0) != 1:
        return "seqused_k must be contiguous int32 (B,)"
    return None


def gather_buffers(k_cache, v_cache, block_table, dtype, window: bool) -> tuple:
    """Fresh (k, v, cu_k, flags, start | None) of one gather into `dtype` (no zeroing: the kernels write what is
    read); window: with a sliding window (the per-sequence first gathered key, `start`)."""
    bsz, cols = block_table.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    rows = bsz * cols * page + PAD_ROWS
    dev = k_cache.device
    i32 = torch.int32
    return (torch.empty((rows, hkv, k_cache.shape[3]), dtype=dtype, device=dev),
            torch.empty((rows, hkv, v_cache.shape[3]), dtype=dtype, device=dev),
            torch.empty(bsz + 1, dtype=i32, device=dev), torch.empty(bsz, dtype=i32, device=dev),
            torch.empty(bsz, dtype=i32, device=dev) if window else None)


def _launches(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q, window_left, k, v, cu_k,
              flags, start) -> list:
    """[(kernel, grid, args, kwargs)] of one gather into the buffers of `gather_buffers`: the prefix kernel, then the
    gather (B >= 1)."""
    bsz, cols = block_table.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    cap = cols * page
    fp8 = k_cache.dtype in FP8_KV
    if fp8:  # the kernel reads E4M3 as bytes
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    scaled = k_scale is not None
    wk, wv = hkv * k_cache.shape[3], hkv * v_cache.shape[3]
    prefix = (_prefix_kernel, (1,), (seqused_k, seqused_k if start is None else cu_seqlens_q, cu_k,
                                     flags if start is None else start, flags, bsz, cap, max(int(window_left), 0)),
              dict(START=start is not None, BLOCK=min(next_pow2(bsz), 1024), num_warps=4))
    gather = (_gather_kernel, (cdiv(max(cap, PAD_ROWS), BLOCK_T), bsz),
              (k_cache, v_cache, k, v, block_table, seqused_k, cu_k, flags if start is None else start, flags,
               k_scale if scaled else flags, v_scale if scaled else flags, k_cache.shape[0], cols,
               block_table.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), bsz),
              dict(PAGE_SIZE=page, START=start is not None, PAD=PAD_ROWS, WK=wk, WV=wv, BLOCK_T=BLOCK_T,
                   BLOCK_CK=min(next_pow2(wk), MAX_BLOCK_C), BLOCK_CV=min(next_pow2(wv), MAX_BLOCK_C), FP8=fp8,
                   SCALE=scaled, OUT_DTYPE=TL_DTYPE[k.dtype], EMULATE=emulate_formats(k.device), num_warps=4))
    return [prefix, gather]


def gather_paged_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seqused_k: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    dtype: torch.dtype, cu_seqlens_q: torch.Tensor | None = None,
                    window_left: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(k (B * cap + PAD_ROWS, Hkv, Dqk), v (B * cap + PAD_ROWS, Hkv, Dv) in `dtype`, cu_k (B + 1,) int32,
    flags (B,) int32, cap): see the module docstring. `gather_reason` first; k_scale / v_scale: per-tensor fp32
    (one element) or None.
    cu_seqlens_q and window_left >= 0 (a sliding window): sequence b's keys before n_b - Sq_b - window_left are seen
    by no query and are left out (its gathered rows are the key positions from there to n_b - 1); the alignment is
    bottom-right, so the kept keys keep their visibility. Two launches (`_prefix_kernel`, the gather), no other
    device work."""
    window = cu_seqlens_q is not None and window_left >= 0
    k, v, cu_k, flags, start = gather_buffers(k_cache, v_cache, block_table, dtype, window)
    cap = block_table.shape[1] * k_cache.shape[1]
    if block_table.shape[0] == 0:
        cu_k.zero_()
        return k, v, cu_k, flags, cap
    for kernel, grid, args, kw in _launches(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q,
                                            window_left, k, v, cu_k, flags, start):
        launch(kernel, grid, *args, **kw)
    return k, v, cu_k, flags, cap


def prepare_gather_paged_kv(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q,
                            window_left: int, buffers: tuple):
    """A launcher for repeated `gather_paged_kv` calls with this exact signature (dtypes, shapes, strides, alignment
    and window_left fixed), prepared on `buffers` (`gather_buffers` of the signature: their dtype is the output's):
    fn(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q) allocates fresh buffers, makes the
    two launches through compiled launchers (triton_ops._launch.prepare: the current device's current stream) and
    returns (k, v, cu_k, flags) as `gather_paged_kv` does; None for an empty batch or where a launch cannot be
    prepared. cu_seqlens_q is read only with a window (window_left >= 0)."""
    bsz = block_table.shape[0]
    if bsz == 0:
        return None
    k, v, cu_k, flags, start = buffers
    sources = (k_cache, v_cache, block_table, seqused_k, cu_seqlens_q, k_scale, v_scale, k, v, cu_k, flags, start)
    launchers = [prepare(kernel, grid, sources, *args, **kw) for kernel, grid, args, kw in
                 _launches(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q, window_left, k,
                           v, cu_k, flags, start)]
    if any(fn is None for fn in launchers):
        return None
    prefix, gather = launchers
    device, dtype, i32, empty = k.device, k.dtype, torch.int32, torch.empty
    k_shape, v_shape, window = tuple(k.shape), tuple(v.shape), start is not None

    def gather_kv(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q):
        k = empty(k_shape, dtype=dtype, device=device)
        v = empty(v_shape, dtype=dtype, device=device)
        cu_k = empty(bsz + 1, dtype=i32, device=device)
        flags = empty(bsz, dtype=i32, device=device)
        start = empty(bsz, dtype=i32, device=device) if window else None
        src = (k_cache, v_cache, block_table, seqused_k, cu_seqlens_q, k_scale, v_scale, k, v, cu_k, flags, start)
        prefix(*src)
        gather(*src)
        return k, v, cu_k, flags

    return gather_kv


__all__ = ["gather_buffers", "gather_paged_kv", "gather_reason", "prepare_gather_paged_kv"]
