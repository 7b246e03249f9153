"""Fused SwiGLU (plain / clamped / GPT-OSS; concatenated or interleaved gate|up; dense or MoE rows) with a
bf16/fp16 or quantized output (Triton). Contract: dispatch/reference/swiglu.py.

A program owns a BLOCK_M x BLOCK_N tile of the [rows, I] output. Concatenated input: two 16-byte-vector
loads (gate at c, up at I + c). Interleaved at granularity g: one contiguous load of the 2*BLOCK_N input
columns, then reshape [.., BLOCK_N/g, 2, g] -> permute -> split, so loads stay fully vectorized.
MoE padding rows (expert id -1, or m >= masked_m[g]) are not read; their outputs are the quantizer's bytes
for zeros. The quantized store is triton_ops/rmsnorm.py:quant_epilogue (the foundation's math).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops.contract.checks import rows_view
from triton_ops.contract.formats import round_up

from . import quant
from ._formats import IN_KIND, abs_bits, cast_out, exp_accurate, exp_flush, nvfp4_effective_gs, split_pairs
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
    GS_PER_GROUP,
    MAX_PARTIALS,
    PASS_AMAX,
    PASS_QUANT,
    PASS_SINGLE,
    alloc_epilogue_outputs,
    epilogue_geometry,
    fold_partials,
    min_block,
    nvfp4_exact_path,
    quant_epilogue,
    tile_amax_bits,
)

MOE_NONE, MOE_CONTIGUOUS, MOE_MASKED = 0, 1, 2
IN_WORD = {torch.bfloat16: torch.int32, torch.float16: torch.int32, torch.float32: torch.int64}


@triton.jit
def _load_tile(x_ptr, eid_ptr, mm_ptr, rows, M, I, cols, cmask, stride_xm, max_m, n_exp,
               INTERLEAVE: tl.constexpr, PAIR_WORDS: tl.constexpr, MOE: tl.constexpr):
    """Raw gate/up inputs of a [BLOCK_M, BLOCK_N] output tile (rows int64), its rows' expert/group ids and
    which rows hold tokens (MoE padding rows and rows >= M are not read). Contiguous layout: expert ids outside
    [0, n_exp) are padding too (n_exp: the per-expert NVFP4 scales there are, else 2^31 - 1)."""
    row_in = rows < M
    if MOE == 1:
        grp = tl.load(eid_ptr + rows, mask=row_in, other=-1).to(tl.int32)
        tok = (grp >= 0) & (grp < n_exp)
    elif MOE == 2:
        grp = (rows // max_m).to(tl.int32)
        valid_m = tl.load(mm_ptr + grp, mask=row_in, other=0)
        tok = row_in & ((rows % max_m) < valid_m)
    else:
        grp = tl.zeros(rows.shape, dtype=tl.int32)
        tok = row_in
    mask = tok[:, None] & cmask[None, :]
    if INTERLEAVE == 0:
        base = x_ptr + rows[:, None] * stride_xm + cols[None, :]
        a = tl.load(base, mask=mask, other=0.0)
        b = tl.load(base + I, mask=mask, other=0.0)
    elif PAIR_WORDS:
        # GPT-OSS even/odd (g = 1): x_ptr is a word view (bf16/fp16 pairs in int32, fp32 pairs in int64), so
        # word c is (gate c, up c): one 16-byte vector load, split in registers (no reshape/split shuffles).
        a = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0)
        b = a
    else:
        # Chunks of g: gate column (c // g) * 2g + c % g, up g further. Triton's axis analysis sees runs of g
        # contiguous columns, so g >= 8 (16-bit) keeps 16-byte loads; no permute through shared memory.
        gcol = (cols // INTERLEAVE) * (2 * INTERLEAVE) + cols % INTERLEAVE
        base = x_ptr + rows[:, None] * stride_xm + gcol[None, :]
        a = tl.load(base, mask=mask, other=0.0)
        b = tl.load(base + INTERLEAVE, mask=mask, other=0.0)
    return a, b, grp, tok


@triton.jit
def _exp_neg(x, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """e^-x for the sigmoid denominator. 16-bit outputs: exp_flush (1 + e^-x is the same with subnormal e^-x
    flushed; 3 fewer instructions per element than tl.exp). fp32 outputs: exp_accurate, because the ex2.approx
    forms lose up to ~22 fp32 ulps for large |x|, more than the fp32 output's tolerance (docs/swiglu.md)."""
    if OUT_DTYPE == tl.float32:
        return exp_accurate(-x, EMULATE)
    else:
        return exp_flush(-x, EMULATE)


