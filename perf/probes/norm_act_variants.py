"""RMSNorm / SwiGLU launcher variants on the GPU: session-1 kernels (kept verbatim below, only here) vs the
current triton_ops/rmsnorm.py + swiglu.py, plus Liger's RMSNorm and silu*mul where liger_kernel is installed.

    python perf/probes/norm_act_variants.py            # ~30 s on an H100/H200: verify, then time
    python perf/probes/norm_act_variants.py --sweep    # also sweep RMSNorm warps x row blocks per program

Verifies bytes on a small shape first (RMSNorm: old == new == reference, all formats; SwiGLU: quantized bytes ==
quantizer(own float y), float y within one bf16 ulp of the reference; both: new == today's kernels with the v1
(session-1) FP4 store epilogue), then prints one line per variant (FP4 cases: old, new kernel + v1 epilogue, new):
median us over CUDA-event timings and GB/s of logical bytes (inputs read once + outputs written).
"""

# ruff: noqa: E501, B023
# (B023: every lambda below is timed inside its own loop iteration)
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import types
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch.checks import rows_view  # noqa: E402
from dispatch.reference import rmsnorm as ref_rms  # noqa: E402
from dispatch.reference import swiglu as ref_sw  # noqa: E402
from dispatch.reference.formats import round_up  # noqa: E402
from triton_ops import rmsnorm as R  # noqa: E402
from triton_ops import swiglu as S  # noqa: E402
from triton_ops._formats import (  # noqa: E402
    abs_bits,
    amax_nan,
    e2m1_encode,
    e4m3_encode,
    fp8_group_scale,
    mxfp4_block_scale,
    nvfp4_block_scale,
    pack_nibbles,
    swizzled_offset_128x4,
)
from triton_ops._launch import TL_DTYPE, emulate_formats  # noqa: E402
from triton_ops.rmsnorm import (  # noqa: E402
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
    _results,
    alloc_epilogue_outputs,
    cast_out,
    epilogue_geometry,
    fold_partials,
)
from triton_ops.swiglu import MOE_CONTIGUOUS, MOE_MASKED, MOE_NONE  # noqa: E402

# ========================================== session-1 FP4/FP8 store epilogue (unchanged up to 9e59277), verbatim
# The session-1 kernels below call these; "cur kernels + v1 epilogue" (epilogue_v1()) swaps them into today's
# kernels through the adapters after them, so the next GPU run separates the epilogue change from the rest.


