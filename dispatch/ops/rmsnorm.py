"""RMSNorm ops (plain, and with a fused FP8-group / MXFP4 / NVFP4 output): torch.library registration, fakes,
typed public API. Contract: dispatch/reference/rmsnorm.py; docs: docs/rmsnorm.md.

Residual: the ops are functional. With `residual`, they return the new residual dtype(x + residual) as a
fresh tensor (vLLM's fused_add_rms_norm writes it into `residual` in place instead). Same traffic, no
aliasing, nothing for torch.compile to functionalize. Without one, the residual output is an empty tensor
at the torch-op level and None in the public wrappers.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from triton_ops.contract import checks as C

from ._common import call, lowbit_op
from ._quant_outputs import _check_quant_args, _check_x, _fake_quant
from .quant import FP8GroupQuantized, MXFP4Quantized, NVFP4Quantized, ScaleLayout, _layout_flag

# ------------------------------------------------------------------------------------------------ checks


def _check_rms(op, x, weight, residual, eps, weight_offset, quant="none", qargs=()):
    C.check_tensor(op, "x", x)
    C.check_tensor(op, "weight", weight)
    C.check_tensor(op, "residual", residual, optional=True)
    gs = qargs[0] if quant == "nvfp4" else None
    C.check_tensor(op, "global_scale", gs, optional=True)
    C.check_no_grad(op, x=x, weight=weight, residual=residual, global_scale=gs)
    _check_x(op, x)
    n = x.shape[-1]
    C.check_dtype(op, "weight", weight, C.FLOAT_INPUTS)
    C.check_same_device(op, "x", x, "weight", weight)
    if tuple(weight.shape) != (n,):
        C.fail(op, "weight", f"expected shape ({n},) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if residual is not None:
        C.check_same_device(op, "x", x, "residual", residual)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            C.fail(op, "residual", f"must match x ({tuple(x.shape)}, {x.dtype}); got "
                                   f"({tuple(residual.shape)}, {residual.dtype})")
        C.rows_view(op, "residual", residual)
    if not (eps >= 0 and math.isfinite(eps)):
        C.fail(op, "eps", f"must be finite and >= 0, got {eps}")
    if not math.isfinite(weight_offset):
        C.fail(op, "weight_offset", f"must be finite, got {weight_offset}")
    _check_quant_args(op, x, n, quant, qargs)


def _rms_check(op: str, quant: str = "none"):
    """The check of op `op`: it takes the op's arguments (without `backend`); those after weight_offset are the
    quantized output's (`qargs` of _check_quant_args)."""
    def check(x, weight, residual, eps, weight_offset, *qargs):
        _check_rms(op, x, weight, residual, eps, weight_offset, quant, qargs)
    check.__name__ = check.__qualname__ = f"_check_{op}"
    return check


def _fake_res(x, residual):
    return x.new_empty(x.shape) if residual is not None else x.new_empty(0)


def _with_res(outputs: tuple, x: Tensor, *_) -> tuple:
    """The op's outputs with a 0-element tensor for the new residual where the backend returned None (the
    schema needs a Tensor; backends skip that allocation because the eager fast path returns their outputs
    to the public wrappers, which turn it into None anyway). Every op's `finish` (the op's other arguments
    are not needed)."""
    if outputs[-1] is not None:
        return outputs
    return (*outputs[:-1], x.new_empty(0))


# ------------------------------------------------------------------------------------------ RMSNorm ops


@lowbit_op("rms_norm", mutates_args=(), check=_rms_check("rms_norm"), finish=_with_res)
def _rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
              backend: str) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), _fake_res(x, residual)


@lowbit_op("rms_norm_fp8_group", mutates_args=(), check=_rms_check("rms_norm_fp8_group", "fp8_group"),
           finish=_with_res)
def _rms_norm_fp8_group(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
                        group_size: int, quant_eps: float, ue8m0: bool, column_major: bool,
                        backend: str) -> tuple[Tensor, Tensor, Tensor]:
    q = (group_size, quant_eps, ue8m0, column_major)
    return (*_fake_quant(x, tuple(x.shape[:-1]), x.shape[-1], "fp8_group", q), _fake_res(x, residual))


