"""Plumbing shared by every op family's registration module.

Every op's implementation has one shape: `check(...)` (clear errors naming op and argument), then
`run(op, backend, *args_without_backend)` (table choice, backend call). Both depend only on tensor metadata
(dtype, device, shape, strides, alignment) and on the plain arguments, never on tensor values, so their outcome
can be remembered per call signature: that is the eager fast path in `call`.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import typing

import torch

from .. import launch_plan, native_replay
from ..eager_env import read_select_env
from ..registry import _load, _scoped, select
from ..table import TABLE

# name -> the op's Python implementation (checks + table choice + backend call), registered by `lowbit_op`.
_EAGER_IMPLS: dict = {}


class _FastPaths(dict):
    """(op, signature) -> the chosen backend function, for calls whose checks passed and whose table choice is
    known. Clearing it also drops the native replay's plans (dispatch/native_replay.py)."""

    def clear(self) -> None:
        super().clear()
        native_replay.clear()


_FAST: dict = _FastPaths()
_FAST_MAX = 4096  # signatures; cleared when full (shapes churn only in odd workloads)
_PLAIN = frozenset({type(None), bool, int, float, str, torch.dtype})
_record = threading.local()
# op -> why its last recorded call gave no launch plan (None: it did, or none was tried); for tests and debugging.
_PLAN_REFUSALS: dict = {}


def lowbit_op(name: str, *, mutates_args, check, finish=None):
    """Declare op `name` once (every lowbit op is declared this way). The decorated function's signature (its
    arguments end with `backend: str`) is the torch op's schema, and its body returns the outputs from metadata
    alone: it is the fake implementation (`check(*args)`, then the body). The real one is derived from it:
    `check(*args)` (errors name op and argument), then the table's backend (`run`), then
    `finish(outputs, *args)` if given (e.g. an absent optional output becomes the empty tensor the schema
    returns). `args` are the op's arguments without `backend`: `check` takes exactly those. Since the same
    `check` validates real and fake tensors (torch.compile, FakeTensorMode, meta), a check that reads tensor
    values (host range checks, LOWBIT_CHECK_INDICES) must skip fake ones (ops/_fake.py `is_fake`). Also
    remembers the real implementation for `call`'s eager fast path."""
    def register(fake):
        def impl(*args):
            check(*args[:-1])
            out = run(name, args[-1], *args[:-1])
            return out if finish is None else finish(out, *args[:-1])

        def fake_impl(*args):
            check(*args[:-1])
            return fake(*args)

        functools.update_wrapper(impl, fake)
        impl.__signature__ = _resolved_signature(fake)  # the schema comes from the declaration's signature
        _EAGER_IMPLS[name] = impl
        op = torch.library.custom_op(f"lowbit::{name}", mutates_args=mutates_args)(impl)
        op.register_fake(fake_impl)
        return op
    return register


def _resolved_signature(fn) -> inspect.Signature:
    """fn's signature with string annotations (`from __future__ import annotations`) evaluated in fn's module,
    so torch.library can infer the schema of a function defined elsewhere."""
    hints = typing.get_type_hints(fn)
    sig = inspect.signature(fn)
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
    ret = hints.get("return", sig.return_annotation)
    return sig.replace(parameters=params, return_annotation=None if ret is type(None) else ret)


def _signature(args: tuple):
    """What checks and backend choice can depend on: tensor metadata (dtype, device, shape, strides, the
    data pointer's and the storage offset's alignment up to 16) and the other arguments' values; None when an
    argument is of another kind (then the call always takes the checked path). One flat tuple (no per-tensor
    inner tuples), env first: it is built and hashed on every eager call (~1 us less than the nested form).
    The env part is None while none of eager_env.SELECT_ENV is set (env_reader)."""
    env = read_select_env()
    if env is not None and env[-1] is not None:
        return None
    sig = [_scoped.get(), env]
    add = sig.append
    for a in args:
        if type(a) in _PLAIN:
            add(a)
        elif isinstance(a, torch.Tensor):
            if a.requires_grad:  # the checks refuse autograd inputs under grad mode: never skip them
                return None
            sig += (a.dtype, a.device, a.shape, a.stride(), (a.storage_offset() & 15) << 4 | (a.data_ptr() & 15))
        else:
            return None
    return tuple(sig)


