"""GPU probe: MoE combine (new one-token tiles, fp fusion off) vs the previous [4, 1024] tile kernel, gather tile
choices, and the align single-launch vs three-launch paths at decode. Bare launchers, CUDA events, < 40 s.

Run: PYTHONPATH=$PWD python perf/probes/moe_variants.py   (prints one line per variant: us and GB/s)
Verifies bytes against the reference on a small shape first.
"""

# ruff: noqa: B023  (every lambda below is called within its loop iteration)
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dispatch.reference import moe as ref
from triton_ops import moe_align as tri


@triton.jit
def _combine_old(eo_ptr, inv_ptr, w_ptr, out_ptr, T, N, stride_eo, K: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The kernel before session 2 (no shared input, bf16 out): [BLOCK_T, BLOCK_N] tiles, FMA contraction on."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = toks < T
    cmask = (cols < N)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + toks * K + j, mask=tmask, other=-1)
        ok = r >= 0
        w = tl.where(ok, tl.load(w_ptr + toks * K + j, mask=tmask, other=0.0).to(tl.float32), 0.0)
        v = tl.load(eo_ptr + r.to(tl.int64)[:, None] * stride_eo + cols[None, :], mask=ok[:, None] & cmask,
                    other=0.0).to(tl.float32)
        acc += w[:, None] * v
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * N + cols[None, :], acc.to(tl.bfloat16),
             mask=tmask[:, None] & cmask)


def combine_old(eo, inv, w):
    t, k = inv.shape
    n = eo.shape[1]
    out = torch.empty(t, n, dtype=torch.bfloat16, device=eo.device)
    bn = min(triton.next_power_of_2(n), 1024)
    br = max(1, min(triton.next_power_of_2(t), 4096 // bn))
    _combine_old[(triton.cdiv(t, br), triton.cdiv(n, bn))](eo, inv, w, out, t, n, eo.stride(0), K=k, BLOCK_T=br,
                                                          BLOCK_N=bn, num_warps=4)
    return out


def bench(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_us(fn, calls=200):
    """Per-call GPU time of `fn` replayed in a CUDA graph of `calls` back-to-back calls (launch-bound decode)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return bench(g.replay, 5) / calls


def layout(t, e, k, bm, dev):
    ids = torch.rand(t, e, device=dev).argsort(-1)[:, :k].to(torch.int32)
    return ids, ref.moe_align(ids, None, e, bm)


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    copy_src = torch.empty(1 << 29, dtype=torch.bfloat16, device=dev)
    copy_dst = torch.empty_like(copy_src)
    cu = bench(lambda: copy_dst.copy_(copy_src))
    copy_gbps = 2 * copy_src.numel() * 2 / cu / 1e3
    print(f"copy 2x1 GiB: {cu:.0f} us {copy_gbps:.0f} GB/s")

    # verify on a small shape first
    ids, lay = layout(37, 64, 4, 16, dev)
    eo = torch.randn(lay[0].numel(), 200, device=dev, dtype=torch.bfloat16)
    w = torch.rand(37, 4, device=dev)
    want = ref.moe_combine(eo, lay[6], w, None, torch.bfloat16)
    assert torch.equal(tri.moe_combine(eo, lay[6], w, None, torch.bfloat16).view(torch.int16),
                       want.view(torch.int16)), "new combine differs from the reference"
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
            for name, fn in (("combine old [4,1024] fma", lambda: combine_old(eo, lay[6], w)),
                             ("combine new 1x1024 nofma", lambda: tri.moe_combine(eo, lay[6], w, None, torch.bfloat16)),
                             ("combine new 1x2048 nofma", lambda: tri.moe_combine(eo, lay[6], w, None, torch.bfloat16,
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
        print(f"decode T={t} combine N=7168 old: {graph_us(lambda: combine_old(eo, lay[6], w)):.2f} us, new: "
              f"{graph_us(lambda: tri.moe_combine(eo, lay[6], w, None, torch.bfloat16)):.2f} us (graph)")


if __name__ == "__main__":
    main()
