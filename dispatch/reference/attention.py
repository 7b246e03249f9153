"""Reference attention: the one contract every attention backend (prefill, decode, split-KV merge) is tested on.

Math in float64 on the inputs' values, output rounded once to the query dtype. Conventions (FlashAttention's):

* Packed varlen: q (total_q, Hq, Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv); sequence b owns rows
  cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v. Hq % Hkv == 0; query
  head h reads KV head h // (Hq // Hkv).
* Positions are aligned bottom-right: query row i of a sequence with sq queries and sk keys sits at key
  position i + sk - sq. Key j is visible when
      causal:        j <= i + sk - sq
      window left:   j >= i + sk - sq - left    (left >= 0; -1 = unbounded)
      window right:  j <= i + sk - sq + right   (right >= 0; -1 = unbounded)
  causal is the same as right = 0 (both may be given; the tighter bound wins).
* logits = softmax_scale * q.k. A sink is a per-query-head logit (not scaled) that joins the softmax
  denominator and contributes no value (GPT-OSS): p_j = exp(l_j) / (sum_j' exp(l_j') + exp(sink)).
* lse (natural log, fp32, shape (total_q, Hq)) = log(sum_j exp(l_j) + exp(sink)), sink included.
* A row with no visible key gives out = 0 and lse = -inf (or the sink's logit when there is a sink).
* cu_seqlens values are clamped into the tensors as the kernels clamp them (sequence b's rows start at
  clamp(cu[b], 0, rows) and number clamp(cu[b + 1] - start, 0, rows - start)); rows no sequence covers stay 0.
"""

from __future__ import annotations

import math

import torch


