"""pytest-benchmark entry: `pytest perf/` (the CLI `python -m perf run` is the main entry; this is for people
who live in pytest-benchmark's tables and `--benchmark-compare`).

One test per case, on the highest-priority lowbit backend available here. Verified against the reference
first (a fast wrong answer fails the test). pytest-benchmark's rounds are timed with a GPU timer: the clock
is read after `torch.cuda.synchronize()`, so a round covers the kernel, not its asynchronous launch; the runner's
CUDA-event median / p20 / p80 (one input set here; `python -m perf run` rotates copies past L2 and is the
number to quote) is attached as `extra_info`.
On a CPU machine the cases are the --quick ones under the Triton interpreter (set LOWBIT_PERF_FULL=1 to
force full shapes), and the timer is the plain wall clock.
"""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from perf import runner  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUICK = DEVICE.type == "cpu" and not os.environ.get("LOWBIT_PERF_FULL")
CASES = runner.select_cases(runner.load_cases(), QUICK)


def gpu_timer() -> float:
    """pytest-benchmark timer: wall clock read after the device drained (seconds)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


@pytest.mark.benchmark(timer=gpu_timer, disable_gc=True, warmup=False)
@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}[{c.label}]" for c in CASES])
def test_bench(benchmark, case):
    backends, why = runner.lowbit_backends(case.op, DEVICE, QUICK)
    if not backends:
        pytest.skip(f"no lowbit backend for {case.op} here: {why}")
    backend = next((b for b in backends if b != "torch"), backends[0])  # the kernel, not the reference backend
    with torch.no_grad():
        inputs = case.make(DEVICE)
        want = case.reference(runner.clone_inputs(inputs))
        case.check(case.lowbit(runner.clone_inputs(inputs), backend), want)
        t = runner.time_passes(lambda i: case.lowbit(i, backend), [inputs], DEVICE)
        benchmark.extra_info.update(
            backend=backend, device=str(DEVICE), quick=QUICK, event_median_us=t.median_us, event_p20_us=t.p20_us,
            event_p80_us=t.p80_us, gbps=case.bytes_moved / (t.median_us * 1e3) if case.bytes_moved else None,
            interpreter=DEVICE.type == "cpu" and backend == "triton")
        rounds = 2 if DEVICE.type == "cpu" else 50
        benchmark.pedantic(case.lowbit, args=(inputs, backend), rounds=rounds, iterations=1, warmup_rounds=1)
