"""Reference quantizers: NVFP4, MXFP4, FP8 per-token-group, and the 128x4 scale swizzle.

These functions *are* the contract. Every backend must produce the same bytes. All math is fp32 with
IEEE round-to-nearest divisions (torch never uses fast-math division), in the order written here.
"""

from __future__ import annotations

import math

import torch

from triton_ops.contract.formats import (
    E4M3_MAX,
    E8M0_NAN,
    MXFP4_BLOCK,
    NVFP4_AMAX_TO_SCALE,
    NVFP4_BLOCK,
    NVFP4_MIN_GLOBAL_SCALE,
    fp4_scales_shape,
    fp8_scale_storage,
    round_up,
)

from .formats import (
    bits_float,
    div_rn,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    exponent_field,
    float_bits,
    pack_nibbles,
    pow2_ceil,
    reciprocal_rn,
    unpack_nibbles,
)

# ------------------------------------------------------------------------------------------ 128x4 swizzle


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """[M, S] -> [round_up(M,128), round_up(S,4)] holding the cuBLASLt/CUTLASS 128x4 blocked layout.

    Byte (m, s) lands at flat offset (m//128)*S4*128 + (s//4)*512 + (m%32)*16 + ((m%128)//32)*4 + s%4,
    with S4 = round_up(S, 4). Padding is zero. The 2-D shape is only a container: read it flat.
    """
    m, s = scales.shape
    mp, sp = round_up(m, 128), round_up(s, 4)
    padded = torch.zeros(mp, sp, dtype=scales.dtype, device=scales.device)
    padded[:m, :s] = scales
    blocks = padded.view(mp // 128, 4, 32, sp // 4, 4).permute(0, 3, 2, 1, 4)
    return blocks.reshape(mp, sp)


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of swizzle_scales_128x4: back to linear [rows, cols]."""
    mp, sp = round_up(rows, 128), round_up(cols, 4)
    if swizzled.numel() != mp * sp:
        raise ValueError(f"swizzled scales hold {swizzled.numel()} elements, expected {mp}*{sp} for {rows}x{cols}")
    blocks = swizzled.reshape(mp // 128, sp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return blocks.reshape(mp, sp)[:rows, :cols].contiguous()


def _rows(t: torch.Tensor) -> int:
    return math.prod(t.shape[:-1])


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().reshape(_rows(x), x.shape[-1] // block, block)


def _amax(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.abs().amax(-1)  # NaN-propagating, as every backend must be


# ------------------------------------------------------------------------------------------------ NVFP4



def nvfp4_global_scale(x: torch.Tensor) -> torch.Tensor:
    """Decode-form global scale amax(|x|) / (448*6) as a 0-dim fp32 tensor (0 for empty or all-zero x)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return nvfp4_global_scale_from_amax(x.float().abs().amax())


def nvfp4_global_scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 2688, raised to NVFP4_MIN_GLOBAL_SCALE (2^-118) for a nonzero amax below 2688 * 2^-118 (~8.1e-33):
    a smaller global scale would count as 0 (its reciprocal overflows) and quantize the tensor to zeros, while
    2^-118 keeps the block scales normal E4M3 down to amax ~ 6 * 2^-6 * 2^-118 ~ 2.8e-37 (round trip within the
    format's error); below that they go subnormal, then 0. 0 (all zeros) and NaN stay."""
    gs = div_rn(amax.float(), NVFP4_AMAX_TO_SCALE)
    return torch.where(amax > 0, gs.clamp_min(NVFP4_MIN_GLOBAL_SCALE), gs)


def nvfp4_quantize(x: torch.Tensor, global_scale: torch.Tensor | None, swizzle: bool):
    """NVFP4: 16-element blocks along the last dim, E4M3 block scales, fp32 decode-form global scale.

    block scale s = e4m3(min((amax_b / 6) / gs, 448))      (|gs| < 2^-118, 0 included -> s = 0)
    inverse     r = (1 / gs) / fp32(s)                     (one IEEE division per block; 0 where s == 0)
    code        = e2m1(x * r)
    A global scale below NVFP4_MIN_GLOBAL_SCALE = 2^-118 in magnitude (0 included) therefore gives zero block
    scales and +-0 codes (sign kept; NaN -> 0): the tensor quantizes to zeros instead of saturating. The
    returned global scale is the given / computed one, unchanged.
    Multiplying by a per-block reciprocal instead of dividing each element keeps the kernels memory-bound. The
    reciprocal is formed exactly as torchao's nvfp4_quantize (0.18) and the MSLK Triton kernel form it, so the
    bytes equal theirs wherever the conventions agree (tests/test_quant_interop.py).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    gs = nvfp4_global_scale(x) if global_scale is None else global_scale.reshape(()).float()
    xb = _blocks(x, NVFP4_BLOCK)
    amax = _amax(xb)
    s = torch.where(gs.abs() < NVFP4_MIN_GLOBAL_SCALE, torch.zeros_like(amax), div_rn(div_rn(amax, 6.0), gs))
    s8 = e4m3_encode(s)
    s32 = s8.float()
    inv = torch.where(s32 == 0, torch.zeros_like(s32), torch.div(reciprocal_rn(gs), s32))
    q = xb * inv[..., None]
    codes = pack_nibbles(e2m1_encode(q)).reshape(*lead, k // 2)
    scales = swizzle_scales_128x4(s8.view(torch.uint8)).view(torch.float8_e4m3fn) if swizzle else s8.reshape(
        fp4_scales_shape(lead, k, NVFP4_BLOCK, False))
    return codes, scales, gs.reshape(()).clone()


def _linear_scales(scales: torch.Tensor, rows: int, cols: int, swizzle: bool) -> torch.Tensor:
    if swizzle:
        return unswizzle_scales_128x4(scales.view(torch.uint8), rows, cols).view(scales.dtype)
    return scales.reshape(rows, cols)


def nvfp4_dequantize(codes, scales, global_scale, swizzle: bool, out_dtype: torch.dtype):
    """value = (e2m1(code) * fp32(s)) * gs, rounded once to out_dtype."""
    lead, k = codes.shape[:-1], codes.shape[-1] * 2
    rows = _rows(codes)
    s = _linear_scales(scales, rows, k // NVFP4_BLOCK, swizzle).float()
    vals = e2m1_decode(unpack_nibbles(codes.reshape(rows, k // 2))).reshape(rows, k // NVFP4_BLOCK, NVFP4_BLOCK)
    out = (vals * s[..., None]) * global_scale.reshape(()).float()
    return out.reshape(*lead, k).to(out_dtype)


# ------------------------------------------------------------------------------------------------ MXFP4


def mxfp4_scale_exponent(amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32) of the block scale, before the NaN rule.

    floor (OCP MX spec): floor(log2(amax)) - 2          (2 = emax of E2M1); amax 0 or subnormal -> -127
    rceil (cuBLAS):      ceil(log2(amax / 6))           (exact, from the bits of fp32(amax / 6))
    Both clamped to [-127, 127].
    """
    if rounding == "floor":
        e = exponent_field(amax) - 127 - 2
    else:
        t = div_rn(amax, 6.0)
        field, mant = exponent_field(t), float_bits(t) & 0x7FFFFF
        normal = field - 127 + (mant != 0).to(torch.int32)
        subnormal = torch.where(mant > (1 << 22), -126, -127).to(torch.int32)
        e = torch.where(field == 0, subnormal, normal)
    return e.clamp(-127, 127)


def mxfp4_quantize(x: torch.Tensor, rounding: str, swizzle: bool):
    """MXFP4: 32-element blocks, E8M0 scale byte = exponent + 127 (0xFF when the block holds NaN/Inf).

    code = e2m1(x * 2^-e): exact scaling by a power of two, then RNE with saturation at +-6.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    xb = _blocks(x, MXFP4_BLOCK)
    amax = _amax(xb)
    e = mxfp4_scale_exponent(amax, rounding)
    finite = torch.isfinite(amax)
    inv = torch.where(finite, bits_float((127 - e) << 23), torch.full_like(amax, float("nan")))
    codes = pack_nibbles(e2m1_encode(xb * inv[..., None])).reshape(*lead, k // 2)
    sbytes = torch.where(finite, e + 127, E8M0_NAN).to(torch.uint8)
    scales = swizzle_scales_128x4(sbytes) if swizzle else sbytes.reshape(*lead, k // MXFP4_BLOCK)
    return codes, scales


def e8m0_decode(sbytes: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> fp32 2^(b-127); 0 -> 2^-127 (subnormal), 0xFF -> NaN."""
    b = sbytes.to(torch.int32)
    normal = bits_float(b.clamp(min=1) << 23)
    v = torch.where(b == 0, torch.full_like(normal, 2.0**-127), normal)
    return torch.where(b == E8M0_NAN, torch.full_like(v, float("nan")), v)


def mxfp4_dequantize(codes, scales, swizzle: bool, out_dtype: torch.dtype):
    lead, k = codes.shape[:-1], codes.shape[-1] * 2
    rows = _rows(codes)
    s = e8m0_decode(_linear_scales(scales, rows, k // MXFP4_BLOCK, swizzle))
    vals = e2m1_decode(unpack_nibbles(codes.reshape(rows, k // 2))).reshape(rows, k // MXFP4_BLOCK, MXFP4_BLOCK)
    return (vals * s[..., None]).reshape(*lead, k).to(out_dtype)


# ------------------------------------------------------------------------------------------ FP8 groups


def fp8_group_quantize(x: torch.Tensor, group_size: int, eps: float, ue8m0: bool, column_major: bool):
    """FP8 E4M3 per-token-group: s = max(amax_g, eps) / 448 (rounded up to a power of two if ue8m0);
    code = e4m3(x * (1 / s)) with saturation at +-448; 1 / s is one IEEE division per group (for ue8m0
    scales, a power of two, this equals x / s exactly)."""
    lead, k = x.shape[:-1], x.shape[-1]
    xb = _blocks(x, group_size)
    s = div_rn(_amax(xb).clamp(min=eps), E4M3_MAX)
    if ue8m0:
        s = pow2_ceil(s)
    codes = e4m3_encode(xb * reciprocal_rn(s)[..., None]).reshape(*lead, k)
    scales = fp8_scale_storage(tuple(lead), k // group_size, column_major, x.device)
    scales.copy_(s.reshape(*lead, k // group_size))
    return codes, scales


def fp8_group_dequantize(codes, scales, group_size: int, out_dtype: torch.dtype):
    lead, k = codes.shape[:-1], codes.shape[-1]
    rows = _rows(codes)
    vals = codes.float().reshape(rows, k // group_size, group_size)
    out = vals * scales.reshape(rows, k // group_size)[..., None].float()
    return out.reshape(*lead, k).to(out_dtype)
