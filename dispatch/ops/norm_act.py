"""RMSNorm and SwiGLU ops (plain and with a fused FP8-group / MXFP4 / NVFP4 output): torch.library
registration, fakes, typed public API. Contracts: dispatch/reference/rmsnorm.py and swiglu.py; docs:
docs/norm_act.md.

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

from .. import checks as C
from ..reference.formats import round_up
from ..reference.quant import MX_ROUNDINGS, MXFP4_BLOCK, NVFP4_BLOCK, fp8_scale_storage
from ..reference.swiglu import ACTIVATIONS
from ._common import call, lowbit_op, run
from .quant import FP8GroupQuantized, MXFP4Quantized, NVFP4Quantized, ScaleLayout, _layout_flag

# ------------------------------------------------------------------------------------------------ checks


def _check_x(op: str, x: Tensor) -> None:
    C.check_tensor(op, "x", x)
    C.check_dtype(op, "x", x, C.FLOAT_INPUTS)
    C.check_min_dims(op, "x", x, 1)
    C.rows_view(op, "x", x)


def _check_block(op: str, arg: str, x: Tensor, k: int, block: int, what: str) -> None:
    if k % block:
        C.fail(op, arg, f"output row length {k} is not a multiple of {block} ({what})")


def _check_gs(op: str, gs: Tensor | None, x: Tensor, groups: int | None) -> None:
    if gs is None:
        return
    C.check_tensor(op, "global_scale", gs)
    C.check_same_device(op, "x", x, "global_scale", gs)
    if groups is None or gs.numel() == 1:
        C.check_scalar_tensor(op, "global_scale", gs)
    else:
        C.check_dtype(op, "global_scale", gs, (torch.float32,))
        if gs.dim() != 1:
            C.fail(op, "global_scale", f"expected a scalar or one scale per expert [E], got shape {tuple(gs.shape)}")
        if groups > 0 and gs.numel() < groups:
            C.fail(op, "global_scale", f"holds {gs.numel()} scales but masked_m has {groups} groups")


def _check_quant_args(op: str, x: Tensor, k: int, quant: str, qargs: tuple, groups: int | None = None) -> None:
    if quant == "fp8_group":
        group_size, quant_eps = qargs[0], qargs[1]
        if group_size <= 0:
            C.fail(op, "group_size", f"must be positive, got {group_size}")
        _check_block(op, "x", x, k, group_size, f"group_size={group_size}")
        if not quant_eps > 0:
            C.fail(op, "quant_eps", f"must be > 0 (it keeps all-zero groups finite), got {quant_eps}")
    elif quant == "mxfp4":
        _check_block(op, "x", x, k, MXFP4_BLOCK, "MXFP4 blocks are 32 elements")
        if qargs[0] not in MX_ROUNDINGS:
            C.fail(op, "rounding", f"{qargs[0]!r} is not one of {', '.join(MX_ROUNDINGS)}")
    elif quant == "nvfp4":
        _check_block(op, "x", x, k, NVFP4_BLOCK, "NVFP4 blocks are 16 elements")
        _check_gs(op, qargs[0], x, groups)


def _check_rms(op, x, weight, residual, eps, weight_offset, quant="none", qargs=()):
    _check_x(op, x)
    n = x.shape[-1]
    C.check_tensor(op, "weight", weight)
    C.check_dtype(op, "weight", weight, C.FLOAT_INPUTS)
    C.check_same_device(op, "x", x, "weight", weight)
    if tuple(weight.shape) != (n,):
        C.fail(op, "weight", f"expected shape ({n},) for x of shape {tuple(x.shape)}, got {tuple(weight.shape)}")
    if residual is not None:
        C.check_tensor(op, "residual", residual)
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


def _swiglu_groups(expert_ids, masked_m) -> int | None:
    """None for a dense call, else the group count a per-group global scale must cover (0 = unknown)."""
    if masked_m is not None:
        return masked_m.shape[0]
    return 0 if expert_ids is not None else None


def _check_swiglu(op, x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, quant="none",
                  qargs=()):
    _check_x(op, x)
    two_i = x.shape[-1]
    if two_i % 2:
        C.fail(op, "x", f"last dim {two_i} is odd; expected [..., 2*I] holding gate and up")
    i = two_i // 2
    if interleave < 0:
        C.fail(op, "interleave", f"must be 0 (concatenated [gate | up]) or a granularity >= 1, got {interleave}")
    if interleave > 0 and i % interleave:
        C.fail(op, "interleave", f"I = {i} is not a multiple of the granularity {interleave}")
    if activation not in ACTIVATIONS:
        C.fail(op, "activation", f"{activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if not math.isfinite(alpha):
        C.fail(op, "alpha", f"must be finite, got {alpha}")
    if limit is not None and not (limit > 0 and math.isfinite(limit)):
        C.fail(op, "limit", f"must be None or a finite value > 0, got {limit}")
    if out_dtype is not None and out_dtype not in C.FLOAT_INPUTS:
        C.fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")
    if expert_ids is not None and masked_m is not None:
        C.fail(op, "masked_m", "give expert_ids (contiguous layout) or masked_m (masked layout), not both")
    if expert_ids is not None:
        C.check_tensor(op, "expert_ids", expert_ids)
        C.check_dtype(op, "expert_ids", expert_ids, (torch.int32,))
        C.check_same_device(op, "x", x, "expert_ids", expert_ids)
        if tuple(expert_ids.shape) != tuple(x.shape[:-1]) or not expert_ids.is_contiguous():
            C.fail(op, "expert_ids", f"expected a contiguous int32 tensor of shape {tuple(x.shape[:-1])} (one "
                                     f"expert per row, -1 = padding), got {tuple(expert_ids.shape)}")
    if masked_m is not None:
        C.check_tensor(op, "masked_m", masked_m)
        C.check_dtype(op, "masked_m", masked_m, (torch.int32,))
        C.check_same_device(op, "x", x, "masked_m", masked_m)
        if x.dim() != 3 or tuple(masked_m.shape) != (x.shape[0],) or not masked_m.is_contiguous():
            C.fail(op, "masked_m", f"the masked layout needs x [G, max_M, 2I] and masked_m [G]; got x "
                                   f"{tuple(x.shape)}, masked_m {tuple(masked_m.shape)}")
    _check_quant_args(op, x, i, quant, qargs, _swiglu_groups(expert_ids, masked_m))


# -------------------------------------------------------------------------------------------- fakes


def _fake_quant(x: Tensor, lead: tuple, k: int, quant: str, qargs: tuple):
    if quant == "fp8_group":
        group_size, _, _, column_major = qargs
        return (x.new_empty(*lead, k, dtype=torch.float8_e4m3fn),
                fp8_scale_storage(lead, k // group_size, column_major, x.device))
    block = MXFP4_BLOCK if quant == "mxfp4" else NVFP4_BLOCK
    swizzle = qargs[-1]
    rows = math.prod(lead)
    sdt = torch.uint8 if quant == "mxfp4" else torch.float8_e4m3fn
    scales = (x.new_empty(round_up(rows, 128), round_up(k // block, 4), dtype=sdt) if swizzle
              else x.new_empty(*lead, k // block, dtype=sdt))
    codes = x.new_empty(*lead, k // 2, dtype=torch.uint8)
    if quant == "mxfp4":
        return codes, scales
    gs = qargs[0]
    return codes, scales, x.new_empty(() if gs is None or gs.numel() == 1 else (gs.numel(),), dtype=torch.float32)


def _fake_res(x, residual):
    return x.new_empty(x.shape) if residual is not None else x.new_empty(0)


def _with_res(outputs: tuple, x: Tensor) -> tuple:
    """The op's outputs with a 0-element tensor for the new residual where the backend returned None (the
    schema needs a Tensor; backends skip that allocation because the eager fast path returns their outputs
    to the public wrappers, which turn it into None anyway)."""
    if outputs[-1] is not None:
        return outputs
    return (*outputs[:-1], x.new_empty(0))


# ------------------------------------------------------------------------------------------ RMSNorm ops


@lowbit_op("rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
              backend: str) -> tuple[Tensor, Tensor]:
    _check_rms("rms_norm", x, weight, residual, eps, weight_offset)
    return _with_res(run("rms_norm", backend, x, weight, residual, eps, weight_offset), x)


@_rms_norm.register_fake
def _(x, weight, residual, eps, weight_offset, backend):
    _check_rms("rms_norm", x, weight, residual, eps, weight_offset)
    return x.new_empty(x.shape), _fake_res(x, residual)


@lowbit_op("rms_norm_fp8_group", mutates_args=())
def _rms_norm_fp8_group(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
                        group_size: int, quant_eps: float, ue8m0: bool, column_major: bool,
                        backend: str) -> tuple[Tensor, Tensor, Tensor]:
    q = (group_size, quant_eps, ue8m0, column_major)
    _check_rms("rms_norm_fp8_group", x, weight, residual, eps, weight_offset, "fp8_group", q)
    return _with_res(run("rms_norm_fp8_group", backend, x, weight, residual, eps, weight_offset, *q), x)


@_rms_norm_fp8_group.register_fake
def _(x, weight, residual, eps, weight_offset, group_size, quant_eps, ue8m0, column_major, backend):
    q = (group_size, quant_eps, ue8m0, column_major)
    _check_rms("rms_norm_fp8_group", x, weight, residual, eps, weight_offset, "fp8_group", q)
    return (*_fake_quant(x, tuple(x.shape[:-1]), x.shape[-1], "fp8_group", q), _fake_res(x, residual))


@lowbit_op("rms_norm_mxfp4", mutates_args=())
def _rms_norm_mxfp4(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
                    rounding: str, swizzle: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    _check_rms("rms_norm_mxfp4", x, weight, residual, eps, weight_offset, "mxfp4", (rounding, swizzle))
    return _with_res(run("rms_norm_mxfp4", backend, x, weight, residual, eps, weight_offset, rounding, swizzle), x)


@_rms_norm_mxfp4.register_fake
def _(x, weight, residual, eps, weight_offset, rounding, swizzle, backend):
    _check_rms("rms_norm_mxfp4", x, weight, residual, eps, weight_offset, "mxfp4", (rounding, swizzle))
    return (*_fake_quant(x, tuple(x.shape[:-1]), x.shape[-1], "mxfp4", (rounding, swizzle)),
            _fake_res(x, residual))


@lowbit_op("rms_norm_nvfp4", mutates_args=())
def _rms_norm_nvfp4(x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, weight_offset: float,
                    global_scale: Tensor | None, swizzle: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_rms("rms_norm_nvfp4", x, weight, residual, eps, weight_offset, "nvfp4", (global_scale, swizzle))
    return _with_res(run("rms_norm_nvfp4", backend, x, weight, residual, eps, weight_offset, global_scale, swizzle), x)


@_rms_norm_nvfp4.register_fake
def _(x, weight, residual, eps, weight_offset, global_scale, swizzle, backend):
    _check_rms("rms_norm_nvfp4", x, weight, residual, eps, weight_offset, "nvfp4", (global_scale, swizzle))
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
    ops, fp64 sum of squares: see docs/norm_act.md). With `residual`, normalizes h = x + residual and also
    returns h (the new residual). weight_offset=1.0 is Gemma's (1 + w)."""
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
    amax(y)/2688 on the device: two launches (amax pass, then norm+quantize), no host sync."""
    swizzle = _layout_flag("rms_norm_nvfp4", scale_layout)
    c, s, g, r = call("rms_norm_nvfp4", x, weight, residual, float(eps), float(weight_offset),
                                                 global_scale, swizzle, backend)
    return RMSNormQuantOutput(NVFP4Quantized(c, s, g), _res(r, residual))


# ------------------------------------------------------------------------------------------- SwiGLU ops


def _fake_swiglu_lead(x):
    return tuple(x.shape[:-1]), x.shape[-1] // 2


@lowbit_op("swiglu", mutates_args=())
def _swiglu(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
            expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
            backend: str) -> Tensor:
    a = (x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    _check_swiglu("swiglu", *a)
    return run("swiglu", backend, *a)


@_swiglu.register_fake
def _(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, backend):
    _check_swiglu("swiglu", x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    lead, i = _fake_swiglu_lead(x)
    return x.new_empty(*lead, i, dtype=out_dtype or x.dtype)


@lowbit_op("swiglu_fp8_group", mutates_args=())
def _swiglu_fp8_group(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                      expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                      group_size: int, quant_eps: float, ue8m0: bool, column_major: bool,
                      backend: str) -> tuple[Tensor, Tensor]:
    a = (x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    q = (group_size, quant_eps, ue8m0, column_major)
    _check_swiglu("swiglu_fp8_group", *a, "fp8_group", q)
    return run("swiglu_fp8_group", backend, *a, *q)


@_swiglu_fp8_group.register_fake
def _(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, group_size, quant_eps, ue8m0,
      column_major, backend):
    q = (group_size, quant_eps, ue8m0, column_major)
    _check_swiglu("swiglu_fp8_group", x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype,
                  "fp8_group", q)
    return _fake_quant(x, *_fake_swiglu_lead(x), "fp8_group", q)


@lowbit_op("swiglu_mxfp4", mutates_args=())
def _swiglu_mxfp4(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                  expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                  rounding: str, swizzle: bool, backend: str) -> tuple[Tensor, Tensor]:
    a = (x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    _check_swiglu("swiglu_mxfp4", *a, "mxfp4", (rounding, swizzle))
    return run("swiglu_mxfp4", backend, *a, rounding, swizzle)


@_swiglu_mxfp4.register_fake
def _(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, rounding, swizzle, backend):
    _check_swiglu("swiglu_mxfp4", x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype,
                  "mxfp4", (rounding, swizzle))
    return _fake_quant(x, *_fake_swiglu_lead(x), "mxfp4", (rounding, swizzle))


@lowbit_op("swiglu_nvfp4", mutates_args=())
def _swiglu_nvfp4(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                  expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                  global_scale: Tensor | None, swizzle: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    a = (x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    _check_swiglu("swiglu_nvfp4", *a, "nvfp4", (global_scale, swizzle))
    return run("swiglu_nvfp4", backend, *a, global_scale, swizzle)


@_swiglu_nvfp4.register_fake
def _(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, global_scale, swizzle, backend):
    _check_swiglu("swiglu_nvfp4", x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype,
                  "nvfp4", (global_scale, swizzle))
    return _fake_quant(x, *_fake_swiglu_lead(x), "nvfp4", (global_scale, swizzle))


def _sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype):
    return (x, int(interleave), activation, float(alpha), None if limit is None else float(limit), expert_ids,
            masked_m, out_dtype)


def swiglu(x: Tensor, *, interleave: int = 0, activation: Literal["silu", "gptoss"] = "silu",
           alpha: float = 1.702, limit: float | None = None, expert_ids: Tensor | None = None,
           masked_m: Tensor | None = None, out_dtype: torch.dtype | None = None, backend: str = "auto") -> Tensor:
    """SwiGLU of x [..., 2I] -> [..., I] (see docs/norm_act.md for layouts and variants).

    interleave: 0 = [gate | up]; g >= 1 = chunks of g alternate gate/up (1: GPT-OSS, 8: fused-GEMM layout).
    activation: "silu" = silu(gate) * up; "gptoss" = gate * sigmoid(alpha * gate) * (up + 1).
    limit: clamp gate <= limit and |up| <= limit first (DeepSeek-V4 / GPT-OSS use 7.0 with gptoss).
    expert_ids [M] int32 (-1 = padding row) or masked_m [G] int32 (x [G, max_M, 2I]): MoE layouts; padding
    rows are not read and come out as zeros.
    """
    return call("swiglu", *_sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m,
                                             out_dtype), backend)


def swiglu_fp8_group(x: Tensor, *, interleave: int = 0, activation: Literal["silu", "gptoss"] = "silu",
                     alpha: float = 1.702, limit: float | None = None, expert_ids: Tensor | None = None,
                     masked_m: Tensor | None = None, out_dtype: torch.dtype | None = None, group_size: int = 128,
                     quant_eps: float = 1e-10, ue8m0: bool = False, column_major_scales: bool = False,
                     backend: str = "auto") -> FP8GroupQuantized:
    """swiglu (rounded to out_dtype, default x.dtype) then FP8 per-token-group quantized, one pass."""
    return FP8GroupQuantized(*call("swiglu_fp8_group",
        *_sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype), group_size,
        float(quant_eps), ue8m0, column_major_scales, backend))


def swiglu_mxfp4(x: Tensor, *, interleave: int = 0, activation: Literal["silu", "gptoss"] = "silu",
                 alpha: float = 1.702, limit: float | None = None, expert_ids: Tensor | None = None,
                 masked_m: Tensor | None = None, out_dtype: torch.dtype | None = None,
                 rounding: Literal["floor", "rceil"] = "floor", scale_layout: ScaleLayout = "linear",
                 backend: str = "auto") -> MXFP4Quantized:
    """swiglu (rounded to out_dtype) then MXFP4 quantized, one pass."""
    swizzle = _layout_flag("swiglu_mxfp4", scale_layout)
    return MXFP4Quantized(*call("swiglu_mxfp4",
        *_sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype), rounding, swizzle,
        backend))


def swiglu_nvfp4(x: Tensor, *, interleave: int = 0, activation: Literal["silu", "gptoss"] = "silu",
                 alpha: float = 1.702, limit: float | None = None, expert_ids: Tensor | None = None,
                 masked_m: Tensor | None = None, out_dtype: torch.dtype | None = None,
                 global_scale: Tensor | None = None, scale_layout: ScaleLayout = "linear",
                 backend: str = "auto") -> NVFP4Quantized:
    """swiglu (rounded to out_dtype) then NVFP4 quantized. global_scale: None (amax of the whole output /
    2688, computed on the device in a first pass), a scalar, or with expert_ids / masked_m one per expert
    [E] (ids must index it: a precondition, like DeepGEMM's m_indices)."""
    swizzle = _layout_flag("swiglu_nvfp4", scale_layout)
    return NVFP4Quantized(*call("swiglu_nvfp4",
        *_sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype), global_scale, swizzle,
        backend))


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

    def sw(dev, small, **kw):
        x = _x(dev, small, k=512 if small else 4096)
        return (x, 1, "gptoss", 1.702, 7.0, None, None, None)

    def sw_fp8(dev, small):
        return (*sw(dev, small), 128, 1e-10, True, False)

    def sw_mx(dev, small):
        return (*sw(dev, small), "floor", True)

    def sw_nv(dev, small):
        x = _x(dev, small, k=512 if small else 4096)
        ids = (torch.arange(x.shape[0], device=dev, dtype=torch.int32) % 3) - 1
        return (x, 8, "silu", 1.702, None, ids, None, None, torch.tensor([0.01, 0.02], device=dev), True)

    def close(out, ref):
        # float outputs of swiglu: exp is not correctly rounded anywhere; <= 1 bf16 ulp (see docs)
        d = (out.float() - ref.float()).abs()
        ok = bool((d <= ref.float().abs() * 2**-7 + 1e-30).all())
        return ok, f"max abs err {d.max().item() if d.numel() else 0:.3g}"

    def close_bytes(out, ref):
        # quantized swiglu: bytes may differ where y differs by an ulp; require >= 99.9% equal bytes
        from ..selfcheck import byte_mismatches
        bad = sum(byte_mismatches(a, b) for a, b in zip(out, ref, strict=True))
        total = sum(a.numel() for a in out)
        return bad <= max(1, total // 1000), f"{bad} bytes differ"

    return [
        Case("rms_norm", rms, exact, label="bf16 + residual"),
        Case("rms_norm_fp8_group", rms_fp8, exact, label="g128, column-major scales"),
        Case("rms_norm_mxfp4", rms_mx, exact, label="rceil, swizzled, residual, 1+w"),
        Case("rms_norm_nvfp4", rms_nv, exact, label="computed global scale, swizzled"),
        Case("swiglu", sw, close, label="gptoss, even/odd, limit 7"),
        Case("swiglu_fp8_group", sw_fp8, close_bytes, label="gptoss g1, ue8m0"),
        Case("swiglu_mxfp4", sw_mx, close_bytes, label="gptoss g1, swizzled"),
        Case("swiglu_nvfp4", sw_nv, close_bytes, label="MoE contiguous, per-expert gs"),
    ]
