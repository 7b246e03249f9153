"""Merge partial attention results by their log-sum-exp (Triton). Contract:
dispatch/reference/attention.py:merge_attn_states.

Two parts computed over disjoint key sets, (out_a, lse_a) and (out_b, lse_b), out (T, H, D), lse (T, H) fp32
(natural log), combine to lse = log(e^lse_a + e^lse_b) and out = out_a e^(lse_a - lse) + out_b e^(lse_b - lse).
A part with lse = -inf (it saw no key) contributes nothing, whatever its out holds; both -inf gives out 0 and
lse -inf. A part with lse NaN or +inf (no softmax gives either: a corrupt part) makes its row's out and lse NaN,
never hidden behind the other part. `lse_weights` is the one statement of these rules; the split-KV reduction of
decode.py uses it too.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2
from triton_ops.contract.attention import check_merge_attn_states


@triton.jit
def lse_weights(lse):
    """lse [R, S] fp32 of S parts per row -> (w [R, S], total [R]): w = e^(lse - total), the share of each part
    in the merged softmax (0 for a part at -inf), total = log(sum e^lse), -inf where every part is -inf (then
    every w is 0). A row with a part at NaN or +inf gets NaN weights and total. The row max is subtracted first,
    so no exponent overflows."""
    corrupt = tl.max(((lse != lse) | (lse == float("inf"))).to(tl.int32), 1) > 0
    lse = tl.where(corrupt[:, None], float("-inf"), lse)  # the NaN is put back below, not computed with
    m = tl.max(lse, 1)
    safe = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(lse - safe[:, None])  # -inf parts -> 0
    den = tl.sum(e, 1)
    ok = den > 0
    w = tl.where(ok[:, None], e / tl.where(ok, den, 1.0)[:, None], 0.0)
    total = tl.where(ok, tl.log(tl.where(ok, den, 1.0)) + safe, float("-inf"))
    return tl.where(corrupt[:, None], float("nan"), w), tl.where(corrupt, float("nan"), total)


@triton.jit
def weighted_sum(w, out):
    """sum over parts of w [R, S] x out [R, S, D] -> [R, D]; a part of weight 0 adds exactly 0 (its out is
    never multiplied, so a NaN or Inf there cannot leak); a NaN weight (a corrupt row) gives NaN."""
    return tl.sum(tl.where(w[:, :, None] != 0, out, 0.0) * w[:, :, None], 1)


# ------------------------------------------------------------------------------------------------ kernel


@triton.jit
def _merge_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, out_ptr, lse_ptr, T, H, D,
                  oa_st, oa_sh, ob_st, ob_sh, la_st, la_sh, lb_st, lb_sh,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    # grid (row blocks, D blocks); row r = t * H + h, split once per row. The two parts are joined into a
    # trailing axis of 2 so the merge is the same [R, S] rule as the split-KV reduction.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = r < T * H
    t = r // H
    h = r % H
    la = tl.load(la_ptr + t * la_st + h * la_sh, mask=rmask, other=float("-inf"))
    lb = tl.load(lb_ptr + t * lb_st + h * lb_sh, mask=rmask, other=float("-inf"))
    w, lse = lse_weights(tl.join(la, lb))
    m = rmask[:, None] & (d < D)[None, :]
    oa = tl.load(oa_ptr + (t * oa_st + h * oa_sh)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + (t * ob_st + h * ob_sh)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    o = weighted_sum(w, tl.permute(tl.join(oa, ob), (0, 2, 1)))
    tl.store(out_ptr + (r * D)[:, None] + d[None, :], cast_out(o, OUT_DTYPE, EMULATE), mask=m)
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + r, lse, mask=rmask)


# ---------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class MergeConfig:
    block_r: int  # (token, head) rows per program
    block_d: int  # head-dim columns per program (a power of two)
    num_warps: int


def merge_config(rows: int, d: int, device: torch.device) -> MergeConfig:
    """GPU: ~2K output elements per program (a decode step merges a few thousand rows: enough programs to
    spread over the SMs; 2 parts x 2K fp32 inputs fit registers at 4 warps). Interpreter: up to 32K (it pays
    per program)."""
    target = 32768 if device.type == "cpu" else 2048
    block_d = min(next_pow2(d), target)
    block_r = max(1, min(next_pow2(rows), target // block_d))
    return MergeConfig(block_r, block_d, 4)


# ---------------------------------------------------------------------------------------------- checks


def supports_merge_attn_states(out_a, lse_a, out_b, lse_b) -> str | None:
    for name, o in (("out_a", out_a), ("out_b", out_b)):
        if o.dtype not in TL_DTYPE:
            return f"{name} dtype {o.dtype} is not bf16, fp16 or fp32"
    return None


# ----------------------------------------------------------------------------------------------- entry


def merge_attn_states(out_a, lse_a, out_b, lse_b, cfg: MergeConfig | None = None):
    """(out (T, H, D) in out_a's dtype, lse (T, H) fp32); see the module docstring. Inputs may be strided
    views (the last dim of out is made contiguous if it is not)."""
    check_merge_attn_states(out_a, lse_a, out_b, lse_b)
    t, h, d = out_a.shape
    out = torch.empty(t, h, d, dtype=out_a.dtype, device=out_a.device)
    lse = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    if t * h == 0:
        return out, lse
    oa = out_a if out_a.stride(-1) == 1 else out_a.contiguous()
    ob = out_b if out_b.stride(-1) == 1 else out_b.contiguous()
    cfg = cfg or merge_config(t * h, d, out_a.device)
    launch(_merge_kernel, (cdiv(t * h, cfg.block_r), cdiv(max(d, 1), cfg.block_d)),
        oa, lse_a, ob, lse_b, out, lse, t, h, d, oa.stride(0), oa.stride(1), ob.stride(0), ob.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        BLOCK_R=cfg.block_r, BLOCK_D=cfg.block_d, OUT_DTYPE=TL_DTYPE[out_a.dtype],
        EMULATE=emulate_formats(out_a.device), num_warps=cfg.num_warps)
    return out, lse
