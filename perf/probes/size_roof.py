"""GPU probe (session 6, issue 5): what a plain copy of the same size reaches, for the KV-cache write cases.

The suite holds every case against the copy bandwidth of 2 x 1 GiB buffers. The KV writes move far less per call
(ds_kv_write T=16384: ~30 MB; paged_kv_write_fp8 T=16384 H=8 D=64: ~26 MB), so launch, ramp-up and the last wave
weigh in, and a dense device copy of the same bytes does not reach that roof either. This probe times, in the suite's
way (CUDA-graph replay of one pass over enough input copies to exceed L2; perf.runner.time_passes), for
T in 4096 / 16384 / 65536:
- a torch copy of the case's bytes (half read, half written: the kernels read about as much as they write),
- ops.ds_kv_write (V3.2 and V4 layouts) and ops.paged_kv_write_fp8 (H=8, D=64, dynamic scales),
and prints each kernel's fraction of the big-copy roof and of the same-size copy.
Run: PYTHONPATH=$PWD python perf/probes/size_roof.py [--out OUT.json]   (~20 s)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch import ops  # noqa: E402
from dispatch.reference import kv_cache as kref  # noqa: E402
from perf.runner import L2_TARGET_BYTES, measure_roofline, time_passes  # noqa: E402

DEV = torch.device("cuda")


def _copies(make, footprint):
    return [make() for _ in range(max(1, math.ceil(L2_TARGET_BYTES / footprint)))]


def same_size_copy_us(nbytes):
    half = nbytes // 2
    sets = _copies(lambda: (torch.empty(half, dtype=torch.uint8, device=DEV),
                            torch.empty(half, dtype=torch.uint8, device=DEV)), nbytes)
    return time_passes(lambda a: a[1].copy_(a[0]), sets, DEV, graph=True, budget_s=0.3).median_us


def ds_write(t, layout):
    L = kref.DS_LAYOUTS[layout]
    nb = -(-t // 64) + 1

    def make():
        return (torch.randn(t, L.d, device=DEV, dtype=torch.bfloat16), torch.randperm(nb * 64, device=DEV)[:t],
                kref.ds_kv_cache_empty(nb, 64, layout, DEV))

    nbytes = t * L.d * 2 + t * L.token_bytes + t * 8
    sets = _copies(make, nbytes)
    us = time_passes(lambda a: ops.ds_kv_write(a[0], a[1], a[2], layout=layout), sets, DEV, graph=True,
                     budget_s=0.3).median_us
    return us, nbytes


def paged_write(t, h=8, d=64):
    nb = -(-t // 16) + 1

    def make():
        return (torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16), torch.randperm(nb * 16, device=DEV)[:t],
                torch.zeros(nb, 16, h, d, device=DEV, dtype=torch.uint8), torch.zeros(nb, 16, h, device=DEV))

    nbytes = t * h * d * 3 + t * h * 4 + t * 8
    sets = _copies(make, nbytes)
    us = time_passes(lambda a: ops.paged_kv_write_fp8(a[0], a[1], a[2], scale_cache=a[3]), sets, DEV, graph=True,
                     budget_s=0.3).median_us
    return us, nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    roof = measure_roofline(DEV).copy_gbps
    print(f"copy roof (2 x 1 GiB) {roof:.0f} GB/s")
    recs = []
    for t in (4096, 16384, 65536):
        for name, fn, arg in (("ds_kv_write v32", ds_write, "v32"), ("ds_kv_write v4", ds_write, "v4"),
                              ("paged_kv_write_fp8 H=8 D=64", paged_write, None)):
            us, nbytes = fn(t, arg) if arg else fn(t)
            cu = same_size_copy_us(nbytes)
            gbps, cgbps = nbytes / us / 1e3, nbytes / cu / 1e3
            rec = dict(case=f"{name} T={t}", bytes=nbytes, us=us, gbps=gbps, roof_frac=gbps / roof,
                       same_size_copy_us=cu, same_size_copy_frac=cgbps / roof, frac_of_same_size_copy=gbps / cgbps)
            recs.append(rec)
            print(f"{rec['case']:36s} {nbytes / 1e6:7.1f} MB {us:8.1f} us {rec['roof_frac']:.3f} of roof | "
                  f"same-size copy {cu:7.1f} us {rec['same_size_copy_frac']:.3f} of roof | kernel/copy "
                  f"{rec['frac_of_same_size_copy']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(copy_gbps=roof, records=recs), indent=1))


if __name__ == "__main__":
    main()
