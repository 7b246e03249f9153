"""Number-format primitives in plain torch, written from the format definitions (see docs in README).

Rounding is round-to-nearest-even everywhere; saturation clamps to the format's largest finite value.
"""

from __future__ import annotations

import torch

from triton_ops.contract.formats import E4M3_MAX, E4M3_NAN

# The 16 E2M1 codes as values; code = sign << 3 | magnitude index.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """fp32 -> E2M1 code (uint8, 0..15): RNE, saturating to +-6, NaN -> 0, sign bit kept (so -0.1 -> 0x8).

    Magnitude index = number of rounding thresholds passed; '>' at thresholds whose tie rounds down to an
    even code, '>=' where the tie rounds up to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2,
    2.5->2, 3.5->4, 5->4).
    """
    a = q.abs()
    mag = (
        (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    ).to(torch.uint8)
    sign = (torch.signbit(q) & ~torch.isnan(q)).to(torch.uint8)
    return mag | (sign << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2i in the low nibble, 2i+1 in the high nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e4m3_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 (float8_e4m3fn): RNE, saturating to +-448, NaN -> 0x7F (canonical)."""
    out = v.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    out = torch.where(torch.isnan(v), E4M3_NAN, out).to(torch.uint8)  # fixed in the byte domain (compilable)
    return out.view(torch.float8_e4m3fn)


def div_rn(a: torch.Tensor, b) -> torch.Tensor:
    """Correctly rounded a / b on any device. torch on CUDA divides by a Python (or host) scalar as
    a * (1/b), which is not the IEEE quotient; dividing by a device tensor is. The fill is a device kernel:
    no host transfer, so this stays CUDA-graph capturable."""
    if not isinstance(b, torch.Tensor) or b.device != a.device:
        b = torch.full((), float(b), dtype=a.dtype, device=a.device)
    return torch.div(a, b)


def float_bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def bits_float(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


def exponent_field(x: torch.Tensor) -> torch.Tensor:
    """Biased fp32 exponent (0..255) of x."""
    return (float_bits(x) >> 23) & 0xFF


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= s for positive normal fp32 s; non-finite s unchanged."""
    b = float_bits(s)
    up = bits_float((b + 0x7FFFFF) & 0x7F800000)
    return torch.where(torch.isfinite(s), up, s)


def reciprocal_rn(d: torch.Tensor) -> torch.Tensor:
    """Correctly rounded 1 / d (tensor / tensor division is IEEE on CPU and CUDA)."""
    return torch.div(torch.ones_like(d), d)
