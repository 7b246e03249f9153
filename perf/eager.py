"""Eager host cost per call: every op back to back at a tiny shape, against torch's own eager ops.

    python -m perf.eager --out eager.json [--ops rms_norm,swiglu] [--profile over|all|rms_norm,...] [--decode]

Each record: op, backend (what `auto` picked), host_us (wall time per call of N back-to-back calls, median of 5
batches; the kernels are tiny, so the GPU idles and the wall time is the host's), host_ratio = host_us / torch
F.rms_norm's host_us at M=16 x 7168 bf16 measured in the same process. Peers: torch eager equivalents and Liger
where installed. `launch_plan`: the op's calls replay a launch plan; `native_replay`: in the C++ replay
(dispatch/native_replay.py; else `no_native` says why), CuTe rows included (their plans call the compiled function
through the TVM-FFI C ABI; without one they run their prepared launcher, `launch_plan` false). `breakdowns` (per "op
(label)") says where a call's host time goes, for every case above the BAR by default (`--profile over`), for all
(`--profile all`) or for the named ops: the plan's census (allocations, bytes, those in the per-call block,
zero-fills, copies, launches) and, for a native replay, the time of the public call, of the extension's call alone,
of the same plan without its launches (key + allocations + outputs) and of an empty plan (key + lookup); for any
other path (a Python plan, a prepared CuTe launcher, the backend function) the time of the public call, of its fast
path alone and of the key (`_signature`), and a cProfile listing (top functions by own time); for every one the
host's submit time and the GPU's time per call (`per_call_us`: where the GPU's time is the larger, the kernels set
host_us, not the host path).
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
BAR = 1.5  # host_ratio every Triton and CuTe op must stay under (docs/perf.md)


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


def submit_and_gpu_us(fn, calls: int = CALLS) -> dict:
    """Per call: host time to submit `calls` back-to-back calls (no synchronization inside the timed loop) and GPU
    time between events around them. host_us ~ gpu_us means the op's GPU work, not its host path, sets host_us."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    submit = (time.perf_counter() - t0) / calls * 1e6
    end.record()
    torch.cuda.synchronize()
    return dict(submit=round(submit, 2), gpu=round(start.elapsed_time(end) * 1e3 / calls, 2))


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


def native_breakdown(op: str, args: tuple, plan) -> dict:
    """Host time of a natively replayed call, split: the public call, the extension's call alone, the same plan
    without launches (key, allocations, outputs) and an empty plan (key and lookup); with the plan's census."""
    from dispatch import native_replay
    from dispatch.ops._common import call

    mod = native_replay.module()
    desc = native_replay.describe(plan)
    offsets, block_bytes, block_zero = native_replay.block_layout(plan.allocs)
    out = dict(plan.census(), in_block=sum(o >= 0 for o in offsets), block_bytes=block_bytes, block_zero=block_zero)
    full = (*args, "auto")
    allocs_only, empty = f"{op}#allocs", f"{op}#empty"
    mod.register(allocs_only, full, (*desc[:3], [], *desc[4:]))
    mod.register(empty, full, (desc[0], desc[1], [], [], ("const", None), None))
    try:
        us = dict(call=host_us(lambda: call(op, *full)), native=host_us(lambda: mod.call(op, full)),
                  allocs_outputs=host_us(lambda: mod.call(allocs_only, full)),
                  key=host_us(lambda: mod.call(empty, full)))
    finally:  # only the probes' plans go
        mod.drop(allocs_only, full)
        mod.drop(empty, full)
    us = {k: round(v, 2) for k, v in us.items()}
    out["us"] = us
    out["us_split"] = dict(python_wrapper=round(us["call"] - us["native"], 2), key_lookup=us["key"],
                           allocs_outputs=round(us["allocs_outputs"] - us["key"], 2),
                           launches=round(us["native"] - us["allocs_outputs"], 2))
    return out


