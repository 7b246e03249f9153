"""The quantized store stage shared by the fused kernels (RMSNorm, SwiGLU, and the GEMM epilogues that follow).

`quant_epilogue` rounds an fp32 tile to the output dtype and writes it either as is or quantized (FP8 1xG
groups, MXFP4, NVFP4) with exactly the math of the standalone quantizers (triton_ops/quant.py), so fused
bytes equal "round to dtype, then quantize" byte for byte. The mode constants are `tl.constexpr` so kernels
compare against the same names the launchers pass.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops.contract.formats import MXFP4_BLOCK, NVFP4_BLOCK, fp4_scales_shape, fp8_scale_storage, round_up

from ._formats import (
    amax_nan,
    cast_out,
    e4m3_encode,
    fp4_encode_exact,
    fp4_encode_pairs,
    fp8_group_scale,
    mxfp4_block_scale_ex,
    nvfp4_block_scale_ex,
    nvfp4_gs_from_amax,
    round_pairs_to,
    swizzled_offset_128x4,
)

FMT_NONE, FMT_FP8, FMT_MX, FMT_NV = (tl.constexpr(v) for v in range(4))  # output format
# NVFP4 global scale: none, given by the caller, one per MoE group, folded from an amax pass's partial maxima
GS_NONE, GS_GIVEN, GS_PER_GROUP, GS_FROM_PARTIALS = (tl.constexpr(v) for v in range(4))
PASS_SINGLE, PASS_AMAX, PASS_QUANT = (tl.constexpr(v) for v in range(3))  # one pass, or amax then quantize
MAX_PARTIALS = 512  # amax partials per two-pass call; every quantize program folds them (2 KB from L2)


# ------------------------------------------------------------------------------ shared store epilogue


@triton.jit
def fold_partials(partial_ptr, n_partials, PARTIALS_BLOCK: tl.constexpr):
    """Decode-form NVFP4 global scale amax / 2688 from the amax pass's partial maxima."""
    pofs = tl.arange(0, PARTIALS_BLOCK)
    partials = tl.load(partial_ptr + pofs, mask=pofs < n_partials, other=0.0)
    return nvfp4_gs_from_amax(amax_nan(partials, 0))


