"""Quantize launchers on the GPU under CUDA-graph replay (kernel time, no host path): the FP4 and FP8 quantizers,
the amax pass alone, the dequantizers, and (--sweep) tile variants, at bf16 [8192, 8192] and at decode (M=16,
K=7168). Session-1 kernels were timed against these once (perf/results/probes/2026-11-21-h200-quant-variants-
9e59277.txt); the benchmark history keeps the rest.

    python perf/probes/quant_variants.py            # ~30 s on an H200 (mostly Triton compiles): verify, then time
    python perf/probes/quant_variants.py --quick    # fewer repetitions
    python perf/probes/quant_variants.py --sweep    # also sweep tiles of the current kernels (~30 s more)
    python perf/probes/quant_variants.py --full-verify  # also fp16/fp32 inputs/outputs, both layouts (~40 s more)
    python perf/probes/quant_variants.py --tiles --out tiles.json  # session 5: row tiles per program (TILES)

Session 5: --tiles times the FP4 quantize kernel with one to four row tiles per program (next tile's loads
first) and 1x2048 / 1x4096 tiles, bytes checked against the one-tile kernel first (--out: JSON). The min3 E2M1
encode timed in calls 3-5 (slower: more registers, lower occupancy) is gone from the kernel; perf/NOTES.md.

Verifies bytes first (small shapes incl. NaN/Inf/-0, special global scales gs = 0, tiny, Inf, NaN, negative,
bf16 inputs (--full-verify: fp16/fp32 too) equal the reference; then the 8192^2 outputs), then prints one
line per variant: median us of CUDA-graph replays (10 calls per graph, so no host time), GB/s of logical bytes
(x read once + codes + scales written) and the fraction of the suite's copy roof (perf.runner.measure_roofline:
eager dst.copy_(src) of 2 x 1 GiB bf16) measured here.
"""

# ruff: noqa: E501, B023
# (B023: every lambda below is timed inside its own loop iteration)
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch import ops  # noqa: E402
from dispatch.reference import quant as ref  # noqa: E402
from dispatch.reference.formats import round_up  # noqa: E402
from dispatch.reference.quant import fp4_scales_shape  # noqa: E402
from dispatch.selfcheck import byte_mismatches  # noqa: E402
from triton_ops import quant_fp4 as Q4  # noqa: E402
from triton_ops import quant_fp8 as Q8  # noqa: E402
from triton_ops._launch import emulate_formats  # noqa: E402

# ============================================================== current kernels with a chosen tile (sweep only)


def new_fp4_tile(x, bm, bk, nw, *, is_mx, swizzle, global_scale=None, tiles=1):
    """Current _fp4_quantize_kernel (given gs or MX) with tile (bm, bk, warps) and row tiles per program instead
    of fp4_tiling's."""
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
    grid = (triton.cdiv(grid_rows, bm * tiles), triton.cdiv(k, bk))
    Q4._fp4_quantize_kernel[grid](
        words, codes, scales, global_scale if global_scale is not None else gs_out, gs_out,
        rows, k, words.stride(0), grid_rows, scp if swizzle else k // block, scp, 1,
        IS_MX=is_mx, MX_RCEIL=False, GS_MODE=0 if is_mx else 1, SWIZZLE=swizzle, IN_KIND=0,
        EMULATE=emulate_formats(x.device), BLOCK_M=bm, BLOCK_K=bk, PARTIALS_BLOCK=1, TILES=tiles,
        num_warps=nw)
    return codes, scales


