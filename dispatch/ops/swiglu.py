"""SwiGLU ops (plain, and with a fused FP8-group / MXFP4 / NVFP4 output; MoE contiguous and masked layouts):
torch.library registration, fakes, typed public API. Contract: dispatch/reference/swiglu.py; docs: docs/swiglu.md.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from triton_ops.contract import checks as C

from ..reference.swiglu import ACTIVATIONS
from ._common import call, lowbit_op
from ._fake import is_fake
from ._quant_outputs import _check_quant_args, _check_x, _fake_quant
from .quant import FP8GroupQuantized, MXFP4Quantized, NVFP4Quantized, ScaleLayout, _layout_flag
from .rope import debug_checks, host_values

# ------------------------------------------------------------------------------------------------ checks


def _swiglu_groups(expert_ids, masked_m) -> int | None:
    """None for a dense call, else the group count a per-group global scale must cover (0 = unknown)."""
    if masked_m is not None:
        return masked_m.shape[0]
    return 0 if expert_ids is not None else None


def _per_expert_scales(expert_ids, quant, qargs) -> int | None:
    """E when swiglu_nvfp4 gets one global scale per expert [E > 1] with the contiguous layout, else None."""
    if quant != "nvfp4" or expert_ids is None or qargs[0] is None or qargs[0].numel() <= 1:
        return None
    return qargs[0].numel()


def _check_swiglu(op, x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, quant="none",
                  qargs=()):
    """With per-expert NVFP4 scales, also range-checks expert_ids where that costs no device sync (host
    tensors) or LOWBIT_CHECK_INDICES=1 asks for it; never fake ones (the fake impls run the same checks)."""
    C.check_tensor(op, "x", x)
    C.check_tensor(op, "expert_ids", expert_ids, optional=True)
    C.check_tensor(op, "masked_m", masked_m, optional=True)
    gs = qargs[0] if quant == "nvfp4" else None
    C.check_tensor(op, "global_scale", gs, optional=True)
    C.check_no_grad(op, x=x, global_scale=gs)
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
        C.check_dtype(op, "expert_ids", expert_ids, (torch.int32,))
        C.check_same_device(op, "x", x, "expert_ids", expert_ids)
        if tuple(expert_ids.shape) != tuple(x.shape[:-1]) or not expert_ids.is_contiguous():
            C.fail(op, "expert_ids", f"expected a contiguous int32 tensor of shape {tuple(x.shape[:-1])} (one "
                                     f"expert per row, -1 = padding), got {tuple(expert_ids.shape)}")
    if masked_m is not None:
        C.check_dtype(op, "masked_m", masked_m, (torch.int32,))
        C.check_same_device(op, "x", x, "masked_m", masked_m)
        if x.dim() != 3 or tuple(masked_m.shape) != (x.shape[0],) or not masked_m.is_contiguous():
            C.fail(op, "masked_m", f"the masked layout needs x [G, max_M, 2I] and masked_m [G]; got x "
                                   f"{tuple(x.shape)}, masked_m {tuple(masked_m.shape)}")
    _check_quant_args(op, x, i, quant, qargs, _swiglu_groups(expert_ids, masked_m))
    n_exp = _per_expert_scales(expert_ids, quant, qargs)
    if n_exp is not None and not is_fake(expert_ids) and expert_ids.numel() \
            and (expert_ids.device.type == "cpu" or debug_checks()):
        hi = int(expert_ids.max())
        if hi >= n_exp:
            C.fail(op, "expert_ids", f"holds expert {hi} but global_scale has {n_exp} per-expert scales (ids must "
                                     f"be < {n_exp}; negative ids are padding rows)")


# ------------------------------------------------------------------------------------------- SwiGLU ops


def _swiglu_check(op: str, quant: str = "none"):
    """The check of op `op`: it takes the op's arguments (without `backend`); those after out_dtype are the
    quantized output's (`qargs` of _check_quant_args)."""
    def check(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, *qargs):
        _check_swiglu(op, x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, quant, qargs)
    check.__name__ = check.__qualname__ = f"_check_{op}"
    return check


def _fake_swiglu_lead(x):
    return tuple(x.shape[:-1]), x.shape[-1] // 2


@lowbit_op("swiglu", mutates_args=(), check=_swiglu_check("swiglu"))
def _swiglu(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
            expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
            backend: str) -> Tensor:
    lead, i = _fake_swiglu_lead(x)
    return x.new_empty(*lead, i, dtype=out_dtype or x.dtype)


