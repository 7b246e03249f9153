"""In-register operand preparation shared by the grouped GEMM kernels: FP4 (MXFP4, NVFP4) / FP8 weight tiles to MMA
operands, and the one tl.dot wrapper that knows the interpreter's limits.

Interpreter traps these work around (triton 3.9, checked on the CPU): tl.dot on bf16 operands returns garbage
(the bf16 bits are multiplied as integers), and fp8 -> fp32 casts are wrong (see _formats.py). So under the
interpreter (`F32_DOT`) operands go to fp32 first, and fp8 bytes are decoded arithmetically (`EMULATE`); every
value involved is exact in fp32, so only the accumulation order differs from the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton_ops._formats import e2m1_decode_nibble, e4m3_decode, e4m3_decode_fast, unpack_nibbles


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
def fp4_tile_t(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SF_VEC: tl.constexpr,
               DTYPE: tl.constexpr, F32_DOT: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 2] packed E2M1 bytes (element 2i in the low nibble) and fp32 [BLOCK_N, BLOCK_K // SF_VEC]
    block scales -> the [BLOCK_K, BLOCK_N] weight operand e2m1 * scale in DTYPE (fp32 under the interpreter)."""
    codes = unpack_nibbles(packed, BLOCK_N, BLOCK_K).to(tl.int32)
    v = tl.reshape(e2m1_decode_nibble(codes), [BLOCK_N, BLOCK_K // SF_VEC, SF_VEC])
    v = tl.reshape(v * scale[:, :, None], [BLOCK_N, BLOCK_K])
    if not F32_DOT:
        v = v.to(DTYPE)
    return tl.trans(v)


@triton.jit
def mxfp4_tile_t(packed, sbytes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """MXFP4: E8M0 scale bytes [BLOCK_N, BLOCK_K // 32] -> the bf16 operand. code * 2^e has at most two
    significant bits, so the bf16 value is exact unless it leaves bf16's range (fp32's)."""
    return fp4_tile_t(packed, e8m0_to_f32(sbytes), BLOCK_N, BLOCK_K, 32, tl.bfloat16, F32_DOT)


@triton.jit
def nvfp4_tile_t(packed, sbytes, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EMULATE: tl.constexpr, F32_DOT: tl.constexpr):
    """NVFP4 without its global scale: E4M3 scale bytes [BLOCK_N, BLOCK_K // 16] -> the DTYPE (bf16 / fp16)
    operand e2m1 * e4m3. Exact in both: the product has at most 6 significant bits and lies in [2^-10, 2688]
    (0 included); E4M3 NaN bytes (0x7F / 0xFF) give NaN, as in the reference."""
    return fp4_tile_t(packed, e4m3_decode_fast(sbytes, EMULATE), BLOCK_N, BLOCK_K, 16, DTYPE, F32_DOT)
