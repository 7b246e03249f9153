"""GPU probe (sessions 4-5, issue 5): the copy bandwidth of the access pattern DeepSeek's RoPE ops are held to.

rope_ (DeepSeek-V4: rotate the last 64 of 512 dims per head, in place) and ds_rope_quant_append's q part touch
one 128-byte run per 1024-byte head row. Their roofline fraction is computed against a dense copy; this probe
measures what the memory system gives for exactly that pattern, so the kernels' 0.74-0.76 can be read against it.

Session 4 timed torch's strided copy (0.40 of copy) and in-place update (0.33): poor elementwise kernels, not a
bound. Session 5 adds minimal Triton kernels that read and write back in place one run per row (no math, the
same bits) over T=16384 x 64 rows, swept over
- rows per program x warps (= 16-byte vectors in flight per thread: rows * RUN * 2 / 16 / (32 * warps)),
- a persistent, software-pipelined loop (the next tile's loads issued before this tile's stores),
- the same loop pipelined by Triton (tl.range num_stages; cp.async where the compiler does it),
- eviction hints (evict_first on the streamed loads and stores),
- and, for calibration, the same kernel on dense rows (run = row: the whole tensor is runs) and 256-byte runs
  (the last 128 of 512 dims).
The best in-place 128-byte-run line is the pattern's practical ceiling for rope_ / the fused q RoPE; a kernel
reaching ~that fraction is done, whatever the dense-copy fraction says.

Run: PYTHONPATH=$PWD python perf/probes/strided_roof.py [--out OUT.json] [--quick]   (~25 s, mostly compiles)
CUDA-graph replay (perf.runner.time_passes), 60 samples per line; the 1 GiB tensor is > 5x L2 so every call is
cold. Every Triton variant is checked (bytes unchanged, nothing outside the runs touched) on a small tensor first.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from perf.runner import measure_roofline, time_passes

DEV = torch.device("cuda")
T, H, D = 16384, 64, 512


@triton.jit
def _runs_kernel(x_ptr, n_rows, STRIDE: tl.constexpr, OFF: tl.constexpr, RUN: tl.constexpr, BLOCK_R: tl.constexpr,
                 EVICT: tl.constexpr):
    """Program p reads rows [p*BLOCK_R, +BLOCK_R) x elements [OFF, OFF+RUN) (row stride STRIDE elements) and
    writes the same bits back in place: the RoPE pattern without the math. All loads before any store."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.arange(0, RUN)
    p = x_ptr + (r * STRIDE + OFF)[:, None] + c[None, :]
    m = (r < n_rows)[:, None]
    v = tl.load(p, mask=m, eviction_policy=EVICT)
    tl.store(p, v, mask=m, eviction_policy=EVICT)


@triton.jit
def _runs_persistent_kernel(x_ptr, n_tiles, STRIDE: tl.constexpr, OFF: tl.constexpr, RUN: tl.constexpr,
                            BLOCK_R: tl.constexpr, EVICT: tl.constexpr):
    """Persistent: program p walks tiles p, p + P, ... (P programs); the next tile's loads are issued before
    this tile's stores (one tile always in flight while the previous one drains). Rows divide n_tiles*BLOCK_R."""
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, RUN)
    offs = (r * STRIDE + OFF)[:, None] + c[None, :]
    step = npg.to(tl.int64) * (BLOCK_R * STRIDE)
    p = x_ptr + pid.to(tl.int64) * (BLOCK_R * STRIDE) + offs
    ok = (pid + r * 0 < n_tiles)[:, None]  # a tensor mask (the interpreter rejects scalar masks)
    v = tl.load(p, mask=ok, eviction_policy=EVICT)
    for it in range(pid + npg, n_tiles + npg, npg):
        pn = p + step
        okn = (it + r * 0 < n_tiles)[:, None]
        vn = tl.load(pn, mask=okn, eviction_policy=EVICT)
        tl.store(p, v, mask=ok, eviction_policy=EVICT)
        p, v, ok = pn, vn, okn


@triton.jit
def _runs_staged_kernel(x_ptr, n_tiles, STRIDE: tl.constexpr, OFF: tl.constexpr, RUN: tl.constexpr,
                        BLOCK_R: tl.constexpr, STAGES: tl.constexpr):
    """Persistent loop left to Triton's software pipeliner (tl.range num_stages)."""
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, RUN)
    offs = (r * STRIDE + OFF)[:, None] + c[None, :]
    for it in tl.range(pid, n_tiles, npg, num_stages=STAGES):
        p = x_ptr + (offs + tl.full([1, 1], it, tl.int64) * (BLOCK_R * STRIDE))
        tl.store(p, tl.load(p))


def launch(x, kind, stride, off, run, block_r, warps, evict=False, ctas_per_sm=0, stages=3):
    rows = x.numel() // stride
    policy = "evict_first" if evict else ""  # the kernels' EVICT: the loads' and stores' eviction policy
    if kind == "flat":
        _runs_kernel[(triton.cdiv(rows, block_r),)](x, rows, STRIDE=stride, OFF=off, RUN=run, BLOCK_R=block_r,
                                                    EVICT=policy, num_warps=warps)
        return
    assert rows % block_r == 0
    tiles = rows // block_r
    grid = (min(tiles, ctas_per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count),)
    if kind == "persistent":
        _runs_persistent_kernel[grid](x, tiles, STRIDE=stride, OFF=off, RUN=run, BLOCK_R=block_r, EVICT=policy,
                                      num_warps=warps)
    else:
        _runs_staged_kernel[grid](x, tiles, STRIDE=stride, OFF=off, RUN=run, BLOCK_R=block_r, STAGES=stages,
                                  num_warps=warps)


