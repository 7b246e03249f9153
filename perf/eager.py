"""Eager host cost per call: every op back to back at a tiny shape, against torch's own eager ops.

    python -m perf.eager --out eager.json [--ops rms_norm,swiglu] [--profile rms_norm,...] [--decode]

Each record: op, backend (what `auto` picked), host_us (wall time per call of N back-to-back calls, median of
5 batches; the kernels are tiny, so the GPU idles and the wall time is the host's), host_ratio = host_us /
torch F.rms_norm's host_us at M=16 x 7168 bf16 measured in the same process. Peers: torch eager equivalents
and Liger where installed. `launch_plan`: the op's calls replay a launch plan; `native_replay`: in the C++ replay
(dispatch/native_replay.py; else `no_native` says why). `--profile` adds a cProfile breakdown (top functions by
own time) per named op.
Calls go through the public path (`dispatch.ops._common.call`, what every `ops.*` wrapper calls).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

CALLS, BATCHES = 200, 5


def host_us(fn, calls: int = CALLS, batches: int = BATCHES) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per_call)


def profile_breakdown(fn, calls: int = CALLS, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def torch_peers(dev) -> dict:
    """Torch's own eager ops (and Liger's where installed) at the decode shape M=16 x 7168 bf16."""
    x = torch.randn(16, 7168, device=dev, dtype=torch.bfloat16)
    w = torch.randn(7168, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(16, 2 * 2048, device=dev, dtype=torch.bfloat16)
    peers = {
        "torch x*2": lambda: x * 2,
        "torch F.rms_norm": lambda: F.rms_norm(x, (7168,), w, 1e-6),
        "torch silu(g)*u": lambda: F.silu(gu[:, :2048]) * gu[:, 2048:],
    }
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        peers["liger rms_norm"] = lambda: LigerRMSNormFunction.apply(x, w, 1e-6)
        peers["liger swiglu"] = lambda: LigerSiLUMulFunction.apply(gu[:, :2048], gu[:, 2048:])
    except Exception:  # an optional peer: absent, its rows are absent
        pass
    return peers


def _torch_fp8_group(y: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 1xG quantization as a user writes it in torch eager (what the fused ops replace)."""
    g = y.float().unflatten(-1, (-1, group))
    s = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    return (g / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).flatten(-2), s.squeeze(-1)


def decode_pairs(dev, m: int) -> list[tuple[str, object, dict]]:
    """(op, lowbit call, {peer: call}) at a decode shape: M tokens x 7168 (RMSNorm) / 2 x 2048 (SwiGLU), bf16.
    Peers: torch eager (the native op where torch has one, else the composition a user writes: the op, then the
    quantizer in torch ops or the reference quantizer for FP4) and Liger where it has the op."""
    from dispatch import ops
    from dispatch.reference import quant as rq

    x = torch.randn(m, 7168, device=dev, dtype=torch.bfloat16)
    w = torch.randn(7168, device=dev, dtype=torch.bfloat16)
    gu = torch.randn(m, 2 * 2048, device=dev, dtype=torch.bfloat16)
    norm = lambda: F.rms_norm(x, (7168,), w, 1e-6)  # noqa: E731
    silu_mul = lambda: F.silu(gu[:, :2048]) * gu[:, 2048:]  # noqa: E731
    liger = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        liger = {"rms_norm": lambda: LigerRMSNormFunction.apply(x, w, 1e-6),
                 "swiglu": lambda: LigerSiLUMulFunction.apply(gu[:, :2048], gu[:, 2048:])}
    except Exception:  # an optional peer
        pass
    pairs = [
        ("rms_norm", lambda: ops.rms_norm(x, w, 1e-6), {"torch": norm}),
        ("rms_norm_fp8_group", lambda: ops.rms_norm_fp8_group(x, w, 1e-6), {"torch": lambda: _torch_fp8_group(norm())}),
        ("rms_norm_mxfp4", lambda: ops.rms_norm_mxfp4(x, w, 1e-6),
         {"torch": lambda: rq.mxfp4_quantize(norm(), "floor", False)}),
        ("rms_norm_nvfp4", lambda: ops.rms_norm_nvfp4(x, w, 1e-6),
         {"torch": lambda: rq.nvfp4_quantize(norm(), None, False)}),
        ("swiglu", lambda: ops.swiglu(gu), {"torch": silu_mul}),
        ("swiglu_fp8_group", lambda: ops.swiglu_fp8_group(gu), {"torch": lambda: _torch_fp8_group(silu_mul())}),
        ("swiglu_mxfp4", lambda: ops.swiglu_mxfp4(gu),
         {"torch": lambda: rq.mxfp4_quantize(silu_mul(), "floor", False)}),
        ("swiglu_nvfp4", lambda: ops.swiglu_nvfp4(gu), {"torch": lambda: rq.nvfp4_quantize(silu_mul(), None, False)}),
    ]
    for op, _, peers in pairs:
        if op in liger:
            peers["liger"] = liger[op]
    return pairs


