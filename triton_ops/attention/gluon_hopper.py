"""Gluon's Hopper API as the sm_90 Gluon kernels (prefill_sm90.py, mla_sm90.py, mla_sm90_fp8.py) use it, imported
once. The API is absent or different in other Triton versions: then GLUON_IMPORT_ERROR says why, `gluon.jit` leaves
the functions plain Python (never compiled: the kernels' `supports_*` refuse the call first) and the other names
are None."""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # TMA load: `async_copy_global_to_shared` in 3.6, renamed `async_load` later (same leading arguments).
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # CTA-wide bar.sync: `thread_barrier` in 3.6, `barrier` later.
    cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    GLUON_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed Triton
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

    class _NoGluon:
        @staticmethod
        def jit(fn=None, **_):
            return fn if fn is not None else (lambda f: f)

    gluon = _NoGluon()
    gl = async_copy = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = tma_load = cta_barrier = None

__all__ = ["GLUON_IMPORT_ERROR", "TensorDescriptor", "async_copy", "cta_barrier", "fence_async_shared", "gl", "gluon",
           "mbarrier", "tma", "tma_load", "warpgroup_mma", "warpgroup_mma_wait"]