@lowbit_op("swiglu_fp8_group", mutates_args=(), check=_swiglu_check("swiglu_fp8_group", "fp8_group"))
def _swiglu_fp8_group(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                      expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                      group_size: int, quant_eps: float, ue8m0: bool, column_major: bool,
                      backend: str) -> tuple[Tensor, Tensor]:
    return _fake_quant(x, *_fake_swiglu_lead(x), "fp8_group", (group_size, quant_eps, ue8m0, column_major))


@lowbit_op("swiglu_mxfp4", mutates_args=(), check=_swiglu_check("swiglu_mxfp4", "mxfp4"))
def _swiglu_mxfp4(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                  expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                  rounding: str, swizzle: bool, backend: str) -> tuple[Tensor, Tensor]:
    return _fake_quant(x, *_fake_swiglu_lead(x), "mxfp4", (rounding, swizzle))


@lowbit_op("swiglu_nvfp4", mutates_args=(), check=_swiglu_check("swiglu_nvfp4", "nvfp4"))
def _swiglu_nvfp4(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                  expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                  global_scale: Tensor | None, swizzle: bool, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _fake_quant(x, *_fake_swiglu_lead(x), "nvfp4", (global_scale, swizzle))


def _sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype):
    return (x, int(interleave), activation, float(alpha), None if limit is None else float(limit), expert_ids,
            masked_m, out_dtype)


def swiglu(x: Tensor, *, interleave: int = 0, activation: Literal["silu", "gptoss"] = "silu",
           alpha: float = 1.702, limit: float | None = None, expert_ids: Tensor | None = None,
           masked_m: Tensor | None = None, out_dtype: torch.dtype | None = None, backend: str = "auto") -> Tensor:
    """SwiGLU of x [..., 2I] -> [..., I] (see docs/swiglu.md for layouts and variants).

    interleave: 0 = [gate | up]; g >= 1 = chunks of g alternate gate/up (1: GPT-OSS, 8: fused-GEMM layout).
    activation: "silu" = silu(gate) * up; "gptoss" = gate * sigmoid(alpha * gate) * (up + 1).
    limit: clamp gate <= limit and |up| <= limit first (DeepSeek-V4 / GPT-OSS use 7.0 with gptoss).
    expert_ids [M] int32 (-1 = padding row) or masked_m [G] int32 (x [G, max_M, 2I]): MoE layouts; padding
    rows are not read and come out as zeros.
    Inference only (every swiglu variant): with grad mode on, inputs that require grad are refused
    (LowbitInputError); call under torch.no_grad() / torch.inference_mode().
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
    2688, computed on the device in a first pass), a scalar, or with expert_ids / masked_m one per expert [E].

    Per-expert scales with expert_ids: a row whose expert id is >= E has no scale; it is masked like a padding
    row (not read, zero code and scale bytes) on every backend, never read past the scales. Checking the ids
    would need a device sync, so on the GPU that masking is the behaviour; host (CPU) tensors, and any tensors
    under LOWBIT_CHECK_INDICES=1, are checked instead (LowbitInputError naming 'expert_ids').
    A global scale below 2^-118 in magnitude quantizes to zeros (see nvfp4_quantize)."""
    swizzle = _layout_flag("swiglu_nvfp4", scale_layout)
    a = _sw_args(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    if expert_ids is not None and global_scale is not None and host_values(x, expert_ids, global_scale):
        _check_swiglu("swiglu_nvfp4", *a, "nvfp4", (global_scale, swizzle))  # every call, not only checked ones
    return NVFP4Quantized(*call("swiglu_nvfp4", *a, global_scale, swizzle, backend))


# ------------------------------------------------------------------------------------------ self-check


def self_check_cases() -> list:
    """Cases for `python -m dispatch check` (see dispatch/selfcheck.py)."""
    from ..selfcheck import Case
    from ..selfcheck import sample_activations as _x

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
        Case("swiglu", sw, close, label="gptoss, even/odd, limit 7"),
        Case("swiglu_fp8_group", sw_fp8, close_bytes, label="gptoss g1, ue8m0"),
        Case("swiglu_mxfp4", sw_mx, close_bytes, label="gptoss g1, swizzled"),
        Case("swiglu_nvfp4", sw_nv, close_bytes, label="MoE contiguous, per-expert gs"),
    ]
