"""The benchmark runner: how a BenchCase is measured (the cases say what).

For every case it builds the providers (each lowbit backend the table has for the op on this device, the
torch eager reference, `torch.compile(reference)`, the case's peers), verifies each lowbit backend against the
reference on identical (cloned) inputs, then times every provider and yields one long-format record per
(op, case, provider, timing).

Timing (GPU): CUDA events around a *pass* over `k` independently made input copies, `k` chosen so the copies
exceed L2 several times over (a decode case with 40 KB of inputs gets ~1000 copies): every call reads cold
inputs. A sample is one pass; per-call time = pass time / k; we report the median and p20/p80 over samples,
after a warm-up pass. Calls inside a pass are launched back to back, so when a provider is launch-bound the
host overhead shows in the "events" timing; lowbit providers are also timed as a CUDA-graph replay of the
same pass ("cuda-graph" timing, every bucket): the difference is host/launch overhead.

Timing (CPU): wall clock (`time.perf_counter`) around the same passes; labelled "cpu-wallclock". Triton runs
on a CPU only under TRITON_INTERPRET=1 and only in --quick mode (it is an interpreter: correctness and plumbing,
not speed), labelled "interpreter" in the record.

Roofline: measured in the same process (`measure_roofline`): device-to-device copy bandwidth (bytes read +
written), bf16 matmul 8192^3 and fp8 `torch._scaled_mm` 8192^3 rates. A case's roofline time is
max(bytes_moved / copy_bw, flops / matmul_rate); its roofline fraction is that over the measured median.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch

from perf.cases.base import BenchCase

L2_TARGET_BYTES = 192 << 20  # input copies per pass: > 3x the 50-60 MB L2 of H100/H200
MAX_COPIES = 1024
GPU_BUDGET_S = 0.12  # per provider and timing mode: samples = budget / sample time, clamped below
GPU_SAMPLES = (10, 60)
MAX_PASS_S = 0.03  # a slower pass is cut to fewer input copies (see time_passes)
MIN_COPIES = 8
CPU_SAMPLES = (2, 7)  # the interpreter takes seconds per call: 2 passes in --quick
CPU_BUDGET_S = 0.5


@dataclasses.dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    calls_per_sample: int


@dataclasses.dataclass
class Roofline:
    copy_gbps: float
    bf16_tflops: float | None
    fp8_tflops: float | None
    how: str  # what was measured (shapes), for the record


# ------------------------------------------------------------------------------------------------ helpers


def clone_inputs(x: Any) -> Any:
    """Deep copy of make()'s result: tensors cloned (same strides not required), containers rebuilt."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: clone_inputs(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_inputs(v) for v in x)
    return x


