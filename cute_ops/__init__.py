"""CuTeDSL kernels (optional: `pip install lowbit[cute]`).

Importing lowbit never requires nvidia-cutlass-dsl: the dispatch table asks `unavailable_reason()` and
marks the cute backend unavailable, with the reason, when the DSL cannot be imported. No cute kernels are
registered yet (issue: CuTeDSL toolchain and RMSNorm escape hatch).
"""

from __future__ import annotations

import functools
import importlib


@functools.cache
def unavailable_reason() -> str | None:
    try:
        importlib.import_module("cutlass")
        importlib.import_module("cutlass.cute")
    except Exception as exc:  # optional dependency: report why, never fall back silently
        return f"nvidia-cutlass-dsl not importable ({type(exc).__name__}: {exc}); pip install 'lowbit[cute]'"
    return None