@triton.jit
def _silu_ratio(g, d, DIV_RN: tl.constexpr):
    """g / d for d = 1 + e^-g' >= 1: div.rn (exact, ~10 SASS instructions with its range check and slow-path
    branch) or '/' (div.full.f32: <= 2 fp32 ulps, full range, ~4 instructions). exp is not correctly rounded on
    any backend, so the float output is a tolerance contract either way (docs/swiglu.md)."""
    if DIV_RN:
        return tl.math.div_rn(g, d)
    else:
        return g / d


@triton.jit
def swiglu_act(g, u, alpha, limit, GPTOSS: tl.constexpr, CLAMP: tl.constexpr, DIV_RN: tl.constexpr,
               OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """The activation on fp32 gate / up (the contract's math, before the one rounding to OUT_DTYPE); shared with
    the fused GEMM epilogue (triton_ops/moe_gemm/fused.py), so both produce the same bytes."""
    if CLAMP:
        g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
        u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                       propagate_nan=tl.PropagateNan.ALL)
    if GPTOSS:
        y = _silu_ratio(g, 1.0 + _exp_neg(alpha * g, OUT_DTYPE, EMULATE), DIV_RN) * (u + 1.0)
    else:
        y = _silu_ratio(g, 1.0 + _exp_neg(g, OUT_DTYPE, EMULATE), DIV_RN) * u
    return y


