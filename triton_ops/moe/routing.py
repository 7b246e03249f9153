"""MoE router (Triton): logits [T, E] -> top-k expert ids + weights, one launch.

One program owns BLOCK_T whole rows (all E experts of a token in registers), so selection needs no
cross-program step: k rounds of (row max, lowest index holding it), grouped top-k first when asked.
Contract: dispatch/reference/moe.py (moe_route, moe_hash_route).

Small-M: the grid is cdiv(T, BLOCK_T) and never depends on E; up to T = 2048 one row per program (T programs),
each a single CTA doing its reductions along the row only (no cross-CTA reduction). Per row: softmax stats (if
softmax), G group scores, then k rounds of ONE int64 max over (key bits, -index);
weights come from re-reading the k chosen logits (see _route_kernel).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .._launch import cdiv, launch, next_pow2

SCORING_CODE = {"softmax": 0, "sigmoid": 1, "sqrt_softplus": 2}
BIG = tl.constexpr(1 << 30)  # globals used inside @triton.jit must be constexpr (compiled mode rejects plain ints)


@triton.jit
def _log1p(u):
    """log(1 + u) accurate for small u without a log1p instruction (Goldberg's trick): the rounding error
    of 1 + u is divided back out. Exact 0 for u = 0."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * tl.math.div_rn(u, w - 1.0))


@triton.jit
def _score_of(x, m, den, SCORING: tl.constexpr):
    """fp32 score of fp32 logits, elementwise (softmax: m = row max, den = sum of exp(x - m) over the row). The
    one formula both the full rows (bias keys, softmax sums) and the k selected logits go through, so a weight
    computed from a re-read logit is bit-identical to the score the row held."""
    if SCORING == 0:
        s = tl.math.div_rn(tl.exp(x - m), den)
    elif SCORING == 1:
        s = tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))
    else:
        # torch softplus: x above 20 passes through; else log1p(exp(x)), written stably as
        # max(x, 0) + log1p(exp(-|x|)).
        sp = tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x)))
        s = tl.sqrt_rn(tl.where(x > 20.0, x, sp))
    return s


@triton.jit
def _softmax_stats(x, valid):
    """Row max and sum of exp(x - max) over the valid lanes (invalid lanes hold -inf)."""
    m = tl.max(x, 1)
    ex = tl.where(valid, tl.exp(x - m[:, None]), 0.0)
    return m, tl.sum(ex, 1)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, tok_ptr, table_ptr, ids_ptr, w_ptr,
    T, E, stride_l, group_size, scaling, VOCAB,
    K: tl.constexpr, KP: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
    HASH: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, TOPG: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    valid = rmask[:, None] & (cols < E)[None, :]
    row_ptr = logits_ptr + rows.to(tl.int64) * stride_l
    x = tl.load(row_ptr[:, None] + cols[None, :], mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.zeros([BLOCK_T], tl.float32)
    den = tl.full([BLOCK_T], 1.0, tl.float32)
    if SCORING == 0:
        m, den = _softmax_stats(x, valid)
    kcols = tl.arange(0, KP)
    ids = tl.zeros([BLOCK_T, KP], tl.int32)
    if HASH:
        # Out-of-range token ids read nothing (all k slots -1); table entries are range-checked at their own
        # width (int64 entries too) before narrowing: outside [0, E) -> -1. Weight 0 below for every -1 slot.
        tok = tl.load(tok_ptr + rows, mask=rmask, other=-1).to(tl.int64)
        kmask = rmask[:, None] & (kcols < K)[None, :] & ((tok >= 0) & (tok < VOCAB))[:, None]
        raw = tl.load(table_ptr + tok[:, None] * K + kcols[None, :], mask=kmask, other=-1)
        ids = tl.where((raw >= 0) & (raw < E), raw, -1).to(tl.int32)
    else:
        if HAS_BIAS:
            b = tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)
            key = _score_of(x, m[:, None], den[:, None], SCORING) + b[None, :]
        else:
            key = x  # every scoring is monotone in the logit: select on it (exact, no rounding ties)
        key = tl.where(key != key, float("-inf"), key)
        key = tl.where(valid, key, float("-inf"))
        avail = valid
        if G > 1:
            grp = cols // group_size
            gcols = tl.arange(0, GP)
            gscore = tl.full([BLOCK_T, GP], float("-inf"), tl.float32)
            for g in tl.static_range(G):  # a [rows, G, E/G] reshape + one reduction compiles to 5x the SASS and spills
                in_g = valid & (grp == g)[None, :]
                m1 = tl.max(tl.where(in_g, key, float("-inf")), 1)
                if HAS_BIAS:  # top-2 sum: drop the first (lowest-index) max, take the max again
                    i1 = tl.min(tl.where(in_g & (key == m1[:, None]), cols[None, :], BIG), 1)
                    m2 = tl.max(tl.where(in_g & (cols[None, :] != i1[:, None]), key, float("-inf")), 1)
                    m1 = m1 + m2
                gscore = tl.where(gcols[None, :] == g, m1[:, None], gscore)
            gavail = (gcols < G)[None, :] & rmask[:, None]
            chosen = tl.zeros([BLOCK_T, BLOCK_E], tl.int1)
            for _ in tl.static_range(TOPG):
                mg = tl.max(tl.where(gavail, gscore, float("-inf")), 1)
                gi = tl.min(tl.where(gavail & (gscore == mg[:, None]), gcols[None, :], BIG), 1)
                gavail = gavail & (gcols[None, :] != gi[:, None])
                chosen = chosen | (grp[None, :] == gi[:, None])
            avail = avail & chosen
        # One int64 max per round picks (largest key, lowest index): the key's bits made order-preserving as a
        # signed int (negative floats: flip the 31 low bits; -0 made +0 first so it ties with +0) in the high
        # word, BLOCK_E - col in the low word. Unavailable lanes hold INT64_MIN, below every packed key.
        kb = tl.where(key == 0.0, 0.0, key).to(tl.int32, bitcast=True)
        kb = kb ^ ((kb >> 31) & 0x7FFFFFFF)
        packed = (kb.to(tl.int64) << 32) | (BLOCK_E - cols).to(tl.int64)[None, :]
        packed = tl.where(avail, packed, -9223372036854775807 - 1)
        for j in tl.static_range(K):
            p = tl.max(packed, 1)
            idx = BLOCK_E - p.to(tl.int32)  # the low word (truncation keeps it)
            packed = tl.where(cols[None, :] == idx[:, None], -9223372036854775807 - 1, packed)
            ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
    # Weights: the scores of the k chosen logits, re-read (k words per row, L1/L2-resident) and scored by the
    # same formula as the row, instead of k masked row sums. Masked hash slots (id -1) weigh 0, also after
    # renormalizing (which sums the valid slots only).
    inr = rmask[:, None] & (kcols < K)[None, :] & (ids >= 0) & (ids < E)
    xg = tl.load(row_ptr[:, None] + ids, mask=inr, other=0.0).to(tl.float32)
    ws = tl.where(inr, _score_of(xg, m[:, None], den[:, None], SCORING), 0.0)
    if RENORM:
        ws = tl.where(inr, tl.math.div_rn(ws, tl.sum(ws, 1)[:, None]), 0.0)
    ws = ws * scaling
    omask = rmask[:, None] & (kcols < K)[None, :]
    out = rows.to(tl.int64)[:, None] * K + kcols[None, :]
    tl.store(ids_ptr + out, ids, mask=omask)
    tl.store(w_ptr + out, ws, mask=omask)


