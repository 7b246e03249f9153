"""Quantize launcher variants on the GPU: session-1 FP4 kernels (kept verbatim below, only here) vs the current
triton_ops/quant_fp4.py, the current FP8 kernel, and tile variants of both, at bf16 [8192, 8192] and at decode
(M=16, K=7168) under CUDA-graph replay.

    python perf/probes/quant_variants.py            # ~30 s on an H200 (mostly Triton compiles): verify, then time
    python perf/probes/quant_variants.py --quick    # fewer repetitions
    python perf/probes/quant_variants.py --sweep    # also sweep tiles of the current kernels (~30 s more)
    python perf/probes/quant_variants.py --full-verify  # also fp16/fp32 inputs/outputs, both layouts (~40 s more)

Verifies bytes first (small shapes incl. NaN/Inf/-0, special global scales gs = 0, tiny, Inf, NaN, negative,
bf16 inputs (--full-verify: fp16/fp32 too): new == reference, old == reference; then the 8192^2 outputs), then prints one
line per variant: median us of CUDA-graph replays (10 calls per graph, so no host time), GB/s of logical bytes
(x read once + codes + scales written) and the fraction of the suite's copy roof (perf.runner.measure_roofline:
eager dst.copy_(src) of 2 x 1 GiB bf16) measured here.
"""

# ruff: noqa: E501, B023
# (B023: every lambda below is timed inside its own loop iteration)
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch import ops  # noqa: E402
from dispatch.checks import rows_view  # noqa: E402
from dispatch.reference import quant as ref  # noqa: E402
from dispatch.reference.formats import round_up  # noqa: E402
from dispatch.reference.quant import fp4_scales_shape  # noqa: E402
from dispatch.selfcheck import byte_mismatches  # noqa: E402
from triton_ops import quant_fp4 as Q4  # noqa: E402
from triton_ops import quant_fp8 as Q8  # noqa: E402
from triton_ops._formats import (  # noqa: E402
    abs_bits,
    amax_nan,
    cast_out,
    e2m1_decode,
    e2m1_encode,
    e4m3_decode,
    mxfp4_block_scale,
    nvfp4_block_scale,
    split_pairs,
    swizzled_offset_128x4,
    unpack_nibbles,
)
from triton_ops._launch import TL_DTYPE, emulate_formats, pick_tile  # noqa: E402

# ============================================================== session-1 kernels (commit 0bcc153), verbatim
# (nvfp4_block_scale's EMULATE defaults to True = the session-1 integer E4M3 emulation)


