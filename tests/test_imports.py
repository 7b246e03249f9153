"""The dependency direction: perf -> dispatch (API, table, references, compositions) -> kernels (triton_ops,
cute_ops) -> contract.

Each kernel module is imported in a fresh interpreter and must pull in neither `dispatch` nor any other op
family's registration; the contract imports nothing of lowbit's (and not Triton). A static scan of every import
statement (inside functions too): no backend imports the other (cute_ops imports only triton_ops.contract of
triton_ops), neither imports dispatch, and perf imports only dispatch and the contract."""

from __future__ import annotations

import ast
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
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {OURS!r} or m == 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        if "ModuleNotFoundError: No module named 'cutlass'" in out.stderr:
            pytest.skip(f"{module} needs nvidia-cutlass-dsl")
        raise AssertionError(f"import {module} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


CONTRACT = [m for m in _modules("triton_ops") if m.startswith("triton_ops.contract")]


@pytest.mark.parametrize("module", CONTRACT)
def test_contract_imports_nothing_of_ours(module):
    loaded = _loaded_after_import(module)
    foreign = [m for m in loaded if not m.startswith("triton_ops.contract") and m != "triton_ops"]
    assert not foreign, f"{module} imports {foreign}"
    assert "triton" not in loaded, f"{module} imports triton"


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


# ------------------------------------------------------------------------------ static scan of every import statement


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in `path` (relative imports resolved against the
    module's package; `from X import y` gives X, and X.y as well where y may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).with_suffix("").parts
    here = rel[:-1]  # the package a relative import starts from (a module's or an __init__'s own)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[:len(here) - node.level + 1]
                base = ".".join((*parent, base) if base else parent)
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    assert package == rel[0]
    return out


def _foreign_imports(package: str, allowed) -> list[str]:
    """'file:line module' for every import under `package` of one of our top-level packages that `allowed`
    (absolute module name -> bool) refuses."""
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, module in _imports(path, package):
            top = module.split(".")[0]
            if top in OURS and top != package and not allowed(module):
                bad.append(f"{path.relative_to(ROOT)}:{line} {module}")
    return bad


def _contract(module: str) -> bool:
    return module == "triton_ops.contract" or module.startswith("triton_ops.contract.")


def test_cute_ops_imports_only_the_contract_of_ours():
    bad = _foreign_imports("cute_ops", _contract)
    assert not bad, bad


def test_triton_ops_imports_neither_cute_ops_nor_dispatch():
    bad = _foreign_imports("triton_ops", lambda m: False)
    assert not bad, bad


def test_perf_imports_only_dispatch_and_the_contract():
    bad = _foreign_imports("perf", lambda m: m.split(".")[0] == "dispatch" or _contract(m))
    assert not bad, bad


def test_the_scan_sees_each_kind_of_import(tmp_path, monkeypatch):
    """The scan resolves relative imports and sees imports inside functions (a scan that missed them could not
    fail)."""
    pkg = tmp_path / "cute_ops" / "sub"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text("import os\nfrom ..x import y\n\ndef f():\n    from triton_ops.moe import align\n"
                              "    import dispatch.ops\n    from triton_ops.contract import arch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _foreign_imports("cute_ops", _contract) == ["cute_ops/sub/m.py:5 triton_ops.moe",
                                                      "cute_ops/sub/m.py:5 triton_ops.moe.align",
                                                      "cute_ops/sub/m.py:6 dispatch.ops"]
