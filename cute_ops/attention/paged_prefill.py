"""Paged-prefix (chunked) prefill on sm_90 through the contiguous CuTeDSL forward: `attention_prefill_paged`'s
signature and contract (dispatch/reference/attention.py), composed of three launches, none of which reads a
device value on the host:

1. `triton_ops.attention.paged_gather.gather_paged_kv`: each sequence's seqused_k keys (its cached prefix and its
   new tokens: the KV write ops have already put the new tokens into the cache, so the cache holds them all) read
   through the block table into contiguous varlen K / V in q's dtype (FP8 E4M3 caches dequantized in the same
   pass), with cu_seqlens_k computed on the device; with a sliding window only the keys some query sees. Buffers
   sized B x block-table width (module docstring there).
2. `fmha_sm90.attention_prefill` on (q, gathered k, v, cu_seqlens_q, cu_seqlens_k): bottom-right causal, windows,
   sinks, GQA and the LSE as for any packed varlen call; sequence b's query s sits at key position
   n_b - Sq_b + s, as the paged contract puts it.
3. The plain paged Triton kernel over the flagged sequences only (`attention_prefill_paged_flagged`): those with an
   out-of-range page id or seqused_k past the table, whose masked keys a contiguous kernel cannot represent. Its
   other programs read one flag and exit (a few microseconds), so the semantics equal the plain kernel's.

Cost: the gather reads the cache's K / V of the used keys once and writes them once in q's dtype (FP8: 2 bytes
written per byte read); docs/attention.md puts it beside the attention's time.
"""

from __future__ import annotations

from . import fmha_sm90

# Gathered K + V above this many bytes: the row is refused (the buffers are sized by the block table's width, not
# by the keys in use, which only the device knows); auto falls back to the plain paged kernel.
MAX_GATHER_BYTES = 8 << 30
MAX_BATCH = 65535  # sequences: the gather's and the fixup's grids put the batch on their second axis


def _gather_bytes(q, k_cache, v_cache, block_table) -> int:
    rows = block_table.shape[0] * block_table.shape[1] * k_cache.shape[1]
    return rows * k_cache.shape[2] * (k_cache.shape[3] + v_cache.shape[3]) * q.element_size()


def supports_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                                     softmax_scale, causal, window_left, window_right, sinks, k_scale,
                                     v_scale) -> str | None:
    """Why `attention_prefill_paged` below cannot take these arguments (None: it can)."""
    import torch

    from triton_ops.attention.paged_gather import gather_reason
    from triton_ops.contract.attention import FP8_KV

    if k_cache.dtype not in (q.dtype, *FP8_KV):
        return f"cache dtype {k_cache.dtype} is neither q's dtype nor FP8 E4M3"
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is not None and s.numel() != 1:
            return f"{name}: the gather takes per-tensor scales only, got {s.numel()} elements"
    why = gather_reason(k_cache, v_cache, block_table, seqused_k)
    if why is not None:
        return why
    nbytes = _gather_bytes(q, k_cache, v_cache, block_table)
    if nbytes > MAX_GATHER_BYTES:
        return (f"gathered K / V of B x table width = {nbytes / 2**30:.1f} GiB is above {MAX_GATHER_BYTES >> 30} GiB "
                "(the buffers are sized by the block table)")
    if block_table.shape[0] > MAX_BATCH:
        return f"{block_table.shape[0]} sequences: the gather's grid holds at most {MAX_BATCH} on its batch axis"
    rows = max(block_table.shape[0] * block_table.shape[1] * k_cache.shape[1], 1)
    # stand-ins of the gathered k / v (their layout is all the check reads): contiguous rows of (Hkv, D)
    k = q.new_empty((1, *k_cache.shape[2:])).expand(rows, *k_cache.shape[2:])
    v = q.new_empty((1, *v_cache.shape[2:])).expand(rows, *v_cache.shape[2:])
    cu_k = torch.empty(block_table.shape[0] + 1, dtype=torch.int32, device=q.device)
    return fmha_sm90.supports_attention_prefill(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, 0, softmax_scale, causal,
                                                window_left, window_right, sinks, True)


def attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                            softmax_scale: float | None, causal: bool, window_left: int, window_right: int, sinks,
                            k_scale, v_scale):
    """(out (total_q, Hq, Dv) in q's dtype, lse (total_q, Hq) fp32): gather, contiguous forward, fixup (above)."""
    from triton_ops.attention.paged_gather import gathered_prefill_paged

    return gathered_prefill_paged(fmha_sm90.attention_prefill, q, k_cache, v_cache, cu_seqlens_q, block_table,
                                  seqused_k, max_seqlen_q, softmax_scale, causal, window_left, window_right, sinks,
                                  k_scale, v_scale)


def specialize_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                                      softmax_scale, causal: bool, window_left: int, window_right: int, sinks,
                                      k_scale, v_scale):
    """A launcher prepared for this exact call signature (the dispatch table's `specialize` hook): the gather's two
    launches and the fixup through compiled launchers, the forward through `fmha_sm90`'s prepared launcher
    (triton_ops/attention/paged_gather.py `prepare_gathered_prefill_paged`), or None where the general entry must
    run."""
    from triton_ops.attention.paged_gather import prepare_gathered_prefill_paged

    return prepare_gathered_prefill_paged(fmha_sm90.specialize_attention_prefill, attention_prefill_paged, q, k_cache,
                                          v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, softmax_scale,
                                          causal, window_left, window_right, sinks, k_scale, v_scale)


__all__ = ["attention_prefill_paged", "specialize_attention_prefill_paged", "supports_attention_prefill_paged"]
