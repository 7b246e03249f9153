"""Number-format device functions shared by every Triton kernel.

Why emulate instead of casting: under TRITON_INTERPRET=1 the fp32 -> float8e4nv cast rounds wrong and
does not saturate, and fp32 -> bf16 truncates. The functions here build the bytes with integer arithmetic
and are exact everywhere; kernels use them for per-block scales always (cheap), and for per-element values
only on the interpreter path (`EMULATE` constexpr chosen by the launcher). The GPU tests prove both paths
equal the torch reference byte for byte.
"""

import triton
import triton.language as tl


@triton.jit
def abs_bits(x):
    """|x| as int32 bits. For non-negative floats the int order is the float order, and every NaN sorts
    above +Inf, so an integer max of these bits is a NaN-propagating amax (the GPU's float max drops
    NaN; torch.amax keeps it) and a fast one (a plain integer max, also under the interpreter, where a
    custom-combine tl.reduce runs ~200x slower)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def amax_nan(x, axis: tl.constexpr):
    """max |x| along axis, NaN-propagating (fp32 in, fp32 out)."""
    return tl.max(abs_bits(x), axis).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_encode(q):
    """fp32 -> E2M1 code in uint8 (0..15): RNE, saturate at +-6, NaN -> 0, sign kept (-0.1 -> 0x8).
    Magnitude = thresholds passed; '>=' where the tie rounds up to the even code."""
    a = tl.abs(q)
    mag = (
        (a > 0.25).to(tl.uint8)
        + (a >= 0.75).to(tl.uint8)
        + (a > 1.25).to(tl.uint8)
        + (a >= 1.75).to(tl.uint8)
        + (a > 2.5).to(tl.uint8)
        + (a >= 3.5).to(tl.uint8)
        + (a > 5.0).to(tl.uint8)
    )
    sign = (q.to(tl.uint32, bitcast=True) >> 31).to(tl.uint8)
    sign = tl.where(q != q, 0, sign).to(tl.uint8)
    return mag | (sign << 3)


@triton.jit
def e2m1_decode(code):
    """E2M1 code (uint8, low nibble) -> fp32 value."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    # e == 0: m * 0.5 (0 or 0.5); else (1 + m/2) * 2^(e-1)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << e).to(tl.float32) * 0.5)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def pack_nibbles(codes, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] codes -> [BLOCK_M, BLOCK_K // 2] bytes, element 2i in the low nibble."""
    pairs = tl.reshape(codes, [BLOCK_M, BLOCK_K // 2, 2])
    lo, hi = tl.split(pairs)
    return lo | (hi << 4)


@triton.jit
def unpack_nibbles(packed, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K // 2] bytes -> [BLOCK_M, BLOCK_K] codes."""
    return tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_M, BLOCK_K])


@triton.jit
def e4m3_encode_emulated(v):
    """fp32 -> E4M3 byte (uint8): RNE, saturate at +-448, NaN -> 0x7F. Integer arithmetic only."""
    sign = v.to(tl.uint32, bitcast=True) >> 31
    a = tl.minimum(tl.abs(v), 448.0)  # NaN lanes are overwritten below
    ab = a.to(tl.uint32, bitcast=True)
    # normal E4M3 (a >= 2^-6): keep 3 mantissa bits with round-half-even; a carry bumps the exponent.
    r = ab + 0x7FFFF + ((ab >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal E4M3 (a < 2^-6): m = rne(a * 2^9) in 0..8 (8 == byte 0x08 == 2^-6, consistent with normal).
    e = ab >> 23
    full = (ab & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - e.to(tl.int32), 1), 31).to(tl.uint32)
    q = full >> shift
    one = tl.full(shift.shape, 1, tl.uint32)
    rem = full & ((one << shift) - 1)
    half = one << (shift - 1)
    m = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.uint32)
    m = tl.where(e == 0, 0, m)
    mag = tl.where(a < 0.015625, m, normal)
    byte = tl.where(v != v, 0x7F, mag | (sign << 7))
    return byte.to(tl.uint8)


@triton.jit
def e4m3_decode(byte):
    """E4M3 byte -> fp32, exact (0x7F / 0xFF -> NaN)."""
    b = byte.to(tl.uint32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # 2^-9
    mag = tl.where(exp == 0, sub, normal)
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def e4m3_encode(v, EMULATE: tl.constexpr):
    """fp32 -> E4M3 byte; the hardware cvt.satfinite on GPU (sm_89+), integer emulation otherwise."""
    if EMULATE:
        return e4m3_encode_emulated(v)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def cast_out(x, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> output dtype with RNE. The interpreter truncates fp32 -> bf16, so emulate that one there."""
    if EMULATE and OUT_DTYPE == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(OUT_DTYPE)


@triton.jit
def swizzled_offset_128x4(rows, cols, cols_padded):
    """Flat byte offset of scale (row, col) in the cuBLASLt/CUTLASS 128x4 layout (int64)."""
    r = rows.to(tl.int64)
    c = cols.to(tl.int64)
    return (r // 128) * (cols_padded * 128) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