def footprint(x: Any) -> int:
    """Bytes of tensor storage reachable from make()'s result."""
    if isinstance(x, torch.Tensor):
        return x.untyped_storage().nbytes()
    if isinstance(x, dict):
        return sum(footprint(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(footprint(v) for v in x)
    return 0


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=10, method="inclusive")  # deciles: q[1] = p20, q[7] = p80
    return statistics.median(v), q[1], q[7]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------- timing


# Providers that run the pure-torch reference (the "torch" peer, and the lowbit torch backend).
REFERENCE_PROVIDERS = ("torch", "lowbit:torch")


def _clear_capture_state(device: torch.device) -> None:
    """After a failed capture torch's CUDA generator still believes it is capturing (the epilogue never ran), and
    every later random op fails with 'Offset increment outside graph capture', spoiling every later case of the
    run. One small successful capture runs the epilogue and clears it."""
    g = torch.cuda.CUDAGraph()
    scratch = torch.empty(1, device=device)
    with torch.cuda.graph(g):
        scratch.add_(1)
    torch.cuda.synchronize(device)


def capture_graph(fn: Callable[[], Any], device: torch.device, warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, what the captured call returned): `fn` called `warmup` times on a side stream (the capture rules:
    first launches, compiles and allocator growth happen outside the graph), then captured once."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def time_passes(fn: Callable[[Any], Any], arg_sets: list, device: torch.device, graph: bool = False,
                budget_s: float | None = None) -> Timing:
    """Time `fn` over one pass of `arg_sets` per sample (see module docstring). Raises if capture fails."""
    k = len(arg_sets)

    def one_pass():
        for a in arg_sets:
            fn(a)

    run = one_pass
    if device.type == "cuda" and graph:  # the whole pass as one graph
        run = capture_graph(one_pass, device)[0].replay

    if device.type == "cuda":
        run()  # warm-up (first launches, autotuning, allocator growth): excluded
        _sync(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        _sync(device)
        est = max(start.elapsed_time(end) / 1e3, 1e-6)
        if not graph and est > MAX_PASS_S and k > MIN_COPIES:
            # A slow provider (host-bound torch references at decode sizes, ~0.5 ms a call over up to 1024
            # copies) would spend seconds per sample. At that speed it is nowhere near the memory roof, so L2
            # residency cannot flatter it: time it over fewer copies.
            k_fit = max(MIN_COPIES, int(k * MAX_PASS_S / est))
            est, k, arg_sets = est * k_fit / k, k_fit, arg_sets[:k_fit]  # one_pass reads arg_sets late
        lo, hi = GPU_SAMPLES
        n = int(min(hi, max(lo, (budget_s or GPU_BUDGET_S) / est)))
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in events:
            s.record()
            run()
            e.record()
        _sync(device)
        per_call = [s.elapsed_time(e) * 1e3 / k for s, e in events]  # ms -> us
    else:
        t0 = time.perf_counter()
        run()  # warm-up
        est = max(time.perf_counter() - t0, 1e-6)
        lo, hi = CPU_SAMPLES
        n = int(min(hi, max(lo, (budget_s or CPU_BUDGET_S) / est)))
        per_call = []
        for _ in range(n):
            t0 = time.perf_counter()
            run()
            per_call.append((time.perf_counter() - t0) * 1e6 / k)
    med, p20, p80 = _quantiles(per_call)
    return Timing(med, p20, p80, len(per_call), k)


def host_us_per_call(fn: Callable[[], Any], n: int = 2000, warmup: int = 50) -> float:
    """Wall-clock microseconds per call over n back-to-back calls (CUDA synchronized before and after only):
    the host cost of an eager call when its GPU work is shorter than its Python path (decode-size calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def measure_roofline(device: torch.device, quick: bool = False) -> Roofline:
    """Copy bandwidth and matmul rates measured here and now (the ceilings every case is held against)."""
    if device.type == "cuda":
        n = (256 if quick else 1024) << 20  # bytes per buffer; copy moves 2x
        src = torch.randn(n // 2, device=device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t = time_passes(lambda _: dst.copy_(src), [None], device, budget_s=0.2)
        copy = 2 * n / (t.median_us * 1e-6) / 1e9
        del src, dst
        s = 4096 if quick else 8192
        a = torch.randn(s, s, device=device, dtype=torch.bfloat16)
        b = torch.randn(s, s, device=device, dtype=torch.bfloat16)
        t = time_passes(lambda _: torch.mm(a, b), [None], device, budget_s=0.3)
        bf16 = 2 * s**3 / (t.median_us * 1e-6) / 1e12
        fp8 = None
        if torch.cuda.get_device_capability(device) >= (8, 9):
            a8 = a.to(torch.float8_e4m3fn)
            b8 = b.to(torch.float8_e4m3fn)  # row-major [N, K]: b8.t() is the column-major operand _scaled_mm wants
            one = torch.ones((), device=device, dtype=torch.float32)
            mm = lambda _: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            t = time_passes(mm, [None], device, budget_s=0.3)
            fp8 = 2 * s**3 / (t.median_us * 1e-6) / 1e12
        return Roofline(copy, bf16, fp8, f"copy 2x{n >> 20} MiB bf16; mm {s}^3 bf16 / fp8 _scaled_mm")
    n = 32 << 20
    src = torch.randn(n // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = time_passes(lambda _: dst.copy_(src), [None], device, budget_s=0.2)
    copy = 2 * n / (t.median_us * 1e-6) / 1e9
    s = 512
    a, b = torch.randn(s, s, dtype=torch.bfloat16), torch.randn(s, s, dtype=torch.bfloat16)
    t = time_passes(lambda _: torch.mm(a, b), [None], device, budget_s=0.2)
    return Roofline(copy, 2 * s**3 / (t.median_us * 1e-6) / 1e12, None, f"CPU: copy 2x32 MiB fp32; mm {s}^3 bf16")


# ----------------------------------------------------------------------------------------------- providers


@dataclasses.dataclass
class Provider:
    name: str  # "lowbit:triton", "torch", "torch.compile", "liger", ...
    fn: Callable[[Any], Any]  # inputs -> output
    kind: str  # "lowbit" | "reference" | "compiled" | "peer"
    backend: str | None = None  # lowbit backend name
    note: str = ""  # e.g. "interpreter"


def lowbit_backends(op: str, device: torch.device, quick: bool) -> tuple[list[str], dict[str, str]]:
    """Backends of `op` that can run on this device, and why the others cannot (backend -> reason)."""
    from dispatch.registry import backend_unavailable
    from dispatch.table import TABLE
    from triton_ops.contract.arch import arch_of

    arch = arch_of(device)
    ok: list[str] = []
    skipped: dict[str, str] = {}
    for entry in sorted(TABLE.get(op, []), key=lambda e: -e.priority):
        if entry.backend in ok:
            continue
        if arch not in entry.archs:
            skipped.setdefault(entry.backend, f"no {entry.backend} entry for {arch}")
            continue
        reason = backend_unavailable(entry.backend, arch)
        if reason is None and arch == "cpu" and entry.backend == "triton" and not quick:
            reason = "Triton interpreter on a CPU: only for --quick shapes"
        if reason:
            skipped[entry.backend] = reason
            continue
        ok.append(entry.backend)
        skipped.pop(entry.backend, None)
    return ok, skipped


_compiled: dict[int, Callable] = {}


def _compile(reference: Callable) -> Callable:
    # One compile per case (reset first): the cases of an op share the reference's code object, and a shared
    # dynamo cache would turn later shapes dynamic or hit the recompile limit and silently run eager.
    torch._dynamo.reset()
    return torch.compile(reference, dynamic=False)


def providers_for(case: BenchCase, device: torch.device, quick: bool,
                  wanted: Callable[[str], bool]) -> tuple[list[Provider], dict[str, str]]:
    backends, skipped = lowbit_backends(case.op, device, quick)
    provs = [Provider(f"lowbit:{b}", (lambda i, b=b: case.lowbit(i, b)), "lowbit", b,
                      "interpreter" if (b == "triton" and device.type == "cpu") else "") for b in backends]
    skipped = {f"lowbit:{b}": r for b, r in skipped.items()}
    provs.append(Provider("torch", case.reference, "reference"))
    if case.compile_reference:
        if device.type == "cuda":
            provs.append(Provider("torch.compile", case.reference, "compiled"))  # compiled lazily (costly)
        else:
            skipped["torch.compile"] = "not timed on a CPU (inductor compile time; the numbers would mean little)"
    for name, fn in case.peers.items():
        if device.type == "cuda":
            provs.append(Provider(name, fn, "peer"))
        else:
            skipped[name] = "peers are timed on GPUs only"
    return [p for p in provs if wanted(p.name)], {k: v for k, v in skipped.items() if wanted(k)}


# ------------------------------------------------------------------------------------------------- a case


def select_cases(all_cases: list[BenchCase], quick: bool) -> list[BenchCase]:
    if not quick:
        return [c for c in all_cases if c.tier in ("full", "both")]
    out: list[BenchCase] = []
    for op in dict.fromkeys(c.op for c in all_cases):
        mine = [c for c in all_cases if c.op == op]
        q = [c for c in mine if c.tier in ("quick", "both")]
        out += q or [min(mine, key=lambda c: c.bytes_moved)]
    return out


LOAD_ERRORS: dict[str, str] = {}  # family module -> why its cases could not be built (the run then fails)


def load_cases(ops: list[str] | None = None) -> list[BenchCase]:
    """Every family's cases (filtered to `ops`). A family that fails to import is reported loudly on stderr and
    in LOAD_ERRORS (`python -m perf run` then exits non-zero) but does not stop the other families."""
    import importlib
    import sys

    from perf.cases import FAMILIES

    cases: list[BenchCase] = []
    for fam in FAMILIES:
        try:
            cases += importlib.import_module(fam).cases()
        except Exception as exc:
            LOAD_ERRORS[fam] = _short(exc)
            print(f"perf: ERROR: cannot build the cases of {fam}: {_short(exc)}", file=sys.stderr)
    if ops:
        unknown = set(ops) - {c.op for c in cases}
        if unknown:
            raise SystemExit(f"perf: no cases for op(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted({c.op for c in cases}))}")
        cases = [c for c in cases if c.op in ops]
    return cases


def _copies(case: BenchCase, first: Any, device: torch.device, quick: bool) -> int:
    if device.type != "cuda" or quick:
        return 1
    fp = max(footprint(first), case.bytes_moved // 2, 1)
    k = math.ceil(L2_TARGET_BYTES / fp)
    return max(1, min(k, MAX_COPIES, case.max_copies or MAX_COPIES))


def run_case(case: BenchCase, device: torch.device, roof: Roofline, quick: bool,
             wanted: Callable[[str], bool], log: Callable[[str], None]) -> Iterator[dict]:
    """Yield result dicts (without run metadata) for every provider and timing mode of `case`."""
    base = dict(op=case.op, case=case.label, bucket=case.bucket, params=case.params,
                bytes_moved=case.bytes_moved, flops=case.flops)

    def rec(provider: Provider | str, timing: str | None, status: str, **kw) -> dict:
        name = provider if isinstance(provider, str) else provider.name
        kind = "" if isinstance(provider, str) else provider.kind
        note = "" if isinstance(provider, str) else provider.note
        return dict(base, provider=name, kind=kind, timing=timing, status=status, note=note, **kw)

    try:
        with torch.no_grad():
            first = case.make(device)
            # Verification inputs stay pristine: `first` is also a timing input, and in-place ops (rope_, cache
            # writes) mutate it on every timed call, which made later providers look wrong.
            pristine = clone_inputs(first)
            want = case.reference(clone_inputs(pristine))
            _sync(device)
    except Exception as exc:
        log(f"  {case.op} [{case.label}]: make/reference failed: {exc}")
        yield rec("torch", None, "error", error=_short(exc))
        return

    provs, skipped = providers_for(case, device, quick, wanted)
    auto = auto_backend(case, pristine, log) if any(p.kind == "lowbit" for p in provs) else None
    if auto is not None:
        base["auto"] = auto
    for name, why in skipped.items():
        yield rec(name, None, "skipped", error=why)

    k = _copies(case, first, device, quick)
    try:
        arg_sets = [first] + [case.make(device) for _ in range(k - 1)]
    except torch.OutOfMemoryError:
        arg_sets = [first]
    # Graph replay for every bucket: at decode it shows launch overhead; at prefill it separates the kernel's
    # time from the eager host path, which on the H200 host (~60-100 us per call) exceeds many prefill kernels.
    graph_too = device.type == "cuda" and (case.graph if case.graph is not None else True)
    timings = ["events", "cuda-graph"] if graph_too else ["events"]
    if device.type != "cuda":
        timings = ["cpu-wallclock"]

    results: dict[tuple[str, str], Timing] = {}
    for p in provs:
        fn = p.fn
        verified = "reference"
        try:
            with torch.no_grad():
                if p.kind == "compiled":
                    fn = _compile(case.reference)
                if p.kind in ("lowbit", "compiled"):
                    got = fn(clone_inputs(pristine)) if p.kind == "compiled" else p.fn(clone_inputs(pristine))
                    _sync(device)
                    try:
                        case.check(got, want)
                        verified = "passed"
                    except AssertionError as exc:
                        if p.kind == "lowbit":  # a fast wrong answer is a failure, not a data point
                            log(f"  {case.op} [{case.label}] {p.name}: WRONG: {exc}")
                            yield rec(p, None, "wrong", error=_short(exc))
                            continue
                        verified = f"differs from eager: {_short(exc)}"  # inductor may round differently
                elif p.kind == "peer":
                    verified = "not checked (peer contract differs in detail)"
        except Exception as exc:
            from dispatch.registry import BackendError

            status = "skipped" if isinstance(exc, BackendError) else "error"
            log(f"  {case.op} [{case.label}] {p.name}: {status}: {_short(exc)}")
            if status == "error" and os.environ.get("LOWBIT_PERF_TRACEBACK"):
                traceback.print_exc()
            yield rec(p, None, status, error=_short(exc))
            continue
        for timing in timings:
            if timing == "cuda-graph" and p.name in REFERENCE_PROVIDERS:
                continue  # references may host-sync (data-dependent shapes): not promised capture-safe
            try:
                with torch.no_grad():
                    t = time_passes(fn, arg_sets, device, graph=(timing == "cuda-graph"))
            except Exception as exc:
                if device.type == "cuda":
                    try:  # a failed capture must not poison the next measurements
                        torch.cuda.synchronize(device)
                        _clear_capture_state(device)
                    except Exception as exc2:
                        log(f"  CUDA state after the failure: {_short(exc2)}")
                log(f"  {case.op} [{case.label}] {p.name} {timing}: timing failed: {_short(exc)}")
                yield rec(p, timing, "error", error=_short(exc), verified=verified)
                continue
            results[(p.name, timing)] = t
            yield rec(p, timing, "ok", verified=verified, **metrics(case, t, roof))
    del arg_sets


def auto_backend(case: BenchCase, inputs: Any, log: Callable[[str], None]) -> str | None:
    """The backend `backend="auto"` picks for the case's inputs on this device (the record's `auto`): the case's
    lowbit call runs once under a dispatch mode that sees the torch op `lowbit::<op>` with its arguments and asks the
    table (`dispatch.ops.backend_for`). None where the call never reaches that op or raises (the timed providers
    report the error)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dispatch.ops import backend_for

    class AutoChoice(TorchDispatchMode):
        chosen: str | None = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.chosen is None and func.namespace == "lowbit" and func._opname == case.op:
                self.chosen = backend_for(case.op, *args[:-1], backend=args[-1])  # the last argument: backend
            return func(*args, **(kwargs or {}))

    mode = AutoChoice()
    try:
        with torch.no_grad(), mode:
            case.lowbit(clone_inputs(inputs), "auto")
    except Exception as exc:
        log(f"  {case.op} [{case.label}] auto: {_short(exc)}")
        return None
    return mode.chosen


