"""GPU probe (session 9): SwiGLU -> MXFP4 / NVFP4 with one quant block per thread (_swiglu_fp4_kernel) against
the [BM, N]-layout kernel (_swiglu_kernel), bare launchers.

Bytes of every blocked variant must equal the old kernel's (same math, another layout), checked first on small
shapes for each input layout (concatenated, g = 1 GPT-OSS, g = 8 chunks); then each is timed
(triton.testing.do_bench, median) at M=16384, I=4096 and I=2880 and printed with its fraction of a torch copy
measured here.
Run: PYTHONPATH=$PWD python perf/probes/swiglu_fp4_blocked.py [--out OUT.json]   (~40 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.probes._common import VariantTimer, outputs_equal, probe_start  # noqa: E402
from triton_ops import rmsnorm as R  # noqa: E402
from triton_ops import swiglu as S  # noqa: E402

# kind -> (interleave, activation, limit, format, per-expert global scales)
KINDS = {
    "mx_gptoss_g1": (1, "gptoss", 7.0, R.FMT_MX, False),
    "mx_silu_cat": (0, "silu", None, R.FMT_MX, False),
    "nv_gptoss_g1_gs": (1, "gptoss", 7.0, R.FMT_NV, False),
    "nv_moe_g8": (8, "silu", 7.0, R.FMT_NV, True),
}
# (block_m, block_n, warps, C innermost) of the blocked kernel; "old" = _swiglu_kernel
VARIANTS = {
    R.FMT_MX: ["old", (1, 2048, 2, True), (1, 2048, 2, False), (2, 1024, 2, True), (1, 1024, 1, True),
               (2, 2048, 4, True), (4, 512, 2, True)],
    R.FMT_NV: ["old", (1, 2048, 4, True), (1, 2048, 4, False), (1, 1024, 2, True), (2, 1024, 4, True),
               (1, 2048, 2, True), (1, 1024, 1, True)],
}


def _name(v):
    return v if isinstance(v, str) else f"blocked {v[0]}x{v[1]}w{v[2]} {'c-inner' if v[3] else 'c-outer'}"


def call(kind, x, ids, gs, variant):
    interleave, act, limit, fmt, moe = KINDS[kind]
    kw = dict(fmt=fmt, swizzle=True)
    if fmt == R.FMT_NV:
        kw["global_scale"] = gs if moe else gs[:1].reshape(())
    if variant == "old":
        kw["fp4_blocked"] = False
    else:
        kw["fp4_cfg"] = S.SwigluConfig(*variant[:3])
        kw["fp4_c_inner"] = variant[3]
    return S._swiglu(x, interleave, act, 1.702, limit, ids if moe else None, None, None, **kw)


def main():
    out, dev = probe_start()
    ok = True
    for rows, i in ((129, 4096), (64, 2880), (300, 1024)):
        x = (torch.randn(rows, 2 * i, device=dev) * 2).bfloat16()
        ids = (torch.arange(rows, device=dev, dtype=torch.int32) % 9) - 1
        gs = torch.full((8,), 0.004, device=dev)
        for kind, (_, _, _, fmt, _) in KINDS.items():
            ref = call(kind, x, ids, gs, "old")
            for v in VARIANTS[fmt][1:]:
                ok &= outputs_equal(call(kind, x, ids, gs, v), ref, f"{kind} {rows}x{i} {_name(v)}")
    print("verify:", "OK" if ok else "FAILED")
    timer = VariantTimer(dev)
    for rows, i in ((16384, 4096), (16384, 2880)):
        x = torch.randn(rows, 2 * i, device=dev).bfloat16()
        ids = torch.randint(-1, 8, (rows,), device=dev, dtype=torch.int32).sort().values
        gs = torch.full((8,), 0.004, device=dev)
        for kind, (_, _, _, fmt, _) in KINDS.items():
            block = 32 if fmt == R.FMT_MX else 16
            nbytes = 4 * rows * i + rows * i // 2 + rows * i // block
            for v in VARIANTS[fmt]:
                timer.time(f"swiglu {kind:16s} M={rows} I={i} {_name(v):22s}",
                           lambda v=v, kind=kind, x=x, ids=ids, gs=gs: call(kind, x, ids, gs, v), nbytes,
                           kind=kind, M=rows, I=i, variant=_name(v))
    timer.write(out, ok)


if __name__ == "__main__":
    main()