def breakdown(op: str, args: tuple, fn) -> dict:
    """Where the host time of `fn` (a public call of op with args) goes: native_breakdown for a native replay,
    else the plan's census (where there is one) and a cProfile listing."""
    from dispatch import native_replay
    from dispatch.launch_plan import LaunchPlan
    from dispatch.ops._common import _FAST, _signature

    plan = _FAST.get((op, _signature((*args, "auto"))))
    native = native_replay.planned(op, (*args, "auto"))
    if isinstance(plan, LaunchPlan) and native:
        out = native_breakdown(op, args, plan)
    elif native and op in native_replay.ADOPTED:  # a CuTe row's fast path is its prepared launcher: the plan is here
        out = native_breakdown(op, args, native_replay.ADOPTED[op])
    else:
        name = getattr(plan, "__qualname__", repr(plan))
        out = plan.census() if isinstance(plan, LaunchPlan) else {"fast_path": name}
        if callable(plan):  # the public call against the fast path alone and the key alone
            full = (*args, "auto")
            us = dict(call=host_us(fn), fast_path=host_us(lambda: plan(*args)), key=host_us(lambda: _signature(full)))
            out["us"] = {k: round(v, 2) for k, v in us.items()}
        out["profile"] = profile_breakdown(fn)
    out["per_call_us"] = submit_and_gpu_us(fn)
    return out


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


def host_floor(dev) -> dict:
    """Peer lines for the host floor of an eager lowbit call, measured beside the ops: the two output allocations
    of an rms_norm call with a residual (`torch.empty_like` x 2) and its eager key (`_signature`), which every
    public call computes before it replays anything."""
    from dispatch.ops._common import _signature

    ts = [torch.empty(16, 7168, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    x, empty = ts[0], torch.empty_like
    key_args = (x, ts[1], ts[2], 1e-6, 0.0, "auto")
    return {
        "torch.empty_like x2 (16 x 7168 bf16)": lambda: (empty(x), empty(x)),
        "lowbit eager key (_signature, rms_norm + residual)": lambda: _signature(key_args),
    }


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
    """profile: op names to break down, or ["over"] (every case above BAR) or ["all"]."""
    from dispatch import native_replay
    from dispatch.launch_plan import LaunchPlan
    from dispatch.ops._common import _FAST, _PLAN_REFUSALS, backend_for, call
    from dispatch.selfcheck import all_cases

    dev = torch.device("cuda")
    records, breakdowns = [], {}
    peers = {name: host_us(fn) for name, fn in torch_peers(dev).items()}
    peers |= {name: host_us(fn) for name, fn in host_floor(dev).items()}
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
        native = native_replay.planned(case.op, (*args, "auto"))
        planned = native or any(n == case.op and isinstance(v, LaunchPlan) for (n, _), v in _FAST.items())
        records.append(dict(op=case.op, label=case.label, provider="lowbit", backend=backend,
                            host_us=round(us, 2), host_ratio=round(us / base, 3), launch_plan=planned,
                            native_replay=native,
                            **({} if planned else {"no_plan": _PLAN_REFUSALS.get(case.op)}),
                            **({"no_native": native_replay.REFUSALS.get(case.op)}
                               if not native and (planned or native_replay.REFUSALS.get(case.op)) else {})))
        if case.op in profile or "all" in profile or ("over" in profile and us / base > BAR):
            try:
                breakdowns[f"{case.op} ({case.label})"] = breakdown(case.op, args, fn)
            except Exception as exc:  # a breakdown must not cost the record
                breakdowns[f"{case.op} ({case.label})"] = {"error": repr(exc)[:300]}
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                tvm_ffi=_tvm_ffi_info(),
                baseline="torch F.rms_norm M=16 x 7168 bf16", baseline_us=round(base, 2), records=records,
                native_replay_built=native_replay.module() is not None,
                breakdowns=breakdowns, decode=decode_compare(dev) if decode else [])


def _tvm_ffi_info() -> dict:
    """How TVM-FFI takes torch tensors here: torch's C DLPack exchange API (a C call per tensor) or not."""
    try:
        import tvm_ffi
        version = tvm_ffi.__version__
    except ImportError:
        version = None
    return dict(version=version, torch_c_dlpack_exchange_api=hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--ops", help="comma-separated op names (default: every op with a self-check case)")
    p.add_argument("--profile", default="over",
                   help="comma-separated ops to break down, 'over' (default: every case above the bar), 'all', "
                        "or '' (none)")
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
    for name, parts in result["breakdowns"].items():
        text = parts.pop("profile", "") if isinstance(parts, dict) else parts
        print(f"==== {name}: {json.dumps(parts)}")
        if text:
            print(text)
        if isinstance(parts, dict) and text:
            parts["profile"] = text


if __name__ == "__main__":
    main()
