"""Plumbing shared by every op family's registration module."""

from __future__ import annotations

import torch

from ..registry import select
from ..table import TABLE

# name -> the op's Python implementation (checks + table choice + backend call), registered by `lowbit_op`.
_EAGER_IMPLS: dict = {}


def lowbit_op(name: str, *, mutates_args):
    """torch.library.custom_op("lowbit::<name>") that also remembers the undecorated implementation, so the
    public wrappers can skip the dispatcher's Python layers in plain eager calls (see `call`)."""
    def register(fn):
        _EAGER_IMPLS[name] = fn
        return torch.library.custom_op(f"lowbit::{name}", mutates_args=mutates_args)(fn)
    return register


def call(name: str, *args):
    """Run op `name` from a public wrapper.

    Under torch.compile / export, or with any dispatch mode active (FakeTensorMode, functionalization,
    make_fx), this is exactly `torch.ops.lowbit.<name>(*args)`, so graphs see the op and its fake impl. In
    plain eager calls it runs the same implementation directly: the custom-op dispatcher's Python layers cost
    tens of microseconds per call (measured: the whole eager path was ~95 us/call on the H200 host, about the
    time of an 8192x8192 quantize kernel), which is what decode-size calls pay.
    """
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return getattr(torch.ops.lowbit, name)(*args)
    return _EAGER_IMPLS[name](*args)


def run(op: str, backend: str, *args):
    """Run `op` on the backend the table picks for these arguments (see registry.select)."""
    entry = select(TABLE[op], op, backend, args, {})
    return entry.resolve_impl()(*args)


def backend_for(op: str, *args, backend: str = "auto") -> str:
    """Which backend would run this call (for self-checks, benchmarks and docs)."""
    return select(TABLE[op], op, backend, args, {}).backend
