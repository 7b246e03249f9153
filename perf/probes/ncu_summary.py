"""Summarize an `ncu --csv --metrics ...` run of perf/probes/ncu_cases.py: per kernel, its time, issue-slot use,
DRAM throughput, the pipes' instruction shares (% of peak) and the warp stall reasons (cycles per issued
instruction). perf/gpu_check.sh's `ncu` step writes that CSV; usage: python perf/probes/ncu_summary.py FILE.csv
"""

from __future__ import annotations

import collections
import csv
import sys


def _num(v: str) -> float:
    return float(v.replace(",", ""))


def summarize(path: str) -> str:
    lines = [line for line in open(path) if line.startswith('"')]  # ncu mixes its log lines into stdout
    per_kernel: dict[str, dict[str, str]] = collections.OrderedDict()
    for r in csv.DictReader(lines):
        name = r["Kernel Name"].replace("kernel_cutlass_kernel_cute_ops_rmsnorm_kernelRMSNormKernel", "cute")[:100]
        metric = r["Metric Name"].replace("SM_A.TriageCompute.", "").replace("SM_B.TriageCompute.", "")
        per_kernel.setdefault(name, {})[metric] = r["Metric Value"]
    out = []
    for name, m in per_kernel.items():
        out.append(f"== {name}")
        out.append(f"  time us {_num(m['gpu__time_duration.sum']) / 1000:.1f} issue% "
                   f"{m.get('smsp__issue_active.avg.pct_of_peak_sustained_active')} dram% "
                   f"{m.get('dram__throughput.avg.pct_of_peak_sustained_elapsed')}")
        pipes = {n.split("sm__inst_executed_pipe_")[1].split(".")[0]: _num(v) for n, v in m.items()
                 if "sm__inst_executed_pipe_" in n and v != "n/a"}
        out.append(f"  inst pipe%: { {p: v for p, v in sorted(pipes.items(), key=lambda t: -t[1]) if v >= 3} }")
        stalls = {n.split("stalled_")[1].split("_per")[0]: _num(v) for n, v in m.items()
                  if "issue_stalled" in n and v != "n/a"}
        top = {p: round(v, 2) for p, v in sorted(stalls.items(), key=lambda t: -t[1]) if v >= 0.15}
        out.append(f"  stalls: {top}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
