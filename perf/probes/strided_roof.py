"""GPU probe (session 4, issue 5): the copy bandwidth of the access pattern DeepSeek's RoPE ops are held to.

rope_ (DeepSeek-V4: rotate the last 64 of 512 dims per head, in place) and ds_rope_quant_append's q part touch
one 128-byte run per 1024-byte head row. Their roofline fraction is computed against a dense copy; this probe
measures what a plain torch copy / in-place update of exactly those runs reaches, so the kernels' 0.74-0.76 can be
read against what the memory system gives for the pattern. CUDA-graph replay (perf.runner.time_passes).
Run: PYTHONPATH=$PWD python perf/probes/strided_roof.py [--out OUT.json]   (~10 s)
"""

from __future__ import annotations

import argparse
import json

import torch

from perf.runner import measure_roofline, time_passes

DEV = torch.device("cuda")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    roof = measure_roofline(DEV, quick=True).copy_gbps
    t, h, d, rot = 16384, 64, 512, 64
    a = torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16)
    dense_src = torch.randn(t, h, rot, device=DEV, dtype=torch.bfloat16)
    dense_dst = torch.empty_like(dense_src)
    nbytes = 2 * t * h * rot * 2  # read + write of the rotary runs
    rows = []
    cases = {
        "dense copy of the same bytes": lambda _: dense_dst.copy_(dense_src),
        "strided copy (last 64 of 512, other tensor)": lambda _: b[:, :, d - rot:].copy_(a[:, :, d - rot:]),
        "strided in-place update (x *= 1, last 64 of 512)": lambda _: a[:, :, d - rot:].mul_(1.0),
    }
    print(f"{torch.cuda.get_device_name()}; dense copy roof {roof:.0f} GB/s; {nbytes / 1e6:.0f} MB per call")
    for name, fn in cases.items():
        us = time_passes(fn, [None], DEV, graph=True, budget_s=0.3).median_us
        gbps = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(case=name, us=us, gbps=gbps, frac=gbps / roof))
        print(f"{name:50s} {us:8.1f} us {gbps:7.0f} GB/s {gbps / roof:.3f} of copy")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=roof, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