@dataclasses.dataclass(frozen=True)
class RouteConfig:
    block_t: int  # tokens (rows) per program; each program holds BLOCK_T x BLOCK_E logits in registers
    num_warps: int


def pick_route_config(t: int, e: int, device: torch.device) -> RouteConfig:
    """One row per program while that fills at most one wave (T <= 2048: 132 SMs x 16 resident 4-warp CTAs on
    H100/H200): the router is latency-bound (a chain of row reductions per token), so more programs with short
    chains beat fewer with long ones (T=64, E=256 dsv3 groups on the H200: one row per program ~4x faster than 16;
    docs/moe.md). Beyond one wave, ~4K fp32 logits per
    program (32 per thread at 4 warps) amortise the per-program work. The interpreter pays per program: one
    program for T <= 64."""
    block_e = next_pow2(max(e, 1))
    if device.type == "cpu":
        return RouteConfig(min(64, next_pow2(max(t, 1))), 4)
    if t <= 2048:
        return RouteConfig(1, 4)
    block_t = max(1, min(next_pow2(max(t, 1)), 4096 // block_e))
    return RouteConfig(block_t, 4 if block_t * block_e <= 4096 else 8)


def supports_route(logits, *args) -> str | None:
    if logits.shape[-1] > 4096:
        return f"E={logits.shape[-1]} > 4096 experts does not fit one program's registers"
    return None


def _launch(logits, bias, tok, table, top_k, scoring, renormalize, routed_scaling, num_groups, topk_groups,
            config: RouteConfig | None = None):
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, w
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cfg = config or pick_route_config(t, e, logits.device)
    dummy = ids  # never read when the matching constexpr flag is off
    grid = (cdiv(t, cfg.block_t),)
    launch(_route_kernel, grid,
        logits, dummy if bias is None else bias, dummy if tok is None else tok,
        dummy if table is None else table, ids, w,
        t, e, logits.stride(0), e // max(num_groups, 1), float(routed_scaling), 0 if table is None else table.shape[0],
        K=top_k, KP=next_pow2(top_k), SCORING=SCORING_CODE[scoring], HAS_BIAS=bias is not None,
        RENORM=renormalize, HASH=table is not None, G=num_groups, GP=next_pow2(max(num_groups, 1)),
        TOPG=topk_groups, BLOCK_T=cfg.block_t, BLOCK_E=next_pow2(e), num_warps=cfg.num_warps)
    return ids, w


def moe_route(logits, bias, top_k, scoring, renormalize, routed_scaling, num_groups, topk_groups,
              config: RouteConfig | None = None):
    return _launch(logits, bias, None, None, top_k, scoring, renormalize, routed_scaling, num_groups,
                   topk_groups, config)


def moe_hash_route(logits, token_ids, table, scoring, renormalize, routed_scaling):
    table = table.contiguous()
    return _launch(logits, None, token_ids.contiguous(), table, table.shape[1], scoring, renormalize,
                   routed_scaling, 1, 1)
