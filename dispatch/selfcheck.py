"""The main job: run every registered op through dispatch on this machine, compare with the reference,
print op, backend chosen, error and time.

On a GPU the backend is whatever `auto` picks. On a CPU, auto would pick the torch reference itself, so the
check forces the Triton backend under the interpreter (small shapes) wherever the table has one, and says so.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch

from .ops._common import backend_for
from .table import TABLE


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t.to(torch.uint8)


def exact(out, ref) -> tuple[bool, str]:
    """Every output tensor byte-identical (and same shape/strides) to the reference's."""
    bad = 0
    for a, b in zip(_as_tuple(out), _as_tuple(ref), strict=True):
        if a.shape != b.shape or a.dtype != b.dtype or a.stride() != b.stride():
            return False, f"meta differs: {a.shape}/{a.dtype}/{a.stride()} vs {b.shape}/{b.dtype}/{b.stride()}"
        bad += int((_bytes(a) != _bytes(b)).sum())
    return bad == 0, f"{bad} bytes differ"


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    make_args: Callable[[torch.device, bool], tuple]  # (device, small) -> op args (without backend)
    compare: Callable = exact
    label: str = ""


def _x(device, small, dtype=torch.bfloat16, k=None):
    m, k = (8, k or 256) if small else (4096, k or 7168)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    return x.to(device=device, dtype=dtype)


def _quant_cases() -> list[Case]:
    from . import ops

    def nvq(dev, small):
        x = _x(dev, small)
        return (x, None, True)

    def nvq_given(dev, small):
        x = _x(dev, small)
        return (x, ops.nvfp4_global_scale_from_amax(x.float().abs().amax()), False)

    def nvdq(dev, small):
        q = ops.nvfp4_quantize(_x(dev, small), scale_layout="swizzled", backend="torch")
        return (q.codes, q.scales, q.global_scale, True, torch.bfloat16)

    def mxq(dev, small):
        return (_x(dev, small), "rceil", True)

    def mxdq(dev, small):
        q = ops.mxfp4_quantize(_x(dev, small), backend="torch")
        return (q.codes, q.scales, False, torch.bfloat16)

    def fp8q(dev, small):
        return (_x(dev, small), 128, 1e-10, False, True)

    def fp8dq(dev, small):
        q = ops.fp8_group_quantize(_x(dev, small), 128, ue8m0=True, backend="torch")
        return (q.codes, q.scales, 128, torch.bfloat16)

    def swz(dev, small):
        return (torch.randint(0, 255, (300, 56), dtype=torch.uint8).to(dev),)

    def unswz(dev, small):
        return (torch.randint(0, 255, (384, 56), dtype=torch.uint8).to(dev), 300, 53)

    return [
        Case("nvfp4_quantize", nvq, label="computed global scale, swizzled"),
        Case("nvfp4_quantize", nvq_given, label="given global scale, linear"),
        Case("nvfp4_dequantize", nvdq, label="swizzled -> bf16"),
        Case("mxfp4_quantize", mxq, label="rceil, swizzled"),
        Case("mxfp4_dequantize", mxdq, label="linear -> bf16"),
        Case("fp8_group_quantize", fp8q, label="g128, column-major scales"),
        Case("fp8_group_dequantize", fp8dq, label="g128 ue8m0 -> bf16"),
        Case("swizzle_scales_128x4", swz),
        Case("unswizzle_scales_128x4", unswz),
    ]


def all_cases() -> list[Case]:
    cases = _quant_cases()
    missing = set(TABLE) - {c.op for c in cases}
    if missing:
        raise AssertionError(f"ops without a self-check case: {sorted(missing)}")
    return cases


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


def run_selfcheck(json_path: str | None = None) -> int:
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    small = not on_gpu
    if on_gpu:
        print(f"lowbit self-check on {torch.cuda.get_device_name()}: auto dispatch vs the torch reference")
    else:
        print("lowbit self-check on the CPU: no GPU here, so the Triton kernels run under the Triton "
              "interpreter (TRITON_INTERPRET=1) on small shapes, against the torch reference. "
              "Times are interpreter times, not kernel performance.")
    header = f"{'op':<24} {'case':<34} {'backend':<21} {'result':<8} {'error':<22} {'ms/call':>9}"
    print(header + "\n" + "-" * len(header))
    failures, records = 0, []
    for case in all_cases():
        args = case.make_args(device, small)
        op = getattr(torch.ops.lowbit, case.op)
        has_triton_cpu = any(e.backend == "triton" and "cpu" in e.archs for e in TABLE[case.op])
        requested = "triton" if (not on_gpu and has_triton_cpu) else "auto"
        chosen = backend_for(case.op, *args, backend=requested)
        label = chosen + (" (interpreter)" if chosen == "triton" and not on_gpu else "")
        try:
            out = op(*args, requested)
            ok, err = case.compare(out, op(*args, "torch"))
            ms = _time_call(lambda: op(*args, requested), device, 3 if small else 20)
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
