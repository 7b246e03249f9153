"""Plumbing shared by every op family's registration module."""

from __future__ import annotations

from ..registry import select
from ..table import TABLE


def run(op: str, backend: str, *args):
    """Run `op` on the backend the table picks for these arguments (see registry.select)."""
    entry = select(TABLE[op], op, backend, args, {})
    return entry.resolve_impl()(*args)


def backend_for(op: str, *args, backend: str = "auto") -> str:
    """Which backend would run this call (for self-checks, benchmarks and docs)."""
    return select(TABLE[op], op, backend, args, {}).backend