def tiles_sweep(dev, roof, reps, records):
    """Session 5, GPU calls 7-10: the FP4 quantize kernel with 1-4 row tiles per program (the next tile's loads
    issued before this tile's math) and 1x2048 / 1x4096 tiles, 8192^2 bf16, bytes checked against the one-tile
    kernel first. (Calls 5 and 10 also timed the min3 encode under register caps and one byte store per swizzled
    scale: both slower, see perf/NOTES.md.)"""
    m = k = 8192
    torch.manual_seed(0)
    x = (torch.randn(m, k, device=dev) * torch.exp(torch.randn(m, 1, device=dev))).to(torch.bfloat16)
    gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
    xb = m * k * 2
    variants = [("1x4096 w4", dict(bm=1, bk=4096, nw=4)),
                ("1x4096 w4 T2", dict(bm=1, bk=4096, nw=4, tiles=2)),
                ("1x4096 w4 T4", dict(bm=1, bk=4096, nw=4, tiles=4)),
                ("1x2048 w4 T2", dict(bm=1, bk=2048, nw=4, tiles=2)),
                ("1x2048 w4 T4", dict(bm=1, bk=2048, nw=4, tiles=4)),
                ("1x4096 w8 T2", dict(bm=1, bk=4096, nw=8, tiles=2)),
                ("1x4096 w8", dict(bm=1, bk=4096, nw=8))]
    nv_b, mx_b = xb + m * k // 2 + m * k // 16, xb + m * k // 2 + m * k // 32
    kernels = (("nvfp4 given-gs swizzled", dict(is_mx=False, swizzle=True, global_scale=gs), nv_b),
               ("nvfp4 given-gs linear", dict(is_mx=False, swizzle=False, global_scale=gs), nv_b),
               ("mxfp4 floor linear", dict(is_mx=True, swizzle=False), mx_b),
               ("mxfp4 floor swizzled", dict(is_mx=True, swizzle=True), mx_b))
    print(f"row-tile sweep, M=K=8192 bf16, CUDA-graph replay (copy roof {roof:.0f} GB/s)")
    for name, kw, nbytes in kernels:
        want = new_fp4_tile(x, 1, 4096, 4, **kw)
        for vname, v in variants:
            _same(f"{name} {vname}", new_fp4_tile(x, **v, **kw), want)
            us = min(graph_us(lambda v=v: new_fp4_tile(x, **v, **kw), reps) for _ in range(2))
            frac = nbytes / us / 1e3 / roof
            print(f"  {name:26s} {vname:16s} {us:7.1f} us {frac:6.3f} of copy")
            records.append(dict(kernel=name, variant=vname, median_us=us, bytes=nbytes, roofline_frac=frac,
                                copy_gbps=roof))


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


def amax_pass(x):
    """The computed-gs amax pass alone (partials only)."""
    k = x.shape[-1]
    x2 = x.view(-1, k)
    rows = x2.shape[0]
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


