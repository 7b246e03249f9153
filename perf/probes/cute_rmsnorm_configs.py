"""GPU probe (session 4, issue 6): the CuTe RMSNorm kernel at other (threads per row, rows per CTA) configs than
cute_ops.rmsnorm.pick_config's, bare TVM-FFI calls under CUDA-graph replay, against Liger in the same process.

The throughput bar is >= 0.90 of copy and never slower than Liger; the heuristic picks the fewest threads per row
with <= 8 vectors each (64 elements per thread at 4096 bf16 columns, 2 rows per CTA). This sweeps threads per row
(64..512) and rows per CTA (1..4) for plain, FP8 g128 +residual and NVFP4 swizzled at 32768x4096 and 4096x7168,
checks every variant's bytes against the heuristic's output first, and prints us, GB/s and the fraction of a torch
copy measured here. Run: PYTHONPATH=$PWD python perf/probes/cute_rmsnorm_configs.py [--out OUT.json] (~60-90 s,
mostly CuTe compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from cute_ops import _compile
from cute_ops import rmsnorm as cr
from perf.runner import measure_roofline, time_passes

DEV = torch.device("cuda")
SHAPES = ((32768, 4096), (4096, 7168))


def variants(base: cr.RMSNormConfig):
    """The heuristic's config first, then other (threads per row, rows per CTA) with <= 8 vectors per thread."""
    nvec = base.k // base.vec
    out = {"heuristic": base}
    for tpr in (64, 128, 256, 512):
        iters = -(-nvec // tpr)
        if iters > cr.MAX_ITERS or (base.mode != "none" and tpr % (base.group_size // base.vec)):
            continue
        for rows in (1, 2, 4):
            if tpr * rows > 1024 or tpr * rows < 64:
                continue
            cfg = dataclasses.replace(base, threads_per_row=tpr, rows_per_cta=rows, iters=iters)
            if cfg != base:
                out[f"tpr{tpr} rows{rows}"] = cfg
    return out


def buffers(mode, m, k, residual):
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) * 2
    w = (torch.randn(k, device=DEV) * 0.2 + 1).bfloat16()
    r = torch.randn(m, k, device=DEV, dtype=torch.bfloat16) if residual else None
    ro = torch.empty_like(x) if residual else None
    y = q = s = gs = gso = None
    if mode == "none":
        y = torch.empty_like(x)
    elif mode == "fp8":
        q = torch.empty(m, k, device=DEV, dtype=torch.uint8)
        s = torch.empty(m, k // 128, device=DEV, dtype=torch.float32)
    else:
        q = torch.empty(m, k // 2, device=DEV, dtype=torch.uint8)
        s = torch.zeros((m + 127) // 128 * 128 * (k // 16), device=DEV, dtype=torch.uint8)
        gs = torch.full((1,), 0.01, device=DEV)
        gso = torch.empty(1, device=DEV)
    args = (x, w, r, ro, y, q, s, gs, gso, 1e-6, 1e-10)
    outs = [t for t in (ro, y, q, s) if t is not None]
    nbytes = sum(t.numel() * t.element_size() for t in (x, r) if t is not None) \
        + sum(t.numel() * t.element_size() for t in outs)
    return args, outs, nbytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    roof = measure_roofline(DEV, quick=True).copy_gbps
    print(f"{torch.cuda.get_device_name()}; copy roof {roof:.0f} GB/s")
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except Exception:  # noqa: BLE001 - the peer is optional
        LigerRMSNormFunction = None
    arch = _compile.target_arch()
    records = []
    for mode, residual in (("none", False), ("fp8", True), ("nvfp4", False)):
        for m, k in SHAPES:
            group = 128 if mode == "fp8" else 16
            base = cr.pick_config(torch.bfloat16, torch.bfloat16, k, mode, residual, 0.0, group, False,
                                  mode == "nvfp4", arch)
            args, outs, nbytes = buffers(mode, m, k, residual)
            want = None
            for name, cfg in variants(base).items():
                try:
                    fn = cr.compiled(cfg)
                    for t in outs:
                        t.fill_(0xFF if t.dtype == torch.uint8 else float("nan"))
                    fn(*args)
                    got = [t.clone() for t in outs]
                    if want is None:
                        want = got
                    same = all(torch.equal(g.view(torch.uint8), r.view(torch.uint8))
                               for g, r in zip(got, want, strict=True))
                    us = time_passes(lambda _, f=fn, a=args: f(*a), [None], DEV, graph=True, budget_s=0.3).median_us
                except Exception as exc:  # noqa: BLE001 - a probe: report and go on
                    print(f"{mode:6s} {m}x{k} {name:16s} failed: {str(exc)[:120]}")
                    continue
                gbps = nbytes / (us * 1e-6) / 1e9
                rec = dict(mode=mode, residual=residual, m=m, k=k, variant=name, tpr=cfg.threads_per_row,
                           rows=cfg.rows_per_cta, iters=cfg.iters, us=us, gbps=gbps, frac=gbps / roof,
                           bytes_equal=same)
                records.append(rec)
                print(f"{mode:6s}{' +res' if residual else '     '} {m}x{k} {name:16s} {us:8.1f} us {gbps:7.0f} GB/s "
                      f"{gbps / roof:.3f} of copy {'' if same else 'BYTES DIFFER'}")
            if mode == "none" and LigerRMSNormFunction is not None:
                x, w = args[0], args[1]
                us = time_passes(lambda _, x=x, w=w: LigerRMSNormFunction.apply(x, w, 1e-6), [None], DEV, graph=True,
                                 budget_s=0.3).median_us
                gbps = nbytes / (us * 1e-6) / 1e9
                records.append(dict(mode=mode, m=m, k=k, variant="liger", us=us, gbps=gbps, frac=gbps / roof))
                print(f"{mode:6s}       {m}x{k} {'liger':16s} {us:8.1f} us {gbps:7.0f} GB/s {gbps / roof:.3f} of copy")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=roof,
                           records=records), f, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