@triton.jit
def _v1_tile_amax_bits(y, mask, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Per-row max |dtype(y)| as int bits (NaN-propagating), masked lanes excluded: [BLOCK_M] int32."""
    yr = cast_out(y, OUT_DTYPE, EMULATE).to(tl.float32)
    return tl.max(tl.where(mask, abs_bits(yr), 0), 1)


@triton.jit
def _v1_quant_epilogue(
    y, rows, row_in, col0, K, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs,
    scale_rows_bound, scale_cols_bound, scale_cols_padded, fp8_eps,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr,
    SWIZZLE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Round y (fp32 [BLOCK_M, BLOCK_N]) to OUT_DTYPE and store it, plain or quantized.

    rows (int64) / row_in: the tile's rows and which of them exist (< M); col0: the tile's first column of
    a K-wide output row (a multiple of BLOCK_N). gs: fp32 [BLOCK_M] NVFP4 global scale per row.
    Swizzled scales: programs also cover the padding rows up to scale_rows_bound and the padding columns up
    to scale_cols_padded, writing zero bytes there (GEMMs read them).
    """
    cols = col0 + tl.arange(0, BLOCK_N)
    yr = cast_out(y, OUT_DTYPE, EMULATE)
    mask = row_in[:, None] & (cols < K)[None, :]
    if FMT == 0:
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], yr, mask=mask)
    elif FMT == 1:
        NG: tl.constexpr = BLOCK_N // GROUP
        yg = tl.reshape(yr.to(tl.float32), [BLOCK_M, NG, GROUP])
        amax = amax_nan(yg, 2)
        s, inv = fp8_group_scale(amax, fp8_eps, UE8M0)  # the foundation's rule (triton_ops/_formats.py)
        q = yg * inv[:, :, None]
        codes = e4m3_encode(tl.reshape(q, [BLOCK_M, BLOCK_N]), EMULATE)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], codes, mask=mask)
        groups = col0 // GROUP + tl.arange(0, NG)
        smask = row_in[:, None] & (groups < K // GROUP)[None, :]
        tl.store(scale_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, s, mask=smask)
    else:
        SB: tl.constexpr = 32 if FMT == 2 else 16
        NB: tl.constexpr = BLOCK_N // SB
        yb = tl.reshape(yr.to(tl.float32), [BLOCK_M, NB, SB])
        amax = amax_nan(yb, 2)
        if FMT == 2:
            sbyte, inv = mxfp4_block_scale(amax, MX_RCEIL)  # the foundation's rules (triton_ops/_formats.py)
        else:
            sbyte, inv = nvfp4_block_scale(amax, gs[:, None])
        q = yb * inv[:, :, None]
        packed = pack_nibbles(e2m1_encode(tl.reshape(q, [BLOCK_M, BLOCK_N])), BLOCK_M, BLOCK_N)
        pcols = col0 // 2 + tl.arange(0, BLOCK_N // 2)
        pmask = row_in[:, None] & (pcols < K // 2)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + pcols[None, :], packed, mask=pmask)
        scols = col0 // SB + tl.arange(0, NB)
        if SWIZZLE:
            smask = (rows < scale_rows_bound)[:, None] & (scols < scale_cols_padded)[None, :]
            valid = row_in[:, None] & (scols < K // SB)[None, :]
            sofs = swizzled_offset_128x4(rows[:, None], scols[None, :], scale_cols_padded)
            tl.store(scale_ptr + sofs, tl.where(valid, sbyte, 0).to(tl.uint8), mask=smask)
        else:
            smask = row_in[:, None] & (scols < K // SB)[None, :]
            tl.store(scale_ptr + rows[:, None] * stride_sm + scols[None, :], sbyte, mask=smask)


@triton.jit
def _v1_tile_amax_bits_adapter(y, row_ok, col_ok, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Today's tile_amax_bits signature (per-pair column mask) on the v1 body (per-element mask)."""
    cmask = tl.reshape(tl.join(col_ok, col_ok), [BLOCK_N])
    return _v1_tile_amax_bits(y, row_ok[:, None] & cmask[None, :], OUT_DTYPE, EMULATE)


@triton.jit
def _v1_quant_epilogue_adapter(
    y, rows, row_in, col0, K, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs, gs_exact,
    scale_rows_bound, scale_cols_bound, scale_cols_padded, fp8_eps,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr,
    SWIZZLE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Today's quant_epilogue signature (gs_exact: unused, v1 always encodes per element) on the v1 body."""
    _v1_quant_epilogue(y, rows, row_in, col0, K, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs,
                       scale_rows_bound, scale_cols_bound, scale_cols_padded, fp8_eps,
                       FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N)


def _clone_jit(jitfn, **globals_override):
    """A copy of a @triton.jit kernel whose global names (the device functions it calls) are overridden."""
    fn = jitfn.fn
    g = dict(fn.__globals__)
    g.update(globals_override)
    clone = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__module__, clone.__qualname__, clone.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
    return triton.jit(clone)


_V1_KERNELS = {}


@contextlib.contextmanager
def epilogue_v1():
    """Run R._rms_norm / S._swiglu (today's launchers and kernels) with the v1 store epilogue and amax."""
    if not _V1_KERNELS:
        over = dict(quant_epilogue=_v1_quant_epilogue_adapter, tile_amax_bits=_v1_tile_amax_bits_adapter)
        _V1_KERNELS["rms"] = _clone_jit(R._rms_norm_kernel, **over)
        _V1_KERNELS["sw"] = _clone_jit(S._swiglu_kernel, **over)
    saved = R._rms_norm_kernel, S._swiglu_kernel
    R._rms_norm_kernel, S._swiglu_kernel = _V1_KERNELS["rms"], _V1_KERNELS["sw"]
    try:
        yield
    finally:
        R._rms_norm_kernel, S._swiglu_kernel = saved


# ============================================================== session-1 kernels (commit 0bcc153), verbatim


@triton.jit
def _old_rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, scale_ptr, gs_ptr, gs_out_ptr, partial_ptr,
    M, N, stride_xm, stride_rm, stride_hm, stride_om, stride_sm, stride_sg,
    eps, w_offset, fp8_eps, rows_per_prog, scale_rows_bound, scale_cols_bound, scale_cols_padded, n_partials,
    HAS_RES: tl.constexpr, PASS: tl.constexpr, GS_MODE: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr,
    OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + w_offset
    gs = tl.zeros([BLOCK_M], dtype=tl.float32)
    if GS_MODE == 1:
        gs += tl.load(gs_ptr)
    if GS_MODE == 3:
        gs += fold_partials(partial_ptr, n_partials, PARTIALS_BLOCK)
        if pid == 0:
            tl.store(gs_out_ptr, tl.max(gs, 0))
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    row0 = pid.to(tl.int64) * rows_per_prog
    for m0 in range(0, rows_per_prog, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        row_in = rows < M
        mask = row_in[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            h = cast_out(x.to(tl.float32) + r.to(tl.float32), OUT_DTYPE, EMULATE)
            tl.store(h_ptr + rows[:, None] * stride_hm + cols[None, :], h, mask=mask)
            hf = h.to(tl.float32)
        else:
            hf = x.to(tl.float32)
        h64 = hf.to(tl.float64)
        ss = tl.sum(h64 * h64, 1)
        # fp64 '/' and sqrt are IEEE (div.rn.f64 / sqrt.rn.f64) on the GPU; only fp32 ones are approximate.
        rstd = (1.0 / tl.sqrt(ss / (tl.zeros([BLOCK_M], dtype=tl.float64) + N) + eps)).to(tl.float32)
        y = (hf * rstd[:, None]) * w[None, :]
        if PASS == 1:
            acc = tl.maximum(acc, _v1_tile_amax_bits(y, mask, OUT_DTYPE, EMULATE))
        else:
            _v1_quant_epilogue(y, rows, row_in, 0, N, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs,
                           scale_rows_bound, scale_cols_bound, scale_cols_padded, fp8_eps,
                           FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N)
    if PASS == 1:
        tl.store(partial_ptr + pid, tl.max(acc, 0).to(tl.float32, bitcast=True))



def old_rms_norm(x, weight, residual, eps, weight_offset, *, fmt, group=128, quant_eps=1e-10, ue8m0=False,
              column_major=False, rounding="floor", swizzle=False, global_scale=None):
    op = "rms_norm"
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    x2 = rows_view(op, "x", x)
    rows = x2.shape[0]
    dev = x.device
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None \
        else x.new_empty(0)
    gs_out = torch.empty((), dtype=torch.float32, device=dev)
    out, scales = alloc_epilogue_outputs(fmt, lead, n, x.dtype, group, column_major, swizzle, dev)
    results = _results(fmt, out, scales, gs_out, new_res)
    if fmt == FMT_NV and global_scale is not None:
        gs_out.copy_(global_scale.reshape(()))
    if rows == 0 or n == 0:
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
    cfg = R.RowConfig(*dataclasses.astuple(R.pick_row_config(grid_rows, n, dev, R.min_block(fmt, group)))[:3], 1)
    emulate = emulate_formats(dev)
    common = dict(FMT=fmt, GROUP=group, UE8M0=ue8m0, MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle,
                  OUT_DTYPE=TL_DTYPE[x.dtype], EMULATE=emulate, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  num_warps=cfg.num_warps)
    scale_arg = scales.view(torch.uint8) if fmt in (FMT_MX, FMT_NV) else scales
    out_arg = out2.view(torch.uint8) if fmt == FMT_FP8 else out2
    w = weight.contiguous()
    if fmt == FMT_NV and global_scale is None:
        # Pass 1: new residual + partial amax of y; pass 2 reads the rounded h (or x) back and quantizes.
        rows_per_prog = round_up(max(cfg.block_m, triton.cdiv(rows, MAX_PARTIALS)), cfg.block_m)
        n_partials = triton.cdiv(rows, rows_per_prog)
        partials = torch.empty(n_partials, dtype=torch.float32, device=dev)
        _old_rms_norm_kernel[(n_partials,)](
            x2, r2, w, h2, out_arg, scale_arg, gs_out, gs_out, partials,
            rows, n, x2.stride(0), r2.stride(0), h2.stride(0), 0, 0, 0,
            float(eps), float(weight_offset), 0.0, rows_per_prog, grid_rows, 0, scale_cols_padded, n_partials,
            HAS_RES=residual is not None, PASS=PASS_AMAX, GS_MODE=GS_NONE, PARTIALS_BLOCK=1, **common)
        src = h2
        gs_mode, has_res, partials_block = GS_FROM_PARTIALS, False, triton.next_power_of_2(n_partials)
    else:
        src, partials, n_partials, partials_block = x2, gs_out, 1, 1
        gs_mode = GS_GIVEN if fmt == FMT_NV else GS_NONE
        has_res = residual is not None
    _old_rms_norm_kernel[(triton.cdiv(grid_rows, cfg.block_m),)](
        src, r2, w, h2, out_arg, scale_arg, global_scale if global_scale is not None else gs_out, gs_out,
        partials, rows, n, src.stride(0), r2.stride(0), h2.stride(0), out2.stride(0), stride_sm, stride_sg,
        float(eps), float(weight_offset), float(quant_eps), cfg.block_m, grid_rows, 0, scale_cols_padded,
        n_partials, HAS_RES=has_res, PASS=PASS_QUANT if gs_mode == GS_FROM_PARTIALS else PASS_SINGLE,
        GS_MODE=gs_mode, PARTIALS_BLOCK=partials_block, **common)
    return results



@triton.jit
def _old_swiglu_kernel(
    x_ptr, out_ptr, scale_ptr, gs_ptr, gs_out_ptr, partial_ptr, eid_ptr, mm_ptr,
    M, I, stride_xm, stride_om, stride_sm, stride_sg, alpha, limit, fp8_eps, max_m, rows_per_prog,
    scale_rows_bound, scale_cols_padded, n_partials, n_gs,
    INTERLEAVE: tl.constexpr, GPTOSS: tl.constexpr, CLAMP: tl.constexpr, MOE: tl.constexpr,
    PASS: tl.constexpr, GS_MODE: tl.constexpr,
    FMT: tl.constexpr, GROUP: tl.constexpr, UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr,
    OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTIALS_BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    col0 = pid_n * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    cmask = cols < I
    gs_all = 0.0
    if GS_MODE == 1:
        gs_all = tl.load(gs_ptr)
    if GS_MODE == 3:
        gs_all = fold_partials(partial_ptr, n_partials, PARTIALS_BLOCK)
        if (pid_m == 0) & (pid_n == 0):
            tl.store(gs_out_ptr, gs_all)
    acc = tl.zeros([BLOCK_M], dtype=tl.int32)
    row0 = pid_m.to(tl.int64) * rows_per_prog
    for m0 in range(0, rows_per_prog, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        row_in = rows < M
        if MOE == 1:
            grp = tl.load(eid_ptr + rows, mask=row_in, other=-1).to(tl.int32)
            tok = grp >= 0
        elif MOE == 2:
            grp = (rows // max_m).to(tl.int32)
            valid_m = tl.load(mm_ptr + grp, mask=row_in, other=0)
            tok = row_in & ((rows % max_m) < valid_m)
        else:
            grp = tl.zeros([BLOCK_M], dtype=tl.int32)
            tok = row_in
        if INTERLEAVE == 0:
            mask = tok[:, None] & cmask[None, :]
            base = x_ptr + rows[:, None] * stride_xm + cols[None, :]
            g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
        else:
            c2 = 2 * col0 + tl.arange(0, 2 * BLOCK_N)
            mask2 = tok[:, None] & (c2 < 2 * I)[None, :]
            both = tl.load(x_ptr + rows[:, None] * stride_xm + c2[None, :], mask=mask2, other=0.0).to(tl.float32)
            if INTERLEAVE == 1:
                pairs = tl.reshape(both, [BLOCK_M, BLOCK_N, 2])
            else:
                chunks = tl.reshape(both, [BLOCK_M, BLOCK_N // INTERLEAVE, 2, INTERLEAVE])
                pairs = tl.reshape(tl.permute(chunks, (0, 1, 3, 2)), [BLOCK_M, BLOCK_N, 2])
            g, u = tl.split(pairs)
        if CLAMP:
            g = tl.minimum(g, limit, propagate_nan=tl.PropagateNan.ALL)
            u = tl.minimum(tl.maximum(u, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                           propagate_nan=tl.PropagateNan.ALL)
        if GPTOSS:
            y = tl.math.div_rn(g, 1.0 + tl.exp(-(alpha * g))) * (u + 1.0)
        else:
            y = tl.math.div_rn(g, 1.0 + tl.exp(-g)) * u
        if PASS == 1:
            acc = tl.maximum(acc, _v1_tile_amax_bits(y, tok[:, None] & cmask[None, :], OUT_DTYPE, EMULATE))
        else:
            if GS_MODE == 2:  # one global scale per expert / group; 0 on padding rows -> zero scale bytes
                gidx = tl.minimum(tl.maximum(grp, 0), n_gs - 1)
                gs = tl.load(gs_ptr + gidx, mask=tok, other=0.0)
            else:
                gs = tl.zeros([BLOCK_M], dtype=tl.float32) + gs_all
            _v1_quant_epilogue(y, rows, row_in, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs,
                           scale_rows_bound, 0, scale_cols_padded, fp8_eps,
                           FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N)
    if PASS == 1:
        tl.store(partial_ptr + pid_m * tl.num_programs(1) + pid_n, tl.max(acc, 0).to(tl.float32, bitcast=True))



def old_swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, *, fmt, group=128,
            quant_eps=1e-10, ue8m0=False, column_major=False, rounding="floor", swizzle=False, global_scale=None):
    op = "swiglu"
    out_dtype = out_dtype or x.dtype
    lead, i = tuple(x.shape[:-1]), x.shape[-1] // 2
    x2 = rows_view(op, "x", x)
    rows = x2.shape[0]
    dev = x.device
    gs_given_shape = () if global_scale is None or global_scale.numel() == 1 else (global_scale.numel(),)
    gs_out = torch.empty(gs_given_shape, dtype=torch.float32, device=dev)
    out, scales = alloc_epilogue_outputs(fmt, lead, i, out_dtype, group, column_major, swizzle, dev)
    results = out if fmt == FMT_NONE else ((out, scales, gs_out) if fmt == FMT_NV else (out, scales))
    if fmt == FMT_NV and global_scale is not None:
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
    cfg = S.pick_swiglu_config(grid_rows, i, dev, max(R.min_block(fmt, group), interleave))
    moe = MOE_CONTIGUOUS if expert_ids is not None else (MOE_MASKED if masked_m is not None else MOE_NONE)
    eid = expert_ids.reshape(-1) if expert_ids is not None else x2
    mm = masked_m if masked_m is not None else x2
    max_m = x.shape[1] if masked_m is not None else 1
    common = dict(INTERLEAVE=interleave, GPTOSS=activation == "gptoss", CLAMP=limit is not None, MOE=moe,
                  FMT=fmt, GROUP=group, UE8M0=ue8m0, MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle,
                  OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(dev), BLOCK_M=cfg.block_m,
                  BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    scale_arg = scales.view(torch.uint8) if fmt in (FMT_MX, FMT_NV) else scales
    out_arg = out2.view(torch.uint8) if fmt == FMT_FP8 else out2
    scalars = (float(alpha), float(limit if limit is not None else 0.0), float(quant_eps), max_m)
    n_col = triton.cdiv(i, cfg.block_n)
    n_gs = global_scale.numel() if global_scale is not None else 1
    if fmt == FMT_NV and global_scale is None:
        row_progs = max(1, MAX_PARTIALS // n_col)
        rows_per_prog = round_up(max(cfg.block_m, triton.cdiv(rows, row_progs)), cfg.block_m)
        n_row = triton.cdiv(rows, rows_per_prog)
        n_partials = n_row * n_col
        partials = torch.empty(n_partials, dtype=torch.float32, device=dev)
        _old_swiglu_kernel[(n_row, n_col)](
            x2, out_arg, scale_arg, gs_out, gs_out, partials, eid, mm, rows, i, x2.stride(0), 0, 0, 0,
            *scalars, rows_per_prog, grid_rows, scale_cols_padded, n_partials, 1,
            PASS=PASS_AMAX, GS_MODE=GS_NONE, PARTIALS_BLOCK=1, **common)
        gs_mode, pass_, partials_block = GS_FROM_PARTIALS, PASS_QUANT, triton.next_power_of_2(n_partials)
    else:
        partials, n_partials, partials_block, pass_ = gs_out, 1, 1, PASS_SINGLE
        gs_mode = GS_NONE
        if fmt == FMT_NV:
            gs_mode = GS_PER_GROUP if (moe != MOE_NONE or n_gs > 1) else GS_GIVEN
    _old_swiglu_kernel[(triton.cdiv(grid_rows, cfg.block_m), n_col)](
        x2, out_arg, scale_arg, global_scale if global_scale is not None else gs_out, gs_out, partials, eid, mm,
        rows, i, x2.stride(0), out2.stride(0), stride_sm, stride_sg, *scalars, cfg.block_m, grid_rows,
        scale_cols_padded, n_partials, n_gs, PASS=pass_, GS_MODE=gs_mode, PARTIALS_BLOCK=partials_block, **common)
    return results



# ======================================================================================= probe driver

QUANT_NAME = {FMT_NONE: "none", FMT_FP8: "fp8_group", FMT_MX: "mxfp4", FMT_NV: "nvfp4"}


def _bytes_of(*ts) -> int:
    n = 0
    for t in ts:
        if isinstance(t, (tuple, list)):
            n += _bytes_of(*t)
        elif isinstance(t, torch.Tensor):
            n += t.numel() * t.element_size()
    return n


def _u8(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.float32 else t.contiguous().view(torch.int32)


def _same(a, b) -> bool:
    return all(torch.equal(_u8(x), _u8(y)) for x, y in zip(a, b, strict=True) if x is not None and y is not None)


def time_us(fn, iters=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return sorted(ts)[len(ts) // 2]


def report(label, fn, nbytes):
    us = time_us(fn)
    print(f"{label:<72s} {us:8.1f} us {nbytes / us / 1e3:7.0f} GB/s", flush=True)
    return us


def with_v1_epilogue(fn):
    """fn run on today's kernels with the v1 store epilogue (see epilogue_v1)."""
    def run():
        with epilogue_v1():
            return fn()
    return run


def rms_kw(fmt, swizzle=False, gs=None, group=128):
    kw = dict(fmt=fmt)
    if fmt == FMT_FP8:
        kw.update(group=group)
    if fmt in (FMT_MX, FMT_NV):
        kw.update(swizzle=swizzle)
    if fmt == FMT_NV:
        kw.update(global_scale=gs)
    return kw


RMS_CASES = [  # (label, fmt, residual, swizzle, given gs)
    ("rms_norm", FMT_NONE, False, False, False),
    ("rms_norm +residual", FMT_NONE, True, False, False),
    ("rms_norm_fp8_group g128 +residual", FMT_FP8, True, False, False),
    ("rms_norm_mxfp4 swizzled", FMT_MX, False, True, False),
    ("rms_norm_nvfp4 given-gs swizzled", FMT_NV, False, True, True),
    ("rms_norm_nvfp4 computed-gs linear", FMT_NV, False, False, False),
]


def verify_rms(dev):
    torch.manual_seed(0)
    for m, n in ((300, 4096), (257, 2880)):
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16) * 2
        r = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, device=dev, dtype=torch.bfloat16)
        for label, fmt, res, swz, given in RMS_CASES:
            gs = torch.tensor(0.01, device=dev) if given else None
            rr = r if res else None
            group = 128 if n % 128 == 0 else 64  # 2880 = 22.5 x 128
            kw = rms_kw(fmt, swz, gs, group)
            new = R._rms_norm(x, w, rr, 1e-6, 0.0, **kw)
            old = old_rms_norm(x, w, rr, 1e-6, 0.0, **kw)
            qkw = {}
            if fmt == FMT_FP8:
                qkw = dict(group_size=group)
            elif fmt in (FMT_MX, FMT_NV):
                qkw = dict(swizzle=swz)
            if fmt == FMT_NV:
                qkw["global_scale"] = gs.cpu() if gs is not None else None
            want = ref_rms.rms_norm_quant(x.cpu(), w.cpu(), 1e-6, rr.cpu() if res else None, 0.0, QUANT_NAME[fmt],
                                          **qkw)
            ok_old = _same(new, old)
            ok_ref = _same([t.cpu() for t in new], want)
            ok_v1 = _same(new, with_v1_epilogue(lambda: R._rms_norm(x, w, rr, 1e-6, 0.0, **kw))())
            print(f"verify {label:<40s} {m}x{n}: new==old {ok_old}  new==reference {ok_ref}  new==v1-epilogue {ok_v1}")
            assert ok_old and ok_ref and ok_v1, label


def probe_rms(dev, sweep):
    liger = None
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        def liger(x, w, eps):
            return LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    except Exception as e:  # noqa: BLE001
        print(f"(no Liger: {type(e).__name__}: {e})")
    for m, n in ((32768, 4096), (16384, 4096)):
        torch.manual_seed(1)
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        r = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, device=dev, dtype=torch.bfloat16)
        gsv = torch.tensor(0.003, device=dev)
        for label, fmt, res, swz, given in RMS_CASES:
            rr = r if res else None
            kw = rms_kw(fmt, swz, gsv if given else None)
            out = R._rms_norm(x, w, rr, 1e-6, 0.0, **kw)
            nb = _bytes_of(x, rr) + _bytes_of(out)
            cfg = R.pick_row_config(m, n, x.device, R.min_block(fmt, 128))
            report(f"{label} {m}x{n} old", lambda: old_rms_norm(x, w, rr, 1e-6, 0.0, **kw), nb)
            if fmt in (FMT_MX, FMT_NV):
                report(f"{label} {m}x{n} new kernel + v1 epilogue", with_v1_epilogue(lambda: R._rms_norm(x, w, rr, 1e-6, 0.0, **kw)), nb)
            report(f"{label} {m}x{n} new {cfg.num_warps}w x{cfg.row_blocks}", lambda: R._rms_norm(x, w, rr, 1e-6, 0.0, **kw), nb)
            if fmt == FMT_NONE and not res:
                if liger is not None:
                    report(f"{label} {m}x{n} liger", lambda: liger(x, w, 1e-6), nb)
                if sweep:
                    for nw in (4, 8, 16):
                        for rb in (1, 2, 4, 8):
                            c = R.RowConfig(1, 4096, nw, rb)
                            report(f"{label} {m}x{n} new sweep {nw}w x{rb}",
                                   lambda c=c: R._rms_norm(x, w, None, 1e-6, 0.0, fmt=FMT_NONE, cfg=c), nb)


SW_CASES = [  # (label, fmt, interleave, activation, alpha, limit, swizzle, moe)
    ("swiglu silu*mul", FMT_NONE, 0, "silu", 1.0, None, False, False),
    ("swiglu gptoss g1 limit7", FMT_NONE, 1, "gptoss", 1.702, 7.0, False, False),
    ("swiglu_fp8_group gptoss g1 g128", FMT_FP8, 1, "gptoss", 1.702, 7.0, False, False),
    ("swiglu_mxfp4 gptoss g1 swizzled", FMT_MX, 1, "gptoss", 1.702, 7.0, True, False),
    ("swiglu_nvfp4 gptoss g1 computed-gs swizzled", FMT_NV, 1, "gptoss", 1.702, 7.0, True, False),
    ("swiglu_nvfp4 MoE contiguous g8 clamp per-expert gs", FMT_NV, 8, "silu", 1.0, 7.0, True, True),
]


def _sw_args(x, case, dev, n_exp=8):
    label, fmt, il, act, alpha, limit, swz, moe = case
    m = x.shape[0]
    eids = gs = None
    if moe:
        eids = torch.sort(torch.randint(-1, n_exp, (m,), device=dev, dtype=torch.int32)).values
        gs = torch.rand(n_exp, device=dev) * 0.004 + 1e-4
    kw = dict(fmt=fmt)
    if fmt == FMT_FP8:
        kw.update(group=128)
    if fmt in (FMT_MX, FMT_NV):
        kw.update(swizzle=swz)
    if fmt == FMT_NV:
        kw.update(global_scale=gs)
    return (x, il, act, alpha, limit, eids, None, None), kw


def verify_sw(dev):
    torch.manual_seed(0)
    x = torch.randn(300, 2 * 1024, device=dev, dtype=torch.bfloat16) * 3
    for case in SW_CASES:
        args, kw = _sw_args(x, case, dev)
        fmt = kw["fmt"]
        y = S._swiglu(*args, fmt=FMT_NONE)
        y_old = old_swiglu(*args, fmt=FMT_NONE)
        cargs = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        y_ref = ref_sw.swiglu(*cargs[:7], None)
        a, b = y.float().cpu(), y_ref.float()
        tol_ok = bool(((a - b).abs() <= 2.0**-7 * b.abs() + 1e-30).all())
        eq = (a == b).float().mean().item()
        eq_old = (y.cpu() == y_old.cpu()).float().mean().item()
        line = f"verify {case[0]:<50s}: y within 1 ulp of ref {tol_ok} (equal {eq:.5f}; equal to old {eq_old:.5f})"
        if fmt != FMT_NONE:
            got = S._swiglu(*args, **kw)
            qkw = dict(group_size=kw.get("group", 128), swizzle=kw.get("swizzle", False),
                       global_scale=kw.get("global_scale").cpu() if kw.get("global_scale") is not None else None)
            want = ref_sw.quantize_swiglu_output(y.cpu(), cargs[5], None, QUANT_NAME[fmt], **qkw)
            qok = _same([t.cpu() for t in got], want)
            v1ok = _same(got, with_v1_epilogue(lambda: S._swiglu(*args, **kw))())
            line += f"  quantized == quantizer(own y) {qok}  == v1 epilogue {v1ok}"
            assert qok and v1ok, case[0]
        print(line)
        assert tol_ok and eq > 0.99, case[0]


def probe_sw(dev):
    liger = None
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        liger = LigerSiLUMulFunction.apply
    except Exception as e:  # noqa: BLE001
        print(f"(no Liger: {type(e).__name__}: {e})")
    for m, i in ((16384, 4096),):
        torch.manual_seed(2)
        x = torch.randn(m, 2 * i, device=dev, dtype=torch.bfloat16) * 3
        for case in SW_CASES:
            args, kw = _sw_args(x, case, dev)
            out = S._swiglu(*args, **kw)
            nb = _bytes_of(x) + _bytes_of(out)
            report(f"{case[0]} {m}x{i} old", lambda: old_swiglu(*args, **kw), nb)
            if kw["fmt"] in (FMT_MX, FMT_NV):
                report(f"{case[0]} {m}x{i} new kernel + v1 epilogue", with_v1_epilogue(lambda: S._swiglu(*args, **kw)), nb)
            report(f"{case[0]} {m}x{i} new", lambda: S._swiglu(*args, **kw), nb)
            if case[0] == "swiglu silu*mul" and liger is not None:
                gate, up = x[:, :i].contiguous(), x[:, i:].contiguous()
                report(f"{case[0]} {m}x{i} liger", lambda: liger(gate, up), nb)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", choices=["rms", "swiglu"], default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    if args.only != "swiglu":
        verify_rms(dev)
    if args.only != "rms":
        verify_sw(dev)
    if args.only != "swiglu":
        probe_rms(dev, args.sweep)
    if args.only != "rms":
        probe_sw(dev)


if __name__ == "__main__":
    main()
