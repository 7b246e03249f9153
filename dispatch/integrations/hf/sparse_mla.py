"""The DeepSeek-V3.2 attention (sparse MLA) that replaces transformers' `DeepseekV32Attention`: DeepSeek-V3's MLA
(`LowbitMlaAttention`: the same projections, latent norms and interleaved RoPE) with transformers'
`DeepseekV32Indexer` kept (its projections, its own half-split RoPE, its keys in the cache's indexer store; its
scores computed by `ops.mla_index_scores`: `LowbitIndexer`) choosing index_topk keys per query;
every other key is masked.

* one token per sequence (decode): the absorbed form through `ops.mla_decode` with the indexer's top-k as
  `indices`: over a `LowbitMlaCache`'s pages (the indexer scores every column of the cache's indexer keys, numbered
  as the stored latent rows, those at or past each sequence's device length masked: the step's shapes do not
  change with the step, so `GraphedDecode` captures it), or over transformers' cached latent, each sequence's rows
  one page (the padded timeline itself). Keys the top-k had to take among masked ones (fewer keys than index_topk)
  become -1.
* a prompt (S > 1; with a `LowbitMlaCache` the first forward only) over no more keys than index_topk: the indexer
  picks every key, so the causal prefill over the decompressed K / V (the "lowbit" attention function:
  `attention_prefill` at q/k 192, v 128) is the same attention. Over more keys: the decompressed K / V and
  transformers' own masked dense attention (`sdpa_attention_forward` with the causal, padding and top-k masks as
  an additive mask): the prefill attention ops take no per-query key set.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ... import ops
from .attention import lowbit_attention_forward
from .mla import LowbitMlaAttention


def visible_keys(padding_mask: Tensor | None, b: int, s: int, t: int, device) -> Tensor:
    """(B, S, T) bool: the keys query row i (position t - s + i of transformers' timeline) may see: causal, and not
    left padding. padding_mask: the "lowbit" mask function's 2-D mask (B, >= T), 1 on real tokens, or None."""
    causal = torch.arange(t, device=device)[None, :] <= torch.arange(t - s, t, device=device)[:, None]
    if padding_mask is None:
        return causal[None].expand(b, s, t)
    return causal[None] & padding_mask[:, -t:].bool()[:, None, :]


def picked(visible: Tensor, topk: Tensor) -> Tensor:
    """The indexer's top-k (B, S, topk) as `mla_decode`'s indices: a key not visible (taken when fewer keys than
    index_topk are) becomes -1."""
    return torch.where(visible.gather(-1, topk.long()), topk, -1).to(torch.int32).contiguous()


class LowbitIndexer(nn.Module):
    """transformers' `DeepseekV32Indexer` (adopts its submodules: the same objects and state-dict names) with one
    change in its forward: the scores, ReLU, head weights and mask are one `ops.mla_index_scores` call. transformers'
    `torch.matmul` of q (B, S, H, D) with k (B, 1, D, T) broadcasts the keys over the S queries (a (B, S, D, T) fp32
    copy of them) and materializes the per-head scores (B, S, H, T) in fp32 before the ReLU and the weighted sum
    over heads; the op's Triton kernel keeps them in registers. Everything else is its forward in its order:
    projections, half-split RoPE, key store, scores, top-k."""

    def __init__(self, original: nn.Module):
        super().__init__()
        for name in ("layer_idx", "n_heads", "head_dim", "qk_rope_head_dim", "index_topk", "softmax_scale"):
            setattr(self, name, getattr(original, name))
        self.wq_b, self.wk, self.k_norm, self.weights_proj = (original.wq_b, original.wk, original.k_norm,
                                                              original.weights_proj)

    @torch.no_grad()
    def forward(self, hidden_states: Tensor, q_resid: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor, position_ids: Tensor | None = None, past_key_values=None) -> Tensor:
        """attention_mask: the visible keys (B, S, T) bool. -> (B, S, topk) int32 key positions."""
        from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

        b, s, _ = hidden_states.shape
        h, d, rope = self.n_heads, self.head_dim, self.qk_rope_head_dim
        cos, sin = position_embeddings
        q_rot, q_pass = self.wq_b(q_resid).view(b, s, h, d).split([rope, d - rope], dim=-1)
        k_rot, k_pass = self.k_norm(self.wk(hidden_states)).unsqueeze(2).split([rope, d - rope], dim=-1)
        q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        if past_key_values is not None:
            k = past_key_values.update_indexer(k, self.layer_idx)
        t = k.shape[1]
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (h ** -0.5)
        index_scores = ops.mla_index_scores(q, k, weights, softmax_scale=self.softmax_scale,
                                            visible=attention_mask)
        return index_scores.topk(min(self.index_topk, t), dim=-1).indices.to(torch.int32)


class LowbitSparseMlaAttention(LowbitMlaAttention):
    """DeepSeek-V3.2 sparse MLA; adopts the original's submodules (same objects and state-dict names, the indexer
    included)."""

    def __init__(self, original: nn.Module):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as ds

        super().__init__(original, rope=ds.apply_rotary_pos_emb_interleave)
        self.indexer = LowbitIndexer(original.indexer)
        # transformers' sdpa form of the masked attention (its V3.2 "sdpa" implementation's): the additive mask at
        # finfo.min as in its eager form (a row with no visible key stays finite), without materializing the
        # (B, H, S, T) scores the eager form does (68 GB at 4 x 8192 tokens and 128 heads)
        self.dense_masked = sdpa_attention_forward
        self.num_key_value_groups = 1  # the decompressed K / V have every query head

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None, past_key_values=None, position_ids: Tensor | None = None,
                **kwargs) -> tuple[Tensor, None]:
        b, s, _ = hidden_states.shape
        q_resid, q, kv_nope, k_rot = self._project(hidden_states, position_embeddings)
        q_pass, q_rot = self._split_q(q)
        latent = getattr(past_key_values, "lowbit_latent", False)
        if latent or getattr(past_key_values, "lowbit_paged", False):
            from .paged_cache import PagedCacheError
        if latent:
            layer = past_key_values.layers[self.layer_idx]
            if s > 1 and layer.seen:
                raise PagedCacheError(f"LowbitMlaCache: DeepSeek-V3.2 takes its prompt in one forward ({s} tokens "
                                      f"after {layer.seen}): the sparse prefill attends over this forward's keys")
            past_key_values.append(self.layer_idx, torch.cat([kv_nope, k_rot], dim=-1).view(b, s, -1),
                                   attention_mask)
        elif getattr(past_key_values, "lowbit_paged", False):
            raise PagedCacheError("LowbitPagedCache: DeepSeek-V3.2's attention stores MLA's latent: pass "
                                  "LowbitMlaCache")
        else:
            if past_key_values is not None:
                kv_nope, k_rot = past_key_values.update(kv_nope, k_rot, self.layer_idx)
        if latent and s == 1:  # the cache's indexer columns, sequence b's first lengths[b] its keys
            visible = layer.indexer_visible()
        else:  # transformers' padded timeline: this forward's keys (a prompt), or every cached key
            visible = visible_keys(attention_mask, b, s, s if latent else kv_nope.shape[2], hidden_states.device)
        topk = self.indexer(hidden_states, q_resid, position_embeddings, visible, position_ids,
                            past_key_values=past_key_values)  # (B, S, topk) key positions
        if latent and s == 1:
            out = self._absorbed_decode(q_pass, q_rot, lambda q_abs: past_key_values.decode(
                self.layer_idx, q_abs, self.scaling, picked(visible, topk)))
        elif s == 1:
            out = self._absorbed_decode(q_pass, q_rot, lambda q_abs: self._one_page_decode(
                q_abs, kv_nope, k_rot, visible, topk))
        elif visible.shape[-1] <= self.indexer.index_topk:
            # no more keys than the top-k: the indexer picks every key, so the selection is the causal and padding
            # mask itself and the dense causal prefill (attention_prefill at q/k 192, v 128) is the same attention
            k, v = self._expand(kv_nope.transpose(1, 2), k_rot.transpose(1, 2))
            out, _ = lowbit_attention_forward(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attention_mask, scaling=self.scaling)
        else:
            out = self._masked_dense(q.transpose(1, 2), kv_nope, k_rot, visible, topk)
        return self.o_proj(out.reshape(b, s, -1)), None

    def _masked_dense(self, q: Tensor, kv_nope: Tensor, k_rot: Tensor, visible: Tensor, topk: Tensor) -> Tensor:
        """q (B, H, S, nope + rope) over the decompressed latent (B, 1, T, .) with the keys both visible and in the
        indexer's top-k, transformers' masked dense attention -> (B, S, H, v)."""
        k, v = self._expand(kv_nope.transpose(1, 2), k_rot.transpose(1, 2))
        chosen = torch.zeros_like(visible).scatter_(-1, topk.long(), True)
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~(visible & chosen), torch.finfo(q.dtype).min)[:, None]
        out, _ = self.dense_masked(self, q, k.transpose(1, 2), v.transpose(1, 2), mask, scaling=self.scaling)
        return out

    def _one_page_decode(self, q: Tensor, kv_nope: Tensor, k_rot: Tensor, visible: Tensor, topk: Tensor) -> Tensor:
        """`ops.mla_decode` over transformers' cached latent (B, 1, T, .), each sequence's rows one page of T (its
        left padding included: the padded timeline is the pages'); the indexer's picks among keys not visible (a
        padding key the top-k had to take) become -1. q (B, 1, H, kv_lora + rope) -> (B, 1, H, kv_lora)."""
        b, t = kv_nope.shape[0], kv_nope.shape[2]
        pages = torch.cat([kv_nope, k_rot], dim=-1).transpose(1, 2).contiguous()  # (B, T, 1, kv_lora + rope)
        table = torch.arange(b, dtype=torch.int32, device=q.device)[:, None]
        lengths = torch.full((b,), t, dtype=torch.int32, device=q.device)
        return ops.mla_decode(q, pages, table, lengths, indices=picked(visible, topk), layout="bf16",
                              v_dim=self.kv_lora_rank, softmax_scale=self.scaling, causal=True)
