"""FP8 E4M3 per-token-group quantize / dequantize (Triton), DeepSeek / DeepGEMM style.

Scales are fp32, one per `group_size` elements of a row; written through explicit strides so the same
kernel fills row-major scales and DeepGEMM's column-major TMA-aligned scales. Contract:
dispatch/reference/quant.py (fp8_group_quantize).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dispatch.checks import fail, rows_view
from dispatch.reference.quant import fp8_scale_storage

from ._formats import amax_nan, cast_out, e4m3_decode_fast, e4m3_encode, fp8_group_scale
from ._launch import TL_DTYPE, emulate_formats, pick_tile


@triton.jit
def _fp8_group_quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, M, K, stride_xm, stride_sm, stride_sg, eps,
    GROUP: tl.constexpr, UE8M0: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    # [BLOCK_M, groups, GROUP] addressed directly: no reshape (reshapes cost layout shuffles on GPU)
    r3 = rows[:, None, None]
    cols = pid_k * BLOCK_K + tl.arange(0, NG)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    mask = (r3 < M) & (cols < K)
    x = tl.load(x_ptr + r3 * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = amax_nan(x, 2)
    s, inv = fp8_group_scale(amax, eps, UE8M0)
    codes = e4m3_encode(x * inv[:, :, None], EMULATE)
    tl.store(codes_ptr + r3 * K + cols, codes, mask=mask)
    groups = pid_k * NG + tl.arange(0, NG)
    smask = (rows < M)[:, None] & (groups < K // GROUP)[None, :]
    tl.store(scales_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, s, mask=smask)


@triton.jit
def _fp8_group_dequantize_kernel(
    codes_ptr, scales_ptr, out_ptr, M, K, stride_sm, stride_sg,
    GROUP: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NG: tl.constexpr = BLOCK_K // GROUP
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_k = tl.program_id(1)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < M)[:, None] & (cols < K)[None, :]
    # hardware E4M3 -> fp32 on sm_89+ (exact: every E4M3 value is an fp16 value); ~2x fewer instructions
    vals = e4m3_decode_fast(tl.load(codes_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0), EMULATE)
    groups = pid_k * NG + tl.arange(0, NG)
    smask = (rows < M)[:, None] & (groups < K // GROUP)[None, :]
    s = tl.load(scales_ptr + rows[:, None] * stride_sm + groups[None, :] * stride_sg, mask=smask, other=0.0)
    out = tl.reshape(tl.reshape(vals, [BLOCK_M, NG, GROUP]) * s[:, :, None], [BLOCK_M, BLOCK_K])
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], cast_out(out, OUT_DTYPE, EMULATE), mask=mask)


def _scale_strides(op: str, scales: torch.Tensor, rows: int, groups: int) -> tuple[int, int]:
    """(row stride, group stride) of scales as a [rows, groups] view (row- or column-major both work)."""
    try:
        return scales.view(rows, groups).stride()
    except RuntimeError:
        fail(op, "scales", f"shape {tuple(scales.shape)} with strides {scales.stride()} cannot be read as "
                           f"[{rows}, {groups}] without a copy")
    raise AssertionError("unreachable")


def _group_size_refusal(group_size: int) -> str | None:
    """Triton tiles need a power-of-two group of at least 16; the torch backend takes any divisor."""
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size} is not a power of two >= 16"
    return None


def supports_quantize(x, group_size, eps, ue8m0, column_major) -> str | None:
    return _group_size_refusal(group_size)


def supports_dequantize(codes, scales, group_size, out_dtype) -> str | None:
    return _group_size_refusal(group_size)


def fp8_group_quantize(x, group_size, eps, ue8m0, column_major):
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    x2 = rows_view("fp8_group_quantize", "x", x)
    rows = x2.shape[0]
    codes = torch.empty(*lead, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = fp8_scale_storage(lead, k // group_size, column_major, x.device)
    if codes.numel() == 0:
        return codes, scales
    cfg = pick_tile(rows, k, x.device, min_block_k=group_size)
    stride_sm, stride_sg = _scale_strides("fp8_group_quantize", scales, rows, k // group_size)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    _fp8_group_quantize_kernel[grid](
        x2, codes.view(torch.uint8), scales, rows, k, x2.stride(0), stride_sm, stride_sg, float(eps),
        GROUP=group_size, UE8M0=ue8m0, EMULATE=emulate_formats(x.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return codes, scales


def fp8_group_dequantize(codes, scales, group_size, out_dtype):
    lead, k = tuple(codes.shape[:-1]), codes.shape[-1]
    codes = codes.contiguous()
    out = torch.empty(*lead, k, dtype=out_dtype, device=codes.device)
    if out.numel() == 0:
        return out
    rows = out.numel() // k
    stride_sm, stride_sg = _scale_strides("fp8_group_dequantize", scales, rows, k // group_size)
    cfg = pick_tile(rows, k, codes.device, min_block_k=group_size)
    grid = (triton.cdiv(rows, cfg.block_m), triton.cdiv(k, cfg.block_k))
    _fp8_group_dequantize_kernel[grid](
        codes.view(torch.uint8), scales, out, rows, k, stride_sm, stride_sg,
        GROUP=group_size, OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(codes.device),
        BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps)
    return out
