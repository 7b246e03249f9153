"""Paged-prefix (chunked) prefill on sm_90 through the contiguous CuTeDSL forward: the "cute" row of
`attention_prefill_paged` (its signature and contract: dispatch/reference/attention.py), composed of three
kernel calls, none of which reads a device value on the host:

1. the Triton gather (`triton_ops.attention.paged_gather.gather_paged_kv`): each sequence's seqused_k keys (its
   cached prefix and its new tokens: the KV write ops have already put the new tokens into the cache, so the cache
   holds them all) read through the block table into contiguous varlen K / V in q's dtype (FP8 E4M3 caches
   dequantized in the same pass), with cu_seqlens_k computed on the device; with a sliding window only the keys
   some query sees. Buffers sized B x block-table width (module docstring there).
2. the CuTeDSL dense forward (`cute_ops.attention.fmha_sm90.attention_prefill`) on (q, gathered k, v,
   cu_seqlens_q, cu_seqlens_k): bottom-right causal, windows, sinks, GQA and the LSE as for any packed varlen call;
   sequence b's query s sits at key position n_b - Sq_b + s, as the paged contract puts it.
3. the Triton fixup (`triton_ops.attention.prefill.attention_prefill_paged_flagged`): the plain paged kernel over
   the flagged sequences only, those with an out-of-range page id or seqused_k past the table, whose masked keys a
   contiguous kernel cannot represent. Its other programs read one flag and exit (a few microseconds), so the
   semantics equal the plain kernel's.

`gathered_prefill_paged` / `prepare_gathered_prefill_paged` take the forward as an argument (the contiguous
`attention_prefill` entry signature), so the composition runs on the CPU interpreter with the plain Triton forward
standing in for the CuTe one (tests/test_attention_paged_gather.py).

Cost: the gather reads the cache's K / V of the used keys once and writes them once in q's dtype (FP8: 2 bytes
written per byte read); docs/attention.md puts it beside the attention's time.
"""

from __future__ import annotations

import torch

from cute_ops.attention import fmha_sm90
from triton_ops.attention.paged_gather import (
    gather_buffers,
    gather_paged_kv,
    gather_reason,
    prepare_gather_paged_kv,
)
from triton_ops.attention.prefill import attention_prefill_paged_flagged, prepare_attention_prefill_paged_flagged
from triton_ops.contract.attention import FP8_KV

# Gathered K + V above this many bytes: the row is refused (the buffers are sized by the block table's width, not
# by the keys in use, which only the device knows); auto falls back to the plain paged kernel.
MAX_GATHER_BYTES = 8 << 30
MAX_BATCH = 65535  # sequences: the gather's and the fixup's grids put the batch on their second axis


def _gather_bytes(q, k_cache, v_cache, block_table) -> int:
    rows = block_table.shape[0] * block_table.shape[1] * k_cache.shape[1]
    return rows * k_cache.shape[2] * (k_cache.shape[3] + v_cache.shape[3]) * q.element_size()


