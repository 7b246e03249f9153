"""Argument checks of the moe_gemm ops (shared by every backend: the op runs them before choosing one).

Errors name the op and the argument (contract.checks.fail). Layouts: docs/moe.md; weights (E, N, K) K-major.
"""

from __future__ import annotations

import math

import torch

from .checks import check_dtype, check_same_device, check_tensor, fail
from .formats import MX_ROUNDINGS, MXFP4_BLOCK, NVFP4_BLOCK, cdiv

FP8_BLOCK = 128  # DeepGEMM block scales: 1x128 activations, 128x128 weights


def _shape(t) -> tuple:
    return tuple(t.shape)


def _check_layout(op, a, w, m_indices, masked_m):
    """Common checks: tensors, devices, the layout pair, a's rank, K-contiguous operands. Returns E."""
    check_tensor(op, "a", a)
    check_tensor(op, "w", w)
    check_same_device(op, "a", a, "w", w)
    if (m_indices is None) == (masked_m is None):
        fail(op, "m_indices", "give exactly one of m_indices (contiguous layout, a 2-D) and masked_m "
                              "(masked layout, a 3-D)")
    if w.dim() != 3:
        fail(op, "w", f"expected (E, N, K) weights, got shape {_shape(w)}")
    e = w.shape[0]
    if m_indices is not None:
        check_tensor(op, "m_indices", m_indices)
        if a.dim() != 2:
            fail(op, "a", f"the contiguous layout takes a 2-D (M, K) activation, got shape {_shape(a)}")
        check_dtype(op, "m_indices", m_indices, (torch.int32,))
        if _shape(m_indices) != (a.shape[0],):
            fail(op, "m_indices", f"expected shape ({a.shape[0]},) (one expert id per row of a), got "
                                  f"{_shape(m_indices)}")
        check_same_device(op, "a", a, "m_indices", m_indices)
    else:
        check_tensor(op, "masked_m", masked_m)
        if a.dim() != 3 or a.shape[0] != e:
            fail(op, "a", f"the masked layout takes a 3-D (E={e}, max_m, K) activation, got shape {_shape(a)}")
        check_dtype(op, "masked_m", masked_m, (torch.int32,))
        if _shape(masked_m) != (e,):
            fail(op, "masked_m", f"expected shape ({e},) (one row count per expert), got {_shape(masked_m)}")
        check_same_device(op, "a", a, "masked_m", masked_m)
    for name, t in (("a", a), ("w", w)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            fail(op, name, f"the last (K) dim must be contiguous, got strides {t.stride()}; call .contiguous()")
    return e


def _check_scale(op, arg, s, want: tuple, a):
    check_tensor(op, arg, s)
    check_dtype(op, arg, s, (torch.float32,))
    if _shape(s) != want:
        fail(op, arg, f"expected shape {want}, got {_shape(s)}")
    check_same_device(op, "a", a, arg, s)


def contiguous_ids(m_indices, masked_m):
    """The index tensors as the kernels read them (contiguous int32)."""
    return (None if m_indices is None else m_indices.contiguous(),
            None if masked_m is None else masked_m.contiguous())


def check_bf16(a, w, m_indices, masked_m, op: str = "moe_gemm_bf16") -> None:
    _check_layout(op, a, w, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.bfloat16, torch.float16))
    if w.dtype != a.dtype:
        fail(op, "w", f"dtype {str(w.dtype).removeprefix('torch.')} differs from a's "
                      f"{str(a.dtype).removeprefix('torch.')}")
    if w.shape[2] != a.shape[-1]:
        fail(op, "w", f"expected (E, N, K={a.shape[-1]}), got shape {_shape(w)}")


