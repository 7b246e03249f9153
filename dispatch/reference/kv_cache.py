"""Reference paged KV-cache FP8 writes and gathers: generic E4M3 and the two DeepSeek byte layouts.

These functions are the contract (docs/kv_cache.md draws the bytes). Conventions shared by all:

* slot_mapping[t] = block * block_size + offset is where token t goes; slot -1 means "skip" (vLLM).
  Slots >= num_blocks * block_size are skipped too (no out-of-bounds write); `LOWBIT_CHECK_INDICES=1`
  turns both that and out-of-range positions into a host-side error (one sync, for debugging).
* Gathers read given slots back; slot -1 returns a row of zeros, other out-of-range slots a row of NaN.
* E4M3 codes: RNE, saturating at +-448, NaN -> 0x7F (dispatch/reference/formats.py e4m3_encode), of
  x / scale computed as one IEEE fp32 division.

Scales:
* generic static: one fp32 per tensor given by the caller (decode form: value = code * scale).
* generic dynamic: per token per head, s = max(amax, 1e-10) / 448 (fp32), stored in a [NB, BS, H] cache.
* DeepSeek (V3.2 and V4): per tile, s = pow2_ceil(max(amax / 448, 1e-4)) (FlashMLA tests/quant.py: its
  1e-4 floor and round-up to a power of two; lowbit rounds up exactly on the bits instead of via log2).
"""

from __future__ import annotations

import torch

from triton_ops.contract.formats import E4M3_MAX
from triton_ops.contract.kv_cache import DS_LAYOUTS, DS_ROPE, DS_SCALE_FLOOR, DYNAMIC_EPS

from .formats import div_rn, e4m3_encode, exponent_field, pow2_ceil
from .rope import cos_sin_at, rotate


