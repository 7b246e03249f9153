"""Docs and product code describe the product, not its history: no commit-hash-like tokens.

Allowed: record paths under perf/results/ (records are named by date and commit), and markdown table rows in docs
(a measured table's run column, an "alternatives measured" table's code-at column). Everything else that looks like
an abbreviated or full commit hash fails, with the file, line and token.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# 7-40 lowercase hex digits with at least one digit and one letter a-f: commit hashes, not words or plain numbers.
HASH_LIKE = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
FLOAT_LITERAL = re.compile(r"[0-9]*\.[0-9]+(?:e[+-]?[0-9]+)?")  # 1.2676506002282294e30, 5.877471754111438e-39
RECORD_PATH = re.compile(r"perf/results/[\w./*<>-]*")

# Hex-looking tokens that are not commits (none needed today; add one with a comment saying what it is).
ALLOWED_TOKENS: frozenset[str] = frozenset()

# Files other branches are rewriting; checked once those land (empty this tuple then).
PENDING_FILES: tuple[str, ...] = ()

CODE_SUFFIXES = (".py", ".h", ".cpp", ".sh")


def _pending(rel: str) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in PENDING_FILES)


def _product_code() -> list[Path]:
    files = [p for pkg in ("triton_ops", "cute_ops", "dispatch") for p in (ROOT / pkg).rglob("*")
             if p.suffix in CODE_SUFFIXES]
    files += [p for p in (ROOT / "perf").glob("*") if p.suffix in CODE_SUFFIXES]
    files += list((ROOT / "perf" / "cases").glob("*.py"))
    return sorted(files)


def _docs() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def hash_tokens(line: str) -> list[str]:
    """Commit-hash-like tokens of one line, record paths removed."""
    text = FLOAT_LITERAL.sub(" ", RECORD_PATH.sub(" ", line))
    return [t for t in HASH_LIKE.findall(text) if t not in ALLOWED_TOKENS]


def findings(path: Path, *, skip_tables: bool) -> list[str]:
    label = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if skip_tables and line.lstrip().startswith("|"):
            continue
        out += [f"{label}:{n}: {t}" for t in hash_tokens(line)]
    return out


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", [p for p in _product_code() if not _pending(_rel(p))], ids=_rel)
def test_product_code_names_no_commits(path):
    assert findings(path, skip_tables=False) == []


@pytest.mark.parametrize("path", [p for p in _docs() if not _pending(_rel(p))], ids=_rel)
def test_docs_prose_names_no_commits(path):
    assert findings(path, skip_tables=True) == []


def test_pending_files_exist():
    """A pending entry that names nothing would hide nothing and stay forever: every one must exist."""
    assert [p for p in PENDING_FILES if not (ROOT / p).exists()] == []


@pytest.mark.parametrize("line, tokens", [
    ("measured at 7aea59e on the H200", ["7aea59e"]),
    ("timed best (H200, 0818b2c / 2e20168)", ["0818b2c", "2e20168"]),
    ("full hash 660f7acbbdc38b8ec47e6b36e6bde7ec7c9ad5b5 here", ["660f7acbbdc38b8ec47e6b36e6bde7ec7c9ad5b5"]),
    ("record `perf/results/experiments/2026-11-21-h200-quant-tiles-c64e7d3.json`", []),
    ("x * 1.2676506002282294e30, 5.877471754111438e-39, mask 0x01C00000, -9223372036854775807", []),
    ("a decade, the facade, 1234567 rows", []),
])
def test_hash_tokens(line, tokens):
    assert hash_tokens(line) == tokens


def test_table_rows_may_name_commits(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("prose\n| alternative | result | record | code at |\n| tiles | 1.1x | - | 735d455 |\n")
    assert findings(doc, skip_tables=True) == [] and len(findings(doc, skip_tables=False)) == 1
