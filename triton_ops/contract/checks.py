"""Input checks shared by every op: each error names the op and the argument.

These run in the public op (before backend choice), so every backend sees validated input and the error
is the same whichever backend would have run. Backend-specific limits live in each backend's `supports_*`.
"""

from __future__ import annotations

import torch

FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)


class LowbitInputError(ValueError):
    pass


def fail(op: str, arg: str, msg: str) -> None:
    raise LowbitInputError(f"lowbit.{op}: argument '{arg}': {msg}")


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_dtype(op: str, arg: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        fail(op, arg, f"dtype {str(t.dtype).removeprefix('torch.')} is not supported; expected {_names(allowed)}")


def check_tensor(op: str, arg: str, t, *, optional: bool = False) -> None:
    """t must be a torch.Tensor (None too when optional): floats, lists and arrays get the named error here,
    before any attribute of them is read. Every op's checks start with this for each tensor argument."""
    if optional and t is None:
        return
    if not isinstance(t, torch.Tensor):
        fail(op, arg, f"expected a torch.Tensor{' or None' if optional else ''}, got {type(t).__name__}")


def check_no_grad(op: str, *tensors, **named) -> None:
    """lowbit ops are inference-only: they have no backward, and the Triton / CuTe kernels would silently drop
    the autograd graph. So while grad mode is on (torch.is_grad_enabled()), no input may require grad. Inputs:
    `name=tensor` keywords (the error names the argument), `(name, tensor)` pairs, or bare tensors (named by
    position); None and non-tensors are skipped. Under torch.no_grad() / torch.inference_mode() it passes."""
    if not torch.is_grad_enabled():
        return
    items = [t if isinstance(t, tuple) else (f"#{i}", t) for i, t in enumerate(tensors)]
    for arg, t in (*items, *named.items()):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            fail(op, arg, "requires grad, but lowbit ops are inference-only (no backward: the result would be "
                          "silently detached); call under torch.no_grad() or torch.inference_mode(), or pass "
                          ".detach()")


def check_index_range(op: str, arg: str, t: torch.Tensor, lo: int, hi: int, what: str) -> None:
    """Values of integer tensor t must lie in [lo, hi). Reads the values: callers run it only where that costs no
    device sync (host tensors) or where the user asked for it (LOWBIT_CHECK_INDICES=1)."""
    if t.numel() == 0:
        return
    tmin, tmax = int(t.min()), int(t.max())
    if tmin < lo or tmax >= hi:
        fail(op, arg, f"values span [{tmin}, {tmax}] but must lie in [{lo}, {hi}) ({what})")


def check_min_dims(op: str, arg: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() < ndim:
        fail(op, arg, f"expected at least {ndim} dim(s), got shape {tuple(t.shape)}")


def check_last_dim_multiple(op: str, arg: str, t: torch.Tensor, multiple: int, what: str) -> None:
    k = t.shape[-1]
    if k % multiple:
        fail(op, arg, f"last dim {k} is not a multiple of {multiple} ({what})")


def check_same_device(op: str, ref_arg: str, ref: torch.Tensor, arg: str, t: torch.Tensor) -> None:
    if t.device != ref.device:
        fail(op, arg, f"is on {t.device} but '{ref_arg}' is on {ref.device}")


def check_scalar_tensor(op: str, arg: str, t: torch.Tensor, dtype=torch.float32) -> None:
    if t.numel() != 1 or t.dim() > 1:
        fail(op, arg, f"expected a one-element tensor of shape () or (1,), got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        fail(op, arg, f"dtype {str(t.dtype).removeprefix('torch.')} is not supported; expected {_names([dtype])}")


def rows_view(op: str, arg: str, t: torch.Tensor) -> torch.Tensor:
    """View t as [rows, last] without copying, or explain why the kernel cannot take its strides.

    Kernels take one row stride and a unit stride along the last dim. Leading dims must therefore collapse
    into one evenly strided row index (true for contiguous tensors, row slices x[:, :k] of wider buffers,
    and x[::2] style row steps).
    """
    last = t.shape[-1]
    if t.numel() == 0:
        return t.reshape(-1, last) if last else t.reshape(0, 0)
    if last > 1 and t.stride(-1) != 1:
        fail(op, arg, f"the last dim must be contiguous (stride 1), got strides {t.stride()}; call .contiguous()")
    try:
        return t.view(-1, last)
    except RuntimeError:
        fail(op, arg, f"leading dims of shape {tuple(t.shape)} with strides {t.stride()} do not collapse "
                      "into one row stride; call .contiguous()")
    raise AssertionError("unreachable")
