"""Attention ops (prefill, paged prefill, paged decode with split-KV, DeepSeek MLA decode, DeepSeek-V3.2 indexer
scores, LSE merge):
torch.library registration, fakes, typed public API. Contract: dispatch/reference/attention.py; docs: docs/attention.md.

Semantics shared by every op and backend: bottom-right aligned causal masks, sliding windows (left, right; -1 =
unbounded), per-query-head sink logits in the softmax denominator (GPT-OSS), GQA/MQA (query head h reads KV head
h // (Hq // Hkv)), natural-log LSE (sink included). Device index values are never read on the host: out-of-range
cu_seqlens are clamped and out-of-range page ids give masked keys inside the kernels; host cu_seqlens (free to
read) are checked (docs/attention.md, bad input).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from triton_ops.contract.attention import (
    check_attention_decode,
    check_attention_prefill,
    check_attention_prefill_paged,
    check_cu_seqlens_values,
    check_merge_attn_states,
    check_mla_decode,
    check_mla_index_scores,
    window_bound,
    window_pair,
)
from triton_ops.contract.checks import check_tensor, fail
from triton_ops.contract.kv_cache import DS_ROPE

from ._common import call, lowbit_op
from ._fake import is_fake
from .rope import debug_checks, host_values


def _lse_like(q: Tensor, lead: tuple) -> Tensor:
    return q.new_empty((*lead, q.shape[-2]), dtype=torch.float32)


@lowbit_op("attention_prefill", mutates_args=(), check=check_attention_prefill)
def _attention_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float | None, causal: bool,
                       window_left: int, window_right: int, sinks: Tensor | None, return_lse: bool,
                       backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v.shape[-1])), _lse_like(q, q.shape[:1])


@lowbit_op("attention_prefill_paged", mutates_args=(), check=check_attention_prefill_paged)
def _attention_prefill_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, block_table: Tensor,
                             seqused_k: Tensor, max_seqlen_q: int, softmax_scale: float | None, causal: bool,
                             window_left: int, window_right: int, sinks: Tensor | None, k_scale: Tensor | None,
                             v_scale: Tensor | None, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), _lse_like(q, q.shape[:1])


@lowbit_op("attention_decode", mutates_args=(), check=check_attention_decode)
def _attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqused_k: Tensor,
                      softmax_scale: float | None, causal: bool, window_left: int, window_right: int,
                      sinks: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None, num_splits: int,
                      backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v_cache.shape[-1])), _lse_like(q, q.shape[:2])


@lowbit_op("mla_decode", mutates_args=(), check=check_mla_decode)
def _mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seqused_k: Tensor, indices: Tensor | None,
                layout: str, v_dim: int, softmax_scale: float | None, causal: bool, window_left: int,
                num_splits: int, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v_dim)), _lse_like(q, q.shape[:2])


@lowbit_op("merge_attn_states", mutates_args=(), check=check_merge_attn_states)
def _merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor,
                       backend: str) -> tuple[Tensor, Tensor]:
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


@lowbit_op("mla_index_scores", mutates_args=(), check=check_mla_index_scores)
def _mla_index_scores(q: Tensor, k: Tensor, weights: Tensor, softmax_scale: float, visible: Tensor | None,
                      backend: str) -> Tensor:
    return q.new_empty((q.shape[0], q.shape[1], k.shape[1]), dtype=torch.float32)


def _check_offsets(op, q, *checks) -> None:
    """Range checks of cu_seqlens values where they are free to read (host tensors: on every call, including the
    ones the eager fast path serves) or LOWBIT_CHECK_INDICES=1 asks for them (a device sync). checks: (arg,
    cu_seqlens, packed tensor, max_seqlen arg, max_seqlen). Elsewhere the kernels clamp (docs/attention.md)."""
    tensors = [c[1] for c in checks]
    if not all(isinstance(t, Tensor) for t in (q, *tensors)):
        return  # the op's checks name it
    if host_values(q, *tensors) or (debug_checks() and not any(is_fake(t) for t in tensors)):
        for arg, cu, packed, max_arg, max_seqlen in checks:
            rows = packed.shape[0] if isinstance(packed, Tensor) and packed.dim() else 0
            check_cu_seqlens_values(op, arg, cu, rows, max_arg, max_seqlen)


def _scale(softmax_scale, q) -> float | None:
    """The default 1/sqrt(Dqk), resolved before the op (the checks reject a q that is not a tensor)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(q.shape[-1]) if isinstance(q, Tensor) and q.dim() else None
    return float(softmax_scale)


