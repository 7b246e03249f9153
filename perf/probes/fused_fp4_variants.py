"""GPU probe (session 4): fused RMSNorm / SwiGLU -> FP4, old vs new kernels and configs, bare launchers.

RMSNorm: "pairs-wN" = the pair-word kernel _rms_norm_pairs_kernel at N warps (2 is the default at 4096 columns since
the first H200 run of this probe); "chunk-wNxB" (session 5) = the two-pass _rms_norm_chunked_kernel, one row per
program at N warps in chunks of B columns (given global scale and MXFP4 only).
SwiGLU: the element-wise epilogue at its default 8 warps vs 4 (a pair-word SwiGLU epilogue measured no faster and
was dropped; perf/NOTES.md "Session 4: fused FP4").
First checks bytes: every variant == the torch reference on small shapes (and old == new on the big ones), then times
each variant (triton.testing.do_bench, median of >= 50 reps; inputs are far larger than L2) and prints one line per
variant: us, GB/s, fraction of a torch copy measured here. `--out FILE.json` writes the records.
Run: python perf/probes/fused_fp4_variants.py [--out probe.json]   (~30-50 s, mostly compiles)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch.reference import rmsnorm as rref  # noqa: E402
from perf.probes._common import VariantTimer, outputs_equal, probe_start  # noqa: E402
from triton_ops import rmsnorm as R  # noqa: E402
from triton_ops import swiglu as S  # noqa: E402


def rms_variants(rows, n, dev):
    out = {}
    for nw in (2, 4):
        cfg = R.RowConfig(1, triton.next_power_of_2(n), nw, 4 if rows >= 8192 else 2)
        out[f"pairs-w{nw}"] = dict(pairs=True, cfg=cfg)
    # session 5: the two-pass chunked kernel (one row per program, one chunk of columns live at a time)
    for nw, bn in ((1, 1024), (2, 1024), (2, 2048), (4, 1024), (4, 2048)):
        chunks = triton.cdiv(triton.cdiv(n, 128) * 128, bn)
        out[f"chunk-w{nw}x{bn}"] = dict(pairs=True, cfg=R.RowConfig(1, bn, nw, 1, chunks))
    for nw in (2, 4):  # with a residual: pass 2 reads the stored h back
        chunks = triton.cdiv(triton.cdiv(n, 128) * 128, 2048)
        out[f"chunkh-w{nw}x2048"] = dict(pairs=True, cfg=R.RowConfig(1, 2048, nw, 1, chunks, reread_h=True))
    return out


def sw_variants(rows, i, dev):
    return {"old": {}, "w4": dict(cfg=S.SwigluConfig(4, 1024, 4))}


def rms_call(fmt, x, w, res, gs, **kw):
    return R._rms_norm(x, w, res, 1e-6, 0.0, fmt=fmt, swizzle=True, global_scale=gs, **kw)


def sw_call(kind, x, ids, gs, **kw):
    if kind == "mx":
        return S._swiglu(x, 1, "gptoss", 1.702, 7.0, None, None, None, fmt=R.FMT_MX, swizzle=True, **kw)
    return S._swiglu(x, 8, "silu", 1.702, 7.0, ids, None, None, fmt=R.FMT_NV, swizzle=True, global_scale=gs, **kw)


def verify(dev):
    ok = True
    torch.manual_seed(0)
    for rows, n in (((257, 4096), (33, 2880)) if dev.type == "cuda" else ((5, 256), (3, 160))):
        x = (torch.randn(rows, n, device=dev) * 3).bfloat16()
        x[0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 65504.0, -3.0, 1e-3])
        w = (1 + 0.2 * torch.randn(n, device=dev)).bfloat16()
        res = torch.randn(rows, n, device=dev).bfloat16()
        for fmt, gs in ((R.FMT_MX, None), (R.FMT_NV, torch.tensor(0.003, device=dev)), (R.FMT_NV, None)):
            for r in (None, res):
                q = "mxfp4" if fmt == R.FMT_MX else "nvfp4"
                kw = dict(swizzle=True)
                if q == "nvfp4":
                    kw["global_scale"] = None if gs is None else gs.cpu()
                want = rref.rms_norm_quant(x.cpu(), w.cpu(), 1e-6, None if r is None else r.cpu(), 0.0, q, **kw)
                for name, v in rms_variants(rows, n, dev).items():
                    ok &= outputs_equal(rms_call(fmt, x, w, r, gs, **v), want,
                                        f"rms {q} {rows}x{n} res={r is not None} gs={gs is not None} {name}")
    for rows, i in (((129, 1024), (64, 2880)) if dev.type == "cuda" else ((5, 256),)):
        x = (torch.randn(rows, 2 * i, device=dev) * 2).bfloat16()
        ids = (torch.arange(rows, device=dev, dtype=torch.int32) % 9) - 1
        gs = torch.full((8,), 0.004, device=dev)
        for kind in ("mx", "nv"):
            outs = {name: sw_call(kind, x, ids, gs, **v) for name, v in sw_variants(rows, i, dev).items()}
            ref = outs["old"]
            # bytes vs the old epilogue (y goes through exp, which the contract leaves to the backend; the GPU tests
            # compare each backend's bytes with the quantizer applied to its own y)
            for name, got in outs.items():
                ok &= outputs_equal(got, ref, f"swiglu {kind} {rows}x{i} {name} != old")
    print("verify:", "OK" if ok else "FAILED")
    return ok


def main():
    out, dev = probe_start()
    ok = verify(dev)
    timer = VariantTimer(dev)

    def run(op, case, name, fn, nbytes):
        timer.time(f"{op:16s} {case:44s} {name:10s}", fn, nbytes, op=op, case=case, variant=name)

    rows, n = 32768, 4096
    x = torch.randn(rows, n, device=dev).bfloat16()
    w = (1 + 0.2 * torch.randn(n, device=dev)).bfloat16()
    gs = torch.tensor(0.003, device=dev)
    for fmt, q, sb in ((R.FMT_NV, "nvfp4 given-gs swizzled", 16), (R.FMT_MX, "mxfp4 swizzled", 32)):
        nbytes = rows * n * 2 + rows * n // 2 + rows * n // sb + 2 * n
        for name, v in rms_variants(rows, n, dev).items():
            run("rms_norm_fp4", f"M={rows} N={n} {q}", name,
                lambda v=v, fmt=fmt, x=x: rms_call(fmt, x, w, None, gs if fmt == R.FMT_NV else None, **v), nbytes)
    res = torch.randn(rows, n, device=dev).bfloat16()
    nbytes = 3 * rows * n * 2 + rows * n // 2 + rows * n // 16
    for name, v in rms_variants(rows, n, dev).items():
        run("rms_norm_fp4", f"M={rows} N={n} +res nvfp4 given-gs swizzled", name,
            lambda v=v, x=x, res=res: rms_call(R.FMT_NV, x, w, res, gs, **v), nbytes)
    del x, res
    m, i = 16384, 4096
    xs = (torch.randn(m, 2 * i, device=dev) * 2).bfloat16()
    ids = (torch.arange(m, device=dev, dtype=torch.int32) % 9) - 1
    gse = torch.full((8,), 0.004, device=dev)
    for kind, case, sb in (("mx", "gptoss g1 -> mxfp4 swizzled", 32), ("nv", "MoE g8 clamp -> nvfp4 per-expert", 16)):
        nbytes = m * 2 * i * 2 + m * i // 2 + m * i // sb
        for name, v in sw_variants(m, i, dev).items():
            run("swiglu_fp4", f"M={m} I={i} {case}", name, lambda v=v, kind=kind: sw_call(kind, xs, ids, gse, **v),
                nbytes)
    timer.write(out, ok)


if __name__ == "__main__":
    main()
