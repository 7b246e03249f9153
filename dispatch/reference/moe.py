"""Reference MoE routing plumbing: router, align (contiguous + masked layouts), gather, combine.

These functions *are* the contract (docs/moe.md explains the layouts for the grouped GEMMs).

Router math is fp32. Selection is exact and deterministic:
* Selection key: without a bias the key is the fp32 *logit* (every scoring function is monotone, so this is
  the true order and no rounding in exp/log can create or break a tie); with a bias (DeepSeek's
  e_score_correction_bias) the key is fp32 score + bias.
* NaN keys never win (they are read as -inf). Ties go to the lowest expert index; the k outputs are in
  descending key order (ties: lowest index first).
* Grouped top-k (DeepSeek): E experts in G equal groups; a group's score is the sum of its top-2 keys when
  a bias is given, else its max key (vLLM's grouped_topk rule); the top `topk_groups` groups are chosen
  (ties: lowest group), then top-k experts among the chosen groups only.
* Weights are the *unbiased* scores of the chosen experts; renormalize divides by their fp32 sum; then
  times routed_scaling. Backends may differ from this by a few ulps in exp/log (weights are compared
  with a tight fp32 tolerance), never in ids.

Align/gather/combine are integer bookkeeping plus one fp32 weighted sum (exact order: slots 0..k-1,
then the shared-expert output, one rounding to out_dtype at the end).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triton_ops.contract.formats import contiguous_capacity

SCORINGS = ("softmax", "sigmoid", "sqrt_softplus")


# ---------------------------------------------------------------------------------------------- router


def score(x: torch.Tensor, scoring: str) -> torch.Tensor:
    """fp32 scores of fp32 logits x [T, E]."""
    if scoring == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(x)
    if scoring == "sqrt_softplus":  # DeepSeek-V4
        return torch.sqrt(F.softplus(x))
    raise ValueError(f"unknown scoring {scoring!r}")


def _topk_lowest(key: torch.Tensor, k: int, avail: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k largest keys per row, ties -> lowest index, NaN never above -inf; entries where
    avail is False come after every available one (so they are picked only if nothing else is left)."""
    key = key.masked_fill(torch.isnan(key), float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    if avail is not None:  # second, stable pass: available first, key order kept inside each class
        a = avail.gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(a, dim=-1, descending=True, stable=True).indices)
    return order[..., :k]