def visible_keys(sq: int, sk: int, causal: bool, window: tuple[int, int], device=None) -> torch.Tensor:
    """Bool [sq, sk]: which keys each query row of one sequence may attend to (bottom-right aligned)."""
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        ok &= j <= i
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    return ok


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, softmax_scale: float | None = None, causal: bool = False,
                     window: tuple[int, int] = (-1, -1), sinks: torch.Tensor | None = None,
                     key_valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, Hq, Dv) in q.dtype, lse (total_q, Hq) fp32). See the module docstring. key_valid (bool,
    (total_k,)): keys marked False keep their position but join neither the softmax nor the output (what the
    paged kernels do with keys behind an out-of-range page id)."""
    total_q, hq, dqk = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(dqk) if softmax_scale is None else float(softmax_scale)
    out = torch.zeros(total_q, hq, dv, dtype=torch.float64, device=q.device)
    lse = torch.full((total_q, hq), -math.inf, dtype=torch.float64, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    sink = None if sinks is None else sinks.to(torch.float64).view(1, hq, 1)
    total_k = k.shape[0]
    for b in range(len(cq) - 1):
        # offsets clamped into the tensors as the kernels clamp them (docs/attention.md, bad input): a sequence
        # ending before it starts is empty, one running past the rows is cut there
        q0, k0 = min(max(cq[b], 0), total_q), min(max(ck[b], 0), total_k)
        sq, sk = min(max(cq[b + 1] - q0, 0), total_q - q0), min(max(ck[b + 1] - k0, 0), total_k - k0)
        q1, k1 = q0 + sq, k0 + sk
        if sq == 0 or (sk == 0 and sink is None):
            continue  # no rows, or rows with no key and no sink: out 0, lse -inf
        qb = q[q0:q1].to(torch.float64)  # (sq, hq, d)
        kb = k[k0:k1].to(torch.float64).repeat_interleave(group, dim=1)  # (sk, hq, d)
        vb = v[k0:k1].to(torch.float64).repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->qhk", qb, kb) * scale  # (sq, hq, sk)
        ok = visible_keys(sq, sk, causal, window, q.device).unsqueeze(1)  # (sq, 1, sk)
        if key_valid is not None:
            ok = ok & key_valid[k0:k1].view(1, 1, sk)
        logits = logits.masked_fill(~ok, -math.inf)
        if sink is not None:
            logits = torch.cat([logits, sink.expand(sq, hq, 1)], dim=2)
        if logits.shape[2]:
            row_max = logits.amax(dim=2, keepdim=True)
        else:  # no keys and no sink (sk = 0): amax of an empty dim raises; the row sees nothing
            row_max = logits.new_full((sq, hq, 1), -math.inf)
        safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        e = torch.exp(logits - safe_max)
        denom = e.sum(dim=2, keepdim=True)
        p = torch.where(denom > 0, e / denom.clamp_min(1e-300), torch.zeros_like(e))
        if sink is not None:
            p = p[..., :sk]
        out[q0:q1] = torch.einsum("qhk,khd->qhd", p, vb)
        lse[q0:q1] = (torch.log(denom) + safe_max).squeeze(2)
    return out.to(q.dtype), lse.to(torch.float32)


def gather_paged(cache: torch.Tensor, block_table: torch.Tensor, seqlens: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """A paged cache (num_blocks, block_size, H, D) read through block_table (B, max_blocks) for per-sequence
    lengths seqlens (B,) -> (packed (sum(seqlens), H, D), cu_seqlens (B + 1,) int32): the dense keys/values
    the paged kernels must behave as if they had read."""
    block_size = cache.shape[1]
    rows, cu = [], [0]
    for b, n in enumerate(seqlens.tolist()):
        pos = torch.arange(n, device=cache.device)
        blocks = block_table[b, pos // block_size].long()
        rows.append(cache[blocks, pos % block_size])
        cu.append(cu[-1] + n)
    packed = torch.cat(rows) if rows else cache.new_zeros(0, *cache.shape[2:])
    return packed, torch.tensor(cu, dtype=torch.int32, device=cache.device)


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attention results over disjoint key sets (out (T, H, D), lse (T, H) fp32):
    lse = log(exp(lse_a) + exp(lse_b)); out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
    A part with lse = -inf (no keys) contributes nothing, whatever its out holds (NaN included); both -inf gives
    out 0, lse -inf. A part with lse NaN or +inf (no softmax gives either) makes its row's out and lse NaN."""
    a, b = lse_a.to(torch.float64), lse_b.to(torch.float64)
    corrupt = a.isnan() | (a == math.inf) | b.isnan() | (b == math.inf)
    a, b = a.masked_fill(corrupt, -math.inf), b.masked_fill(corrupt, -math.inf)
    m = torch.maximum(a, b)
    safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(a - safe).unsqueeze(-1), torch.exp(b - safe).unsqueeze(-1)
    total = wa + wb
    zero = torch.zeros((), dtype=torch.float64, device=out_a.device)
    # a part of weight 0 is never multiplied: a NaN or Inf in its out cannot leak
    parts = [torch.where(w > 0, o.to(torch.float64), zero) * w for o, w in ((out_a, wa), (out_b, wb))]
    out = torch.where(total > 0, (parts[0] + parts[1]) / total.clamp_min(1e-300), zero)
    lse = torch.where(total[..., 0] > 0, torch.log(total[..., 0]) + safe, -math.inf)
    out, lse = out.masked_fill(corrupt.unsqueeze(-1), math.nan), lse.masked_fill(corrupt, math.nan)
    return out.to(out_a.dtype), lse.to(torch.float32)


# ------------------------------------------------------------------------------- the ops' reference backends
# Same signatures as the torch ops in dispatch/ops/attention.py, minus `backend`. They sync with the host
# (.tolist()): they are the test oracle and the CPU backend, not a fast path.