def e4m3_decode_table(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E4M3 bytes -> fp32 values (exact; 0x7F/0xFF -> NaN)."""
    return codes.contiguous().view(torch.float8_e4m3fn).float()


def _slot_parts(slot_mapping: torch.Tensor, num_blocks: int, block_size: int):
    s = slot_mapping.long()
    valid = (s >= 0) & (s < num_blocks * block_size)
    s = s.clamp(0, max(num_blocks * block_size - 1, 0))
    return valid, s // block_size, s % block_size


def dynamic_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 [T, H]: max(amax over D, 1e-10) / 448."""
    return div_rn(torch.clamp_min(x.float().abs().amax(-1), DYNAMIC_EPS), E4M3_MAX)


def paged_kv_write_fp8(x, slot_mapping, cache, scale, scale_cache):
    """x [T, H, D] -> cache [NB, BS, H, D] (E4M3 bytes) at the slots; scale: static fp32 scalar tensor, or
    None for dynamic per-(token, head) scales written to scale_cache [NB, BS, H]."""
    nb, bs = cache.shape[0], cache.shape[1]
    valid, blk, off = _slot_parts(slot_mapping, nb, bs)
    if not bool(valid.any()):
        return
    xv = x[valid].float()
    s = scale.float().reshape(()) if scale is not None else dynamic_scales(xv)
    codes = e4m3_encode(xv / (s if scale is not None else s[..., None]))
    cache.view(torch.float8_e4m3fn)[blk[valid], off[valid]] = codes
    if scale is None:
        scale_cache[blk[valid], off[valid]] = s


def paged_kv_gather_fp8(cache, slots, scale, scale_cache, out_dtype):
    """[N, H, D] out_dtype: e4m3 value * scale (fp32), one rounding. Slot -1 -> zeros, other bad slots -> NaN."""
    nb, bs = cache.shape[0], cache.shape[1]
    valid, blk, off = _slot_parts(slots, nb, bs)
    vals = e4m3_decode_table(cache.view(torch.uint8)[blk, off])
    s = scale.float().reshape(()) if scale is not None else scale_cache[blk, off].float()[..., None]
    out = vals * s
    pad = torch.where(slots.long() == -1, 0.0, float("nan")).to(out)
    out = torch.where(valid[:, None, None], out, pad[:, None, None])
    return out.to(out_dtype)


# ----------------------------------------------------------------------------------------- DeepSeek


def ds_tile_scales(nope: torch.Tensor, tile: int) -> torch.Tensor:
    """fp32 [T, tiles]: pow2_ceil(max(amax_tile / 448, 1e-4)); NaN stays NaN, Inf stays Inf."""
    t = nope.shape[0]
    amax = nope.float().reshape(t, -1, tile).abs().amax(-1)
    return pow2_ceil(torch.clamp_min(div_rn(amax, E4M3_MAX), DS_SCALE_FLOOR))


def ds_token_bytes(kv: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(data bytes [T, ...], scale bytes [T, ...]) of each token, in the layout's order.
    kv: [T, d] with the rope part already rotated (or not), any float dtype."""
    L = DS_LAYOUTS[layout]
    t = kv.shape[0]
    nope, rope = kv[:, : L.d_nope].float(), kv[:, L.d_nope:]
    s = ds_tile_scales(nope, L.tile)
    codes = e4m3_encode((nope.reshape(t, L.num_tiles, L.tile) / s[..., None]).reshape(t, L.d_nope))
    code_b = codes.view(torch.uint8)
    rope_b = rope.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(t, 2 * DS_ROPE)
    if layout == "v32":
        scale_b = s.contiguous().view(torch.uint8).reshape(t, 4 * L.num_tiles)
        return torch.cat([code_b, scale_b, rope_b], 1), scale_b.new_empty(t, 0)
    e8m0 = exponent_field(s).to(torch.uint8)  # power of two -> its biased exponent; NaN/Inf -> 0xFF
    return torch.cat([code_b, rope_b], 1), torch.cat([e8m0, e8m0.new_zeros(t, 1)], 1)


def _block_bytes(cache: torch.Tensor) -> torch.Tensor:
    """uint8 view [num_blocks, block_size * token_bytes] of a [NB, BS, (1,) token_bytes] cache: each block's
    bytes are contiguous (the ops check it), only the block stride is free. Indexing this view (instead of an
    as_strided flat view, which torch.compile cannot functionalize when written through) keeps the reference
    compilable by inductor."""
    c = cache.view(torch.uint8)
    return c.view(c.shape[0], c.shape[1] * c.shape[-1])


def ds_cache_geometry(cache: torch.Tensor) -> tuple[int, int, int]:
    """(num_blocks, block_size, block stride in bytes) of a [NB, BS, (1,) token_bytes] cache."""
    return cache.shape[0], cache.shape[1], cache.view(torch.uint8).stride(0)


def ds_offsets(layout: str, off, block_size: int):
    """Byte offsets inside the block (data [T, n_data], scales [T, n_scale]) of tokens at the given offsets."""
    L = DS_LAYOUTS[layout]
    if layout == "v32":
        data = off[:, None] * L.token_bytes + torch.arange(L.token_bytes, device=off.device)
        return data, data[:, :0]
    per = L.d_nope + 2 * DS_ROPE
    data = off[:, None] * per + torch.arange(per, device=off.device)
    scales = block_size * per + off[:, None] * 8 + torch.arange(8, device=off.device)
    return data, scales


def ds_kv_write(kv, slot_mapping, cache, layout):
    """kv [T, d] (d = 576 for v32, 512 for v4) -> the paged DeepSeek cache at the slots."""
    nb, bs, _ = ds_cache_geometry(cache)
    valid, blk, off = _slot_parts(slot_mapping, nb, bs)
    if not bool(valid.any()):
        return
    data_b, scale_b = ds_token_bytes(kv[valid], layout)
    blk = blk[valid][:, None]
    d_off, s_off = ds_offsets(layout, off[valid], bs)
    raw = _block_bytes(cache)
    raw[blk, d_off] = data_b
    raw[blk, s_off] = scale_b


def ds_rope_quant_append(kv, positions, cos_sin_cache, slot_mapping, cache, layout, q, is_neox):
    """Fused op's contract: rotate the last 64 dims of kv (and of q, in place, when given), then ds_kv_write.
    The rotated kv rope values are rounded once, to bf16, for the cache (never to kv's dtype first)."""
    cos, sin = cos_sin_at(cos_sin_cache, positions)
    L = DS_LAYOUTS[layout]
    rope = rotate(kv[:, None, L.d_nope:].float(), cos, sin, is_neox, False)[:, 0]
    ds_kv_write(torch.cat([kv[:, : L.d_nope].float(), rope], 1), slot_mapping, cache, layout)
    if q is not None:
        qo = q.shape[-1] - DS_ROPE
        q[..., qo:] = rotate(q[..., qo:].float(), cos, sin, is_neox, False).to(q.dtype)


def ds_kv_gather(cache, slots, layout, out_dtype):
    """[N, d] out_dtype from the DeepSeek cache: e4m3 * tile scale (fp32) for NoPE, bf16 RoPE as is."""
    L = DS_LAYOUTS[layout]
    nb, bs, _ = ds_cache_geometry(cache)
    valid, blk, off = _slot_parts(slots, nb, bs)
    n = slots.shape[0]
    d_off, s_off = ds_offsets(layout, off, bs)
    raw = _block_bytes(cache)
    data = raw[blk[:, None], d_off]
    codes = e4m3_decode_table(data[:, L.nope_at: L.nope_at + L.d_nope])
    rope = data[:, L.rope_at: L.rope_at + 2 * DS_ROPE].contiguous().view(torch.bfloat16).float()
    if layout == "v32":
        s = data[:, L.scale_at: L.scale_at + 4 * L.num_tiles].contiguous().view(torch.float32)
    else:
        e = raw[blk[:, None], s_off][:, : L.num_tiles].to(torch.int32)
        s = torch.where(e == 0xFF, float("nan"), torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - 127))
    nope = (codes.reshape(n, L.num_tiles, L.tile) * s[..., None]).reshape(n, L.d_nope)
    out = torch.cat([nope, rope], 1)
    pad = torch.where(slots.long() == -1, 0.0, float("nan")).to(out)
    return torch.where(valid[:, None], out, pad[:, None]).to(out_dtype)


def ds_kv_cache_empty(num_blocks: int, block_size: int, layout: str, device=None) -> torch.Tensor:
    """A zeroed uint8 cache [NB, BS, 1, token_bytes] shaped like FlashMLA's (V4: each block padded to a
    multiple of 576 bytes, so the block stride exceeds BS * 584). View it as float8_e4m3fn if a kernel
    wants that dtype; the bytes are the same."""
    L = DS_LAYOUTS[layout]
    per_block = L.padded_block_bytes(block_size)
    buf = torch.zeros(num_blocks, per_block, dtype=torch.uint8, device=device)
    return buf[:, : block_size * L.token_bytes].view(num_blocks, block_size, 1, L.token_bytes)