def attention_prefill(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float | None = None,
                     causal: bool = False, window: tuple[int, int] = (-1, -1), sinks: Tensor | None = None,
                     return_lse: bool = False, backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Packed varlen prefill: q (total_q, Hq, Dqk), k (total_k, Hkv, Dqk), v (total_k, Hkv, Dv), bf16/fp16;
    cu_seqlens_q/k int32 (B + 1); max_seqlen_q sizes the grid (an upper bound: rows past it are not written).
    Returns out (total_q, Hq, Dv), and lse (total_q, Hq) fp32 when return_lse."""
    left, right = window_pair("attention_prefill", window)
    _check_offsets("attention_prefill", q, ("cu_seqlens_q", cu_seqlens_q, q, "max_seqlen_q", max_seqlen_q),
                   ("cu_seqlens_k", cu_seqlens_k, k, "max_seqlen_k", max_seqlen_k))
    out, lse = call("attention_prefill", q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                    _scale(softmax_scale, q), bool(causal), left, right, sinks, bool(return_lse), backend)
    return (out, lse) if return_lse else out


def attention(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None = None, causal: bool = False,
              window: tuple[int, int] = (-1, -1), sinks: Tensor | None = None, return_lse: bool = False,
              backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Batched form (B, Sq, Hq, D) / (B, Sk, Hkv, D) of `attention_prefill`: out (B, Sq, Hq, Dv), lse (B, Sq, Hq).
    B = 0 or Sq = 0 gives the empty out / lse of those shapes; Sk = 0 rows see no key (out 0, lse -inf)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor("attention", name, t)
        if t.dim() != 4:
            fail("attention", name, f"expected (B, S, H, D), got shape {tuple(t.shape)}")
        if t.shape[0] != q.shape[0]:
            fail("attention", name, f"batch {t.shape[0]} != q's {q.shape[0]}")
    window = window_pair("attention", window)
    b, sq, hq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[1]
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sq
    cu_k = torch.arange(b + 1, dtype=torch.int32, device=q.device) * sk
    out, lse = attention_prefill(q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
                                 v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, sq, sk, softmax_scale=softmax_scale,
                                 causal=causal, window=window, sinks=sinks, return_lse=True, backend=backend)
    out, lse = out.view(b, sq, hq, out.shape[-1]), lse.view(b, sq, hq)  # explicit sizes: B or Sq may be 0
    return (out, lse) if return_lse else out


def attention_prefill_paged(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, block_table: Tensor,
                            seqused_k: Tensor, max_seqlen_q: int, *, softmax_scale: float | None = None,
                            causal: bool = True, window: tuple[int, int] = (-1, -1), sinks: Tensor | None = None,
                            k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                            return_lse: bool = False, backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Chunked prefill over a paged cache: sequence b's keys are positions 0..seqused_k[b]-1 of k_cache / v_cache
    (num_blocks, block_size, Hkv, D), read through block_table[b] (int32); its new queries (cu_seqlens_q) are the
    last positions. FP8 caches (float8_e4m3fn or uint8 E4M3 bytes) need per-tensor fp32 k_scale / v_scale
    (value = code * scale, as `paged_kv_write_fp8` writes them). Page ids outside [0, num_blocks) give masked keys."""
    left, right = window_pair("attention_prefill_paged", window)
    _check_offsets("attention_prefill_paged", q, ("cu_seqlens_q", cu_seqlens_q, q, "max_seqlen_q", max_seqlen_q))
    out, lse = call("attention_prefill_paged", q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k,
                    int(max_seqlen_q), _scale(softmax_scale, q), bool(causal), left, right, sinks, k_scale, v_scale,
                    backend)
    return (out, lse) if return_lse else out


def attention_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seqused_k: Tensor, *,
                     softmax_scale: float | None = None, causal: bool = True, window: tuple[int, int] = (-1, -1),
                     sinks: Tensor | None = None, k_scale: Tensor | None = None, v_scale: Tensor | None = None,
                     num_splits: int = 0, return_lse: bool = False,
                     backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """Paged decode: q (B, Sq, Hq, D) with Sq in 1..8 (query s sits at key position seqused_k[b] - Sq + s;
    causal among them), caches (num_blocks, block_size, Hkv, D) in q's dtype or FP8 with per-tensor or per-KV-head
    fp32 scales. num_splits <= 0 picks the split-KV count from static sizes (never from seqused_k: CUDA graphs
    replay with new lengths). Returns out (B, Sq, Hq, Dv), and lse (B, Sq, Hq) when return_lse."""
    left, right = window_pair("attention_decode", window)
    out, lse = call("attention_decode", q, k_cache, v_cache, block_table, seqused_k, _scale(softmax_scale, q),
                    bool(causal), left, right, sinks, k_scale, v_scale, int(num_splits), backend)
    return (out, lse) if return_lse else out


def _mla_layout(kv_cache) -> str:
    """The cache layout from its metadata: bf16 -> "bf16", else the DeepSeek FP8 layout of its token width."""
    if not isinstance(kv_cache, Tensor) or kv_cache.dtype == torch.bfloat16:
        return "bf16"
    return {656: "v32", 584: "v4"}.get(kv_cache.shape[-1] if kv_cache.dim() else 0, f"{kv_cache.shape[-1]} B/token")


def mla_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seqused_k: Tensor, *, indices: Tensor | None = None,
               layout: str | None = None, v_dim: int | None = None, softmax_scale: float | None = None,
               causal: bool = True, window_left: int = -1, num_splits: int = 0, return_lse: bool = False,
               backend: str = "auto") -> Tensor | tuple[Tensor, Tensor]:
    """DeepSeek MLA decode (FlashMLA `flash_mla_with_kvcache` semantics, MQA over one latent head): q (B, Sq, H, D)
    bf16 with Sq in 1..8 (query s sits at key position seqused_k[b] - Sq + s); kv_cache the paged latent, layout
    "bf16" ((num_blocks, block_size, (1,) D) bf16), "v32" (DeepSeek V3.2, 656 B per token, D = 576) or "v4"
    (DeepSeek V4, 584 B per token, D = 512), as `ds_kv_write` writes them (layout None: inferred from the cache's
    dtype and token width). The key is the latent row (NoPE + 64 RoPE columns), the value its first v_dim columns
    (default D - 64, the NoPE part). indices (B, Sq, topk) int32 selects the sparse variant: query (b, s) attends
    to the key positions listed (entries < 0 or >= seqused_k[b] are unused; causal also drops positions after the
    query's own). window_left >= 0 (V4's sliding-window layers, bf16 cache): a query at position p sees keys
    p - window_left .. p only. softmax_scale defaults to 1/sqrt(D). num_splits <= 0 picks the split-KV count from
    static sizes (never from seqused_k: CUDA graphs replay with new lengths). Returns out (B, Sq, H, v_dim) bf16,
    and lse (B, Sq, H) fp32 (natural log; -inf for a row with no key) when return_lse."""
    layout = _mla_layout(kv_cache) if layout is None else layout
    if v_dim is None and isinstance(q, Tensor) and q.dim():
        v_dim = q.shape[-1] - DS_ROPE
    out, lse = call("mla_decode", q, kv_cache, block_table, seqused_k, indices, layout, v_dim,
                    _scale(softmax_scale, q), bool(causal), window_bound("mla_decode", "window_left", window_left),
                    int(num_splits), backend)
    return (out, lse) if return_lse else out


