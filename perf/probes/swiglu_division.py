"""GPU probe (session 8): SwiGLU's silu division, exact (div.rn) or div.full.f32, and the computed-global-scale
NVFP4 path (two fused passes, or the float output with its amax and then the NVFP4 quantizer).

1. Accuracy of the float output (bf16) against a float64 evaluation of the same formula rounded once to bf16,
   for both divisions, on normal and heavy-tailed inputs: fraction of outputs that differ and the largest
   difference in bf16 ulps (the contract: <= 1 ulp, docs/norm_act.md).
2. Bytes: every quantized output equals the NVFP4/MXFP4/FP8 quantizer applied to the same division's float
   output (the contract the GPU tests also assert), and the two computed-gs paths give the same bytes.
3. Time (triton.testing.do_bench, median, bare launchers) at M=16384, I=4096 and I=2880 against a copy roof.
Run: PYTHONPATH=$PWD python perf/probes/swiglu_division.py [--out OUT.json]   (~40 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from perf.probes._common import VariantTimer, outputs_equal, probe_start  # noqa: E402
from triton_ops import quant_fp4 as Q4  # noqa: E402
from triton_ops import quant_fp8 as Q8  # noqa: E402
from triton_ops import rmsnorm as R  # noqa: E402
from triton_ops import swiglu as S  # noqa: E402

GPT = dict(interleave=1, activation="gptoss", alpha=1.702, limit=7.0)


def call(kind, x, ids, gs):
    a = (x, GPT["interleave"], GPT["activation"], GPT["alpha"], GPT["limit"], None, None, None)
    if kind == "plain":
        return (S._swiglu(*a, fmt=R.FMT_NONE),)
    if kind == "fp8":
        return S._swiglu(*a, fmt=R.FMT_FP8, group=128)
    if kind == "mx":
        return S._swiglu(*a, fmt=R.FMT_MX, swizzle=True)
    if kind == "nv-computed":
        return S._swiglu(*a, fmt=R.FMT_NV, swizzle=True)
    return S._swiglu(x, 8, "silu", 1.702, 7.0, ids, None, None, fmt=R.FMT_NV, swizzle=True, global_scale=gs)


def reference_y(x):
    """GPT-OSS swiglu of even/odd x in float64, rounded once to bf16."""
    g, u = x[:, 0::2].double().clamp(max=7.0), x[:, 1::2].double().clamp(-7.0, 7.0)
    return (g / (1.0 + torch.exp(-1.702 * g)) * (u + 1.0)).bfloat16()


def ulp_stats(y, want):
    """(fraction of outputs that differ, max difference in bf16 ulps) where the float64 value is >= 2^-100 in
    magnitude: below that the fp32 formula itself underflows (1 + e^-g overflows fp32 for g < -52 at alpha 1.702,
    so y is 0 where float64 still has ~1e-36), on every backend alike."""
    keep = want.float().abs() >= 2.0**-100
    a, b = y[keep].view(torch.int16).int(), want[keep].view(torch.int16).int()
    # bf16 bits -> a monotone integer line (negative values mirrored), so ulp distance is a difference
    a = torch.where(a < 0, -(a & 0x7FFF), a)
    b = torch.where(b < 0, -(b & 0x7FFF), b)
    d = (a - b).abs()
    return (d > 0).float().mean().item(), d.max().item()


def main():
    out, dev = probe_start()
    ok = True
    defaults = S.SILU_DIV_RN, S.NVFP4_COMPUTED_GS_SPLIT_ROWS
    modes = (("div_rn", True), ("div_full", False))
    for dist in ("normal", "heavy"):
        x = torch.randn(4096, 8192, device=dev) * 3
        if dist == "heavy":
            x = x * torch.exp(torch.randn_like(x) * 2)
        x = x.bfloat16()
        want = reference_y(x)
        for name, rn in modes:
            S.SILU_DIV_RN = rn
            frac, worst = ulp_stats(S._swiglu(x, **GPT, expert_ids=None, masked_m=None, out_dtype=None,
                                              fmt=R.FMT_NONE), want)
            print(f"accuracy {dist:6s} {name:8s}: {frac:.2e} of outputs differ from float64, max {worst} ulp")
            ok &= worst <= 1
    # bytes: quantized outputs == quantizer(own float output), for both divisions; split == fused computed gs
    x = (torch.randn(2304, 2 * 2880, device=dev) * 3).bfloat16()
    ids = torch.randint(-1, 8, (2304,), device=dev, dtype=torch.int32).sort().values
    gs = torch.full((8,), 0.004, device=dev)
    for name, rn in modes:
        S.SILU_DIV_RN = rn
        y = call("plain", x, ids, gs)[0]
        ok &= outputs_equal(call("fp8", x, ids, gs), Q8.fp8_group_quantize(y, 128, 1e-10, False, False),
                            f"fp8 {name}")
        ok &= outputs_equal(call("mx", x, ids, gs), Q4.mxfp4_quantize(y, "floor", True), f"mx {name}")
        split = call("nv-computed", x, ids, gs)
        ok &= outputs_equal(split, Q4.nvfp4_quantize(y, None, True), f"nv computed split {name}")
        S.NVFP4_COMPUTED_GS_SPLIT_ROWS = 1 << 40
        ok &= outputs_equal(call("nv-computed", x, ids, gs), split, f"nv computed fused vs split {name}")
        S.NVFP4_COMPUTED_GS_SPLIT_ROWS = defaults[1]
    print("verify:", "OK" if ok else "FAILED")
    timer = VariantTimer(dev)
    for rows, i in ((16384, 4096), (16384, 2880)):
        x = torch.randn(rows, 2 * i, device=dev).bfloat16()
        ids = torch.randint(-1, 8, (rows,), device=dev, dtype=torch.int32).sort().values
        gs = torch.full((8,), 0.004, device=dev)
        out_bytes = {"plain": 2 * rows * i, "fp8": rows * i + rows * i // 32, "mx": rows * i // 2 + rows * i // 32,
                     "nv-computed": rows * i // 2 + rows * i // 16, "nv-moe": rows * i // 2 + rows * i // 16}
        for kind in ("plain", "fp8", "mx", "nv-computed", "nv-moe"):
            for name, rn in modes:
                splits = (((" split", defaults[1]), (" fused", 1 << 40)) if kind == "nv-computed"
                          else (("", defaults[1]),))
                for tag, threshold in splits:
                    S.SILU_DIV_RN, S.NVFP4_COMPUTED_GS_SPLIT_ROWS = rn, threshold
                    timer.time(f"swiglu {kind:11s}{tag:6s} M={rows} I={i} {name:8s}",
                               lambda kind=kind, x=x, ids=ids, gs=gs: call(kind, x, ids, gs),
                               4 * rows * i + out_bytes[kind], kind=kind + tag, M=rows, I=i, variant=name)
    S.SILU_DIV_RN, S.NVFP4_COMPUTED_GS_SPLIT_ROWS = defaults
    timer.write(out, ok)


if __name__ == "__main__":
    main()
