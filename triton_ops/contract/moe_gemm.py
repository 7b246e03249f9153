"""Argument checks of the moe_gemm ops (shared by every backend: the op runs them before choosing one).

Errors name the op and the argument (contract.checks.fail). Layouts: docs/moe.md; weights (E, N, K) K-major.
"""

from __future__ import annotations

import torch

from .checks import check_dtype, check_same_device, check_tensor, fail
from .formats import MXFP4_BLOCK, cdiv

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


def check_bf16(a, w, m_indices, masked_m) -> None:
    op = "moe_gemm_bf16"
    _check_layout(op, a, w, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.bfloat16, torch.float16))
    if w.dtype != a.dtype:
        fail(op, "w", f"dtype {str(w.dtype).removeprefix('torch.')} differs from a's "
                      f"{str(a.dtype).removeprefix('torch.')}")
    if w.shape[2] != a.shape[-1]:
        fail(op, "w", f"expected (E, N, K={a.shape[-1]}), got shape {_shape(w)}")


def check_fp8(a, a_scale, w, w_scale, m_indices, masked_m) -> None:
    op = "moe_gemm_fp8"
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


def _check_mxfp4_weights(op, a, w_packed, w_scale, k: int, e: int) -> None:
    """MXFP4 weights: packed (E, N, K/2) uint8 and E8M0 (E, N, K/32) uint8 scales, on a's device."""
    check_dtype(op, "w", w_packed, (torch.uint8,))
    if k % MXFP4_BLOCK:
        fail(op, "a", f"K={k} is not a multiple of {MXFP4_BLOCK} (one E8M0 scale per 32 weights)")
    if w_packed.shape[2] * 2 != k:
        fail(op, "w", f"expected packed (E, N, K/2={k // 2}) bytes, got shape {_shape(w_packed)}")
    check_tensor(op, "w_scale", w_scale)
    check_dtype(op, "w_scale", w_scale, (torch.uint8,))
    want = (e, w_packed.shape[1], k // MXFP4_BLOCK)
    if _shape(w_scale) != want:
        fail(op, "w_scale", f"expected shape {want}, got {_shape(w_scale)}")
    check_same_device(op, "a", a, "w_scale", w_scale)


def check_mxfp4(a, w_packed, w_scale, m_indices, masked_m) -> None:
    op = "moe_gemm_mxfp4"
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    e = _check_layout(op, a, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.bfloat16,))
    _check_mxfp4_weights(op, a, w_packed, w_scale, a.shape[-1], e)


def check_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m) -> None:
    """E4M3 activations with fp32 1x128 scales (fp8_group_quantize) x MXFP4 weights."""
    op = "moe_gemm_w4a8"
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    e = _check_layout(op, a, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a, (torch.float8_e4m3fn,))
    k = a.shape[-1]
    if k % FP8_BLOCK:
        fail(op, "a", f"K={k} is not a multiple of {FP8_BLOCK} (one fp32 activation scale per 128 columns)")
    _check_scale(op, "a_scale", a_scale, (*a.shape[:-1], k // FP8_BLOCK), a)
    _check_mxfp4_weights(op, a, w_packed, w_scale, k, e)


def check_w4a4(a_packed, a_scale, w_packed, w_scale, m_indices, masked_m) -> None:
    """MXFP4 activations (packed pairs + E8M0 scales per 32, mxfp4_quantize's linear layout) x MXFP4 weights."""
    op = "moe_gemm_w4a4"
    a_packed, a_scale = fp4_views(a_packed, a_scale)
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    e = _check_layout(op, a_packed, w_packed, m_indices, masked_m)
    check_dtype(op, "a", a_packed, (torch.uint8,))
    k = a_packed.shape[-1] * 2
    check_tensor(op, "a_scale", a_scale)
    check_dtype(op, "a_scale", a_scale, (torch.uint8,))
    want = (*a_packed.shape[:-1], k // MXFP4_BLOCK)
    if _shape(a_scale) != want:
        fail(op, "a_scale", f"expected shape {want} (E8M0, one per 32 activations, the linear scale layout), got "
                            f"{_shape(a_scale)}")
    check_same_device(op, "a", a_packed, "a_scale", a_scale)
    _check_mxfp4_weights(op, a_packed, w_packed, w_scale, k, e)


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
