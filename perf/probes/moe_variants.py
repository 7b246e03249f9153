"""GPU probe: MoE combine column tiles, gather tile choices, and the align single-launch vs three-launch paths at
decode. Bare launchers, CUDA events (perf.runner.time_passes), < 40 s.

Run: PYTHONPATH=$PWD python perf/probes/moe_variants.py   (prints one line per variant: us and GB/s)
Verifies bytes against the reference on a small shape first.
"""

# ruff: noqa: B023  (every lambda below is called within its loop iteration)
from __future__ import annotations

import torch

from dispatch.reference import moe as ref
from perf.runner import measure_roofline, time_passes
from triton_ops import moe_align as tri

DEVICE = torch.device("cuda")


def bench(fn):
    """Median us per eager call (perf.runner.time_passes: CUDA events, warm-up excluded)."""
    return time_passes(lambda _: fn(), [None], DEVICE).median_us


def graph_us(fn, calls=200):
    """Per-call GPU time of `fn` replayed in a CUDA graph of `calls` back-to-back calls (launch-bound decode)."""
    return time_passes(lambda _: fn(), [None] * calls, DEVICE, graph=True).median_us


def layout(t, e, k, bm, dev):
    ids = torch.rand(t, e, device=dev).argsort(-1)[:, :k].to(torch.int32)
    return ids, ref.moe_align(ids, None, e, bm)


def main():
    dev = DEVICE
    torch.manual_seed(0)
    copy_gbps = measure_roofline(dev).copy_gbps
    print(f"copy 2x1 GiB (perf.runner.measure_roofline): {copy_gbps:.0f} GB/s")

    # verify on a small shape first
    ids, lay = layout(37, 64, 4, 16, dev)
    eo = torch.randn(lay[0].numel(), 200, device=dev, dtype=torch.bfloat16)
    w = torch.rand(37, 4, device=dev)
    want = ref.moe_combine(eo, lay[6], w, None, torch.bfloat16)
    assert torch.equal(tri.moe_combine(eo, lay[6], w, None, torch.bfloat16).view(torch.int16),
                       want.view(torch.int16)), "combine differs from the reference"
    x = torch.randn(37, 200, device=dev, dtype=torch.bfloat16)
    for tile in (None, (8, 256, 4)):
        assert torch.equal(tri.moe_gather(x, lay[0], 4, tile=tile), ref.moe_gather(x, lay[0], 4)), tile
    for fn, arg in ((tri.moe_align, 128), (tri.moe_masked_layout, 64)):
        ids64 = torch.rand(64, 256, device=dev).argsort(-1)[:, :8].to(torch.int32)
        a, b = fn(ids64, None, 256, arg, path="single"), fn(ids64, None, 256, arg, path="general")
        assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True)), fn.__name__
    print("verified: combine bytes == reference, gather tiles, align paths agree")

    for model, (hidden, e, k) in {"dsv4": (7168, 256, 8), "gpt-oss": (2880, 128, 4)}.items():
        for t in (8192, 32768):
            ids, lay = layout(t, e, k, 128, dev)
            cap = lay[0].numel()
            eo = torch.randn(cap, hidden, device=dev, dtype=torch.bfloat16)
            w = torch.rand(t, k, device=dev)
            cb = t * k * hidden * 2 + t * hidden * 2 + t * k * 8
            for name, fn in (("combine 1x1024 nofma", lambda: tri.moe_combine(eo, lay[6], w, None, torch.bfloat16)),
                             ("combine 1x2048 nofma", lambda: tri.moe_combine(eo, lay[6], w, None, torch.bfloat16,
                                                                                block_n=2048))):
                us = bench(fn)
                print(f"{model} T={t} {name}: {us:.1f} us {cb / us / 1e3:.0f} GB/s "
                      f"({cb / us / 1e3 / copy_gbps:.2f} of copy)")
            eo = None  # free before the gather buffers
            x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
            gb = t * k * hidden * 2 + cap * hidden * 2 + cap * 4
            for tile in (None, (8, 1024, 8), (4, 1024, 4), (2, 1024, 2)):
                us = bench(lambda tile=tile: tri.moe_gather(x, lay[0], k, tile=tile))
                print(f"{model} T={t} gather tile={tile or 'default'}: {us:.1f} us {gb / us / 1e3:.0f} GB/s "
                      f"({gb / us / 1e3 / copy_gbps:.2f} of copy)")
            x = None
    for t in (1, 16, 64):
        ids = torch.rand(t, 256, device=dev).argsort(-1)[:, :8].to(torch.int32)
        for path in ("single", "general"):
            a = graph_us(lambda path=path: tri.moe_align(ids, None, 256, 128, path=path))
            m = graph_us(lambda path=path: tri.moe_masked_layout(ids, None, 256, 64, path=path))
            print(f"decode T={t} E=256 k=8 align bm=128 {path}: {a:.2f} us/call (graph); masked max_m=64: {m:.2f} us")
        eo = torch.randn(ref.contiguous_capacity(t * 8, 256, 128), 7168, device=dev, dtype=torch.bfloat16)
        _, lay = layout(t, 256, 8, 128, dev)
        w = torch.rand(t, 8, device=dev)
        print(f"decode T={t} combine N=7168: "
              f"{graph_us(lambda: tri.moe_combine(eo, lay[6], w, None, torch.bfloat16)):.2f} us (graph)")


if __name__ == "__main__":
    main()
