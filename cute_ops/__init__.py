"""CuTeDSL kernels (optional: `pip install lowbit[cute]`, i.e. nvidia-cutlass-dsl + apache-tvm-ffi).

Importing lowbit never requires nvidia-cutlass-dsl: the dispatch table asks `unavailable_reason()` and
marks the cute backend unavailable, with the reason, when the DSL (or TVM-FFI, which every cute launch goes
through) cannot be imported. With them installed, the cute rows of dispatch/table.py appear for their archs.

Modules: `_compile` (in-memory + on-disk compile cache, compile target), `_sass` (keep PTX/cubin and
disassemble, for tests), `rmsnorm` (RMSNorm + FP8-group / NVFP4 quant: host side), `_rmsnorm_kernel`
(the kernel). See docs/cute.md.
"""

from __future__ import annotations

import functools
import importlib


@functools.cache
def unavailable_reason() -> str | None:
    for module, why in (("cutlass", "nvidia-cutlass-dsl"), ("cutlass.cute", "nvidia-cutlass-dsl"),
                        ("tvm_ffi", "apache-tvm-ffi (cute kernels launch through TVM-FFI)")):
        try:
            importlib.import_module(module)
        except Exception as exc:  # optional dependency: report why, never fall back silently
            return f"{why} not importable ({type(exc).__name__}: {exc}); pip install 'lowbit[cute]'"
    return None
