"""DeepSeek-V3.2 sparse-attention indexer scores (Triton). Contract: dispatch/reference/attention.py:mla_index_scores.

    index_scores[b, s, t] = sum_h weights[b, s, h] * relu(softmax_scale * (q[b, s, h, :] . k[b, t, :]))

then -inf where `visible[b, s, t]` is False. q (B, S, H, D) and k (B, T, D) bf16 / fp16 / fp32, weights (B, S, H)
fp32, out (B, S, T) fp32. The torch forms (transformers' `DeepseekV32Indexer`) materialize the per-head scores
(B, S, H, T) in fp32 before the weighted sum over heads; here they stay in registers:

* a program owns one sequence, a block of BLOCK_S query rows and a block of BLOCK_T keys. Its key tile
  (D x BLOCK_T) is loaded once and serves every head: for each head h, one `tl.dot` of the (BLOCK_S x D) slice of
  q at head h with it, fp32 accumulation, then relu(acc * scale) * w[:, h] added to the fp32 scores. Products of
  16-bit values are exact in fp32, so the tensor-core dot gives the fp32 torch form's values up to summation order.
* the visibility tile is read first: a tile with no visible pair runs no head (a causal prompt's tiles above the
  diagonal) and is stored as -inf.
* fp32 inputs take IEEE fp32 dots (no TF32 rounding of the operands). Interpreter: its tl.dot on bf16 operands is
  wrong (decode.py), so there the dots run on fp32 copies of the same values.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops._launch import cdiv, launch, next_pow2
from triton_ops.contract.attention import check_mla_index_scores

MAX_HEAD_DIM = 256  # the key tile (D x BLOCK_T) is held for the whole head loop


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def _index_scores_kernel(q_ptr, k_ptr, w_ptr, vis_ptr, out_ptr, S, T, H, D, scale,
                         q_sb, q_ss, q_sh, k_sb, k_st, w_sb, w_ss, w_sh, v_sb, v_ss, v_st, o_sb, o_ss,
                         BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                         HAS_VISIBLE: tl.constexpr, DOT_F32: tl.constexpr):
    # grid (key blocks, query-row blocks, B): neighbouring programs share their query rows' q slices in L2
    b = tl.program_id(2).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < S
    t_ok = t < T
    st_ok = s_ok[:, None] & t_ok[None, :]
    if HAS_VISIBLE:
        vis = tl.load(vis_ptr + b * v_sb + s[:, None].to(tl.int64) * v_ss + t[None, :] * v_st, mask=st_ok, other=0)
        keep = (vis != 0) & st_ok
    else:
        keep = st_ok
    # no visible pair in the tile: no head runs, every score is -inf
    heads = tl.where(tl.max(tl.max(keep.to(tl.int32), 1), 0) > 0, H, 0)
    kt = tl.load(k_ptr + b * k_sb + t[None, :].to(tl.int64) * k_st + d[:, None],
                 mask=t_ok[None, :] & (d < D)[:, None], other=0.0)
    if DOT_F32:
        kt = kt.to(tl.float32)
    q_rows = q_ptr + b * q_sb + s[:, None].to(tl.int64) * q_ss + d[None, :]
    q_mask = s_ok[:, None] & (d < D)[None, :]
    w_rows = w_ptr + b * w_sb + s.to(tl.int64) * w_ss
    scores = tl.zeros((BLOCK_S, BLOCK_T), dtype=tl.float32)
    for h in range(0, heads):
        q = tl.load(q_rows + h * q_sh, mask=q_mask, other=0.0)
        if DOT_F32:
            acc = tl.dot(q.to(tl.float32), kt, input_precision="ieee")
        else:
            acc = tl.dot(q, kt)
        w = tl.load(w_rows + h * w_sh, mask=s_ok, other=0.0)
        scores += tl.maximum(acc * scale, 0.0) * w[:, None]
    scores = tl.where(keep, scores, float("-inf"))
    tl.store(out_ptr + b * o_sb + s[:, None].to(tl.int64) * o_ss + t[None, :], scores, mask=st_ok)


# ---------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class IndexScoresConfig:
    block_s: int  # query rows per program (the M side of each head's dot; >= 16)
    block_t: int  # keys per program (the N side; >= 16)
    num_warps: int
    num_stages: int  # software pipelining of the head loop's q / weight loads


def index_scores_config(s: int, t: int, itemsize: int, device: torch.device) -> IndexScoresConfig:
    """GPU: 64 query rows x 128 keys per program, 8 warps: the fp32 score and dot accumulators (2 x 32 KB) spread
    over 256 threads (64 registers each), the key tile (128 x 128 bf16, 32 KB) read once for all H heads, so a
    program does H x 64 x 128 x D x 2 flops per 32 KB of keys. Two stages overlap the next head's q slice with
    this head's dot. Short sequences take the smallest power-of-two tiles that cover them (16 at least: the dot's
    minimum) and 4 warps. fp32 inputs (FFMA dots, operands twice as wide) take 64 keys: at 128 the sm_90a compile
    spills (8 warps: 8 bytes; 64 keys at 4 warps: 280 bytes; 64 keys at 8 warps: none, 158 registers).
    Interpreter: up to 64 x 256 (it pays per program and per loop step, not per element)."""
    cap_s, cap_t = (64, 256) if device.type == "cpu" else (64, 128 if itemsize <= 2 else 64)
    block_s = min(max(16, next_pow2(s)), cap_s)
    block_t = min(max(16, next_pow2(t)), cap_t)
    num_warps = 8 if (block_s, block_t) == (64, cap_t) and device.type != "cpu" else 4
    return IndexScoresConfig(block_s, block_t, num_warps, 2)


# ---------------------------------------------------------------------------------------------- checks


def supports_mla_index_scores(q, k, weights, softmax_scale, visible) -> str | None:
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head dim {q.shape[-1]} > {MAX_HEAD_DIM} (the key tile is held in registers for every head)"
    return None


# ----------------------------------------------------------------------------------------------- entry


def mla_index_scores(q, k, weights, softmax_scale, visible, cfg: IndexScoresConfig | None = None):
    """(B, S, T) fp32 index scores; see the module docstring. visible None: every key is visible. Inputs may be
    strided (q and k with a non-unit last-dim stride are made contiguous)."""
    check_mla_index_scores(q, k, weights, softmax_scale, visible)
    bsz, s, h, d = q.shape
    t = k.shape[1]
    out = torch.empty(bsz, s, t, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    vis = out if visible is None else visible.view(torch.uint8)  # (not read without HAS_VISIBLE)
    cfg = cfg or index_scores_config(s, t, q.element_size(), q.device)
    launch(_index_scores_kernel, (cdiv(t, cfg.block_t), cdiv(s, cfg.block_s), bsz),
        q, k, weights, vis, out, s, t, h, d, float(softmax_scale),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        weights.stride(0), weights.stride(1), weights.stride(2), vis.stride(0), vis.stride(1), vis.stride(2),
        out.stride(0), out.stride(1),
        BLOCK_S=cfg.block_s, BLOCK_T=cfg.block_t, BLOCK_D=max(16, next_pow2(d)), HAS_VISIBLE=visible is not None,
        DOT_F32=q.device.type == "cpu" or q.dtype == torch.float32,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