def _paged_keys(k_cache, v_cache, block_table, seqlens, k_scale, v_scale):
    """Gather a paged cache into packed fp32 keys/values + cu_seqlens + validity: positions 0..seqlens[b]-1
    (negative lengths count as 0); page ids outside [0, num_blocks) and positions past the table's capacity give
    invalid (masked) keys that keep their positions; FP8 codes are dequantized as code * scale (per tensor, or
    per KV head)."""
    block_size = k_cache.shape[1]
    ks, vs, valid, cu = [], [], [], [0]
    for b, n in enumerate(seqlens.tolist()):
        n = max(0, int(n))
        pos = torch.arange(n, device=k_cache.device)
        page, ok = table_pages(block_table[b], pos, block_size, k_cache.shape[0])
        ks.append(_dequant(k_cache[page, pos % block_size], k_scale))
        vs.append(_dequant(v_cache[page, pos % block_size], v_scale))
        valid.append(ok)
        cu.append(cu[-1] + n)
    k = torch.cat(ks) if ks else k_cache.new_zeros(0, *k_cache.shape[2:]).float()
    v = torch.cat(vs) if vs else v_cache.new_zeros(0, *v_cache.shape[2:]).float()
    valid_all = torch.cat(valid) if valid else torch.zeros(0, dtype=torch.bool, device=k_cache.device)
    return k, v, torch.tensor(cu, dtype=torch.int32, device=k_cache.device), valid_all