@triton.jit
def _swiglu_kernel(
    x_ptr, out_ptr, scale_ptr, gs_ptr, gs_out_ptr, partial_ptr, eid_ptr, mm_ptr,
    M, I, stride_xm, stride_om, stride_sm, stride_sg, alpha, limit, fp8_eps, max_m, rows_per_prog,
    scale_rows_bound, scale_cols_padded, n_partials, n_gs, n_exp,
    INTERLEAVE: tl.constexpr, PAIR_WORDS: tl.constexpr, IN_KIND: tl.constexpr,
    GPTOSS: tl.constexpr, CLAMP: tl.constexpr, MOE: tl.constexpr,
    PASS: tl.constexpr, GS_MODE: tl.constexpr, DIV_RN: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr,
    OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS_BLOCK: tl.constexpr, STORE_AMAX: tl.constexpr = False,
    HW_FP4: tl.constexpr = False,
):
    """STORE_AMAX (float output, single pass): also atomic-max the tile's max |stored y| bits into partial_ptr[0]
    (int32, zeroed by the caller): the computed-global-scale NVFP4 path quantizes that y afterwards."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    cmask = cols < I
    gs_all = 0.0
    if GS_MODE == GS_GIVEN:
        gs_all = tl.load(gs_ptr)
        if (pid_m == 0) & (pid_n == 0):  # the returned global scale: copied here, not by a second launch
            tl.store(gs_out_ptr, gs_all)
        gs_all = nvfp4_effective_gs(gs_all)  # |gs| < 2^-118 -> 0 for the block scales (the contract)
    if GS_MODE == GS_FROM_PARTIALS:
        gs_all = fold_partials(partial_ptr, n_partials, PARTIALS_BLOCK)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(gs_out_ptr, gs_all)
        gs_all = nvfp4_effective_gs(gs_all)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    row0 = pid_m.to(tl.int64) * rows_per_prog
    # Software prefetch (as in rmsnorm.py) in the NVFP4 amax pass, whose <= MAX_PARTIALS programs each walk
    # many rows: the next block's gate/up are loaded before this block's math. The other passes own one block
    # per program and do not prefetch (a prefetch in every pass took plain silu*mul 16384x4096 from 0.96 to 0.70
    # of copy on the H200).
    a, b, grp, tok = _load_tile(x_ptr, eid_ptr, mm_ptr, row0 + tl.arange(0, BLOCK_M), M, I, cols, cmask, stride_xm,
                                max_m, n_exp, INTERLEAVE, PAIR_WORDS, MOE)
    # Only the amax pass walks several blocks; elsewhere the loop has one trip, made a compile-time one: with a
    # runtime bound ptxas hoists the (loop-invariant) math out of the loop, runs both sides of the NVFP4
    # epilogue's fast/exact branch for every tile and unrolls the store tail 4x (sm_90 SASS, 16 outputs per
    # thread: FP8 29.4 instructions per output with the compile-time trip against 32.9 with a runtime one).
    if PASS == PASS_AMAX:
        loop_rows = rows_per_prog
    else:
        loop_rows: tl.constexpr = BLOCK_M
    for m0 in range(0, loop_rows, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        row_in = rows < M
        if PASS == PASS_AMAX:  # only the amax pass walks several blocks; elsewhere rows_per_prog == BLOCK_M
            nxt = tl.where(m0 + BLOCK_M < rows_per_prog, rows + BLOCK_M, M)  # past the program's rows: no load
            a_next, b_next, grp_next, tok_next = _load_tile(x_ptr, eid_ptr, mm_ptr, nxt, M, I, cols, cmask,
                                                            stride_xm, max_m, n_exp, INTERLEAVE, PAIR_WORDS, MOE)
        if PAIR_WORDS:
            g, u = split_pairs(a, IN_KIND)
        else:
            g = a.to(tl.float32)
            u = b.to(tl.float32)
        y = swiglu_act(g, u, alpha, limit, GPTOSS, CLAMP, DIV_RN, OUT_DTYPE, EMULATE)
        if PASS == PASS_AMAX:
            acc = tl.maximum(acc, tile_amax_bits(y, tok, col0 // 2 + tl.arange(0, BLOCK_N // 2) < I // 2, OUT_DTYPE,
                                                 EMULATE, BLOCK_M, BLOCK_N))
        else:
            if GS_MODE == GS_PER_GROUP:  # one global scale per expert / group
                gidx = tl.minimum(tl.maximum(grp, 0), n_gs - 1)
                # Padding rows: y is +0 there (zeros in, alpha and limit finite), so any finite gs > 0 gives the
                # zero bytes they must hold; 1.0 (not 0) keeps them off the epilogue's exact per-element path,
                # which a zero global scale on a stored row selects for the whole tile.
                gs = nvfp4_effective_gs(tl.load(gs_ptr + gidx, mask=tok, other=1.0))
            else:
                gs = tl.zeros([BLOCK_M], dtype=tl.float32) + gs_all
            gs_exact = 0
            if FMT == FMT_NV:
                gs_exact = nvfp4_exact_path(gs, row_in)
            # (a pair-word FP4 epilogue like rmsnorm's is no faster here: SwiGLU FP4 is bound by the activation's
            # instructions, not the store; docs/swiglu.md, alternatives measured)
            quant_epilogue(y, rows, row_in, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs, gs_exact,
                           scale_rows_bound, 0, scale_cols_padded, fp8_eps,
                           FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N, HW_FP4)
            if STORE_AMAX:  # max |y| of what was stored (the rounded y); integer bits: NaN sorts above Inf.
                # Not tile_amax_bits: that re-rounds y in pairs (out_pairs); this reuses the store's own cast.
                bits = abs_bits(cast_out(y, OUT_DTYPE, EMULATE).to(tl.float32))
                bits = tl.where(tok[:, None] & cmask[None, :], bits, 0)
                tl.atomic_max(partial_ptr, tl.max(tl.max(bits, 1), 0))
        if PASS == PASS_AMAX:
            a = a_next
            b = b_next
            grp = grp_next
            tok = tok_next
    if PASS == PASS_AMAX:
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(acc, 0).to(tl.float32, bitcast=True))


# -------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class SwigluConfig:
    block_m: int  # rows per program
    block_n: int  # output columns per program: a power of two >= the quant block * 4 and >= interleave
    num_warps: int


def pick_swiglu_config(rows: int, i: int, device: torch.device, min_block_n: int, quantized: bool = False,
                       fp4: bool = False) -> SwigluConfig:
    """GPU: ~4K outputs per program (8 warps, 16-byte loads, ~16 values per thread in flight); columns up to
    1024 so wide rows still give many programs. Long batches: one row per program, the widest 2048/1024-column
    tile (4096 plain) with the fewest masked columns, 16 values per thread; FP4 outputs 32 per thread (2 warps per
    2048 outputs, two 1024-wide rows where the row takes 1024-wide tiles): 3-8% faster than 4 warps or one
    1024-wide row on the H200 at 16384 rows (docs/swiglu.md, alternatives measured). Interpreter: big tiles (cost
    is per program)."""
    if device.type != "cpu" and rows >= 2048:
        # the widest tile that wastes the fewest masked columns (GPT-OSS I = 2880: 3 x 1024, not 2 x 2048)
        widths = [b for b in ((2048, 1024) if quantized else (4096, 2048, 1024)) if b >= min_block_n] or [min_block_n]
        block_n = min(widths, key=lambda b: (round_up(max(i, 1), b) - max(i, 1), -b))
        if fp4:
            return SwigluConfig(max(1, 2048 // block_n), block_n, 2)
        return SwigluConfig(1, block_n, max(2, min(8, block_n // 512)))
    target, max_n = (32768, 4096) if device.type == "cpu" else (4096, 1024)
    block_n = max(min_block_n, min(next_pow2(max(i, 1)), max_n))
    block_m = max(1, min(next_pow2(max(rows, 1)), target // block_n))
    num_warps = 8 if block_m * block_n >= 4096 else 4
    return SwigluConfig(block_m, block_n, num_warps)


def supports_swiglu(x, interleave, *rest) -> str | None:
    if interleave > 0 and interleave & (interleave - 1):
        return f"interleave={interleave} is not a power of two (Triton reshapes by it)"
    return None


def supports_swiglu_fp8_group(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype,
                              group_size, *rest) -> str | None:
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size} is not a power of two >= 16"
    return supports_swiglu(x, interleave)


# ------------------------------------------------------------------------------------------- launcher


# silu's g / (1 + e^-g) for 16-bit outputs: div.full.f32 (False) or the exactly rounded div.rn (True); fp32 outputs
# always take div.rn. div.full is 8-18% faster on the H200 at 16384 x 4096 GPT-OSS (docs/swiglu.md, alternatives
# measured), and the bf16 outputs differ from a float64 evaluation of the formula equally often either way (1.6e-5
# of them, by one ulp).
SILU_DIV_RN = False

# NVFP4 with a computed global scale: from this many rows on, the float output is stored (with its amax) and
# then quantized by the NVFP4 quantizer, instead of two fused passes that each evaluate the activation. Same
# bytes by contract (quantized output == quantizer(own float output)); one evaluation of the activation instead of
# two is ~26% faster at 16384 x 4096 GPT-OSS (docs/swiglu.md, alternatives measured). Short batches keep the fused
# passes (no intermediate, two launches).
NVFP4_COMPUTED_GS_SPLIT_ROWS = 2048


def silu_div_rn(out_dtype: torch.dtype) -> bool:
    """The DIV_RN constexpr of swiglu_act for an output dtype (every kernel that evaluates the activation)."""
    return SILU_DIV_RN or out_dtype == torch.float32


def _swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, *, fmt, group=128,
            quant_eps=1e-10, ue8m0=False, column_major=False, rounding="floor", swizzle=False, global_scale=None,
            cfg=None, amax_out=None):
    """amax_out (float output only): int32 [1], zeroed, that receives max |y| as fp32 bits."""
    op = "swiglu"
    out_dtype = out_dtype or x.dtype
    lead, i = tuple(x.shape[:-1]), x.shape[-1] // 2
    x2 = rows_view(op, "x", x)
    rows = x2.shape[0]
    dev = x.device
    if fmt == FMT_NV and global_scale is None and rows >= max(1, NVFP4_COMPUTED_GS_SPLIT_ROWS) and i > 0:
        amax = torch.zeros(1, dtype=torch.int32, device=dev)
        y = _swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, fmt=FMT_NONE,
                    amax_out=amax)
        return quant.nvfp4_quantize_given_amax(y, amax.view(torch.float32), swizzle)
    gs_given_shape = () if global_scale is None or global_scale.numel() == 1 else (global_scale.numel(),)
    gs_out = torch.empty(gs_given_shape, dtype=torch.float32, device=dev)
    out, scales = alloc_epilogue_outputs(fmt, lead, i, out_dtype, group, column_major, swizzle, dev)
    results = out if fmt == FMT_NONE else ((out, scales, gs_out) if fmt == FMT_NV else (out, scales))
    # A given global scale is returned as a copy: one scale is copied by the kernel (GS_GIVEN), per-expert scales
    # by this launch (MoE layouts: two launches per call).
    per_group_gs = global_scale is not None and (expert_ids is not None or masked_m is not None
                                                 or global_scale.numel() > 1)
    if fmt == FMT_NV and global_scale is not None and (per_group_gs or rows == 0 or i == 0):
        gs_out.copy_(global_scale.reshape(gs_given_shape))
    if rows == 0 or i == 0:
        if fmt in (FMT_MX, FMT_NV):
            scales.view(torch.uint8).zero_()
        if fmt == FMT_NV and global_scale is None:
            gs_out.zero_()
        return results
    out2 = out.view(-1, out.shape[-1])
    geo = epilogue_geometry(fmt, scales, rows, i, group, swizzle)
    stride_sm, stride_sg, scale_cols_padded, grid_rows = geo.stride_sm, geo.stride_sg, geo.scale_cols_padded, \
        geo.grid_rows
    cfg = cfg or pick_swiglu_config(grid_rows, i, dev, max(min_block(fmt, group), interleave), fmt != FMT_NONE,
                                    fmt in (FMT_MX, FMT_NV))
    moe = MOE_CONTIGUOUS if expert_ids is not None else (MOE_MASKED if masked_m is not None else MOE_NONE)
    eid = expert_ids.reshape(-1) if expert_ids is not None else x2
    mm = masked_m if masked_m is not None else x2
    max_m = x.shape[1] if masked_m is not None else 1
    # g = 1: read (gate, up) pairs as one word each (needs an even row stride and offset for the word view)
    pair_words = interleave == 1 and x2.stride(0) % 2 == 0 and x2.storage_offset() % 2 == 0
    xs = x2.view(IN_WORD[x.dtype]) if pair_words else x2
    # fp32 outputs keep the exact division (their tolerance is a few fp32 ulps; see _silu_ratio)
    common = dict(INTERLEAVE=interleave, PAIR_WORDS=pair_words, IN_KIND=IN_KIND[x.dtype],
                  DIV_RN=silu_div_rn(out_dtype),
                  GPTOSS=activation == "gptoss", CLAMP=limit is not None, MOE=moe,
                  FMT=fmt, GROUP=group, UE8M0=ue8m0, MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle,
                  OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(dev), BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, HW_FP4=fmt in (FMT_MX, FMT_NV) and hw_fp4(dev), num_warps=cfg.num_warps)
    scale_arg = scales.view(torch.uint8) if fmt in (FMT_MX, FMT_NV) else scales
    out_arg = out2.view(torch.uint8) if fmt == FMT_FP8 else out2
    scalars = (float(alpha), float(limit if limit is not None else 0.0), float(quant_eps), max_m)
    n_col = cdiv(i, cfg.block_n)
    n_gs = global_scale.numel() if global_scale is not None else 1
    # per-expert NVFP4 scales (contiguous layout): rows of experts >= n_gs have no scale and are masked as padding
    n_exp = n_gs if fmt == FMT_NV and moe == MOE_CONTIGUOUS and n_gs > 1 else 2**31 - 1
    if fmt == FMT_NV and global_scale is None:
        row_progs = max(1, MAX_PARTIALS // n_col)
        rows_per_prog = round_up(max(cfg.block_m, cdiv(rows, row_progs)), cfg.block_m)
        n_row = cdiv(rows, rows_per_prog)
        n_partials = n_row * n_col
        partials = torch.empty(n_partials, dtype=torch.float32, device=dev)
        launch(_swiglu_kernel, (n_row, n_col),
            xs, out_arg, scale_arg, gs_out, gs_out, partials, eid, mm, rows, i, xs.stride(0), 0, 0, 0,
            *scalars, rows_per_prog, grid_rows, scale_cols_padded, n_partials, 1, n_exp,
            PASS=PASS_AMAX, GS_MODE=GS_NONE, PARTIALS_BLOCK=1, **common)
        gs_mode, pass_, partials_block = GS_FROM_PARTIALS, PASS_QUANT, next_pow2(n_partials)
    else:
        partials, n_partials, partials_block, pass_ = (amax_out if amax_out is not None else gs_out), 1, 1, PASS_SINGLE
        gs_mode = GS_NONE
        if fmt == FMT_NV:
            gs_mode = GS_PER_GROUP if (moe != MOE_NONE or n_gs > 1) else GS_GIVEN
    # the kernel reads the given scales at unit stride (a strided per-expert view would be misread)
    gs_in = global_scale.reshape(-1).contiguous() if global_scale is not None else gs_out
    launch(_swiglu_kernel, (cdiv(grid_rows, cfg.block_m), n_col),
        xs, out_arg, scale_arg, gs_in, gs_out, partials, eid, mm,
        rows, i, xs.stride(0), out2.stride(0), stride_sm, stride_sg, *scalars, cfg.block_m, grid_rows,
        scale_cols_padded, n_partials, n_gs, n_exp, PASS=pass_, GS_MODE=gs_mode, PARTIALS_BLOCK=partials_block,
        STORE_AMAX=amax_out is not None, **common)
    return results


# ------------------------------------------------------------------------------- backend entry points


def swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype):
    return _swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, fmt=FMT_NONE)


def swiglu_fp8_group(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, group_size,
                     quant_eps, ue8m0, column_major):
    return _swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, fmt=FMT_FP8,
                   group=group_size, quant_eps=quant_eps, ue8m0=ue8m0, column_major=column_major)


def swiglu_mxfp4(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, rounding, swizzle):
    return _swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, fmt=FMT_MX,
                   rounding=rounding, swizzle=swizzle)


def swiglu_nvfp4(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, global_scale,
                 swizzle):
    return _swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, fmt=FMT_NV,
                   swizzle=swizzle, global_scale=global_scale)
