"""Does `backend="auto"` pick the fastest shipped backend the committed benchmark records measured?

Records: perf/results/<device>.jsonl. For each (op, case) the comparison is the latest run that timed two or more
shipped backends of it: forced `lowbit:<backend>` providers with status ok, never the `lowbit:torch` reference.
What auto picks at that case's shape comes from the dispatch table itself: the case's inputs are made as fake CUDA
tensors (perf/cases, FakeTensorMode: no GPU, no memory), the op's arguments are captured from the case's own
public call, and `registry.select` runs on them with LOWBIT_ARCH set to the record's arch.

A choice is wrong when another shipped backend beat it by more than TOLERANCE under every timing the run recorded
for both (CUDA events around eager calls, and CUDA-graph replay). Where the two timings disagree (a lighter eager
launch against a faster kernel), the choice is a trade-off that the table row's reason documents.

`python -m perf.auto_choice` prints every comparison with its verdict, then per device the cases where the table
has two or more shipped backends but no record compares them, as one `python -m perf run` selection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shlex
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from dispatch.registry import BackendError, select
from dispatch.table import TABLE
from perf import results
from perf.cases.base import BenchCase
from triton_ops.contract.arch import ARCH_ENV

TOLERANCE = 0.03  # auto may be this much slower than the fastest shipped backend (run-to-run noise of a median)
REFERENCE_BACKEND = "torch"  # the test oracle: timed only in --quick runs, never a candidate here
CUTE_ARCH_ENV = "CUTE_DSL_ARCH"  # the CuTeDSL compile target on a machine without a GPU (cute_ops/_compile.py)
_FAKE_DATA_PTR = 1 << 20  # fake tensors have no storage: the alignment checks read this base plus the offset


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One run's timings of two or more shipped backends on one case."""

    path: str  # the record file, relative to the repository
    device: str
    arch: str
    op: str
    case: str
    run_id: str
    timestamp: str
    times: dict[str, dict[str, float]]  # timing ("events" / "cuda-graph") -> backend -> median us

    def where(self) -> str:
        return f"{self.op} [{self.case}] on {self.device} ({self.path}, run {self.run_id} at {self.timestamp[:16]})"


def shipped_backend(provider: str) -> str | None:
    """'lowbit:cute' -> 'cute'; None for the reference and for peers."""
    kind, _, backend = provider.partition(":")
    return backend if kind == "lowbit" and backend and backend != REFERENCE_BACKEND else None


def comparisons(path: Path) -> list[Comparison]:
    """The latest run per (op, case) of `path` that timed two or more shipped backends."""
    runs: dict[tuple[str, str], dict[tuple[str, str], list[dict]]] = {}
    for r in results.load([path]):
        if r.get("quick") or r.get("status") != "ok" or r.get("median_us") is None:
            continue
        if shipped_backend(r["provider"]) is None:
            continue
        runs.setdefault((r["op"], r["case"]), {}).setdefault((r["timestamp"], r["run_id"]), []).append(r)
    out = []
    full = path.resolve()
    rel = str(full.relative_to(results.REPO) if full.is_relative_to(results.REPO) else full)
    for (op, case), by_run in sorted(runs.items()):
        compared = [k for k, recs in by_run.items() if len({shipped_backend(r["provider"]) for r in recs}) > 1]
        if not compared:
            continue
        stamp, run_id = max(compared)
        recs = by_run[(stamp, run_id)]
        times: dict[str, dict[str, float]] = {}
        for r in recs:
            times.setdefault(r["timing"], {})[shipped_backend(r["provider"])] = r["median_us"]
        out.append(Comparison(rel, recs[0]["device"], recs[0]["arch"], op, case, run_id, stamp, times))
    return out


def verdict(c: Comparison, auto: str) -> str | None:
    """Why auto's choice `auto` is wrong for this comparison, or None (see the module docstring)."""
    timed = {t: b for t, b in c.times.items() if auto in b and len(b) > 1}
    if not timed:
        return f"{c.where()}: auto picks {auto}, which the run did not time beside another backend"
    slower = {}
    for timing, by_backend in timed.items():
        best = min(by_backend, key=by_backend.get)
        if by_backend[auto] > by_backend[best] * (1 + TOLERANCE):
            slower[timing] = f"auto's {auto} {by_backend[auto]:.1f} us vs {best} {by_backend[best]:.1f} us"
    if len(slower) < len(timed):
        return None
    return f"{c.where()}: " + "; ".join(f"{t}: {s}" for t, s in sorted(slower.items()))


# ------------------------------------------------------------------------------- auto's choice at a case's shape


@functools.cache
def case_index() -> dict[tuple[str, str], BenchCase]:
    """Every full-size benchmark case by (op, label)."""
    from perf.runner import load_cases, select_cases

    return {(c.op, c.label): c for c in select_cases(load_cases(), quick=False)}


