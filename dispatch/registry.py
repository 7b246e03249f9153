"""The dispatch mechanism: table entries, backend availability, selection, overrides.

The table itself (which op has which backends) is data in `dispatch/table.py`. This module only knows
how to read it:

* `backend="auto"` walks the op's entries by priority and takes the first one whose backend is available,
  whose arch list holds the input's arch, whose `supports` predicate returns None (no reason to refuse), and
  whose `auto_skip` predicate (a measured per-shape preference, e.g. "Triton is faster at prefill here") returns
  None. Every skipped entry is logged at DEBUG level on the `lowbit.dispatch` logger, with its reason.
* An explicit backend (argument, `use_backend(...)` scope, or `LOWBIT_BACKEND` env) forces that entry and
  raises `BackendError` listing every candidate and why it was refused when it cannot run.

Precedence: explicit argument > innermost `use_backend` scope > `LOWBIT_BACKEND` > auto.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import logging
import os
from collections.abc import Callable, Iterator

import torch

from triton_ops.contract import arch as _arch
from triton_ops.contract.arch import arch_of

log = logging.getLogger("lowbit.dispatch")

BACKEND_ENV = "LOWBIT_BACKEND"
BACKENDS = ("triton", "cute", "torch")
REFERENCE_BACKEND = "torch"  # the rows that are the references (dispatch/reference/): plain torch, no launches


class BackendError(RuntimeError):
    """No backend can run this call (or the forced one cannot). The message lists every candidate."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of the dispatch table."""

    op: str  # public op name, e.g. "nvfp4_quantize" (torch op: torch.ops.lowbit.<op>)
    backend: str  # "triton" | "cute" | "torch"
    archs: tuple[str, ...]  # archs (see arch.KNOWN_ARCHS) this entry may run on
    impl: str  # "module:function", imported on first use (keeps `import dispatch` light)
    priority: int  # higher wins under auto
    why: str  # one line: why this priority / what this entry is for (printed by `python -m dispatch`)
    supports: str | None = None  # "module:function" returning a refusal reason (str) or None
    # "module:function" returning why auto should pass this entry over for these arguments (a measured
    # preference by shape bucket, not a capability: an explicit backend still runs it), or None
    auto_skip: str | None = None
    # "module:function" returning a launcher prepared for one exact call signature (compiled function, views
    # and checks resolved once; the eager fast path in ops/_common.py caches it), or None where the general
    # entry must run
    specialize: str | None = None

    def resolve_impl(self) -> Callable:
        return _load(self.impl)

    @property
    def is_reference(self) -> bool:
        """A reference row (torch ops only: its calls are never recorded for launch plans)."""
        return self.backend == REFERENCE_BACKEND

    def refusal(self, arch: str, args: tuple, kwargs: dict) -> str | None:
        """Why this entry cannot run this call, or None."""
        if arch not in self.archs:
            return f"arch {arch} not in {'/'.join(self.archs)}"
        unavailable = backend_unavailable(self.backend, arch)  # cached per backend below (_import_failure, cute)
        if unavailable:
            return unavailable
        if self.supports is not None:
            return _load(self.supports)(*args, **kwargs)
        return None


@functools.cache
def _load(path: str) -> Callable:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def backend_unavailable(backend: str, arch: str) -> str | None:
    """Why `backend` cannot run on `arch` on this machine (None if it can)."""
    if backend == REFERENCE_BACKEND:
        return None
    if backend == "triton":
        if arch == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "host tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
        return _import_failure("triton")
    if backend == "cute":
        from cute_ops import unavailable_reason

        return unavailable_reason()
    return f"unknown backend {backend!r}"


