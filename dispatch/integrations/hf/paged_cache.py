"""`LowbitPagedCache`: a transformers `Cache` for patched models (Llama, GPT-OSS) whose KV lives in lowbit's paged
layout, `(num_pages, page_size, Hkv, D)` per layer for k and for v, read through a block table; bf16 / fp16 pages, or
FP8 E4M3 pages written by `ops.paged_kv_write_fp8` with a static per-tensor scale.

The patched attention hands the layer its new q / k / v and the 2-D padding mask (the "lowbit" mask function's);
the layer writes the new keys of each sequence after its own real keys (left padding is never stored, so sequence b
holds exactly its tokens at positions 0 .. len[b] - 1, the RoPE positions transformers gives them), then runs
`ops.attention_decode` (one new token per sequence: paged split-KV decode) or `ops.attention_prefill_paged` (the
prompt, or any chunk: every sequence has S query rows; a padding row sits before the sequence's first key and
sees none, so its output is 0). Lengths stay on the device and grow in place; nothing is read back to the host,
and a decode step has the same shapes and tensors every step: `GraphedDecode` (graph.py) captures one in a CUDA
graph, advancing the host counters with `advance` outside it. `set_lengths` / `write_prefix` / `fill_random`
give the sequences contents without a prefill (benchmarks, tests). transformers' own attention cannot read this
cache: `update` raises.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ... import ops

KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


class PagedCacheError(ValueError):
    """A use of LowbitPagedCache it does not support (named argument, reason)."""


@dataclasses.dataclass(frozen=True)
class CacheState:
    """What a step changes in a cache: every layer's device lengths (copies) and host timeline counter."""

    lengths: tuple[Tensor, ...]
    seen: tuple[int, ...]


def _cache_base():
    from transformers.cache_utils import Cache, CacheLayerMixin

    return Cache, CacheLayerMixin


Cache, CacheLayerMixin = _cache_base()


