"""Reference rotary position embedding (RoPE): the contract every backend matches bit for bit.

Definitions (docs/rope.md has the long form):

* cos_sin_cache: fp32 [max_pos, rot], cos in [:, :rot/2], sin in [:, rot/2:] (the vLLM / FlashInfer
  convention). rot is the rotary width; pair i of a head uses cos[pos, i] and sin[pos, i].
* style: NeoX ("rotate half", is_neox=True) pairs (i, i + rot/2) of the rotary slice;
  GPT-J (interleaved, is_neox=False) pairs (2i, 2i + 1).
* rotary slice: dims [rot_offset, rot_offset + rot) of each head; the other dims pass through unchanged.
* math, fp32, each operation rounded separately (no fused multiply-add; the Triton kernels are compiled
  with fp fusion off so the bits agree):
      forward: o1 = x1*c - x2*s ; o2 = x2*c + x1*s
      inverse: o1 = x1*c + x2*s ; o2 = x2*c - x1*s        (rotation by -angle)
  then one round-to-nearest-even cast to the input dtype.
* positions outside [0, max_pos): the rotary slice of that token's heads becomes NaN (no out-of-bounds
  read, no host sync). `LOWBIT_CHECK_INDICES=1` adds a host-side check (one sync) that raises instead.
"""

from __future__ import annotations

import torch


def rope_cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """fp32 [max_pos, rot] = cat(cos, sin) for inv_freq_i = base^(-2i/rot). Angles in fp64, one rounding.
    Scaled variants (YaRN, NTK, linear) build their own cache with the same layout."""
    if rot <= 0 or rot % 2:
        raise ValueError(f"rope_cos_sin_cache: rot must be a positive even number, got {rot}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)


def cos_sin_at(cos_sin_cache: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 [T, rot/2] for each position; NaN rows where the position is out of range."""
    max_pos, rot = cos_sin_cache.shape
    pos = positions.long()
    valid = (pos >= 0) & (pos < max_pos)
    rows = cos_sin_cache.float()[pos.clamp(0, max(max_pos - 1, 0))] if max_pos else \
        torch.full((pos.numel(), rot), float("nan"), device=pos.device)
    rows = torch.where(valid[:, None], rows, torch.full_like(rows, float("nan")))
    return rows[:, : rot // 2], rows[:, rot // 2:]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool, inverse: bool) -> torch.Tensor:
    """Rotate the fp32 rotary slice x [T, H, rot] with cos/sin [T, rot/2]; returns fp32."""
    half = x.shape[-1] // 2
    if is_neox:
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    if inverse:
        o1 = x1 * c + x2 * s
        o2 = x2 * c - x1 * s
    else:
        o1 = x1 * c - x2 * s
        o2 = x2 * c + x1 * s
    if is_neox:
        return torch.cat([o1, o2], dim=-1)
    return torch.stack([o1, o2], dim=-1).flatten(-2)


def _rope_one(x: torch.Tensor, cos, sin, rot_offset: int, is_neox: bool, inverse: bool) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    out = x.clone(memory_format=torch.contiguous_format)
    sl = slice(rot_offset, rot_offset + rot)
    out[..., sl] = rotate(x[..., sl].float(), cos, sin, is_neox, inverse).to(x.dtype)
    return out


def rope(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    """Out of place: (q_out, k_out), contiguous, same dtype as the inputs."""
    cos, sin = cos_sin_at(cos_sin_cache, positions)
    return (_rope_one(q, cos, sin, rot_offset, is_neox, inverse),
            _rope_one(k, cos, sin, rot_offset, is_neox, inverse))


def rope_(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    """In place on q and k (k may be None)."""
    cos, sin = cos_sin_at(cos_sin_cache, positions)
    q.copy_(_rope_one(q, cos, sin, rot_offset, is_neox, inverse))
    if k is not None:
        k.copy_(_rope_one(k, cos, sin, rot_offset, is_neox, inverse))
