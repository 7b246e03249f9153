"""MoE expert grouped GEMMs (Triton): out[m, n] = sum_k a[m, k] * w[e(m), n, k], fp32 accumulation.

Weights are (E, N, K) with K contiguous (K-major), one of:
* bf16 / fp16 (`moe_gemm_bf16`; the output has the activations' dtype);
* FP8 E4M3 with fp32 128x128 block scales (E, ceil(N/128), K/128), activations E4M3 with fp32 1x128 scales
  (`moe_gemm_fp8`, DeepGEMM's W8A8 block scaling): acc += dot(a_blk, w_blk) * a_scale[m] * w_scale[n // 128]
  once per 128-wide K step, bf16 output;
* MXFP4 (`moe_gemm_mxfp4`, GPT-OSS W4A16): E2M1 pairs (E, N, K/2) uint8, element 2i in the low nibble, E8M0
  scales (E, N, K/32) (value = e2m1 * 2^(s - 127)), bf16 activations; dequantized to bf16 in registers (or,
  with `dot_scaled=True`, handed to tl.dot_scaled as "e2m1" with the scales), bf16 output.
* MXFP4 weights with narrow activations through `tl.dot_scaled` (the native block-scaled MMA on Blackwell, an
  upcast + WGMMA on sm_90): `moe_gemm_w4a8` (E4M3 activations with fp32 1x128 scales, as fp8_group_quantize
  writes them; the activation scale multiplies each 128-wide K step) and `moe_gemm_w4a4` (MXFP4 activations:
  packed pairs + E8M0 scales per 32 in the linear layout mxfp4_quantize writes).
* NVFP4 (`moe_gemm_nvfp4`, W4A16): E2M1 pairs (E, N, K/2) uint8 as for MXFP4, E4M3 scales per 16 (E, N, K/16)
  (the linear layout nvfp4_quantize writes), an fp32 global scale per expert (E,); value = e2m1 * e4m3 *
  global[e]. bf16 / fp16 activations, output in their dtype. e2m1 * e4m3 is dequantized in registers (exact in
  bf16 and fp16), the global scale multiplies the expert's fp32 sums once (hand-written: Triton 3.6 cannot lower
  tl.dot_scaled with NVFP4 scales on sm_90).
Optional fused epilogue on every entry: `row_weights` (fp32, one per row of a) multiplies each computed row
before the one rounding (the top-k weights of GEMM2, so the combine only sums).

Two activation layouts (docs/moe.md; exactly one of `m_indices` / `masked_m` is given):
* contiguous: a (M, K) with `m_indices` (M,) int32, the expert of each row, -1 on padding rows (moe_align's
  output). Rows whose id is outside [0, E) are padding: never read, their output rows are written as 0.
  A tile whose rows span several experts (the align block_m smaller than BLOCK_M) runs one K loop per
  expert present, each with the other rows masked off, so any alignment is correct; aligned tiles take one.
* masked: a (E, max_m, K) with `masked_m` (E,) int32; rows >= masked_m[e] (clamped to [0, max_m]) are not
  computed and written as 0. Output (E, max_m, N).

Anatomy: kernel (one body, weight kind and layout as constexprs) -> launcher -> config (config.py) ->
input checks (raise triton_ops.contract.checks errors) -> supports_* (backend limits, a reason or None) ->
entries. Reference: dispatch/reference/moe_gemm.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch
from triton_ops.contract.formats import NVFP4_BLOCK
from triton_ops.contract.moe_gemm import (
    check_bf16,
    check_fp8,
    check_mxfp4,
    check_nvfp4,
    check_row_weights,
    check_w4a4,
    check_w4a8,
    contiguous_ids,
    fp4_views,
    nvfp4_views,
)

from .config import FP8_BLOCK, MXFP4_BLOCK, MoeGemmConfig, pick_config, rows_per_expert
from .dequant import e4m3_operand, mma, mxfp4_tile_t, nvfp4_tile_t

KIND_CODE = {"bf16": 0, "fp8": 1, "mxfp4": 2, "w4a8": 3, "w4a4": 4, "nvfp4": 5}
_MAX_GRID_Y = 65535  # CUDA grid dim y: the masked layout puts the experts there


@triton.jit
def _weight_step(a, a_s, k0, w_ptr, ws_ptr, e64, n64, nmask, K, acc, stride_we, stride_wn, stride_wse, stride_wsn,
                 stride_wsk, KIND: tl.constexpr, EMULATE: tl.constexpr, F32_DOT: tl.constexpr,
                 DOT_SCALED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a[:, k0:k0+BLOCK_K] @ w[e, n64, k0:k0+BLOCK_K].T for one K step (a loaded by the caller; a_s: the
    step's fp32 activation scales for FP8). n64: the weight rows of the tile's columns (any rows of w)."""
    kk = k0 + tl.arange(0, BLOCK_K)
    kmask = kk < K
    w_cols = w_ptr + e64 * stride_we + n64[None, :] * stride_wn  # [1, BLOCK_N]
    if KIND == 0:
        w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        acc = mma(a, w, acc, F32_DOT)
    elif KIND == 1:
        w = tl.load(w_cols + kk[:, None], mask=kmask[:, None] & nmask[None, :], other=0)
        kb = k0 // BLOCK_K  # BLOCK_K == 128: one scale column per step
        w_s = tl.load(ws_ptr + e64 * stride_wse + (n64 // 128) * stride_wsn + kb * stride_wsk, mask=nmask,
                      other=0.0)
        d = mma(e4m3_operand(a, EMULATE, F32_DOT), e4m3_operand(w, EMULATE, F32_DOT), None, F32_DOT)
        acc += d * (a_s[:, None] * w_s[None, :])
    else:  # FP4 weights, E2M1 pairs: MXFP4 (E8M0 scales per 32) W4A16 (2), W4A8 (3), W4A4 (4); NVFP4 W4A16 (5: E4M3
        # scales per 16, the expert's global scale: expert_pass)
        SB: tl.constexpr = 16 if KIND == 5 else 32  # weight elements per scale
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // SB + tl.arange(0, BLOCK_K // SB)
        w_rows = w_ptr + e64 * stride_we + n64[:, None] * stride_wn  # [BLOCK_N, 1]
        sb = tl.load(ws_ptr + e64 * stride_wse + n64[:, None] * stride_wsn + ks[None, :] * stride_wsk,
                     mask=nmask[:, None] & (ks < K // SB)[None, :], other=0)
        if KIND == 3:  # e4m3 x e2m1 block-scaled MMA; the fp32 1x128 activation scale (a_s) after each K step
            packed = tl.load(w_cols + kh[:, None], mask=(kh < K // 2)[:, None] & nmask[None, :], other=0)
            # unit E8M0 scales on the lhs (2^0): with no lhs scale Triton upcasts instead of using the
            # native e4m3 x e2m1 MMA; the real fp32 scale is applied per step, as the FP8 GEMM does
            unit = tl.full([a.shape[0], BLOCK_K // 32], 127, tl.uint8)
            d = tl.dot_scaled(a.to(tl.float8e4nv, bitcast=True), unit, "e4m3", packed, sb, "e2m1")
            acc += d * a_s[:, None]
        elif KIND == 4:  # e2m1 x e2m1 block-scaled MMA, E8M0 scales per 32 on both sides (a_s: the lhs's)
            packed = tl.load(w_cols + kh[:, None], mask=(kh < K // 2)[:, None] & nmask[None, :], other=0)
            acc = tl.dot_scaled(a, a_s, "e2m1", packed, sb, "e2m1", acc)
        elif KIND == 2 and DOT_SCALED:
            # rhs: [BLOCK_K / 2, BLOCK_N] bytes packed along K; scales [BLOCK_N, BLOCK_K / 32]
            packed = tl.load(w_cols + kh[:, None], mask=(kh < K // 2)[:, None] & nmask[None, :], other=0)
            acc = tl.dot_scaled(a, None, "bf16", packed, sb, "e2m1", acc)
        else:  # W4A16 dequantized in registers (NVFP4: e2m1 * e4m3 in a's dtype, exact)
            packed = tl.load(w_rows + kh[None, :], mask=nmask[:, None] & (kh < K // 2)[None, :], other=0)
            if KIND == 5:
                w_t = nvfp4_tile_t(packed, sb, a.dtype, BLOCK_N, BLOCK_K, EMULATE, F32_DOT)
            else:
                w_t = mxfp4_tile_t(packed, sb, BLOCK_N, BLOCK_K, F32_DOT)
            acc = mma(a, w_t, acc, F32_DOT)
    return acc


@triton.jit
def expert_pass(a_ptr, a_off, sel, as_ptr, as_off, stride_ask, w_ptr, ws_ptr, e, offs_n, nmask, offs_n2, K,
                stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                KIND: tl.constexpr, EMULATE: tl.constexpr, F32_DOT: tl.constexpr, DOT_SCALED: tl.constexpr,
                DUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] = sum over K of a[rows] * w[e, offs_n] for the rows in `sel` (the others read
    as zero; their results are not stored). a_off / as_off: int64 element offsets of the rows in a / a_scale.
    DUAL: a second accumulator over the weight rows offs_n2 (same mask) from the same activation loads (the gate
    and up columns of a fused SwiGLU); returns (acc, acc2), acc2 is acc when not DUAL.
    as_ptr: the activation scales (FP8 / W4A8 / W4A4), or for NVFP4 weights the fp32 global scale per expert (E,),
    which multiplies the fp32 sums once at the end (value = e2m1 * e4m3 * global[e])."""
    e64 = e.to(tl.int64)
    n64 = offs_n.to(tl.int64)
    n64b = offs_n2.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    A_PER_BYTE: tl.constexpr = 2 if KIND == 4 else 1  # W4A4: activations are packed E2M1 pairs too
    offs_ka = tl.arange(0, BLOCK_K // A_PER_BYTE)
    for k0 in range(0, K, BLOCK_K):
        ka = k0 // A_PER_BYTE + offs_ka
        a = tl.load(a_ptr + a_off[:, None] + ka[None, :], mask=sel[:, None] & (ka < K // A_PER_BYTE)[None, :],
                    other=0)
        a_s = 0.0  # activation scales of this step: FP8 (fp32 1x128, one per row), W4A4 (E8M0 per 32)
        if KIND == 1 or KIND == 3:
            a_s = tl.load(as_ptr + as_off + (k0 // 128) * stride_ask, mask=sel, other=0.0)
        elif KIND == 4:
            ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            a_s = tl.load(as_ptr + as_off[:, None] + ks[None, :] * stride_ask,
                          mask=sel[:, None] & (ks < K // 32)[None, :], other=0)
        acc = _weight_step(a, a_s, k0, w_ptr, ws_ptr, e64, n64, nmask, K, acc, stride_we, stride_wn, stride_wse,
                           stride_wsn, stride_wsk, KIND, EMULATE, F32_DOT, DOT_SCALED, BLOCK_N, BLOCK_K)
        if DUAL:
            acc2 = _weight_step(a, a_s, k0, w_ptr, ws_ptr, e64, n64b, nmask, K, acc2, stride_we, stride_wn,
                                stride_wse, stride_wsn, stride_wsk, KIND, EMULATE, F32_DOT, DOT_SCALED, BLOCK_N,
                                BLOCK_K)
    if KIND == 5:
        gs = tl.load(as_ptr + e64)
        acc = acc * gs
        acc2 = acc2 * gs
    if DUAL:
        return acc, acc2
    else:
        return acc, acc


@triton.jit
def tile_of_program(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The [BLOCK_M, BLOCK_N] tile of this program (axis 0), GROUP_M-swizzled (the programs of a group walk the
    same N tile of GROUP_M consecutive M tiles, mostly one expert, so its weight tile is reused from L2):
    (pid_m, pid_n, rows, rows as int64, rows < M, columns, columns < N)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group
    pid_n = (pid % width) // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_m, pid_n, rows, rows.to(tl.int64), rows < M, offs_n, offs_n < N


@triton.jit
def _moe_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, ids_ptr, rw_ptr, out_ptr,
                     M, N, K, E,
                     stride_ae, stride_am, stride_ase, stride_asm, stride_ask,
                     stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                     KIND: tl.constexpr, MASKED: tl.constexpr, EMULATE: tl.constexpr, F32_DOT: tl.constexpr,
                     DOT_SCALED: tl.constexpr, HAS_RW: tl.constexpr, OUT_DTYPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     dst_ptr=None, n_dst=0, SCATTER: tl.constexpr = False):
    """Program (axis 0) = one [BLOCK_M, BLOCK_N] output tile, GROUP_M-swizzled; masked layout: axis 1 = expert.
    M is the row count of the layout (contiguous: all rows; masked: max_m). Every output element in range is
    written exactly once: computed rows by their expert's pass, the others as zeros. HAS_RW: computed rows are
    multiplied by their fp32 row weight (the top-k weight of the row's entry) before the one rounding.
    SCATTER: layout row r goes to output row dst[r] of an (n_dst, N) output (the token-order entry t * k + j of
    the row), rows whose dst is outside [0, n_dst) (moe_align's sentinel T * k) are not written."""
    pid_m, pid_n, rows, rows64, rmask, offs_n, nmask = tile_of_program(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    cols_mask = nmask[None, :]
    if MASKED:
        e = tl.program_id(1)
        e64 = e.to(tl.int64)
        cnt = tl.minimum(tl.maximum(tl.load(ids_ptr + e), 0), M)
        flat = e64 * M + rows64  # row of the (E * max_m, N) output
        dst, dst_ok = _destination(flat, rmask, dst_ptr, n_dst, SCATTER)
        out_rows = out_ptr + dst[:, None] * N + offs_n[None, :]
        done = rows < cnt
        if pid_m * BLOCK_M < cnt:
            acc, acc_ = expert_pass(a_ptr, e64 * stride_ae + rows64 * stride_am, done, as_ptr,
                                    e64 * stride_ase + rows64 * stride_asm, stride_ask, w_ptr, ws_ptr, e, offs_n,
                                    nmask, offs_n, K, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                                    KIND, EMULATE, F32_DOT, DOT_SCALED, False, BLOCK_M, BLOCK_N, BLOCK_K)
            if HAS_RW:
                acc *= tl.load(rw_ptr + flat, mask=done, other=0.0)[:, None]
            tl.store(out_rows, cast_out(acc, OUT_DTYPE, EMULATE), mask=(done & dst_ok)[:, None] & cols_mask)
    else:
        dst, dst_ok = _destination(rows64, rmask, dst_ptr, n_dst, SCATTER)
        out_rows = out_ptr + dst[:, None] * N + offs_n[None, :]
        if HAS_RW:
            rw = tl.load(rw_ptr + rows, mask=rmask, other=0.0)
        mi = tl.load(ids_ptr + rows, mask=rmask, other=-1)
        done = (mi >= 0) & (mi < E)  # out-of-range ids are padding: never used as an expert
        mi = tl.where(done, mi, E)
        e = tl.min(mi, 0)
        while e < E:  # one pass per expert present in the tile, in increasing id order
            sel = mi == e
            acc, acc_ = expert_pass(a_ptr, rows64 * stride_am, sel, as_ptr, rows64 * stride_asm, stride_ask, w_ptr,
                                    ws_ptr, e, offs_n, nmask, offs_n, K, stride_we, stride_wn, stride_wse, stride_wsn,
                                    stride_wsk, KIND, EMULATE, F32_DOT, DOT_SCALED, False, BLOCK_M, BLOCK_N, BLOCK_K)
            if HAS_RW:
                acc *= rw[:, None]
            tl.store(out_rows, cast_out(acc, OUT_DTYPE, EMULATE), mask=(sel & dst_ok)[:, None] & cols_mask)
            e = tl.min(tl.where(mi > e, mi, E), 0)
    zero = tl.zeros([BLOCK_M, BLOCK_N], OUT_DTYPE)
    tl.store(out_rows, zero, mask=(rmask & ~done & dst_ok)[:, None] & cols_mask)


@triton.jit
def _destination(flat, rmask, dst_ptr, n_dst, SCATTER: tl.constexpr):
    """(output row, whether to write it) of layout rows `flat` (int64): the row itself, or dst[flat] when SCATTER."""
    if SCATTER:
        d = tl.load(dst_ptr + flat, mask=rmask, other=-1).to(tl.int64)
        ok = rmask & (d >= 0) & (d < n_dst)
        return tl.where(ok, d, 0), ok
    else:
        return flat, rmask


# ---------------------------------------------------------------------------------------------- launcher


def layout_args(a, a_scale, w, w_scale, m_indices, masked_m):
    """(ids, strides) of checked operands: the layout's index tensor and the kernels' stride arguments stride_ae,
    stride_am, stride_ase, stride_asm, stride_ask, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk."""
    masked = masked_m is not None
    sa = (0, 0, 0)
    if a_scale is not None:
        sa = a_scale.stride() if masked else (0, *a_scale.stride())
    sw = (0, 0, 0) if w_scale is None else w_scale.stride()
    sae = a.stride(0) if masked else 0
    sam = a.stride(1) if masked else a.stride(0)
    return (masked_m if masked else m_indices), (sae, sam, *sa, w.stride(0), w.stride(1), *sw)


def _launch(kind, a, a_scale, w, w_scale, m_indices, masked_m, row_weights, out_dtype, config, dot_scaled=False,
            dst_rows=None, n_dst=0, w_global=None):
    """a / w / scales already checked; 1-byte formats travel as uint8 views. dst_rows (int32, a.shape[:-1]):
    scatter layout row r to output row dst_rows[r] of an (n_dst, N) output (rows outside [0, n_dst) unwritten).
    w_global: NVFP4's fp32 (E,) global scales (the kernel reads them through the activation-scale pointer)."""
    masked = masked_m is not None
    e, n = w.shape[0], w.shape[1]
    k = a.shape[-1] * (2 if kind == "w4a4" else 1)  # W4A4 activations: packed pairs
    rows = a.shape[1] if masked else a.shape[0]
    lead = a.shape[:-1] if dst_rows is None else (n_dst,)
    out = torch.empty(*lead, n, dtype=out_dtype, device=a.device)
    if dst_rows is not None and a.shape[:-1].numel() == 0:
        return out  # no layout row: nothing is written (the combine reads no slot)
    if out.numel() == 0:
        return out
    cfg = config or pick_config(kind, rows_per_expert(rows, e, masked), n, k, a.device)
    reason = cfg.refusal(kind)
    if reason:
        raise ValueError(f"moe_gemm_{kind}: config {cfg}: {reason}")
    ids, strides = layout_args(a, a_scale, w, w_scale, m_indices, masked_m)
    grid = (cdiv(rows, cfg.block_m) * cdiv(n, cfg.block_n), e if masked else 1)
    dummy = w  # never read when the kind has no scales
    if w_global is not None:
        a_scale = w_global.contiguous()  # after layout_args: no activation-scale strides for this kind
    launch(_moe_gemm_kernel, grid,
        a, dummy if a_scale is None else a_scale, w, dummy if w_scale is None else w_scale, ids,
        dummy if row_weights is None else row_weights.contiguous(), out,
        rows, n, k, e, *strides,
        KIND=KIND_CODE[kind], MASKED=masked, EMULATE=emulate_formats(a.device), F32_DOT=a.device.type != "cuda",
        DOT_SCALED=dot_scaled, HAS_RW=row_weights is not None, OUT_DTYPE=TL_DTYPE[out_dtype],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        dst_ptr=dummy if dst_rows is None else dst_rows.contiguous(), n_dst=n_dst, SCATTER=dst_rows is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


# ---------------------------------------------------------------------------------------------- checks


# ---------------------------------------------------------------------------------------------- supports


def _grid_refusal(w, masked_m) -> str | None:
    if masked_m is not None and w.shape[0] > _MAX_GRID_Y:
        return f"E={w.shape[0]} > {_MAX_GRID_Y} experts on grid axis 1 (masked layout)"
    return None


def supports_moe_gemm_bf16(a, w, m_indices, masked_m, *rest) -> str | None:
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"activations {a.dtype} are not bf16 / fp16"
    return _grid_refusal(w, masked_m)


def supports_moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m, *rest) -> str | None:
    if a.shape[-1] % FP8_BLOCK:
        return f"K={a.shape[-1]} is not a multiple of {FP8_BLOCK}: BLOCK_K is 128, one scale per K tile"
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        return f"a {a.dtype} / w {w.dtype}: only E4M3 (float8_e4m3fn) is implemented"
    return _grid_refusal(w, masked_m)


def supports_moe_gemm_mxfp4(a, w_packed, w_scale, m_indices, masked_m, *rest) -> str | None:
    if a.dtype != torch.bfloat16:
        return f"activations {a.dtype}: W4A16 takes bf16 (E8M0-scaled weights can leave fp16's range)"
    if a.shape[-1] % MXFP4_BLOCK:
        return f"K={a.shape[-1]} is not a multiple of {MXFP4_BLOCK}"
    return _grid_refusal(w_packed, masked_m)


def supports_moe_gemm_nvfp4(a, w_packed, w_scale, w_global, m_indices, masked_m, *rest) -> str | None:
    if a.dtype not in (torch.bfloat16, torch.float16):
        return f"activations {a.dtype} are not bf16 / fp16"
    if a.shape[-1] % NVFP4_BLOCK:
        return f"K={a.shape[-1]} is not a multiple of {NVFP4_BLOCK}"
    return _grid_refusal(w_packed, masked_m)


def supports_moe_gemm_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m, *rest) -> str | None:
    return _grid_refusal(w_packed, masked_m)


def supports_moe_gemm_w4a4(a, a_scale, w_packed, w_scale, m_indices, masked_m, *rest) -> str | None:
    return _grid_refusal(w_packed, masked_m)


# ---------------------------------------------------------------------------------------------- entries


def moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None, *, config: MoeGemmConfig | None = None):
    """(M, K) x (E, N, K) -> (M, N) (contiguous) or (E, max_m, K) -> (E, max_m, N) (masked); a's dtype.
    row_weights (fp32, a.shape[:-1]): computed rows are scaled by it before rounding (GEMM2 top-k weights)."""
    check_bf16(a, w, m_indices, masked_m)
    check_row_weights("moe_gemm_bf16", a, row_weights)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch("bf16", a, None, w, None, m_indices, masked_m, row_weights, a.dtype, config)


def moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m, row_weights=None, *,
                 config: MoeGemmConfig | None = None):
    """E4M3 W8A8 with 1x128 activation and 128x128 weight scales (any strides: row-major or the
    column-major TMA-aligned scales fp8_group_quantize writes) -> bf16. row_weights: as moe_gemm_bf16."""
    check_fp8(a, a_scale, w, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_fp8", a, row_weights)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch("fp8", a.view(torch.uint8), a_scale, w.view(torch.uint8), w_scale, m_indices, masked_m,
                   row_weights, torch.bfloat16, config)


def moe_gemm_mxfp4(a, w_packed, w_scale, m_indices, masked_m, row_weights=None, *,
                   config: MoeGemmConfig | None = None, dot_scaled: bool = False):
    """bf16 activations x MXFP4 weights -> bf16. row_weights: as moe_gemm_bf16. dot_scaled: tl.dot_scaled
    (lhs "bf16", rhs "e2m1" packed along K + E8M0 scales) instead of the in-register dequantization."""
    check_mxfp4(a, w_packed, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_mxfp4", a, row_weights)
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch("mxfp4", a, None, w_packed, w_scale, m_indices, masked_m, row_weights, torch.bfloat16, config,
                   dot_scaled)


def moe_gemm_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights=None, *,
                  config: MoeGemmConfig | None = None):
    """E4M3 activations with fp32 1x128 scales x MXFP4 weights -> bf16, through tl.dot_scaled ("e4m3" x "e2m1"
    with the weights' E8M0 scales; the activation scale multiplies each 128-wide K step's result, as in the FP8
    GEMM). Blackwell: native block-scaled MMA (UTCQMMA on sm_100a); sm_90: upcast + WGMMA."""
    check_w4a8(a, a_scale, w_packed, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_w4a8", a, row_weights)
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch("w4a8", a.view(torch.uint8), a_scale, w_packed, w_scale, m_indices, masked_m, row_weights,
                   torch.bfloat16, config)


def moe_gemm_w4a4(a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights=None, *,
                  config: MoeGemmConfig | None = None):
    """MXFP4 activations x MXFP4 weights -> bf16, through tl.dot_scaled ("e2m1" x "e2m1", E8M0 scales per 32 on
    both sides). Blackwell: native block-scaled MMA (UTCOMMA on sm_100a, OMMA.SF on sm_120a); sm_90: upcast."""
    check_w4a4(a, a_scale, w_packed, w_scale, m_indices, masked_m)
    check_row_weights("moe_gemm_w4a4", a, row_weights)
    a, a_scale = fp4_views(a, a_scale)
    w_packed, w_scale = fp4_views(w_packed, w_scale)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch("w4a4", a, a_scale, w_packed, w_scale, m_indices, masked_m, row_weights, torch.bfloat16,
                   config)


def moe_gemm_nvfp4(a, w_packed, w_scale, w_global, m_indices, masked_m, row_weights=None, *,
                   config: MoeGemmConfig | None = None):
    """bf16 / fp16 activations x NVFP4 weights (W4A16) -> a's dtype: E2M1 pairs (E, N, K/2), E4M3 scales per 16
    (E, N, K/16), fp32 global scale per expert (E,). e2m1 * e4m3 is dequantized to a's dtype in registers (exact),
    the global scale multiplies each expert's fp32 sums once. row_weights: as moe_gemm_bf16."""
    check_nvfp4(a, w_packed, w_scale, w_global, m_indices, masked_m)
    check_row_weights("moe_gemm_nvfp4", a, row_weights)
    w_packed, w_scale = nvfp4_views(w_packed, w_scale)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch("nvfp4", a, None, w_packed, w_scale, m_indices, masked_m, row_weights, a.dtype, config,
                   w_global=w_global)
