"""GPU probe (session 5): run chosen benchmark cases once each inside a profiler range, for Nsight Compute.

Where the benchmarks say how long a kernel takes, ncu says why: issue-slot use, per-pipe load, warp stall
reasons, occupancy, DRAM throughput. This driver makes each case's inputs (perf/cases), warms every provider up
(compiles), then calls each provider once between torch.cuda.profiler.start()/stop() inside an NVTX range named
"op|label|provider", so `ncu --profile-from-start off --nvtx --print-nvtx-rename kernel` names the kernels.

Run (on the GPU):  ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
                       --section SpeedOfLight ... python perf/probes/ncu_cases.py [--only SUBSTR ...]
Without ncu it just runs the calls (a smoke test: `python perf/probes/ncu_cases.py --list`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf import runner  # noqa: E402

# (op, label substring, providers): "triton"/"cute" are lowbit backends, anything else a case peer by name
TARGETS = [
    ("nvfp4_quantize", "M=8192 K=8192 bf16 given-gs swizzled", ("triton",)),
    ("nvfp4_quantize", "M=8192 K=8192 bf16 computed-gs linear", ("triton",)),
    ("mxfp4_quantize", "M=8192 K=8192 bf16 floor linear", ("triton",)),
    ("fp8_group_quantize", "M=8192 K=8192 bf16 g128", ("triton",)),
    ("rms_norm", "M=32768 N=4096 bf16", ("triton", "cute", "liger")),
    ("rms_norm_nvfp4", "M=32768 N=4096 bf16 given-gs swizzled", ("triton", "cute")),
    ("rms_norm_mxfp4", "M=32768 N=4096 bf16 swizzled", ("triton",)),
    ("swiglu_mxfp4", "M=16384 I=4096 gptoss g1 -> mxfp4 swizzled", ("triton",)),
    ("swiglu_nvfp4", "M=16384 I=4096 MoE contiguous g8", ("triton",)),
    ("rope", "T=16384 Hq=32 Hk=8", ("triton", "liger")),
    ("rope_", "T=16384 H=64 D=512", ("triton",)),
    ("ds_rope_quant_append", "T=16384 Hq=64 v32", ("triton",)),
    ("ds_kv_write", "T=16384 v32", ("triton",)),
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=None, help="keep targets whose 'op|label' contains one of these")
    ap.add_argument("--list", action="store_true", help="print the matched cases and exit")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = runner.load_cases(sorted({t[0] for t in TARGETS}))
    plan = []
    for op, sub, provs in TARGETS:
        match = [c for c in cases if c.op == op and sub in c.label and c.bucket == "prefill"]
        if not match:
            print(f"ncu_cases: no case {op} [{sub}]", file=sys.stderr)
            continue
        c = match[0]
        if a.only and not any(s in f"{c.op}|{c.label}" for s in a.only):
            continue
        plan.append((c, provs))
    if a.list or dev.type != "cuda":
        for c, provs in plan:
            print(c.op, "|", c.label, "|", ",".join(provs))
        return 0
    import torch.cuda.nvtx as nvtx

    for c, provs in plan:
        inputs = c.make(dev)
        for p in provs:
            if p in ("triton", "cute", "torch"):
                fn = (lambda i, b=p, case=c: case.lowbit(i, b))
            elif p in c.peers:
                fn = c.peers[p]
            else:
                print(f"ncu_cases: {c.op} [{c.label}]: provider {p} unavailable here", file=sys.stderr)
                continue
            try:
                with torch.no_grad():
                    for _ in range(2):  # compile and settle
                        fn(runner.clone_inputs(inputs))
                    arg = runner.clone_inputs(inputs)
                    torch.cuda.synchronize()
                    torch.cuda.profiler.start()
                    with nvtx.range(f"{c.op}|{c.label}|{p}"):
                        fn(arg)
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                print(f"ncu_cases: ran {c.op} [{c.label}] {p}", flush=True)
            except Exception as exc:  # keep profiling the rest
                print(f"ncu_cases: {c.op} [{c.label}] {p}: {type(exc).__name__}: {exc}", file=sys.stderr)
        del inputs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
