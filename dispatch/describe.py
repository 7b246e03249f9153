"""Render the dispatch table for one arch (used by `python -m dispatch` and the README)."""

from __future__ import annotations

from .registry import Entry, backend_unavailable
from .table import BLACKWELL_ARCHS, CUTE_UNRUN_ON_BLACKWELL, TABLE, TRITON_UNRUN_ON_BLACKWELL


def hardware_status(entry: Entry, arch: str) -> str:
    """What is known of `entry` on `arch`'s silicon where it needs saying, else "": a row that auto may take there but
    that has never run on that chip (Triton rows on Blackwell: compiled and SASS-checked in CI only; CuTe rows: the
    same, and refused there unless LOWBIT_CUTE_UNVERIFIED=1)."""
    if entry.backend == "triton" and arch in BLACKWELL_ARCHS and arch in entry.archs:
        return TRITON_UNRUN_ON_BLACKWELL
    if entry.backend == "cute" and arch in BLACKWELL_ARCHS and arch in entry.archs:
        return CUTE_UNRUN_ON_BLACKWELL
    return ""


def auto_candidates(op: str, arch: str) -> list[tuple[str, str | None]]:
    """The backends `backend="auto"` tries for `op` on `arch`, best first (registry.select's order: the rows built for
    `arch` with a positive priority), each with its row's per-shape `auto_skip` preference ("module:function") or
    None. Host availability is not consulted: a caller holding benchmark records knows which backends ran there."""
    ranked = sorted(TABLE.get(op, []), key=lambda e: -e.priority)
    return [(e.backend, e.auto_skip) for e in ranked if arch in e.archs and e.priority > 0]


def table_rows(arch: str) -> list[tuple[str, str, str, str, str]]:
    """(op, backend, rank, status on `arch`, why) with the entry auto picks first, per op."""
    return [row[:4] + row[5:] for row in _rows(arch)]


def _rows(arch: str) -> list[tuple[str, str, str, str, str, str]]:
    """(op, backend, rank, status on `arch`, hardware status on `arch`, why)."""
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
            rows.append((op, e.backend, str(e.priority), status, hardware_status(e, arch), e.why))
        for backend in sorted({e.backend for e in entries} - {e.backend for e in ranked if arch in e.archs}):
            rows.append((op, backend, "-", f"not built for {arch}", "", ""))
    return rows


def format_table(arch: str, markdown: bool = False) -> str:
    """The table for `arch`; a "hardware" column (between status and why) only where some row has one (Blackwell)."""
    rows = _rows(arch)
    hardware = any(r[4] for r in rows)
    header = ("op", "backend", "priority", f"on {arch}", *((f"hardware ({arch})",) if hardware else ()), "why")
    rows = [r if hardware else r[:4] + r[5:] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    padded = len(header) - 1  # every column but `why` is padded
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(padded)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    out, last_op = [fmt.format(*header), fmt.format(*("-" * w for w in widths), "---")], None
    for r in rows:
        out.append(fmt.format(r[0] if r[0] != last_op else "", *r[1:]))
        last_op = r[0]
    return "\n".join(out)