def moe_route(logits, bias, top_k, scoring, renormalize, routed_scaling, num_groups, topk_groups):
    """logits [T, E] -> (topk_ids int32 [T, k], topk_weights fp32 [T, k]). See the module docstring."""
    x = logits.float()
    scores = score(x, scoring)
    key = x if bias is None else scores + bias.float()
    key = key.masked_fill(torch.isnan(key), float("-inf"))
    avail = None
    t, e = x.shape
    if num_groups > 1:
        g = key.view(t, num_groups, e // num_groups)
        if bias is not None:
            top2 = torch.sort(g, dim=-1, descending=True).values
            gscore = top2[..., 0] + top2[..., 1]
        else:
            gscore = g.amax(-1)
        gid = _topk_lowest(gscore, topk_groups)
        gmask = torch.zeros(t, num_groups, dtype=torch.bool, device=x.device).scatter(1, gid, True)
        avail = gmask.repeat_interleave(e // num_groups, dim=1)
    ids = _topk_lowest(key, top_k, avail)
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    w = w * routed_scaling
    return ids.to(torch.int32), w


def moe_hash_route(logits, token_ids, table, scoring, renormalize, routed_scaling):
    """Hash routing (DeepSeek-V4 early layers): ids = table[token_ids] (table order kept); weights are the
    scores of those experts, renormalized / scaled like moe_route.

    Out-of-range values are masked: a token id outside [0, vocab) makes all k slots of its token, and a table
    entry outside [0, E) makes its slot, expert id -1 with weight 0; masked slots are left out of the
    renormalizing sum (all slots masked: weights 0). Nothing is read out of range (ids compared at full width)."""
    scores = score(logits.float(), scoring)
    t, e = scores.shape
    vocab, k = table.shape
    tok = token_ids.long()
    tok_ok = (tok >= 0) & (tok < vocab)
    raw = table.long()[tok.clamp(0, max(vocab - 1, 0))] if vocab else table.new_zeros(t, k, dtype=torch.long)
    ok = tok_ok[:, None] & (raw >= 0) & (raw < e)
    ids = torch.where(ok, raw, -1).to(torch.int32)
    w = scores.gather(1, torch.where(ok, raw, 0)) if e else scores.new_zeros(t, k)
    w = torch.where(ok, w, 0.0)
    if renormalize:
        w = torch.where(ok, w / w.sum(-1, keepdim=True), 0.0)
    return ids, w * routed_scaling


# ---------------------------------------------------------------------------------------------- align


def local_experts(topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Flat local expert id per (token, slot) entry; -1 where the entry has no local expert (the map says -1,
    or the id is out of range)."""
    g = topk_ids.reshape(-1).long()
    if expert_map is not None:
        inr = (g >= 0) & (g < expert_map.numel())
        g = torch.where(inr, expert_map.long()[g.clamp(0, max(expert_map.numel() - 1, 0))], -1)
    return torch.where((g >= 0) & (g < num_experts), g, -1)


def _sorted_entries(e: torch.Tensor, num_experts: int):
    """Local entries in (expert, flat index) order: (flat index, expert, rank within expert), and counts."""
    idx = (e >= 0).nonzero().flatten()
    es = e[idx]
    order = torch.sort(es, stable=True).indices  # stable: within an expert, flat order (token, then slot)
    idx, es = idx[order], es[order]
    counts = torch.bincount(es, minlength=num_experts)[:num_experts]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(es.numel(), device=e.device) - first[es]
    return idx, es, rank, counts


def moe_align(topk_ids, expert_map, num_experts, block_m):
    """Contiguous layout (see docs/moe.md). Returns (sorted_token_ids, expert_ids, m_indices,
    num_tokens_post_padded, expert_offsets, expert_counts, inv_rows)."""
    t, k = topk_ids.shape
    n, dev = t * k, topk_ids.device
    cap = contiguous_capacity(n, num_experts, block_m)
    e = local_experts(topk_ids, num_experts, expert_map)
    idx, es, rank, counts = _sorted_entries(e, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    total = padded.sum()
    dest = starts[es] + rank
    i32 = dict(dtype=torch.int32, device=dev)
    sorted_ids = torch.full((cap,), n, **i32)
    sorted_ids[dest] = idx.to(torch.int32)
    m_indices = torch.full((cap,), -1, **i32)
    m_indices[dest] = es.to(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=dev), padded // block_m)
    expert_ids = torch.full((cap // block_m,), -1, **i32)
    expert_ids[: blocks.numel()] = blocks.to(torch.int32)
    offsets = torch.cat([starts, total.reshape(1)]).to(torch.int32)
    inv = torch.full((n,), -1, **i32)
    inv[idx] = dest.to(torch.int32)
    return (sorted_ids, expert_ids, m_indices, total.reshape(1).to(torch.int32), offsets,
            counts.to(torch.int32), inv.view(t, k))


def moe_masked_layout(topk_ids, expert_map, num_experts, max_m):
    """Masked layout: (src_rows int32 [E, max_m], masked_m int32 [E], expert_counts int32 [E],
    inv_rows int32 [T, k]). Entries past max_m of an expert are dropped (inv -1); masked_m is clamped,
    expert_counts is not (compare them to detect overflow)."""
    t, k = topk_ids.shape
    n, dev = t * k, topk_ids.device
    e = local_experts(topk_ids, num_experts, expert_map)
    idx, es, rank, counts = _sorted_entries(e, num_experts)
    keep = rank < max_m
    idx, es, rank = idx[keep], es[keep], rank[keep]
    dest = es * max_m + rank
    i32 = dict(dtype=torch.int32, device=dev)
    src = torch.full((num_experts * max_m,), n, **i32)
    src[dest] = idx.to(torch.int32)
    inv = torch.full((n,), -1, **i32)
    inv[idx] = dest.to(torch.int32)
    return (src.view(num_experts, max_m), counts.clamp(max=max_m).to(torch.int32), counts.to(torch.int32),
            inv.view(t, k))


# ----------------------------------------------------------------------------------------- gather/combine


def moe_gather(x, src_rows, top_k):
    """out[r] = x[src_rows[r] // top_k] for 0 <= src_rows[r] < T*top_k, else a zero row. Shape
    [*src_rows.shape, K], dtype of x (bytes copied as they are)."""
    t = x.shape[0]
    src = src_rows.reshape(-1).long()
    ok = (src >= 0) & (src < t * top_k)
    tok = torch.where(ok, src // top_k, 0)
    out = x[tok] if t else x.new_zeros(src.numel(), x.shape[1])
    out = torch.where(ok[:, None], out, torch.zeros((), dtype=x.dtype, device=x.device)) if t else out
    return out.reshape(*src_rows.shape, x.shape[1])


def moe_combine(expert_out, inv_rows, weights, shared, out_dtype):
    """y[t] = sum_j w[t,j] * expert_out[inv_rows[t,j]] (j in slot order, skipping rows outside [0, R): -1 and
    any other out-of-range value contribute nothing), + shared[t]; fp32 accumulation, one rounding to
    out_dtype. expert_out is [R, N] or [E, max_m, N] (read flat, R = E * max_m; R may be 0)."""
    n = expert_out.shape[-1]
    t, k = inv_rows.shape
    if n == 0:
        return torch.zeros(t, 0, dtype=out_dtype, device=expert_out.device)
    eo = expert_out.reshape(-1, n)
    rows = eo.shape[0]
    acc = torch.zeros(t, n, dtype=torch.float32, device=eo.device)
    for j in range(k):
        r = inv_rows[:, j].long()
        ok = (r >= 0) & (r < rows)
        v = eo[r.clamp(0, rows - 1)].float() if rows else acc
        w = torch.where(ok, weights[:, j].float(), 0.0)
        acc = acc + torch.where(ok[:, None], w[:, None] * v, 0.0)
    if shared is not None:
        acc = acc + shared.float()
    return acc.to(out_dtype)