@triton.jit
def _old_amax_partials_kernel(x_ptr, partials_ptr, M, K, stride_xm, rows_per_prog, cols_per_prog,
                              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    row0 = pid_m.to(tl.int64) * rows_per_prog
    col0 = pid_k * cols_per_prog
    for m0 in range(0, rows_per_prog, BLOCK_M):
        rows = row0 + m0 + tl.arange(0, BLOCK_M)
        rmask = (rows < M) & (m0 + tl.arange(0, BLOCK_M) < rows_per_prog)
        for k0 in range(0, cols_per_prog, BLOCK_K):
            cols = col0 + k0 + tl.arange(0, BLOCK_K)
            mask = rmask[:, None] & ((cols < K) & (k0 + tl.arange(0, BLOCK_K) < cols_per_prog))[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
            acc = tl.maximum(acc, abs_bits(x.to(tl.float32)))
    amax = tl.max(tl.reshape(acc, [BLOCK_M * BLOCK_K]), 0).to(tl.float32, bitcast=True)
    tl.store(partials_ptr + pid_m * tl.num_programs(1) + pid_k, amax)


@triton.jit
def _old_fp4_quantize_kernel(
    words_ptr, codes_ptr, scales_ptr, gs_in_ptr, gs_out_ptr,
    M, K, stride_wm, grid_rows, scale_cols_bound, scale_cols_padded, n_partials,
    IS_MX: tl.constexpr, MX_RCEIL: tl.constexpr, GS_MODE: tl.constexpr, SWIZZLE: tl.constexpr,
    IN_KIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PARTIALS_BLOCK: tl.constexpr,
):
    SB: tl.constexpr = 32 if IS_MX else 16
    NB: tl.constexpr = BLOCK_K // SB
    HP: tl.constexpr = SB // 2
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    r3 = rows[:, None, None]
    pcol = (pid_k * (BLOCK_K // 2) + tl.arange(0, NB)[None, :, None] * HP + tl.arange(0, HP)[None, None, :])
    mask = (r3 < M) & (pcol < K // 2)
    w = tl.load(words_ptr + r3 * stride_wm + pcol, mask=mask, other=0)
    lo, hi = split_pairs(w, IN_KIND)
    amax = tl.max(tl.maximum(abs_bits(lo), abs_bits(hi)), 2).to(tl.float32, bitcast=True)
    if IS_MX:
        sbyte, inv = mxfp4_block_scale(amax, MX_RCEIL)
    else:
        if GS_MODE == 1:
            gs = tl.load(gs_in_ptr)
        else:
            pofs = tl.arange(0, PARTIALS_BLOCK)
            partials = tl.load(gs_in_ptr + pofs, mask=pofs < n_partials, other=0.0)
            gs = tl.math.div_rn(amax_nan(partials, 0), 2688.0)
        if (pid_m == 0) & (pid_k == 0):
            tl.store(gs_out_ptr, gs)
        sbyte, inv = nvfp4_block_scale(amax, gs)
    inv3 = inv[:, :, None]
    q_lo = lo * inv3
    q_hi = hi * inv3
    packed = e2m1_encode(q_lo) | (e2m1_encode(q_hi) << 4)
    tl.store(codes_ptr + r3 * (K // 2) + pcol, packed, mask=mask)
    scols = pid_k * NB + tl.arange(0, NB)
    smask = (rows < grid_rows)[:, None] & (scols < scale_cols_bound)[None, :]
    if SWIZZLE:
        sofs = swizzled_offset_128x4(rows[:, None], scols[None, :], scale_cols_padded)
        valid = (rows < M)[:, None] & (scols < K // SB)[None, :]
        sbyte = tl.where(valid, sbyte, 0).to(tl.uint8)
    else:
        sofs = rows[:, None] * (K // SB) + scols[None, :]
    tl.store(scales_ptr + sofs, sbyte, mask=smask)


def old_quantize(x, *, is_mx, swizzle, rceil=False, global_scale=None):
    """Session-1 launcher (256 amax partials of 2x1024 steps), minus the empty-input branch."""
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    block = 32 if is_mx else 16
    x2 = rows_view("probe", "x", x)
    rows = x2.shape[0]
    codes = torch.empty(*lead, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(fp4_scales_shape(lead, k, block, swizzle), device=x.device,
                         dtype=torch.uint8 if is_mx else torch.float8_e4m3fn)
    gs_out = torch.empty((), dtype=torch.float32, device=x.device)
    grid_rows = scales.shape[0] if swizzle else rows
    cfg = pick_tile(grid_rows, k, x.device, min_block_k=4 * block)
    scp = round_up(k // block, 4)
    gs_mode, gs_in, n_partials, partials_block = 0, gs_out, 1, 1
    if not is_mx and global_scale is not None:
        gs_mode, gs_in = 1, global_scale
    elif not is_mx:
        gs_mode = 2
        amax_k = min(cfg.block_k, 1024)
        rows_per_prog = max(cfg.block_m, triton.cdiv(rows, 256))
        n_m = triton.cdiv(rows, rows_per_prog)
        n_k = min(triton.cdiv(k, amax_k), max(1, 256 // n_m))
        cols_per_prog = amax_k * triton.cdiv(triton.cdiv(k, amax_k), n_k)
        n_k = triton.cdiv(k, cols_per_prog)
        n_partials = n_m * n_k
        partials_block = triton.next_power_of_2(n_partials)
        gs_in = torch.empty(n_partials, dtype=torch.float32, device=x.device)
        _old_amax_partials_kernel[(n_m, n_k)](
            x2, gs_in, rows, k, x2.stride(0), rows_per_prog, cols_per_prog,
            BLOCK_M=max(1, min(cfg.block_m, 8192 // amax_k)), BLOCK_K=amax_k, num_warps=cfg.num_warps)
    words = x2.view(torch.int64 if x.dtype == torch.float32 else torch.int32)
    grid = (triton.cdiv(grid_rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    _old_fp4_quantize_kernel[grid](
        words, codes, scales.view(torch.uint8), gs_in, gs_out,
        rows, k, words.stride(0), grid_rows, scp if swizzle else k // block, scp, n_partials,
        IS_MX=is_mx, MX_RCEIL=rceil, GS_MODE=gs_mode, SWIZZLE=swizzle, IN_KIND=Q4.IN_KIND[x.dtype],
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, PARTIALS_BLOCK=partials_block, num_warps=cfg.num_warps)
    return (codes, scales, gs_out) if not is_mx else (codes, scales)


@triton.jit
def _old_fp4_dequantize_kernel(
    codes_ptr, scales_ptr, gs_ptr, out_ptr, M, K, scale_cols_padded,
    IS_MX: tl.constexpr, SWIZZLE: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    SB: tl.constexpr = 32 if IS_MX else 16
    NB: tl.constexpr = BLOCK_K // SB
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    pcols = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    pmask = (rows < M)[:, None] & (pcols < K // 2)[None, :]
    packed = tl.load(codes_ptr + rows[:, None] * (K // 2) + pcols[None, :], mask=pmask, other=0)
    vals = e2m1_decode(unpack_nibbles(packed, BLOCK_M, BLOCK_K))
    scols = pid_k * NB + tl.arange(0, NB)
    smask = (rows < M)[:, None] & (scols < K // SB)[None, :]
    if SWIZZLE:
        sofs = swizzled_offset_128x4(rows[:, None], scols[None, :], scale_cols_padded)
    else:
        sofs = rows[:, None] * (K // SB) + scols[None, :]
    sbyte = tl.load(scales_ptr + sofs, mask=smask, other=0)
    if IS_MX:
        b = sbyte.to(tl.uint32)
        s = (tl.maximum(b, 1) << 23).to(tl.float32, bitcast=True)
        s = tl.where(b == 0, 5.877471754111438e-39, s)
        s = tl.where(b == 255, float("nan"), s)
    else:
        s = e4m3_decode(sbyte)
    out = tl.reshape(vals, [BLOCK_M, NB, SB]) * s[:, :, None]
    if not IS_MX:
        out = out * tl.load(gs_ptr)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    omask = (rows < M)[:, None] & (cols < K)[None, :]
    y = cast_out(tl.reshape(out, [BLOCK_M, BLOCK_K]), OUT_DTYPE, EMULATE)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], y, mask=omask)


@triton.jit
def _old_fp8_group_dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, M, K, stride_sm, stride_sg,
    GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    vals = e4m3_decode(tl.load(codes_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0))
    groups = pid_k * NG + tl.arange(0, NG)
    smask = (rows < M)[:, None] & (groups < K // GROUP)[None, :]
    s = tl.load(scales_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, mask=smask, other=0.0)
    out = tl.reshape(tl.reshape(vals, [BLOCK_M, NG, GROUP]) * s[:, :, None], [BLOCK_M, BLOCK_K])
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], cast_out(out, OUT_DTYPE, EMULATE), mask=mask)


def old_fp4_dequantize(codes, scales, gs, *, is_mx, swizzle, out_dtype=torch.bfloat16):
    k = codes.shape[-1] * 2
    rows = codes.numel() * 2 // k
    out = torch.empty(rows, k, dtype=out_dtype, device=codes.device)
    block = 32 if is_mx else 16
    cfg = pick_tile(rows, k, codes.device, min_block_k=4 * block)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    _old_fp4_dequantize_kernel[grid](
        codes, scales.view(torch.uint8), gs if gs is not None else codes, out, rows, k, round_up(k // block, 4),
        IS_MX=is_mx, SWIZZLE=swizzle, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(codes.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return out


def old_fp8_dequantize(codes, scales, out_dtype=torch.bfloat16):
    rows, k = codes.shape
    out = torch.empty(rows, k, dtype=out_dtype, device=codes.device)
    cfg = pick_tile(rows, k, codes.device, min_block_k=128)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    _old_fp8_group_dequantize_kernel[grid](
        codes.view(torch.uint8), scales, out, rows, k, scales.stride(0), scales.stride(1),
        GROUP=128, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(codes.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return out


# ============================================================== current kernels with a chosen tile (sweep only)


def new_fp4_tile(x, bm, bk, nw, *, is_mx, swizzle, global_scale=None):
    """Current _fp4_quantize_kernel (given gs or MX) with tile (bm, bk, warps) instead of pick_tile's."""
    k = x.shape[-1]
    block = 32 if is_mx else 16
    x2 = x.view(-1, k)
    rows = x2.shape[0]
    codes = torch.empty(rows, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(fp4_scales_shape((rows,), k, block, swizzle), device=x.device, dtype=torch.uint8)
    gs_out = torch.empty((), dtype=torch.float32, device=x.device)
    grid_rows = scales.shape[0] if swizzle else rows
    scp = round_up(k // block, 4)
    words = x2.view(torch.int32)
    grid = (triton.cdiv(grid_rows, bm), triton.cdiv(k, bk))
    Q4._fp4_quantize_kernel[grid](
        words, codes, scales, global_scale if global_scale is not None else gs_out, gs_out,
        rows, k, words.stride(0), grid_rows, scp if swizzle else k // block, scp, 1,
        IS_MX=is_mx, MX_RCEIL=False, GS_MODE=0 if is_mx else 1, SWIZZLE=swizzle, IN_KIND=0,
        EMULATE=emulate_formats(x.device), BLOCK_M=bm, BLOCK_K=bk, PARTIALS_BLOCK=1, num_warps=nw)
    return codes, scales


def fp8_tile(x, bm, bk, nw):
    k = x.shape[-1]
    x2 = x.view(-1, k)
    rows = x2.shape[0]
    codes = torch.empty(rows, k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, k // 128, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(rows, bm), triton.cdiv(k, bk))
    Q8._fp8_group_quantize_kernel[grid](
        x2, codes, scales, rows, k, x2.stride(0), k // 128, 1, 1e-10,
        GROUP=128, UE8M0=False, EMULATE=emulate_formats(x.device), BLOCK_M=bm, BLOCK_K=bk, num_warps=nw)
    return codes, scales


def amax_pass(x, old: bool):
    """The computed-gs amax pass alone (partials only)."""
    k = x.shape[-1]
    x2 = x.view(-1, k)
    rows = x2.shape[0]
    if old:
        cfg = pick_tile(rows, k, x.device, min_block_k=64)
        amax_k = min(cfg.block_k, 1024)
        rpp = max(cfg.block_m, triton.cdiv(rows, 256))
        n_m = triton.cdiv(rows, rpp)
        n_k = min(triton.cdiv(k, amax_k), max(1, 256 // n_m))
        cpp = amax_k * triton.cdiv(triton.cdiv(k, amax_k), n_k)
        n_k = triton.cdiv(k, cpp)
        out = torch.empty(n_m * n_k, dtype=torch.float32, device=x.device)
        _old_amax_partials_kernel[(n_m, n_k)](x2, out, rows, k, x2.stride(0), rpp, cpp,
                                              BLOCK_M=max(1, min(cfg.block_m, 8192 // amax_k)), BLOCK_K=amax_k, num_warps=4)
        return out
    p = Q4.amax_plan(rows, k, x.device)
    out = torch.empty(p.n_m * p.n_k, dtype=torch.float32, device=x.device)
    Q4._amax_partials_kernel[(p.n_m, p.n_k)](x2, out, rows, k, x2.stride(0), p.rows_per_prog, p.cols_per_prog,
                                             BLOCK_M=p.block_m, BLOCK_K=p.block_k, num_warps=p.num_warps)
    return out


# ============================================================== verification


def _same(name, got, want):
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape:
            raise AssertionError(f"{name}[{i}]: shape {tuple(g.shape)} != {tuple(w.shape)}")
        if bad := byte_mismatches(g, w):
            raise AssertionError(f"{name}[{i}]: {bad} bytes differ from the reference")


def verify(dev, full=False):
    """Small shapes with NaN/Inf/-0/subnormals and special global scales (runtime values: no extra compiles).
    Default: bf16 inputs and the configurations timed below (each new constexpr combination is a ~1 s compile);
    full=True adds fp16/fp32 inputs, both layouts and fp16/fp32 outputs (the GPU pytest run covers those too)."""
    g = torch.Generator().manual_seed(0)
    # [64, 2048]: the same tiles (and so the same compiled kernels) as the 8192^2 timing below
    base = torch.randn(64, 2048, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
    base[0, 5] = float("inf")
    base[1, 7] = float("-inf")
    base[2, 9] = float("nan")
    base[3, :16] = 0
    base[3, 3] = -0.0
    base[4, 20] = -0.0
    base[5, 40:48] = 1e-40
    n = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        x = base.to(dt)
        xd = x.to(dev)
        old_too = dt == torch.bfloat16
        for gsv in (0.0, -0.0, 1e-36, 1e-30, 2.0 ** -100, 1e-3, -0.5, float("inf"), float("nan"), 3e38, 1e-45):
            gs = torch.tensor(gsv)
            for sw in (False, True):
                lay = "swizzled" if sw else "linear"
                want = ops.nvfp4_quantize(x, gs, scale_layout=lay, backend="torch")
                _same(f"new nvfp4 {dt} gs={gsv} {lay}", Q4.nvfp4_quantize(xd, gs.to(dev), sw), want)
                n += 1
                if old_too and sw:
                    _same(f"old nvfp4 {dt} gs={gsv} {lay}", old_quantize(xd, is_mx=False, swizzle=sw, global_scale=gs.to(dev)), want)
                    n += 1
        want = ops.nvfp4_quantize(x, backend="torch")
        _same(f"new nvfp4 computed {dt}", Q4.nvfp4_quantize(xd, None, False), want)
        if old_too:
            _same(f"old nvfp4 computed {dt}", old_quantize(xd, is_mx=False, swizzle=False), want)
        for r in ("floor", "rceil"):
            want = ops.mxfp4_quantize(x, rounding=r, backend="torch")
            _same(f"new mxfp4 {dt} {r}", Q4.mxfp4_quantize(xd, r, False), want)
            if old_too and r == "floor":
                _same(f"old mxfp4 {dt} {r}", old_quantize(xd, is_mx=True, swizzle=False, rceil=r == "rceil"), want)
        want = ops.fp8_group_quantize(x, 128, backend="torch")
        _same(f"fp8 {dt}", Q8.fp8_group_quantize(xd, 128, 1e-10, False, False), want)
        n += 7
        for od in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
            for sw in (False, True) if full else (None,):
                nsw = True if sw is None else sw  # timed: nvfp4 swizzled, mxfp4 linear
                msw = False if sw is None else sw
                q = ops.nvfp4_quantize(x, torch.tensor(0.003), scale_layout="swizzled" if nsw else "linear", backend="torch")
                qd = [t.to(dev) for t in q]
                want = ref.nvfp4_dequantize(*q, nsw, od)
                _same(f"new nvfp4 deq {dt}->{od} sw={nsw}", (Q4.nvfp4_dequantize(*qd, nsw, od),), (want,))
                q = ops.mxfp4_quantize(x, scale_layout="swizzled" if msw else "linear", backend="torch")
                qd = [t.to(dev) for t in q]
                want = ref.mxfp4_dequantize(*q, msw, od)
                _same(f"new mxfp4 deq {dt}->{od} sw={msw}", (Q4.mxfp4_dequantize(*qd, msw, od),), (want,))
                n += 2
            q = ops.fp8_group_quantize(x, 128, backend="torch")
            qd = [t.to(dev) for t in q]
            want = ref.fp8_group_dequantize(*q, 128, od)
            _same(f"new fp8 deq {dt}->{od}", (Q8.fp8_group_dequantize(*qd, 128, od),), (want,))
            n += 1
    print(f"verify: {n} small-shape comparisons equal the reference ({'full' if full else 'bf16, timed configs'}; "
          "NaN/Inf/-0/subnormals, special gs); old dequant kernels are checked at the timed shapes")


# ============================================================== timing


def graph_us(fn, reps, inner=10):
    """Median us per call of `fn` captured `inner` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(inner):
            fn()
    gr.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return statistics.median(times)


def copy_gbps(dev):
    """The suite's own copy roof (perf/runner.py measure_roofline: eager CUDA-event passes of dst.copy_(src), 2 x
    1 GiB bf16, bytes read + written), so "of copy" here means what roofline_frac means in the results.

    This probe used to capture b.copy_(a) in a CUDA graph: a same-dtype contiguous copy_ is a cudaMemcpyAsync,
    captured as a memcpy node, and graph memcpy nodes run a different (slower) copy path than the eager one
    (pytorch/pytorch#191284). On the H200 that read 2694 GB/s against the runner's 4225 GB/s in the same call, and
    every fraction printed was 1.57x too high. The kernels timed below are Triton launches, not memcpy nodes, so
    graph replay does not slow them."""
    from perf.runner import measure_roofline
    return measure_roofline(dev).copy_gbps


SHAPES = ((8192, 8192), (16, 7168))  # (M, K): the headline shape, then decode
DEVICE = "cuda"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also sweep tiles of the current kernels (~30 s more)")
    ap.add_argument("--full-verify", action="store_true", help="fp16/fp32 inputs and outputs, both layouts (~40 s more)")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    dev = torch.device(DEVICE)
    if dev.type == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    verify(dev, args.full_verify)
    roof = copy_gbps(dev)
    print(f"copy 2 x 1 GiB bf16 (perf.runner.measure_roofline, eager events): {roof:.0f} GB/s (bytes read + written)")

    def line(name, us, nbytes):
        gbps = nbytes / us / 1e3
        print(f"  {name:58s} {us:8.1f} us {gbps:7.0f} GB/s {gbps / roof:5.2f} of copy")

    for m, k in SHAPES:
        torch.manual_seed(0)
        x = (torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev))).to(torch.bfloat16)
        gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
        xb = m * k * 2
        nv_b, mx_b, f8_b = xb + m * k // 2 + m * k // 16, xb + m * k // 2 + m * k // 32, xb + m * k + m * k // 32
        if m == SHAPES[0][0]:  # the big outputs too
            _same("new nvfp4 8192^2", Q4.nvfp4_quantize(x, gs, True), ref.nvfp4_quantize(x, gs, True))
            _same("new nvfp4 computed 8192^2", Q4.nvfp4_quantize(x, None, False), ref.nvfp4_quantize(x, None, False))
            _same("new mxfp4 8192^2", Q4.mxfp4_quantize(x, "floor", False), ref.mxfp4_quantize(x, "floor", False))
            _same("fp8 8192^2", Q8.fp8_group_quantize(x, 128, 1e-10, False, False), ref.fp8_group_quantize(x, 128, 1e-10, False, False))
        print(f"M={m} K={k} bf16 (CUDA-graph replay, 10 calls per graph)")
        line("nvfp4 given-gs swizzled: session-1", graph_us(lambda: old_quantize(x, is_mx=False, swizzle=True, global_scale=gs), reps), nv_b)
        line("nvfp4 given-gs swizzled: current launcher", graph_us(lambda: Q4.nvfp4_quantize(x, gs, True), reps), nv_b)
        line("nvfp4 computed-gs linear: session-1 (amax + quant)", graph_us(lambda: old_quantize(x, is_mx=False, swizzle=False), reps), nv_b)
        line("nvfp4 computed-gs linear: current (amax + quant)", graph_us(lambda: Q4.nvfp4_quantize(x, None, False), reps), nv_b)
        line("  amax pass alone, session-1 (GB/s of x read)", graph_us(lambda: amax_pass(x, True), reps), xb)
        line("  amax pass alone, current (GB/s of x read)", graph_us(lambda: amax_pass(x, False), reps), xb)
        line("mxfp4 floor linear: session-1", graph_us(lambda: old_quantize(x, is_mx=True, swizzle=False), reps), mx_b)
        line("mxfp4 floor linear: current launcher", graph_us(lambda: Q4.mxfp4_quantize(x, "floor", False), reps), mx_b)
        line("fp8 g128: current launcher", graph_us(lambda: Q8.fp8_group_quantize(x, 128, 1e-10, False, False), reps), f8_b)
        nq = Q4.nvfp4_quantize(x, gs, True)
        mq = Q4.mxfp4_quantize(x, "floor", False)
        fq = Q8.fp8_group_quantize(x, 128, 1e-10, False, False)
        _same("old nvfp4 deq", (old_fp4_dequantize(*nq, is_mx=False, swizzle=True),), (ref.nvfp4_dequantize(*nq, True, torch.bfloat16),))
        _same("old mxfp4 deq", (old_fp4_dequantize(*mq, None, is_mx=True, swizzle=False),), (ref.mxfp4_dequantize(*mq, False, torch.bfloat16),))
        _same("old fp8 deq", (old_fp8_dequantize(*fq),), (ref.fp8_group_dequantize(*fq, 128, torch.bfloat16),))
        if m == SHAPES[0][0]:
            _same("new nvfp4 deq 8192^2", (Q4.nvfp4_dequantize(*nq, True, torch.bfloat16),), (ref.nvfp4_dequantize(*nq, True, torch.bfloat16),))
            _same("new mxfp4 deq 8192^2", (Q4.mxfp4_dequantize(*mq, False, torch.bfloat16),), (ref.mxfp4_dequantize(*mq, False, torch.bfloat16),))
            _same("new fp8 deq 8192^2", (Q8.fp8_group_dequantize(*fq, 128, torch.bfloat16),), (ref.fp8_group_dequantize(*fq, 128, torch.bfloat16),))
        line("nvfp4 dequant swizzled -> bf16: session-1", graph_us(lambda: old_fp4_dequantize(*nq, is_mx=False, swizzle=True), reps), nv_b)
        line("nvfp4 dequant swizzled -> bf16: current launcher", graph_us(lambda: Q4.nvfp4_dequantize(*nq, True, torch.bfloat16), reps), nv_b)
        line("mxfp4 dequant linear -> bf16: session-1", graph_us(lambda: old_fp4_dequantize(*mq, None, is_mx=True, swizzle=False), reps), mx_b)
        line("mxfp4 dequant linear -> bf16: current launcher", graph_us(lambda: Q4.mxfp4_dequantize(*mq, False, torch.bfloat16), reps), mx_b)
        line("fp8 dequant g128 -> bf16: session-1", graph_us(lambda: old_fp8_dequantize(*fq), reps), f8_b)
        line("fp8 dequant g128 -> bf16: current launcher", graph_us(lambda: Q8.fp8_group_dequantize(*fq, 128, torch.bfloat16), reps), f8_b)
        if not args.sweep or m != SHAPES[0][0]:
            continue
        print("  tile sweep (BLOCK_M x BLOCK_K, warps), current kernels:")
        for bm, bk, nw in ((2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (4, 2048, 8), (8, 1024, 8), (8, 2048, 8), (1, 2048, 4)):
            line(f"    nvfp4 given-gs swizzled {bm}x{bk} w{nw}", graph_us(lambda: new_fp4_tile(x, bm, bk, nw, is_mx=False, swizzle=True, global_scale=gs), reps), nv_b)
            line(f"    mxfp4 floor linear      {bm}x{bk} w{nw}", graph_us(lambda: new_fp4_tile(x, bm, bk, nw, is_mx=True, swizzle=False), reps), mx_b)
            line(f"    fp8 g128                {bm}x{bk} w{nw}", graph_us(lambda: fp8_tile(x, bm, bk, nw), reps), f8_b)


if __name__ == "__main__":
    main()