def _special_base():
    """[64, 2048] fp32 values over a wide per-row scale range with Inf, -Inf, NaN, a zero block, -0 and
    subnormals in fixed places: the probes' small verification input."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 2048, generator=g) * torch.exp(torch.randn(64, 1, generator=g) * 3)
    base[0, 5] = float("inf")
    base[1, 7] = float("-inf")
    base[2, 9] = float("nan")
    base[3, :16] = 0
    base[3, 3] = -0.0
    base[4, 20] = -0.0
    base[5, 40:48] = 1e-40
    return base


def verify(dev, full=False):
    """Small shapes with NaN/Inf/-0/subnormals and special global scales (runtime values: no extra compiles).
    Default: bf16 inputs and the configurations timed below (each new constexpr combination is a ~1 s compile);
    full=True adds fp16/fp32 inputs, both layouts and fp16/fp32 outputs (the GPU pytest run covers those too)."""
    # [64, 2048]: the same tiles (and so the same compiled kernels) as the 8192^2 timing below
    base = _special_base()
    n = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32) if full else (torch.bfloat16,):
        x = base.to(dt)
        xd = x.to(dev)
        for gsv in (0.0, -0.0, 1e-36, 1e-30, 2.0 ** -100, 1e-3, -0.5, float("inf"), float("nan"), 3e38, 1e-45):
            gs = torch.tensor(gsv)
            for sw in (False, True):
                lay = "swizzled" if sw else "linear"
                want = ops.nvfp4_quantize(x, gs, scale_layout=lay, backend="torch")
                _same(f"new nvfp4 {dt} gs={gsv} {lay}", Q4.nvfp4_quantize(xd, gs.to(dev), sw), want)
                n += 1
        want = ops.nvfp4_quantize(x, backend="torch")
        _same(f"new nvfp4 computed {dt}", Q4.nvfp4_quantize(xd, None, False), want)
        for r in ("floor", "rceil"):
            want = ops.mxfp4_quantize(x, rounding=r, backend="torch")
            _same(f"new mxfp4 {dt} {r}", Q4.mxfp4_quantize(xd, r, False), want)
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
          "NaN/Inf/-0/subnormals, special gs)")


# ============================================================== timing


def graph_us(fn, reps, inner=10):
    """Median us per call of `fn`, `inner` calls captured in one CUDA graph (perf.runner.time_passes)."""
    from perf.runner import time_passes
    return time_passes(lambda _: fn(), [None] * inner, torch.device(DEVICE), graph=True, budget_s=reps * 1e-3).median_us


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
    ap.add_argument("--out", help="write the --tiles records (JSON) here")
    ap.add_argument("--tiles", action="store_true", help="only the session-5 row-tiles-per-program sweep")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    dev = torch.device(DEVICE)
    if dev.type == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    verify(dev, args.full_verify)
    roof = copy_gbps(dev)
    print(f"copy 2 x 1 GiB bf16 (perf.runner.measure_roofline, eager events): {roof:.0f} GB/s (bytes read + written)")
    if args.tiles:
        records = []
        tiles_sweep(dev, roof, reps, records)
        if args.out:
            import json
            Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), triton=triton.__version__,
                                                      copy_gbps=roof, records=records), indent=1))
        return

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
        line("nvfp4 given-gs swizzled: current launcher", graph_us(lambda: Q4.nvfp4_quantize(x, gs, True), reps), nv_b)
        line("nvfp4 given-gs linear: current launcher", graph_us(lambda: Q4.nvfp4_quantize(x, gs, False), reps), nv_b)
        line("nvfp4 computed-gs linear: current (amax + quant)", graph_us(lambda: Q4.nvfp4_quantize(x, None, False), reps), nv_b)
        line("  amax pass alone (GB/s of x read)", graph_us(lambda: amax_pass(x), reps), xb)
        line("mxfp4 floor linear: current launcher", graph_us(lambda: Q4.mxfp4_quantize(x, "floor", False), reps), mx_b)
        line("fp8 g128: current launcher", graph_us(lambda: Q8.fp8_group_quantize(x, 128, 1e-10, False, False), reps), f8_b)
        nq = Q4.nvfp4_quantize(x, gs, True)
        mq = Q4.mxfp4_quantize(x, "floor", False)
        fq = Q8.fp8_group_quantize(x, 128, 1e-10, False, False)
        if m == SHAPES[0][0]:
            _same("new nvfp4 deq 8192^2", (Q4.nvfp4_dequantize(*nq, True, torch.bfloat16),), (ref.nvfp4_dequantize(*nq, True, torch.bfloat16),))
            _same("new mxfp4 deq 8192^2", (Q4.mxfp4_dequantize(*mq, False, torch.bfloat16),), (ref.mxfp4_dequantize(*mq, False, torch.bfloat16),))
            _same("new fp8 deq 8192^2", (Q8.fp8_group_dequantize(*fq, 128, torch.bfloat16),), (ref.fp8_group_dequantize(*fq, 128, torch.bfloat16),))
        line("nvfp4 dequant swizzled -> bf16: current launcher", graph_us(lambda: Q4.nvfp4_dequantize(*nq, True, torch.bfloat16), reps), nv_b)
        line("mxfp4 dequant linear -> bf16: current launcher", graph_us(lambda: Q4.mxfp4_dequantize(*mq, False, torch.bfloat16), reps), mx_b)
        line("fp8 dequant g128 -> bf16: current launcher", graph_us(lambda: Q8.fp8_group_dequantize(*fq, 128, torch.bfloat16), reps), f8_b)
        if not args.sweep or m != SHAPES[0][0]:
            continue
        print("  tile sweep (BLOCK_M x BLOCK_K, warps), current kernels:")
        for bm, bk, nw in ((2, 2048, 4), (1, 4096, 4), (2, 4096, 8), (4, 1024, 4)):
            line(f"    nvfp4 given-gs swizzled {bm}x{bk} w{nw}", graph_us(lambda: new_fp4_tile(x, bm, bk, nw, is_mx=False, swizzle=True, global_scale=gs), reps), nv_b)
            line(f"    nvfp4 given-gs linear   {bm}x{bk} w{nw}", graph_us(lambda: new_fp4_tile(x, bm, bk, nw, is_mx=False, swizzle=False, global_scale=gs), reps), nv_b)
            line(f"    mxfp4 floor swizzled    {bm}x{bk} w{nw}", graph_us(lambda: new_fp4_tile(x, bm, bk, nw, is_mx=True, swizzle=True), reps), mx_b)
            line(f"    mxfp4 floor linear      {bm}x{bk} w{nw}", graph_us(lambda: new_fp4_tile(x, bm, bk, nw, is_mx=True, swizzle=False), reps), mx_b)

if __name__ == "__main__":
    main()
