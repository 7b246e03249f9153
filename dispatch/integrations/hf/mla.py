"""The DeepSeek-V3 attention (MLA) that replaces transformers' `DeepseekV3Attention`: its projections, latent norms
and interleaved RoPE as transformers computes them, then

* with a `LowbitMlaCache`: the latent row [normalized kv latent | RoPE'd k_pe] of each new token goes into the
  cache's pages; one token per sequence (decode) runs the absorbed form: q_nope through kv_b_proj's W_UK per head
  (qk_nope -> kv_lora), `ops.mla_decode` over the pages with the query [q_absorbed | q_pe] and the model's softmax
  scale (YaRN mscale included, as transformers sets `scaling`), the latent output through W_UV per head
  (kv_lora -> v_head_dim), o_proj. The logits are q_nope . (W_UK c) + q_pe . k_pe, the decompressed form's, and
  the values W_UV (sum p c), so the result is the model's up to rounding. A prompt (S > 1) decompresses the stored
  latent of each sequence with kv_b_proj and runs `ops.attention_prefill_paged` at q/k 192, v 128 (a padding row
  sits before its sequence's first key and comes out 0).
* with any other cache (transformers' own) or none: transformers' latent cache, K / V decompressed, the "lowbit"
  attention function (`ops.attention` / `attention_prefill` at q/k 192, v 128), as before the latent cache existed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ... import ops
from .attention import lowbit_attention_forward

SUBMODULES = ("q_proj", "q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
              "o_proj")
DIMS = ("num_heads", "q_lora_rank", "qk_rope_head_dim", "kv_lora_rank", "v_head_dim", "qk_nope_head_dim",
        "qk_head_dim", "scaling", "layer_idx", "config")


class MlaWeightError(ValueError):
    """kv_b_proj's weight cannot be split into the absorbed form's W_UK / W_UV (named argument, reason)."""


class LowbitMlaAttention(nn.Module):
    """DeepSeek-V3 MLA over lowbit's attention ops; adopts the original's submodules (same objects and state-dict
    names: q_a_proj, q_a_layernorm, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    def __init__(self, original: nn.Module, rope=None):
        """rope: the model's RoPE function (q_rot, k_rot, cos, sin) -> (q_rot, k_rot); None picks DeepSeek-V3's by
        the config's rope_interleave."""
        super().__init__()
        for name in SUBMODULES:
            setattr(self, name, getattr(original, name))
        for name in DIMS:
            setattr(self, name, getattr(original, name))
        if rope is None:
            from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

            rope = ds.apply_rotary_pos_emb_interleave if self.config.rope_interleave else ds.apply_rotary_pos_emb
        self.rope = rope

    def _project(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor]
                 ) -> tuple[Tensor | None, Tensor, Tensor, Tensor]:
        """transformers' projections, latent norm and RoPE: q_resid (B, S, q_lora) (the normalized q latent, None
        without q_lora_rank), q (B, S, H, nope + rope) with its RoPE'd part written in place (the layout the
        attention ops read: no concatenation), kv_nope (B, 1, S, kv_lora), k_rot (B, 1, S, rope)."""
        b, s, _ = hidden_states.shape
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_resid)
        q = q.view(b, s, -1, self.qk_head_dim)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                                       dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, s, self.kv_lora_rank)
        q_rot, k_rot = self.rope(q[..., self.qk_nope_head_dim:].transpose(1, 2),
                                 k_rot.view(b, 1, s, self.qk_rope_head_dim), *position_embeddings)
        q[..., self.qk_nope_head_dim:] = q_rot.transpose(1, 2)
        return q_resid, q, kv_nope, k_rot

    def _split_q(self, q: Tensor) -> tuple[Tensor, Tensor]:
        """q (B, S, H, nope + rope) -> views q_pass (B, H, S, nope), q_rot (B, H, S, rope)."""
        q_pass, q_rot = q.transpose(1, 2).split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        return q_pass, q_rot

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                attention_mask: Tensor | None, past_key_values=None, **kwargs) -> tuple[Tensor, None]:
        b, s, _ = hidden_states.shape
        _, q, kv_nope, k_rot = self._project(hidden_states, position_embeddings)
        if getattr(past_key_values, "lowbit_latent", False):
            rows = torch.cat([kv_nope, k_rot], dim=-1).view(b, s, -1)
            past_key_values.append(self.layer_idx, rows, attention_mask)
            if s == 1:
                out = self._absorbed_decode(*self._split_q(q), lambda q_abs: past_key_values.decode(
                    self.layer_idx, q_abs, self.scaling))
            else:
                out = self._prefill(past_key_values, q)
            return self.o_proj(out.reshape(b, s, -1)), None
        if getattr(past_key_values, "lowbit_paged", False):
            from .paged_cache import PagedCacheError

            raise PagedCacheError("LowbitPagedCache: DeepSeek-V3's attention stores MLA's latent: pass LowbitMlaCache")
        if past_key_values is not None:
            kv_nope, k_rot = past_key_values.update(kv_nope, k_rot, self.layer_idx)
        k, v = self._expand(kv_nope.transpose(1, 2), k_rot.transpose(1, 2))
        out, _ = lowbit_attention_forward(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attention_mask, scaling=self.scaling)
        return self.o_proj(out.reshape(b, s, -1)), None

    def _expand(self, latent: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
        """latent (B, T, 1, kv_lora), k_pe (B, T, 1, rope) -> K (B, T, H, nope + rope), V (B, T, H, v) through
        kv_b_proj (transformers' `expand_kv`, sequence-major)."""
        b, t = latent.shape[:2]
        kv = self.kv_b_proj(latent.view(b, t, -1)).view(b, t, self.num_heads, -1)
        # two slice copies into one buffer, not torch.cat of the strided / broadcast parts: with the q concatenation
        # that cat was the longest non-GEMM kernel of the DeepSeek-V3 prefill trace (docs/models.md)
        k = kv.new_empty(b, t, self.num_heads, self.qk_head_dim)
        k[..., : self.qk_nope_head_dim] = kv[..., : self.qk_nope_head_dim]
        k[..., self.qk_nope_head_dim:] = k_pe
        return k, kv[..., self.qk_nope_head_dim:].contiguous()

    def _absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """Views of kv_b_proj's weight (H * (nope + v), kv_lora): W_UK (H, nope, kv_lora), W_UV^T (H, kv_lora, v)."""
        weight = self.kv_b_proj.weight
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise MlaWeightError(f"LowbitMlaAttention: argument 'kv_b_proj.weight': {weight.dtype} (a quantized "
                                 "projection); the absorbed decode multiplies by the weight itself")
        w = weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim:].transpose(1, 2)

    def _absorbed_decode(self, q_pass: Tensor, q_rot: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        """q_pass (B, H, 1, nope), q_rot (B, H, 1, rope) -> (B, 1, H, v); attend: the latent-space attention, the
        query (B, 1, H, kv_lora + rope) bf16 -> (B, 1, H, kv_lora) (`ops.mla_decode` over some latent pages)."""
        w_uk, w_uv_t = self._absorbed_weights()
        q_latent = torch.bmm(q_pass[:, :, 0].transpose(0, 1), w_uk)  # (H, B, kv_lora)
        q = torch.cat([q_latent.transpose(0, 1), q_rot[:, :, 0]], dim=-1)[:, None]  # (B, 1, H, kv_lora + rope)
        out = attend(q.contiguous())
        return torch.bmm(out[:, 0].transpose(0, 1), w_uv_t).transpose(0, 1)[:, None]

    def _prefill(self, cache, q: Tensor) -> Tensor:
        """q (B, S, H, nope + rope) over every sequence's stored latent, decompressed -> (B, S, H, v)."""
        b, s, h, d = q.shape
        rows, lengths = cache.prefix(self.layer_idx)
        t, page = rows.shape[1], cache.page_size
        k, v = self._expand(rows[..., None, : self.kv_lora_rank], rows[..., None, self.kv_lora_rank:])
        table = torch.arange(b * t // page, dtype=torch.int32, device=q.device).view(b, -1)
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * s
        out = ops.attention_prefill_paged(q.reshape(b * s, h, d), k.view(-1, page, h, d),
                                          v.view(-1, page, h, self.v_head_dim), cu_q, table, lengths, s,
                                          softmax_scale=self.scaling, causal=True)
        return out.view(b, s, h, -1)