def call(name: str, *args):
    """Run op `name` from a public wrapper (`args` end with the `backend` argument).

    Under torch.compile / export, or with any dispatch mode active (FakeTensorMode, functionalization,
    make_fx), this is exactly `torch.ops.lowbit.<name>(*args)`, so graphs see the op and its fake impl.
    In plain eager calls it skips the custom-op dispatcher's Python layers (tens of microseconds per call), and
    after the first call with a given signature also the checks and the table choice (~20 us on the H200's
    host): the backend function the first call chose runs directly (or the launcher its table row prepared for that
    signature: `Entry.specialize`), or its launch plan (dispatch/launch_plan.py), which the C++ replay runs in one
    call, key included, where it can (dispatch/native_replay.py). Any change of the backend overrides
    (use_backend, LOWBIT_BACKEND, LOWBIT_ARCH, ...) is part of the signature. A first call logs what auto
    dispatch skipped (registry.select, debug level); repeated calls with the same signature do not.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return getattr(torch.ops.lowbit, name)(*args)
    native = native_replay.call
    if native is not None:  # a plan the C++ replay holds: key, allocations, launches and outputs in one call
        out = native(name, args)
        if out is not native_replay.MISS:
            return out
    key = _signature(args)
    if key is not None:
        fast = _FAST.get((name, key))
        if fast is not None:
            return fast(*args[:-1])
    _record.chosen = None
    _record.want_plan = key is not None and os.environ.get(launch_plan.PLANS_ENV) != "0"
    try:
        out = _EAGER_IMPLS[name](*args)  # raises on bad input: nothing is remembered then
    finally:
        _record.want_plan = False
    chosen, _record.chosen = _record.chosen, None
    # Remember only when the implementation ran the backend on exactly its own arguments minus `backend`.
    if key is not None and chosen is not None and chosen[0] == name and len(chosen[1]) == len(args) - 1 \
            and all(a is b for a, b in zip(chosen[1], args[:-1], strict=True)):
        if len(_FAST) >= _FAST_MAX:
            _FAST.clear()
        impl, entry, plan = chosen[2], chosen[3], chosen[4]
        # A table row may name a launcher prepared for this exact signature (cute_ops/rmsnorm.py: compiled
        # function, views and checks resolved once); it returns None where the general entry must run. Every
        # non-reference row gets an eager launch plan where the first call allowed one (dispatch/launch_plan.py);
        # a plan with CuTe calls replays natively only (the prepared launcher, or the entry, is the Python path).
        prepared = _load(entry.specialize)(*args[:-1]) if entry.specialize is not None else None
        python_plan = plan if plan is not None and not plan.native_only else None
        _FAST[(name, key)] = prepared or python_plan or impl
        if plan is not None and (plan.native_only or not prepared):
            native_replay.adopt(name, args, plan)
    return out


def run(op: str, backend: str, *args):
    """Run `op` on the backend the table picks for these arguments (see registry.select)."""
    entry = select(TABLE[op], op, backend, args, {})
    impl = entry.resolve_impl()
    want_plan = getattr(_record, "want_plan", False) and not entry.is_reference and _on_cuda(args)
    _record.want_plan = False  # a backend that calls other ops records only its own launches
    out, plan, _PLAN_REFUSALS[op] = launch_plan.record(impl, args) if want_plan else (impl(*args), None, None)
    _record.chosen = (op, args, impl, entry, plan)  # after the call: a backend calling other ops must not overwrite it
    return out


def _on_cuda(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


def backend_for(op: str, *args, backend: str = "auto") -> str:
    """Which backend would run this call (for self-checks, benchmarks and docs)."""
    return select(TABLE[op], op, backend, args, {}).backend