def metrics(case: BenchCase, t: Timing, roof: Roofline) -> dict:
    sec = t.median_us * 1e-6
    gbps = case.bytes_moved / sec / 1e9 if case.bytes_moved else None
    tflops = case.flops / sec / 1e12 if case.flops else None
    compute_roof = roof.fp8_tflops if case.flops_dtype == "fp8" else roof.bf16_tflops
    t_mem = case.bytes_moved / (roof.copy_gbps * 1e9) if roof.copy_gbps else 0.0
    t_cmp = case.flops / (compute_roof * 1e12) if (case.flops and compute_roof) else 0.0
    frac = max(t_mem, t_cmp) / sec if max(t_mem, t_cmp) > 0 else None
    return dict(median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, samples=t.samples,
                calls_per_sample=t.calls_per_sample, gbps=gbps, tflops=tflops, roofline_frac=frac,
                bound="compute" if t_cmp > t_mem else "memory")


def add_ratios(records: list[dict]) -> None:
    """Per case and timing: `vs` = {other provider: other median / this median} (> 1: this one is faster)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("status") == "ok":
            groups.setdefault((r["op"], r["case"], r["timing"]), []).append(r)
    for rs in groups.values():
        for r in rs:
            r["vs"] = {o["provider"]: o["median_us"] / r["median_us"] for o in rs
                       if o is not r and r["median_us"] > 0}


def _short(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return msg if len(msg) < 300 else msg[:297] + "..."