def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                      backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Merge two attention results over disjoint key sets (vLLM merge_attn_states semantics): out (T, H, D),
    lse (T, H) fp32 (any strides: vLLM's (H, T) buffer passed transposed works). A part with lse -inf adds
    nothing whatever its out holds; both -inf give out 0, lse -inf; a part with lse NaN or +inf gives that row
    out and lse NaN."""
    return call("merge_attn_states", out_a, lse_a, out_b, lse_b, backend)


def mla_index_scores(q: Tensor, k: Tensor, weights: Tensor, *, softmax_scale: float | None = None,
                     visible: Tensor | None = None, backend: str = "auto") -> Tensor:
    """DeepSeek-V3.2 sparse-attention indexer scores (transformers' `DeepseekV32Indexer` before its top-k): q (B, S,
    H, D) and k (B, T, D) bf16 / fp16 / fp32 (the indexer's RoPE'd queries and keys), weights (B, S, H) fp32 (its
    head weights, already times H ** -0.5) -> (B, S, T) fp32
    out[b, s, t] = sum_h weights[b, s, h] * relu(softmax_scale * q[b, s, h] . k[b, t]), -inf where visible (B, S, T)
    bool is False (None: every key visible). softmax_scale defaults to 1/sqrt(D). The per-head scores (B, S, H, T)
    are never materialized on the Triton backend."""
    if isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool):
        softmax_scale = float(softmax_scale)  # anything else reaches the check as given, to be named there
    elif softmax_scale is None:
        softmax_scale = _scale(None, q)
    return call("mla_index_scores", q, k, weights, softmax_scale, visible, backend)


# ------------------------------------------------------------------------------------------ self-check


def self_check_cases() -> list:
    """Cases for `python -m dispatch check` (GPT-OSS-like heads: hd 64, 8 query heads per KV head, sinks)."""
    from ..selfcheck import Case, normalized_error

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    def prefill(dev, small):
        g = gen(5)
        lens = [7, 0, 19, 1] if small else [1024, 3000, 17, 4096]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        t, hq, hkv, d = cu[-1].item(), 8, 2, 64
        q = torch.randn(t, hq, d, generator=g).bfloat16()
        k = torch.randn(t, hkv, d, generator=g).bfloat16()
        v = torch.randn(t, hkv, d, generator=g).bfloat16()
        sinks = torch.randn(hq, generator=g)
        return (q.to(dev), k.to(dev), v.to(dev), cu.to(dev), cu.to(dev), max(lens), max(lens), 0.125, True, 127, 0,
                sinks.to(dev), True)

    def paged(dev, small, decode):
        g = gen(6)
        b, bs, hq, hkv, d = (3, 16, 8, 2, 64) if small else (8, 64, 64, 8, 64)
        lens = torch.randint(1, 40 if small else 4000, (b,), generator=g, dtype=torch.int32)
        max_blocks = -(-int(lens.max()) // bs)
        nb = b * max_blocks + 3
        table = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
        kc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
        vc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
        sinks = torch.randn(hq, generator=g)
        if decode:
            q = torch.randn(b, 2, hq, d, generator=g).bfloat16()
            return (q.to(dev), kc.to(dev), vc.to(dev), table.to(dev), lens.to(dev), 0.125, True, -1, -1,
                    sinks.to(dev), None, None, 0)
        new = torch.minimum(lens, torch.tensor(5))
        cu = torch.tensor([0] + new.cumsum(0).tolist(), dtype=torch.int32)
        q = torch.randn(int(cu[-1]), hq, d, generator=g).bfloat16()
        return (q.to(dev), kc.to(dev), vc.to(dev), cu.to(dev), table.to(dev), lens.to(dev), int(new.max()), 0.125,
                True, -1, -1, sinks.to(dev), None, None)

    def merge(dev, small):
        g = gen(7)
        t, h, d = (9, 4, 64) if small else (4096, 32, 128)
        lse_a = torch.randn(t, h, generator=g) * 3
        lse_b = torch.randn(t, h, generator=g) * 3
        lse_a[0] = -math.inf
        return (torch.randn(t, h, d, generator=g).bfloat16().to(dev), lse_a.to(dev),
                torch.randn(t, h, d, generator=g).bfloat16().to(dev), lse_b.to(dev))

    def mla(layout, sparse):
        def make(dev, small):
            from ..reference.kv_cache import ds_kv_cache_empty, ds_kv_write

            g = gen(8)
            b, bs, h = (2, 16, 16) if small else (4, 64, 128)
            lens = torch.tensor([37, 50] if small else [4000, 2500, 1, 4096], dtype=torch.int32)
            max_blocks = -(-int(lens.max()) // bs)
            nb = b * max_blocks + 2
            d = 512 if layout == "v4" else 576
            kv = torch.randn(nb * bs, d, generator=g)
            if layout == "bf16":
                cache = kv.bfloat16().view(nb, bs, 1, d)
            else:
                cache = ds_kv_cache_empty(nb, bs, layout)
                ds_kv_write(kv, torch.arange(nb * bs), cache, layout)
            table = torch.randperm(nb, generator=g)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
            q = torch.randn(b, 2, h, d, generator=g).bfloat16()
            idx = None
            if sparse:
                idx = torch.randint(-1, int(lens.max()), (b, 2, 32 if small else 2048), generator=g, dtype=torch.int32)
                idx = idx.to(dev)
            return (q.to(dev), cache.to(dev), table.to(dev), lens.to(dev), idx, layout, d - 64, d ** -0.5, True, -1,
                    0)
        return make

    def close(out, ref):
        err = normalized_error(out[0], ref[0])
        finite = torch.isfinite(ref[1])
        lse_ok = bool(torch.equal(torch.isfinite(out[1]), finite)) and (
            not finite.any() or float((out[1][finite] - ref[1][finite]).abs().max()) <= 1e-2)
        return err <= 2e-2 and lse_ok, f"normalized error {err:.2e}, lse {'ok' if lse_ok else 'differs'}"

    def index_scores(dev, small):
        from ..reference.attention import visible_keys

        g = gen(9)
        b, s, t, h, d = (2, 5, 9, 4, 32) if small else (2, 1024, 1024, 64, 128)
        q = torch.randn(b, s, h, d, generator=g).bfloat16()
        k = torch.randn(b, t, d, generator=g).bfloat16()
        w = torch.randn(b, s, h, generator=g) * h ** -0.5
        visible = visible_keys(s, t, True, (-1, -1))[None].repeat(b, 1, 1)
        visible[1, 0] = False  # a row with no visible key
        return q.to(dev), k.to(dev), w.to(dev), d ** -0.5, visible.to(dev)

    def index_close(out, ref):
        finite = torch.isfinite(ref)
        same_inf = bool(torch.equal(torch.isneginf(out), ~finite))
        err = normalized_error(out[finite], ref[finite])
        return same_inf and err <= 1e-4, f"normalized error {err:.2e}, -inf {'same' if same_inf else 'differs'}"

    return [
        Case("attention_prefill", prefill, close, label="varlen hd64 GQA 8, causal, window 128, sinks"),
        Case("attention_prefill_paged", lambda dev, small: paged(dev, small, False), close,
             label="paged bf16, page 16/64, sinks"),
        Case("attention_decode", lambda dev, small: paged(dev, small, True), close,
             label="paged bf16, Sq=2, sinks, auto splits"),
        Case("merge_attn_states", merge, close, label="bf16, a -inf row"),
        Case("mla_index_scores", index_scores, index_close, label="V3.2 indexer, causal, an all-masked row"),
        Case("mla_decode", mla("bf16", False), close, label="bf16 576, Sq=2, dense (sm_90: the Gluon kernel)"),
        Case("mla_decode", mla("v32", False), close, label="V3.2 FP8 656 B, Sq=2, dense"),
        Case("mla_decode", mla("v4", True), close, label="V4 FP8 584 B, Sq=2, sparse top-k"),
    ]
