"""One benchmark case's providers called a few times each, nothing timed: the kernels for Nsight Compute.

    ncu --csv --page details --section SpeedOfLight ... python -m perf.scripts.case_calls \
        --op moe_gemm_fp4_prepacked --case "<label>" [--providers triton,triton_kernels]

Providers: lowbit backends by name (triton, cute, ...) and the case's peers by their benchmark names. Each provider's
calls are bracketed by an NVTX range named after it (ncu --nvtx --nvtx-include "<provider>/").
"""

from __future__ import annotations

import argparse

import torch

from perf.runner import load_cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", required=True)
    ap.add_argument("--case", required=True, help="the exact case label")
    ap.add_argument("--providers", default="", help="comma separated; default: the lowbit rule's and every peer")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    (case,) = [c for c in load_cases([args.op]) if c.label == args.case]
    dev = torch.device(args.device)
    i = case.make(dev)
    names = [p for p in args.providers.split(",") if p] or ["auto", *case.peers]
    cuda = dev.type == "cuda"
    for name in names:
        fn = case.peers[name] if name in case.peers else (lambda x, b=name: case.lowbit(x, b))
        if cuda:
            torch.cuda.nvtx.range_push(name)
        for _ in range(args.calls):
            fn(i)
        if cuda:
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
        print(f"{name}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
