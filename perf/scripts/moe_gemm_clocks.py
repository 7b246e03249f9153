"""One bf16 MoE grouped GEMM shape timed per provider (Triton, CuTe, `torch._grouped_mm`): eager calls back to
back, CUDA-graph replays back to back, one eager call after a 50 ms idle gap, each with the SM clock and board
power (NVML through torch.cuda); and each kernel's mean time per call (torch.profiler, 16 eager calls).

    python -m perf.scripts.moe_gemm_clocks --n 7168 --k 2048 --rows 256
    ncu --csv --page details --section SpeedOfLight ... python -m perf.scripts.moe_gemm_clocks --ncu

--ncu: each provider called twice and nothing timed (the kernels for Nsight Compute).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from .moe_bf16_tile_sweep import grouped_providers

PROVIDERS = ("torch._grouped_mm", "triton", "cute")


def timed(fn, calls: int, gap_s: float) -> dict:
    """Median us per call; the SM clock (MHz) and board power (W) sampled while the calls run (back to back: five
    samples while the queued calls execute; with a gap: one right after each call). Back to back also the host's
    submit time per call (`submit_us`: the loop's wall time, no synchronization inside it)."""
    events, clocks, watts = [], [], []
    t0 = time.perf_counter()

    def sample():
        clocks.append(torch.cuda.clock_rate())
        watts.append(torch.cuda.power_draw() / 1e3)

    for _ in range(calls):
        if gap_s:
            torch.cuda.synchronize()
            time.sleep(gap_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
        if gap_s:
            sample()
    submit_us = (time.perf_counter() - t0) / calls * 1e6
    if not gap_s:
        for _ in range(5):
            time.sleep(0.003)
            sample()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e3 for a, b in events]
    return dict(us=round(statistics.median(times), 1), mhz=round(statistics.mean(clocks)),
                watts=round(statistics.mean(watts)), **({} if gap_s else {"submit_us": round(submit_us, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--ncu", action="store_true", help="call each provider twice, time nothing")
    args = ap.parse_args()
    e, rows, n, k = args.experts, args.rows, args.n, args.k
    every, _ = grouped_providers(n, k, e, rows)
    providers = {label: every[label] for label in PROVIDERS}
    for _ in range(2 if args.ncu else 1):
        for fn in providers.values():
            fn()
    if args.ncu:
        torch.cuda.synchronize()
        return
    for label, fn in providers.items():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(16):
                fn()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
                kernels[ev.key[:60]] = [ev.count, round(ev.device_time_total / ev.count, 1)]
        rec = dict(case=f"{e}x{rows} N={n} K={k}", provider=label, back_to_back=timed(fn, 64, 0.0),
                   graph=timed(graph.replay, 64, 0.0), after_idle=timed(fn, 12, 0.05), kernels_us=kernels)
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
