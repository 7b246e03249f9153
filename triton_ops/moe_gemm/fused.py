"""GEMM1 of a MoE expert with SwiGLU in its epilogue (Triton): y = swiglu(dtype(a @ w_gate.T), dtype(a @ w_up.T)),
stored in the GEMM's dtype or quantized to FP8 E4M3 1xG groups (the layout fp8_group_quantize writes, what the
FP8 GEMM2 reads), MXFP4 or NVFP4 (codes and linear or 128x4-swizzled block scales, as swiglu_mxfp4 / swiglu_nvfp4
write them: linear MXFP4 is what moe_gemm_w4a4 reads, swizzled what moe_gemm_blockscaled reads).

A program owns BLOCK_N output columns c of I and the two weight rows each reads: gate row c and up row I + c
(concatenated halves), or, interleaved at granularity g, gate row (c // g) * 2g + c % g and up row that + g. Both
accumulators run over the same activation loads (grouped.expert_pass with DUAL). The epilogue rounds each to the
GEMM's output dtype (what the plain GEMM stores), evaluates the activation (triton_ops/swiglu.py:swiglu_act, the
SwiGLU kernel's own code) and stores through quant_epilogue, so the bytes equal the unfused chain
moe_gemm_<kind> -> swiglu / swiglu_fp8_group given the same fp32 accumulators (the GEMM's K order is the same:
same BLOCK_K steps, fp32 accumulation). Rows that are not computed (padding, out-of-range ids, past masked_m) hold
gate = up = 0, so they store what the SwiGLU op stores for its padding rows: y = 0, quantized as zeros (FP4: zero
code and scale bytes).

NVFP4 output: the global scale is given (one fp32 scalar, or one per expert: the expert pass's scale is loaded
once per pass); a computed one (None) is the float output quantized by the NVFP4 quantizer afterwards (its amax
pass, then the quantize pass: swiglu_nvfp4's long-batch path, same bytes by contract). Swizzled scales: the rows
of the container past the output's rows are zeroed by the launcher (one memset of the last 128-row block), the
programs write every real row's scales, its padding columns included.

Layouts and weight kinds: as grouped.py (contiguous m_indices / masked masked_m; bf16/fp16, FP8 W8A8 128x128
block-scaled, MXFP4 W4A16, MXFP4 x FP8 W4A8, NVFP4 W4A16). NVFP4's fp32 global scale per expert (w_global) travels
through the activation-scale pointer, as in the plain GEMM: expert_pass multiplies both accumulators by it before
the epilogue. Contract: dispatch/reference/moe_gemm.py:moe_gemm_swiglu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out, nvfp4_effective_gs
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch
from triton_ops.blackwell import hw_fp4
from triton_ops.contract.moe_gemm import (
    check_gemm_combine,
    check_gemm_swiglu,
    check_gemm_swiglu_fp4,
    contiguous_ids,
    fp4_views,
    nvfp4_views,
)
from triton_ops.moe.align import moe_combine
from triton_ops.quant import nvfp4_quantize
from triton_ops.quant_epilogue import (
    FMT_FP8,
    FMT_MX,
    FMT_NONE,
    FMT_NV,
    alloc_epilogue_outputs,
    epilogue_geometry,
    min_block,
    nvfp4_exact_path,
    quant_epilogue,
    store_zero_rows,
)
from triton_ops.swiglu import silu_div_rn, swiglu_act

from .config import MoeGemmConfig, pick_swiglu_gemm_config, rows_per_expert
from .grouped import KIND_CODE, _grid_refusal, expert_pass, layout_args, tile_of_program
from .grouped import _launch as _gemm_launch

# the GEMM's output dtype per weight kind (None: a's dtype)
_OUT_DTYPE = {"bf16": None, "fp8": torch.bfloat16, "mxfp4": torch.bfloat16, "w4a8": torch.bfloat16, "nvfp4": None}


@triton.jit
def _gate_up_rows(offs_n, I, INTERLEAVE: tl.constexpr):
    """Weight rows of the gate and up values of output columns offs_n."""
    if INTERLEAVE == 0:
        return offs_n, offs_n + I
    else:
        gate = (offs_n // INTERLEAVE) * (2 * INTERLEAVE) + offs_n % INTERLEAVE
        return gate, gate + INTERLEAVE


@triton.jit
def _moe_gemm_swiglu_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, ids_ptr, out_ptr, scale_ptr,
                            M, I, K, E,
                            stride_ae, stride_am, stride_ase, stride_asm, stride_ask,
                            stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                            stride_om, stride_sm, stride_sg, alpha, limit, fp8_eps, gs_ptr, n_gs, scale_rows,
                            scale_cols_padded,
                            KIND: tl.constexpr, MASKED: tl.constexpr, EMULATE: tl.constexpr, F32_DOT: tl.constexpr,
                            INTERLEAVE: tl.constexpr, GPTOSS: tl.constexpr, CLAMP: tl.constexpr,
                            DIV_RN: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                            UE8M0: tl.constexpr, OUT_DTYPE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr,
                            HW_FP4: tl.constexpr):
    """Program (axis 0) = one [BLOCK_M, BLOCK_N] tile of the (rows, I) output, GROUP_M-swizzled; masked layout:
    axis 1 = expert. Every output row in range is stored once, by one epilogue after the expert passes.
    FP4 outputs: gs_ptr holds NVFP4's n_gs global scales (1: one for all rows, else one per expert); scale_rows:
    the output's rows (swizzled scales), scale_cols_padded: I / block rounded up to 4 (swizzled).
    MXFP4 weights with bf16 activations are dequantized in registers (expert_pass's DOT_SCALED off: tl.dot_scaled
    measured slower, docs/moe_gemm.md)."""
    pid_m, pid_n, rows, rows64, rmask, offs_n, nmask = tile_of_program(M, I, BLOCK_M, BLOCK_N, GROUP_M)
    n_gate, n_up = _gate_up_rows(offs_n, I, INTERLEAVE)
    col0 = pid_n * BLOCK_N
    if MASKED:
        e = tl.program_id(1)
        e64 = e.to(tl.int64)
        cnt = tl.minimum(tl.maximum(tl.load(ids_ptr + e), 0), M)
        out_rows = e64 * M + rows64  # row of the (E * max_m, I) output
        done = rows < cnt
        if pid_m * BLOCK_M < cnt:
            g, u = expert_pass(a_ptr, e64 * stride_ae + rows64 * stride_am, done, as_ptr,
                               e64 * stride_ase + rows64 * stride_asm, stride_ask, w_ptr, ws_ptr, e, n_gate, nmask,
                               n_up, K, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk,
                               KIND, EMULATE, F32_DOT, False, True, BLOCK_M, BLOCK_N, BLOCK_K)
            _swiglu_store(g, u, e, out_rows, done, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg,
                          alpha, limit, fp8_eps, gs_ptr, n_gs, scale_rows, scale_cols_padded, GPTOSS, CLAMP, DIV_RN,
                          FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, HW_FP4, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N)
    else:
        out_rows = rows64
        mi = tl.load(ids_ptr + rows, mask=rmask, other=-1)
        done = (mi >= 0) & (mi < E)  # out-of-range ids are padding: never used as an expert
        mi = tl.where(done, mi, E)
        e = tl.min(mi, 0)
        while e < E:  # one pass per expert present in the tile, in increasing id order; each stores its rows
            sel = mi == e
            g, u = expert_pass(a_ptr, rows64 * stride_am, sel, as_ptr, rows64 * stride_asm, stride_ask, w_ptr,
                               ws_ptr, e, n_gate, nmask, n_up, K, stride_we, stride_wn, stride_wse, stride_wsn,
                               stride_wsk, KIND, EMULATE, F32_DOT, False, True, BLOCK_M, BLOCK_N, BLOCK_K)
            _swiglu_store(g, u, e, out_rows, sel, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg,
                          alpha, limit, fp8_eps, gs_ptr, n_gs, scale_rows, scale_cols_padded, GPTOSS, CLAMP, DIV_RN,
                          FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, HW_FP4, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N)
            e = tl.min(tl.where(mi > e, mi, E), 0)
    # rows that are not computed: gate = up = 0, so y = 0 for every activation (silu(0) * 0, GPT-OSS's 0 * sigmoid(0)
    # * 1), i.e. what the SwiGLU op stores for its padding rows
    idle = rmask & ~done
    if tl.max(idle.to(tl.int32), 0) > 0:
        store_zero_rows(out_rows, idle, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, fp8_eps,
                        scale_cols_padded, FMT, GROUP, UE8M0, SWIZZLE, OUT_DTYPE, BLOCK_M, BLOCK_N)


@triton.jit
def _swiglu_store(gate, up, e, out_rows, row_in, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, alpha,
                  limit, fp8_eps, gs_ptr, n_gs, scale_rows, scale_cols_padded, GPTOSS: tl.constexpr,
                  CLAMP: tl.constexpr, DIV_RN: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
                  UE8M0: tl.constexpr, MX_RCEIL: tl.constexpr, SWIZZLE: tl.constexpr, HW_FP4: tl.constexpr,
                  OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue of expert e's rows in row_in: the plain GEMM's one rounding of gate / up to OUT_DTYPE, the
    SwiGLU op's math on the rounded values, then its store (plain, FP8 1xGROUP, MXFP4 or NVFP4: quant_epilogue)."""
    g = cast_out(gate, OUT_DTYPE, EMULATE).to(tl.float32)
    u = cast_out(up, OUT_DTYPE, EMULATE).to(tl.float32)
    y = swiglu_act(g, u, alpha, limit, GPTOSS, CLAMP, DIV_RN, OUT_DTYPE, EMULATE)
    gs = tl.zeros([BLOCK_M], tl.float32)
    gs_exact = 0
    if FMT == FMT_NV:  # the expert's global scale (or the one for all rows), as swiglu_nvfp4 loads it
        gs += nvfp4_effective_gs(tl.load(gs_ptr + tl.minimum(e, n_gs - 1)))
        gs_exact = nvfp4_exact_path(gs, row_in)
    rows = out_rows
    if SWIZZLE:
        # swizzled scales: quant_epilogue writes zero scale bytes on every row below its bound that is not in
        # row_in; rows of the tile stored by another expert's pass are moved to the bound (no scale, no code)
        rows = tl.where(row_in, out_rows, scale_rows)
    quant_epilogue(y, rows, row_in, col0, I, out_ptr, stride_om, scale_ptr, stride_sm, stride_sg, gs, gs_exact,
                   scale_rows, 0, scale_cols_padded, fp8_eps,
                   FMT, GROUP, UE8M0, MX_RCEIL, SWIZZLE, OUT_DTYPE, EMULATE, BLOCK_M, BLOCK_N, HW_FP4)