class PagedLayer(CacheLayerMixin):
    """One attention layer's pages and per-sequence key counts (device int32, updated in place)."""

    is_compileable = False

    def __init__(self, pages: int, page_size: int, kv_heads: int, head_dim: int, batch_size: int,
                 kv_dtype: torch.dtype, device, kv_scale: float):
        super().__init__()
        shape = (pages, page_size, kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.values = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.batch_size = batch_size  # transformers' Cache.batch_size reads it from the layers
        self.fp8 = kv_dtype == torch.float8_e4m3fn
        self.scale = torch.full((1,), kv_scale, dtype=torch.float32, device=device) if self.fp8 else None
        self.seen = 0  # transformers' (padded) timeline: prompt width + steps, a host int
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        """The pages are allocated by the constructor (their sizes come from the config)."""

    def update(self, key_states, value_states, *args, **kwargs):
        raise PagedCacheError("LowbitPagedCache.update: the paged cache is read by lowbit's patched attention only "
                              "(patch the model with lowbit_patch before generating with it)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty every sequence (the pages keep their bytes: nothing past a sequence's length is read)."""
        self.lengths.zero_()
        self.seen = 0

    def reorder_cache(self, beam_idx) -> None:
        raise PagedCacheError("LowbitPagedCache.reorder_cache: beam search is not supported (greedy / sampling)")

    def offload(self) -> None:
        raise PagedCacheError("LowbitPagedCache: offloading is not supported (pass offloading=False)")

    def write(self, k: Tensor, v: Tensor, slots: Tensor) -> None:
        """k / v (T, Hkv, D) at flat slots (T,) (the spare page's slot for tokens not stored)."""
        if self.fp8:
            ops.paged_kv_write_fp8(k, slots, self.keys, scale=self.scale)
            ops.paged_kv_write_fp8(v, slots, self.values, scale=self.scale)
            return
        self.keys.view(-1, *self.keys.shape[2:]).index_copy_(0, slots, k.to(self.keys.dtype))
        self.values.view(-1, *self.values.shape[2:]).index_copy_(0, slots, v.to(self.values.dtype))


class LowbitPagedCache(Cache):
    """Paged KV cache for `model.generate(..., past_key_values=LowbitPagedCache(model.config, batch_size,
    max_cache_len))` on a model patched by `lowbit_patch` (Llama, GPT-OSS).

    max_cache_len: the most positions of transformers' (left-padded) timeline, prompt width + new tokens; each
    sequence gets ceil(max_cache_len / page_size) pages. Pages are interleaved across sequences (page i of
    sequence b is page i * batch_size + b) and one spare page at the end takes the writes of padding tokens.
    kv_dtype: bf16 / fp16 (the model's dtype) or torch.float8_e4m3fn (E4M3 codes, value = code * kv_scale for
    k and v: a static per-tensor scale, as `paged_kv_write_fp8` and the attention ops take it; the default 1.0
    covers |k|, |v| <= 448)."""

    lowbit_paged = True  # what the patched attention looks for (transformers is imported only with this module)

    def __init__(self, config, batch_size: int, max_cache_len: int, *, page_size: int = 16,
                 kv_dtype: torch.dtype = torch.bfloat16, kv_scale: float = 1.0, device=None):
        if kv_dtype not in KV_DTYPES:
            raise PagedCacheError(f"LowbitPagedCache: argument 'kv_dtype': {kv_dtype} is not one of "
                                  f"{', '.join(map(str, KV_DTYPES))}")
        for name, value in (("batch_size", batch_size), ("max_cache_len", max_cache_len), ("page_size", page_size)):
            if value < 1:
                raise PagedCacheError(f"LowbitPagedCache: argument '{name}': must be >= 1, got {value}")
        config = config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        pages = self._page_table(batch_size, max_cache_len, page_size, device)
        layers = [PagedLayer(pages, page_size, kv_heads, head_dim, batch_size, kv_dtype, device, kv_scale)
                  for _ in range(config.num_hidden_layers)]
        super().__init__(layers=layers)

    def _page_table(self, batch_size: int, max_cache_len: int, page_size: int, device) -> int:
        """Sets the page size, the capacity, the block table (page i of sequence b is page i * batch_size + b) and
        the spare page's first slot; returns the page count per layer (the sequences' pages and the spare one)."""
        self.page_size, self.max_cache_len_tokens = page_size, max_cache_len
        pages_per_seq = math.ceil(max_cache_len / page_size)
        self.spare_slot = pages_per_seq * batch_size * page_size  # the spare page's first slot
        order = torch.arange(pages_per_seq, dtype=torch.int32)[None, :] * batch_size
        self.block_table = (order + torch.arange(batch_size, dtype=torch.int32)[:, None]).contiguous().to(device)
        return pages_per_seq * batch_size + 1

    def _check_room(self, seen: int, s: int) -> None:
        if seen + s > self.max_cache_len_tokens:
            raise PagedCacheError(f"{type(self).__name__}: {seen} + {s} positions exceed max_cache_len "
                                  f"{self.max_cache_len_tokens}")

    def _check_batch(self, b: int) -> None:
        if b != self.block_table.shape[0]:
            raise PagedCacheError(f"{type(self).__name__}: batch {b} != the cache's batch_size "
                                  f"{self.block_table.shape[0]}")

    def advance(self, s: int) -> None:
        """The host side of a step of `s` positions whose device side ran without Python (a CUDA-graph replay):
        the max_cache_len check, then every layer's timeline counter moves by s. The device lengths are not
        touched (the replayed graph grows them)."""
        for layer in self.layers:
            self._check_room(layer.seen, s)
        for layer in self.layers:
            layer.seen += s

    def snapshot(self) -> CacheState:
        """The per-sequence lengths (device copies) and host counters, for `restore` (a capture's warm-up steps
        write keys after each sequence's last one and grow the lengths; restoring undoes the growth, and the
        written slots are past every length, so nothing reads them)."""
        return CacheState(tuple(layer.lengths.clone() for layer in self.layers),
                          tuple(layer.seen for layer in self.layers))

    def restore(self, state: CacheState) -> None:
        for layer, lengths, seen in zip(self.layers, state.lengths, state.seen, strict=True):
            layer.lengths.copy_(lengths)
            layer.seen = seen

    def set_lengths(self, lengths: Sequence[int]) -> None:
        """Make sequence b hold its first lengths[b] positions in every layer (whatever the pages hold there:
        `write_prefix` or `fill_random` put keys in them). The host counter becomes max(lengths), the padded
        timeline of a left-padded batch of these lengths; one host-to-device copy per layer."""
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch_size or not all(0 <= n <= self.max_cache_len_tokens for n in lengths):
            raise PagedCacheError(f"LowbitPagedCache.set_lengths: argument 'lengths': expected {self.batch_size} "
                                  f"values in [0, {self.max_cache_len_tokens}], got {lengths}")
        host = torch.tensor(lengths, dtype=torch.int32)
        for layer in self.layers:
            layer.lengths.copy_(host)
            layer.seen = max(lengths)

    def write_prefix(self, layer_idx: int, keys: Tensor, values: Tensor, lengths: Sequence[int]) -> None:
        """Store given keys / values (B, L, Hkv, D), RoPE'd as the attention stores them, as positions 0 ..
        lengths[b] - 1 of each sequence b of layer `layer_idx` (rows past lengths[b] are not stored). Does not
        change the lengths: `set_lengths` after writing every layer."""
        layer = self.layers[layer_idx]
        b, width = keys.shape[:2]
        if keys.shape != values.shape or b != self.batch_size or keys.shape[2:] != layer.keys.shape[2:] \
                or width > self.max_cache_len_tokens or len(lengths) != b:
            raise PagedCacheError(f"LowbitPagedCache.write_prefix: arguments 'keys' / 'values' / 'lengths': expected "
                                  f"(B={self.batch_size}, L <= {self.max_cache_len_tokens}, "
                                  f"{', '.join(map(str, layer.keys.shape[2:]))}) and B lengths, got "
                                  f"{tuple(keys.shape)}, {tuple(values.shape)}, {len(lengths)} lengths")
        device = self.block_table.device
        pos = torch.arange(width, dtype=torch.int32, device=device)[None, :].expand(b, width)
        page = self.block_table.gather(1, (pos // self.page_size).long())
        real = pos < torch.tensor([int(n) for n in lengths], dtype=torch.int32, device=device)[:, None]
        slots = torch.where(real, page * self.page_size + pos % self.page_size, self.spare_slot)
        layer.write(keys.reshape(b * width, *keys.shape[2:]), values.reshape(b * width, *values.shape[2:]),
                    slots.reshape(-1).long())

    def fill_random(self, seed: int = 0, std: float = 1.0) -> None:
        """Fill every page of every layer with normal(0, std) keys and values (stored as the cache stores them:
        FP8 pages hold the codes of value / kv_scale): contents for decode benchmarks at long context without a
        prefill. Lengths unchanged (`set_lengths`)."""
        g = torch.Generator(device=self.block_table.device).manual_seed(seed)
        for layer in self.layers:
            for pages in (layer.keys, layer.values):
                if layer.fp8:
                    for chunk in pages.split(1024):  # no full-size fp32 copy of the pages
                        chunk.copy_((torch.randn(chunk.shape, generator=g, device=chunk.device) * std
                                     / layer.scale).to(pages.dtype))
                else:
                    pages.normal_(0.0, std, generator=g)

    @property
    def batch_size(self) -> int:
        return self.block_table.shape[0]

    def crop(self, tokens_to_remove: int) -> None:
        raise PagedCacheError("LowbitPagedCache.crop: not supported (assisted / speculative generation)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise PagedCacheError("LowbitPagedCache.batch_repeat_interleave: not supported (beam search, "
                              "num_return_sequences > 1: size the cache for the expanded batch instead)")

    def batch_select_indices(self, indices) -> None:
        raise PagedCacheError("LowbitPagedCache.batch_select_indices: not supported")

    def attend(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, attention_mask: Tensor | None, *,
               scaling: float, window: tuple[int, int], sinks: Tensor | None) -> Tensor:
        """Store the new keys of layer `layer_idx` and attend: q (B, S, Hq, D), k / v (B, S, Hkv, D), the mask
        (B, >= S) with 1 on real tokens (left padding only) or None; returns (B, S, Hq, Dv)."""
        layer = self.layers[layer_idx]
        b, s = q.shape[:2]
        self._check_room(layer.seen, s)
        self._check_batch(b)
        slots, new = self._slots(layer.lengths, attention_mask, b, s, q.device)
        layer.write(k.reshape(b * s, *k.shape[2:]), v.reshape(b * s, *v.shape[2:]), slots)
        layer.lengths.add_(new)
        layer.seen += s
        scales = dict(k_scale=layer.scale, v_scale=layer.scale) if layer.fp8 else {}
        if s == 1:
            return ops.attention_decode(q, layer.keys, layer.values, self.block_table, layer.lengths,
                                        softmax_scale=scaling, causal=True, window=window, sinks=sinks, **scales)
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * s
        out = ops.attention_prefill_paged(q.reshape(b * s, *q.shape[2:]), layer.keys, layer.values, cu_q,
                                          self.block_table, layer.lengths, s, softmax_scale=scaling, causal=True,
                                          window=window, sinks=sinks, **scales)
        return out.view(b, s, *out.shape[1:])

    def _slots(self, lengths: Tensor, attention_mask: Tensor | None, b: int, s: int, device) -> tuple[Tensor, Tensor]:
        """Flat slots (B * S,) int64 of the new tokens (padding -> the spare slot) and the real-token counts (B,)."""
        if attention_mask is None:
            new = torch.full((b,), s, dtype=torch.int32, device=device)
        else:
            new = (attention_mask[:, -s:] != 0).sum(dim=1, dtype=torch.int32)
        offset = torch.arange(s, device=device, dtype=torch.int32)[None, :] - (s - new)[:, None]  # -k: padding
        pos = lengths[:, None] + offset
        page = self.block_table.gather(1, (pos.clamp(min=0) // self.page_size).long())
        slots = torch.where(offset >= 0, page * self.page_size + pos % self.page_size, self.spare_slot)
        return slots.reshape(-1).long(), new
