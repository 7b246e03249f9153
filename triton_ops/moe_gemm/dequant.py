"""In-register operand preparation shared by the grouped GEMM kernels: FP4 / FP8 weight tiles to MMA operands,
and the one tl.dot wrapper that knows the interpreter's limits.

Interpreter traps these work around (triton 3.9, checked on the CPU): tl.dot on bf16 operands returns garbage
(the bf16 bits are multiplied as integers), and fp8 -> fp32 casts are wrong (see _formats.py). So under the
interpreter (`F32_DOT`) operands go to fp32 first, and fp8 bytes are decoded arithmetically (`EMULATE`); every
value involved is exact in fp32, so only the accumulation order differs from the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_ops._formats import e2m1_decode_nibble, e4m3_decode, unpack_nibbles


@triton.jit
def mma(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b with fp32 accumulation; fp32 operands under the interpreter (its bf16 dot is broken)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def e4m3_operand(byte, EMULATE: tl.constexpr, F32_DOT: tl.constexpr):
    """E4M3 bytes (uint8) -> a tl.dot operand of the same values: fp8 itself where the hardware has fp8 MMA,
    else bf16 (every E4M3 value is exact in bf16; fp32 under the interpreter)."""
    if EMULATE:
        v = e4m3_decode(byte)
        if F32_DOT:
            return v
        else:
            return v.to(tl.bfloat16)
    else:
        return byte.to(tl.float8e4nv, bitcast=True)


@triton.jit
def e8m0_to_f32(sbyte):
    """E8M0 scale byte -> fp32 2^(b - 127): byte 0 -> 2^-127 (a subnormal), 0xFF -> NaN (the reference's
    e8m0_decode)."""
    b = sbyte.to(tl.int32)
    v = (b << 23).to(tl.float32, bitcast=True)
    v = tl.where(b == 0, 5.877471754111438e-39, v)  # 2^-127
    return tl.where(b == 255, float("nan"), v)


@triton.jit
def mxfp4_tile_t(packed, sbytes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 2] packed E2M1 bytes (element 2i in the low nibble) and [BLOCK_N, BLOCK_K // 32]
    E8M0 scales -> the [BLOCK_K, BLOCK_N] weight operand (bf16; fp32 under the interpreter). code * 2^e has
    at most two significant bits, so the bf16 value is exact unless it leaves bf16's range (fp32's)."""
    codes = unpack_nibbles(packed, BLOCK_N, BLOCK_K).to(tl.int32)
    v = tl.reshape(e2m1_decode_nibble(codes), [BLOCK_N, BLOCK_K // 32, 32])
    v = tl.reshape(v * e8m0_to_f32(sbytes)[:, :, None], [BLOCK_N, BLOCK_K])
    if not F32_DOT:
        v = v.to(tl.bfloat16)
    return tl.trans(v)