# ---------------------------------------------------------------------------------------------- launcher


def _launch(kind, a, a_scale, w, w_scale, m_indices, masked_m, interleave, activation, alpha, limit, fmt,
            group=128, quant_eps=1e-10, ue8m0=False, column_major=False, config=None, w_global=None,
            rounding="floor", swizzle=False, global_scale=None):
    """Operands already checked; 1-byte formats travel as uint8 views. Returns out (FMT_NONE), (codes, scales)
    (FP8, MXFP4) or (codes, scales, global scale) (NVFP4, global_scale given: a copy of it, swiglu_nvfp4's shapes).
    w_global: NVFP4 weights' fp32 (E,) global scales (read through the activation-scale pointer, as
    grouped._launch)."""
    masked = masked_m is not None
    e, i = w.shape[0], w.shape[1] // 2
    k = a.shape[-1]
    rows = a.shape[1] if masked else a.shape[0]
    out_dtype = _OUT_DTYPE[kind] or a.dtype
    lead = tuple(a.shape[:-1])
    dev = a.device
    out, scales = alloc_epilogue_outputs(fmt, lead, i, out_dtype, group, column_major, swizzle, dev)
    results = out if fmt == FMT_NONE else (out, scales)
    gs_n = 1 if global_scale is None else global_scale.numel()
    if fmt == FMT_NV:
        gs_out = global_scale.float().reshape(() if gs_n == 1 else (gs_n,)).clone()
        results = (out, scales, gs_out)
    if out.numel() == 0:
        if fmt in (FMT_MX, FMT_NV):
            scales.view(torch.uint8).zero_()
        return results
    flat_rows = out.numel() // out.shape[-1]
    need = min_block(fmt, group) if fmt != FMT_NONE else 16
    cfg = config or pick_swiglu_gemm_config(kind, rows_per_expert(rows, e, masked), i, k, dev, need)
    fmt_name = "FP8 group" if fmt == FMT_FP8 else "MXFP4" if fmt == FMT_MX else "NVFP4"
    reason = cfg.refusal(kind) or (f"{fmt_name} output needs block_n a multiple of {need}, got {cfg.block_n}"
                                   if fmt != FMT_NONE and cfg.block_n % need else None)
    if reason:
        raise ValueError(f"moe_gemm_swiglu ({kind}): config {cfg}: {reason}")
    geo = epilogue_geometry(fmt, scales, flat_rows, i, group, swizzle)
    if swizzle and flat_rows % 128:  # the container's rows past the output's: zero bytes (GEMMs read them)
        scales.view(torch.uint8).view(-1)[flat_rows // 128 * 128 * geo.scale_cols_padded:].zero_()
    ids, strides = layout_args(a, a_scale, w, w_scale, m_indices, masked_m)
    grid = (cdiv(rows, cfg.block_m) * cdiv(i, cfg.block_n), e if masked else 1)
    dummy = w  # never read when the kind has no scales
    if w_global is not None:
        a_scale = w_global.contiguous()  # after layout_args: no activation-scale strides for this kind
    out_arg = out.view(torch.uint8) if fmt == FMT_FP8 else out
    scale_arg = scales.view(torch.uint8) if fmt in (FMT_MX, FMT_NV) else scales
    stride_om = i // 2 if fmt in (FMT_MX, FMT_NV) else i
    # the kernel reads the given scales at unit stride (a strided per-expert view would be misread)
    gs_arg = dummy if global_scale is None else global_scale.reshape(-1).contiguous()
    launch(_moe_gemm_swiglu_kernel, grid,
        a, dummy if a_scale is None else a_scale, w, dummy if w_scale is None else w_scale, ids, out_arg, scale_arg,
        rows, i, k, e, *strides, stride_om, geo.stride_sm, geo.stride_sg,
        float(alpha), float(limit if limit is not None else 0.0), float(quant_eps),
        gs_arg, gs_n, flat_rows, geo.scale_cols_padded,
        KIND=KIND_CODE[kind], MASKED=masked, EMULATE=emulate_formats(dev), F32_DOT=dev.type != "cuda",
        INTERLEAVE=interleave, GPTOSS=activation == "gptoss", CLAMP=limit is not None,
        DIV_RN=silu_div_rn(out_dtype), FMT=fmt, GROUP=group, UE8M0=ue8m0, OUT_DTYPE=TL_DTYPE[out_dtype],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        MX_RCEIL=rounding == "rceil", SWIZZLE=swizzle, HW_FP4=fmt in (FMT_MX, FMT_NV) and hw_fp4(dev),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return results


def _operands(weights, a, a_scale, w, w_scale):
    """The uint8 views the kernel reads (FP8 codes, FP4 pairs / E8M0 / E4M3 scales)."""
    if weights == "fp8":
        return a.view(torch.uint8), a_scale, w.view(torch.uint8), w_scale
    if weights == "nvfp4":
        return (a, a_scale, *nvfp4_views(w, w_scale))
    if weights in ("mxfp4", "w4a8"):
        w, w_scale = fp4_views(w, w_scale)
    if weights == "w4a8":
        a = a.view(torch.uint8)
    return a, a_scale, w, w_scale


# ---------------------------------------------------------------------------------------------- supports


def supports_moe_gemm_swiglu(a, a_scale, w, w_scale, m_indices, masked_m, weights, *rest) -> str | None:
    if weights == "bf16" and a.dtype not in (torch.bfloat16, torch.float16):
        return f"activations {a.dtype} are not bf16 / fp16"
    if weights == "fp8" and (a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn):
        return f"a {a.dtype} / w {w.dtype}: only E4M3 (float8_e4m3fn) is implemented"
    if weights == "w4a8" and a.dtype != torch.float8_e4m3fn:
        return f"activations {a.dtype}: only E4M3 (float8_e4m3fn) is implemented"
    if weights == "nvfp4" and a.dtype not in (torch.bfloat16, torch.float16):
        return f"activations {a.dtype} are not bf16 / fp16"
    return _grid_refusal(w, masked_m)


# ---------------------------------------------------------------------------------------------- entries


def moe_gemm_swiglu(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                    w_global=None, *, config: MoeGemmConfig | None = None):
    """GEMM1 (weights "bf16" / "fp8" / "mxfp4" / "w4a8" / "nvfp4", operands as moe_gemm_<weights> takes them, w
    (E, 2I, K); w_global: NVFP4's fp32 (E,) global scales) with SwiGLU: (rows, I) in the GEMM's output dtype (a's
    for bf16/fp16 and NVFP4, else bf16)."""
    check_gemm_swiglu("moe_gemm_swiglu", weights, a, a_scale, w, w_scale, m_indices, masked_m, interleave,
                      activation, alpha, limit, w_global=w_global)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch(weights, *_operands(weights, a, a_scale, w, w_scale), m_indices, masked_m, interleave,
                   activation, alpha, limit, FMT_NONE, config=config, w_global=w_global)


def moe_gemm_swiglu_fp8_group(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                              limit, group_size, quant_eps, ue8m0, column_major, w_global=None, *,
                              config: MoeGemmConfig | None = None):
    """moe_gemm_swiglu, its output quantized to FP8 E4M3 1x group_size groups: (codes, fp32 scales) as
    fp8_group_quantize writes them (column_major: the TMA-aligned layout; ue8m0: power-of-two scales)."""
    check_gemm_swiglu("moe_gemm_swiglu_fp8_group", weights, a, a_scale, w, w_scale, m_indices, masked_m,
                      interleave, activation, alpha, limit, group_size, quant_eps, w_global=w_global)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    return _launch(weights, *_operands(weights, a, a_scale, w, w_scale), m_indices, masked_m, interleave,
                   activation, alpha, limit, FMT_FP8, group=group_size, quant_eps=quant_eps, ue8m0=ue8m0,
                   column_major=column_major, config=config, w_global=w_global)


def _swiglu_fp4(quant, a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                qarg, swizzle, w_global, config):
    """moe_gemm_swiglu_<quant>; qarg: MXFP4's rounding or NVFP4's global scale."""
    check_gemm_swiglu_fp4(quant, a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                          limit, qarg, swizzle, w_global)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    args = (weights, *_operands(weights, a, a_scale, w, w_scale), m_indices, masked_m, interleave, activation, alpha,
            limit)
    kw = dict(config=config, w_global=w_global)
    if quant == "mxfp4":
        return _launch(*args, FMT_MX, rounding=qarg, swizzle=swizzle, **kw)
    if qarg is None:  # computed global scale: the float output, then the quantizer's amax and quantize passes
        return nvfp4_quantize(_launch(*args, FMT_NONE, **kw), None, swizzle)
    return _launch(*args, FMT_NV, swizzle=swizzle, global_scale=qarg, **kw)


def moe_gemm_swiglu_mxfp4(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                          rounding, swizzle, w_global=None, *, config: MoeGemmConfig | None = None):
    """moe_gemm_swiglu, its output quantized to MXFP4 in the same pass: (codes uint8 (rows, I/2), E8M0 scales) as
    swiglu_mxfp4 writes them (rounding "floor" / "rceil"; swizzle: the 128x4 container, else (rows, I/32))."""
    return _swiglu_fp4("mxfp4", a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                       limit, rounding, swizzle, w_global, config)


def moe_gemm_swiglu_nvfp4(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha, limit,
                          global_scale, swizzle, w_global=None, *, config: MoeGemmConfig | None = None):
    """moe_gemm_swiglu, its output quantized to NVFP4: (codes, E4M3 scales, fp32 global scale) as swiglu_nvfp4
    writes them. global_scale: a scalar or one per expert (E,): quantized in the GEMM's epilogue; None (amax of the
    whole output / 2688): the float output, then the NVFP4 quantizer (its amax pass and its quantize pass)."""
    return _swiglu_fp4("nvfp4", a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation, alpha,
                       limit, global_scale, swizzle, w_global, config)


def supports_moe_gemm_swiglu_fp8_group(a, a_scale, w, w_scale, m_indices, masked_m, weights, interleave, activation,
                                       alpha, limit, group_size, *rest) -> str | None:
    if group_size < 16 or group_size & (group_size - 1):
        return f"group_size={group_size} is not a power of two >= 16 (a group is a slice of the column tile)"
    return supports_moe_gemm_swiglu(a, a_scale, w, w_scale, m_indices, masked_m, weights)


# ---------------------------------------------------------------------- GEMM2 scattered into token order + combine


def supports_moe_gemm_combine(a, a_scale, w, w_scale, m_indices, masked_m, weights, *rest) -> str | None:
    return supports_moe_gemm_swiglu(a, a_scale, w, w_scale, m_indices, masked_m, weights)


def moe_gemm_combine(a, a_scale, w, w_scale, m_indices, masked_m, weights, src_rows, inv_rows, topk_weights, shared,
                     out_dtype, w_global=None, *, config: MoeGemmConfig | None = None):
    """GEMM2 whose epilogue stores each row at its entry t * k + j (src_rows) of a (T * k, N) buffer in token
    order (rounded to the GEMM's dtype, as moe_gemm_<weights> rounds it), then the combine over each token's k
    slots in slot order (fp32, weights applied there, no atomics): bytes = moe_gemm_<weights> -> moe_combine.
    Slots without a row (inv_rows -1: not local or dropped) are never read, so the buffer needs no clearing."""
    check_gemm_combine("moe_gemm_combine", weights, a, a_scale, w, w_scale, m_indices, masked_m, src_rows, inv_rows,
                       topk_weights, shared, out_dtype, w_global)
    m_indices, masked_m = contiguous_ids(m_indices, masked_m)
    t, k = inv_rows.shape
    a, a_scale, w, w_scale = _operands(weights, a, a_scale, w, w_scale)
    buf = _gemm_launch(weights, a, a_scale, w, w_scale, m_indices, masked_m, None, _OUT_DTYPE[weights] or a.dtype,
                       config, dst_rows=src_rows, n_dst=t * k, w_global=w_global)
    return moe_combine(buf, inv_rows, topk_weights, shared, out_dtype, token_order=True)