def check_fp8(a, a_scale, w, w_scale, m_indices, masked_m, op: str = "moe_gemm_fp8") -> None:
    e = _check_layout(op, a, w, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.float8_e4m3fn,))
    check_dtype(op, "w", w, (torch.float8_e4m3fn,))
    k = a.shape[-1]
    if k % FP8_BLOCK:
        fail(op, "a", f"K={k} is not a multiple of {FP8_BLOCK} (one fp32 scale per 128 columns)")
    if w.shape[2] != k:
        fail(op, "w", f"expected (E, N, K={k}), got shape {_shape(w)}")
    _check_scale(op, "a_scale", a_scale, (*a.shape[:-1], k // FP8_BLOCK), a)
    _check_scale(op, "w_scale", w_scale, (e, cdiv(w.shape[1], FP8_BLOCK), k // FP8_BLOCK), a)


def fp4_views(w_packed, w_scale):
    """uint8 views of torch's packed-FP4 / E8M0 dtypes (same bytes)."""
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if fp4 is not None and isinstance(w_packed, torch.Tensor) and w_packed.dtype == fp4:
        w_packed = w_packed.view(torch.uint8)
    if e8m0 is not None and isinstance(w_scale, torch.Tensor) and w_scale.dtype == e8m0:
        w_scale = w_scale.view(torch.uint8)
    return w_packed, w_scale


def _check_fp4_weights(op, a, w_packed, w_scale, k: int, e: int, block: int = MXFP4_BLOCK,
                       scale: str = "E8M0") -> None:
    """FP4 weights: packed (E, N, K/2) uint8 and one uint8 scale per `block` weights (E, N, K/block) (MXFP4: E8M0
    per 32; NVFP4: E4M3 per 16), on a's device."""
    check_dtype(op, "w", w_packed, (torch.uint8,))
    if k % block:
        fail(op, "a", f"K={k} is not a multiple of {block} (one {scale} scale per {block} weights)")
    if w_packed.shape[2] * 2 != k:
        fail(op, "w", f"expected packed (E, N, K/2={k // 2}) bytes, got shape {_shape(w_packed)}")
    check_tensor(op, "w_scale", w_scale)
    check_dtype(op, "w_scale", w_scale, (torch.uint8,))
    want = (e, w_packed.shape[1], k // block)
    if _shape(w_scale) != want:
        fail(op, "w_scale", f"expected shape {want} ({scale}, one per {block} weights, the linear scale layout), "
                            f"got {_shape(w_scale)}")
    check_same_device(op, "a", a, "w_scale", w_scale)


def check_mxfp4(a, w_packed, w_scale, m_indices, masked_m, op: str = "moe_gemm_mxfp4") -> None:
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    e = _check_layout(op, a, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.bfloat16,))
    _check_fp4_weights(op, a, w_packed, w_scale, a.shape[-1], e)


def check_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m, op: str = "moe_gemm_w4a8") -> None:
    """E4M3 activations with fp32 1x128 scales (fp8_group_quantize) x MXFP4 weights."""
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    e = _check_layout(op, a, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.float8_e4m3fn,))
    k = a.shape[-1]
    if k % FP8_BLOCK:
        fail(op, "a", f"K={k} is not a multiple of {FP8_BLOCK} (one fp32 activation scale per 128 columns)")
    _check_scale(op, "a_scale", a_scale, (*a.shape[:-1], k // FP8_BLOCK), a)
    _check_fp4_weights(op, a, w_packed, w_scale, k, e)


def check_w4a4(a, a_scale, w_packed, w_scale, m_indices, masked_m) -> None:
    """MXFP4 activations (packed pairs + E8M0 scales per 32, mxfp4_quantize's linear layout) x MXFP4 weights."""
    op = "moe_gemm_w4a4"
    a, a_scale = fp4_views(a, a_scale)
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    e = _check_layout(op, a, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.uint8,))
    k = a.shape[-1] * 2
    check_tensor(op, "a_scale", a_scale)
    check_dtype(op, "a_scale", a_scale, (torch.uint8,))
    want = (*a.shape[:-1], k // MXFP4_BLOCK)
    if _shape(a_scale) != want:
        fail(op, "a_scale", f"expected shape {want} (E8M0, one per 32 activations, the linear scale layout), got "
                            f"{_shape(a_scale)}")
    check_same_device(op, "a", a, "a_scale", a_scale)
    _check_fp4_weights(op, a, w_packed, w_scale, k, e)


def nvfp4_views(w_packed, w_scale):
    """uint8 views of torch's packed-FP4 codes and float8_e4m3fn block scales (same bytes)."""
    w_packed, _ = fp4_views(w_packed, None)
    if isinstance(w_scale, torch.Tensor) and w_scale.dtype == torch.float8_e4m3fn:
        w_scale = w_scale.view(torch.uint8)
    return w_packed, w_scale


def check_nvfp4(a, w_packed, w_scale, w_global, m_indices, masked_m, op: str = "moe_gemm_nvfp4") -> None:
    """bf16 / fp16 activations x NVFP4 weights: E2M1 pairs (E, N, K/2) uint8, E4M3 block scales per 16 (E, N, K/16)
    (uint8 codes or float8_e4m3fn), fp32 global scales (E,), one per expert."""
    w_packed, w_scale = nvfp4_views(w_packed, w_scale)
    e = _check_layout(op, a, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.bfloat16, torch.float16))
    _check_fp4_weights(op, a, w_packed, w_scale, a.shape[-1], e, NVFP4_BLOCK, "E4M3")
    _check_scale(op, "w_global", w_global, (e,), a)


def check_row_weights(op, a, row_weights) -> None:
    """row_weights: fp32, one per row of the layout (contiguous (M,), masked (E, max_m))."""
    if row_weights is None:
        return
    check_tensor(op, "row_weights", row_weights)
    check_dtype(op, "row_weights", row_weights, (torch.float32,))
    if _shape(row_weights) != _shape(a)[:-1]:
        fail(op, "row_weights", f"expected shape {_shape(a)[:-1]} (one weight per row of a), got "
                                f"{_shape(row_weights)}")
    check_same_device(op, "a", a, "row_weights", row_weights)


# ------------------------------------------------------------------ GEMM1 + SwiGLU (+ FP8 1xG quantization)

WEIGHT_KINDS = ("bf16", "fp8", "mxfp4", "w4a8", "nvfp4")
ACTIVATIONS = ("silu", "gptoss")  # dispatch/reference/swiglu.py


def check_gemm_operands(op, weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global=None) -> None:
    """The GEMM operands as the moe_gemm_<weights> op takes them (a_scale: FP8 activations (fp8, w4a8); w_scale:
    every kind but bf16; w_global: NVFP4's fp32 (E,) global scale per expert, required for nvfp4, refused for the
    other kinds)."""
    if weights not in WEIGHT_KINDS:
        fail(op, "weights", f"{weights!r} is not one of {', '.join(WEIGHT_KINDS)}")
    if weights == "nvfp4":
        if a_scale is not None:
            fail(op, "a_scale", "NVFP4 W4A16 takes bf16 / fp16 activations without scales (give None)")
        if w_global is None:
            fail(op, "w_global", "NVFP4 weights need w_global: fp32 (E,), the global scale of each expert")
        check_nvfp4(a, w, w_scale, w_global, m_indices, masked_m, op)
        return
    if w_global is not None:
        fail(op, "w_global", f"only NVFP4 weights take a global scale ({weights} weights: give None)")
    if weights == "bf16":
        for name, t in (("a_scale", a_scale), ("w_scale", w_scale)):
            if t is not None:
                fail(op, name, "bf16 weights take no scales (give None)")
        check_bf16(a, w, m_indices, masked_m, op)
    elif weights == "fp8":
        check_fp8(a, a_scale, w, w_scale, m_indices, masked_m, op)
    elif weights == "w4a8":
        check_w4a8(a, a_scale, w, w_scale, m_indices, masked_m, op)
    else:
        if a_scale is not None:
            fail(op, "a_scale", "MXFP4 W4A16 takes bf16 activations without scales (give None)")
        check_mxfp4(a, w, w_scale, m_indices, masked_m, op)


def check_gemm_swiglu(op, weights, a, a_scale, w, w_scale, m_indices, masked_m, interleave, activation, alpha,
                      limit, group_size=None, quant_eps=None, w_global=None) -> None:
    """The GEMM operands (check_gemm_operands), then the SwiGLU arguments on the (E, 2I, K) weights' I, then the
    FP8 group arguments (group_size given)."""
    check_gemm_operands(op, weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    check_swiglu_args(op, w.shape[1], interleave, activation, alpha, limit, group_size, quant_eps)


def check_swiglu_args(op, two_i, interleave, activation, alpha, limit, group_size=None, quant_eps=None,
                      w_name="w") -> None:
    """The SwiGLU arguments of a GEMM1 + SwiGLU over 2I = two_i weight rows (gate and up; the weights' argument
    w_name), then the FP8 group arguments (group_size given)."""
    if two_i % 2:
        fail(op, w_name, f"N={two_i} is odd; expected (E, 2I, K) holding gate and up rows")
    i = two_i // 2
    if interleave < 0:
        fail(op, "interleave", f"must be 0 (gate rows [0, I), up rows [I, 2I)) or a granularity >= 1, got "
                               f"{interleave}")
    if interleave > 0 and i % interleave:
        fail(op, "interleave", f"I = {i} is not a multiple of the granularity {interleave}")
    if activation not in ACTIVATIONS:
        fail(op, "activation", f"{activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if not math.isfinite(alpha):
        fail(op, "alpha", f"must be finite, got {alpha}")
    if limit is not None and not (limit > 0 and math.isfinite(limit)):
        fail(op, "limit", f"must be None or a finite value > 0, got {limit}")
    if group_size is not None:
        if group_size <= 0 or i % group_size:
            fail(op, "group_size", f"I = {i} is not a multiple of group_size={group_size}")
        if not quant_eps > 0:
            fail(op, "quant_eps", f"must be > 0 (it keeps all-zero groups finite), got {quant_eps}")


def check_gemm_swiglu_fp4(quant, a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                          limit, qarg, swizzle, w_global) -> None:
    """moe_gemm_swiglu_<quant> (quant "mxfp4" / "nvfp4", the op's arguments in order; qarg: MXFP4's rounding or
    NVFP4's global_scale): the GEMM1 + SwiGLU checks, then I a whole number of 32 / 16-wide blocks; MXFP4
    rounding; NVFP4 global_scale None (computed), one fp32 scalar, or fp32 (E',) with E' >= E, one per expert
    (what swiglu_nvfp4 takes for the layout, every expert id of the GEMM covered)."""
    op = f"moe_gemm_swiglu_{quant}"
    check_gemm_swiglu(op, weights, a, a_scale, w, w_scale, m_indices, masked_m, interleave, activation, alpha, limit,
                      w_global=w_global)
    i, e = w.shape[1] // 2, w.shape[0]
    block = MXFP4_BLOCK if quant == "mxfp4" else NVFP4_BLOCK
    if i % block:
        fail(op, "w", f"I = {i} is not a multiple of the {quant.upper()} block {block}")
    if quant == "mxfp4":
        if qarg not in MX_ROUNDINGS:
            fail(op, "rounding", f"{qarg!r} is not one of {', '.join(MX_ROUNDINGS)}")
        return
    gs = qarg
    if gs is None:
        return
    check_tensor(op, "global_scale", gs)
    check_same_device(op, "a", a, "global_scale", gs)
    check_dtype(op, "global_scale", gs, (torch.float32,))
    if gs.numel() == 1 and gs.dim() <= 1:
        return
    if gs.dim() != 1 or gs.numel() < e:
        fail(op, "global_scale", f"expected a scalar or one scale per expert ({e},), got shape {_shape(gs)}")

# ------------------------------------------------------------------ GEMM2 scattered into token order + combine

FLOAT_OUT = (torch.bfloat16, torch.float16, torch.float32)


def check_gemm_combine(op, weights, a, a_scale, w, w_scale, m_indices, masked_m, src_rows, inv_rows, topk_weights,
                       shared, out_dtype, w_global=None) -> None:
    """The GEMM operands, then the layout's two index maps (src_rows: entry t * k + j per row, sentinel T * k;
    inv_rows (T, k): row of each entry, -1 = none), the top-k weights and the optional shared output."""
    check_gemm_operands(op, weights, a, a_scale, w, w_scale, m_indices, masked_m, w_global)
    check_combine_args(op, a, w.shape[1], src_rows, inv_rows, topk_weights, shared, out_dtype)


def check_combine_args(op, a, n, src_rows, inv_rows, topk_weights, shared, out_dtype) -> None:
    """A GEMM2-into-token-order's index maps, top-k weights, shared output (T, n) and output dtype."""
    for name, t in (("src_rows", src_rows), ("inv_rows", inv_rows), ("topk_weights", topk_weights)):
        check_tensor(op, name, t)
        check_same_device(op, "a", a, name, t)
    check_dtype(op, "src_rows", src_rows, (torch.int32,))
    check_dtype(op, "inv_rows", inv_rows, (torch.int32,))
    check_dtype(op, "topk_weights", topk_weights, (torch.float32,))
    if _shape(src_rows) != _shape(a)[:-1]:
        fail(op, "src_rows", f"expected shape {_shape(a)[:-1]} (one entry per row of a), got {_shape(src_rows)}")
    if inv_rows.dim() != 2:
        fail(op, "inv_rows", f"expected (T, k), got shape {_shape(inv_rows)}")
    if _shape(topk_weights) != _shape(inv_rows):
        fail(op, "topk_weights", f"shape {_shape(topk_weights)} != inv_rows shape {_shape(inv_rows)}")
    if shared is not None:
        check_tensor(op, "shared", shared)
        check_same_device(op, "a", a, "shared", shared)
        if _shape(shared) != (inv_rows.shape[0], n):
            fail(op, "shared", f"expected shape ({inv_rows.shape[0]}, {n}), got {_shape(shared)}")
    if out_dtype not in FLOAT_OUT:
        fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")


BLOCKSCALED_FORMATS = {"nvfp4": 16, "mxfp4": 32}  # elements per block scale
SCALE_ATOM_ROWS, SCALE_ATOM_COLS = 128, 4  # the 128x4 swizzled scale layout's atom


def blockscaled_views(a, a_scale, b, b_scale):
    """uint8 views of the block-scaled GEMM's operands: torch's packed-FP4 codes and E8M0 (MXFP4) or E4M3 (NVFP4)
    scale bytes are accepted as they are; other dtypes pass through (and the checks name them)."""
    a, a_scale = fp4_views(a, a_scale)
    b, b_scale = fp4_views(b, b_scale)
    e4m3 = lambda t: t.view(torch.uint8) if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn else t
    return a, e4m3(a_scale), b, e4m3(b_scale)


def _check_blockscaled_operands(op, a, a_scale, b, b_scale, alpha, fmt, a_form: str):
    """The operands both block-scaled layouts share: a (`a_form`: [M, K/2] or [E, max_m, K/2]) u8, the
    128x4-swizzled scale container of all its rows, b [G, N, K/2], b_scale, alpha [G] fp32. Returns G."""
    if fmt not in BLOCKSCALED_FORMATS:
        fail(op, "fmt", f"{fmt!r}: one of {sorted(BLOCKSCALED_FORMATS)}")
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("b_scale", b_scale)):
        check_tensor(op, name, t)
        check_dtype(op, name, t, (torch.uint8,))
        check_same_device(op, "a", a, name, t)
    if a.dim() != a_form.count(",") + 1:
        fail(op, "a", f"expected {a_form} packed E2M1 pairs, got shape {_shape(a)}")
    rows = a.shape[0] * (a.shape[1] if a.dim() == 3 else 1)
    if b.dim() != 3 or b.shape[2] != a.shape[-1]:
        fail(op, "b", f"expected [G, N, K/2={a.shape[-1]}] packed weights, got shape {_shape(b)}")
    g, n = b.shape[0], b.shape[1]
    k = 2 * a.shape[-1]
    sf = BLOCKSCALED_FORMATS[fmt]
    if k % sf:
        fail(op, "a", f"K={k} is not a multiple of {sf} ({fmt}: one scale per {sf} elements)")
    cols = -(-(k // sf) // SCALE_ATOM_COLS) * SCALE_ATOM_COLS
    want_a = (-(-rows // SCALE_ATOM_ROWS) * SCALE_ATOM_ROWS, cols)
    if _shape(a_scale) != want_a:
        fail(op, "a_scale", f"expected the 128x4-swizzled container {want_a}, got {_shape(a_scale)}")
    want_b = (g, -(-n // SCALE_ATOM_ROWS) * SCALE_ATOM_ROWS, cols)
    if _shape(b_scale) != want_b:
        fail(op, "b_scale", f"expected one 128x4-swizzled container per group {want_b}, got {_shape(b_scale)}")
    check_tensor(op, "alpha", alpha)
    check_dtype(op, "alpha", alpha, (torch.float32,))
    if _shape(alpha) != (g,):
        fail(op, "alpha", f"expected shape ({g},) (one output factor per group), got {_shape(alpha)}")
    check_same_device(op, "a", a, "alpha", alpha)
    return g


def check_blockscaled(a, a_scale, b, b_scale, offsets, alpha, fmt) -> None:
    """FP4 x FP4 grouped GEMM over group offsets: a [M, K/2] u8 (E2M1 pairs), a_scale [round_up(M, 128),
    round_up(K/sf, 4)] u8 (128x4-swizzled, as nvfp4_quantize / mxfp4_quantize write with scale_layout="swizzled"),
    b [G, N, K/2] u8, b_scale [G, round_up(N, 128), round_up(K/sf, 4)] u8, offsets [G + 1] int32, alpha [G] fp32."""
    op = "moe_gemm_blockscaled"
    a, a_scale, b, b_scale = blockscaled_views(a, a_scale, b, b_scale)
    g = _check_blockscaled_operands(op, a, a_scale, b, b_scale, alpha, fmt, "[M, K/2]")
    _check_int32_vector(op, a, "offsets", offsets, g + 1, "group row starts and the end")


def check_blockscaled_masked(a, a_scale, b, b_scale, masked_m, alpha, fmt) -> None:
    """The masked layout: a [E, max_m, K/2] u8, a_scale the 128x4-swizzled container of its E * max_m rows
    [round_up(E * max_m, 128), round_up(K/sf, 4)] (the quantizers' output for a [E * max_m, K] view), b [E, N, K/2],
    b_scale as check_blockscaled, masked_m [E] int32 (rows per expert, clamped to [0, max_m]), alpha [E] fp32."""
    op = "moe_gemm_blockscaled_masked"
    a, a_scale, b, b_scale = blockscaled_views(a, a_scale, b, b_scale)
    e = _check_blockscaled_operands(op, a, a_scale, b, b_scale, alpha, fmt, "[E, max_m, K/2]")
    if e != a.shape[0]:
        fail(op, "b", f"expected {a.shape[0]} experts (a's first dimension), got {e}")
    _check_int32_vector(op, a, "masked_m", masked_m, e, "rows per expert")


def _check_int32_vector(op, a, name, t, size, what):
    check_tensor(op, name, t)
    check_dtype(op, name, t, (torch.int32,))
    if _shape(t) != (size,):
        fail(op, name, f"expected shape ({size},) ({what}), got {_shape(t)}")
    check_same_device(op, "a", a, name, t)
