"""Argument checks of the attention ops, shared by every backend (the op runs them before choosing one).

Host-only: shapes, dtypes, strides, devices and plain arguments; never a device value (no sync). Index values
(cu_seqlens, block tables, lengths) are made safe inside the kernels instead (docs/attention.md). Errors name
the op and the argument (contract.checks.fail).
"""

from __future__ import annotations

import math

import torch

from .checks import check_no_grad, fail
from .kv_cache import DS_LAYOUTS, DS_ROPE, check_ds_cache

FLOAT16 = (torch.bfloat16, torch.float16)
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_KV = (torch.float8_e4m3fn, torch.uint8)  # uint8: the same E4M3 bytes, as some caches store them
# A sequence-length argument is an int, or a SymInt when torch.compile traces with dynamic shapes (prefill and
# decode through one compiled model): the fake implementation runs these checks on it.
SEQLEN_TYPES = (int, torch.SymInt)


def _tensor(op, arg, t, ndim, dtypes=None, device=None):
    if not isinstance(t, torch.Tensor):
        fail(op, arg, f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(op, arg, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(op, arg, f"dtype {str(t.dtype).removeprefix('torch.')} is not supported; expected one of "
                      f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}")
    if device is not None and t.device != device:
        fail(op, arg, f"is on {t.device} but 'q' is on {device}")
    if ndim == 1 and t.shape[0] > 1 and t.stride(0) != 1:  # index vectors are read as contiguous int32
        fail(op, arg, f"expected a contiguous vector, got stride {t.stride(0)}")


def window_bound(op, arg, value, side: str = "") -> int:
    """One side of a sliding window as an int: -1 (unbounded) or a key count >= 0. Python and numpy ints (and
    one-element integer tensors, through __index__) pass; bool, floats and anything else are a named error,
    never a silent truncation (7.9 is not 7)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        fail(op, arg, f"{side}expected an int (-1: unbounded, or a key count >= 0), got {value!r}")
    n = value.__index__()
    if n < -1:
        fail(op, arg, f"{side}{n} is neither -1 (unbounded) nor an int >= 0")
    return n


def window_pair(op, window) -> tuple[int, int]:
    """The public `window=(left, right)` argument -> (left, right) ints. Key j is visible to the query at key
    position p iff p - left <= j <= p + right (-1: that side unbounded). Every attention op parses it here."""
    if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
        fail(op, "window", f"must be a pair of ints (left, right), -1 = unbounded, got {window!r}")
    left, right = window
    return window_bound(op, "window", left, "left: "), window_bound(op, "window", right, "right: ")


def _windows(op, window_left, window_right):
    window_bound(op, "window_left", window_left)
    window_bound(op, "window_right", window_right)


def check_cu_seqlens_values(op, arg, cu_seqlens, rows, max_arg, max_seqlen) -> None:
    """The values of cu_seqlens (B + 1,) int32 over a packed tensor of `rows` rows: non-decreasing from >= 0 to
    <= rows, no sequence longer than max_seqlen. Reads the values: callers run it only where that costs no device
    sync (host tensors) or LOWBIT_CHECK_INDICES=1 asks for it; elsewhere the kernels clamp (docs/attention.md)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 \
            or cu_seqlens.shape[0] < 1:
        return  # the op's checks name what is wrong with it
    v = cu_seqlens.tolist()
    if v[0] < 0 or v[-1] > rows:
        fail(op, arg, f"offsets span [{v[0]}, {v[-1]}] but must lie in [0, {rows}] (the packed tensor's rows)")
    lengths = [b - a for a, b in zip(v, v[1:], strict=False)]
    if lengths and min(lengths) < 0:
        i = lengths.index(min(lengths))
        fail(op, arg, f"must be non-decreasing, but entry {i + 1} ({v[i + 1]}) < entry {i} ({v[i]})")
    if lengths and isinstance(max_seqlen, int) and max(lengths) > max_seqlen:
        fail(op, max_arg, f"{max_seqlen} is less than the longest sequence in {arg} ({max(lengths)}): the rows "
                          "past it would not be written")


def _sinks(op, sinks, hq, device):
    if sinks is None:
        return
    _tensor(op, "sinks", sinks, 1, (torch.float32,), device)
    if sinks.shape[0] != hq:
        fail(op, "sinks", f"expected one fp32 logit per query head ({hq},), got shape {tuple(sinks.shape)}")


def _scale(op, softmax_scale):
    if softmax_scale is not None and not isinstance(softmax_scale, (int, float)):
        fail(op, "softmax_scale", f"expected a float or None, got {type(softmax_scale).__name__}")


def _qkv(op, q, k, v, names, kv_ndim, kv_dtypes, q_ndim=3, q_dtypes=QUERY_DTYPES):
    """q (..., Hq, D) against K/V sources of kv_ndim dims (..., Hkv, D) / (..., Hkv, Dv)."""
    _tensor(op, "q", q, q_ndim, q_dtypes)
    _tensor(op, names[1], k, kv_ndim, kv_dtypes)
    _tensor(op, names[2], v, kv_ndim, (k.dtype,))
    for name, t in zip(names, (q, k, v), strict=True):
        if t.device != q.device:
            fail(op, name, f"is on {t.device} but 'q' is on {q.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            fail(op, name, f"the last dim must be contiguous (stride 1), got strides {t.stride()}")
    hq, hkv = q.shape[-2], k.shape[-2]
    if k.shape[-1] != q.shape[-1]:
        fail(op, names[1], f"head dim {k.shape[-1]} != q's {q.shape[-1]}")
    if v.shape[:-1] != k.shape[:-1]:
        fail(op, names[2], f"shape {tuple(v.shape)} does not match {names[1]}'s {tuple(k.shape)} but the last dim")
    if hkv == 0 or hq % hkv:
        fail(op, names[1], f"{hkv} KV heads do not divide q's {hq} heads")
    check_no_grad(op, q, k, v)


def _kv_scales(op, k_cache, k_scale, v_scale, hkv, device, *, per_head: bool):
    fp8 = k_cache.dtype in FP8_KV
    if (k_scale is None) != (v_scale is None):
        fail(op, "k_scale" if k_scale is None else "v_scale", "give both scales or neither")
    if fp8 and k_scale is None:
        fail(op, "k_scale", "an FP8 cache needs k_scale and v_scale (value = code * scale)")
    counts = (1, hkv) if per_head else (1,)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            continue
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() not in counts or s.dim() > 1:
            fail(op, name, f"expected an fp32 tensor of {' or '.join(map(str, counts))} element(s), got "
                           f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
        if s.device != device:
            fail(op, name, f"is on {s.device} but 'q' is on {device}")


def _decode_table(op, block_table, seqused_k, bsz, device):
    """block_table (B, max_blocks) int32 with contiguous rows and seqused_k (B,) int32 of a decode op."""
    _tensor(op, "block_table", block_table, 2, (torch.int32,), device)
    if block_table.shape[0] != bsz or (block_table.shape[1] > 1 and block_table.stride(1) != 1):
        fail(op, "block_table", f"expected ({bsz}, max_blocks) with contiguous rows, got shape "
                                f"{tuple(block_table.shape)} strides {block_table.stride()}")
    _tensor(op, "seqused_k", seqused_k, 1, (torch.int32,), device)
    if seqused_k.shape[0] != bsz:
        fail(op, "seqused_k", f"expected ({bsz},), got {tuple(seqused_k.shape)}")


def _num_splits(op, num_splits):
    if not isinstance(num_splits, int):
        fail(op, "num_splits", f"expected an int (<= 0: chosen from the shapes), got {num_splits!r}")


def check_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                            causal, window_left, window_right, sinks, return_lse) -> None:
    op = "attention_prefill"
    _qkv(op, q, k, v, ("q", "k", "v"), 3, (q.dtype,) if isinstance(q, torch.Tensor) else None)
    _tensor(op, "cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), q.device)
    _tensor(op, "cu_seqlens_k", cu_seqlens_k, 1, (torch.int32,), q.device)
    if cu_seqlens_q.shape[0] < 1:
        fail(op, "cu_seqlens_q", "expected B + 1 >= 1 entries")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        fail(op, "cu_seqlens_k", f"shape {tuple(cu_seqlens_k.shape)} != cu_seqlens_q's {tuple(cu_seqlens_q.shape)}")
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(n, SEQLEN_TYPES) or n < 0:
            fail(op, name, f"expected an int >= 0, got {n!r}")
    _scale(op, softmax_scale)
    _windows(op, window_left, window_right)
    _sinks(op, sinks, q.shape[1], q.device)


def check_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                                  softmax_scale, causal, window_left, window_right, sinks, k_scale, v_scale) -> None:
    op = "attention_prefill_paged"
    kv_dtypes = ((q.dtype,) if isinstance(q, torch.Tensor) else ()) + FP8_KV
    _qkv(op, q, k_cache, v_cache, ("q", "k_cache", "v_cache"), 4, kv_dtypes)
    _tensor(op, "cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), q.device)
    if cu_seqlens_q.shape[0] < 1:
        fail(op, "cu_seqlens_q", "expected B + 1 >= 1 entries")
    batch = cu_seqlens_q.shape[0] - 1
    _tensor(op, "block_table", block_table, 2, (torch.int32,), q.device)
    _tensor(op, "seqused_k", seqused_k, 1, (torch.int32,), q.device)
    if block_table.shape[0] != batch or (block_table.shape[1] > 1 and block_table.stride(-1) != 1):
        fail(op, "block_table", f"expected ({batch}, max_blocks) with unit column stride, got shape "
                                f"{tuple(block_table.shape)} strides {block_table.stride()}")
    if seqused_k.shape[0] != batch:
        fail(op, "seqused_k", f"expected ({batch},), got {tuple(seqused_k.shape)}")
    if k_cache.shape[1] < 1:
        fail(op, "k_cache", "block_size must be >= 1")
    if not isinstance(max_seqlen_q, SEQLEN_TYPES) or max_seqlen_q < 0:
        fail(op, "max_seqlen_q", f"expected an int >= 0, got {max_seqlen_q!r}")
    _scale(op, softmax_scale)
    _windows(op, window_left, window_right)
    _sinks(op, sinks, q.shape[1], q.device)
    _kv_scales(op, k_cache, k_scale, v_scale, k_cache.shape[2], q.device, per_head=False)


def check_attention_decode(q, k_cache, v_cache, block_table, seqused_k, softmax_scale, causal, window_left,
                           window_right, sinks, k_scale, v_scale, num_splits) -> None:
    op = "attention_decode"
    _tensor(op, "q", q, 4, FLOAT16)
    bsz, _, hq, d = q.shape
    _qkv(op, q, k_cache, v_cache, ("q", "k_cache", "v_cache"), 4, (q.dtype,) + FP8_KV, q_ndim=4, q_dtypes=FLOAT16)
    _decode_table(op, block_table, seqused_k, bsz, q.device)
    _num_splits(op, num_splits)
    _scale(op, softmax_scale)
    _windows(op, window_left, window_right)
    _sinks(op, sinks, hq, q.device)
    _kv_scales(op, k_cache, k_scale, v_scale, k_cache.shape[2], q.device, per_head=True)
    if k_cache.dtype not in FP8_KV and k_scale is not None:
        fail(op, "k_scale", "scales apply to FP8 caches only; pass None for a 16-bit cache")


def check_merge_attn_states(out_a, lse_a, out_b, lse_b) -> None:
    op = "merge_attn_states"
    _tensor(op, "out_a", out_a, 3, QUERY_DTYPES)
    _tensor(op, "out_b", out_b, 3, (out_a.dtype,), out_a.device)
    if out_b.shape != out_a.shape:
        fail(op, "out_b", f"expected out_a's shape {tuple(out_a.shape)}, got {tuple(out_b.shape)}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        _tensor(op, name, lse, 2, (torch.float32,), out_a.device)
        if lse.shape != out_a.shape[:2]:
            fail(op, name, f"expected shape {tuple(out_a.shape[:2])} (tokens, heads), got {tuple(lse.shape)}")
    check_no_grad(op, out_a, out_b)


MLA_LAYOUTS = ("bf16", "v32", "v4")
MLA_MAX_Q = 8  # speculative (MTP) tokens per sequence


def check_mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal,
                     window_left, num_splits) -> None:
    op = "mla_decode"
    _tensor(op, "q", q, 4, (torch.bfloat16,))
    bsz, sq, _, d = q.shape
    if q.stride(-1) != 1:
        fail(op, "q", f"the last dim must be contiguous (stride 1), got strides {q.stride()}")
    if not 1 <= sq <= MLA_MAX_Q:
        fail(op, "q", f"{sq} queries per sequence: expected 1..{MLA_MAX_Q}")
    if layout not in MLA_LAYOUTS:
        fail(op, "layout", f"{layout!r} is not one of {', '.join(MLA_LAYOUTS)}")
    if layout == "bf16":
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() not in (3, 4):
            fail(op, "kv_cache", "expected a (num_blocks, block_size, (1,) D) bf16 tensor")
        _tensor(op, "kv_cache", kv_cache, kv_cache.dim(), (torch.bfloat16,), q.device)
        if kv_cache.dim() == 4 and kv_cache.shape[2] != 1:
            fail(op, "kv_cache", f"MLA has one latent KV head, got shape {tuple(kv_cache.shape)}")
        if kv_cache.shape[-1] != d or kv_cache.stride(-1) != 1:
            fail(op, "kv_cache", f"expected a contiguous latent of q's width {d}, got shape {tuple(kv_cache.shape)} "
                                 f"strides {kv_cache.stride()}")
        if d <= DS_ROPE:
            fail(op, "q", f"head dim {d} leaves no NoPE part beside the {DS_ROPE} RoPE columns")
    else:
        check_ds_cache(op, kv_cache, layout, "kv_cache")
        if kv_cache.device != q.device:
            fail(op, "kv_cache", f"is on {kv_cache.device} but 'q' is on {q.device}")
        if d != DS_LAYOUTS[layout].d:
            fail(op, "q", f"head dim {d} != {DS_LAYOUTS[layout].d} of layout {layout}")
    if kv_cache.shape[1] < 1:
        fail(op, "kv_cache", "block_size must be >= 1")
    _decode_table(op, block_table, seqused_k, bsz, q.device)
    _num_splits(op, num_splits)
    if indices is not None:
        _tensor(op, "indices", indices, 3, (torch.int32,), q.device)
        if indices.shape[:2] != (bsz, sq) or (indices.shape[2] > 1 and indices.stride(2) != 1):
            fail(op, "indices", f"expected ({bsz}, {sq}, topk) with contiguous rows, got shape "
                                f"{tuple(indices.shape)} strides {indices.stride()}")
    if not isinstance(v_dim, int) or not 1 <= v_dim <= d:
        fail(op, "v_dim", f"expected an int in 1..{d} (the value is the latent's first v_dim columns), got {v_dim!r}")
    _scale(op, softmax_scale)
    _windows(op, window_left, -1)
    check_no_grad(op, q)


def check_mla_index_scores(q, k, weights, softmax_scale, visible) -> None:
    """DeepSeek-V3.2 indexer scores: q (B, S, H, D), k (B, T, D) in q's dtype, weights (B, S, H) fp32, visible
    (B, S, T) bool or None, softmax_scale a finite float > 0."""
    op = "mla_index_scores"
    _tensor(op, "q", q, 4, QUERY_DTYPES)
    bsz, s, h, d = q.shape
    _tensor(op, "k", k, 3, (q.dtype,), q.device)
    if k.shape[0] != bsz or k.shape[2] != d:
        fail(op, "k", f"expected ({bsz}, T, {d}) (q's batch and head dim), got {tuple(k.shape)}")
    _tensor(op, "weights", weights, 3, (torch.float32,), q.device)
    if weights.shape != (bsz, s, h):
        fail(op, "weights", f"expected one fp32 weight per query head {(bsz, s, h)}, got {tuple(weights.shape)}")
    if visible is not None:
        _tensor(op, "visible", visible, 3, (torch.bool,), q.device)
        if visible.shape != (bsz, s, k.shape[1]):
            fail(op, "visible", f"expected (B, S, T) = {(bsz, s, k.shape[1])}, got {tuple(visible.shape)}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        fail(op, "softmax_scale", f"expected a finite float > 0, got {softmax_scale!r}")
    check_no_grad(op, q=q, k=k, weights=weights)
