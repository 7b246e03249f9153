"""Quantization ops: torch.library registration (namespace `lowbit`), fakes, and the typed public API.

Each op: a check function (run by the real and the fake impl, so errors surface at trace time too) -> one
`lowbit_op` declaration (schema + fake outputs; the real impl asks the dispatch table for a backend) -> typed
wrapper.

Every op here is inference-only: with grad mode on (torch.is_grad_enabled()), an input that requires grad is
refused with LowbitInputError (the kernels have no backward); call under torch.no_grad() / inference_mode().
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from triton_ops.contract import checks as C
from triton_ops.contract.formats import (
    MX_ROUNDINGS,
    MXFP4_BLOCK,
    NVFP4_BLOCK,
    fp4_scales_shape,
    fp8_scale_storage,
    round_up,
)

from ..reference import quant as ref_quant
from ._common import call, lowbit_op

ScaleLayout = Literal["linear", "swizzled"]
OUT_DTYPES = C.FLOAT_INPUTS


def _layout_flag(op: str, scale_layout: str) -> bool:
    if scale_layout not in ("linear", "swizzled"):
        C.fail(op, "scale_layout", f"{scale_layout!r} is not 'linear' or 'swizzled'")
    return scale_layout == "swizzled"


def _check_quant_input(op: str, x: Tensor, block: int, what: str) -> None:
    C.check_tensor(op, "x", x)
    C.check_no_grad(op, x=x)
    C.check_dtype(op, "x", x, C.FLOAT_INPUTS)
    C.check_min_dims(op, "x", x, 1)
    C.check_last_dim_multiple(op, "x", x, block, what)
    C.rows_view(op, "x", x)


def _check_fp4_dequant(op: str, codes: Tensor, scales: Tensor, block: int, scale_dtype, swizzle: bool,
                       out_dtype) -> None:
    C.check_tensor(op, "codes", codes)
    C.check_tensor(op, "scales", scales)
    C.check_dtype(op, "codes", codes, (torch.uint8,))
    C.check_min_dims(op, "codes", codes, 1)
    k = codes.shape[-1] * 2
    if k % block:
        C.fail(op, "codes", f"last dim {codes.shape[-1]} holds {k} values, not a multiple of the block {block}")
    C.check_dtype(op, "scales", scales, (scale_dtype,))
    C.check_same_device(op, "codes", codes, "scales", scales)
    want = fp4_scales_shape(tuple(codes.shape[:-1]), k, block, swizzle)
    if swizzle and scales.numel() != want[0] * want[1]:
        C.fail(op, "scales", f"swizzled scales for codes {tuple(codes.shape)} need {want[0]}x{want[1]} "
                             f"elements, got shape {tuple(scales.shape)}")
    if not swizzle and tuple(scales.shape) != want:
        C.fail(op, "scales", f"expected shape {want} for codes {tuple(codes.shape)}, got {tuple(scales.shape)}")
    if out_dtype not in OUT_DTYPES:
        C.fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")


# ------------------------------------------------------------------------------------------------ NVFP4


def _check_nvfp4_quantize(x, global_scale, swizzle):
    op = "nvfp4_quantize"
    C.check_tensor(op, "x", x)
    C.check_tensor(op, "global_scale", global_scale, optional=True)
    C.check_no_grad(op, global_scale=global_scale)
    _check_quant_input(op, x, NVFP4_BLOCK, "NVFP4 blocks are 16 elements")
    if global_scale is not None:
        C.check_scalar_tensor(op, "global_scale", global_scale)
        C.check_same_device(op, "x", x, "global_scale", global_scale)


@lowbit_op("nvfp4_quantize", mutates_args=(), check=_check_nvfp4_quantize)
def _nvfp4_quantize(x: Tensor, global_scale: Tensor | None, swizzle: bool, backend: str) -> tuple[
        Tensor, Tensor, Tensor]:
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    return (x.new_empty(*lead, k // 2, dtype=torch.uint8),
            x.new_empty(fp4_scales_shape(lead, k, NVFP4_BLOCK, swizzle), dtype=torch.float8_e4m3fn),
            x.new_empty((), dtype=torch.float32))


def _check_nvfp4_dequantize(codes, scales, global_scale, swizzle, out_dtype):
    op = "nvfp4_dequantize"
    C.check_tensor(op, "codes", codes)
    C.check_tensor(op, "scales", scales)
    C.check_tensor(op, "global_scale", global_scale)
    C.check_no_grad(op, global_scale=global_scale)
    _check_fp4_dequant(op, codes, scales, NVFP4_BLOCK, torch.float8_e4m3fn, swizzle, out_dtype)
    C.check_scalar_tensor(op, "global_scale", global_scale)
    C.check_same_device(op, "codes", codes, "global_scale", global_scale)


@lowbit_op("nvfp4_dequantize", mutates_args=(), check=_check_nvfp4_dequantize)
def _nvfp4_dequantize(codes: Tensor, scales: Tensor, global_scale: Tensor, swizzle: bool,
                      out_dtype: torch.dtype, backend: str) -> Tensor:
    return codes.new_empty(*codes.shape[:-1], codes.shape[-1] * 2, dtype=out_dtype)


class NVFP4Quantized(NamedTuple):
    codes: Tensor  # uint8 [..., K/2]; element 2i in the low nibble
    scales: Tensor  # float8_e4m3fn [..., K/16] (linear) or [round_up(M,128), round_up(K/16,4)] (swizzled)
    global_scale: Tensor  # fp32 0-dim, decode form: value = e2m1 * scale * global_scale


def nvfp4_quantize(x: Tensor, global_scale: Tensor | None = None, *, scale_layout: ScaleLayout = "linear",
                   backend: str = "auto") -> NVFP4Quantized:
    """Quantize x to NVFP4 along its last dim (16-element blocks).

    global_scale: decode-form fp32 device tensor (`amax / (448*6)`); None computes it on the device from
    amax(|x|) without a host sync (one extra pass). Convert an encode-form scale (vLLM/FlashInfer
    `448*6/amax`) with `nvfp4_decode_global_scale`.

    Tiny global scales: a given one below 2^-118 in magnitude (0 included) counts as 0 for the block scales, on
    every backend: all block scales 0, all codes +-0, so the tensor decodes to zeros (its reciprocal would
    overflow, and every nonzero code saturate to +-6). The returned global_scale is still the given value. A
    computed one is amax / 2688 raised to 2^-118 for a nonzero amax, so a tiny tensor (amax down to ~2.8e-37)
    still round-trips within the format's error instead of decoding to zeros. The same rule holds for the fused NVFP4
    outputs (rms_norm_nvfp4, swiglu_nvfp4).
    Inference only: with grad mode on, inputs that require grad are refused (LowbitInputError).
    """
    swizzle = _layout_flag("nvfp4_quantize", scale_layout)
    return NVFP4Quantized(*call("nvfp4_quantize", x, global_scale, swizzle, backend))


def nvfp4_dequantize(codes: Tensor, scales: Tensor, global_scale: Tensor, *, scale_layout: ScaleLayout = "linear",
                     out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> Tensor:
    """value = (e2m1(code) * fp32(scale)) * global_scale, rounded once to out_dtype."""
    swizzle = _layout_flag("nvfp4_dequantize", scale_layout)
    return call("nvfp4_dequantize", codes, scales, global_scale, swizzle, out_dtype, backend)


def nvfp4_global_scale_from_amax(amax: Tensor) -> Tensor:
    """Decode-form global scale (lowbit's convention) from a tensor amax: amax / (448 * 6), at least 2^-118 for a
    nonzero amax (the global scale the quantizers compute themselves; see nvfp4_quantize)."""
    C.check_tensor("nvfp4_global_scale_from_amax", "amax", amax)
    return ref_quant.nvfp4_global_scale_from_amax(amax)


def nvfp4_encode_global_scale(global_scale: Tensor) -> Tensor:
    """lowbit (decode form, amax/2688) -> vLLM/FlashInfer encode form (2688/amax): the reciprocal."""
    C.check_tensor("nvfp4_encode_global_scale", "global_scale", global_scale)
    return 1.0 / global_scale.float()


def nvfp4_decode_global_scale(encode_scale: Tensor) -> Tensor:
    """vLLM/FlashInfer encode form (2688/amax) -> lowbit decode form: the reciprocal. Note 1/(1/g) may
    differ from g in the last bit; pass the decode form through unchanged where you have it."""
    C.check_tensor("nvfp4_decode_global_scale", "encode_scale", encode_scale)
    return 1.0 / encode_scale.float()


# ------------------------------------------------------------------------------------------------ MXFP4


def _check_mxfp4_quantize(x, rounding, swizzle):
    _check_quant_input("mxfp4_quantize", x, MXFP4_BLOCK, "MXFP4 blocks are 32 elements")
    if rounding not in MX_ROUNDINGS:
        C.fail("mxfp4_quantize", "rounding", f"{rounding!r} is not one of {', '.join(MX_ROUNDINGS)}")


@lowbit_op("mxfp4_quantize", mutates_args=(), check=_check_mxfp4_quantize)
def _mxfp4_quantize(x: Tensor, rounding: str, swizzle: bool, backend: str) -> tuple[Tensor, Tensor]:
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    return (x.new_empty(*lead, k // 2, dtype=torch.uint8),
            x.new_empty(fp4_scales_shape(lead, k, MXFP4_BLOCK, swizzle), dtype=torch.uint8))


def _check_mxfp4_dequantize(codes, scales, swizzle, out_dtype):
    _check_fp4_dequant("mxfp4_dequantize", codes, scales, MXFP4_BLOCK, torch.uint8, swizzle, out_dtype)


@lowbit_op("mxfp4_dequantize", mutates_args=(), check=_check_mxfp4_dequantize)
def _mxfp4_dequantize(codes: Tensor, scales: Tensor, swizzle: bool, out_dtype: torch.dtype,
                      backend: str) -> Tensor:
    return codes.new_empty(*codes.shape[:-1], codes.shape[-1] * 2, dtype=out_dtype)


class MXFP4Quantized(NamedTuple):
    codes: Tensor  # uint8 [..., K/2]; element 2i in the low nibble
    scales: Tensor  # uint8 E8M0 (byte = exponent + 127, 0xFF = NaN); [..., K/32] or swizzled 128x4


def mxfp4_quantize(x: Tensor, *, rounding: Literal["floor", "rceil"] = "floor",
                   scale_layout: ScaleLayout = "linear", backend: str = "auto") -> MXFP4Quantized:
    """Quantize x to MXFP4 (OCP MX): 32-element blocks, E8M0 scales.

    rounding="floor": scale 2^(floor(log2 amax) - 2) (OCP spec, torchao default); values above 6 saturate.
    rounding="rceil": scale 2^ceil(log2(amax / 6)) (cuBLAS / NVIDIA recipe); never saturates.
    """
    swizzle = _layout_flag("mxfp4_quantize", scale_layout)
    return MXFP4Quantized(*call("mxfp4_quantize", x, rounding, swizzle, backend))


def mxfp4_dequantize(codes: Tensor, scales: Tensor, *, scale_layout: ScaleLayout = "linear",
                     out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> Tensor:
    swizzle = _layout_flag("mxfp4_dequantize", scale_layout)
    return call("mxfp4_dequantize", codes, scales, swizzle, out_dtype, backend)


# ------------------------------------------------------------------------------------------ FP8 groups


def _check_fp8_group_quantize(x, group_size, eps, ue8m0, column_major):
    op = "fp8_group_quantize"
    C.check_tensor(op, "x", x)
    if group_size <= 0:
        C.fail(op, "group_size", f"must be positive, got {group_size}")
    _check_quant_input(op, x, group_size, f"group_size={group_size}")
    if not eps > 0:
        C.fail(op, "eps", f"must be > 0 (it keeps all-zero groups finite), got {eps}")


@lowbit_op("fp8_group_quantize", mutates_args=(), check=_check_fp8_group_quantize)
def _fp8_group_quantize(x: Tensor, group_size: int, eps: float, ue8m0: bool, column_major: bool,
                        backend: str) -> tuple[Tensor, Tensor]:
    lead = tuple(x.shape[:-1])
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            fp8_scale_storage(lead, x.shape[-1] // group_size, column_major, x.device))


def _check_fp8_group_dequantize(codes, scales, group_size, out_dtype):
    op = "fp8_group_dequantize"
    C.check_tensor(op, "codes", codes)
    C.check_tensor(op, "scales", scales)
    C.check_no_grad(op, scales=scales)
    C.check_dtype(op, "codes", codes, (torch.float8_e4m3fn,))
    C.check_min_dims(op, "codes", codes, 1)
    if group_size <= 0:
        C.fail(op, "group_size", f"must be positive, got {group_size}")
    C.check_last_dim_multiple(op, "codes", codes, group_size, f"group_size={group_size}")
    C.check_dtype(op, "scales", scales, (torch.float32,))
    C.check_same_device(op, "codes", codes, "scales", scales)
    want = (*codes.shape[:-1], codes.shape[-1] // group_size)
    if tuple(scales.shape) != want:
        C.fail(op, "scales", f"expected shape {want}, got {tuple(scales.shape)}")
    if out_dtype not in OUT_DTYPES:
        C.fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")


@lowbit_op("fp8_group_dequantize", mutates_args=(), check=_check_fp8_group_dequantize)
def _fp8_group_dequantize(codes: Tensor, scales: Tensor, group_size: int, out_dtype: torch.dtype,
                          backend: str) -> Tensor:
    return codes.new_empty(codes.shape, dtype=out_dtype)


class FP8GroupQuantized(NamedTuple):
    codes: Tensor  # float8_e4m3fn, same shape as x
    scales: Tensor  # fp32 [..., K/group_size]; column-major TMA-aligned storage when asked


def fp8_group_quantize(x: Tensor, group_size: int = 128, *, eps: float = 1e-10, ue8m0: bool = False,
                       column_major_scales: bool = False, backend: str = "auto") -> FP8GroupQuantized:
    """FP8 E4M3 per-token-group quantization (DeepSeek 1x128 activations).

    scale = max(amax_group, eps) / 448, rounded up to a power of two when ue8m0; code = e4m3(x / scale).
    column_major_scales: DeepGEMM's MN-major layout, storage [K/group, round_up(M, 4)] (16-byte aligned
    columns), returned as a [..., K/group] view of it.
    """
    return FP8GroupQuantized(*call("fp8_group_quantize",
        x, group_size, float(eps), ue8m0, column_major_scales, backend))


def fp8_group_dequantize(codes: Tensor, scales: Tensor, group_size: int = 128, *,
                         out_dtype: torch.dtype = torch.bfloat16, backend: str = "auto") -> Tensor:
    return call("fp8_group_dequantize", codes, scales, group_size, out_dtype, backend)


# ---------------------------------------------------------------------------------------- scale layout


def _check_swizzle(scales):
    C.check_tensor("swizzle_scales_128x4", "scales", scales)
    if scales.dim() != 2:
        C.fail("swizzle_scales_128x4", "scales", f"expected [M, S], got shape {tuple(scales.shape)}")


@lowbit_op("swizzle_scales_128x4", mutates_args=(), check=_check_swizzle)
def _swizzle_scales_128x4(scales: Tensor, backend: str) -> Tensor:
    return scales.new_empty(round_up(scales.shape[0], 128), round_up(scales.shape[1], 4))


def _check_unswizzle(swizzled, rows, cols):
    op = "unswizzle_scales_128x4"
    C.check_tensor(op, "swizzled", swizzled)
    for name, v in (("rows", rows), ("cols", cols)):
        if v < 0:
            C.fail(op, name, f"must be >= 0, got {v}")
    if swizzled.numel() != round_up(rows, 128) * round_up(cols, 4):
        C.fail(op, "swizzled", f"holds {swizzled.numel()} elements, expected "
               f"{round_up(rows, 128)}x{round_up(cols, 4)} for rows={rows}, cols={cols}")


@lowbit_op("unswizzle_scales_128x4", mutates_args=(), check=_check_unswizzle)
def _unswizzle_scales_128x4(swizzled: Tensor, rows: int, cols: int, backend: str) -> Tensor:
    return swizzled.new_empty(rows, cols)


def swizzle_scales_128x4(scales: Tensor, *, backend: str = "auto") -> Tensor:
    """Linear [M, S] block scales -> the 128x4 blocked layout block-scaled GEMMs read (zero padded)."""
    return call("swizzle_scales_128x4", scales, backend)


def unswizzle_scales_128x4(swizzled: Tensor, rows: int, cols: int, *, backend: str = "auto") -> Tensor:
    return call("unswizzle_scales_128x4", swizzled, rows, cols, backend)


# ------------------------------------------------------------------------------------------ self-check


def self_check_cases() -> list:
    """Cases for `python -m dispatch check` (see dispatch/selfcheck.py)."""
    from .. import ops
    from ..selfcheck import Case
    from ..selfcheck import sample_activations as _x

    def nvq(dev, small):
        x = _x(dev, small)
        return (x, None, True)

    def nvq_given(dev, small):
        x = _x(dev, small)
        return (x, ops.nvfp4_global_scale_from_amax(x.float().abs().amax()), False)

    def nvdq(dev, small):
        q = ops.nvfp4_quantize(_x(dev, small), scale_layout="swizzled", backend="torch")
        return (q.codes, q.scales, q.global_scale, True, torch.bfloat16)

    def mxq(dev, small):
        return (_x(dev, small), "rceil", True)

    def mxdq(dev, small):
        q = ops.mxfp4_quantize(_x(dev, small), backend="torch")
        return (q.codes, q.scales, False, torch.bfloat16)

    def fp8q(dev, small):
        return (_x(dev, small), 128, 1e-10, False, True)

    def fp8dq(dev, small):
        q = ops.fp8_group_quantize(_x(dev, small), 128, ue8m0=True, backend="torch")
        return (q.codes, q.scales, 128, torch.bfloat16)

    def swz(dev, small):
        return (torch.randint(0, 255, (300, 56), dtype=torch.uint8).to(dev),)

    def unswz(dev, small):
        return (torch.randint(0, 255, (384, 56), dtype=torch.uint8).to(dev), 300, 53)

    return [
        Case("nvfp4_quantize", nvq, label="computed global scale, swizzled"),
        Case("nvfp4_quantize", nvq_given, label="given global scale, linear"),
        Case("nvfp4_dequantize", nvdq, label="swizzled -> bf16"),
        Case("mxfp4_quantize", mxq, label="rceil, swizzled"),
        Case("mxfp4_dequantize", mxdq, label="linear -> bf16"),
        Case("fp8_group_quantize", fp8q, label="g128, column-major scales"),
        Case("fp8_group_dequantize", fp8dq, label="g128 ue8m0 -> bf16"),
        Case("swizzle_scales_128x4", swz, label="300x56 -> 384x56 (128x4 tiles)"),
        Case("unswizzle_scales_128x4", unswz, label="384x56 -> 300x53"),
    ]
