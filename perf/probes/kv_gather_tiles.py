"""GPU probe: program tiles of the two KV-cache gathers (paged_kv_gather_fp8, ds_kv_gather) at the benchmark
shapes (perf/cases/rope_kv.py). Bare launchers through `cfg=GatherConfig(...)`, CUDA-graph replay over input
copies that exceed L2 (perf.runner.time_passes); ~1 min, mostly Triton compiles (27 variants).

Run: PYTHONPATH=$PWD python perf/probes/kv_gather_tiles.py [--json OUT]   (one line per variant: us, GB/s, fraction
of copy; also PROBES="kv_gather_tiles" bash perf/gpu_check.sh probes)
Verifies every variant's bytes against the reference on a small shape with padding / bad slots first.
"""

# ruff: noqa: B023  (every lambda below is called within its loop iteration)
from __future__ import annotations

import argparse
import json

import torch
import triton

from dispatch.reference import kv_cache as ref
from perf.runner import measure_roofline, time_passes
from triton_ops import kv_cache as tri
from triton_ops.kv_cache import GatherConfig

DEVICE = torch.device("cuda")
L2_BYTES = 192 << 20


def graph_us(fn, sets):
    return time_passes(fn, sets, DEVICE, graph=True).median_us


ROWS = []


def report(what, us, nbytes, copy):
    gbps = nbytes / us / 1e3
    ROWS.append(dict(variant=what.strip(), us=us, gbps=gbps, of_copy=gbps / copy))
    print(f"{what} {us:7.2f} us {gbps:7.0f} GB/s {gbps / copy:5.2f} of copy")


def same(got, want):
    gn, wn = torch.isnan(got), torch.isnan(want)
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    return torch.equal(gn, wn) and torch.equal(torch.where(gn, 0, got.view(ints)), torch.where(wn, 0, want.view(ints)))


def paged_inputs(t, h=8, d=64, bs=16):
    nb = -(-t // bs) + 1
    slots = torch.randperm(nb * bs, device=DEVICE)[:t]
    cache = torch.zeros(nb, bs, h, d, device=DEVICE, dtype=torch.uint8)
    sc = torch.zeros(nb, bs, h, device=DEVICE)
    ref.paged_kv_write_fp8(torch.randn(t, h, d, device=DEVICE, dtype=torch.bfloat16), slots, cache, None, sc)
    return cache, sc, slots[torch.randperm(t, device=DEVICE)]


def ds_inputs(t, layout, bs=64):
    L = ref.DS_LAYOUTS[layout]
    nb = -(-t // bs) + 1
    slots = torch.randperm(nb * bs, device=DEVICE)[:t]
    cache = ref.ds_kv_cache_empty(nb, bs, layout, DEVICE)
    ref.ds_kv_write(torch.randn(t, L.d, device=DEVICE, dtype=torch.bfloat16), slots, cache, layout)
    return cache, slots[torch.randperm(t, device=DEVICE)]


# (name, elements per program, warps); tokens per program follow from the row size
PREFILL = [("default", None, None), ("2048el/4w", 2048, 4), ("2048el/2w", 2048, 2), ("8192el/8w", 8192, 8),
           ("1024el/1w", 1024, 1)]
DECODE = [("default", None, None), ("1tok/1w", 512, 1), ("1tok/4w", 512, 4), ("2tok/4w", 1024, 4)]


def cfg_for(elems, warps, row, block_h=1):
    return None if elems is None else GatherConfig(max(1, elems // row), block_h, warps)


def main(shapes=((16384, PREFILL), (64, DECODE))):
    torch.manual_seed(0)
    copy = measure_roofline(DEVICE).copy_gbps
    print(f"copy 2x1 GiB (perf.runner.measure_roofline): {copy:.0f} GB/s")

    # verify every variant on a small shape with slot -1 and a bad slot
    cache, sc, slots = paged_inputs(300)
    slots = torch.cat([slots, torch.tensor([-1, cache.shape[0] * cache.shape[1]], device=DEVICE)])
    want = ref.paged_kv_gather_fp8(cache, slots, None, sc, torch.bfloat16)
    for _, el, w in PREFILL + DECODE:
        assert same(tri.paged_kv_gather_fp8(cache, slots, None, sc, torch.bfloat16, cfg_for(el, w, 512, 8)), want)
    for layout in ("v32", "v4"):
        cache, slots = ds_inputs(300, layout)
        slots = torch.cat([slots, torch.tensor([-1, cache.shape[0] * cache.shape[1]], device=DEVICE)])
        want = ref.ds_kv_gather(cache, slots, layout, torch.bfloat16)
        for _, el, w in PREFILL + DECODE:
            assert same(tri.ds_kv_gather(cache, slots, layout, torch.bfloat16, cfg_for(el, w, 512)), want), layout
    print("verified: every tile variant == reference bytes (bf16, slot -1 and a bad slot included)")

    for t, variants in shapes:
        h, d = 8, 64
        per_copy = t * h * (d + 4) + t * 8 + t * h * d * 2
        sets = [paged_inputs(t) for _ in range(max(8, min(256, L2_BYTES // per_copy)))]
        for name, el, w in variants:
            cfg = cfg_for(el, w, h * d, 8)
            us = graph_us(lambda a: tri.paged_kv_gather_fp8(a[0], a[2], None, a[1], torch.bfloat16, cfg), sets)
            report(f"paged_kv_gather_fp8 T={t} H=8 D=64 {name:10s}", us, per_copy, copy)
        for layout in ("v32", "v4"):
            L = ref.DS_LAYOUTS[layout]
            per_copy = t * (L.d_nope + L.num_tiles * L.scale_bytes + 2 * ref.DS_ROPE) + t * L.d * 2 + t * 8
            sets = [ds_inputs(t, layout) for _ in range(max(8, min(256, L2_BYTES // per_copy)))]
            for name, el, w in variants:
                cfg = cfg_for(el, w, 512)
                us = graph_us(lambda a: tri.ds_kv_gather(a[0], a[1], layout, torch.bfloat16, cfg), sets)
                report(f"ds_kv_gather T={t} {layout:3s} {name:10s}", us, per_copy, copy)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    main()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=ROWS), f, indent=1)
