"""The modules that replace transformers' per-layer modules: RMSNorm, the SwiGLU MLP and the attention
(projections -> `ops.rope` -> KV cache -> the lowbit attention function). Each adopts the original's parameters
(same objects, same state-dict names) so a patched model holds no second copy of its weights.
Inference only: the ops refuse inputs that require grad under grad mode (call under torch.no_grad())."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ... import ops
from .attention import lowbit_attention_forward, sliding_window_bounds


class LowbitRMSNorm(nn.Module):
    """y = x * rsqrt(mean(x^2) + eps) * weight through `ops.rms_norm` (fp32 math, one rounding)."""

    def __init__(self, original: nn.Module, eps: float):
        super().__init__()
        self.weight = original.weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        y = ops.rms_norm(hidden_states.reshape(-1, shape[-1]), self.weight, self.variance_epsilon).out
        return y.view(shape)


def _fuse_linears(first: nn.Linear, second: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """One [first; second] weight (and bias) whose halves become the two layers' parameters (views of it, so
    the pair is stored once and keeps its state-dict names)."""
    n = first.weight.shape[0]
    weight = torch.cat([first.weight.detach(), second.weight.detach()])
    first.weight, second.weight = nn.Parameter(weight[:n], False), nn.Parameter(weight[n:], False)
    bias = None
    if first.bias is not None:
        bias = torch.cat([first.bias.detach(), second.bias.detach()])
        first.bias, second.bias = nn.Parameter(bias[:n], False), nn.Parameter(bias[n:], False)
    return weight, bias


class LowbitSwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): one GEMM for gate and up (their weights fused), `ops.swiglu` (silu)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = original.gate_proj, original.up_proj, original.down_proj
        weight, bias = _fuse_linears(self.gate_proj, self.up_proj)
        self.register_buffer("gate_up_weight", weight, persistent=False)
        self.register_buffer("gate_up_bias", bias, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = nn.functional.linear(x, self.gate_up_weight, self.gate_up_bias)
        return self.down_proj(ops.swiglu(gate_up, activation="silu"))


class LowbitAttention(nn.Module):
    """Llama / GPT-OSS / Qwen3-MoE attention: q/k/v projections, Qwen3's per-head q / k RMSNorms if the layer has
    them (the original's `q_norm` / `k_norm`, adopted as they are: the patch swaps them for `LowbitRMSNorm`s
    first), NeoX RoPE through `ops.rope` on the model's cos/sin cache (shared by all layers), the transformers KV
    cache, then `lowbit_attention_forward` (causal, GQA, the layer's sliding window, sinks if the layer has them)
    and the output projection. With a `LowbitPagedCache` the cache stores the keys in its pages and runs the paged
    attention ops itself."""

    def __init__(self, original: nn.Module, cos_sin_cache: Tensor):
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, getattr(original, name))
        self.sinks = getattr(original, "sinks", None)
        self.q_norm, self.k_norm = getattr(original, "q_norm", None), getattr(original, "k_norm", None)
        self.layer_idx, self.head_dim, self.scaling = original.layer_idx, original.head_dim, original.scaling
        self.sliding_window = getattr(original, "sliding_window", None)
        self.config = original.config
        self.register_buffer("cos_sin_cache", cos_sin_cache, persistent=False)

    def forward(self, hidden_states: Tensor, position_embeddings=None, attention_mask: Tensor | None = None,
                past_key_values=None, position_ids: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
        b, s, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b * s, -1, self.head_dim)
        k = self.k_proj(hidden_states).view(b * s, -1, self.head_dim)
        v = self.v_proj(hidden_states).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:  # Qwen3: each head's q and k normalized over head_dim, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if position_ids is None:
            raise ValueError("lowbit attention: argument 'position_ids': the patched attention needs the positions "
                             "the model passes its layers")
        q, k = ops.rope(q, k, position_ids.expand(b, s).reshape(-1), self.cos_sin_cache, is_neox=True)
        if getattr(past_key_values, "lowbit_paged", False):  # LowbitPagedCache: paged writes + paged attention
            out = past_key_values.attend(self.layer_idx, q.view(b, s, -1, self.head_dim),
                                         k.view(b, s, -1, self.head_dim), v.transpose(1, 2), attention_mask,
                                         scaling=self.scaling, window=sliding_window_bounds(self.sliding_window),
                                         sinks=None if self.sinks is None else self.sinks.float())
            return self.o_proj(out.reshape(b, s, -1)), None
        q, k = q.view(b, s, -1, self.head_dim).transpose(1, 2), k.view(b, s, -1, self.head_dim).transpose(1, 2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        out, _ = lowbit_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling,
                                          sliding_window=self.sliding_window, s_aux=self.sinks)
        return self.o_proj(out.reshape(b, s, -1)), None
