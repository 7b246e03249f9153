"""The main job: run every registered op through dispatch on this machine, compare with the reference,
print op, case, backend chosen, result, time and error.

On a GPU the backend is whatever `auto` picks. On a CPU, auto would pick the torch reference itself, so the
check forces the Triton backend under the interpreter (small shapes) wherever the table has one, and says so.
Each row runs the chosen backend and the reference on their own copies of the buffers the op writes and
compares what each returns and every byte of what each wrote. A row where the reference is the only backend
serving the call is `reference only`: it runs, but is not counted as passed.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
import json
import os
import statistics
import textwrap
import time
import warnings
from collections.abc import Callable

import torch

from .ops._common import backend_for
from .registry import REFERENCE_BACKEND
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


# ---------------------------------------------------------------------------------------- one row

REFERENCE = REFERENCE_BACKEND  # the backend whose table rows are the references (dispatch/reference/)
OK, FAIL, REFERENCE_ONLY = "ok", "FAIL", "reference only"


def written_args(op: str) -> tuple[int, ...]:
    """Positions of the arguments `op` writes in place (`Tensor(a!)` in its schema)."""
    schema = getattr(torch.ops.lowbit, op).default._schema
    return tuple(i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write)


def whole_buffer(t: torch.Tensor) -> torch.Tensor:
    """Every element of t's storage, flat, in t's dtype: a write is compared over the bytes outside the view
    too (padding, untouched slots), which must keep what was there."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, (storage.nbytes() // t.element_size(),))


def with_copied_buffers(args: tuple, positions: tuple[int, ...]) -> tuple:
    """args with the tensors at `positions` moved onto copies of their whole storages (same offsets, shapes and
    strides; arguments sharing a storage share its copy), so one run's writes never reach another run's inputs."""
    copies: dict[int, torch.UntypedStorage] = {}
    out = list(args)
    for i in positions:
        t = args[i]
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in copies:
            copies[storage.data_ptr()] = storage.clone()
        out[i] = torch.empty(0, dtype=t.dtype, device=t.device).set_(copies[storage.data_ptr()], t.storage_offset(),
                                                                      t.shape, t.stride())
    return tuple(out)


def compare_written(op: str, got_args: tuple, want_args: tuple) -> tuple[bool, str]:
    """The buffers `op` writes, whole (every byte of their storages), after the backend's run vs after the
    reference's: byte-identical (NaN payloads of 16/32-bit floats aside: logical_bytes)."""
    names = [a.name for a in getattr(torch.ops.lowbit, op).default._schema.arguments]
    seen, written, bad, total = set(), [], 0, 0
    for i in written_args(op):
        got, want = got_args[i], want_args[i]
        if got is None:
            continue
        written.append(names[i])
        if got.untyped_storage().data_ptr() in seen:  # a view of a buffer already compared whole
            continue
        seen.add(got.untyped_storage().data_ptr())
        bad += byte_mismatches(whole_buffer(got), whole_buffer(want))
        total += got.untyped_storage().nbytes()
    return bad == 0, f"{'+'.join(written)}: {bad} of {total} bytes differ"


def check_case(case: Case, args: tuple, backend: str) -> tuple[bool, str]:
    """Run the op through `backend` and through the reference, each on its own copy of the buffers the op
    writes; compare the outputs (case.compare) and the written buffers (compare_written)."""
    op = getattr(torch.ops.lowbit, case.op)
    written = written_args(case.op)
    got_args, want_args = with_copied_buffers(args, written), with_copied_buffers(args, written)
    out = op(*got_args, backend)
    ref = op(*want_args, REFERENCE)
    verdicts = [case.compare(out, ref)] if ref is not None else []
    if written:
        verdicts.append(compare_written(case.op, got_args, want_args))
    if not verdicts:
        raise AssertionError(f"{case.op}: returns nothing and writes nothing: nothing to compare")
    return all(ok for ok, _ in verdicts), "; ".join(msg for _, msg in verdicts)


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


def requested_backend(op: str, on_gpu: bool) -> str:
    """`auto` on a GPU. On a CPU auto picks the reference itself, so the Triton backend (its interpreter row) is
    forced wherever the table has one."""
    if on_gpu or not any(e.backend == "triton" and "cpu" in e.archs for e in TABLE[op]):
        return "auto"
    return "triton"


def backend_label(backend: str, on_gpu: bool) -> str:
    return backend + (" (interpreter)" if backend == "triton" and not on_gpu else "")


def run_row(case: Case, device: torch.device, small: bool) -> dict:
    """One row: the chosen backend against the reference, or `reference only` where the reference is all that
    serves this call here (comparing it with itself would check nothing)."""
    on_gpu = device.type == "cuda"
    requested = requested_backend(case.op, on_gpu)
    chosen, ms = None, float("nan")
    try:
        args = case.make_args(device, small)
        chosen = backend_for(case.op, *args, backend=requested)
        if chosen == REFERENCE:
            status, err = REFERENCE_ONLY, "-"
        else:
            ok, err = check_case(case, args, requested)
            status = OK if ok else FAIL
        # timed on the case's own arguments (a write lands in them: they are not read again)
        op = getattr(torch.ops.lowbit, case.op)
        ms = _time_call(functools.partial(op, *args, requested), device, 1 if not on_gpu else 3 if small else 20)
    except Exception as exc:  # report every row, then fail
        status, err = FAIL, f"{type(exc).__name__}: {exc}"[:80]
    return dict(op=case.op, case=case.label, backend=chosen, status=status, ok=status == OK, error=err, ms=ms,
                device=torch.cuda.get_device_name() if on_gpu else "cpu")


