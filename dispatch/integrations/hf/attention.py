"""The attention function the patched transformers attention modules call, registered with transformers as the
attention implementation "lowbit" (its mask function is the FlashAttention one: a 2-D padding mask or None).

transformers hands the function q (B, Hq, Sq, D) and the cached k / v (B, Hkv, Sk, D); the query rows are the
last Sq of the Sk key positions (bottom-right causal). Without padding the batch goes to `ops.attention` as it
is; with a left-padding mask each sequence is packed without its padding for `ops.attention_prefill` (one host
sync to size the packing), and padding query rows come out as zeros (no real token reads them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ... import ops

IMPLEMENTATION = "lowbit"


class UnsupportedMaskError(ValueError):
    """An attention mask the lowbit attention cannot express (only left padding is supported)."""


def sliding_window_bounds(sliding_window: int | None) -> tuple[int, int]:
    """transformers' sliding_window W lets query i see keys j with i - W < j <= i: lowbit's (left, right) window
    (W - 1, 0); None is no window."""
    return (-1, -1) if sliding_window is None else (int(sliding_window) - 1, 0)


def _left_padding_lengths(mask: Tensor, sk: int) -> Tensor:
    """Per-sequence count of real keys from a 2-D padding mask (B, Sk); refuses anything but left padding."""
    mask = mask[:, -sk:].bool()
    lengths = mask.sum(dim=1)
    expected = torch.arange(sk, device=mask.device)[None, :] >= (sk - lengths)[:, None]
    if not torch.equal(mask, expected):
        raise UnsupportedMaskError("lowbit attention: argument 'attention_mask': only left padding is supported "
                                   "(each row zeros then ones)")
    return lengths


def _packed(q, k, v, lengths, scaling, window, sinks):
    """Attention over the real tokens of each left-padded sequence, packed varlen; zeros on padding rows."""
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    lengths_q = lengths.clamp(max=sq)
    q_rows = torch.arange(sq, device=q.device)[None, :] >= (sq - lengths_q)[:, None]
    k_rows = torch.arange(sk, device=q.device)[None, :] >= (sk - lengths)[:, None]
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    cu_q = torch.cat([zero, lengths_q.cumsum(0).to(torch.int32)])
    cu_k = torch.cat([zero, lengths.cumsum(0).to(torch.int32)])
    q_idx, k_idx = q_rows.reshape(-1).nonzero().squeeze(1), k_rows.reshape(-1).nonzero().squeeze(1)
    out = ops.attention_prefill(q.reshape(b * sq, hq, d)[q_idx], k.reshape(b * sk, *k.shape[2:])[k_idx],
                                v.reshape(b * sk, *v.shape[2:])[k_idx], cu_q, cu_k, sq, sk, softmax_scale=scaling,
                                causal=True, window=window, sinks=sinks)
    full = out.new_zeros(b * sq, hq, out.shape[-1])
    full[q_idx] = out
    return full.view(b, sq, hq, -1)


def lowbit_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             sliding_window: int | None = None, s_aux: Tensor | None = None,
                             **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature: returns (out (B, Sq, Hq, Dv), None); causal, GQA, optional
    sliding window and per-head sink logits (s_aux, GPT-OSS)."""
    if dropout:
        raise ValueError(f"lowbit attention: argument 'dropout': inference only, got {dropout}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    window = sliding_window_bounds(sliding_window)
    sinks = None if s_aux is None else s_aux.float()
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedMaskError("lowbit attention: argument 'attention_mask': expected the 2-D padding mask of "
                                   f"the 'lowbit' mask function, got shape {tuple(attention_mask.shape)}")
    if attention_mask is None or bool(attention_mask[:, -k.shape[1]:].all()):
        return ops.attention(q, k, v, softmax_scale=scaling, causal=True, window=window, sinks=sinks), None
    return _packed(q, k, v, _left_padding_lengths(attention_mask, k.shape[1]), scaling, window, sinks), None


def register() -> None:
    """Make "lowbit" a transformers attention implementation (idempotent: the registries are dicts)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(IMPLEMENTATION, lowbit_attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, flash_attention_mask)
