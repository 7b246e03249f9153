"""The prepacked FP4 weight layout (MXFP4 / NVFP4, W4A16) that the Hopper decode kernel streams, and its checks.

Torch only: the prepack op's reference, its inverse (the round-trip oracle), the kernel and the checks share it.

Values: int32 (E, N, KP / 8), KP = K rounded up to a multiple of CHUNK = 128 (padded with zero codes). Each row's
128-element K chunk u is 16 words; word 4c + t (c, t in 0..3) of the chunk holds the 8 elements

    k = 128 u + 32 t + 16 s + 8 h + 2 c + b        (s, h, b in {0, 1})

with the elements of half b (bits 16 b .. 16 b + 15) in the 4 slots p = 2 s + h of that half. A slot holds an
e2m1 code as its sign bit and 3 magnitude bits (m2 m1 m0) at these bits of the half (SIGN_BIT, MAG_BITS):

    p = 0: sign 15, magnitude 8 7 6      p = 1: sign 12, magnitude 5 4 3
    p = 2: sign 9,  magnitude 2 1 0      p = 3: sign 14, magnitude 11 10 13

So:
* a word holds exactly the weights one thread of a warpgroup MMA's register A fragment needs at K offset 2c of 8
  consecutive 16-wide K steps (each thread owns columns 2c, 2c + 1, 2c + 8, 2c + 9 of a step), and the 4 words of
  one (row, c) are contiguous: one 16-byte load per thread per row and 128 K;
* bf16 bits (sign 15, exponent bits 8 7, mantissa bit 6) of the pair (b = 0, 1) of slot p, each value times
  2^-126, packed as the MMA's bf16x2 register, are one or two operations on the word: `w & M`, `(w << 3) & M`,
  `(w << 6) & M` (M = 0x81C081C0), and `(w << 1) & 0x80008000 | (w >> 3) & 0x01800180 | (w >> 7) & 0x00400040`
  (slot 3). fp16 bits (magnitude at 11 10 9, the value times 2^-14): the bf16 bits with the magnitude shifted up 3.
Scales: uint8 (E, N, SP), SP = KP / block rounded up to a multiple of 16 (MXFP4: E8M0 per 32; NVFP4: E4M3 per 16),
in K order, the padding filled with the unit scale (127 / 0x38) so a padded zero code never meets a NaN scale. Rows
start 16-byte aligned, so a row's scale bytes of one K chunk (4 for MXFP4, 8 for NVFP4) are one aligned load.
"""

from __future__ import annotations

import torch

from .checks import check_dtype, check_tensor, fail
from .formats import MXFP4_BLOCK, NVFP4_BLOCK
from .moe_gemm import _check_layout, _check_scale

CHUNK = 128  # K elements per 16-word chunk of a row
FP4_BLOCKS = {"mxfp4": MXFP4_BLOCK, "nvfp4": NVFP4_BLOCK}  # elements per block scale
UNIT_SCALE = {"mxfp4": 127, "nvfp4": 0x38}  # 1.0 in E8M0 / E4M3: the padding's scale


