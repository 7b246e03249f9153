"""lowbit's public API and dispatch table.

    from dispatch import ops
    codes, scales, gs = ops.nvfp4_quantize(x)                  # auto backend
    ops.fp8_group_quantize(x, backend="torch")                 # forced
    with dispatch.use_backend("triton"): ...                   # scoped
    LOWBIT_BACKEND="nvfp4_quantize=torch"                      # env

`python -m dispatch` prints the table for this machine (`--arch sm_100` for another).
"""

from triton_ops.contract.arch import resolve_arch

from . import ops
from .registry import BackendError, use_backend
from .table import TABLE

__all__ = ["TABLE", "BackendError", "ops", "resolve_arch", "use_backend"]
