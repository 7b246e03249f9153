"""Number-format device functions shared by every Triton kernel.

Why emulate instead of casting: under TRITON_INTERPRET=1 the fp32 -> float8e4nv cast rounds wrong and
does not saturate, and fp32 -> bf16 truncates. The functions here build the bytes with integer arithmetic
and are exact everywhere; kernels use them for per-block scales always (cheap), and for per-element values
only on the interpreter path (`EMULATE` constexpr chosen by the launcher). The GPU tests prove both paths
equal the torch reference byte for byte.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from triton_ops.blackwell import e2m1x2_hw
from triton_ops.contract.formats import NVFP4_MIN_GLOBAL_SCALE

# NVFP4_MIN_GLOBAL_SCALE as a constexpr (globals read inside @triton.jit must be constexprs).
NVFP4_MIN_GS = tl.constexpr(NVFP4_MIN_GLOBAL_SCALE)

# Launcher-side code of a 16/32-bit input dtype for the pair-word kernels (see `split_pairs`).
IN_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


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
def with_sign(mag, sign_bit):
    """Set the sign bit of non-negative fp32 `mag`. Not `-mag`: Triton lowers unary minus to 0 - x, which
    turns -0.0 into +0.0 (and the formats have negative zero codes)."""
    return (mag.to(tl.uint32, bitcast=True) | (sign_bit.to(tl.uint32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_encode(q):
    """fp32 -> E2M1 code in uint8 (0..15): RNE, saturate at +-6, NaN -> 0, sign kept (-0.1 -> 0x8).

    One fp32 add does the rounding: with a = min(|q|, 6) in binade e (e = 0 for a < 2), C = 2^(e + 22) has
    an ulp equal to the E2M1 step there (0.5, 1, 2), so S = a + C rounds a to the grid with ties to even,
    exactly as the format asks; S's low mantissa bits then count grid steps above C, and the code is that
    count plus 2e. Full-rate fp32 work plus a few integer ops (INT32 runs at half rate on Hopper)."""
    sign = (q.to(tl.uint32, bitcast=True) >> 31) << 3
    a = tl.minimum(tl.abs(q), 6.0)
    eb = tl.maximum(a, 1.0).to(tl.uint32, bitcast=True) & 0x7F800000  # exponent bits of max(a, 1)
    c = (eb + (22 << 23)).to(tl.float32, bitcast=True)
    steps = (a + c).to(tl.uint32, bitcast=True) & 0xF
    code = (steps + (eb >> 22) - 254) | sign
    return tl.where(q != q, 0, code).to(tl.uint8)


@triton.jit
def e2m1_magnitude_word(a):
    """a = min(|q|, 6), never NaN -> int32 whose low byte is the E2M1 magnitude code (0..7) of a, RNE.

    The fp32 add a + C rounds a to the E2M1 grid in one step (the faster cousin of e2m1_encode, for kernels
    that handle sign and NaN per block): C's ulp is the grid step of a's binade (0.5, 1, 2) and its low
    mantissa bits hold the code offset of that binade (0, 2, 4 steps), so the sum's low bits are the code:
    C = 2^22 for a < 2, 2^23 + 2 for [2, 4), 2^24 + 8 for [4, 6]. Ties go to even because the offsets are even.
    C's exponent field E = max(exp(a), 127) + 22 and C = E << 23 | 2(E - 149), built as m + (m >> 22) from
    m = (E << 23) - 297 (one max-add and one shift-add on the GPU)."""
    eb = a.to(tl.int32, bitcast=True) & 0x7F800000
    m = tl.maximum(eb + ((22 << 23) - 297), (149 << 23) - 297)
    c = (m + (m >> 22)).to(tl.float32, bitcast=True)
    return (a + c).to(tl.int32, bitcast=True)


@triton.jit
def e2m1_pair_byte(mag_lo, mag_hi, signs):
    """E2M1 pair byte (low element in the low nibble) from two e2m1_magnitude_word results and `signs`, a
    word with the low element's sign at bit 15 and the high one's at bit 31 (a bf16/fp16 pair word masked
    to 0x80008000; 0 drops the signs). Built in the top byte with three multiply-adds (the FMA pipe, not
    the half-rate integer ALU; no shifts needed for the signs: x 4097 copies bit 15 to 27, bit 31 stays)."""
    top = mag_lo * (1 << 24) + mag_hi * (1 << 28) + signs * 4097
    return (top.to(tl.uint32, bitcast=True) >> 24).to(tl.uint8)


@triton.jit
def split_pairs(w, IN_KIND: tl.constexpr):
    """Two adjacent inputs packed in one machine word -> (even element, odd element) as fp32.
    IN_KIND 0: bf16 pairs in int32, 1: fp16 pairs in int32, 2: fp32 pairs in int64. Loading words
    keeps 16-byte vector loads and hands each thread whole (2i, 2i+1) pairs, so FP4 packing needs no
    reshape/split (which cost layout shuffles)."""
    if IN_KIND == 0:
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
    elif IN_KIND == 1:
        lo = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = w.to(tl.int32).to(tl.float32, bitcast=True)
        hi = (w >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def e2m1_decode(code):
    """E2M1 code (uint8, low nibble) -> fp32 value."""
    c = code.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    # e == 0: m * 0.5 (0 or 0.5); else (1 + m/2) * 2^(e-1)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << e).to(tl.float32) * 0.5)
    return with_sign(mag, (c >> 3) & 1)


@triton.jit
def e2m1_decode_nibble(c):
    """Low nibble of int32 c (higher bits ignored) as an E2M1 code -> fp32 value, exact. The magnitude bits
    placed at fp32 bits 22..24 read as an fp32 subnormal/normal equal to value * 2^-126 (code 1 -> 2^-127 =
    0.5 * 2^-126, code 7 -> 1.5 * 2^-124 = 6 * 2^-126), so one exact multiply by 2^126 finishes the decode:
    ~3 integer ops and a multiply instead of e2m1_decode's int->float conversions and selects."""
    bits = ((c << 22) & 0x01C00000) | ((c << 28) & -2147483648)  # sign: bit 3 -> bit 31
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


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
def e4m3_decode_fast(byte, EMULATE: tl.constexpr):
    """E4M3 byte -> fp32; the hardware conversion on GPU (sm_89+), e4m3_decode otherwise."""
    if EMULATE:
        return e4m3_decode(byte)
    else:
        return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


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
    return with_sign(mag, b >> 7)


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
def exp_flush(x, EMULATE: tl.constexpr):
    """e^x as Triton's exp computes it (fp32 x * log2(e), then the ex2.approx unit), except that results
    below 2^-126 are flushed to zero on the GPU (ex2.approx.ftz: one FMUL + one MUFU.EX2; the non-flushing
    form adds a compare and two predicated multiplies per element to scale its subnormal range). Equal to
    tl.exp wherever the result is >= 2^-126. For callers that add it to 1 (sigmoid denominators: 1 + t == 1
    for every t < 2^-24), so their bytes are unchanged (docs/design_notes.md)."""
    if EMULATE:
        return tl.exp(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def exp_accurate(x, EMULATE: tl.constexpr):
    """e^x within ~2 fp32 ulps over the whole range (libdevice's expf: range reduction with a split log2(e)),
    for fp32 outputs whose tolerance is a few fp32 ulps. exp_flush / tl.exp round x * log2(e) to fp32 first, which
    costs |x| * 2^-24 relative (about 22 ulps of the result at |x| ~ 64): invisible in a 16-bit output, not in fp32."""
    if EMULATE:
        return tl.exp(x)
    return libdevice.exp(x)


# ------------------------------------------------------------------------------ per-block scale rules
# One definition each, used by every kernel that emits these formats (the bytes are the contract in
# dispatch/reference/quant.py). Each returns what the element loop needs: the scale to store and the exact
# reciprocal to multiply by.


@triton.jit
def fp8_group_scale(amax, eps, UE8M0: tl.constexpr):
    """(scale, 1/scale) for an FP8 E4M3 group: max(amax, eps) / 448, rounded up to a power of two if UE8M0."""
    s = tl.math.div_rn(tl.maximum(amax, eps, propagate_nan=tl.PropagateNan.ALL), 448.0)
    if UE8M0:
        b = s.to(tl.uint32, bitcast=True)
        up = ((b + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        s = tl.where((b & 0x7F800000) == 0x7F800000, s, up)  # non-finite scales stay as they are
    return s, tl.math.div_rn(1.0, s)


@triton.jit
def div6_rn(amax, AMAX16: tl.constexpr):
    """fp32(amax / 6), correctly rounded. AMAX16: amax is a bf16 or fp16 value (or Inf/NaN), where one
    Markstein correction of amax * fp32(1/6) is exact: checked against the IEEE quotient for every positive
    bf16 and fp16 value, subnormals included (docs/design_notes.md); 4 fp32 ops and a select instead of
    div.rn's ~10 with a slow-path branch. Inf needs the select (the residual is Inf - Inf)."""
    if AMAX16:
        q0 = amax * 0.1666666716337204  # fp32(1/6)
        q1 = tl.fma(tl.fma(q0, -6.0, amax), 0.1666666716337204, q0)
        return tl.where(q0 == float("inf"), q0, q1)
    else:
        return tl.math.div_rn(amax, 6.0)


@triton.jit
def nvfp4_block_scale(amax, gs):
    """(E4M3 scale byte, (1/gs) / fp32(scale)) for an NVFP4 block with decode-form global scale gs (the
    reciprocal formed as torchao / MSLK form it, so bytes match theirs). Integer E4M3 emulation, fp32 amax."""
    return nvfp4_block_scale_ex(amax, gs, True, False)


@triton.jit
def nvfp4_block_scale_ex(amax, gs, EMULATE: tl.constexpr, AMAX16: tl.constexpr):
    """nvfp4_block_scale with options. EMULATE=False: hardware E4M3 conversions (sm_89+; the emulated encode +
    decode were ~1/3 of the NVFP4 quantize kernel's instructions). AMAX16: amax is a bf16/fp16 value (div6_rn)."""
    s = tl.where(gs == 0, 0.0, tl.math.div_rn(div6_rn(amax, AMAX16), gs))
    sbyte = e4m3_encode(s, EMULATE)
    s32 = e4m3_decode_fast(sbyte, EMULATE)
    return sbyte, tl.where(s32 == 0, 0.0, tl.math.div_rn(tl.math.div_rn(1.0, gs), s32))


@triton.jit
def mxfp4_block_scale(amax, RCEIL: tl.constexpr):
    """(E8M0 scale byte, 2^-exponent) for an MXFP4 block; byte 0xFF and NaN for a NaN/Inf block."""
    return mxfp4_block_scale_ex(amax, RCEIL, False)


@triton.jit
def mxfp4_block_scale_ex(amax, RCEIL: tl.constexpr, AMAX16: tl.constexpr):
    """mxfp4_block_scale; AMAX16: amax is a bf16/fp16 value (div6_rn for RCEIL)."""
    abits = amax.to(tl.uint32, bitcast=True)
    if RCEIL:  # ceil(log2(amax / 6)), exactly, from the bits of fp32(amax / 6)
        tbits = div6_rn(amax, AMAX16).to(tl.uint32, bitcast=True)
        field = ((tbits >> 23) & 0xFF).to(tl.int32)
        mant = tbits & 0x7FFFFF
        e = tl.where(field == 0, tl.where(mant > (1 << 22), -126, -127), field - 127 + (mant != 0).to(tl.int32))
    else:  # floor(log2(amax)) - 2 (OCP)
        e = ((abits >> 23) & 0xFF).to(tl.int32) - 129
    e = tl.minimum(tl.maximum(e, -127), 127)
    finite = (abits & 0x7F800000) != 0x7F800000
    inv = tl.where(finite, ((127 - e) << 23).to(tl.float32, bitcast=True), float("nan"))
    return tl.where(finite, e + 127, 255).to(tl.uint8), inv


@triton.jit
def swizzled_offset_128x4(rows, cols, cols_padded):
    """Flat byte offset of scale (row, col) in the cuBLASLt/CUTLASS 128x4 layout (int64)."""
    r = rows.to(tl.int64)
    c = cols.to(tl.int64)
    return (r // 128) * (cols_padded * 128) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


# ------------------------------------------------------------------------------ pair words (fused FP4 epilogues)


@triton.jit
def round_pairs(y_lo, y_hi, OUT_KIND: tl.constexpr, EMULATE: tl.constexpr):
    """Round an (even, odd) pair of fp32 values to the output dtype (OUT_KIND as split_pairs' IN_KIND: 0 bf16,
    1 fp16, 2 fp32) -> (word, lo, hi): word holds the rounded pair as a bf16/fp16 pair word (what an int32 load
    of the output would give; for fp32 outputs only the two sign bits, at 15 and 31, are meaningful), lo / hi
    the rounded values as fp32. On the GPU one cvt.rn.{bf16,f16}x2.f32 (F2FP ... PACK_AB) rounds both values
    at once; Triton's per-element cast became one slow-pipe F2F per element once its result was read back
    as fp32. RNE either way, the same rounding as x.to(dtype) (cast_out emulates bf16 on the interpreter)."""
    if OUT_KIND == 2:
        w = (y_lo.to(tl.uint32, bitcast=True) >> 16) | (y_hi.to(tl.uint32, bitcast=True) & 0xFFFF0000)
        return w.to(tl.int32, bitcast=True), y_lo, y_hi
    if EMULATE:
        dt = tl.bfloat16 if OUT_KIND == 0 else tl.float16
        lo16 = cast_out(y_lo, dt, True).to(tl.uint16, bitcast=True).to(tl.uint32)
        hi16 = cast_out(y_hi, dt, True).to(tl.uint16, bitcast=True).to(tl.uint32)
        w = (lo16 | (hi16 << 16)).to(tl.int32, bitcast=True)
    elif OUT_KIND == 0:
        w = tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [y_hi, y_lo], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        w = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [y_hi, y_lo], dtype=tl.int32,
                                      is_pure=True, pack=1)
    lo, hi = split_pairs(w, OUT_KIND)
    return w, lo, hi


@triton.jit
def round_pairs_to(y_lo, y_hi, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """round_pairs for an output given as a Triton dtype (bf16, fp16 or fp32)."""
    if OUT_DTYPE == tl.bfloat16:
        w, lo, hi = round_pairs(y_lo, y_hi, 0, EMULATE)
    elif OUT_DTYPE == tl.float16:
        w, lo, hi = round_pairs(y_lo, y_hi, 1, EMULATE)
    else:
        w, lo, hi = round_pairs(y_lo, y_hi, 2, EMULATE)
    return w, lo, hi


@triton.jit
def fp4_encode_pairs(w, lo, hi, inv, ok, IN_KIND: tl.constexpr, HW_FP4: tl.constexpr = False):
    """[BM, NB, HP] pair words + per-block inv -> packed E2M1 bytes (element 2i in the low nibble).
    Fast path: q = x * inv must be NaN only where the whole block is (ok == False there: inv NaN), which holds
    when inv is finite or NaN (see the kernel). Signs come from x (inv >= +0, so sign(q) == sign(x)); a bad
    block gets limit 0 and no signs, i.e. byte 0, without a per-element NaN test. ~7 instructions per
    element instead of ~20.

    HW_FP4 (Blackwell, sm_100+; the launcher's `blackwell.hw_fp4`): one cvt.rn.satfinite.e2m1x2.f32 per pair on
    q, or on +0.0 where the block is bad, the same byte by the instruction's definition: RNE on the same grid,
    |q| > 6 and +-Inf -> +-6 as min(|q|, 6), sign(q) == sign(x) (inv >= +0 in a good block, -0 included), and a
    bad block (the only place q is NaN, where the instruction would write 0x7) gives 0x00 as limit 0 and no
    signs do (tests/test_blackwell_compile.py checks this byte for byte, with a model of the instruction)."""
    if HW_FP4:
        ok3 = ok[:, :, None]
        inv3 = inv[:, :, None]
        return e2m1x2_hw(tl.where(ok3, lo * inv3, 0.0), tl.where(ok3, hi * inv3, 0.0))
    lim = tl.where(ok, 6.0, 0.0)[:, :, None]
    inv3 = inv[:, :, None]
    a_lo = tl.minimum(tl.abs(lo * inv3), lim)  # min drops NaN on the GPU and under the interpreter (fmin)
    a_hi = tl.minimum(tl.abs(hi * inv3), lim)
    if IN_KIND == 2:  # fp32 pairs in int64: gather the two sign bits into one word
        signs = ((w >> 32) & 0x80000000) | ((w >> 16) & 0x8000)
        signs = signs.to(tl.int32)
    else:
        signs = w
    signs = signs & tl.where(ok, -2147450880, 0)[:, :, None]  # 0x80008000 as int32, or 0 for a bad block
    return e2m1_pair_byte(e2m1_magnitude_word(a_lo), e2m1_magnitude_word(a_hi), signs)


@triton.jit
def fp4_encode_exact(lo, hi, inv3, HW_FP4: tl.constexpr = False):
    """Packed E2M1 bytes of (lo * inv3, hi * inv3) element by element, NaN -> 0 per element: the exact path for a
    zero, tiny or NaN NVFP4 global scale (Inf * 0 can make single elements NaN). HW_FP4: the hardware pair
    convert on q with NaN replaced by +0.0 (the instruction would write 0x7 for NaN; the reference 0x0, which
    +0.0 gives); every other input converts as e2m1_encode does (same rounding, saturation and sign)."""
    q_lo = lo * inv3
    q_hi = hi * inv3
    if HW_FP4:
        return e2m1x2_hw(tl.where(q_lo == q_lo, q_lo, 0.0), tl.where(q_hi == q_hi, q_hi, 0.0))
    return e2m1_encode(q_lo) | (e2m1_encode(q_hi) << 4)


@triton.jit
def nvfp4_gs_from_amax(amax):
    """Decode-form NVFP4 global scale computed from a tensor amax: amax / 2688, raised to 2^-118 for a nonzero
    amax below 2688 * 2^-118 (~8.1e-33), so tiny tensors keep real block scales (normal E4M3 down to amax ~2.8e-37)
    instead of quantizing to zeros; 0 (all zeros) and NaN stay. dispatch.reference.quant.nvfp4_global_scale."""
    gs = tl.math.div_rn(amax, 2688.0)
    return tl.where(amax > 0, tl.maximum(gs, NVFP4_MIN_GS), gs)


@triton.jit
def nvfp4_effective_gs(gs):
    """The global scale NVFP4 block scales are computed with: gs, or 0 where |gs| < 2^-118 (zero scales and
    +-0 codes instead of an overflowing reciprocal; contract.formats.NVFP4_MIN_GLOBAL_SCALE). NaN stays NaN.
    Every kernel that quantizes to NVFP4 applies it where it loads or folds gs."""
    return tl.where(tl.abs(gs) < NVFP4_MIN_GS, 0.0, gs)
