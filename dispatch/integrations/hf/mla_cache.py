"""`LowbitMlaCache`: a transformers `Cache` for patched DeepSeek-V3 whose keys and values live as MLA's latent in
pages, one pool per layer: per token the normalized kv latent (kv_lora_rank, 512 in DeepSeek-V3) and the RoPE'd
shared key part k_pe (qk_rope_head_dim, 64), one row of 576, as `ops.mla_decode` reads it. Layouts: "bf16"
((num_pages, page_size, 1, 576) bf16) or DeepSeek V3.2's FP8 "v32" (656 bytes per token: 512 E4M3 | 4 fp32 scales
| 64 bf16 RoPE, written by `ops.ds_kv_write`, read back by `ops.ds_kv_gather` and by `mla_decode` itself).

The conventions are `LowbitPagedCache`'s (it is the base class): pages interleaved across the sequences with one
spare page for the writes of padding tokens, left padding never stored (sequence b holds its tokens at positions
0 .. len[b] - 1, the RoPE positions transformers gives them), per-sequence lengths on the device grown in place, a
decode step with the same shapes and tensors every step and no host sync. The patched DeepSeek attention
(`mla.LowbitMlaAttention`) appends the new latent rows, then decodes with `decode` (absorbed MLA over the pages) or
reads the sequence's latent back with `prefix` to decompress it for the prompt; the patched DeepSeek-V3.2 attention
decodes with the indexer's top-k (`decode`'s indices) and keeps the indexer's keys here (`update_indexer`), numbered as
the latent rows are (sequence b's key i in column i, left padding not stored), so that a decode step scores every
column with the same shapes whatever the step and masks by the device lengths: no host counter shapes the step, and
`GraphedDecode` replays it. Nothing else reads this cache:
`update` (transformers' attention) and `attend` (the Llama / GPT-OSS paged attention) raise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from triton_ops.contract.kv_cache import DS_ROPE

from ... import ops
from .paged_cache import CacheLayerMixin, LowbitPagedCache, PagedCacheError, PagedLayer

LAYOUTS = ("bf16", "v32")
V32_DIMS = (512, 64)  # the V3.2 FP8 layout's (latent, RoPE) widths


class LatentLayer(PagedLayer):
    """One attention layer's latent pages and per-sequence token counts (device int32, updated in place)."""

    def __init__(self, pages: int, page_size: int, width: int, batch_size: int, layout: str, device,
                 max_cache_len: int, indexer_dim: int | None):
        CacheLayerMixin.__init__(self)
        if layout == "bf16":
            self.latent = torch.zeros((pages, page_size, 1, width), dtype=torch.bfloat16, device=device)
        else:
            self.latent = ops.ds_kv_cache_empty(pages, page_size, layout, device=device)
        self.layout, self.width = layout, width
        self.lengths = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self.seen = 0  # transformers' (padded) timeline: prompt width + steps, a host int
        self.max_cache_len = max_cache_len
        # DeepSeek-V3.2's indexer keys (None without an indexer), one spare column for the writes of padding tokens
        self.indexer_keys = None if indexer_dim is None else torch.zeros(
            (batch_size, max_cache_len + 1, indexer_dim), dtype=torch.bfloat16, device=device)
        self._columns = torch.arange(max_cache_len, device=device)  # never written: a decode step's column ids
        self.is_initialized = True

    def indexer_visible(self) -> Tensor:
        """(B, 1, max_cache_len) bool: the indexer columns a decode step may pick, each sequence's first
        lengths[b] (its stored keys, numbered as `update_indexer` stores them)."""
        return self._columns[None, None, :] < self.lengths[:, None, None]

    def write(self, rows: Tensor, slots: Tensor) -> None:
        """rows (T, width) at flat slots (T,) (the spare page's slot for tokens not stored)."""
        if self.layout == "bf16":
            self.latent.view(-1, self.width).index_copy_(0, slots, rows.to(torch.bfloat16))
        else:
            ops.ds_kv_write(rows, slots, self.latent, layout=self.layout)

    def update_indexer(self, keys: Tensor) -> Tensor:
        """DeepSeek-V3.2's indexer keys (B, S, index_head_dim) of the S tokens `append` has just stored (it runs
        first: the lengths count them), kept as the latent rows are: token i of the forward is sequence b's key
        i - S + lengths[b], a padding token's (< 0) goes to the spare column. Returns what the indexer scores: a
        prompt (S > 1, the first forward) its own keys on transformers' padded timeline, as given; a decode step
        every column (B, max_cache_len, index_head_dim), the same tensor each step, the columns at or past each
        sequence's length for the caller to mask (`LowbitSparseMlaAttention`)."""
        if self.indexer_keys is None:
            raise PagedCacheError("LowbitMlaCache.update_indexer: the cache's config has no index_head_dim "
                                  "(DeepSeek-V3.2's indexer): build the cache from the DeepSeek-V3.2 model's config")
        b, s, d = keys.shape
        batch, _, width = self.indexer_keys.shape
        if (b, d) != (batch, width):
            raise PagedCacheError(f"LowbitMlaCache.update_indexer: argument 'keys': expected ({batch}, S, {width}), "
                                  f"got {tuple(keys.shape)}")
        column = torch.arange(s, device=keys.device)[None, :] - s + self.lengths[:, None]
        column = torch.where(column >= 0, column, self.max_cache_len).long()
        self.indexer_keys.scatter_(1, column[..., None].expand(b, s, d), keys.to(self.indexer_keys.dtype))
        return keys if s > 1 else self.indexer_keys[:, : self.max_cache_len]

    def read(self, slots: Tensor) -> Tensor:
        """The rows at flat slots (N,) as bf16 (N, width) (FP8 rows dequantized as `mla_decode` reads them)."""
        if self.layout == "bf16":
            return self.latent.view(-1, self.width).index_select(0, slots)
        return ops.ds_kv_gather(self.latent, slots, layout=self.layout, out_dtype=torch.bfloat16)