def decode_compare(dev, rows=(16, 64)) -> list[dict]:
    """Wall time per call of back-to-back eager calls at decode shapes, lowbit against each peer."""
    out = []
    for m in rows:
        for op, fn, peers in decode_pairs(dev, m):
            mine = host_us(fn)
            theirs = {name: round(host_us(p), 2) for name, p in peers.items()}
            out.append(dict(op=op, M=m, lowbit_us=round(mine, 2), peers_us=theirs,
                            faster_than_peers=all(mine < t for t in theirs.values())))
    return out


def run(ops: list[str] | None, profile: list[str], decode: bool = False) -> dict:
    from dispatch import native_replay
    from dispatch.launch_plan import LaunchPlan
    from dispatch.ops._common import _FAST, _PLAN_REFUSALS, backend_for, call
    from dispatch.selfcheck import all_cases

    dev = torch.device("cuda")
    records, breakdowns = [], {}
    peers = {name: host_us(fn) for name, fn in torch_peers(dev).items()}
    base = peers["torch F.rms_norm"]
    for name, us in peers.items():
        records.append(dict(op=name, provider="peer", host_us=round(us, 2), host_ratio=round(us / base, 3)))
    for case in all_cases():
        if ops and case.op not in ops:
            continue
        args = case.make_args(dev, True)
        backend = backend_for(case.op, *args)
        fn = (lambda a=args, op=case.op: call(op, *a, "auto"))
        try:
            us = host_us(fn)
        except Exception as exc:  # report, do not hide: the record says what failed
            records.append(dict(op=case.op, label=case.label, backend=backend, error=repr(exc)[:300]))
            continue
        planned = any(n == case.op and isinstance(v, LaunchPlan) for (n, _), v in _FAST.items())
        native = planned and native_replay.planned(case.op, (*args, "auto"))
        records.append(dict(op=case.op, label=case.label, provider="lowbit", backend=backend,
                            host_us=round(us, 2), host_ratio=round(us / base, 3), launch_plan=planned,
                            native_replay=native,
                            **({} if planned else {"no_plan": _PLAN_REFUSALS.get(case.op)}),
                            **({"no_native": native_replay.REFUSALS.get(case.op)} if planned and not native else {})))
        if case.op in profile:
            breakdowns[case.op] = profile_breakdown(fn)
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                baseline="torch F.rms_norm M=16 x 7168 bf16", baseline_us=round(base, 2), records=records,
                native_replay_built=native_replay.module() is not None,
                breakdowns=breakdowns, decode=decode_compare(dev) if decode else [])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ops", help="comma-separated op names (default: every op with a self-check case)")
    p.add_argument("--profile", default="", help="comma-separated ops to break down with cProfile")
    p.add_argument("--decode", action="store_true",
                   help="also compare the fused ops with torch eager and Liger at decode shapes (M = 16, 64)")
    a = p.parse_args()
    import triton
    result = run(a.ops.split(",") if a.ops else None, [o for o in a.profile.split(",") if o], a.decode)
    result["triton"] = triton.__version__
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in result["records"]:
        print(f"{r['op']:<28} {r.get('backend', r.get('provider', '')):<8} {r.get('host_us', 'ERR'):>8} "
              f"{r.get('host_ratio', r.get('error', ''))} {'native' if r.get('native_replay') else ''} "
              f"{'' if r.get('launch_plan', True) else r.get('no_plan')} {r.get('no_native') or ''}")
    for r in result["decode"]:
        peers = ", ".join(f"{k} {v}" for k, v in r["peers_us"].items())
        print(f"decode M={r['M']:<3} {r['op']:<20} lowbit {r['lowbit_us']:>8} us | {peers} | "
              f"{'faster' if r['faster_than_peers'] else 'NOT faster'}")
    for op, text in result["breakdowns"].items():
        print(f"==== {op}\n{text}")


if __name__ == "__main__":
    main()
