"""GPU probe (session 6): SwiGLU tile configs (block_m x block_n x warps) for the plain, FP8 g128, MXFP4 and MoE
NVFP4 outputs, bare launchers.

The RMSNorm probe of this session found its prefetching 8-warp tiles slower than one block of ~32 elements per
thread; this asks the same of SwiGLU's 4096-output 8-warp tiles (16 per thread). Bytes of every variant must
equal the default config's (same per-element math, other tiles), checked first on small shapes; then each is timed
(triton.testing.do_bench, median) at M=16384, I=4096 and printed with its fraction of a torch copy measured here.
Run: PYTHONPATH=$PWD python perf/probes/swiglu_variants.py [--out OUT.json]   (~40 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.probes._common import VariantTimer, outputs_equal, probe_start  # noqa: E402
from triton_ops import rmsnorm as R  # noqa: E402
from triton_ops import swiglu as S  # noqa: E402

CONFIGS = [None, (4, 1024, 8), (4, 1024, 4), (2, 1024, 4), (2, 2048, 8), (1, 4096, 8), (1, 2048, 4), (1, 1024, 2),
           (1, 1024, 4), (8, 512, 8), (2, 1024, 2), (1, 2048, 2), (1, 2048, 8), (1, 4096, 4)]


def _name(c):
    return "default" if c is None else f"{c[0]}x{c[1]}w{c[2]}"


def call(kind, x, ids, gs, cfg):
    kw = {} if cfg is None else dict(cfg=S.SwigluConfig(*cfg))
    if kind == "plain":
        return (S._swiglu(x, 0, "silu", 1.702, None, None, None, None, fmt=R.FMT_NONE, **kw),)
    if kind == "fp8":
        return S._swiglu(x, 1, "gptoss", 1.702, 7.0, None, None, None, fmt=R.FMT_FP8, group=128, **kw)
    if kind == "mx":
        return S._swiglu(x, 1, "gptoss", 1.702, 7.0, None, None, None, fmt=R.FMT_MX, swizzle=True, **kw)
    return S._swiglu(x, 8, "silu", 1.702, 7.0, ids, None, None, fmt=R.FMT_NV, swizzle=True, global_scale=gs, **kw)


def main():
    out, dev = probe_start()
    ok = True
    for rows, i in ((129, 4096), (64, 2880)):
        x = (torch.randn(rows, 2 * i, device=dev) * 2).bfloat16()
        ids = (torch.arange(rows, device=dev, dtype=torch.int32) % 9) - 1
        gs = torch.full((8,), 0.004, device=dev)
        for kind in ("plain", "fp8", "mx", "nv"):
            ref = call(kind, x, ids, gs, None)
            for c in CONFIGS[1:]:
                if c[1] > triton.next_power_of_2(i):
                    continue
                ok &= outputs_equal(call(kind, x, ids, gs, c), ref, f"{kind} {rows}x{i} {_name(c)}")
    print("verify:", "OK" if ok else "FAILED")
    timer = VariantTimer(dev)
    for rows, i, kinds in ((16384, 4096, ("plain", "fp8", "mx", "nv")), (16384, 2880, ("fp8", "mx"))):
        x = torch.randn(rows, 2 * i, device=dev).bfloat16()
        ids = torch.randint(-1, 8, (rows,), device=dev, dtype=torch.int32).sort().values
        gs = torch.full((8,), 0.004, device=dev)
        out_bytes = {"plain": 2 * rows * i, "fp8": rows * i + rows * i // 32, "mx": rows * i // 2 + rows * i // 32,
                     "nv": rows * i // 2 + rows * i // 16}
        for kind in kinds:
            nbytes = 4 * rows * i + out_bytes[kind]
            for c in CONFIGS:
                timer.time(f"swiglu {kind:6s} M={rows} I={i} {_name(c):10s}",
                           lambda c=c, kind=kind, x=x, ids=ids, gs=gs: call(kind, x, ids, gs, c), nbytes,
                           kind=kind, M=rows, I=i, variant=_name(c))
    timer.write(out, ok)


if __name__ == "__main__":
    main()