@lowbit_op("rms_norm_mxfp4", mutates_args=(), check=_rms_check("rms_norm_mxfp4", "mxfp4"), finish=_with_res)
def _rms_norm_mxfp4(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
                    rounding: str, swizzle: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return (*_fake_quant(x, tuple(x.shape[:-1]), x.shape[-1], "mxfp4", (rounding, swizzle)),
            _fake_res(x, residual))


@lowbit_op("rms_norm_nvfp4", mutates_args=(), check=_rms_check("rms_norm_nvfp4", "nvfp4"), finish=_with_res)
def _rms_norm_nvfp4(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
                    global_scale: Tensor | None, swizzle: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (*_fake_quant(x, tuple(x.shape[:-1]), x.shape[-1], "nvfp4", (global_scale, swizzle)),
            _fake_res(x, residual))


class RMSNormOutput(NamedTuple):
    out: Tensor  # normalized x, x.dtype
    residual: Tensor | None  # dtype(x + residual): the next layer's residual (None without a residual)


class RMSNormQuantOutput(NamedTuple):
    quantized: NamedTuple  # FP8GroupQuantized / MXFP4Quantized / NVFP4Quantized of the rounded output
    residual: Tensor | None


def _res(r: Tensor, residual: Tensor | None) -> Tensor | None:
    return r if residual is not None else None


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None,
             weight_offset: float = 0.0, backend: str = "auto") -> RMSNormOutput:
    """y = x * rsqrt(mean(x^2) + eps) * (weight + weight_offset) over the last dim (fp32 math, exact IEEE
    ops, fp64 sum of squares: see docs/rmsnorm.md). With `residual`, normalizes h = x + residual and also
    returns h (the new residual). weight_offset=1.0 is Gemma's (1 + w).
    Inference only (every rms_norm variant): with grad mode on, inputs that require grad (an nn.Parameter
    weight included) are refused (LowbitInputError); call under torch.no_grad() / torch.inference_mode()."""
    y, r = call("rms_norm", x, weight, residual, float(eps), float(weight_offset), backend)
    return RMSNormOutput(y, _res(r, residual))


def rms_norm_fp8_group(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None,
                       weight_offset: float = 0.0, group_size: int = 128, quant_eps: float = 1e-10,
                       ue8m0: bool = False, column_major_scales: bool = False,
                       backend: str = "auto") -> RMSNormQuantOutput:
    """rms_norm, rounded to x.dtype, then FP8 per-token-group quantized (ops.fp8_group_quantize), one pass."""
    c, s, r = call("rms_norm_fp8_group", x, weight, residual, float(eps), float(weight_offset),
                                                  group_size, float(quant_eps), ue8m0, column_major_scales, backend)
    return RMSNormQuantOutput(FP8GroupQuantized(c, s), _res(r, residual))


def rms_norm_mxfp4(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None,
                   weight_offset: float = 0.0, rounding: Literal["floor", "rceil"] = "floor",
                   scale_layout: ScaleLayout = "linear", backend: str = "auto") -> RMSNormQuantOutput:
    """rms_norm, rounded to x.dtype, then MXFP4 quantized (ops.mxfp4_quantize), one pass."""
    swizzle = _layout_flag("rms_norm_mxfp4", scale_layout)
    c, s, r = call("rms_norm_mxfp4", x, weight, residual, float(eps), float(weight_offset), rounding,
                                              swizzle, backend)
    return RMSNormQuantOutput(MXFP4Quantized(c, s), _res(r, residual))


def rms_norm_nvfp4(x: Tensor, weight: Tensor, eps: float = 1e-6, *, residual: Tensor | None = None,
                   weight_offset: float = 0.0, global_scale: Tensor | None = None,
                   scale_layout: ScaleLayout = "linear", backend: str = "auto") -> RMSNormQuantOutput:
    """rms_norm, rounded to x.dtype, then NVFP4 quantized (ops.nvfp4_quantize). global_scale=None computes
    amax(y)/2688 on the device: two launches (amax pass, then norm+quantize), no host sync. A global scale below
    2^-118 in magnitude quantizes to zeros (see nvfp4_quantize)."""
    swizzle = _layout_flag("rms_norm_nvfp4", scale_layout)
    c, s, g, r = call("rms_norm_nvfp4", x, weight, residual, float(eps), float(weight_offset),
                                                 global_scale, swizzle, backend)
    return RMSNormQuantOutput(NVFP4Quantized(c, s, g), _res(r, residual))


# ------------------------------------------------------------------------------------------ self-check


def self_check_cases() -> list:
    """Cases for `python -m dispatch check` (see dispatch/selfcheck.py)."""
    from ..selfcheck import Case, exact
    from ..selfcheck import sample_activations as _x

    def w(dev, k):
        g = torch.Generator().manual_seed(1)
        return (1 + 0.1 * torch.randn(k, generator=g)).to(dev, torch.bfloat16)

    def rms(dev, small):
        x = _x(dev, small)
        return (x, w(dev, x.shape[-1]), _x(dev, small).flip(0), 1e-6, 0.0)

    def rms_fp8(dev, small):
        x = _x(dev, small)
        return (x, w(dev, x.shape[-1]), None, 1e-6, 0.0, 128, 1e-10, False, True)

    def rms_mx(dev, small):
        x = _x(dev, small)
        return (x, w(dev, x.shape[-1]), x.flip(0), 1e-6, 1.0, "rceil", True)

    def rms_nv(dev, small):
        x = _x(dev, small)
        return (x, w(dev, x.shape[-1]), None, 1e-6, 0.0, None, True)

    return [
        Case("rms_norm", rms, exact, label="bf16 + residual"),
        Case("rms_norm_fp8_group", rms_fp8, exact, label="g128, column-major scales"),
        Case("rms_norm_mxfp4", rms_mx, exact, label="rceil, swizzled, residual, 1+w"),
        Case("rms_norm_nvfp4", rms_nv, exact, label="computed global scale, swizzled"),
    ]
