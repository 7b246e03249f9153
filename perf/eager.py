"""Eager host cost per call: every op back to back at a tiny shape, against torch's own eager ops.

    python -m perf.eager --out eager.json [--ops rms_norm,swiglu] [--profile rms_norm,...]

Each record: op, backend (what `auto` picked), host_us (wall time per call of N back-to-back calls, median of
5 batches; the kernels are tiny, so the GPU idles and the wall time is the host's), host_ratio = host_us /
torch F.rms_norm's host_us at M=16 x 7168 bf16 measured in the same process. Peers: torch eager equivalents
and Liger where installed. `--profile` adds a cProfile breakdown (top functions by own time) per named op.
Calls go through the public path (`dispatch.ops._common.call`, what every `ops.*` wrapper calls).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

CALLS, BATCHES = 200, 5


def host_us(fn, calls: int = CALLS, batches: int = BATCHES) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


def profile_breakdown(fn, calls: int = CALLS, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def torch_peers(dev) -> dict:
    """Torch's own eager ops (and Liger's where installed) at the decode shape M=16 x 7168 bf16."""
    x = torch.randn(16, 7168, device=dev, dtype=torch.bfloat16)
    w = torch.randn(7168, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(16, 2 * 2048, device=dev, dtype=torch.bfloat16)
    peers = {
        "torch x*2": lambda: x * 2,
        "torch F.rms_norm": lambda: F.rms_norm(x, (7168,), w, 1e-6),
        "torch silu(g)*u": lambda: F.silu(gu[:, :2048]) * gu[:, 2048:],
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        peers["liger rms_norm"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-6)
        peers["liger swiglu"] = lambda: LigerSiLUMulFunction.apply(gu[:, :2048], gu[:, 2048:])
    except Exception:  # an optional peer: absent, its rows are absent
        pass
    return peers


def run(ops: list[str] | None, profile: list[str]) -> dict:
    from dispatch.ops._common import backend_for, call
    from dispatch.selfcheck import all_cases

    dev = torch.device("cuda")
    records, breakdowns = [], {}
    peers = {name: host_us(fn) for name, fn in torch_peers(dev).items()}
    base = peers["torch F.rms_norm"]
    for name, us in peers.items():
        records.append(dict(op=name, provider="peer", host_us=round(us, 2), host_ratio=round(us / base, 3)))
    for case in all_cases():
        if ops and case.op not in ops:
            continue
        args = case.make_args(dev, True)
        backend = backend_for(case.op, *args)
        fn = (lambda a=args, op=case.op: call(op, *a, "auto"))
        try:
            us = host_us(fn)
        except Exception as exc:  # report, do not hide: the record says what failed
            records.append(dict(op=case.op, label=case.label, backend=backend, error=repr(exc)[:300]))
            continue
        records.append(dict(op=case.op, label=case.label, provider="lowbit", backend=backend,
                            host_us=round(us, 2), host_ratio=round(us / base, 3)))
        if case.op in profile:
            breakdowns[case.op] = profile_breakdown(fn)
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                baseline="torch F.rms_norm M=16 x 7168 bf16", baseline_us=round(base, 2), records=records,
                breakdowns=breakdowns)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ops", help="comma-separated op names (default: every op with a self-check case)")
    p.add_argument("--profile", default="", help="comma-separated ops to break down with cProfile")
    a = p.parse_args()
    import triton
    result = run(a.ops.split(",") if a.ops else None, [o for o in a.profile.split(",") if o])
    result["triton"] = triton.__version__
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["records"]:
        print(f"{r['op']:<28} {r.get('backend', r.get('provider', '')):<8} {r.get('host_us', 'ERR'):>8} "
              f"{r.get('host_ratio', r.get('error', ''))}")
    for op, text in result["breakdowns"].items():
        print(f"==== {op}\n{text}")


if __name__ == "__main__":
    main()