def alloc_epilogue_outputs(fmt, lead, n, out_dtype, group, column_major, swizzle, device):
    """(out, scales) tensors that quant_epilogue fills for an n-wide output row (scales is out for FMT_NONE)."""
    if fmt == FMT_NONE:
        out = torch.empty(*lead, n, dtype=out_dtype, device=device)
        return out, out
    if fmt == FMT_FP8:
        return (torch.empty(*lead, n, dtype=torch.float8_e4m3fn, device=device),
                fp8_scale_storage(lead, n // group, column_major, device))
    sb = MXFP4_BLOCK if fmt == FMT_MX else NVFP4_BLOCK
    sdt = torch.uint8 if fmt == FMT_MX else torch.float8_e4m3fn
    scales = torch.empty(fp4_scales_shape(lead, n, sb, swizzle), dtype=sdt, device=device)
    return torch.empty(*lead, n // 2, dtype=torch.uint8, device=device), scales


@dataclasses.dataclass(frozen=True)
class EpilogueGeometry:
    """Where quant_epilogue writes scales, for an n-wide output row of `rows` rows."""

    stride_sm: int  # scale row stride (elements)
    stride_sg: int  # scale column stride
    scale_cols_padded: int  # FP4 swizzled: scale columns rounded up to 4 (0 otherwise)
    grid_rows: int  # rows the programs cover (swizzled FP4: padded to 128, padding scales written as 0)


def epilogue_geometry(fmt, scales, rows, n, group, swizzle) -> EpilogueGeometry:
    if fmt == FMT_FP8:
        stride_sm, stride_sg = scales.view(rows, n // group).stride()
        return EpilogueGeometry(stride_sm, stride_sg, 0, rows)
    if fmt in (FMT_MX, FMT_NV):
        sb = MXFP4_BLOCK if fmt == FMT_MX else NVFP4_BLOCK
        return EpilogueGeometry(n // sb, 1, round_up(n // sb, 4), round_up(rows, 128) if swizzle else rows)
    return EpilogueGeometry(0, 1, 0, rows)


@triton.jit
def out_pairs(y, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
              HP: tl.constexpr):
    """y (fp32 [BLOCK_M, 2 * NB * HP]) rounded to OUT_DTYPE, as fp32 pairs (even, odd column) [BLOCK_M, NB, HP]:
    the quantize kernel's layout (triton_ops/quant.py), so its per-pair code applies as is. Also returns the
    pairs' sign word (bit 15: even's sign, bit 31: odd's), what that code reads from a bf16/fp16 input pair word.
    Rounding keeps the sign, so these are the signs of the rounded outputs. The pair is split before rounding so
    one cvt rounds both (round_pairs: a per-element cast read back as fp32 is one slow-pipe F2F per element)."""
    lo, hi = tl.split(tl.reshape(y, [BLOCK_M, NB, HP, 2]))
    w, lo, hi = round_pairs_to(lo, hi, OUT_DTYPE, EMULATE)
    return lo, hi, w


@triton.jit
def pair_amax_bits(lo, hi):
    """max(|lo|, |hi|) as uint32 bits, NaN-propagating (as the quantize kernel: one max.NaN per pair; an unsigned
    max of these bits then propagates NaN whatever its sign bit, which the caller clears)."""
    return tl.maximum(tl.abs(lo), tl.abs(hi), propagate_nan=tl.PropagateNan.ALL).to(tl.uint32, bitcast=True)


@triton.jit
def nvfp4_exact_path(gs, row_ok):
    """Whether an NVFP4 tile needs the exact per-element E2M1 encode (an int32 scalar, 0 or 1): with |1/gs| <
    2^100 on every row where row_ok (gs [BLOCK_M] per row), inv = (1/gs)/s32 is finite, NaN only for a whole
    NaN block and 0 only where |y| * inv cannot be Inf * 0, so q = y * inv is NaN only where the whole block's
    inv is and the fast encode is exact (the quantize kernel's test; docs/design_notes.md).
    A zero, tiny or NaN gs on a stored row selects the exact path. Callers with one gs for all rows evaluate
    this once per program."""
    bad = row_ok & ((tl.abs(tl.math.div_rn(1.0, gs)) < 1.2676506002282294e30) == 0)
    return tl.max(bad.to(tl.int32), 0)


@triton.jit
def tile_amax_bits(y, row_ok, col_ok, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Per-row max |dtype(y)| as int bits (NaN-propagating) over the columns where col_ok ([BLOCK_N // 2], per
    output pair: K is even) and the rows where row_ok ([BLOCK_M]): [BLOCK_M] int32. Masked lanes are excluded,
    not assumed finite (RMSNorm with eps = 0 makes Inf * 0 there)."""
    lo, hi, w = out_pairs(y, OUT_DTYPE, EMULATE, BLOCK_M, 1, BLOCK_N // 2)
    m = pair_amax_bits(lo, hi) & tl.where(col_ok, -1, 0).to(tl.uint32)[None, None, :]
    rmax = (tl.max(tl.max(m, 2), 1) & 0x7FFFFFFF).to(tl.int32, bitcast=True)
    return tl.where(row_ok, rmax, 0)


@triton.jit
def quant_epilogue(
    y, rows, row_in, col0, K, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs, gs_exact,
    scale_rows_bound, scale_cols_bound, scale_cols_padded, fp8_eps,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr,
    SWIZZLE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW_FP4: tl.constexpr = False,
):
    """Round y (fp32 [BLOCK_M, BLOCK_N]) to OUT_DTYPE and store it, plain or quantized.

    rows (int64) / row_in: the tile's rows and which of them exist (< M); col0: the tile's first column of
    a K-wide output row (a multiple of BLOCK_N). gs: fp32 [BLOCK_M] NVFP4 global scale per row; gs_exact:
    nvfp4_exact_path(gs, row_in) (NVFP4 only; computed by the caller, once per program where gs is uniform).
    Swizzled scales: programs also cover the padding rows up to scale_rows_bound and the padding columns up
    to scale_cols_padded, writing zero bytes there (GEMMs read them). HW_FP4: FP4 codes by the Blackwell pair
    convert (blackwell.hw_fp4; same bytes, _formats.fp4_encode_pairs).
    """
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = row_in[:, None] & (cols < K)[None, :]
    if FMT == FMT_NONE:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], cast_out(y, OUT_DTYPE, EMULATE), mask=mask)
    elif FMT == FMT_FP8:
        NG: tl.constexpr = BLOCK_N // GROUP
        # rounded in pairs (one cvt per two values, see out_pairs), then back to [BLOCK_M, NG, GROUP]
        lo, hi = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_N // 2, 2]))
        _, lo, hi = round_pairs_to(lo, hi, OUT_DTYPE, EMULATE)
        yg = tl.reshape(tl.join(lo, hi), [BLOCK_M, NG, GROUP])
        amax = amax_nan(yg, 2)
        s, inv = fp8_group_scale(amax, fp8_eps, UE8M0)  # the foundation's rule (triton_ops/_formats.py)
        q = yg * inv[:, :, None]
        codes = e4m3_encode(tl.reshape(q, [BLOCK_M, BLOCK_N]), EMULATE)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], codes, mask=mask)
        groups = col0 // GROUP + tl.arange(0, NG)
        smask = row_in[:, None] & (groups < K // GROUP)[None, :]
        tl.store(scale_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, s, mask=smask)
    else:
        # FP4: round, split into (even, odd) pairs, then the quantize kernel's per-pair math (fp4_pack_store)
        SB: tl.constexpr = 32 if FMT == FMT_MX else 16
        NB: tl.constexpr = BLOCK_N // SB
        HP: tl.constexpr = SB // 2
        AMAX16: tl.constexpr = OUT_DTYPE != tl.float32  # amax is a bf16/fp16 value: div6_rn is exact
        lo, hi, w = out_pairs(y, OUT_DTYPE, EMULATE, BLOCK_M, NB, HP)
        # pair p of block b is output byte col0 / 2 + b * HP + p (the even element in the low nibble)
        pcols = col0 // 2 + tl.arange(0, NB)[None, :, None] * HP + tl.arange(0, HP)[None, None, :]
        fp4_pack_store(w, lo, hi, rows, row_in, pcols, col0 // SB, K // 2, out_ptr, stride_om, scale_ptr, stride_sm,
                       gs, gs_exact, scale_rows_bound, scale_cols_padded, FMT, MX_RCEIL, SWIZZLE, AMAX16, EMULATE,
                       NB, HP, HW_FP4)


@triton.jit
def store_zero_rows(rows, row_in, col0, K, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, fp8_eps,
                    scale_cols_padded, FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr,
                    SWIZZLE: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What quant_epilogue stores for y = 0 on the rows in row_in: zeros in OUT_DTYPE, zero FP8 codes with the
    scale of an all-zero group, or FP4 (MXFP4 / NVFP4) zero code and scale bytes (amax 0 gives E8M0 byte 0 with
    either rounding; NVFP4: the bytes the SwiGLU op stores on MoE padding rows, zero whatever the global scale),
    linear or 128x4-swizzled (swizzled: the row's padding scale columns up to scale_cols_padded too; a byte
    scale_ptr). Stored directly rather than by running quant_epilogue on a constant zero tile: compiled for sm_90
    by Triton 3.6, that constant path stored wrong FP8 codes (random bytes in place of 0x00, with the right
    scales) while the same call on the interpreter was exact."""
    cols = col0 + tl.arange(0, BLOCK_N)
    mask = row_in[:, None] & (cols < K)[None, :]
    if FMT == FMT_NONE:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], tl.zeros([BLOCK_M, BLOCK_N], OUT_DTYPE),
                 mask=mask)
    elif FMT == FMT_FP8:
        NG: tl.constexpr = BLOCK_N // GROUP
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], tl.zeros([BLOCK_M, BLOCK_N], tl.uint8),
                 mask=mask)
        s, _ = fp8_group_scale(tl.zeros([BLOCK_M, NG], tl.float32), fp8_eps, UE8M0)
        groups = col0 // GROUP + tl.arange(0, NG)
        smask = row_in[:, None] & (groups < K // GROUP)[None, :]
        tl.store(scale_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, s, mask=smask)
    else:
        SB: tl.constexpr = 32 if FMT == FMT_MX else 16
        pcols = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + rows[:, None] * stride_om + pcols[None, :], tl.zeros([BLOCK_M, BLOCK_N // 2], tl.uint8),
                 mask=row_in[:, None] & (pcols < K // 2)[None, :])
        scols = col0 // SB + tl.arange(0, BLOCK_N // SB)
        zeros = tl.zeros([BLOCK_M, BLOCK_N // SB], tl.uint8)
        if SWIZZLE:
            sofs = swizzled_offset_128x4(rows[:, None], scols[None, :], scale_cols_padded)
            tl.store(scale_ptr + sofs, zeros, mask=row_in[:, None] & (scols < scale_cols_padded)[None, :])
        else:
            tl.store(scale_ptr + rows[:, None] * stride_sm + scols[None, :], zeros,
                     mask=row_in[:, None] & (scols < K // SB)[None, :])


@triton.jit
def fp4_pack_store(
    w, lo, hi, rows, row_in, pcol, scol0, Kp, out_ptr, stride_om, scale_ptr, stride_sm, gs, gs_exact,
    scale_rows_bound, scale_cols_padded,
    FMT: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr, AMAX16: tl.constexpr, EMULATE: tl.constexpr,
    NB: tl.constexpr, HP: tl.constexpr, HW_FP4: tl.constexpr = False,
):
    """The FP4 tail both epilogues share, on outputs already rounded to their dtype and split into (even, odd)
    pairs [BLOCK_M, NB, HP] (lo / hi as fp32, w the pair words whose bits 15 and 31 are the signs): the
    quantize kernel's per-pair math (docs/design_notes.md): amax by
    max.NaN per pair, bf16/fp16 amax / 6 by div6_rn (AMAX16), hardware E4M3 block scales off the interpreter,
    E2M1 by one fp32 add, NaN per block; then the packed bytes (pcol: their output byte columns [1, NB, HP],
    Kp = K // 2) and the block scales (scol0: the first block's scale column; swizzled: padding rows/columns
    up to scale_rows_bound / scale_cols_padded get zero bytes, GEMMs read them). HW_FP4: E2M1 by the Blackwell
    pair convert (same bytes, _formats.fp4_encode_pairs)."""
    amax = (tl.max(pair_amax_bits(lo, hi), 2) & 0x7FFFFFFF).to(tl.float32, bitcast=True)  # [BLOCK_M, NB]
    if FMT == FMT_MX:
        sbyte, inv = mxfp4_block_scale_ex(amax, MX_RCEIL, AMAX16)
        # inv: a finite power of two for a finite block (q finite), NaN for a NaN/Inf block
        packed = fp4_encode_pairs(w, lo, hi, inv, inv == inv, 0, HW_FP4)
    else:
        sbyte, inv = nvfp4_block_scale_ex(amax, gs[:, None], EMULATE, AMAX16)
        if gs_exact == 0:  # see nvfp4_exact_path
            packed = fp4_encode_pairs(w, lo, hi, inv, inv == inv, 0, HW_FP4)
        else:
            packed = fp4_encode_exact(lo, hi, inv[:, :, None], HW_FP4)
    pmask = row_in[:, None, None] & (pcol < Kp)
    tl.store(out_ptr + rows[:, None, None] * stride_om + pcol, packed, mask=pmask)
    scols = scol0 + tl.arange(0, NB)[None, :]  # [1, NB]: the blocks' scale columns
    if SWIZZLE:
        smask = (rows < scale_rows_bound)[:, None] & (scols < scale_cols_padded)
        valid = row_in[:, None] & (scols < Kp // HP)
        sofs = swizzled_offset_128x4(rows[:, None], scols, scale_cols_padded)
        tl.store(scale_ptr + sofs, tl.where(valid, sbyte, 0).to(tl.uint8), mask=smask)
    else:
        smask = row_in[:, None] & (scols < Kp // HP)
        tl.store(scale_ptr + rows[:, None] * stride_sm + scols, sbyte, mask=smask)


def min_block(fmt: int, group: int) -> int:
    """Smallest column tile for a format: one FP8 group, or four FP4 blocks (whole swizzled 4-column groups)."""
    return {FMT_NONE: 16, FMT_FP8: group, FMT_MX: 4 * MXFP4_BLOCK, FMT_NV: 4 * NVFP4_BLOCK}[fmt]
