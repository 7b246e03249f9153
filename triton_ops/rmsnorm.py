"""Fused RMSNorm (+ residual add) with a bf16/fp16/fp32 or quantized output (Triton).

The quantized store stage is triton_ops/quant_epilogue.py (shared with SwiGLU).

Design: one program owns BLOCK_M whole rows (BLOCK_N = next_pow2(N) columns held in registers; loads are
16-byte vectors because rows are contiguous and Triton specializes 16-divisible strides). The sum of
squares and rstd are evaluated in fp64 and rounded once to fp32 (see dispatch/reference/rmsnorm.py: this
makes the result independent of the reduction order and of fp32 sqrt/rsqrt accuracy).
NVFP4 with a computed global scale takes two launches: an amax pass (which also writes the new residual)
leaves <= MAX_PARTIALS partial maxima, and the quantize pass folds them on every program (no host sync,
CUDA-graph safe).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops.contract.checks import rows_view
from triton_ops.contract.formats import MXFP4_BLOCK, round_up

from ._formats import (
    IN_KIND,
    cast_out,
    nvfp4_effective_gs,
    round_pairs,
    split_pairs,
)
from ._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2
from .blackwell import hw_fp4
from .quant_epilogue import (
    FMT_FP8,
    FMT_MX,
    FMT_NONE,
    FMT_NV,
    GS_FROM_PARTIALS,
    GS_GIVEN,
    GS_NONE,
    MAX_PARTIALS,
    PASS_AMAX,
    PASS_QUANT,
    PASS_SINGLE,
    alloc_epilogue_outputs,
    epilogue_geometry,
    fold_partials,
    fp4_pack_store,
    min_block,
    nvfp4_exact_path,
    pair_amax_bits,
    quant_epilogue,
    tile_amax_bits,
)

MAX_TRITON_N = 65536  # rows wider than this would not fit in registers: the torch backend takes them


# ---------------------------------------------------------------------------------------------- kernel


@triton.jit
def _load_row_block(x_ptr, r_ptr, rows, M, cols, cmask, stride_xm, stride_rm, HAS_RES: tl.constexpr):
    """x (and residual) of rows [BLOCK_M] (int64); rows >= M are not read (zeros)."""
    mask = (rows < M)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
    else:
        r = x
    return x, r


@triton.jit
def _row_global_scale(pid, gs_ptr, gs_out_ptr, partial_ptr, n_partials, GS_MODE: tl.constexpr, FMT: tl.constexpr,
                      BLOCK_M: tl.constexpr, PARTIALS_BLOCK: tl.constexpr):
    """(gs [BLOCK_M], gs_exact) of an RMSNorm program: the NVFP4 global scale (given, or folded from the amax
    pass's partials) broadcast over its rows, and nvfp4_exact_path of it (one gs, every row counts). Program 0
    also writes the scale the op returns (a given one is copied here, not by a second launch)."""
    gs = tl.zeros([BLOCK_M], dtype=tl.float32)
    if GS_MODE == GS_GIVEN:
        gs += tl.load(gs_ptr)
        if pid == 0:
            tl.store(gs_out_ptr, tl.max(gs, 0))
    if GS_MODE == GS_FROM_PARTIALS:
        gs += fold_partials(partial_ptr, n_partials, PARTIALS_BLOCK)
        if pid == 0:
            tl.store(gs_out_ptr, tl.max(gs, 0))
    gs_exact = 0
    if FMT == FMT_NV:
        gs = nvfp4_effective_gs(gs)  # the returned scale stays as given / computed; block scales use this one
        gs_exact = nvfp4_exact_path(gs, tl.zeros([BLOCK_M], dtype=tl.int32) == 0)
    return gs, gs_exact


@triton.jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, scale_ptr, gs_ptr, gs_out_ptr, partial_ptr,
    M, N: tl.constexpr, stride_xm, stride_rm, stride_hm, stride_om, stride_sm, stride_sg,
    eps, w_offset, fp8_eps, rows_per_prog, scale_rows_bound, scale_cols_bound, scale_cols_padded, n_partials,
    HAS_RES: tl.constexpr, PASS: tl.constexpr, GS_MODE: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr,
    OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
    HW_FP4: tl.constexpr = False,
):
    """N (the row width) is a compile-time constant: 1/N folds and, where N == BLOCK_N, the column masks vanish
    (a model has a handful of widths)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    gs, gs_exact = _row_global_scale(pid, gs_ptr, gs_out_ptr, partial_ptr, n_partials, GS_MODE, FMT, BLOCK_M,
                                     PARTIALS_BLOCK)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    inv_n = _inv_n(N)
    row0 = pid.to(tl.int64) * rows_per_prog
    # PREFETCH (programs of several row blocks): the next BLOCK_M rows are loaded before this block's reduction,
    # rstd tail and stores, so a program keeps two row blocks of loads in flight (docs/design_notes.md). Without
    # it (one block per program, the plain-output default) there is no loop and no second set of registers.
    if PREFETCH:
        loop_rows = rows_per_prog
        x, r = _load_row_block(x_ptr, r_ptr, row0 + tl.arange(0, BLOCK_M), M, cols, cmask, stride_xm, stride_rm,
                               HAS_RES)
    else:
        loop_rows: tl.constexpr = BLOCK_M
    for m0 in range(0, loop_rows, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        row_in = rows < M
        mask = row_in[:, None] & cmask[None, :]
        if PREFETCH:
            nxt = tl.where(m0 + BLOCK_M < rows_per_prog, rows + BLOCK_M, M)  # past the program's rows: no load
            x_next, r_next = _load_row_block(x_ptr, r_ptr, nxt, M, cols, cmask, stride_xm, stride_rm, HAS_RES)
        else:
            x, r = _load_row_block(x_ptr, r_ptr, rows, M, cols, cmask, stride_xm, stride_rm, HAS_RES)
        if HAS_RES:
            h = cast_out(x.to(tl.float32) + r.to(tl.float32), OUT_DTYPE, EMULATE)
            tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h, mask=mask)
            hf = h.to(tl.float32)
        else:
            hf = x.to(tl.float32)
        h64 = hf.to(tl.float64)
        ss = tl.sum(h64 * h64, 1)
        rstd = _rstd_of(ss, inv_n, eps)
        # w is re-read per block (an L1 hit) rather than held: holding it as fp32 across the loop costs 16
        # registers a thread, and registers bound how many row blocks an SM keeps in flight.
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + w_offset
        y = (hf * rstd[:, None]) * w[None, :]
        if PASS == PASS_AMAX:
            acc = tl.maximum(acc, tile_amax_bits(y, row_in, tl.arange(0, BLOCK_N // 2) < N // 2, OUT_DTYPE, EMULATE,
                                                 BLOCK_M, BLOCK_N))
        else:
            quant_epilogue(y, rows, row_in, 0, N, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs, gs_exact,
                           scale_rows_bound, scale_cols_bound, scale_cols_padded, fp8_eps,
                           FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N, HW_FP4)
        if PREFETCH:
            x = x_next
            r = r_next
    if PASS == PASS_AMAX:
        tl.store(partial_ptr + pid, tl.max(acc, 0).to(tl.float32, bitcast=True))


@triton.jit
def _load_row_words(x_ptr, r_ptr, rows, M, pcol, pmask, stride_xm, stride_rm, HAS_RES: tl.constexpr):
    """Pair words [BLOCK_M, NB, HP] of x (and the residual) for rows (int64); rows >= M are not read (zeros)."""
    mask = (rows < M)[:, None, None] & pmask
    x = tl.load(x_ptr + rows[:, None, None] * stride_xm + pcol, mask=mask, other=0)
    if HAS_RES:
        r = tl.load(r_ptr + rows[:, None, None] * stride_rm + pcol, mask=mask, other=0)
    else:
        r = x
    return x, r


@triton.jit
def _h_pairs_and_squares(x, r, rows, row_in, pcol, pmask, h_ptr, stride_hm, HAS_RES: tl.constexpr,
                         STORE_H: tl.constexpr, IN_KIND: tl.constexpr, EMULATE: tl.constexpr):
    """h = x (+ residual, rounded to x's dtype and stored as the new residual when STORE_H) as fp32 pairs, and
    each pair's fp64 sum of squares (the contract's order-independent sum: docs/rmsnorm.md)."""
    h_lo, h_hi = split_pairs(x, IN_KIND)
    if HAS_RES:
        r_lo, r_hi = split_pairs(r, IN_KIND)
        hw, h_lo, h_hi = round_pairs(h_lo + r_lo, h_hi + r_hi, IN_KIND, EMULATE)
        if STORE_H:
            tl.store(h_ptr + rows[:, None, None] * stride_hm + pcol, hw, mask=row_in[:, None, None] & pmask)
    a64 = h_lo.to(tl.float64)
    b64 = h_hi.to(tl.float64)
    return h_lo, h_hi, a64 * a64 + b64 * b64


@triton.jit
def _inv_n(N):
    """1 / N in fp64 (correctly rounded), computed once per program for _rstd_of."""
    return 1.0 / (tl.zeros([1], dtype=tl.float64) + N)  # [1]: N may be specialized to a constexpr


@triton.jit
def _rstd_of(ss, inv_n, eps):
    """fp32(1 / sqrt(ss / N + eps)) evaluated in fp64, one rounding to fp32: ss * (1/N) and fp64 rsqrt (CUDA's
    rsqrt(double): MUFU.RSQ64H + one cubic refinement, <= 1 ulp) carry ~2.5 fp64 ulps against the reference's
    division, sqrt and division, inside the contract's few-ulp budget (docs/rmsnorm.md). Every thread of a row
    evaluates this tail; the IEEE div.rn.f64 + sqrt.rn.f64 + div.rn.f64 it replaces cost ~3 instructions per
    element of an 8-warp 4096-column row (docs/design_notes.md)."""
    return tl.math.rsqrt(ss * inv_n + eps).to(tl.float32)


@triton.jit
def _rms_norm_pairs_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, scale_ptr, gs_ptr, gs_out_ptr, partial_ptr,
    M, N, stride_xm, stride_rm, stride_hm, stride_om, stride_sm,
    eps, w_offset, rows_per_prog, scale_rows_bound, scale_cols_padded, n_partials,
    HAS_RES: tl.constexpr, PASS: tl.constexpr, GS_MODE: tl.constexpr, FMT: tl.constexpr, MX_RCEIL: tl.constexpr,
    SWIZZLE: tl.constexpr, IN_KIND: tl.constexpr, W_KIND: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS_BLOCK: tl.constexpr, HW_FP4: tl.constexpr = False,
):
    """_rms_norm_kernel for a bf16/fp16 row and an FP4 output, on pair words: x, the residual, h and the weight
    are read and written as int32 words of two elements (strides in words), held as [BLOCK_M, NB, HP] (the
    quantize kernel's layout), so every thread owns whole (even, odd) pairs from the load to the packed byte:
    no layout shuffles, bf16 -> fp32 by one integer op per element, both rounding steps (h, y) two values per
    cvt. Same math and order as _rms_norm_kernel (bytes equal)."""
    SB: tl.constexpr = 32 if FMT == FMT_MX else 16
    NB: tl.constexpr = BLOCK_N // SB
    HP: tl.constexpr = SB // 2
    pid = tl.program_id(0)
    pcol = tl.arange(0, NB)[None, :, None] * HP + tl.arange(0, HP)[None, None, :]  # pair (= output byte) column
    Np = N // 2
    pmask = pcol < Np
    gs, gs_exact = _row_global_scale(pid, gs_ptr, gs_out_ptr, partial_ptr, n_partials, GS_MODE, FMT, BLOCK_M,
                                     PARTIALS_BLOCK)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    inv_n = _inv_n(N)
    row0 = pid.to(tl.int64) * rows_per_prog
    w_lo, w_hi = split_pairs(tl.load(w_ptr + pcol, mask=pmask, other=0), W_KIND)
    w_lo += w_offset
    w_hi += w_offset
    x, r = _load_row_words(x_ptr, r_ptr, row0 + tl.arange(0, BLOCK_M), M, pcol, pmask, stride_xm, stride_rm,
                           HAS_RES)
    for m0 in range(0, rows_per_prog, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        row_in = rows < M
        nxt = tl.where(m0 + BLOCK_M < rows_per_prog, rows + BLOCK_M, M)  # past the program's rows: no load
        x_next, r_next = _load_row_words(x_ptr, r_ptr, nxt, M, pcol, pmask, stride_xm, stride_rm, HAS_RES)
        h_lo, h_hi, sq = _h_pairs_and_squares(x, r, rows, row_in, pcol, pmask, h_ptr, stride_hm, HAS_RES, True,
                                              IN_KIND, EMULATE)
        rstd = _rstd_of(tl.sum(tl.sum(sq, 2), 1), inv_n, eps)
        y_lo = (h_lo * rstd[:, None, None]) * w_lo
        y_hi = (h_hi * rstd[:, None, None]) * w_hi
        if PASS == PASS_AMAX:
            yw, lo, hi = round_pairs(y_lo, y_hi, IN_KIND, EMULATE)
            m = pair_amax_bits(lo, hi) & tl.where(pmask, -1, 0).to(tl.uint32)
            rmax = (tl.max(tl.max(m, 2), 1) & 0x7FFFFFFF).to(tl.int32, bitcast=True)
            acc = tl.maximum(acc, tl.where(row_in, rmax, 0))
        else:
            w, lo, hi = round_pairs(y_lo, y_hi, IN_KIND, EMULATE)  # two values per cvt (y is x's dtype)
            fp4_pack_store(w, lo, hi, rows, row_in, pcol, 0, Np, out_ptr, stride_om, scale_ptr, stride_sm, gs, gs_exact,
                           scale_rows_bound, scale_cols_padded, FMT, MX_RCEIL, SWIZZLE, True, EMULATE, NB, HP,
                           HW_FP4)
        x = x_next
        r = r_next
    if PASS == PASS_AMAX:
        tl.store(partial_ptr + pid, tl.max(acc, 0).to(tl.float32, bitcast=True))


@triton.jit
def _rms_norm_chunked_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, scale_ptr, gs_ptr, gs_out_ptr,
    M, N, stride_xm, stride_rm, stride_hm, stride_om, stride_sm,
    eps, w_offset, scale_rows_bound, scale_cols_padded,
    HAS_RES: tl.constexpr, GS_MODE: tl.constexpr, FMT: tl.constexpr, MX_RCEIL: tl.constexpr,
    SWIZZLE: tl.constexpr, IN_KIND: tl.constexpr, W_KIND: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, REREAD_H: tl.constexpr, HW_FP4: tl.constexpr = False,
):
    """_rms_norm_pairs_kernel in two passes over one row in CHUNKS column chunks of BLOCK_N: pass 1 sums the
    squares (and writes the new residual), pass 2 reads the chunks again (L1/L2 hits: the row was just read)
    and normalizes + quantizes them. Only one chunk is live at a time, so a thread holds a few dozen registers
    instead of the whole row and its weight (the one-pass kernel: 255 registers at 2 warps, 8 warps per SM,
    issue-latency bound in Nsight Compute), and many more rows are in flight per SM. Same math and order per
    element as the one-pass kernels (the fp64 sum is order-independent to a few fp64 ulps: docs/rmsnorm.md),
    bytes equal. One program per row; padding rows of swizzled scales (row >= M) write zero scale bytes."""
    SB: tl.constexpr = 32 if FMT == FMT_MX else 16
    NB: tl.constexpr = BLOCK_N // SB
    HP: tl.constexpr = SB // 2
    pid = tl.program_id(0)
    gs, gs_exact = _row_global_scale(pid, gs_ptr, gs_out_ptr, gs_out_ptr, 1, GS_MODE, FMT, 1, 1)
    rows = pid.to(tl.int64) + tl.arange(0, 1)
    row_in = rows < M
    lane = tl.arange(0, NB)[None, :, None] * HP + tl.arange(0, HP)[None, None, :]  # pair column in a chunk
    Np = N // 2
    acc = tl.zeros([1, NB, HP], dtype=tl.float64)
    for c in tl.static_range(CHUNKS):
        pcol = c * (BLOCK_N // 2) + lane
        pmask = pcol < Np
        x, r = _load_row_words(x_ptr, r_ptr, rows, M, pcol, pmask, stride_xm, stride_rm, HAS_RES)
        _, _, sq = _h_pairs_and_squares(x, r, rows, row_in, pcol, pmask, h_ptr, stride_hm, HAS_RES, True, IN_KIND,
                                        EMULATE)
        acc += sq
    rstd = _rstd_of(tl.sum(tl.sum(acc, 2), 1), _inv_n(N), eps)
    for c in tl.static_range(CHUNKS):
        pcol = c * (BLOCK_N // 2) + lane
        pmask = pcol < Np
        if HAS_RES and REREAD_H:  # the h words this thread stored in pass 1 (one load instead of two)
            h_lo, h_hi = split_pairs(tl.load(h_ptr + rows[:, None, None] * stride_hm + pcol,
                                             mask=row_in[:, None, None] & pmask, other=0), IN_KIND)
        else:  # h again from x (+ r); its squares are dead code
            x, r = _load_row_words(x_ptr, r_ptr, rows, M, pcol, pmask, stride_xm, stride_rm, HAS_RES)
            h_lo, h_hi, _ = _h_pairs_and_squares(x, r, rows, row_in, pcol, pmask, h_ptr, stride_hm, HAS_RES, False,
                                                 IN_KIND, EMULATE)
        w_lo, w_hi = split_pairs(tl.load(w_ptr + pcol, mask=pmask, other=0), W_KIND)
        y_lo = (h_lo * rstd[:, None, None]) * (w_lo + w_offset)
        y_hi = (h_hi * rstd[:, None, None]) * (w_hi + w_offset)
        yw, lo, hi = round_pairs(y_lo, y_hi, IN_KIND, EMULATE)
        fp4_pack_store(yw, lo, hi, rows, row_in, pcol, c * NB, Np, out_ptr, stride_om, scale_ptr, stride_sm, gs,
                       gs_exact, scale_rows_bound, scale_cols_padded, FMT, MX_RCEIL, SWIZZLE, True, EMULATE, NB, HP,
                       HW_FP4)


# -------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class RowConfig:
    """Whole-row tiles: BLOCK_N covers the row, BLOCK_M rows per block, row_blocks blocks per program."""

    block_m: int  # rows per block (several for narrow rows, so a block moves >= ~8 KB)
    block_n: int  # next_pow2(N), at least the quant block * 4 (swizzled scale columns come in 4s)
    num_warps: int  # ~16 fp32 elements per thread: the row stays in registers, loads are 16-byte vectors
    row_blocks: int = 1  # blocks per program, walked with a one-block prefetch (1 at decode: more programs)
    chunks: int = 1  # > 1: the FP4 two-pass kernel, one row per program in `chunks` chunks of block_n columns
    reread_h: bool = False  # two-pass kernel with a residual: pass 2 loads the stored h instead of x and r


def pick_row_config(rows: int, n: int, device: torch.device, min_block_n: int, pairs: bool = False) -> RowConfig:
    block_n = max(next_pow2(max(n, 1)), min_block_n)
    target = 32768 if device.type == "cpu" else 4096  # interpreter: cost is per program; take big tiles
    block_m = max(1, min(next_pow2(max(rows, 1)), target // block_n))
    elems = block_m * block_n
    blocks = cdiv(rows, block_m)
    if not pairs and device.type != "cpu" and blocks >= 2048:
        # The element-wise kernel (plain and FP8 outputs), long batches: one row block per program, ~32 elements
        # per thread. With the one-rsqrt rstd tail a program's per-row work is short, so prefetching multi-block
        # programs do not pay: one block per program is 1-15% faster for plain outputs and 18-34% for FP8 g128 on
        # the H200 (docs/rmsnorm.md, alternatives measured).
        return RowConfig(block_m, block_n, min(32, max(4, elems // 1024)), 1)
    # pairs (the FP4 pair-word kernel): ~64 elements per thread. Its per-row work (cross-warp sum, fp64 rstd
    # tail) is paid per thread, so few warps per row: 2 warps per 4096 columns is the fastest or within 2% of it
    # (docs/rmsnorm.md, alternatives measured); up to ~240 registers, no spills.
    num_warps = min(32, max(2, elems // 2048)) if pairs else min(32, max(4, elems // 512))
    # Prefetching (the pair kernel; the element-wise kernel returned above for >= 2048 blocks) needs >= 2 blocks
    # per program; keep >= ~8 programs per SM (132 on H200) so the tail wave stays short. Interpreter: one block
    # per program (the prefetch is only a second masked load there).
    row_blocks = 1 if device.type == "cpu" else (4 if blocks >= 8192 else 2 if blocks >= 2048 else 1)
    return RowConfig(block_m, block_n, num_warps, row_blocks)


def pick_chunked_config(rows: int, n: int, device: torch.device, has_res: bool) -> RowConfig | None:
    """The two-pass chunked FP4 kernel's config, or None where the one-pass pair kernel is the better choice.
    Long batches: 2 warps x 2048-column chunks hold ~70-96 registers instead of the pair kernel's ~255, 11-12%
    faster at 32768x4096 on the H200; with a residual, pass 2 reads the stored h back (reread_h, 4 warps) rather
    than x and the residual again (docs/rmsnorm.md, alternatives measured). Rows that fit one chunk gain nothing
    (no register relief); short batches keep the one-pass kernel's several-rows-per-program tiles. Chunk width:
    2048, or 1024 where it wastes fewer masked lanes (N = 7168: 7 x 1024; 2880: 3 x 1024)."""
    if device.type == "cpu" or rows < 2048 or n <= 2048:
        return None
    width = round_up(n, 4 * MXFP4_BLOCK)  # whole swizzled 4-column groups of either format's blocks
    block_n = min((2048, 1024), key=lambda b: (round_up(width, b) - width, -b))
    return RowConfig(1, block_n, 4 if has_res else 2, 1, cdiv(width, block_n), reread_h=has_res)


def supports_rms_norm(x, weight, residual, eps, weight_offset, *rest) -> str | None:
    if x.shape[-1] > MAX_TRITON_N:
        return f"row length {x.shape[-1]} > {MAX_TRITON_N} does not fit one program's registers"
    return None


def supports_rms_norm_fp8_group(x, weight, residual, eps, weight_offset, group_size, *rest) -> str | None:
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size} is not a power of two >= 16"
    return supports_rms_norm(x, weight, residual, eps, weight_offset)


# ------------------------------------------------------------------------------------------- launcher


def _word_view(t):
    """t's rows as pair words (bf16/fp16 pairs in int32, fp32 pairs in int64; needs an even row stride and
    offset), or None."""
    if t.dtype not in IN_KIND or t.storage_offset() % 2 or t.shape[-1] % 2:
        return None
    if t.dim() == 2 and t.shape[0] > 1 and t.stride(0) % 2:
        return None
    return t.view(torch.int64 if t.dtype == torch.float32 else torch.int32)


def _amax_pass_plan(rows, cfg, dev):
    """(rows per program, program count, partial-maxima buffer) of the NVFP4 computed-global-scale amax pass:
    <= MAX_PARTIALS programs, each a whole number of row blocks."""
    rows_per_prog = round_up(max(cfg.block_m, cdiv(rows, MAX_PARTIALS)), cfg.block_m)
    n_partials = cdiv(rows, rows_per_prog)
    return rows_per_prog, n_partials, torch.empty(n_partials, dtype=torch.float32, device=dev)


def _rms_norm(x, weight, residual, eps, weight_offset, *, fmt, group=128, quant_eps=1e-10, ue8m0=False,
              column_major=False, rounding="floor", swizzle=False, global_scale=None, cfg=None, pairs=None):
    op = "rms_norm"
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    x2 = rows_view(op, "x", x)
    rows = x2.shape[0]
    dev = x.device
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    gs_out = torch.empty((), dtype=torch.float32, device=dev)
    out, scales = alloc_epilogue_outputs(fmt, lead, n, x.dtype, group, column_major, swizzle, dev)
    results = _results(fmt, out, scales, gs_out, new_res)
    if rows == 0 or n == 0:
        if fmt == FMT_NV and global_scale is not None:
            gs_out.copy_(global_scale.reshape(()))  # otherwise the kernel copies it
        if fmt in (FMT_MX, FMT_NV):
            scales.view(torch.uint8).zero_()
        if fmt == FMT_NV and global_scale is None:
            gs_out.zero_()
        if residual is not None:
            new_res.copy_((x.float() + residual.float()).to(x.dtype))
        return results
    r2 = rows_view(op, "residual", residual) if residual is not None else x2
    h2 = new_res.view(-1, n) if residual is not None else x2
    out2 = out.view(-1, out.shape[-1])
    geo = epilogue_geometry(fmt, scales, rows, n, group, swizzle)
    stride_sm, stride_sg, scale_cols_padded, grid_rows = geo.stride_sm, geo.stride_sg, geo.scale_cols_padded, \
        geo.grid_rows
    use_pairs = pairs is not False and fmt in (FMT_MX, FMT_NV) and x.dtype != torch.float32
    if cfg is None and use_pairs and not (fmt == FMT_NV and global_scale is None):
        cfg = pick_chunked_config(grid_rows, n, dev, residual is not None)
    cfg = cfg or pick_row_config(grid_rows, n, dev, min_block(fmt, group), use_pairs)  # cfg: benchmark sweeps pass one
    emulate = emulate_formats(dev)
    common = dict(FMT=fmt, GROUP=group, UE8M0=ue8m0, MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle,
                  OUT_DTYPE=TL_DTYPE[x.dtype], EMULATE=emulate, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  HW_FP4=fmt in (FMT_MX, FMT_NV) and hw_fp4(dev), num_warps=cfg.num_warps)
    scale_arg = scales.view(torch.uint8) if fmt in (FMT_MX, FMT_NV) else scales
    out_arg = out2.view(torch.uint8) if fmt == FMT_FP8 else out2
    w = weight.contiguous()
    if use_pairs:  # pairs=False: sweeps time the element-wise kernel
        views = [_word_view(t) for t in (x2, r2, h2, w)]
        if all(v is not None for v in views):
            _rms_norm_pairs(views, IN_KIND[x.dtype], IN_KIND[w.dtype], rows, n, eps, weight_offset, cfg, emulate,
                            out2, scale_arg, geo, global_scale, gs_out, fmt=fmt, rounding=rounding, swizzle=swizzle,
                            has_res=residual is not None)
            return results
        assert not pairs, "pair-word kernel not applicable"
        if cfg.chunks > 1:  # no word views (odd strides/offsets): the element-wise kernel with its own tiles
            cfg = pick_row_config(grid_rows, n, dev, min_block(fmt, group))
            common.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    if fmt == FMT_NV and global_scale is None:
        # Pass 1: new residual + partial amax of y; pass 2 reads the rounded h (or x) back and quantizes.
        rows_per_prog, n_partials, partials = _amax_pass_plan(rows, cfg, dev)
        launch(_rms_norm_kernel, (n_partials,),
            x2, r2, w, h2, out_arg, scale_arg, gs_out, gs_out, partials,
            rows, n, x2.stride(0), r2.stride(0), h2.stride(0), 0, 0, 0,
            float(eps), float(weight_offset), 0.0, rows_per_prog, grid_rows, 0, scale_cols_padded, n_partials,
            HAS_RES=residual is not None, PASS=PASS_AMAX, GS_MODE=GS_NONE, PARTIALS_BLOCK=1,
            PREFETCH=rows_per_prog > cfg.block_m, **common)
        src = h2
        gs_mode, has_res, partials_block = GS_FROM_PARTIALS, False, next_pow2(n_partials)
    else:
        src, partials, n_partials, partials_block = x2, gs_out, 1, 1
        gs_mode = GS_GIVEN if fmt == FMT_NV else GS_NONE
        has_res = residual is not None
    rows_per_prog = cfg.block_m * cfg.row_blocks
    launch(_rms_norm_kernel, (cdiv(grid_rows, rows_per_prog),),
        src, r2, w, h2, out_arg, scale_arg, global_scale if global_scale is not None else gs_out, gs_out,
        partials, rows, n, src.stride(0), r2.stride(0), h2.stride(0), out2.stride(0), stride_sm, stride_sg,
        float(eps), float(weight_offset), float(quant_eps), rows_per_prog, grid_rows, 0, scale_cols_padded,
        n_partials, HAS_RES=has_res, PASS=PASS_QUANT if gs_mode == GS_FROM_PARTIALS else PASS_SINGLE,
        GS_MODE=gs_mode, PARTIALS_BLOCK=partials_block, PREFETCH=rows_per_prog > cfg.block_m, **common)
    return results


def _rms_norm_pairs(views, in_kind, w_kind, rows, n, eps, weight_offset, cfg, emulate, out2, scale_arg, geo,
                    global_scale, gs_out, *, fmt, rounding, swizzle, has_res):
    """_rms_norm's launches with _rms_norm_pairs_kernel (word views of x, residual, h, weight; strides in words)."""
    x2, r2, h2, w = views
    dev = x2.device
    grid_rows = geo.grid_rows
    if fmt == FMT_NV and global_scale is None and cfg.chunks > 1:
        # the two-pass kernel has no partial-amax fold (computed global scale): one-pass kernel and config
        cfg = pick_row_config(grid_rows, n, dev, min_block(fmt, 16), True)
    hw = hw_fp4(dev)
    common = dict(FMT=fmt, MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle, IN_KIND=in_kind, W_KIND=w_kind,
                  EMULATE=emulate, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HW_FP4=hw, num_warps=cfg.num_warps)
    if fmt == FMT_NV and global_scale is None:
        rows_per_prog, n_partials, partials = _amax_pass_plan(rows, cfg, dev)
        launch(_rms_norm_pairs_kernel, (n_partials,),
            x2, r2, w, h2, out2, scale_arg, gs_out, gs_out, partials,
            rows, n, x2.stride(0), r2.stride(0), h2.stride(0), 0, 0,
            float(eps), float(weight_offset), rows_per_prog, grid_rows, geo.scale_cols_padded, n_partials,
            HAS_RES=has_res, PASS=PASS_AMAX, GS_MODE=GS_NONE, PARTIALS_BLOCK=1, **common)
        src, gs_mode, has_res, partials_block = h2, GS_FROM_PARTIALS, False, next_pow2(n_partials)
    else:
        src, partials, n_partials, partials_block = x2, gs_out, 1, 1
        gs_mode = GS_GIVEN if fmt == FMT_NV else GS_NONE
    if cfg.chunks > 1 and gs_mode != GS_FROM_PARTIALS:
        launch(_rms_norm_chunked_kernel, (grid_rows,),
            src, r2, w, h2, out2, scale_arg, global_scale if global_scale is not None else gs_out, gs_out,
            rows, n, src.stride(0), r2.stride(0), h2.stride(0), out2.stride(0), geo.stride_sm,
            float(eps), float(weight_offset), grid_rows, geo.scale_cols_padded,
            HAS_RES=has_res, GS_MODE=gs_mode, FMT=fmt, MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle,
            IN_KIND=in_kind, W_KIND=w_kind, EMULATE=emulate, BLOCK_N=cfg.block_n, CHUNKS=cfg.chunks,
            REREAD_H=cfg.reread_h, HW_FP4=hw, num_warps=cfg.num_warps)
        return
    rows_per_prog = cfg.block_m * cfg.row_blocks
    launch(_rms_norm_pairs_kernel, (cdiv(grid_rows, rows_per_prog),),
        src, r2, w, h2, out2, scale_arg, global_scale if global_scale is not None else gs_out, gs_out, partials,
        rows, n, src.stride(0), r2.stride(0), h2.stride(0), out2.stride(0), geo.stride_sm,
        float(eps), float(weight_offset), rows_per_prog, grid_rows, geo.scale_cols_padded, n_partials,
        HAS_RES=has_res, PASS=PASS_QUANT if gs_mode == GS_FROM_PARTIALS else PASS_SINGLE, GS_MODE=gs_mode,
        PARTIALS_BLOCK=partials_block, **common)


def _results(fmt, out, scales, gs_out, new_res):
    if fmt == FMT_NONE:
        return out, new_res
    if fmt == FMT_NV:
        return out, scales, gs_out, new_res
    return out, scales, new_res


# ------------------------------------------------------------------------------- backend entry points


def rms_norm(x, weight, residual, eps, weight_offset):
    return _rms_norm(x, weight, residual, eps, weight_offset, fmt=FMT_NONE)


def rms_norm_fp8_group(x, weight, residual, eps, weight_offset, group_size, quant_eps, ue8m0, column_major):
    return _rms_norm(x, weight, residual, eps, weight_offset, fmt=FMT_FP8, group=group_size, quant_eps=quant_eps,
                     ue8m0=ue8m0, column_major=column_major)


def rms_norm_mxfp4(x, weight, residual, eps, weight_offset, rounding, swizzle):
    return _rms_norm(x, weight, residual, eps, weight_offset, fmt=FMT_MX, rounding=rounding, swizzle=swizzle)


def rms_norm_nvfp4(x, weight, residual, eps, weight_offset, global_scale, swizzle):
    return _rms_norm(x, weight, residual, eps, weight_offset, fmt=FMT_NV, swizzle=swizzle,
                     global_scale=global_scale)
