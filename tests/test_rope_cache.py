"""The public RoPE cache builder (dispatch/rope_cache.py): plain, linear, Llama-3 and YaRN / DeepSeek-YaRN."""

from __future__ import annotations

import math

import pytest
import torch

from dispatch import ops
from dispatch.rope_cache import LinearScaling, Llama3Scaling, YarnScaling, rope_cos_sin_cache


def _angles_and_magnitude(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = cache.shape[1] // 2
    c, s = cache[:, :half].double(), cache[:, half:].double()
    return torch.atan2(s, c), torch.sqrt(c * c + s * s)


def _inv_freq(cache: torch.Tensor) -> torch.Tensor:
    """Per-pair angle step, read from position 1 (angle(1) = inv_freq for every pair below pi)."""
    angles, _ = _angles_and_magnitude(cache)
    return angles[1]


def test_plain_is_the_reference_cache():
    from dispatch.reference.rope import rope_cos_sin_cache as ref
    assert torch.equal(rope_cos_sin_cache(64, 32), ref(64, 32))


def test_linear_divides_positions():
    plain = rope_cos_sin_cache(64, 16)
    lin = rope_cos_sin_cache(128, 16, scaling=LinearScaling(2.0))
    assert torch.allclose(lin[::2], plain, atol=1e-6)
    assert torch.equal(rope_cos_sin_cache(32, 16, scaling=LinearScaling(1.0)), rope_cos_sin_cache(32, 16))


@pytest.mark.parametrize("mscale_all_dim, want_m", [(0.0, 0.1 * math.log(40) + 1), (1.0, 1.0)])
def test_yarn_bands_and_magnitude(mscale_all_dim, want_m):
    rot, base, factor, orig = 64, 10000.0, 40.0, 4096
    s = YarnScaling(factor, orig, mscale_all_dim=mscale_all_dim)
    cache = rope_cos_sin_cache(8, rot, base, scaling=s)
    _, mag = _angles_and_magnitude(cache)
    assert torch.allclose(mag, torch.full_like(mag, want_m), rtol=1e-6)
    plain_inv = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    inv = _inv_freq(cache)
    lo = math.floor(rot * math.log(orig / (32 * 2 * math.pi)) / (2 * math.log(base)))
    hi = math.ceil(rot * math.log(orig / (1 * 2 * math.pi)) / (2 * math.log(base)))
    assert torch.allclose(inv[:lo], plain_inv[:lo], rtol=1e-5)  # fast-rotating pairs kept
    assert torch.allclose(inv[hi + 1:], plain_inv[hi + 1:] / factor, rtol=1e-4)  # slow ones interpolated
    between = inv[lo:hi + 1] / plain_inv[lo:hi + 1]
    assert bool(((between <= 1 + 1e-6) & (between >= 1 / factor - 1e-6)).all())
    assert bool((between[1:] <= between[:-1] + 1e-9).all())  # the ramp is monotone


def test_yarn_factor_one_is_plain():
    got = rope_cos_sin_cache(16, 32, scaling=YarnScaling(1.0, 4096))
    assert torch.allclose(got, rope_cos_sin_cache(16, 32), atol=1e-7)


def test_llama3_bands():
    rot, base = 128, 500000.0
    s = Llama3Scaling()
    inv = _inv_freq(rope_cos_sin_cache(4, rot, base, scaling=s))
    plain = 1.0 / base ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    wavelen = 2 * math.pi / plain
    long = wavelen > s.original_max_position / s.low_freq_factor
    short = wavelen < s.original_max_position / s.high_freq_factor
    assert torch.allclose(inv[short], plain[short], rtol=1e-5)
    assert torch.allclose(inv[long], plain[long] / s.factor, rtol=1e-4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="rot"):
        rope_cos_sin_cache(8, 7, scaling=LinearScaling(2.0))
    with pytest.raises(ValueError, match="factor"):
        rope_cos_sin_cache(8, 8, scaling=LinearScaling(0.0))
    with pytest.raises(TypeError, match="unknown scaling"):
        rope_cos_sin_cache(8, 8, scaling="yarn")


def test_public_exports_feed_the_ops():
    assert ops.rope_cos_sin_cache is rope_cos_sin_cache
    cache = ops.ds_kv_cache_empty(2, 16, "v32")
    assert cache.dtype == torch.uint8 and cache.shape == (2, 16, 1, 656)
    q = torch.randn(3, 2, 64)
    out = ops.rope(q, None, torch.tensor([0, 5, 9]), ops.rope_cos_sin_cache(16, 64, scaling=YarnScaling(4.0, 8)),
                   backend="torch")
    assert out.q.shape == q.shape and bool(torch.isfinite(out.q).all())