def padded_k(k: int) -> int:
    return -(-k // CHUNK) * CHUNK


SCALE_ROW_ALIGN = 16  # bytes: prepacked scale rows are padded to a multiple of this


def scale_row(k: int, fmt: str) -> int:
    """SP: the prepacked scale bytes per weight row for K = k."""
    return -(-(padded_k(k) // FP4_BLOCKS[fmt]) // SCALE_ROW_ALIGN) * SCALE_ROW_ALIGN


def prepacked_shapes(e: int, n: int, k: int, fmt: str) -> tuple[tuple, tuple]:
    """(values shape, scales shape) of the prepacked layout of (E, N, K) FP4 weights."""
    return (e, n, padded_k(k) // 8), (e, n, scale_row(k, fmt))


def _chunks(codes: torch.Tensor) -> torch.Tensor:
    """(E, N, KP) codes -> (E, N, U, t, s, h, c, b) view of the chunk coordinates."""
    e, n, kp = codes.shape
    return codes.reshape(e, n, kp // CHUNK, 4, 2, 2, 4, 2)


SIGN_BIT = (15, 12, 9, 14)  # per slot p = 2 s + h of a 16-bit half
MAG_BITS = ((8, 7, 6), (5, 4, 3), (2, 1, 0), (11, 10, 13))  # (m2, m1, m0) per slot


def _encode_halves(codes: torch.Tensor) -> torch.Tensor:
    """codes (..., 4 slots) -> int32 (...) 16-bit halves."""
    c = codes.to(torch.int32)
    half = torch.zeros(c.shape[:-1], dtype=torch.int32, device=c.device)
    for p in range(4):
        half |= ((c[..., p] >> 3) & 1) << SIGN_BIT[p]
        for j, pos in enumerate(MAG_BITS[p]):
            half |= ((c[..., p] >> (2 - j)) & 1) << pos
    return half


def _decode_halves(half: torch.Tensor) -> torch.Tensor:
    """int32 (...) 16-bit halves -> codes (..., 4 slots) uint8."""
    out = []
    for p in range(4):
        c = ((half >> SIGN_BIT[p]) & 1) << 3
        for j, pos in enumerate(MAG_BITS[p]):
            c |= ((half >> pos) & 1) << (2 - j)
        out.append(c)
    return torch.stack(out, dim=-1).to(torch.uint8)


def prepack_values(w_packed: torch.Tensor) -> torch.Tensor:
    """Linear E2M1 pairs (E, N, K/2) uint8 (element 2i in the low nibble) -> int32 words (E, N, KP/8)."""
    e, n, kh = w_packed.shape
    k = kh * 2
    codes = torch.stack((w_packed & 0xF, w_packed >> 4), dim=-1).reshape(e, n, k)
    codes = torch.nn.functional.pad(codes, (0, padded_k(k) - k))
    x = _chunks(codes).permute(0, 1, 2, 6, 3, 7, 4, 5)  # (E, N, U, c, t, b, s, h)
    half = _encode_halves(x.reshape(*x.shape[:-2], 4))  # (E, N, U, c, t, b): slot p = 2 s + h
    byte = torch.stack((half & 0xFF, half >> 8), dim=-1).to(torch.uint8)  # little-endian: half b = bytes 2b, 2b+1
    return byte.reshape(e, n, -1, 4).contiguous().view(torch.int32).reshape(e, n, -1)


def unpack_values(values: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of prepack_values: int32 words (E, N, KP/8) -> linear E2M1 pairs (E, N, K/2) uint8."""
    e, n, _ = values.shape
    byte = values.contiguous().view(torch.uint8).reshape(e, n, -1, 4, 4, 2, 2).to(torch.int32)  # (.., c, t, b, 2)
    x = _decode_halves(byte[..., 0] | (byte[..., 1] << 8)).reshape(e, n, -1, 4, 4, 2, 2, 2)  # (.., b, s, h)
    codes = x.permute(0, 1, 2, 4, 6, 7, 3, 5).reshape(e, n, -1)[..., :k]  # (E, N, U, t, s, h, c, b)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def prepack_scales(w_scale: torch.Tensor, k: int, fmt: str) -> torch.Tensor:
    """Linear scale bytes (E, N, K/block) -> (E, N, SP), the padding the unit scale."""
    pad = scale_row(k, fmt) - w_scale.shape[-1]
    return torch.nn.functional.pad(w_scale, (0, pad), value=UNIT_SCALE[fmt]).contiguous()


def unpack_scales(scales: torch.Tensor, k: int, fmt: str) -> torch.Tensor:
    return scales[..., : k // FP4_BLOCKS[fmt]].contiguous()


# E8M0 bytes up to this keep 2^126 * 2^(s - 127) (the folded MXFP4 multiplier) in bf16's range: the prepacked
# kernel's per-tile fold (MoeGemmConfig.fold_scale) runs its one-multiply loop on tiles whose bytes are all <= this
FOLD_MAX_SCALE = 128


def check_fmt(op: str, fmt) -> None:
    if fmt not in FP4_BLOCKS:
        fail(op, "fmt", f"expected one of {tuple(FP4_BLOCKS)}, got {fmt!r}")


def check_prepack(w_packed, w_scale, fmt, op: str = "moe_gemm_fp4_prepack") -> None:
    """The prepack op's inputs: the quantizer's linear layout, (E, N, K/2) uint8 codes + (E, N, K/block) scales."""
    check_tensor(op, "w_packed", w_packed)
    check_tensor(op, "w_scale", w_scale)
    check_fmt(op, fmt)
    block = FP4_BLOCKS[fmt]
    check_dtype(op, "w_packed", w_packed, (torch.uint8,))
    check_dtype(op, "w_scale", w_scale, (torch.uint8,))
    if w_packed.dim() != 3:
        fail(op, "w_packed", f"expected (E, N, K/2) packed codes, got shape {tuple(w_packed.shape)}")
    e, n, kh = w_packed.shape
    if (2 * kh) % block:
        fail(op, "w_packed", f"K={2 * kh} is not a multiple of {block} (one {fmt} scale per {block} weights)")
    if tuple(w_scale.shape) != (e, n, 2 * kh // block):
        fail(op, "w_scale", f"expected shape {(e, n, 2 * kh // block)} (the linear scale layout), got "
                            f"{tuple(w_scale.shape)}")
    if w_scale.device != w_packed.device:
        fail(op, "w_scale", f"on {w_scale.device}, w_packed on {w_packed.device}")


def check_prepacked_weights(op: str, a, values, scales, fmt, k: int, e: int) -> None:
    """Prepacked values int32 (E, N, KP/8) and scales uint8 (E, N, SP) for K = k, on a's device."""
    check_fmt(op, fmt)
    block = FP4_BLOCKS[fmt]
    if k % block:
        fail(op, "a", f"K={k} is not a multiple of {block} (one {fmt} scale per {block} weights)")
    check_tensor(op, "w_values", values)
    check_tensor(op, "w_scales", scales)
    if values.dtype != torch.int32:
        fail(op, "w_values", f"dtype {str(values.dtype).removeprefix('torch.')}: expected the int32 words of "
                             "moe_gemm_fp4_prepack (the linear uint8 layout goes to moe_gemm_mxfp4 / moe_gemm_nvfp4)")
    check_dtype(op, "w_scales", scales, (torch.uint8,))
    n = values.shape[1] if values.dim() == 3 else -1
    want_v, want_s = prepacked_shapes(e, n, k, fmt)
    if tuple(values.shape) != want_v:
        fail(op, "w_values", f"expected prepacked shape {want_v} for K={k}, got {tuple(values.shape)}")
    if tuple(scales.shape) != want_s:
        fail(op, "w_scales", f"expected prepacked {fmt} scale shape {want_s} for K={k}, got {tuple(scales.shape)}")
    for name, t in (("w_values", values), ("w_scales", scales)):
        if not t.is_contiguous():
            fail(op, name, "must be contiguous (the layout moe_gemm_fp4_prepack returns)")
        if t.device != a.device:
            fail(op, name, f"on {t.device}, a on {a.device}")


def check_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m,
                        op: str = "moe_gemm_fp4_prepacked") -> None:
    """bf16 (MXFP4; bf16 / fp16 for NVFP4) activations x prepacked FP4 weights (+ NVFP4's fp32 (E,) global)."""
    e = _check_layout(op, a, w_values, m_indices, masked_m)
    check_prepacked_weights(op, a, w_values, w_scales, fmt, a.shape[-1], e)
    if fmt == "mxfp4":
        check_dtype(op, "a", a, (torch.bfloat16,))
        if w_global is not None:
            fail(op, "w_global", "MXFP4 weights have no global scale (give None)")
    else:
        check_dtype(op, "a", a, (torch.bfloat16, torch.float16))
        if w_global is None:
            fail(op, "w_global", "NVFP4 weights need the fp32 (E,) global scales")
        _check_scale(op, "w_global", w_global, (e,), a)