# ------------------------------------------------------------------------------------------ the table


def _header(on_gpu: bool) -> str:
    not_counted = (f"Rows where only the reference serves the call say '{REFERENCE_ONLY}' and are not counted as "
                   "passed.")
    if on_gpu:
        return (f"lowbit self-check on {torch.cuda.get_device_name()}: backend 'auto' against the torch reference. "
                + not_counted)
    return ("lowbit self-check on the CPU (no GPU here). This run forces backend 'triton' wherever the table has a "
            "Triton row, instead of 'auto': on a CPU, auto picks the torch reference, and comparing it with the "
            "reference would compare the reference with itself. The Triton kernels run under the Triton interpreter "
            "(TRITON_INTERPRET=1) on small shapes instead. " + not_counted + " Times are interpreter times, not "
            "kernel performance.")


class _Table:
    """Columns aligned to the widest entry of each; every column but the last (error) is known before any row
    runs, so rows print as they finish."""

    def __init__(self, cases: list[Case], on_gpu: bool):
        labels = [backend_label(e.backend, on_gpu) for c in cases for e in TABLE[c.op]]
        self.widths = (max(len(s) for s in ["op", *(c.op for c in cases)]),
                       max(len(s) for s in ["case", *(c.label for c in cases)]),
                       max(len(s) for s in ["backend", *labels]),
                       max(len(s) for s in ("result", OK, FAIL, REFERENCE_ONLY)),
                       9)

    def line(self, op: str, case: str, backend: str, result: str, ms: str, error: str) -> str:
        w = self.widths
        return f"{op:<{w[0]}}  {case:<{w[1]}}  {backend:<{w[2]}}  {result:<{w[3]}}  {ms:>{w[4]}}  {error}".rstrip()

    def header(self) -> str:
        head = self.line("op", "case", "backend", "result", "ms/call", "error")
        return head + "\n" + "-" * len(head)

    def row(self, r: dict, on_gpu: bool) -> str:
        ms = "-" if r["ms"] != r["ms"] else f"{r['ms']:.2f}"
        backend = "-" if r["backend"] is None else backend_label(r["backend"], on_gpu)
        return self.line(r["op"], r["case"], backend, r["status"], ms, r["error"])


def summary(records: list[dict]) -> str:
    reference_only = sum(r["status"] == REFERENCE_ONLY for r in records)
    checked = len(records) - reference_only
    passed = sum(r["status"] == OK for r in records)
    return f"{passed} of {checked} checked rows passed; {reference_only} {REFERENCE_ONLY}"


def _warnings_footer(caught: collections.Counter) -> str:
    if not caught:
        return ""
    lines = [f"{sum(caught.values())} warnings while the rows ran (captured, so the table stays readable):"]
    lines += [f"  {n} x {what}" for what, n in caught.most_common()]
    return "\n".join(lines) + "\n"


def run_selfcheck(json_path: str | None = None, ops: list[str] | None = None) -> int:
    """Print one row per case (of `ops`, default every op) and a summary; 1 if any row failed, else 0."""
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    small = not on_gpu or os.environ.get("LOWBIT_SELFCHECK_SMALL") == "1"  # small: e.g. under compute-sanitizer
    unknown = sorted(set(ops or ()) - set(TABLE))
    if unknown:
        raise SystemExit(f"dispatch check --ops: unknown op(s) {', '.join(unknown)}")
    cases = [c for c in all_cases() if not ops or c.op in ops]
    table = _Table(cases, on_gpu)
    print(textwrap.fill(_header(on_gpu), width=120))
    print(table.header(), flush=True)
    records, caught = [], collections.Counter()
    for case in cases:
        with warnings.catch_warnings(record=True) as seen:  # e.g. the interpreter's numpy overflow in casts
            warnings.simplefilter("always")
            record = run_row(case, device, small)
        caught.update(f"{w.category.__name__}: {str(w.message).splitlines()[0][:100]}" for w in seen)
        records.append(record)
        print(table.row(record, on_gpu), flush=True)
    models_ok = True if ops else check_models(device)
    print("\n" + _warnings_footer(caught) + summary(records))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return 1 if any(r["status"] == FAIL for r in records) or not models_ok else 0


def check_models(device: torch.device) -> bool:
    """The patched transformers models against themselves unpatched (dispatch/integrations/hf/check.py), under
    `auto`; False if any model's tokens disagree. Skipped, and said so, without transformers."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("\nmodels: skipped, transformers is not installed (pip install 'lowbit[hf]')")
        return True
    from .integrations.hf.check import NEW_TOKENS, PROMPT_LENS
    from .integrations.hf.check import check_models as model_rows

    print(f"\nmodels: each patched with lowbit_patch and generating {NEW_TOKENS} greedy tokens for "
          f"{len(PROMPT_LENS)} left-padded prompts against itself unpatched, under auto"
          + ("" if device.type == "cuda" else " (the torch references on a CPU)") + "; times of a second generate")
    rows = model_rows(device)
    print(f"{'model':16} {'replaced':>8}  {'result':6}  {'unpatched ms':>12}  {'lowbit ms':>9}  tokens")
    for r in rows:
        print(f"{r['model']:16} {r['replaced']:>8}  {'ok' if r['ok'] else 'FAIL':6}  {r['unpatched_ms']:>12.1f}  "
              f"{r['lowbit_ms']:>9.1f}  {r['tokens']}")
    return all(r["ok"] for r in rows)
