"""Quantize / dequantize kernels (Triton): NVFP4 and MXFP4 (e2m1 codes + block scales) and FP8 E4M3
per-token groups (DeepSeek / DeepGEMM style).

FP4: one quantize kernel serves both formats (constexpr IS_MX): they share loading, E2M1 rounding, packing and
the scale layouts, and differ only in how a block's scale is chosen. FP8: fp32 scales, one per `group_size`
elements of a row, written through explicit strides so the same kernel fills row-major scales and DeepGEMM's
column-major TMA-aligned scales. The contract (bytes) is dispatch/reference/quant.py; tests compare the two on
every drawn input.

Anatomy: kernels -> launchers -> tile choice (triton_ops._launch.pick_tile) -> checks (supports_*)
-> entries (dispatch/table.py names them).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from triton_ops.contract.checks import fail, rows_view
from triton_ops.contract.formats import (
    MXFP4_BLOCK,
    NVFP4_AMAX_TO_SCALE,
    NVFP4_BLOCK,
    fp4_scales_shape,
    fp8_scale_storage,
    round_up,
)

from ._formats import (
    IN_KIND,
    abs_bits,
    amax_nan,
    cast_out,
    e2m1_decode_nibble,
    e4m3_decode_fast,
    e4m3_encode,
    fp4_encode_exact,
    fp4_encode_pairs,
    fp8_group_scale,
    mxfp4_block_scale_ex,
    nvfp4_block_scale_ex,
    nvfp4_effective_gs,
    nvfp4_gs_from_amax,
    split_pairs,
    swizzled_offset_128x4,
)
from ._launch import TL_DTYPE, TileConfig, emulate_formats, launch, next_pow2, pick_tile
from .blackwell import hw_fp4
from .quant_epilogue import GS_FROM_PARTIALS, GS_GIVEN, GS_NONE

MAX_AMAX_PARTIALS = 512  # partial maxima the amax pass leaves for the quantize kernel to fold


@dataclasses.dataclass(frozen=True)
class AmaxPlan:
    """Tiling of the NVFP4 global-amax pass: grid (n_m, n_k) of programs, each folding a rows_per_prog x
    cols_per_prog region in [block_m, block_k] steps into one partial maximum."""

    block_m: int
    block_k: int
    rows_per_prog: int
    cols_per_prog: int
    n_m: int
    n_k: int
    num_warps: int


def amax_plan(rows: int, k: int, device: torch.device) -> AmaxPlan:
    """A read-only pass is bound by bytes in flight: 8192-element (16 KB bf16) steps and up to 512 programs
    (~4 per SM on an H200, ~64 KB in flight per SM), where the quantize tile (4096 elements, <= 256 programs
    at 8192 rows) left it at a fraction of copy bandwidth. Short batches split K so decode still spreads.
    Interpreter: bigger steps (its cost is per program step)."""
    step = 32768 if device.type == "cpu" else 8192
    block_k = min(triton.next_power_of_2(k), 2048)
    block_m = max(1, min(triton.next_power_of_2(rows), step // block_k))
    rows_per_prog = round_up(max(block_m, triton.cdiv(rows, MAX_AMAX_PARTIALS)), block_m)
    n_m = triton.cdiv(rows, rows_per_prog)
    n_k = min(triton.cdiv(k, block_k), max(1, MAX_AMAX_PARTIALS // n_m))
    cols_per_prog = block_k * triton.cdiv(triton.cdiv(k, block_k), n_k)
    return AmaxPlan(block_m, block_k, rows_per_prog, cols_per_prog, n_m, triton.cdiv(k, cols_per_prog), 4)


@triton.jit
def _amax_partials_kernel(x_ptr, partials_ptr, M, K, stride_xm, rows_per_prog, cols_per_prog,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """partials[pid_m * n_k + pid_k] = max |x| over a (rows_per_prog x cols_per_prog) tile, NaN-propagating.
    Tiles split K too, so short batches (decode) still spread over many programs."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    # A small accumulator (one column max per thread slot): a [BLOCK_M, BLOCK_K] one held 64 registers per
    # thread at 4x2048, and ptxas then serialized the step's loads through one register quad (16 bytes in
    # flight per thread). Folding each step over rows first keeps the step's loads in flight together.
    acc = tl.zeros([BLOCK_K], dtype=tl.int32)
    row0 = pid_m.to(tl.int64) * rows_per_prog
    col0 = pid_k * cols_per_prog
    for m0 in range(0, rows_per_prog, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        rmask = (rows < M) & (m0 + tl.arange(0, BLOCK_M) < rows_per_prog)
        for k0 in range(0, cols_per_prog, BLOCK_K):
            cols = col0 + k0 + tl.arange(0, BLOCK_K)
            mask = rmask[:, None] & ((cols < K) & (k0 + tl.arange(0, BLOCK_K) < cols_per_prog))[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            acc = tl.maximum(acc, tl.max(abs_bits(x.to(tl.float32)), 0))
    amax = tl.max(acc, 0).to(tl.float32, bitcast=True)
    tl.store(partials_ptr + pid_m * tl.num_programs(1) + pid_k, amax)


@triton.jit
def _fp4_quantize_kernel(
    words_ptr, codes_ptr, scales_ptr, gs_in_ptr, gs_out_ptr,
    M, K, stride_wm, grid_rows, scale_cols_bound, scale_cols_padded, n_partials,
    IS_MX: tl.constexpr, MX_RCEIL: tl.constexpr, GS_MODE: tl.constexpr, SWIZZLE: tl.constexpr,
    IN_KIND: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr, TILES: tl.constexpr = 1, HW_FP4: tl.constexpr = False,
):
    """One program: TILES row tiles of BLOCK_M rows x BLOCK_K columns (each held as [BLOCK_M, blocks, pairs per
    block] words), walked with the next tile's loads issued before this tile's math (TILES > 1).
    Pair p of a row is output byte p (element 2p -> low nibble), so no reshapes are needed anywhere.
    Addressing: 64-bit row offsets (one per row of the tile), 32-bit column offsets.
    HW_FP4: E2M1 by the Blackwell pair convert (blackwell.hw_fp4; same bytes, see _formats.fp4_encode_pairs)."""
    SB: tl.constexpr = 32 if IS_MX else 16
    NB: tl.constexpr = BLOCK_K // SB
    HP: tl.constexpr = SB // 2
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    gs = 0.0
    if not IS_MX:
        if GS_MODE == GS_GIVEN:
            gs = tl.load(gs_in_ptr)
        else:
            pofs = tl.arange(0, PARTIALS_BLOCK)
            partials = tl.load(gs_in_ptr + pofs, mask=pofs < n_partials, other=0.0)
            gs = nvfp4_gs_from_amax(amax_nan(partials, 0))
        if (pid_m == 0) & (pid_k == 0):
            tl.store(gs_out_ptr, gs)  # returned as given / computed; the block scales use the effective one
        gs = nvfp4_effective_gs(gs)
    rows = pid_m * (BLOCK_M * TILES) + tl.arange(0, BLOCK_M)  # int32; widened per row where it scales a stride
    pcol = (pid_k * (BLOCK_K // 2) + tl.arange(0, NB)[None, :, None] * HP + tl.arange(0, HP)[None, None, :])
    w = tl.load(words_ptr + rows[:, None, None].to(tl.int64) * stride_wm + pcol,
                mask=(rows[:, None, None] < M) & (pcol < K // 2), other=0)
    for t in tl.static_range(TILES):
        if t + 1 < TILES:
            rows_next = rows + BLOCK_M
            w_next = tl.load(words_ptr + rows_next[:, None, None].to(tl.int64) * stride_wm + pcol,
                             mask=(rows_next[:, None, None] < M) & (pcol < K // 2), other=0)
        _quantize_tile(w, rows, pcol, pid_k, gs, codes_ptr, scales_ptr, M, K, grid_rows, scale_cols_bound,
                       scale_cols_padded, IS_MX, MX_RCEIL, SWIZZLE, IN_KIND, EMULATE, BLOCK_M, NB, HP, HW_FP4)
        if t + 1 < TILES:
            rows = rows_next
            w = w_next


@triton.jit
def _quantize_tile(w, rows, pcol, pid_k, gs, codes_ptr, scales_ptr, M, K, grid_rows, scale_cols_bound,
                   scale_cols_padded, IS_MX: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr,
                   IN_KIND: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                   HP: tl.constexpr, HW_FP4: tl.constexpr):
    """Codes and block scales of one [BLOCK_M, NB, HP] tile of pair words (rows: its rows, pcol: its pair
    columns; gs: the NVFP4 global scale)."""
    SB: tl.constexpr = 2 * HP
    mask = (rows[:, None, None] < M) & (pcol < K // 2)
    lo, hi = split_pairs(w, IN_KIND)
    # NaN-propagating |x| max: one max.NaN per pair, then an unsigned integer max (NaN bits sort above Inf,
    # whatever a NaN's sign), the sign cleared once per block
    m = tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL).to(tl.uint32, bitcast=True)
    amax = (tl.max(m, 2) & 0x7FFFFFFF).to(tl.float32, bitcast=True)  # [BLOCK_M, NB]

    if IS_MX:
        sbyte, inv = mxfp4_block_scale_ex(amax, MX_RCEIL, IN_KIND != 2)
        # inv is a finite power of two for a finite block (so q is finite), NaN for a NaN/Inf block
        packed = fp4_encode_pairs(w, lo, hi, inv, inv == inv, IN_KIND, HW_FP4)
    else:
        sbyte, inv = nvfp4_block_scale_ex(amax, gs, EMULATE, IN_KIND != 2)  # bf16/fp16 amax: cheap /6
        # inv = (1/gs)/s32 is >= +0 or NaN. With |1/gs| < 2^100, inv is finite, NaN only for a block whose
        # amax (or gs) is NaN, and 0 only where |x| * inv cannot be Inf * 0: the fast path applies. Otherwise
        # (gs == 0, tiny or NaN gs) Inf * 0 or 0 * Inf can make single elements NaN: exact per-element path.
        if tl.abs(tl.math.div_rn(1.0, gs)) < 1.2676506002282294e30:
            packed = fp4_encode_pairs(w, lo, hi, inv, inv == inv, IN_KIND, HW_FP4)
        else:
            packed = fp4_encode_exact(lo, hi, inv[:, :, None], HW_FP4)
    tl.store(codes_ptr + rows[:, None, None].to(tl.int64) * (K // 2) + pcol, packed, mask=mask)

    # Scales: the swizzled layout's padding rows/cols are written too, forced to 0 (GEMMs read them;
    # a NaN global scale would otherwise make them NaN).
    scols = pid_k * NB + tl.arange(0, NB)
    if SWIZZLE:
        # The 4 scales of a 4-column group are 4 consecutive bytes of the 128x4 layout: one int32 store per
        # group (byte c % 4 at bits 8 * (c % 4)) instead of 4 scattered byte stores (NB is a multiple of 4:
        # BLOCK_K >= 4 * SB); the word of group g is the byte offset of column 4g, divided by 4. Faster at 2x2048
        # tiles, equal at 1x4096 (docs/quant.md, alternatives measured).
        valid = (rows < M)[:, None] & (scols < K // SB)[None, :]
        sb4 = tl.reshape(tl.where(valid, sbyte, 0).to(tl.int32), [BLOCK_M, NB // 4, 4])
        words4 = tl.sum(sb4 << (tl.arange(0, 4) * 8)[None, None, :], axis=2)
        grp = pid_k * (NB // 4) + tl.arange(0, NB // 4)
        wofs = swizzled_offset_128x4(rows[:, None], grp[None, :] * 4, scale_cols_padded) // 4
        gmask = (rows < grid_rows)[:, None] & (grp * 4 < scale_cols_bound)[None, :]
        tl.store(scales_ptr.to(tl.pointer_type(tl.int32)) + wofs, words4, mask=gmask)
    else:
        smask = (rows < grid_rows)[:, None] & (scols < scale_cols_bound)[None, :]
        sofs = rows[:, None].to(tl.int64) * (K // SB) + scols[None, :]
        tl.store(scales_ptr + sofs, sbyte, mask=smask)


@triton.jit
def _fp4_dequantize_kernel(
    codes_ptr, scales_ptr, gs_ptr, out_ptr, M, K, scale_cols_padded,
    IS_MX: tl.constexpr, SWIZZLE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Mirror of the quantize kernel: [BLOCK_M, blocks, bytes per block], byte p of a row = elements 2p (low
    nibble) and 2p+1, written as one output pair word (two 16-bit values in an int32, two fp32 in an int64),
    so nothing is reshaped or joined (those cost layout shuffles)."""
    SB: tl.constexpr = 32 if IS_MX else 16
    NB: tl.constexpr = BLOCK_K // SB
    HP: tl.constexpr = SB // 2
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # int32; widened per row where it scales a stride
    pcol = (pid_k * (BLOCK_K // 2) + tl.arange(0, NB)[None, :, None] * HP + tl.arange(0, HP)[None, None, :])
    mask = (rows[:, None, None] < M) & (pcol < K // 2)
    pofs = rows[:, None, None].to(tl.int64) * (K // 2) + pcol  # 64-bit per row, 32-bit per column
    b = tl.load(codes_ptr + pofs, mask=mask, other=0).to(tl.int32)

    scols = pid_k * NB + tl.arange(0, NB)
    smask = (rows < M)[:, None] & (scols < K // SB)[None, :]
    if SWIZZLE:
        sofs = swizzled_offset_128x4(rows[:, None], scols[None, :], scale_cols_padded)
    else:
        sofs = rows[:, None].to(tl.int64) * (K // SB) + scols[None, :]
    sbyte = tl.load(scales_ptr + sofs, mask=smask, other=0)
    if IS_MX:
        sb = sbyte.to(tl.uint32)
        s = (tl.maximum(sb, 1) << 23).to(tl.float32, bitcast=True)
        s = tl.where(sb == 0, 5.877471754111438e-39, s)  # 2^-127 (fp32 subnormal)
        s = tl.where(sb == 255, float("nan"), s)
    else:
        s = e4m3_decode_fast(sbyte, EMULATE)
    s3 = s[:, :, None]
    v_lo = e2m1_decode_nibble(b) * s3  # (value * scale) * gs, the reference's order
    v_hi = e2m1_decode_nibble(b >> 4) * s3
    if not IS_MX:
        gs = tl.load(gs_ptr)
        v_lo = v_lo * gs
        v_hi = v_hi * gs
    if OUT_DTYPE == tl.float32:
        word = (v_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
                | (v_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32)).to(tl.int64, bitcast=True)
    else:
        y_lo = cast_out(v_lo, OUT_DTYPE, EMULATE).to(tl.uint16, bitcast=True).to(tl.uint32)
        y_hi = cast_out(v_hi, OUT_DTYPE, EMULATE).to(tl.uint16, bitcast=True).to(tl.uint32)
        word = (y_lo | (y_hi << 16)).to(tl.int32, bitcast=True)
    tl.store(out_ptr + pofs, word, mask=mask)


# ------------------------------------------------------------------------------------------ launchers


def _quantize(x: torch.Tensor, op: str, *, is_mx: bool, swizzle: bool, rceil: bool = False,
              global_scale: torch.Tensor | None = None, amax_partials: torch.Tensor | None = None):
    """amax_partials (NVFP4 without a global scale): fp32 partial maxima of |x| already computed by the caller
    (the kernel folds them into amax / 2688 as it does its own amax pass's)."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    block = MXFP4_BLOCK if is_mx else NVFP4_BLOCK
    x2 = rows_view(op, "x", x)
    rows = x2.shape[0]
    codes = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(fp4_scales_shape(lead, k, block, swizzle), device=x.device,
                         dtype=torch.uint8 if is_mx else torch.float8_e4m3fn)
    gs_out = torch.empty((), dtype=torch.float32, device=x.device)
    if scales.numel() == 0 or k == 0:
        if not is_mx:
            gs_out.copy_(global_scale.reshape(()) if global_scale is not None else gs_out.new_zeros(()))
        scales.view(torch.uint8).zero_()
        return codes, scales, gs_out
    grid_rows = scales.shape[0] if swizzle else rows  # swizzled: programs also cover the padding rows
    cfg, tiles = fp4_tiling(grid_rows, k, block, swizzle, x.device)
    scale_cols_padded = round_up(k // block, 4)
    gs_mode, gs_in, n_partials, partials_block = GS_NONE, gs_out, 1, 1
    if not is_mx and global_scale is not None:
        gs_mode, gs_in = GS_GIVEN, global_scale
    elif not is_mx and amax_partials is not None:
        gs_mode, gs_in, n_partials = GS_FROM_PARTIALS, amax_partials, amax_partials.numel()
        partials_block = triton.next_power_of_2(n_partials)
    elif not is_mx:
        gs_mode = GS_FROM_PARTIALS
        plan = amax_plan(rows, k, x.device)
        n_partials = plan.n_m * plan.n_k
        partials_block = triton.next_power_of_2(n_partials)
        gs_in = torch.empty(n_partials, dtype=torch.float32, device=x.device)
        launch(_amax_partials_kernel, (plan.n_m, plan.n_k),
            x2, gs_in, rows, k, x2.stride(0), plan.rows_per_prog, plan.cols_per_prog,
            BLOCK_M=plan.block_m, BLOCK_K=plan.block_k, num_warps=plan.num_warps)
    words = x2.view(torch.int64 if x.dtype == torch.float32 else torch.int32)
    grid = (triton.cdiv(grid_rows, cfg.block_m * tiles), triton.cdiv(k, cfg.block_k))
    launch(_fp4_quantize_kernel, grid,
        words, codes, scales.view(torch.uint8), gs_in, gs_out,
        rows, k, words.stride(0), grid_rows, scale_cols_padded if swizzle else k // block, scale_cols_padded,
        n_partials,
        IS_MX=is_mx, MX_RCEIL=rceil, GS_MODE=gs_mode, SWIZZLE=swizzle, IN_KIND=IN_KIND[x.dtype],
        EMULATE=emulate_formats(x.device), BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PARTIALS_BLOCK=partials_block,
        TILES=tiles, HW_FP4=hw_fp4(x.device), num_warps=cfg.num_warps)
    return codes, scales, gs_out


@functools.lru_cache(maxsize=4096)  # called on every eager launch; the answer depends only on the sizes
def fp4_tiling(rows: int, k: int, block: int, swizzle: bool, device: torch.device) -> tuple[TileConfig, int]:
    """(tile, row tiles per program) of the FP4 quantize kernel. Long batches on the GPU walk several one-row
    tiles per program with the next tile's loads issued before this tile's math (TILES): Nsight Compute had the
    one-tile kernel's warps stalled on memory latency once the ALU work was issued. Linear scales: 1x2048 tiles
    x 4; swizzled: 1x4096 tiles, x 2 for NVFP4 (x 4 measured slower) and x 4 for MXFP4; each 5-8% faster than one
    tile per program on the H200 at 8192^2 (docs/quant.md, alternatives measured). Short batches keep one tile per
    program (more programs)."""
    base = pick_tile(rows, k, device, min_block_k=4 * block, max_block_k=4096)
    if device.type == "cpu" or rows < 1024 or k < 2048:  # narrow rows: the base tile already holds many rows
        return base, 1
    width = 4096 if swizzle else 2048
    return TileConfig(1, max(4 * block, min(next_pow2(k), width)), 4), 2 if swizzle and block == 16 else 4


def _dequantize(codes, scales, gs, *, is_mx: bool, swizzle: bool, out_dtype: torch.dtype):
    lead, k = tuple(codes.shape[:-1]), codes.shape[-1] * 2
    out = torch.empty(*lead, k, dtype=out_dtype, device=codes.device)
    if out.numel() == 0:
        return out
    rows = out.numel() // k
    block = MXFP4_BLOCK if is_mx else NVFP4_BLOCK
    cfg = pick_tile(rows, k, codes.device, min_block_k=4 * block)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    out_words = out.view(torch.int64 if out_dtype == torch.float32 else torch.int32)  # one word per code byte
    launch(_fp4_dequantize_kernel, grid,
        codes, scales.view(torch.uint8), gs if gs is not None else codes, out_words, rows, k, round_up(k // block, 4),
        IS_MX=is_mx, SWIZZLE=swizzle, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(codes.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return out


# ------------------------------------------------------------------------------- checks


def _pair_stride_refusal(x) -> str | None:
    """The kernel reads element pairs as one word, so rows must start on a pair boundary. (The op's checks
    already made sure x views as [rows, K]; a single row has no row stride to speak of.)"""
    if x.numel() == 0:
        return None
    x2 = x.view(-1, x.shape[-1])
    if x2.shape[0] > 1 and x2.stride(0) % 2:
        return f"row stride {x2.stride(0)} is odd (rows must start at an even element)"
    return None


def supports_nvfp4_quantize(x, global_scale, swizzle) -> str | None:
    return _pair_stride_refusal(x)


def supports_mxfp4_quantize(x, rounding, swizzle) -> str | None:
    return _pair_stride_refusal(x)


# ------------------------------------------------------------------------------- backend entry points


def nvfp4_quantize(x, global_scale, swizzle):
    return _quantize(x, "nvfp4_quantize", is_mx=False, swizzle=swizzle, global_scale=global_scale)


def nvfp4_quantize_given_amax(x, amax_partials, swizzle):
    """NVFP4 with the global scale computed from partial maxima of |x| the caller already has (fused SwiGLU
    stores its float output and its amax, then quantizes here): same bytes as nvfp4_quantize(x, None, ...)."""
    return _quantize(x, "nvfp4_quantize", is_mx=False, swizzle=swizzle, amax_partials=amax_partials)


def nvfp4_dequantize(codes, scales, global_scale, swizzle, out_dtype):
    return _dequantize(codes.contiguous(), scales.contiguous(), global_scale, is_mx=False, swizzle=swizzle,
                       out_dtype=out_dtype)


def mxfp4_quantize(x, rounding, swizzle):
    codes, scales, _ = _quantize(x, "mxfp4_quantize", is_mx=True, swizzle=swizzle, rceil=rounding == "rceil")
    return codes, scales


def mxfp4_dequantize(codes, scales, swizzle, out_dtype):
    return _dequantize(codes.contiguous(), scales.contiguous(), None, is_mx=True, swizzle=swizzle,
                       out_dtype=out_dtype)


assert NVFP4_AMAX_TO_SCALE == 2688.0  # the kernel's literal


# ------------------------------------------------------------------------------------------ FP8 groups


@triton.jit
def _fp8_group_quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, M, K, stride_xm, stride_sm, stride_sg, eps,
    GROUP: tl.constexpr, UE8M0: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    # [BLOCK_M, groups, GROUP] addressed directly: no reshape (reshapes cost layout shuffles on GPU)
    r3 = rows[:, None, None]
    cols = pid_k * BLOCK_K + tl.arange(0, NG)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (r3 < M) & (cols < K)
    x = tl.load(x_ptr + r3 * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = amax_nan(x, 2)
    s, inv = fp8_group_scale(amax, eps, UE8M0)
    codes = e4m3_encode(x * inv[:, :, None], EMULATE)
    tl.store(codes_ptr + r3 * K + cols, codes, mask=mask)
    groups = pid_k * NG + tl.arange(0, NG)
    smask = (rows < M)[:, None] & (groups < K // GROUP)[None, :]
    tl.store(scales_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, s, mask=smask)


@triton.jit
def _fp8_group_dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, M, K, stride_sm, stride_sg,
    GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    # hardware E4M3 -> fp32 on sm_89+ (exact: every E4M3 value is an fp16 value); ~2x fewer instructions
    vals = e4m3_decode_fast(tl.load(codes_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0), EMULATE)
    groups = pid_k * NG + tl.arange(0, NG)
    smask = (rows < M)[:, None] & (groups < K // GROUP)[None, :]
    s = tl.load(scales_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, mask=smask, other=0.0)
    out = tl.reshape(tl.reshape(vals, [BLOCK_M, NG, GROUP]) * s[:, :, None], [BLOCK_M, BLOCK_K])
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], cast_out(out, OUT_DTYPE, EMULATE), mask=mask)


def _scale_strides(op: str, scales: torch.Tensor, rows: int, groups: int) -> tuple[int, int]:
    """(row stride, group stride) of scales as a [rows, groups] view (row- or column-major both work)."""
    try:
        return scales.view(rows, groups).stride()
    except RuntimeError:
        fail(op, "scales", f"shape {tuple(scales.shape)} with strides {scales.stride()} cannot be read as "
                           f"[{rows}, {groups}] without a copy")
    raise AssertionError("unreachable")


def _group_size_refusal(group_size: int) -> str | None:
    """Triton tiles need a power-of-two group of at least 16; the torch backend takes any divisor."""
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size} is not a power of two >= 16"
    return None


def supports_fp8_group_quantize(x, group_size, eps, ue8m0, column_major) -> str | None:
    return _group_size_refusal(group_size)


def supports_fp8_group_dequantize(codes, scales, group_size, out_dtype) -> str | None:
    return _group_size_refusal(group_size)


def fp8_group_quantize(x, group_size, eps, ue8m0, column_major):
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = rows_view("fp8_group_quantize", "x", x)
    rows = x2.shape[0]
    codes = torch.empty(*lead, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = fp8_scale_storage(lead, k // group_size, column_major, x.device)
    if codes.numel() == 0:
        return codes, scales
    cfg = pick_tile(rows, k, x.device, min_block_k=group_size)
    stride_sm, stride_sg = _scale_strides("fp8_group_quantize", scales, rows, k // group_size)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    launch(_fp8_group_quantize_kernel, grid,
        x2, codes.view(torch.uint8), scales, rows, k, x2.stride(0), stride_sm, stride_sg, float(eps),
        GROUP=group_size, UE8M0=ue8m0, EMULATE=emulate_formats(x.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return codes, scales


def fp8_group_dequantize(codes, scales, group_size, out_dtype):
    lead, k = tuple(codes.shape[:-1]), codes.shape[-1]
    codes = codes.contiguous()
    out = torch.empty(*lead, k, dtype=out_dtype, device=codes.device)
    if out.numel() == 0:
        return out
    rows = out.numel() // k
    stride_sm, stride_sg = _scale_strides("fp8_group_dequantize", scales, rows, k // group_size)
    cfg = pick_tile(rows, k, codes.device, min_block_k=group_size)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    launch(_fp8_group_dequantize_kernel, grid,
        codes.view(torch.uint8), scales, out, rows, k, stride_sm, stride_sg,
        GROUP=group_size, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(codes.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return out