def gathered_prefill_paged(forward, q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                           softmax_scale: float | None, causal: bool, window_left: int, window_right: int, sinks,
                           k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention_prefill_paged` (signature and contract) through a contiguous varlen forward `forward` (the
    `attention_prefill` entry signature): the gather, `forward` on the gathered K / V, then the fixup over the
    flagged sequences (module docstring), so the result is the plain kernel's wherever the gather cannot represent
    the keys."""
    k, v, cu_k, flags, cap = gather_paged_kv(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, q.dtype,
                                             cu_seqlens_q, window_left)
    out, lse = forward(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, cap, softmax_scale, causal, window_left,
                       window_right, sinks, True)
    if q.shape[0] and block_table.shape[0]:
        attention_prefill_paged_flagged(out, lse, q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k,
                                        max_seqlen_q, softmax_scale, causal, window_left, window_right, sinks,
                                        k_scale, v_scale, flags)
    return out, lse


def prepare_gathered_prefill_paged(prepare_forward, general, q, k_cache, v_cache, cu_seqlens_q, block_table,
                                   seqused_k, max_seqlen_q: int, softmax_scale: float | None, causal: bool,
                                   window_left: int, window_right: int, sinks, k_scale, v_scale):
    """A launcher for repeated calls of `gathered_prefill_paged` with this exact call signature (dtypes, shapes,
    strides, alignment and plain arguments fixed: dispatch/ops/_common.call keeps it per signature), or None where
    the general path must run. Each part is prepared by its own backend: the gather (`prepare_gather_paged_kv`:
    its buffers and two launches), the forward that `prepare_forward` (the forward entry's per-signature hook, same
    arguments) returns for the gathered K / V's signature, and the fixup (`prepare_attention_prefill_paged_flagged`):
    four launches per call. `general` (the row's entry) runs instead on another current device than q's (the
    launches use the current device's stream); None when q has no rows or the batch is empty."""
    bsz = block_table.shape[0]
    if q.shape[0] == 0 or bsz == 0:
        return None
    if q.device.type == "cuda" and q.device.index != torch.cuda.current_device():  # kernels load on the current one
        return None
    cap = block_table.shape[1] * k_cache.shape[1]
    buffers = gather_buffers(k_cache, v_cache, block_table, q.dtype, window_left >= 0)
    k, v, cu_k, flags, _ = buffers
    forward = prepare_forward(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, cap, softmax_scale, causal, window_left,
                              window_right, sinks, True)
    if forward is None:
        return None
    gather = prepare_gather_paged_kv(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q,
                                     window_left, buffers)
    out = torch.empty((q.shape[0], q.shape[1], v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    fixup = prepare_attention_prefill_paged_flagged(out, lse, q, k_cache, v_cache, cu_seqlens_q, block_table,
                                                    seqused_k, max_seqlen_q, softmax_scale, causal, window_left,
                                                    window_right, sinks, k_scale, v_scale, flags)
    if gather is None or fixup is None:
        return None
    index = q.device.index if q.device.type == "cuda" else None
    get_device = torch._C._cuda_getDevice if index is not None else None

    def prefill(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, softmax_scale, causal,
                window_left, window_right, sinks, k_scale, v_scale):
        if index is not None and get_device() != index:
            return general(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, softmax_scale,
                           causal, window_left, window_right, sinks, k_scale, v_scale)
        k, v, cu_k, flags = gather(k_cache, v_cache, block_table, seqused_k, k_scale, v_scale, cu_seqlens_q)
        out, lse = forward(q, k, v, cu_seqlens_q, cu_k, max_seqlen_q, cap, softmax_scale, causal, window_left,
                           window_right, sinks, True)
        fixup(out, lse, q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, sinks, k_scale, v_scale, flags)
        return out, lse

    return prefill


# ------------------------------------------------------------------------------ the sm_90 cute row of the table


def supports_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                                     softmax_scale, causal, window_left, window_right, sinks, k_scale,
                                     v_scale) -> str | None:
    """Why `attention_prefill_paged` below cannot take these arguments (None: it can): the gather's refusals, the
    buffers' size, and the CuTe forward's refusal of the gathered K / V's layout."""
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
    """(out (total_q, Hq, Dv) in q's dtype, lse (total_q, Hq) fp32): gather, CuTe forward, fixup (above)."""
    return gathered_prefill_paged(fmha_sm90.attention_prefill, q, k_cache, v_cache, cu_seqlens_q, block_table,
                                  seqused_k, max_seqlen_q, softmax_scale, causal, window_left, window_right, sinks,
                                  k_scale, v_scale)


def specialize_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                                       softmax_scale, causal: bool, window_left: int, window_right: int, sinks,
                                       k_scale, v_scale):
    """The table's `specialize` hook: `prepare_gathered_prefill_paged` with the CuTe forward's prepared launcher
    (`fmha_sm90.specialize_attention_prefill`), or None where the general entry must run."""
    return prepare_gathered_prefill_paged(fmha_sm90.specialize_attention_prefill, attention_prefill_paged, q, k_cache,
                                          v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, softmax_scale,
                                          causal, window_left, window_right, sinks, k_scale, v_scale)


__all__ = ["attention_prefill_paged", "gathered_prefill_paged", "prepare_gathered_prefill_paged",
           "specialize_attention_prefill_paged", "supports_attention_prefill_paged"]
