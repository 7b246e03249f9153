"""The dependency direction: dispatch (API, table, references) -> kernels (triton_ops, cute_ops) -> contract.

Each kernel module is imported in a fresh interpreter and must pull in neither `dispatch` nor any other op
family's registration; the contract imports nothing of lowbit's (and not Triton)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("dispatch", "triton_ops", "cute_ops", "perf")


def _modules(package: str) -> list[str]:
    names = []
    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
        names.append(info.name)
    return sorted(names)


def _loaded_after_import(module: str) -> list[str]:
    code = (f"import sys, json; import {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {OURS!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        if "ModuleNotFoundError: No module named 'cutlass'" in out.stderr:
            pytest.skip(f"{module} needs nvidia-cutlass-dsl")
        raise AssertionError(f"import {module} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


CONTRACT = [m for m in _modules("triton_ops") if m.startswith("triton_ops.contract")]
KERNELS = [m for m in _modules("triton_ops") + _modules("cute_ops") if not m.startswith("triton_ops.contract")]


@pytest.mark.parametrize("module", CONTRACT)
def test_contract_imports_nothing_of_ours(module):
    loaded = _loaded_after_import(module)
    foreign = [m for m in loaded if not m.startswith("triton_ops.contract") and m != "triton_ops"]
    assert not foreign, f"{module} imports {foreign}"
    code = f"import sys; import {module}; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", f"{module} imports triton"


@pytest.mark.parametrize("module", KERNELS)
def test_kernel_modules_do_not_import_dispatch(module):
    loaded = _loaded_after_import(module)
    assert not [m for m in loaded if m.split(".")[0] in ("dispatch", "perf")], f"{module} imports {loaded}"


def test_dispatch_import_registers_nothing_eagerly():
    """`import dispatch` registers the torch ops but imports no kernel module (the table names them as strings,
    loaded on first use)."""
    loaded = _loaded_after_import("dispatch")
    kernels = [m for m in loaded if m.split(".")[0] in ("triton_ops", "cute_ops")
               and not m.startswith("triton_ops.contract") and m not in ("triton_ops", "cute_ops")]
    assert not kernels, f"import dispatch loaded kernel modules {kernels}"


def test_dispatch_import_imports_no_triton():
    """`import dispatch` leaves Triton unimported: `python -m dispatch check` turns the interpreter on
    (TRITON_INTERPRET) after the package is imported, and Triton must not have read its settings before."""
    code = "import sys, dispatch; print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"import dispatch imported {out.stdout.strip()}"
