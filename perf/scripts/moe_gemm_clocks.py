"""One bf16 MoE grouped GEMM shape timed per provider (Triton, CuTe, `torch._grouped_mm`): eager calls back to
back, CUDA-graph replays back to back, one eager call after a 50 ms idle gap, each with the SM clock and board
power (NVML through torch.cuda); and each kernel's mean time per call (torch.profiler, 16 eager calls).

    python perf/scripts/moe_gemm_clocks.py --n 7168 --k 2048 --rows 256
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch import ops  # noqa: E402


def timed(fn, calls: int, gap_s: float) -> dict:
    """Median us per call; the SM clock (MHz) and board power (W) sampled while the calls run (back to back: five
    samples while the queued calls execute; with a gap: one right after each call)."""
    events, clocks, watts = [], [], []

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
    if not gap_s:
        for _ in range(5):
            time.sleep(0.003)
            sample()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) * 1e3 for a, b in events]
    return dict(us=round(statistics.median(times), 1), mhz=round(statistics.mean(clocks)),
                watts=round(statistics.mean(watts)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    e, rows, n, k = args.experts, args.rows, args.n, args.k
    a = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    m_indices = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
    providers = {
        "torch._grouped_mm": lambda: torch._grouped_mm(a, w.transpose(1, 2), offs, out_dtype=torch.bfloat16),
        "triton": lambda: ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="triton"),
        "cute": lambda: ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="cute"),
    }
    for fn in providers.values():
        fn()
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
