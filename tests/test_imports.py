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


def _imported_names(node: ast.Import | ast.ImportFrom, here: tuple[str, ...]) -> list[str]:
    """The absolute module names one import statement names (relative imports resolved against the package `here`;
    `from X import y` gives X, and X.y as well where y may be a submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = here[:len(here) - node.level + 1]
        base = ".".join((*parent, base) if base else parent)
    return [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in `path`, inside functions too."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).with_suffix("").parts
    here = rel[:-1]  # the package a relative import starts from (a module's or an __init__'s own)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out += [(node.lineno, name) for name in _imported_names(node, here)]
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


# ------------------------------------------------------------------------------ the CuTe anatomy (docs/contributing.md)


def _catches_import_error(node: ast.Try) -> bool:
    return any(isinstance(h.type, ast.Name) and h.type.id == "ImportError" for h in node.handlers)


def _cutlass_guard(node: ast.If) -> bool:
    """`if cutlass is not None:`, the block of a device helper's DSL-only definitions."""
    t = node.test
    return (isinstance(t, ast.Compare) and isinstance(t.left, ast.Name) and t.left.id == "cutlass"
            and isinstance(t.ops[0], ast.IsNot) and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value is None)


def _scoped_imports(path: Path) -> list[tuple[int, str, str | None, bool]]:
    """(line, absolute module name, enclosing function or None, runs unguarded on import) of every import statement
    in `path`. Guarded: inside a function, in a `try` that catches ImportError, or under `if cutlass is not None:`."""
    here = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = []

    def visit(nodes, func, eager):
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                out.extend((node.lineno, name, func, eager) for name in _imported_names(node, here))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, node.name, False)
            elif isinstance(node, ast.Try) and _catches_import_error(node):
                visit(node.body, func, False)
                visit([*node.handlers, *node.orelse, *node.finalbody], func, eager)
            elif isinstance(node, ast.If) and _cutlass_guard(node):
                visit(node.body, func, False)
                visit(node.orelse, func, eager)
            else:
                visit(ast.iter_child_nodes(node), func, eager)

    visit(ast.parse(path.read_text(), str(path)).body, None, True)
    return out


def _cute_host_modules() -> list[Path]:
    """Every CuTe module but the private ones (`_<kernel>_kernel.py`, `_compile.py`, `__init__.py`, ...)."""
    return [p for p in sorted((ROOT / "cute_ops").rglob("*.py")) if not p.name.startswith("_")]


def _unguarded_cutlass_imports(paths) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{line} {name}" for p in paths for line, name, _, eager in _scoped_imports(p)
            if eager and name.split(".")[0] == "cutlass"]


def _kernel_imports_outside_build(packages) -> list[str]:
    """'file:line module (function)' for every import of a `_<kernel>_kernel` module that is not inside a function
    named `build`."""
    bad = []
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, name, func, _ in _scoped_imports(path):
                kernel = any(part.startswith("_") and part.endswith("_kernel") for part in name.split("."))
                if name.startswith("cute_ops.") and kernel and func != "build":
                    bad.append(f"{path.relative_to(ROOT)}:{line} {name} ({func or 'module level'})")
    return bad


def test_cute_host_modules_import_no_cutlass_on_import():
    """A CuTe host module (config, rule, build, supports, entry functions) and a shared device helper import
    nvidia-cutlass-dsl only inside functions or guarded (try / `if cutlass is not None`), so `import dispatch`,
    `python -m dispatch` and the table's supports functions work without it."""
    hosts = _cute_host_modules()
    assert {"cute_ops/gemm/grouped_sm90.py", "cute_ops/gemm/blockscaled_sm100.py", "cute_ops/gemm/scheduler.py",
            "cute_ops/attention/fmha_sm90.py", "cute_ops/rmsnorm.py"} <= {str(p.relative_to(ROOT)) for p in hosts}
    bad = _unguarded_cutlass_imports(hosts)
    assert not bad, bad


def test_cute_kernel_modules_are_imported_by_build_only():
    kernels = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "cute_ops").rglob("_*_kernel.py"))
    assert {"cute_ops/gemm/_grouped_sm90_kernel.py", "cute_ops/gemm/_blockscaled_sm100_kernel.py"} <= set(kernels)
    bad = _kernel_imports_outside_build(("cute_ops", "dispatch", "perf"))
    assert not bad, bad


def test_the_anatomy_scan_tells_guarded_imports_from_eager_ones(tmp_path, monkeypatch):
    """The scan flags a module-level cutlass import and a kernel module imported outside `build`, and passes the
    guarded forms (a scan that flagged nothing could not fail)."""
    pkg = tmp_path / "cute_ops" / "fam"
    pkg.mkdir(parents=True)
    (pkg / "host.py").write_text(
        "import cutlass.cute\ntry:\n    import cutlass\nexcept ImportError:\n    cutlass = None\n"
        "if cutlass is not None:\n    from cutlass import Int32\nif True:\n    from cutlass import Float32\n\n"
        "def build():\n    import cutlass\n    from ._k_kernel import K\n\n"
        "def run():\n    from . import _k_kernel\n")
    (pkg / "other.py").write_text("from cute_ops.fam._k_kernel import K\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    paths = sorted(pkg.glob("*.py"))
    assert _unguarded_cutlass_imports(paths) == ["cute_ops/fam/host.py:1 cutlass.cute",
                                                 "cute_ops/fam/host.py:9 cutlass",
                                                 "cute_ops/fam/host.py:9 cutlass.Float32"]
    assert _kernel_imports_outside_build(("cute_ops",)) == [
        "cute_ops/fam/host.py:16 cute_ops.fam._k_kernel (run)",
        "cute_ops/fam/other.py:1 cute_ops.fam._k_kernel (module level)",
        "cute_ops/fam/other.py:1 cute_ops.fam._k_kernel.K (module level)"]