@functools.cache
def _import_failure(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as exc:  # an optional dependency: say why, never fall back silently
        return f"cannot import {module}: {exc}"
    return None


# ---------------------------------------------------------------------------------------------- overrides

_scoped: contextvars.ContextVar[tuple[tuple[str | None, str], ...]] = contextvars.ContextVar(
    "lowbit_backend_scope", default=()
)


@contextlib.contextmanager
def use_backend(backend: str, ops: str | tuple[str, ...] | None = None) -> Iterator[None]:
    """Force `backend` for `ops` (all ops if None) inside the `with` block. Nests; innermost wins.
    Unknown backend or op names raise ValueError (a typo would otherwise force nothing, silently)."""
    _check_backend_name(backend)
    names: tuple[str | None, ...] = (None,) if ops is None else ((ops,) if isinstance(ops, str) else tuple(ops))
    if ops is not None:
        for name in names:
            _check_op_name(name, "use_backend(ops=...)")
    token = _scoped.set(_scoped.get() + tuple((name, backend) for name in names))
    try:
        yield
    finally:
        _scoped.reset(token)


def _check_backend_name(backend: str) -> None:
    if backend not in BACKENDS and backend != "auto":
        raise ValueError(f"unknown backend {backend!r}; choose one of auto, {', '.join(BACKENDS)}")


def known_ops() -> tuple[str, ...]:
    """Every op the dispatch table has rows for (dispatch/table.py, imported lazily: it imports this module)."""
    from .table import TABLE

    return tuple(TABLE)


def _check_op_name(op, source: str) -> None:
    ops = known_ops()
    if op not in ops:
        raise ValueError(f"{source}: unknown op {op!r}; known ops: {', '.join(sorted(ops))}")


def parse_backend_env(value: str) -> dict[str | None, str]:
    """LOWBIT_BACKEND: 'torch' (all ops) or 'op=backend,op2=backend' ('*' = all ops). Unknown backend or op
    names raise ValueError (listing the known ones): a typo must not be ignored silently."""
    return dict(_parse_backend_env(value))


@functools.lru_cache(maxsize=64)  # read on every select() while the env var is set; the answer depends on it only
def _parse_backend_env(value: str) -> dict[str | None, str]:
    forced: dict[str | None, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        op, sep, backend = item.rpartition("=")
        op = op.strip() if sep else "*"
        backend = backend.strip()
        _check_backend_name(backend)
        if op != "*":
            _check_op_name(op, f"{BACKEND_ENV}={value}")
        forced[None if op == "*" else op] = backend
    return forced


def forced_backend(op: str) -> tuple[str, str] | None:
    """(backend, source) forced for `op` by a scope or the env, else None."""
    for name, backend in reversed(_scoped.get()):
        if name is None or name == op:
            return backend, "use_backend()"
    env = os.environ.get(BACKEND_ENV)
    if env:
        forced = _parse_backend_env(env)
        backend = forced.get(op, forced.get(None))
        if backend:
            return backend, f"{BACKEND_ENV}={env}"
    return None


# ---------------------------------------------------------------------------------------------- selection


def _device_of(args: tuple) -> torch.device:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def unsupported_arch_message(arch: str) -> str:
    """What to say about an arch the table has no rows for (e.g. sm_75), instead of 'not built' per entry."""
    return f"lowbit has no kernels for {arch}; supported: {', '.join(_arch.KNOWN_ARCHS)}"


def select(entries: list[Entry], op: str, backend: str, args: tuple, kwargs: dict) -> Entry:
    """Pick the entry that runs this call (see module docstring for the rules)."""
    _check_backend_name(backend)
    source = "backend= argument"
    if backend == "auto":
        forced = forced_backend(op)
        if forced is not None:
            backend, source = forced
    arch = arch_of(_device_of(args))
    if arch not in _arch.KNOWN_ARCHS:
        raise BackendError(f"lowbit.{op}: {unsupported_arch_message(arch)}")
    ranked = sorted(entries, key=lambda e: -e.priority)
    refusals: list[str] = []
    for entry in ranked:
        if backend != "auto" and entry.backend != backend:
            continue
        reason = entry.refusal(arch, args, kwargs)
        if reason is None and backend == "auto" and entry.auto_skip is not None:
            reason = _load(entry.auto_skip)(*args, **kwargs)
        if reason is None:
            if refusals:
                log.debug("lowbit.%s: chose %s on %s after skipping: %s", op, entry.backend, arch,
                          "; ".join(refusals))
            return entry
        refusals.append(f"{entry.backend}[{','.join(entry.archs)}]: {reason}")
        log.debug("lowbit.%s: skipped %s on %s: %s", op, entry.backend, arch, reason)
    wanted = "any backend" if backend == "auto" else f"backend {backend!r} (from {source})"
    listing = "\n  ".join(refusals) or f"no {backend} entry is registered for this op"
    raise BackendError(f"lowbit.{op}: {wanted} cannot run this call on {arch}. Candidates:\n  {listing}")
