"""FP4-weight (MXFP4 / NVFP4, W4A16) MoE GEMM over prepacked weights: the decode kernel for Hopper.

Weights come from `moe_gemm_fp4_prepack` (layout: triton_ops/contract/fp4_prepack.py): int32 words whose codes
are placed so that one 16-byte load per thread holds its warpgroup-MMA A-fragment weights of 128 K, and one or two
shift / mask operations per pair turn a word into a packed bf16x2 (fp16x2) register. The kernel is swap-AB: the
weight rows are the MMA's M side (BLOCK_W = 64 / 128 rows per tile, dequantized in registers and fed as the
register A operand of the warpgroup MMA on sm_90), the tokens of one expert the N side (BLOCK_T = 16 / 32 / 64, from
shared memory), so a decode tile of 16 tokens wastes no MMA rows. Accumulator [BLOCK_W, BLOCK_T] fp32, stored
transposed.

GEMM1 + SwiGLU (moe_gemm_swiglu_fp4_prepacked) in one K loop: a tile's BLOCK_W weight rows are the gate and up rows
of BLOCK_W / 2 output columns, in each 16-row group the gate rows of 8 columns then their up rows (_swiglu_rows). In
the sm_90 warpgroup-MMA accumulator a thread holds rows i and i + 8 of each 16-row group, so every thread holds both
values of its pairs and the split after the K loop is register relabelling (no layout conversion of the fp32
accumulator in the TTGIR, no added shared-memory traffic in the SASS); the tile and its K loop are the plain GEMM's
(same rule, same config), the epilogue the chain's math on the two halves.

E2M1 -> bf16 on packed words: a code's sign lands on bf16's sign bit and its 3 magnitude bits on bf16's two lowest
exponent bits and top mantissa bit, which is the code's value times 2^-126 (code 1 = 0.5 becomes the subnormal 2^-127,
exact). MXFP4: one packed multiply by 2^126 (exact: subnormal inputs are kept) and one by the block scale 2^(s - 127)
give the operand (folded into one multiply by 2^(s - 1) only where s <= 128: MoeGemmConfig.fold_scale; "tile": each
program checks its rows' scale bytes once and runs the folded K loop or the two-multiply one; "loop": the folded loop
with the factor +inf from s = 129 on, so a tile with such a byte has a sum that is not finite and is redone with two
multiplies, as is a tile whose tokens hold inf / NaN; the same bytes either way). NVFP4: one
multiply by the scale word e4m3 * 2^119 (the bias folded in, less 2^7, which the fp32 sums get back after the K loop);
exact (e2m1 has <= 2 significant bits, E4M3 <= 4). The multiplies are `fma.rn.bf16x2` with a -0 addend (an exact
multiply, sm_80+; `mul.bf16x2` needs sm_90). fp16 (NVFP4 with fp16 activations): the magnitude 3 bits higher (the
value times 2^-14), scale word e4m3 * 2^7, `fma.rn.f16x2`. Under the interpreter (no inline PTX, broken bf16 dot) the
same bf16 bit patterns are widened to fp32 and multiplied there, so the layout and the bit trick are what the CPU
tests check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out, e4m3_decode_fast
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch
from triton_ops.contract.fp4_prepack import CHUNK, FOLD_MAX_SCALE, check_fp4_prepacked
from triton_ops.contract.moe_gemm import check_combine_args, check_row_weights, check_swiglu_args, contiguous_ids
from triton_ops.moe.align import moe_combine
from triton_ops.swiglu import silu_div_rn, swiglu_act

from .config import FOLD_MODES, MoeGemmConfig, pick_prepacked_config, rows_per_expert
from .dequant import e8m0_to_f32, mma
from .fused import _gate_up_rows
from .grouped import _destination, _grid_refusal

_BIAS_F32 = tl.constexpr(8.507059173023462e37)  # 2^126 (the bf16 bit trick's bias), fp32
_FOLD_MAX_SCALE = tl.constexpr(FOLD_MAX_SCALE)
_FOLD_MX = {mode: i for i, mode in enumerate(FOLD_MODES)}  # MoeGemmConfig.fold_scale -> the kernel's FOLD_MX (0 off)
# fold "loop": scale byte s -> the bf16 pair of 2^(min(s, FOLD_MAX_SCALE + 1) - 1), +inf past FOLD_MAX_SCALE
# ((s + 126) * 0x800080 puts s + 126 in both halves' exponent fields)
_FOLD_LOOP_ASM = tl.constexpr(f"{{ .reg .u32 t; min.u32 t, $1, {FOLD_MAX_SCALE + 1}; "
                              f"mad.lo.u32 $0, t, 0x800080, 0x{126 * 0x800080:08X}; }}")


# 0x81C081C0 as int32: per 16-bit half, bf16's sign bit and the code's 3 magnitude bits (exponent 8 7, mantissa 6)
_M = tl.constexpr(-2118090304)
_SIGN = tl.constexpr(-2147450880)  # 0x80008000


@triton.jit
def _pair_bits(w, P: tl.constexpr, FP16: tl.constexpr):
    """Slot P (= 2 s + h) of both 16-bit halves of the words -> the two values' bf16 (fp16) bits, each value times
    2^-126 (2^-14); the slot positions are fp4_prepack.SIGN_BIT / MAG_BITS."""
    if P == 0:
        bits = w & _M
    elif P == 1:
        bits = (w << 3) & _M
    elif P == 2:
        bits = (w << 6) & _M
    else:
        bits = ((w << 1) & _SIGN) | ((w >> 3) & 0x01800180) | ((w >> 7) & 0x00400040)
    if FP16:  # the magnitude 3 bits up: fp16's exponent bits 11 10, mantissa bit 9
        bits = (bits & _SIGN) | ((bits & 0x01C001C0) << 3)
    return bits


@triton.jit
def _pair(words, P: tl.constexpr, sc, F32_DOT: tl.constexpr, FP16: tl.constexpr, FOLDED: tl.constexpr):
    """The pair p = 2 s + h of every word: [..., 2] (b = 0, 1) operand values. sc: fp32 scale values (interpreter)
    or int32 words holding the scale's bf16 (fp16) bits in both halves (GPU). FOLDED (NVFP4): sc already holds
    the bit trick's bias (one multiply: e2m1 * e4m3 * 2^-7); else two multiplies, by the bias then by sc."""
    sc = tl.broadcast_to(sc, words.shape)
    if F32_DOT:  # the bf16 bit patterns, widened to fp32 (exact), the same multiplies
        bits = _pair_bits(words, P, False)
        lo = (bits << 16).to(tl.float32, bitcast=True)
        hi = (bits & -65536).to(tl.float32, bitcast=True)
        if not FOLDED:
            lo = lo * _BIAS_F32
            hi = hi * _BIAS_F32
        return tl.join(lo * sc, hi * sc)
    else:
        bits = _pair_bits(words, P, FP16)
        if FP16:  # NVFP4 only: always folded
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, z; mov.b32 z, 0x80008000; fma.rn.f16x2 t, $2, $3, z; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [bits, sc], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
        elif FOLDED:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, z; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $2, $3, z; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [bits, sc], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        else:
            lo, hi = tl.inline_asm_elementwise(
                "{ .reg .b32 t, c, z; mov.b32 c, 0x7E807E80; mov.b32 z, 0x80008000; fma.rn.bf16x2 t, $2, c, z; "
                "fma.rn.bf16x2 t, t, $3, z; mov.b32 {$0, $1}, t; }",
                "=h,=h,r,r", [bits, sc], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
        return tl.join(lo, hi)


@triton.jit
def dequant_prepacked(words, sc0, sc1, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                      FP16: tl.constexpr, FOLDED: tl.constexpr):
    """words [BLOCK_W, U, 4 (c), 4 (t)] int32 (U = BLOCK_K / 128 chunks), sc0 / sc1 [BLOCK_W, U, 1, 4] the scales of
    the elements with s = 0 / 1 -> the [BLOCK_W, BLOCK_K] operand in K order (k = 128 u + 32 t + 16 s + 8 h + 2 c +
    b): four pairs (p = 2 s + h), joined and permuted (register relabelling only: a thread keeps its words)."""
    v = tl.join(tl.join(_pair(words, 0, sc0, F32_DOT, FP16, FOLDED), _pair(words, 1, sc0, F32_DOT, FP16, FOLDED)),
                tl.join(_pair(words, 2, sc1, F32_DOT, FP16, FOLDED), _pair(words, 3, sc1, F32_DOT, FP16, FOLDED)))
    v = tl.permute(v, (0, 1, 3, 6, 5, 2, 4))  # (W, u, c, t, b, h, s) -> (W, u, t, s, h, c, b)
    return tl.reshape(v, [BLOCK_W, BLOCK_K])


@triton.jit
def _scale_words(sb, NVFP4: tl.constexpr, DTYPE: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
                 FOLD_MX: tl.constexpr):
    """Scale bytes -> fp32 values (interpreter) or int32 words with the DTYPE bits of the value in both halves.
    NVFP4: e4m3 * 2^119 (bf16 bit trick, interpreter) / 2^7 (fp16): the bit trick's bias 2^126 / 2^14 folded in,
    less 2^7 (the largest E4M3, 448, times 2^119 is bf16's largest power-of-two binade), which the fp32 sums get
    back after the K loop. Exact: every E4M3 times 2^119 (2^7) is a normal bf16 (fp16).
    MXFP4: 2^(s - 127) itself (2^126 * 2^(s - 127) leaves bf16's range for s >= 129); FOLD_MX (every scale byte
    <= 128, checked per tile by _tile_foldable): 2^(s - 1), the bias folded in (a normal bf16 for s in 0 .. 128)."""
    if NVFP4:
        f = e4m3_decode_fast(sb, EMULATE)
        if F32_DOT or DTYPE == tl.bfloat16:
            f = f * 6.646139978924579e35  # 2^119
        else:
            f = f * 128.0
        if F32_DOT:
            return f
        h = f.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        if F32_DOT:
            if FOLD_MX:
                return e8m0_to_f32(sb) * _BIAS_F32
            return e8m0_to_f32(sb)
        b = sb.to(tl.int32)
        if FOLD_MX == 2:  # 2^(s - 1) up to s = 128; +inf from s = 129 on (the loop's result is then not finite)
            # (inline: Triton vectorizes a plain minimum into 16-bit pairs, twice the instructions)
            return tl.inline_asm_elementwise(_FOLD_LOOP_ASM, "=r,r", [b], dtype=tl.int32, is_pure=True, pack=1)
        if FOLD_MX:
            return ((b + 126) << 7) * 0x10001
        # bf16 2^(b - 127) in both halves; b = 0: the subnormal 2^-127 (0x0040, above 0 and below every b << 7)
        h = tl.maximum(b * 0x800080, 0x400040)
        return tl.where(b == 255, 0x7FC07FC0, h)  # NaN
    return h | (h << 16)


@triton.jit
def _weight_tile(v_rows, s_rows, k0, KW, KS, MASK_K: tl.constexpr, NVFP4: tl.constexpr, DTYPE: tl.constexpr,
                 F32_DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALES_AS_WORDS: tl.constexpr, FOLD: tl.constexpr):
    """The [BLOCK_W, BLOCK_K] operand of the tile's weight rows at K offset k0 (MASK_K: words and scales past the
    row read as zero codes with scale byte 0). FOLD (MXFP4): one multiply per pair (every scale byte <= 128)."""
    SB: tl.constexpr = 16 if NVFP4 else 32
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    if SCALES_AS_WORDS:
        # one scale byte per word (c, t) of the chunk, the scales of the words' 4 t (and 2 s) contiguous: the load
        # has the words' shape and (for the GPU's blocked layout) their thread mapping, so the scale words need no
        # layout conversion (through shared memory) on the way to the operand
        SPW: tl.constexpr = 2 if NVFP4 else 1  # scale bytes per word (s = 0, 1)
        j = tl.arange(0, BLOCK_K // 8 * SPW)
        ks = k0 // SB + (j // (16 * SPW)) * (128 // SB) + j % (4 * SPW)  # chunk u, then t (and s)
    else:
        ks = k0 // SB + tl.arange(0, BLOCK_K // SB)
    if MASK_K:
        words = tl.load(v_rows[:, None] + kw[None, :], mask=(kw < KW)[None, :], other=0)
        sb = tl.load(s_rows[:, None] + ks[None, :], mask=(ks < KS)[None, :], other=0)
    else:
        words = tl.load(v_rows[:, None] + kw[None, :])
        sb = tl.load(s_rows[:, None] + ks[None, :])
    return _operand(words, sb, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W, BLOCK_K, SCALES_AS_WORDS, FOLD)


@triton.jit
def _operand(words, sb, NVFP4: tl.constexpr, DTYPE: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
             BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, SCALES_AS_WORDS: tl.constexpr, FOLD: tl.constexpr):
    """The loaded words and scale bytes of a step -> the [BLOCK_W, BLOCK_K] operand."""
    U: tl.constexpr = BLOCK_K // 128
    sc = _scale_words(sb, NVFP4, DTYPE, F32_DOT, EMULATE, FOLD)
    if SCALES_AS_WORDS:
        if NVFP4:  # [W, u, c, t, s]
            sc0, sc1 = tl.split(tl.reshape(sc, [BLOCK_W, U, 4, 4, 2]))
        else:
            sc0 = tl.reshape(sc, [BLOCK_W, U, 4, 4])
            sc1 = sc0
    elif NVFP4:  # scale index 8 u + 2 t + s
        sc0, sc1 = tl.split(tl.reshape(sc, [BLOCK_W, U, 4, 2]))
        sc0 = tl.reshape(sc0, [BLOCK_W, U, 1, 4])
        sc1 = tl.reshape(sc1, [BLOCK_W, U, 1, 4])
    else:  # scale index 4 u + t
        sc0 = tl.reshape(sc, [BLOCK_W, U, 1, 4])
        sc1 = sc0
    return dequant_prepacked(tl.reshape(words, [BLOCK_W, U, 4, 4]), sc0, sc1, BLOCK_W, BLOCK_K, F32_DOT,
                             DTYPE == tl.float16, NVFP4 or FOLD)


@triton.jit
def _step(acc, a_ptr, a_off, sel, v_rows, s_rows, k0, K, KW, KS, NVFP4: tl.constexpr, DTYPE: tl.constexpr,
          F32_DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
          SCALES_AS_WORDS: tl.constexpr, FOLD: tl.constexpr, A_DESC: tl.constexpr):
    """One K step: acc += the weight tile at k0 times the tokens' [BLOCK_T, BLOCK_K] (K past the row read as
    zero). A_DESC: a_ptr is a tensor descriptor of the tokens' 2-D rows and a_off the tile's first row (a TMA load:
    K past the row and rows past the tensor read as zero, the tile's rows outside `sel` as they are, their products
    never stored)."""
    wt = _weight_tile(v_rows, s_rows, k0, KW, KS, BLOCK_K != 128, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W,
                      BLOCK_K, SCALES_AS_WORDS, FOLD)
    kk = k0 + tl.arange(0, BLOCK_K)
    if A_DESC:
        a = a_ptr.load([a_off, k0])
    else:
        a = tl.load(a_ptr + a_off[:, None] + kk[None, :], mask=sel[:, None] & (kk < K)[None, :], other=0)
    return mma(wt, tl.trans(a), acc, F32_DOT)


@triton.jit
def _k_loop(acc, a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS, NVFP4: tl.constexpr, DTYPE: tl.constexpr,
            F32_DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
            SCALES_AS_WORDS: tl.constexpr, FOLD: tl.constexpr, STAGES: tl.constexpr, A_DESC: tl.constexpr):
    """acc + the products over K. STAGES: the pipeline depth of this loop (0: the launch's num_stages)."""
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES if STAGES else None):
        acc = _step(acc, a_ptr, a_off, sel, v_rows, s_rows, k0, K, KW, KS, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W,
                    BLOCK_K, SCALES_AS_WORDS, FOLD, A_DESC)
    return acc


@triton.jit
def _tile_foldable(s_rows, KS, BLOCK_W: tl.constexpr):
    """Whether every MXFP4 scale byte of the tile's rows is <= FOLD_MAX_SCALE (128): one pass over the
    rows' KS scale bytes (KS / 128 loads of [BLOCK_W, 128] bytes, from L2 after the first tile of a row block)."""
    m = tl.zeros([BLOCK_W, 128], tl.uint8)
    for j in range(0, KS, 128):
        jj = j + tl.arange(0, 128)
        m = tl.maximum(m, tl.load(s_rows[:, None] + jj[None, :], mask=(jj < KS)[None, :], other=0))
    return tl.max(tl.max(m.to(tl.int32), 1), 0) <= _FOLD_MAX_SCALE


@triton.jit
def _sums_finite(acc, sel):
    """Whether every sum of the tokens in `sel` is finite (NaN counts as not). Reduced over the weight rows first:
    the other order makes ptxas compute the K loop's shared-memory descriptors in vector registers."""
    worst = tl.max(tl.where(acc == acc, tl.abs(acc), float("inf")), 0)
    return tl.max(tl.where(sel, worst, 0.0), 0) < float("inf")


@triton.jit
def _prepacked_pass(a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS,
                    NVFP4: tl.constexpr, DTYPE: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr,
                    BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                    SCALES_AS_WORDS: tl.constexpr, FOLD_MX: tl.constexpr, A_DESC: tl.constexpr):
    """fp32 [BLOCK_W, BLOCK_T] = w[rows] @ a[tokens].T over K for the tokens in `sel` (others read as zero).
    v_rows / s_rows: pointers to the tile's weight rows in the prepacked values / scales, all in range (the caller
    clamps rows past N; their results are not stored), so the weight loads need no row mask, and no K mask when a
    step is one 128-K chunk (K <= KP: the chunk is in the row). Longer steps mask the words and scales past the row
    (a zero code with a NaN scale byte of the next row would make NaN)."""
    acc = tl.zeros([BLOCK_W, BLOCK_T], tl.float32)
    if FOLD_MX == 2:  # the folded loop, its factors +inf past scale byte 128; a tile whose sums are not all finite is
        # redone with two multiplies (exact: the sums are those of the unfolded loop; never for real weights, whose
        # scales sit far below 2^1, unless the tokens themselves hold inf / NaN)
        acc = _k_loop(acc, a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W,
                      BLOCK_K, SCALES_AS_WORDS, 2, 0, A_DESC)
        if not _sums_finite(acc, sel):
            acc = _k_loop(tl.zeros([BLOCK_W, BLOCK_T], tl.float32), a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS,
                          NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W, BLOCK_K, SCALES_AS_WORDS, False, 1, A_DESC)
    elif FOLD_MX:  # per tile: the folded loop where every scale byte of the tile's rows allows it, else the unfolded
        # one at 2 stages (Triton gives each loop its own pipeline buffers: both within an SM's shared memory)
        if _tile_foldable(s_rows, KS, BLOCK_W):
            acc = _k_loop(acc, a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W,
                          BLOCK_K, SCALES_AS_WORDS, True, 0, A_DESC)
        else:
            acc = _k_loop(acc, a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W,
                          BLOCK_K, SCALES_AS_WORDS, False, 2, A_DESC)
    else:
        acc = _k_loop(acc, a_ptr, a_off, sel, v_rows, s_rows, K, KW, KS, NVFP4, DTYPE, F32_DOT, EMULATE, BLOCK_W,
                      BLOCK_K, SCALES_AS_WORDS, False, 0, A_DESC)
    if NVFP4:
        acc = acc * 128.0  # the 2^-7 the folded scales leave on every operand (exact)
    return acc


@triton.jit
def _rows_pass(a_ptr, a_off, sel, v_ptr, s_ptr, g_ptr, e64, w_rows, NR, K, KW, KS, NVFP4: tl.constexpr,
               DTYPE: tl.constexpr, F32_DOT: tl.constexpr, EMULATE: tl.constexpr, BLOCK_W: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, SCALES_AS_WORDS: tl.constexpr, FOLD_MX: tl.constexpr,
               A_DESC: tl.constexpr):
    """Expert e64's fp32 [BLOCK_W, BLOCK_T] products of weight rows w_rows (of its NR) with the tokens in `sel`,
    times (NVFP4) its global scale. Rows past NR read row NR - 1 (the caller never stores them)."""
    w_in = e64 * NR + tl.minimum(w_rows, NR - 1)
    acc = _prepacked_pass(a_ptr, a_off, sel, v_ptr + w_in * KW, s_ptr + w_in * KS, K, KW, KS, NVFP4, DTYPE, F32_DOT,
                          EMULATE, BLOCK_W, BLOCK_T, BLOCK_K, SCALES_AS_WORDS, FOLD_MX, A_DESC)
    if NVFP4:
        acc = acc * tl.load(g_ptr + e64)
    return acc


@triton.jit
def _swiglu_rows(col0, N, INTERLEAVE: tl.constexpr, BLOCK_W: tl.constexpr):
    """The weight rows of a one-pass GEMM1 + SwiGLU tile (its BLOCK_W // 2 output columns from col0, N = I): in each
    16-row group of the tile, rows 0-7 the gate rows and rows 8-15 the up rows of the same 8 columns. Rows i and
    i + 8 of a 16-row group are one thread's in the sm_90 warpgroup-MMA accumulator, so each thread holds both
    members of its pairs (_gate_up_split). Columns past N read column N - 1 (never stored)."""
    r = tl.arange(0, BLOCK_W)
    c = tl.minimum(col0 + (r // 16) * 8 + r % 8, N - 1).to(tl.int64)
    gate, up = _gate_up_rows(c, N, INTERLEAVE)
    return tl.where((r // 8) % 2 == 1, up, gate)


@triton.jit
def _gate_up_split(acc, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr):
    """The [BLOCK_W, BLOCK_T] accumulator of _swiglu_rows' rows -> (gate, up), each [BLOCK_W // 2, BLOCK_T] in
    output-column order: row 16 j + i is column 8 j + i's gate, row 16 j + 8 + i its up."""
    v = tl.permute(tl.reshape(acc, [BLOCK_W // 16, 2, 8, BLOCK_T]), (0, 2, 3, 1))
    g, u = tl.split(v)
    return tl.reshape(g, [BLOCK_W // 2, BLOCK_T]), tl.reshape(u, [BLOCK_W // 2, BLOCK_T])


@triton.jit
def _expert_tile(a_ptr, a_off, sel, v_ptr, s_ptr, g_ptr, rw_rows, out_t, e64, w_rows, cmask, N, K, KW, KS, alpha,
                 limit, NVFP4: tl.constexpr, HAS_RW: tl.constexpr, DTYPE: tl.constexpr, F32_DOT: tl.constexpr,
                 EMULATE: tl.constexpr, SWIGLU: tl.constexpr, GPTOSS: tl.constexpr, CLAMP: tl.constexpr,
                 DIV_RN: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALES_AS_WORDS: tl.constexpr, FOLD_MX: tl.constexpr, A_DESC: tl.constexpr):
    """Expert e64's tile for the tokens in `sel`, stored to their columns of out_t (one rounding). Plain: the
    output columns are the weight rows w_rows, times the row weights (rw_rows: pointers to the tokens' weights).
    SWIGLU (N = I, weights (E, 2I, K)): w_rows are _swiglu_rows' gate / up rows of BLOCK_W // 2 output columns, one
    K loop for both; gate and up each rounded to the GEMM's dtype as the plain kernel stores them, then the SwiGLU
    op's math (triton_ops/swiglu.py:swiglu_act)."""
    acc = _rows_pass(a_ptr, a_off, sel, v_ptr, s_ptr, g_ptr, e64, w_rows, 2 * N if SWIGLU else N, K, KW, KS, NVFP4,
                     DTYPE, F32_DOT, EMULATE, BLOCK_W, BLOCK_T, BLOCK_K, SCALES_AS_WORDS, FOLD_MX, A_DESC)
    if SWIGLU:
        g, u = _gate_up_split(acc, BLOCK_W, BLOCK_T)
        g = cast_out(g, DTYPE, EMULATE).to(tl.float32)
        u = cast_out(u, DTYPE, EMULATE).to(tl.float32)
        acc = swiglu_act(g, u, alpha, limit, GPTOSS, CLAMP, DIV_RN, DTYPE, EMULATE)
    elif HAS_RW:
        acc *= tl.load(rw_rows, mask=sel, other=0.0)[None, :]
    tl.store(out_t, cast_out(acc, out_t.dtype.element_ty, EMULATE), mask=cmask[:, None] & sel[None, :])


@triton.jit
def _kept(rows_mask, dst_ok, SCATTER: tl.constexpr):
    """The rows of rows_mask that are stored: all, or (SCATTER) those with a destination."""
    if SCATTER:
        return rows_mask & dst_ok
    else:
        return rows_mask


@triton.jit
def _fp4_prepacked_kernel(a_ptr, v_ptr, s_ptr, g_ptr, ids_ptr, rw_ptr, out_ptr, dst_ptr, M, N, K, E, KW, KS,
                          stride_ae, stride_am, alpha, limit, n_dst,
                          NVFP4: tl.constexpr, MASKED: tl.constexpr, HAS_RW: tl.constexpr, DTYPE: tl.constexpr,
                          F32_DOT: tl.constexpr, EMULATE: tl.constexpr, SWIGLU: tl.constexpr,
                          INTERLEAVE: tl.constexpr, GPTOSS: tl.constexpr, CLAMP: tl.constexpr, DIV_RN: tl.constexpr,
                          SCATTER: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_K: tl.constexpr, SCALES_AS_WORDS: tl.constexpr, FOLD_MX: tl.constexpr,
                          A_DESC: tl.constexpr, SLOTS: tl.constexpr):
    """Program (axis 0) = one [BLOCK_T tokens, BLOCK_C output columns] tile (BLOCK_W weight rows: the columns, or
    with SWIGLU the gate and up rows of BLOCK_W // 2 columns of the I outputs, _swiglu_rows), the column tiles of one
    token tile adjacent (activations reused from L2); masked layout: axis 1 = expert; contiguous layout: axis 1 = the
    SLOTS expert slots (slot s runs the s-th expert present in the tile, the last slot every expert from there on).
    Every output element in range is written once: computed rows by their expert's pass, the others as zeros by slot
    0 (SwiGLU of gate = up = 0 is 0 for both activations). SCATTER: layout row r goes to output row dst[r] of an
    (n_dst, N) output (grouped._destination; rows outside [0, n_dst) unwritten)."""
    BLOCK_C: tl.constexpr = BLOCK_W // 2 if SWIGLU else BLOCK_W
    pid = tl.program_id(0)
    num_c = tl.cdiv(N, BLOCK_C)
    pid_t = pid // num_c
    col0 = (pid % num_c) * BLOCK_C
    offs_c = col0 + tl.arange(0, BLOCK_C)
    cmask = offs_c < N
    c64 = offs_c.to(tl.int64)
    if SWIGLU:
        w_rows = _swiglu_rows(col0, N, INTERLEAVE, BLOCK_W)
    else:
        w_rows = c64
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    if MASKED:
        e = tl.program_id(1)
        e64 = e.to(tl.int64)
        cnt = tl.minimum(tl.maximum(tl.load(ids_ptr + e), 0), M)
        flat = e64 * M + rows64
        dst, dst_ok = _destination(flat, rmask, dst_ptr, n_dst, SCATTER)
        out_t = out_ptr + dst[None, :] * N + c64[:, None]
        done = rows < cnt
        if pid_t * BLOCK_T < cnt:
            if A_DESC:  # a 2-D view of the (E, M, K) tokens: row e * M + r
                a_off = e * M + pid_t * BLOCK_T
            else:
                a_off = e64 * stride_ae + rows64 * stride_am
            _expert_tile(a_ptr, a_off, _kept(done, dst_ok, SCATTER), v_ptr, s_ptr,
                         g_ptr, rw_ptr + flat, out_t, e64, w_rows, cmask, N, K, KW, KS, alpha, limit, NVFP4, HAS_RW,
                         DTYPE, F32_DOT, EMULATE, SWIGLU, GPTOSS, CLAMP, DIV_RN, BLOCK_W, BLOCK_T, BLOCK_K,
                         SCALES_AS_WORDS, FOLD_MX, A_DESC)
    else:
        dst, dst_ok = _destination(rows64, rmask, dst_ptr, n_dst, SCATTER)
        out_t = out_ptr + dst[None, :] * N + c64[:, None]
        mi = tl.load(ids_ptr + rows, mask=rmask, other=-1)
        done = (mi >= 0) & (mi < E)
        mi = tl.where(done, mi, E)
        e = tl.min(mi, 0)
        slot = tl.program_id(1)
        if SLOTS > 1:  # this slot's first expert: the slot-th present (E: none)
            for _ in range(slot):
                e = tl.min(tl.where(mi > e, mi, E), 0)
        if A_DESC:
            a_off = pid_t * BLOCK_T
        else:
            a_off = rows64 * stride_am
        while e < E:  # one pass per expert of this slot, in increasing id order
            sel = _kept(mi == e, dst_ok, SCATTER)
            _expert_tile(a_ptr, a_off, sel, v_ptr, s_ptr, g_ptr, rw_ptr + rows64, out_t,
                         e.to(tl.int64), w_rows, cmask, N, K, KW, KS, alpha, limit, NVFP4, HAS_RW, DTYPE, F32_DOT,
                         EMULATE, SWIGLU, GPTOSS, CLAMP, DIV_RN, BLOCK_W, BLOCK_T, BLOCK_K, SCALES_AS_WORDS,
                         FOLD_MX, A_DESC)
            if SLOTS > 1:
                e = tl.where(slot == SLOTS - 1, tl.min(tl.where(mi > e, mi, E), 0), E)
            else:
                e = tl.min(tl.where(mi > e, mi, E), 0)
        if SLOTS > 1:
            done = done | (tl.full([BLOCK_T], 0, tl.int32) != slot)  # the zeros below are slot 0's
    zero = tl.zeros([BLOCK_C, BLOCK_T], out_ptr.dtype.element_ty)
    tl.store(out_t, zero, mask=cmask[:, None] & _kept(rmask & ~done, dst_ok, SCATTER)[None, :])


# ---------------------------------------------------------------------------------------------- launcher


def _launch(fmt, a, values, scales, w_global, m_indices, masked_m, row_weights, config, swiglu=None, dst_rows=None,
            n_dst=0):
    """swiglu: None (the plain GEMM, N = the weight rows) or (interleave, activation, alpha, limit): GEMM1 + SwiGLU
    over (E, 2I, K) weights, N = I output columns. dst_rows (int32, a.shape[:-1]): scatter layout row r to output row
    dst_rows[r] of an (n_dst, N) output (rows outside [0, n_dst) unwritten)."""
    masked = masked_m is not None
    e = values.shape[0]
    n = values.shape[1] // 2 if swiglu else values.shape[1]  # output columns
    k = a.shape[-1]
    rows = a.shape[1] if masked else a.shape[0]
    out = torch.empty(*(a.shape[:-1] if dst_rows is None else (n_dst,)), n, dtype=a.dtype, device=a.device)
    if out.numel() == 0 or a.shape[:-1].numel() == 0:
        return out  # scatter with no layout row: nothing is written (the combine reads no slot)
    # GEMM1 + SwiGLU: the plain GEMM's tile over the 2I weight rows (one pass; block_n // 2 output columns)
    cfg = config or config_for_call(a, values, masked_m, fmt, bool(swiglu))
    reason = prepacked_refusal(cfg)
    if not reason and cfg.fold_scale != "off" and fmt != "mxfp4":
        reason = "fold_scale is for MXFP4 weights (NVFP4's scale words always hold the bias)"
    if not reason and masked and cfg.expert_slots != 1:
        reason = "expert_slots > 1 is for the contiguous layout (a masked tile holds one expert)"
    if reason:
        raise ValueError(f"moe_gemm_fp4_prepacked: config {cfg}: {reason}")
    interleave, activation, alpha, limit = swiglu or (0, "silu", 0.0, None)
    grid = (cdiv(rows, cfg.block_m) * cdiv(n, cfg.block_n // 2 if swiglu else cfg.block_n),
            e if masked else cfg.expert_slots)
    dummy = scales
    a_src = _tokens_descriptor(a, cfg) if cfg.a_tma else None
    launch(_fp4_prepacked_kernel, grid,
           a if a_src is None else a_src, values, scales, dummy if w_global is None else w_global.contiguous(),
           masked_m if masked else m_indices, dummy if row_weights is None else row_weights.contiguous(), out,
           dummy if dst_rows is None else dst_rows.contiguous(), rows, n, k, e, values.shape[2], scales.shape[2],
           a.stride(0) if masked else 0, a.stride(1) if masked else a.stride(0),
           float(alpha), float(0.0 if limit is None else limit), n_dst,
           NVFP4=fmt == "nvfp4", MASKED=masked, HAS_RW=row_weights is not None, DTYPE=TL_DTYPE[a.dtype],
           F32_DOT=a.device.type != "cuda", EMULATE=emulate_formats(a.device), SWIGLU=bool(swiglu),
           INTERLEAVE=interleave, GPTOSS=activation == "gptoss", CLAMP=limit is not None,
           DIV_RN=silu_div_rn(a.dtype), SCATTER=dst_rows is not None, BLOCK_W=cfg.block_n, BLOCK_T=cfg.block_m,
           BLOCK_K=cfg.block_k, SCALES_AS_WORDS=cfg.scale_words, FOLD_MX=_FOLD_MX[cfg.fold_scale],
           A_DESC=a_src is not None,
           SLOTS=cfg.expert_slots, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
           **({"maxnreg": cfg.max_registers} if cfg.max_registers and a.device.type == "cuda" else {}))
    return out


def config_for_call(a, values, masked_m, fmt: str, swiglu: bool = False) -> MoeGemmConfig:
    """The rule's config for these operands (pick_prepacked_config at their rows per expert, weight rows and K)."""
    masked = masked_m is not None
    rows = a.shape[1] if masked else a.shape[0]
    return pick_prepacked_config(rows_per_expert(rows, values.shape[0], masked), values.shape[1], a.shape[-1],
                                 a.device, fmt, swiglu, masked)


def _tokens_descriptor(a: torch.Tensor, cfg: MoeGemmConfig):
    """A TMA descriptor of the tokens as 2-D rows ([block_m, block_k] boxes), or None where the layout does not allow
    one (the kernel then loads with pointers): unit K stride, 16-byte aligned base and row stride, and the masked
    layout's experts back to back (a 2-D view of (E, M, K))."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if a.stride(-1) != 1 or (a.stride(-2) * a.element_size()) % 16 or a.data_ptr() % 16:
        return None
    if a.dim() == 3 and a.stride(0) != a.shape[1] * a.stride(1):
        return None
    rows = a.view(-1, a.shape[-1]) if a.dim() == 3 else a
    return TensorDescriptor(rows, list(rows.shape), [rows.stride(0), 1], [cfg.block_m, cfg.block_k])


def prepacked_refusal(cfg: MoeGemmConfig) -> str | None:
    """Why `cfg` cannot run the prepacked kernel (block_m: tokens per tile, block_n: weight rows per tile)."""
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            return f"{name}={v} is not a power of two >= 16 (tl.dot)"
    if cfg.block_k % CHUNK:
        return f"block_k={cfg.block_k} is not a multiple of the layout's {CHUNK}-element chunk"
    if cfg.expert_slots < 1:
        return f"expert_slots={cfg.expert_slots} < 1"
    if cfg.fold_scale not in FOLD_MODES:
        return f"fold_scale={cfg.fold_scale!r} is none of {FOLD_MODES}"
    if cfg.max_registers < 0:
        return f"max_registers={cfg.max_registers} < 0"
    return None


# ---------------------------------------------------------------------------------------------- supports / entry


def supports_moe_gemm_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, *rest) -> str | None:
    return _grid_refusal(w_values, masked_m)


def moe_gemm_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, row_weights=None, *,
                           config: MoeGemmConfig | None = None):
    """a x prepacked FP4 weights (moe_gemm_fp4_prepack's output) -> a's dtype; the math of moe_gemm_mxfp4 /
    moe_gemm_nvfp4 on the unpacked weights. config: block_m = tokens per tile, block_n = weight rows per tile."""
    check_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m)
    check_row_weights("moe_gemm_fp4_prepacked", a, row_weights)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch(fmt, a, w_values, w_scales, w_global, m_indices, masked_m, row_weights, config)


def moe_gemm_swiglu_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, interleave, activation,
                                  alpha, limit, *, config: MoeGemmConfig | None = None):
    """GEMM1 + SwiGLU on prepacked FP4 weights (E, 2I, ...): (rows, I) in a's dtype; the bytes of
    moe_gemm_fp4_prepacked -> swiglu given the same accumulators (the plain GEMM's tile rule over the 2I rows: a tile
    of block_n weight rows holds the gate and up rows of block_n // 2 output columns, one K loop)."""
    op = "moe_gemm_swiglu_fp4_prepacked"
    check_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, op=op)
    check_swiglu_args(op, w_values.shape[1], interleave, activation, alpha, limit, w_name="w_values")
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch(fmt, a, w_values, w_scales, w_global, m_indices, masked_m, None, config,
                   swiglu=(interleave, activation, alpha, limit))


def moe_gemm_combine_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, src_rows, inv_rows,
                                   topk_weights, shared, out_dtype, *, config: MoeGemmConfig | None = None):
    """GEMM2 on prepacked FP4 weights scattered into token order (row r to entry src_rows[r] of a (T * k, N) buffer,
    rounded to a's dtype as moe_gemm_fp4_prepacked stores it), then the slot-order combine (moe_combine,
    token_order): the bytes of moe_gemm_fp4_prepacked -> moe_combine. Slots without a row are never read."""
    op = "moe_gemm_combine_fp4_prepacked"
    check_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m, op=op)
    check_combine_args(op, a, w_values.shape[1], src_rows, inv_rows, topk_weights, shared, out_dtype)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    t, k = inv_rows.shape
    buf = _launch(fmt, a, w_values, w_scales, w_global, m_indices, masked_m, None, config, dst_rows=src_rows,
                  n_dst=t * k)
    return moe_combine(buf, inv_rows, topk_weights, shared, out_dtype, token_order=True)
