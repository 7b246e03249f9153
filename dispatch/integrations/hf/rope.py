"""The RoPE cos/sin cache a patched model's attention reads (`ops.rope`'s fp32 [max_pos, rot] = cat(cos, sin)),
built from the model's config: `ops.rope_cos_sin_cache` for the plain, linear and Llama-3 variants; for YaRN the
model's own inverse frequencies and attention scaling (transformers' YaRN has options, e.g. `truncate=False` on
GPT-OSS, that `YarnScaling` does not mirror), with the angles in fp64 and one rounding like the builder's."""

from __future__ import annotations

import torch

from ... import ops

CACHE_ROPE_TYPES = ("default", "linear", "llama3")
MODEL_FREQ_ROPE_TYPES = ("yarn",)


def rope_type(config) -> str:
    return (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")


def rope_problems(config) -> list[str]:
    params = getattr(config, "rope_parameters", None) or {}
    kind = rope_type(config)
    problems = []
    if kind not in CACHE_ROPE_TYPES + MODEL_FREQ_ROPE_TYPES:
        problems.append(f"rope_type {kind!r} (supported: {', '.join(CACHE_ROPE_TYPES + MODEL_FREQ_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor {params['partial_rotary_factor']} (only full rotary)")
    return problems


def _scaling(params: dict, kind: str):
    if kind == "linear":
        return ops.LinearScaling(factor=float(params["factor"]))
    if kind == "llama3":
        return ops.Llama3Scaling(factor=float(params["factor"]), low_freq_factor=float(params["low_freq_factor"]),
                                 high_freq_factor=float(params["high_freq_factor"]),
                                 original_max_position=int(params["original_max_position_embeddings"]))
    return None


def cos_sin_cache(config, rotary_emb: torch.nn.Module, rot: int, device) -> torch.Tensor:
    """fp32 [max_position_embeddings, rot] for `ops.rope` (checked supported by `rope_problems`)."""
    kind, max_pos = rope_type(config), int(config.max_position_embeddings)
    params = config.rope_parameters
    if kind in CACHE_ROPE_TYPES:
        return ops.rope_cos_sin_cache(max_pos, rot, float(params["rope_theta"]), scaling=_scaling(params, kind),
                                      device=device)
    inv_freq = rotary_emb.inv_freq.to(torch.float64).cpu()
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1) * float(rotary_emb.attention_scaling)
    return cache.float().to(device)