class LowbitMlaCache(LowbitPagedCache):
    """Paged latent cache for `model.generate(..., past_key_values=LowbitMlaCache(model.config, batch_size,
    max_cache_len))` on a DeepSeek-V3 model patched by `lowbit_patch`.

    max_cache_len: the most positions of transformers' (left-padded) timeline, prompt width + new tokens; each
    sequence gets ceil(max_cache_len / page_size) pages (page i of sequence b is page i * batch_size + b, one spare
    page at the end). page_size 64 is what the sm_90 MLA decode kernel takes (other sizes run the portable one).
    layout: "bf16", or "v32" (DeepSeek V3.2's FP8 656-byte rows: kv_lora_rank 512 and qk_rope_head_dim 64)."""

    lowbit_paged = False  # not the per-head K / V pages the Llama / GPT-OSS attention reads
    lowbit_latent = True  # what the patched DeepSeek attention looks for

    def __init__(self, config, batch_size: int, max_cache_len: int, *, page_size: int = 64, layout: str = "bf16",
                 device=None):
        if layout not in LAYOUTS:
            raise PagedCacheError(f"LowbitMlaCache: argument 'layout': {layout!r} is not one of {', '.join(LAYOUTS)}")
        for name, value in (("batch_size", batch_size), ("max_cache_len", max_cache_len), ("page_size", page_size)):
            if value < 1:
                raise PagedCacheError(f"LowbitMlaCache: argument '{name}': must be >= 1, got {value}")
        config = config.get_text_config(decoder=True)
        if getattr(config, "kv_lora_rank", None) is None:
            raise PagedCacheError(f"LowbitMlaCache: argument 'config': {config.model_type} has no MLA latent "
                                  "(kv_lora_rank); LowbitPagedCache is the cache of per-head K / V")
        dims = (config.kv_lora_rank, config.qk_rope_head_dim)
        if dims[1] != DS_ROPE:
            raise PagedCacheError(f"LowbitMlaCache: argument 'config': qk_rope_head_dim {dims[1]}; ops.mla_decode's "
                                  f"rows end in {DS_ROPE} RoPE columns")
        if layout == "v32" and dims != V32_DIMS:
            raise PagedCacheError(f"LowbitMlaCache: argument 'layout': 'v32' holds a latent of {V32_DIMS[0]} and "
                                  f"RoPE of {V32_DIMS[1]}, the model's are {dims[0]} and {dims[1]}")
        self.kv_lora_rank, self.layout = config.kv_lora_rank, layout
        pages = self._page_table(batch_size, max_cache_len, page_size, device)
        indexer_dim = getattr(config, "index_head_dim", None)  # DeepSeek-V3.2's indexer
        layers = [LatentLayer(pages, page_size, sum(dims), batch_size, layout, device, max_cache_len, indexer_dim)
                  for _ in range(config.num_hidden_layers)]
        super(LowbitPagedCache, self).__init__(layers=layers)

    def write_prefix(self, *args, **kwargs) -> None:
        raise PagedCacheError("LowbitMlaCache.write_prefix: the latent cache stores latent rows, not per-head keys "
                              "and values (append, or fill_random for benchmarks)")

    def fill_random(self, seed: int = 0, std: float = 1.0) -> None:
        """Fill every page of every layer with normal(0, std) latent rows, stored as the layout stores them (the V3.2
        FP8 rows through `ds_kv_write`), and DeepSeek-V3.2's indexer keys likewise: contents for decode benchmarks
        at long context without a prefill. Lengths unchanged (`set_lengths`)."""
        g = torch.Generator(device=self.block_table.device).manual_seed(seed)
        for layer in self.layers:
            if layer.indexer_keys is not None:
                layer.indexer_keys.normal_(0.0, std, generator=g)
            if layer.layout == "bf16":
                layer.latent.normal_(0.0, std, generator=g)
                continue
            slots = torch.arange(layer.latent.shape[0] * layer.latent.shape[1], device=layer.latent.device)
            for chunk in slots.split(1 << 16):  # no full-size fp32 copy of the pages
                rows = torch.randn(chunk.numel(), layer.width, generator=g, device=chunk.device) * std
                layer.write(rows.to(torch.bfloat16), chunk)

    def attend(self, *args, **kwargs) -> Tensor:
        raise PagedCacheError("LowbitMlaCache.attend: the latent cache is read by the patched DeepSeek-V3 attention "
                              "only (models with per-head K / V take LowbitPagedCache)")

    def append(self, layer_idx: int, rows: Tensor, attention_mask: Tensor | None) -> None:
        """Store the new latent rows (B, S, width) of layer `layer_idx` after each sequence's own tokens; the mask
        (B, >= S) has 1 on real tokens (left padding only) or is None (every token real)."""
        layer = self.layers[layer_idx]
        b, s = rows.shape[:2]
        self._check_room(layer.seen, s)
        self._check_batch(b)
        if rows.dtype != torch.bfloat16:
            raise PagedCacheError(f"LowbitMlaCache.append: argument 'rows': {rows.dtype}; the latent pages and "
                                  "ops.mla_decode's queries are bf16 (a bf16 model)")
        if rows.shape[2] != layer.width:
            raise PagedCacheError(f"LowbitMlaCache.append: argument 'rows': width {rows.shape[2]} != the cache's "
                                  f"{layer.width}")
        slots, new = self._slots(layer.lengths, attention_mask, b, s, rows.device)
        layer.write(rows.reshape(b * s, -1), slots)
        layer.lengths.add_(new)
        layer.seen += s

    def decode(self, layer_idx: int, q: Tensor, scaling: float, indices: Tensor | None = None) -> Tensor:
        """Absorbed MLA over the layer's pages: q (B, 1, H, width) bf16 (the latent-space query, then the RoPE
        part), keys the whole rows, values their first kv_lora_rank columns; returns (B, 1, H, kv_lora_rank).
        indices (B, 1, topk) int32: sparse MLA (DeepSeek-V3.2's indexer), the stored keys each query attends to
        (-1: none, which `mla_decode` skips)."""
        if q.dtype != torch.bfloat16:
            raise PagedCacheError(f"LowbitMlaCache.decode: argument 'q': {q.dtype}; ops.mla_decode takes bf16 "
                                  "queries (a bf16 model)")
        layer = self.layers[layer_idx]
        return ops.mla_decode(q, layer.latent, self.block_table, layer.lengths, indices=indices,
                              layout=layer.layout, v_dim=self.kv_lora_rank, softmax_scale=scaling, causal=True)

    def prefix(self, layer_idx: int) -> tuple[Tensor, Tensor]:
        """Every sequence's stored latent, bf16 (B, P * page_size, width) with P = the pages the timeline has
        reached (rows past a sequence's length hold whatever the page holds), and the lengths (B,) int32."""
        layer = self.layers[layer_idx]
        b, pages = self.block_table.shape[0], math.ceil(layer.seen / self.page_size)
        offsets = torch.arange(self.page_size, device=self.block_table.device)
        slots = (self.block_table[:, :pages, None].long() * self.page_size + offsets).reshape(-1)
        return layer.read(slots).view(b, pages * self.page_size, layer.width), layer.lengths
