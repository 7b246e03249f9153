"""Reference SwiGLU (plain / clamped / GPT-OSS), optional MoE row layouts, optional quantized output.

Input x [..., 2I] holds gate and up:
  interleave == 0: concatenated, gate = x[..., :I], up = x[..., I:]
  interleave == g: chunks of g columns alternate gate, up (g = 1: GPT-OSS even/odd; g = 8: the seed's
                   fused-GEMM layout); output column c reads chunk c // g.

Math in fp32 (g = fp32(gate), u = fp32(up)), then ONE rounding to out_dtype:
  limit given:  g = min(g, limit); u = clamp(u, -limit, limit)       (NaN propagates)
  "silu":       y = (g / (1 + exp(-g))) * u
  "gptoss":     y = (g / (1 + exp(-alpha * g))) * (u + 1)

exp is not correctly rounded on any backend (torch CPU, torch CUDA and Triton's exp all differ in the last
fp32 bit), so the float output is a tolerance contract (<= 1 ulp of out_dtype, rarely), and a quantized
output is defined as the foundation quantizer applied to the backend's own rounded y: bytes are exact
given y. See docs/swiglu.md.

MoE layouts (rows that hold no token are "padding": never read; y is zero there, so the quantized bytes
are what the quantizer gives for zeros (codes 0; scales 0, or eps/448 for FP8 groups); with per-group
NVFP4 global scales a padding row's scales are zero bytes whatever the scales hold):
  contiguous: x [M, 2I] with expert_ids [M] (int32, -1 = padding row)
  masked:     x [G, max_M, 2I] with masked_m [G]; rows m >= masked_m[g] of group g are padding
NVFP4 global scale: None (computed: amax of y over all rows / 2688; plain layout only), a scalar, or one
per expert / group ([E]) for the MoE layouts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import quant as Q
from .rmsnorm import quantize_output

ACTIVATIONS = ("silu", "gptoss")


def split_gate_up(x: Tensor, interleave: int) -> tuple[Tensor, Tensor]:
    two_i = x.shape[-1]
    i = two_i // 2
    if interleave == 0:
        return x[..., :i], x[..., i:]
    chunks = x.reshape(*x.shape[:-1], two_i // (2 * interleave), 2, interleave)
    return chunks[..., 0, :].reshape(*x.shape[:-1], i), chunks[..., 1, :].reshape(*x.shape[:-1], i)


def row_valid(x: Tensor, expert_ids: Tensor | None, masked_m: Tensor | None) -> Tensor | None:
    """Bool [*lead] marking rows that hold tokens, or None when every row does."""
    if expert_ids is not None:
        return expert_ids.reshape(x.shape[:-1]) >= 0
    if masked_m is not None:
        m = torch.arange(x.shape[1], device=x.device)
        return m[None, :] < masked_m.to(x.device)[:, None]
    return None


def swiglu(x: Tensor, interleave: int = 0, activation: str = "silu", alpha: float = 1.702,
           limit: float | None = None, expert_ids: Tensor | None = None, masked_m: Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> Tensor:
    """y [..., I] in out_dtype (default x.dtype); padding rows are zeros."""
    out_dtype = out_dtype or x.dtype
    gate, up = split_gate_up(x, interleave)
    g, u = gate.float(), up.float()
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    if activation == "silu":
        y = (g / (1.0 + torch.exp(-g))) * u
    elif activation == "gptoss":
        y = (g / (1.0 + torch.exp(-(alpha * g)))) * (u + 1.0)
    else:
        raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    valid = row_valid(x, expert_ids, masked_m)
    if valid is not None:
        y = torch.where(valid[..., None], y, torch.zeros_like(y))
    return y.to(out_dtype)


def row_groups(y: Tensor, expert_ids: Tensor | None, masked_m: Tensor | None) -> Tensor:
    """Group (expert) index of every row as int64 [rows]; -1 on padding rows."""
    if expert_ids is not None:
        return expert_ids.reshape(-1).long()
    if masked_m is not None:
        g = torch.arange(y.shape[0], device=y.device)[:, None].expand(y.shape[0], y.shape[1])
        valid = row_valid(y, None, masked_m)
        return torch.where(valid, g, -1).reshape(-1).long()
    return torch.zeros(y.shape[:-1].numel(), dtype=torch.long, device=y.device)


def nvfp4_per_group(y: Tensor, global_scale: Tensor, groups: Tensor, swizzle: bool):
    """NVFP4 with one global scale per row group: the foundation primitive on each group's rows, linear
    scales scattered back, then the foundation swizzle of the whole matrix. Padding rows (and rows whose group
    has no per-group scale): zero bytes."""
    lead, k = y.shape[:-1], y.shape[-1]
    y2 = y.reshape(-1, k)
    codes = torch.zeros(y2.shape[0], k // 2, dtype=torch.uint8, device=y.device)
    scales = torch.zeros(y2.shape[0], k // Q.NVFP4_BLOCK, dtype=torch.uint8, device=y.device)
    gs = global_scale.reshape(-1).float()
    for e in torch.unique(groups).tolist():
        if e < 0 or (gs.numel() > 1 and e >= gs.numel()):
            continue  # padding rows, and expert ids past the per-expert scales (masked: zero bytes, as the kernels)
        sel = groups == e
        c, s, _ = Q.nvfp4_quantize(y2[sel], gs[e if gs.numel() > 1 else 0], False)
        codes[sel], scales[sel] = c, s.view(torch.uint8)
    scales = Q.swizzle_scales_128x4(scales) if swizzle else scales.reshape(*lead, k // Q.NVFP4_BLOCK)
    gs_out = global_scale.float().reshape(()) if global_scale.numel() == 1 else global_scale.float().reshape(-1)
    return codes.reshape(*lead, k // 2), scales.view(torch.float8_e4m3fn), gs_out.clone()


def swiglu_quant(x: Tensor, interleave: int, activation: str, alpha: float, limit: float | None,
                 expert_ids: Tensor | None, masked_m: Tensor | None, out_dtype: torch.dtype | None,
                 quant: str, **kw) -> tuple:
    y = swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)
    return quantize_swiglu_output(y, expert_ids, masked_m, quant, **kw)


def quantize_swiglu_output(y: Tensor, expert_ids: Tensor | None, masked_m: Tensor | None, quant: str,
                           **kw) -> tuple:
    """The contract for a quantized SwiGLU output, given the (rounded) float output y."""
    gs = kw.get("global_scale")
    moe = expert_ids is not None or masked_m is not None
    if quant == "nvfp4" and gs is not None and (gs.numel() > 1 or moe):
        return nvfp4_per_group(y, gs, row_groups(y, expert_ids, masked_m), kw.get("swizzle", False))
    return quantize_output(y, quant, **kw)


# ----------------------------------------------------------------- backend entry points (dispatch table)
# Same signatures as the torch ops in dispatch/ops/rmsnorm.py, minus `backend`.


def swiglu_op(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype):
    return swiglu(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype)


def swiglu_fp8_group(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, group_size,
                     quant_eps, ue8m0, column_major):
    return swiglu_quant(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, "fp8_group",
                        group_size=group_size, quant_eps=quant_eps, ue8m0=ue8m0, column_major=column_major)


def swiglu_mxfp4(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, rounding, swizzle):
    return swiglu_quant(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, "mxfp4",
                        rounding=rounding, swizzle=swizzle)


def swiglu_nvfp4(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, global_scale,
                 swizzle):
    return swiglu_quant(x, interleave, activation, alpha, limit, expert_ids, masked_m, out_dtype, "nvfp4",
                        global_scale=global_scale, swizzle=swizzle)