class _OpCalls(TorchDispatchMode):
    """Records the lowbit torch ops called under it (the public wrappers call them under any dispatch mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "lowbit":
            self.calls.append((name, args))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _described_as(arch: str) -> Iterator[None]:
    """The dispatcher and the CuTeDSL compiler describe this machine as `arch`; restored on exit."""
    saved = {k: os.environ.get(k) for k in (ARCH_ENV, CUTE_ARCH_ENV)}
    os.environ[ARCH_ENV] = arch
    os.environ[CUTE_ARCH_ENV] = f"{arch}a"
    try:
        with mock.patch.object(FakeTensor, "data_ptr",
                               lambda t: _FAKE_DATA_PTR + t.storage_offset() * t.element_size()):
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _mirror(x):
    """Fake CUDA tensors of the same dtype, shape and strides as the (meta or host) tensors in `x`."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cuda")
    if isinstance(x, dict):
        return {k: _mirror(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_mirror(v) for v in x)
    return x


def _fake_inputs(case: BenchCase, mode: FakeTensorMode):
    """The case's inputs as fake CUDA tensors of the dtypes, shapes and strides its make() gives: made on the meta
    device (no memory), or on the host where make() reads values (e.g. a page count), then mirrored."""
    try:
        made = case.make(torch.device("meta"))
    except (NotImplementedError, RuntimeError):  # a value read: meta tensors have none
        made = case.make(torch.device("cpu"))
    with mode:
        return _mirror(made)


def op_arguments(case: BenchCase, mode: FakeTensorMode) -> tuple:
    """The op's arguments (without `backend`) of the case's public call, as fake CUDA tensors."""
    inputs = _fake_inputs(case, mode)
    calls = _OpCalls()
    with mode, calls:
        case.lowbit(inputs, "auto")
    mine = [args for name, args in calls.calls if name == case.op]
    if not mine:
        raise LookupError(f"{case.op} [{case.label}]: its public call never reached torch.ops.lowbit.{case.op}")
    return mine[-1][:-1]


def choices(case: BenchCase, arch: str, backends: set[str]) -> tuple[str, dict[str, bool]]:
    """(the backend auto picks for the case on `arch`, {backend: whether auto's row is the row forcing it runs})
    for each of `backends` that can run the case."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with _described_as(arch):
        args = op_arguments(case, mode)
        with mode:
            auto = select(TABLE[case.op], case.op, "auto", args, {})
            same_row = {}
            for b in sorted(backends):
                try:
                    same_row[b] = select(TABLE[case.op], case.op, b, args, {}) is auto
                except BackendError:
                    continue
    return auto.backend, same_row


def check(c: Comparison) -> str | None:
    """verdict() of the backend auto picks on the comparison's case, or why that cannot be decided."""
    case = case_index().get((c.op, c.case))
    if case is None:
        return f"{c.where()}: no benchmark case with this label in perf/cases (renamed? then the records are stale)"
    auto, same_row = choices(case, c.arch, {b for t in c.times.values() for b in t})
    if auto in same_row and not same_row[auto]:
        return f"{c.where()}: auto picks a {auto} row other than the one `backend='{auto}'` runs (untimed)"
    return verdict(c, auto)


# ------------------------------------------------------------------------------------------------- the gaps


def shipped_backends(op: str, arch: str) -> set[str]:
    """Backends of `op` with a table row for `arch`, the reference excepted."""
    return {e.backend for e in TABLE.get(op, []) if arch in e.archs and e.backend != REFERENCE_BACKEND}


def record_arch(path: Path) -> str:
    """The arch of the device whose records `path` holds (one device per file)."""
    archs = {r["arch"] for r in results.load([path])}
    if len(archs) != 1:
        raise ValueError(f"{path}: records of {len(archs)} archs ({', '.join(sorted(archs))}); expected one device")
    return archs.pop()


def unmeasured(path: Path, arch: str) -> list[BenchCase]:
    """Cases that two or more shipped backends of `arch` can run but no run in `path` compares."""
    compared = comparisons(path)
    done = {(c.op, c.case) for c in compared}
    out = []
    for (op, label), case in case_index().items():
        backends = shipped_backends(op, arch)
        if len(backends) < 2 or (op, label) in done:
            continue
        if len(choices(case, arch, backends)[1]) > 1:
            out.append(case)
    return out


def run_command(cases: list[BenchCase], arch: str, time_limit_s: int = 280) -> str:
    """A `python -m perf run` selection timing every shipped backend on `cases` (peers and references left out)."""
    ops = list(dict.fromkeys(c.op for c in cases))
    backends = sorted({b for c in cases for b in shipped_backends(c.op, arch)})
    labels = " ".join(f"--case {shlex.quote(c.label)}" for c in cases)
    return (f"python -m perf run --ops {' '.join(ops)} --providers {' '.join('lowbit:' + b for b in backends)} "
            f"{labels} --time-limit {time_limit_s}")


def main() -> int:
    status = 0
    files = sorted(results.RESULTS_DIR.glob("*.jsonl"))
    for path in files:
        for c in comparisons(path):
            why = check(c)
            status |= why is not None
            print(f"{'WRONG' if why else 'ok   '} {c.where()}" + (f"\n      {why}" if why else ""))
    for path in files:
        if not any(r.get("kind") == "lowbit" for r in results.load([path])):
            continue  # a file of model or multi-GPU records only (nvidia-h200-x2): no op benchmark to compare
        arch = record_arch(path)
        gaps = unmeasured(path, arch)
        print(f"\n{path.name}: {len(gaps)} case(s) with no comparison of their shipped backends")
        for case in gaps:
            print(f"  {case.op} [{case.label}]")
        if gaps:
            print(run_command(gaps, arch))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
