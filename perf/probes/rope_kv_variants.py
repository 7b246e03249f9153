"""GPU probe: session-1 ("old", perf/probes/_rope_kv_old.py) vs current ("new", triton_ops/rope.py and
triton_ops/kv_cache.py) RoPE / DeepSeek KV-cache kernels, bare launchers (no dispatch), CUDA-event GPU time.

    python -m perf.probes.rope_kv_variants          # < 40 s on an H200

First checks every variant's bytes against the torch reference on small shapes (a mismatch aborts), then
prints one line per (case, variant): median us, GB/s (bytes model of perf/cases/rope_kv.py) and the fraction
of the 4224 GB/s copy roof. Decode rows (T=64) are timed under CUDA-graph replay (20 launches per graph).
"""

from __future__ import annotations

import statistics
import sys
from functools import partial

import torch

import perf.probes._rope_kv_old as old
from dispatch.reference import kv_cache as kref
from dispatch.reference import rope as rref
from triton_ops import kv_cache as new_kv
from triton_ops import rope as new_rope

ROOF = 4224.0  # GB/s, H200 copy roof (perf/NOTES.md)


def _equal_bytes(a, b, what):
    a, b = a.detach(), b.detach()
    if a.dtype.is_floating_point and a.element_size() in (2, 4):
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        nan = torch.isnan(a.float()) & torch.isnan(b.float())
        a, b = torch.where(nan, 0, a.view(ints)), torch.where(nan, 0, b.view(ints))
    else:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    bad = int((a != b).sum())
    if bad:
        sys.exit(f"VERIFY FAILED: {what}: {bad} elements differ")


def verify(dev):
    g = torch.Generator(device=dev).manual_seed(0)
    t = 37
    for mod, name in ((old, "old"), (new_rope, "new")):
        for neox, d, rot, off, inv in ((True, 128, 128, 0, False), (False, 512, 64, 448, True),
                                       (False, 96, 32, 16, False)):
            qkv = torch.randn(t, 12, d, device=dev, generator=g, dtype=torch.bfloat16)
            q, k = qkv[:, :8], qkv[:, 8:10]
            pos = torch.randint(0, 500, (t,), device=dev, generator=g)
            cs = rref.rope_cos_sin_cache(500, rot, device=dev)
            got = mod.rope(q, k, pos, cs, off, neox, inv)
            want = rref.rope(q, k, pos, cs, off, neox, inv)
            for x, y in zip(got, want, strict=True):
                _equal_bytes(x, y, f"{name} rope neox={neox} d={d}")
            q1, q2 = q.clone(), q.clone()
            mod.rope_(q1, None, pos, cs, off, neox, inv)
            rref.rope_(q2, None, pos, cs, off, neox, inv)
            _equal_bytes(q1, q2, f"{name} rope_ neox={neox} d={d}")
        mod_kv = old if mod is old else new_kv
        for layout in ("v32", "v4"):
            L = kref.DS_LAYOUTS[layout]
            kv = torch.randn(t, L.d, device=dev, generator=g, dtype=torch.bfloat16) * 3
            q = torch.randn(t, 20, L.d, device=dev, generator=g, dtype=torch.bfloat16)
            pos = torch.randint(0, 300, (t,), device=dev, generator=g)
            cs = rref.rope_cos_sin_cache(300, 64, device=dev)
            slots = torch.randperm(3 * 16, device=dev, generator=g)[:t]
            slots[3] = -1
            for neox in (False, True):
                c1, c2 = kref.ds_kv_cache_empty(3, 16, layout, dev), kref.ds_kv_cache_empty(3, 16, layout, dev)
                q1, q2 = q.clone(), q.clone()
                mod_kv.ds_rope_quant_append(kv, pos, cs, slots, c1, layout, q1, neox)
                kref.ds_rope_quant_append(kv, pos, cs, slots, c2, layout, q2, neox)
                _equal_bytes(c1, c2, f"{name} ds_rope_quant_append {layout} neox={neox} cache")
                _equal_bytes(q1, q2, f"{name} ds_rope_quant_append {layout} neox={neox} q")
        x = torch.randn(t, 8, 64, device=dev, generator=g, dtype=torch.bfloat16)
        slots = torch.randperm(4 * 16, device=dev, generator=g)[:t]
        c1, c2 = (torch.zeros(4, 16, 8, 64, dtype=torch.uint8, device=dev) for _ in range(2))
        s1, s2 = (torch.zeros(4, 16, 8, device=dev) for _ in range(2))
        mod_kv.paged_kv_write_fp8(x, slots, c1, None, s1)
        kref.paged_kv_write_fp8(x, slots, c2, None, s2)
        _equal_bytes(c1, c2, f"{name} paged_kv_write_fp8 codes")
        _equal_bytes(s1, s2, f"{name} paged_kv_write_fp8 scales")
    print("verify: old and new match the reference bytes")


