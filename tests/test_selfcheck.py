"""`python -m dispatch check` (dispatch/selfcheck.py): a row compares the chosen backend with the reference, the
buffers an op writes included (whole, byte for byte); rows the reference alone serves are not counted as
passed; the table's columns line up; warnings raised while rows run stay out of the table.

The backends under test here are stand-ins (the reference, then one byte changed), so no Triton kernel runs:
the kernels' own bytes are what `python -m dispatch check` itself and the family tests compare."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from dispatch import registry, selfcheck
from dispatch.table import TABLE


def _entry(op: str, backend: str):
    return next(e for e in TABLE[op] if e.backend == backend)


def _replace_backend(monkeypatch, op: str, fake) -> None:
    """The backend the self-check runs for `op` on this machine (Triton: on the GPU or under the interpreter)
    becomes `fake`."""
    path, real = _entry(op, "triton").impl, registry._load
    monkeypatch.setattr(registry, "_load", lambda p: fake if p == path else real(p))


def _reference_then(op: str, corrupt):
    """A backend that runs the reference, then `corrupt(before, after)` on the first buffer the op writes (the
    whole storage as uint8, before and after the reference's write)."""
    reference = registry._load(_entry(op, "torch").impl)
    first_written = selfcheck.written_args(op)[0]

    def backend(*args):
        buffer = selfcheck.whole_buffer(args[first_written]).view(torch.uint8)
        before = buffer.clone()
        out = reference(*args)
        corrupt(before, buffer)
        return out
    return backend


def _flip_a_written_byte(before, after):
    i = int(torch.nonzero(before != after)[0])
    after[i] ^= 0x01


def _zero_a_kept_byte(before, after):  # bytes the write must keep: the poison (or the v heads around q and k)
    i = int(torch.nonzero(before == after)[-1])
    after[i] = 0


def _keep(before, after):
    pass


def _run(capsys, ops, **kw) -> tuple[int, list[str], str]:
    rc = selfcheck.run_selfcheck(ops=ops, **kw)
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith("op "))
    end = lines.index("", start)
    return rc, lines[start:end], out


@pytest.mark.parametrize("op", ["ds_kv_write", "paged_kv_write_fp8", "rope_"])
@pytest.mark.parametrize("corrupt", [_flip_a_written_byte, _zero_a_kept_byte, _keep])
def test_a_row_of_an_in_place_op_compares_every_written_byte(op, corrupt, monkeypatch, capsys):
    _replace_backend(monkeypatch, op, _reference_then(op, corrupt))
    rc, table, out = _run(capsys, [op])
    rows = table[2:]
    n = sum(c.op == op for c in selfcheck.all_cases())
    assert len(rows) == n
    if corrupt is _keep:
        assert rc == 0 and all(" ok " in r and " 0 of " in r for r in rows), out
        assert out.rstrip().endswith(f"{n} of {n} checked rows passed; 0 reference only"), out
    else:
        assert rc == 1 and all(" FAIL " in r and ": 1 of " in r for r in rows), out
        assert out.rstrip().endswith(f"0 of {n} checked rows passed; 0 reference only"), out


def test_reference_only_rows_are_not_counted_as_passed(monkeypatch, capsys, tmp_path):
    _replace_backend(monkeypatch, "ds_kv_write", _reference_then("ds_kv_write", _keep))
    ops = ["swizzle_scales_128x4", "unswizzle_scales_128x4", "ds_kv_write"]
    rc, table, out = _run(capsys, ops, json_path=str(tmp_path / "check.json"))
    assert rc == 0
    assert out.rstrip().endswith("2 of 2 checked rows passed; 2 reference only"), out
    ref_rows = [r for r in table if "swizzle" in r]
    assert len(ref_rows) == 2 and all(" torch " in r and " reference only " in r for r in ref_rows), table
    records = json.loads((tmp_path / "check.json").read_text())
    assert [(r["op"], r["status"], r["ok"]) for r in records if "swizzle" in r["op"]] == [
        ("swizzle_scales_128x4", "reference only", False), ("unswizzle_scales_128x4", "reference only", False)]
    forced = "auto" if torch.cuda.is_available() else "triton"
    assert f"backend '{forced}'" in out.split("\nop ")[0]  # the header says which backend the rows run


def _column_spans(header: str) -> list[tuple[int, int]]:
    names = ["op", "case", "backend", "result", "ms/call", "error"]
    starts = [header.index(n) if n == "op" else header.index("  " + n) + 2 for n in names]
    return [(s, s + len(n)) for s, n in zip(starts, names, strict=True)]


def test_the_table_is_aligned(monkeypatch, capsys):
    _replace_backend(monkeypatch, "ds_kv_write", _reference_then("ds_kv_write", _keep))
    _replace_backend(monkeypatch, "rope_", _reference_then("rope_", _flip_a_written_byte))
    _, table, out = _run(capsys, ["swizzle_scales_128x4", "rope_", "ds_kv_write", "moe_gemm_fp4_prepack"])
    header, dashes, rows = table[0], table[1], table[2:]
    assert set(dashes) == {"-"} and len(dashes) == len(header) and len(rows) == 5
    (op, _), (case, _), (backend, _), (result, _), (_, ms_end), (error, _) = _column_spans(header)
    for row in rows:
        for start in (case, backend, result, error):  # left-aligned columns start where their header does
            assert row[start - 2:start] == "  " and row[start] != " ", f"column at {start}:\n{header}\n{row}"
        assert row[ms_end - 1] != " " and row[ms_end:ms_end + 2] == "  ", f"ms/call:\n{header}\n{row}"
        assert row[0] != " "


def test_warnings_stay_out_of_the_table(monkeypatch, capsys):
    reference = _reference_then("ds_kv_write", _keep)

    def noisy(*args):
        warnings.warn("overflow encountered in cast", RuntimeWarning, stacklevel=1)
        return reference(*args)
    _replace_backend(monkeypatch, "ds_kv_write", noisy)
    rc, table, out = _run(capsys, ["ds_kv_write"])
    assert rc == 0 and not any("Warning" in r for r in table)
    assert "RuntimeWarning: overflow encountered in cast" in out.split("\n\n")[-1]
    assert "overflow" not in capsys.readouterr().err