def table_pages(table_row, pos, block_size, num_blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(page ids clamped into [0, num_blocks), validity) of key positions `pos` (int64 >= 0) of one sequence read
    through its block-table row: a position past the row's capacity, or behind a page id outside
    [0, num_blocks), is invalid (masked; the page returned for it is any readable one)."""
    col = pos // block_size
    in_table = col < table_row.shape[0]
    page = table_row[col.clamp(max=max(table_row.shape[0] - 1, 0))].long() if table_row.shape[0] else col
    ok = in_table & (page >= 0) & (page < num_blocks)
    return page.clamp(0, max(num_blocks - 1, 0)), ok


def _dequant(codes, scale):
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    values = codes.float()
    if scale is not None:
        values = values * (scale.float().view(-1, 1) if scale.numel() > 1 else scale.float().reshape(()))
    return values


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_left, window_right, sinks, return_lse):
    return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, (window_left, window_right),
                            sinks)


def attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                            softmax_scale, causal, window_left, window_right, sinks, k_scale, v_scale):
    k, v, cu_k, valid = _paged_keys(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale)
    out, lse = attention_varlen(q.float(), k, v, cu_seqlens_q, cu_k, softmax_scale, causal,
                                (window_left, window_right), sinks, valid)
    return out.to(q.dtype), lse


def attention_decode(q, k_cache, v_cache, block_table, seqused_k, softmax_scale, causal, window_left,
                     window_right, sinks, k_scale, v_scale, num_splits):
    bsz, sq, hq, d = q.shape
    k, v, cu_k, valid = _paged_keys(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale)
    cu_q = torch.arange(bsz + 1, dtype=torch.int32, device=q.device) * sq
    out, lse = attention_varlen(q.reshape(bsz * sq, hq, d).float(), k, v, cu_q, cu_k, softmax_scale, causal,
                                (window_left, window_right), sinks, valid)
    return out.to(q.dtype).view(bsz, sq, hq, -1), lse.view(bsz, sq, hq)


# ------------------------------------------------------------------------------------------------ MLA decode
# DeepSeek MLA decode (MQA over one latent KV head). Cache layouts: "bf16" (num_blocks, block_size, (1,) D) in
# bf16, or the DeepSeek FP8 byte layouts "v32" (656 B / token, D = 576) and "v4" (584 B / token, D = 512) as
# `ds_kv_write` writes them, dequantized as `ds_kv_gather` reads them. The key of a token is its whole latent
# row (D = NoPE + 64 RoPE); its value is the row's first v_dim columns.

MLA_LAYOUTS = ("bf16", "v32", "v4")


def mla_latent_rows(kv_cache, layout, table_row, pos):
    """fp32 latent rows [n, D] of positions `pos` (int64, >= 0) of one sequence read through its block-table row,
    and their validity (inside the row's capacity, page id inside [0, num_blocks)); invalid rows are 0."""
    from .kv_cache import ds_kv_gather

    nb, bs = kv_cache.shape[:2]
    page, ok = table_pages(table_row, pos, bs, nb)
    if layout == "bf16":
        rows = kv_cache[page, pos % bs].reshape(pos.shape[0], -1).float()
    else:
        rows = ds_kv_gather(kv_cache, page * bs + pos % bs, layout, torch.float32)
    return torch.where(ok[:, None], rows, torch.zeros_like(rows)), ok


def mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal, window_left,
               num_splits):
    """q (B, Sq, H, D) against sequence b's latent rows. Dense (indices None): keys 0..seqused_k[b]-1, bottom-right
    causal among the Sq queries when causal. Sparse: query (b, s) attends to the keys at positions indices[b, s, :]
    (int32; entries < 0 or >= seqused_k[b] are unused; causal also drops those after the query's own position; a
    repeated index counts once per occurrence). window_left >= 0: a query at position p sees keys
    p - window_left .. p only (dense and sparse), -1 = unbounded. Keys behind a page id outside [0, num_blocks), or
    past the table's capacity, are masked; query s sits at seqused_k[b] - Sq + s either way. Returns (out
    (B, Sq, H, v_dim) in q's dtype, lse (B, Sq, H) fp32, natural log); a row with no key is out 0, lse -inf."""
    bsz, sq, h, d = q.shape
    dev = q.device
    out = torch.zeros(bsz, sq, h, v_dim, dtype=q.dtype, device=dev)
    lse = torch.full((bsz, sq, h), -math.inf, dtype=torch.float32, device=dev)
    one_q = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    for b, n in enumerate(seqused_k.tolist()):
        n = max(0, int(n))
        if indices is None:
            if n == 0:
                continue
            rows, ok = mla_latent_rows(kv_cache, layout, block_table[b], torch.arange(n, device=dev))
            cu_k = torch.tensor([0, n], dtype=torch.int32, device=dev)
            o, l = attention_varlen(q[b].float(), rows[:, None], rows[:, None, :v_dim], one_q * sq, cu_k,
                                    softmax_scale, causal, (window_left, -1), None, ok)
            out[b], lse[b] = o.to(q.dtype), l
            continue
        for s in range(sq):
            idx = indices[b, s].long()
            keep = (idx >= 0) & (idx < n)
            if causal:
                keep &= idx <= n - sq + s
            if window_left >= 0:
                keep &= idx >= n - sq + s - window_left
            if n == 0 or not bool(keep.any()):
                continue
            rows, ok = mla_latent_rows(kv_cache, layout, block_table[b], idx.clamp(0, n - 1))
            ok &= keep
            cu_k = torch.tensor([0, idx.shape[0]], dtype=torch.int32, device=dev)
            o, l = attention_varlen(q[b, s:s + 1].float(), rows[:, None], rows[:, None, :v_dim], one_q, cu_k,
                                    softmax_scale, False, (-1, -1), None, ok)
            out[b, s], lse[b, s] = o[0].to(q.dtype), l[0]
    return out, lse


INDEX_CHUNK_ELEMS = 1 << 26  # fp64 per-head scores held at a time (512 MB): V3.2 prompts of 8k keys fit


def mla_index_scores(q, k, weights, softmax_scale, visible):
    """DeepSeek-V3.2 indexer scores (transformers' `DeepseekV32Indexer`): q (B, S, H, D), k (B, T, D), weights
    (B, S, H) fp32 (the indexer's head weights, already times H ** -0.5) ->
    out[b, s, t] = sum_h weights[b, s, h] * relu(softmax_scale * (q[b, s, h] . k[b, t])), -inf where visible (B, S,
    T) bool is False (None: every key visible). In float64 in that order (dot, scale, ReLU, weight, sum over heads),
    rounded once to fp32; query rows in chunks so the per-head scores stay bounded."""
    bsz, s, h, _ = q.shape
    t = k.shape[1]
    out = torch.empty(bsz, s, t, dtype=torch.float32, device=q.device)
    rows = max(1, INDEX_CHUNK_ELEMS // max(1, h * t))
    for b in range(bsz):
        kb = k[b].to(torch.float64)
        for i in range(0, s, rows):
            qb, wb = q[b, i:i + rows].to(torch.float64), weights[b, i:i + rows].to(torch.float64)
            per_head = torch.relu(torch.einsum("shd,td->sht", qb, kb) * softmax_scale) * wb[..., None]
            out[b, i:i + rows] = per_head.sum(1).to(torch.float32)
    return out if visible is None else out.masked_fill(~visible, -math.inf)
