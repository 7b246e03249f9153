"""Reference RMSNorm (optionally with a fused residual add and a quantized output). This is the contract.

Math, in this order:

    h    = dtype(fp32(x) + fp32(residual))          (only with a residual; h is also the new residual)
    ss   = sum over the row of fp64(h)^2             (fp64: squares of bf16/fp16/fp32 values are exact there)
    rstd = fp32(1 / sqrt(ss / N + fp32(eps)))        (evaluated in fp64, ONE rounding to fp32)
    y    = dtype((fp32(h) * rstd) * (fp32(w) + fp32(weight_offset)))     (fp32 IEEE multiplies)

Why fp64 up to rstd: a fp32 sum depends on the reduction order (torch CPU, torch CUDA and a Triton tree all
differ), and fp32 sqrt / rsqrt are not correctly rounded everywhere (CUDA's rsqrtf is ~2 ulp; torch's CPU
sqrt was measured 0.6 ulp off). Evaluated in fp64, every backend's value sits within a few fp64 ulps of
the exact one, so its fp32 rounding is the same on all of them unless the exact value lies within ~2^-50
(relative) of an fp32 rounding boundary: about one row in 10^8, and even then y changes only where it also
sits on an output-dtype boundary. Tests compare bytes exactly.

The quantized variants are the foundation primitives (dispatch/reference/quant.py) applied to y *after*
it is rounded to x.dtype: fused bytes == unfused `rms_norm` then quantize, exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import quant as Q

RMS_QUANTS = ("none", "fp8_group", "mxfp4", "nvfp4")


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
             weight_offset: float = 0.0) -> tuple[Tensor, Tensor | None]:
    """(y, new_residual): y in x.dtype; new_residual = dtype(x + residual), or None without a residual."""
    if residual is not None:
        h = (x.float() + residual.float()).to(x.dtype)
        new_residual = h
    else:
        h, new_residual = x, None
    n = x.shape[-1]
    hf = h.float()
    if n == 0 or h.numel() == 0:
        return torch.empty_like(x), new_residual
    ss = h.double().square().sum(-1, keepdim=True)
    eps32 = float(torch.tensor(eps, dtype=torch.float32))  # kernels receive eps as an fp32 scalar
    rstd = (1.0 / torch.sqrt(ss / n + eps32)).float()
    w = weight.float() + weight_offset
    y = ((hf * rstd) * w).to(x.dtype)
    return y, new_residual


def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, weight_offset: float,
                   quant: str, **quant_kwargs) -> tuple:
    """rms_norm then the foundation quantizer on the rounded y; returns (*quantized outputs, new_residual).

    quant="none":      (y, new_residual)
    quant="fp8_group": (codes, scales, new_residual)          kwargs: group_size, quant_eps, ue8m0, column_major
    quant="mxfp4":     (codes, scales, new_residual)          kwargs: rounding, swizzle
    quant="nvfp4":     (codes, scales, global_scale, new_residual)  kwargs: global_scale (None = amax of y
                       over the whole tensor / 2688), swizzle
    """
    y, new_residual = rms_norm(x, weight, eps, residual, weight_offset)
    if quant == "none":
        return y, new_residual
    return (*quantize_output(y, quant, **quant_kwargs), new_residual)


def quantize_output(y: Tensor, quant: str, **kw) -> tuple:
    """The foundation reference quantizer for `quant`, with lowbit's argument conventions."""
    if quant == "fp8_group":
        return Q.fp8_group_quantize(y, kw.get("group_size", 128), kw.get("quant_eps", 1e-10), kw.get("ue8m0", False),
                                    kw.get("column_major", False))
    if quant == "mxfp4":
        return Q.mxfp4_quantize(y, kw.get("rounding", "floor"), kw.get("swizzle", False))
    if quant == "nvfp4":
        return Q.nvfp4_quantize(y, kw.get("global_scale"), kw.get("swizzle", False))
    raise ValueError(f"unknown quant {quant!r}; expected one of {', '.join(RMS_QUANTS)}")


# ----------------------------------------------------------------- backend entry points (dispatch table)
# Same signatures as the torch ops in dispatch/ops/rmsnorm.py, minus `backend`; an absent new residual is None
# (dispatch/ops/rmsnorm.py `_with_res` gives the op its 0-element tensor).


def rms_norm_op(x, weight, residual, eps, weight_offset):
    return rms_norm(x, weight, eps, residual, weight_offset)


def rms_norm_fp8_group(x, weight, residual, eps, weight_offset, group_size, quant_eps, ue8m0, column_major):
    return rms_norm_quant(x, weight, eps, residual, weight_offset, "fp8_group", group_size=group_size,
                          quant_eps=quant_eps, ue8m0=ue8m0, column_major=column_major)


def rms_norm_mxfp4(x, weight, residual, eps, weight_offset, rounding, swizzle):
    return rms_norm_quant(x, weight, eps, residual, weight_offset, "mxfp4", rounding=rounding, swizzle=swizzle)


def rms_norm_nvfp4(x, weight, residual, eps, weight_offset, global_scale, swizzle):
    return rms_norm_quant(x, weight, eps, residual, weight_offset, "nvfp4", global_scale=global_scale,
                          swizzle=swizzle)
