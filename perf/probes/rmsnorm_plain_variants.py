"""GPU probe (session 6): plain RMSNorm (bf16 out) and RMSNorm -> FP8 group-128 (Triton) configs, against Liger.

Variants are RowConfig(block_m, block_n, num_warps, row_blocks) of triton_ops/rmsnorm._rms_norm_kernel; "default"
is pick_row_config's choice. Liger's rms_norm (and fused_add_rms_norm with a residual) runs in the same process.
First checks bytes: every variant == the torch reference (y and the new residual) on small shapes, including a
-0.0 weight and zero / huge rows; then times each (triton.testing.do_bench, median; inputs far larger than L2) and
prints one line per variant: us, GB/s, fraction of a torch copy measured here. `--out FILE.json` writes records.
Run: python perf/probes/rmsnorm_plain_variants.py [--out probe.json]   (~30 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import perf.peers  # noqa: E402
from dispatch.reference import rmsnorm as rref  # noqa: E402
from perf.probes._common import VariantTimer, outputs_equal, probe_start  # noqa: E402
from triton_ops import rmsnorm as R  # noqa: E402


def variants(rows, n, dev):
    block_n = triton.next_power_of_2(n)
    out = {"default": {}}
    for nw in (4, 8, 16):
        if block_n // (32 * nw) < 4 or block_n // (32 * nw) > 64:
            continue
        for rb in (1, 2, 4):
            out[f"w{nw}-rb{rb}"] = dict(cfg=R.RowConfig(1, block_n, nw, rb))
    return out


def call(x, w, res, fp8=False, **kw):
    if fp8:
        return R._rms_norm(x, w, res, 1e-6, 0.0, fmt=R.FMT_FP8, group=128, **kw)
    return R._rms_norm(x, w, res, 1e-6, 0.0, fmt=R.FMT_NONE, **kw)


def verify(dev):
    ok = True
    torch.manual_seed(0)
    for rows, n in ((257, 4096), (33, 7168), (65, 2880)):
        x = (torch.randn(rows, n, device=dev) * 3).bfloat16()
        x[0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 65504.0, -3.0, 1e-3])
        x[1] = 0.0
        x[2] = 3e38
        w = (1 + 0.2 * torch.randn(n, device=dev)).bfloat16()
        w[:3] = torch.tensor([-0.0, 0.0, -1.0])
        res = torch.randn(rows, n, device=dev).bfloat16()
        for r in (None, res):
            for fp8 in (False, True) if n % 128 == 0 else (False,):
                want = rref.rms_norm_quant(x.cpu(), w.cpu(), 1e-6, None if r is None else r.cpu(), 0.0,
                                           "fp8_group" if fp8 else "none", group_size=128)
                for name, v in variants(rows, n, dev).items():
                    ok &= outputs_equal(call(x, w, r, fp8, **v), want,
                                        f"{rows}x{n} res={r is not None} fp8={fp8} {name}")
    print("verify:", "OK" if ok else "FAILED")
    return ok


def main():
    out, dev = probe_start()
    ok = verify(dev)
    timer = VariantTimer(dev, rep=300)
    liger = perf.peers.liger_rms_norm()
    liger_add = perf.peers.liger_fused_add_rms_norm()

    def run(case, name, fn, nbytes):
        timer.time(f"{case:34s} {name:10s}", fn, nbytes, op="rms_norm", case=case, variant=name)

    for rows, n in ((32768, 4096), (4096, 7168), (16384, 2880)):
        x = torch.randn(rows, n, device=dev).bfloat16()
        w = (1 + 0.2 * torch.randn(n, device=dev)).bfloat16()
        res = torch.randn(rows, n, device=dev).bfloat16()
        for r in (None, res):
            case = f"M={rows} N={n} bf16" + (" +residual" if r is not None else "")
            nbytes = rows * n * 2 * (2 if r is None else 4) + 2 * n
            if r is None and liger is not None:
                run(case, "liger", lambda x=x, w=w: liger(x, w, 1e-6), nbytes)
            if r is not None and liger_add is not None:
                # Liger writes x + residual back into residual: give it its own copies
                xl, rl = x.clone(), r.clone()
                run(case, "liger", lambda xl=xl, rl=rl, w=w: liger_add(xl, rl, w, 1e-6), nbytes)
            for name, v in variants(rows, n, dev).items():
                run(case, name, lambda v=v, x=x, w=w, r=r: call(x, w, r, **v), nbytes)
            if n % 128 == 0:  # RMSNorm -> FP8 g128: codes (1 B) + fp32 scales instead of y (2 B)
                fbytes = nbytes - rows * n + rows * n // 32
                for name, v in variants(rows, n, dev).items():
                    run(case.replace("bf16", "bf16 -> fp8 g128"), name,
                        lambda v=v, x=x, w=w, r=r: call(x, w, r, True, **v), fbytes)
    timer.write(out, ok)


if __name__ == "__main__":
    main()