def time_eager(fn, iters=30):
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 for a, b in ev)


def time_graph(fn, reps=20, iters=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return time_eager(graph.replay, iters) / reps


def line(case, variant, us, nbytes):
    gbps = nbytes / us / 1e3
    print(f"{case:52s} {variant:4s} {us:9.2f} us {gbps:8.0f} GB/s {gbps / ROOF:5.2f}", flush=True)


def bench(dev, t=16384):
    bf = torch.bfloat16

    # Llama NeoX out of place
    qkv = torch.randn(t, 48, 128, device=dev, dtype=bf)
    q, k = qkv[:, :32].contiguous(), qkv[:, 32:40].contiguous()
    pos = torch.randint(0, 16384, (t,), device=dev)
    cs = rref.rope_cos_sin_cache(16384, 128, device=dev)
    nb = 2 * t * 40 * 128 * 2 + t * (8 + 128 * 4)
    for name, mod in (("old", old), ("new", new_rope)):
        line(f"rope T={t} Hq=32 Hk=8 D=128 NeoX out-of-place", name,
             time_eager(partial(mod.rope, q, k, pos, cs, 0, True, False)), nb)
    # DeepSeek-V4 inverse, GPT-J, last 64 of 512, in place
    q = torch.randn(t, 64, 512, device=dev, dtype=bf)
    cs = rref.rope_cos_sin_cache(16384, 64, device=dev)
    nb = 2 * t * 64 * 64 * 2 + t * (8 + 64 * 4)
    for name, mod in (("old", old), ("new", new_rope)):
        line(f"rope_ T={t} H=64 D=512 GPT-J last-64 inverse", name,
             time_eager(partial(mod.rope_, q, None, pos, cs, 448, False, True)), nb)
    del q
    # fused DeepSeek + the plain write, both layouts
    for layout in ("v32", "v4"):
        L = kref.DS_LAYOUTS[layout]
        kv = torch.randn(t, L.d, device=dev, dtype=bf)
        q = torch.randn(t, 64, L.d, device=dev, dtype=bf)
        slots = torch.randperm(t + 64, device=dev)[:t]
        cache = kref.ds_kv_cache_empty(t // 64 + 1, 64, layout, dev)
        nb_f = t * L.d * 2 + t * L.token_bytes + 2 * t * 64 * 64 * 2 + t * 8 + t * (8 + 64 * 4)
        nb_w = t * L.d * 2 + t * L.token_bytes + t * 8
        for name, mod in (("old", old), ("new", new_kv)):
            line(f"ds_rope_quant_append T={t} Hq=64 {layout}", name,
                 time_eager(partial(mod.ds_rope_quant_append, kv, pos, cs, slots, cache, layout, q, False)),
                 nb_f)
        for name, mod in (("old", old), ("new", new_kv)):
            line(f"ds_kv_write T={t} {layout}", name,
                 time_eager(partial(mod.ds_kv_write, kv, slots, cache, layout)), nb_w)
        # decode: T=64, Hq=16, CUDA-graph replay
        td = 64
        kvd, qd, sd, pd = kv[:td].clone(), q[:td, :16].clone(), slots[:td].clone(), pos[:td].clone()
        nb_d = td * L.d * 2 + td * L.token_bytes + 2 * td * 16 * 64 * 2 + td * 8 + td * (8 + 64 * 4)
        for name, mod in (("old", old), ("new", new_kv)):
            line(f"ds_rope_quant_append T=64 Hq=16 {layout} (graph)", name,
                 time_graph(partial(mod.ds_rope_quant_append, kvd, pd, cs, sd, cache, layout, qd, False)), nb_d)
        del kv, q, cache
    # generic paged write, GPT-OSS kv heads
    for tt in (t, 64):
        x = torch.randn(tt, 8, 64, device=dev, dtype=bf)
        nblk = tt // 16 + 1
        slots = torch.randperm(nblk * 16, device=dev)[:tt]
        cache = torch.zeros(nblk, 16, 8, 64, dtype=torch.uint8, device=dev)
        sc = torch.zeros(nblk, 16, 8, device=dev)
        nb = tt * 8 * 64 * 3 + tt * 8 * 4 + tt * 8
        timer = time_eager if tt > 64 else time_graph
        for name, mod in (("old", old), ("new", new_kv)):
            line(f"paged_kv_write_fp8 T={tt} H=8 D=64 dynamic" + (" (graph)" if tt == 64 else ""), name,
                 timer(partial(mod.paged_kv_write_fp8, x, slots, cache, None, sc)), nb)


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    verify(dev)
    bench(dev)


if __name__ == "__main__":
    main()
