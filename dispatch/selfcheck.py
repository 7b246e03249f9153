"""The main job: run every registered op through dispatch on this machine, compare with the reference,
print op, backend chosen, error and time.

On a GPU the backend is whatever `auto` picks. On a CPU, auto would pick the torch reference itself, so the
check forces the Triton backend under the interpreter (small shapes) wherever the table has one, and says so.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

from .ops._common import backend_for
from .table import TABLE


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def logical_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's values as uint8 bytes in logical (row-major) order, whatever its strides: the one byte comparison
    the self-check, the tests and the benchmarks' verify step share.

    NaNs of 16/32-bit float dtypes are canonicalized: a NaN's payload is in no lowbit contract (the GPU's
    arithmetic makes 0x7FFFFFFF, x86 keeps 0x7FC00000). FP8 NaN bytes stay as they are (lowbit defines them)."""
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    flat.copy_(t.detach().reshape(-1))
    if flat.is_floating_point() and flat.element_size() > 1:
        flat = torch.where(torch.isnan(flat), torch.full_like(flat, float("nan")), flat)
    return flat.view(torch.uint8)


def byte_mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    """Number of differing bytes (shapes and dtypes must already agree)."""
    return int((logical_bytes(got) != logical_bytes(want).to(got.device)).sum())


def normalized_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (0 for empty tensors): the float comparison of ops whose sums are not
    bit-reproducible across backends (GEMMs, attention)."""
    if not ref.numel():
        return 0.0
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def exact(out, ref) -> tuple[bool, str]:
    """Every output tensor byte-identical (and same shape/strides) to the reference's."""
    bad = 0
    for a, b in zip(_as_tuple(out), _as_tuple(ref), strict=True):
        if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
            return False, f"meta differs: {a.shape}/{a.dtype}/{a.stride()} vs {b.shape}/{b.dtype}/{b.stride()}"
        bad += byte_mismatches(a, b)
    return bad == 0, f"{bad} bytes differ"


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    make_args: Callable[[torch.device, bool], tuple]  # (device, small) -> op args (without backend)
    compare: Callable = exact
    label: str = ""


# Each op family's registration module defines `self_check_cases() -> list[Case]`. Add yours here.
FAMILIES = ("dispatch.ops.quant", "dispatch.ops.rope", "dispatch.ops.kv_cache", "dispatch.ops.moe",
            "dispatch.ops.rmsnorm", "dispatch.ops.swiglu", "dispatch.ops.moe_gemm",
            "dispatch.ops.attention")


def all_cases() -> list[Case]:
    cases = [c for fam in FAMILIES for c in importlib.import_module(fam).self_check_cases()]
    missing = set(TABLE) - {c.op for c in cases}
    if missing:
        raise AssertionError(f"ops without a self-check case: {sorted(missing)}")
    return cases


def sample_activations(device, small: bool, dtype=torch.bfloat16, k: int | None = None) -> torch.Tensor:
    """Deterministic activation-like data: Gaussian rows at log-normal magnitudes (never zeros)."""
    m, k = (8, k or 256) if small else (4096, k or 7168)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    return x.to(device=device, dtype=dtype)


def _time_call(fn, device, reps: int) -> float:
    """Median wall time (ms) per call; synchronizes on GPU."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_selfcheck(json_path: str | None = None, ops: list[str] | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    small = not on_gpu or os.environ.get("LOWBIT_SELFCHECK_SMALL") == "1"  # small: e.g. under compute-sanitizer
    if on_gpu:
        print(f"lowbit self-check on {torch.cuda.get_device_name()}: auto dispatch vs the torch reference")
    else:
        print("lowbit self-check on the CPU: no GPU here, so the Triton kernels run under the Triton "
              "interpreter (TRITON_INTERPRET=1) on small shapes, against the torch reference. "
              "Times are interpreter times, not kernel performance.")
    header = f"{'op':<24} {'case':<34} {'backend':<21} {'result':<8} {'error':<22} {'ms/call':>9}"
    print(header + "\n" + "-" * len(header))
    failures, records = 0, []
    unknown = sorted(set(ops or ()) - set(TABLE))
    if unknown:
        raise SystemExit(f"dispatch check --ops: unknown op(s) {', '.join(unknown)}")
    for case in all_cases():
        if ops and case.op not in ops:
            continue
        args = case.make_args(device, small)
        op = getattr(torch.ops.lowbit, case.op)
        has_triton_cpu = any(e.backend == "triton" and "cpu" in e.archs for e in TABLE[case.op])
        requested = "triton" if (not on_gpu and has_triton_cpu) else "auto"
        chosen = backend_for(case.op, *args, backend=requested)
        label = chosen + (" (interpreter)" if chosen == "triton" and not on_gpu else "")
        try:
            out = op(*args, requested)
            ok, err = case.compare(out, op(*args, "torch"))
            ms = _time_call(functools.partial(op, *args, requested), device, 3 if small else 20)
        except Exception as exc:  # report every op, then fail
            ok, err, ms = False, f"{type(exc).__name__}: {exc}"[:60], float("nan")
        failures += not ok
        print(f"{case.op:<24} {case.label:<34} {label:<21} {'ok' if ok else 'FAIL':<8} {err:<22} {ms:>9.2f}")
        records.append(dict(op=case.op, case=case.label, backend=chosen, ok=ok, error=err, ms=ms,
                            device=torch.cuda.get_device_name() if on_gpu else "cpu"))
    print(f"\n{len(records) - failures} passed, {failures} failed")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if failures else 0
