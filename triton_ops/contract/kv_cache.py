"""Byte geometry of the KV-cache layouts lowbit writes and reads (docs/kv_cache.md draws the bytes), and the
cache check shared by the ops that write and read them (host metadata only)."""

from __future__ import annotations

import torch

from . import checks

DYNAMIC_EPS = 1e-10
DS_SCALE_FLOOR = 1e-4
DS_ROPE = 64


class DSLayout:
    """Byte geometry of one DeepSeek FP8 KV-cache layout (see docs/kv_cache.md)."""

    def __init__(self, name, d_nope, tile, token_bytes, nope_at, scale_at, rope_at, scale_bytes, blocked):
        self.name, self.d_nope, self.tile = name, d_nope, tile
        self.num_tiles = d_nope // tile
        self.d = d_nope + DS_ROPE
        self.token_bytes = token_bytes  # bytes per token, including this layout's padding
        self.nope_at, self.scale_at, self.rope_at = nope_at, scale_at, rope_at
        self.scale_bytes = scale_bytes  # 4 (fp32) or 1 (E8M0)
        self.blocked = blocked  # V4: [block_size x 576 data][block_size x 8 scales] inside each block

    def min_block_bytes(self, block_size: int) -> int:
        return block_size * self.token_bytes

    def padded_block_bytes(self, block_size: int) -> int:
        """What FlashMLA allocates per block: V4 rounds each block up to a multiple of 576 bytes."""
        b = self.min_block_bytes(block_size)
        return (b + 575) // 576 * 576 if self.blocked else b


DS_LAYOUTS = {
    # 512 E4M3 | 4 x fp32 scale | 64 x bf16 rope, per token (656 B).
    "v32": DSLayout("v32", 512, 128, 656, nope_at=0, scale_at=512, rope_at=528, scale_bytes=4, blocked=False),
    # per token in the data part: 448 E4M3 | 64 x bf16 rope (576 B); scales part: 7 x E8M0 | 1 pad (8 B).
    "v4": DSLayout("v4", 448, 64, 584, nope_at=0, scale_at=None, rope_at=448, scale_bytes=1, blocked=True),
}


# ------------------------------------------------------------------------------------------- checks


CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def check_ds_cache(op, cache, layout, arg="cache"):
    """A [num_blocks, block_size, (1,) token_bytes] uint8 / E4M3 DeepSeek cache: each block's bytes contiguous, the
    block stride and storage offset aligned for the kernels' bf16 / fp32 views."""
    L = DS_LAYOUTS[layout]
    checks.check_tensor(op, arg, cache)
    checks.check_dtype(op, arg, cache, CACHE_DTYPES)
    if cache.dim() not in (3, 4) or cache.shape[-1] != L.token_bytes or (cache.dim() == 4 and cache.shape[2] != 1):
        checks.fail(op, arg, f"expected [num_blocks, block_size, (1,) {L.token_bytes}] bytes for layout {layout}, "
                         f"got shape {tuple(cache.shape)}")
    bs = cache.shape[1]
    st = cache.stride()
    if st[-1] != 1 or st[1] != L.token_bytes:
        checks.fail(op, arg, f"each block's bytes must be contiguous (strides (*, {L.token_bytes}, ..., 1)), got {st}")
    align = 4 if layout == "v32" else 2
    if cache.shape[0] > 1 and (st[0] < bs * L.token_bytes or st[0] % align):
        checks.fail(op, arg, f"block stride {st[0]} must be >= {bs * L.token_bytes} and a multiple of {align}")
    if cache.storage_offset() % align:
        checks.fail(op, arg, f"storage offset {cache.storage_offset()} must be a multiple of {align}")
