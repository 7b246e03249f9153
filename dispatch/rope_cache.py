"""Public builders of the buffers the rope and kv_cache ops read: the RoPE cos/sin cache (plain, linear, Llama-3,
YaRN and DeepSeek-YaRN scaling) and the DeepSeek FP8 KV cache allocator (re-exported from the reference, which
defines the bytes).

The cache layout is the one every rope op takes: fp32 [max_pos, rot] = cat(cos, sin) along the last dim; pair i
uses column i of each half. Angles are computed in fp64 and rounded once to fp32, so a scaling variant with
factor 1 gives exactly the plain cache.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .reference.kv_cache import ds_kv_cache_empty
from .reference.rope import rope_cos_sin_cache as _plain_cache

__all__ = ["LinearScaling", "Llama3Scaling", "YarnScaling", "ds_kv_cache_empty", "rope_cos_sin_cache"]


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Position interpolation: positions are divided by `factor` (HF rope_type "linear")."""

    factor: float


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1 frequency-dependent scaling (HF rope_type "llama3"): wavelengths longer than
    original_max_position / low_freq_factor are divided by `factor`, shorter than original_max_position /
    high_freq_factor kept, and the band between blended linearly in 1/wavelength."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN (HF rope_type "yarn"; DeepSeek-V2/V3 when mscale_all_dim is set).

    Frequencies whose wavelength fits fewer than beta_slow turns in original_max_position are interpolated
    (divided by `factor`), those with more than beta_fast turns kept, and the band between ramped linearly.
    cos and sin are multiplied by the attention scaling m = g(factor, mscale) / g(factor, mscale_all_dim) *
    attn_factor with g(s, m) = 0.1 * m * ln(s) + 1 for s > 1, else 1 (plain YaRN: mscale 1, mscale_all_dim 0,
    i.e. m = 0.1 ln(s) + 1). The cache covers max_pos positions as given (engines pass
    original_max_position * factor)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attn_factor: float = 1.0


def _inv_freq(rot: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn(rot: int, base: float, s: YarnScaling) -> tuple[torch.Tensor, float]:
    def correction_dim(turns: float) -> float:  # the pair index whose wavelength fits `turns` turns
        return rot * math.log(s.original_max_position / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(correction_dim(s.beta_fast)), 0)
    hi = min(math.ceil(correction_dim(s.beta_slow)), rot - 1)
    if lo == hi:
        hi += 0.001  # a one-pair band: avoid 0 / 0
    ramp = ((torch.arange(rot // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    inv = _inv_freq(rot, base)
    keep = 1 - ramp  # 1: extrapolate (high frequency, keep), 0: interpolate (divide by factor)
    inv = inv / s.factor * (1 - keep) + inv * keep
    if s.mscale_all_dim:
        m = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        m = _yarn_mscale(s.factor, s.mscale)
    return inv, m * s.attn_factor


def _llama3(rot: int, base: float, s: Llama3Scaling) -> torch.Tensor:
    inv = _inv_freq(rot, base)
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv / s.factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    band = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(band, blended, out)


def rope_cos_sin_cache(max_pos: int, rot: int, base: float = 10000.0, *,
                       scaling: LinearScaling | Llama3Scaling | YarnScaling | None = None,
                       device=None) -> torch.Tensor:
    """fp32 [max_pos, rot] = cat(cos, sin) for the rope ops; `scaling` picks a context-extension variant."""
    if scaling is None:
        return _plain_cache(max_pos, rot, base, device)
    if rot <= 0 or rot % 2:
        raise ValueError(f"rope_cos_sin_cache: rot must be a positive even number, got {rot}")
    if max_pos < 0:
        raise ValueError(f"rope_cos_sin_cache: max_pos must be >= 0, got {max_pos}")
    if getattr(scaling, "factor", 1) <= 0:
        raise ValueError(f"rope_cos_sin_cache: scaling factor must be > 0, got {scaling}")
    positions = torch.arange(max_pos, dtype=torch.float64)
    magnitude = 1.0
    if isinstance(scaling, LinearScaling):
        inv = _inv_freq(rot, base)
        positions = positions / scaling.factor
    elif isinstance(scaling, Llama3Scaling):
        inv = _llama3(rot, base, scaling)
    elif isinstance(scaling, YarnScaling):
        inv, magnitude = _yarn(rot, base, scaling)
    else:
        raise TypeError(f"rope_cos_sin_cache: unknown scaling {type(scaling).__name__}; expected LinearScaling, "
                        "Llama3Scaling, YarnScaling or None")
    angles = torch.outer(positions, inv)
    return (torch.cat([angles.cos(), angles.sin()], dim=-1) * magnitude).float().to(device)
