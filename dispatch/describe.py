"""Render the dispatch table for one arch (used by `python -m dispatch` and the README)."""

from __future__ import annotations

from .registry import backend_unavailable
from .table import TABLE


def table_rows(arch: str) -> list[tuple[str, str, str, str, str]]:
    """(op, backend, rank, status on `arch`, why) with the entry auto picks first, per op."""
    rows = []
    for op, entries in TABLE.items():
        ranked = sorted(entries, key=lambda e: -e.priority)
        auto_taken = False
        for e in ranked:
            if arch not in e.archs:
                continue
            reason = backend_unavailable(e.backend, arch)
            if reason:
                status = f"unavailable: {reason}"
            elif e.priority <= 0:
                status = "forced only"
            elif not auto_taken:
                status, auto_taken = "AUTO", True
            else:
                status = "available"
            rows.append((op, e.backend, str(e.priority), status, e.why))
        for backend in sorted({e.backend for e in entries} - {e.backend for e in ranked if arch in e.archs}):
            rows.append((op, backend, "-", f"not built for {arch}", ""))
    return rows


def format_table(arch: str, markdown: bool = False) -> str:
    header = ("op", "backend", "priority", f"on {arch}", "why")
    rows = table_rows(arch)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    out, last_op = [fmt.format(*header), fmt.format(*("-" * w for w in widths), "---")], None
    for r in rows:
        out.append(fmt.format(r[0] if r[0] != last_op else "", *r[1:]))
        last_op = r[0]
    return "\n".join(out)