# (name, kind, run elements, rows per program, warps, evict, CTAs per SM (persistent), stages)
VARIANTS = [
    ("flat 16r 4w", "flat", 64, 16, 4, False, 0, 0),  # 1 vector of 16 B per thread
    ("flat 32r 4w", "flat", 64, 32, 4, False, 0, 0),  # 2
    ("flat 64r 4w", "flat", 64, 64, 4, False, 0, 0),  # 4
    ("flat 128r 4w", "flat", 64, 128, 4, False, 0, 0),  # 8 (rope_'s default tile: 2 tokens x 64 heads)
    ("flat 256r 4w", "flat", 64, 256, 4, False, 0, 0),  # 16
    ("flat 128r 8w", "flat", 64, 128, 8, False, 0, 0),  # 4
    ("flat 256r 8w", "flat", 64, 256, 8, False, 0, 0),  # 8
    ("flat 64r 2w", "flat", 64, 64, 2, False, 0, 0),  # 8
    ("flat 128r 4w evict_first", "flat", 64, 128, 4, True, 0, 0),
    ("persistent 64r 4w x8/SM", "persistent", 64, 64, 4, False, 8, 0),  # 4 + 4 vectors per thread
    ("persistent 128r 4w x4/SM", "persistent", 64, 128, 4, False, 4, 0),  # 8 + 8
    ("persistent 128r 8w x4/SM", "persistent", 64, 128, 8, False, 4, 0),
    ("persistent 128r 4w x4/SM evict_first", "persistent", 64, 128, 4, True, 4, 0),
    ("staged(3) 64r 4w x8/SM", "staged", 64, 64, 4, False, 8, 3),
    ("staged(4) 128r 4w x4/SM", "staged", 64, 128, 4, False, 4, 4),
]
QUICK = {"flat 64r 4w", "flat 128r 4w", "flat 256r 8w", "persistent 128r 4w x4/SM"}


def verify():
    """Every variant on a [96, 64, 512] tensor: every byte unchanged afterwards (in place, same bits; a wrong
    offset or mask would move bytes between runs or rows)."""
    x = torch.randn(96, H, D, device=DEV, dtype=torch.bfloat16)
    ref = x.clone()
    for name, kind, run, block_r, warps, evict, cps, stages in VARIANTS:
        launch(x, kind, D, D - run, run, block_r, warps, evict, cps, stages)
        torch.cuda.synchronize()
        assert torch.equal(x.view(torch.int16), ref.view(torch.int16)), f"strided_roof {name}: bytes changed"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    opts = parser.parse_args()
    roof = measure_roofline(DEV).copy_gbps
    verify()
    a = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(T, H, D, device=DEV, dtype=torch.bfloat16)
    rot = 64
    dense_src = torch.randn(T, H, rot, device=DEV, dtype=torch.bfloat16)
    dense_dst = torch.empty_like(dense_src)
    rows = []

    def line(name, fn, nbytes):
        us = time_passes(fn, [None], DEV, graph=True, budget_s=10.0).median_us  # 60 samples (GPU_SAMPLES cap)
        gbps = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(case=name, us=us, gbps=gbps, frac=gbps / roof, mb=nbytes / 1e6))
        print(f"{name:52s} {us:8.1f} us {gbps:7.0f} GB/s {gbps / roof:.3f} of copy", flush=True)

    n64 = 2 * T * H * 64 * 2  # read + write of 128-byte runs, 268 MB
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; dense copy roof {roof:.0f} GB/s "
          f"(perf.runner.measure_roofline); {n64 / 1e6:.0f} MB per call")
    line("torch dense copy of the same bytes", lambda _: dense_dst.copy_(dense_src), n64)
    if not opts.quick:
        line("torch strided copy (last 64 of 512, other tensor)",
             lambda _: b[:, :, D - rot:].copy_(a[:, :, D - rot:]), n64)
    dense = a.view(-1)[: T * H * 64]  # the same number of bytes, contiguous: calibrates the Triton kernel itself
    line("triton dense in place, flat 128r 4w (run = row)",
         lambda _: launch(dense, "flat", 64, 0, 64, 128, 4), n64)
    for name, kind, run, block_r, warps, evict, cps, stages in VARIANTS:
        if opts.quick and name not in QUICK:
            continue
        line(f"128B runs in place: {name}",
             lambda _, k=kind, r=run, br=block_r, w=warps, e=evict, c=cps, s=stages:
             launch(a, k, D, D - r, r, br, w, e, c, s), n64)
    n128 = 2 * T * H * 128 * 2
    for block_r, warps in ((64, 4), (128, 8)):  # 256-byte runs (calibration only)
        line(f"256B runs in place: flat {block_r}r {warps}w",
             lambda _, br=block_r, w=warps: launch(a, "flat", D, D - 128, 128, br, w), n128)
    roof_end = measure_roofline(DEV).copy_gbps
    print(f"copy roof re-measured at the end: {roof_end:.0f} GB/s (fractions above use {roof:.0f})")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           copy_gbps=roof, copy_gbps_end=roof_end, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
