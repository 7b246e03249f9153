"""Benchmark cases for RoPE: Llama NeoX over the full head (q and k in one call, out of place) and DeepSeek-V4
GPT-J on the last 64 of 512 dims, inverse, in place. Decode cases (T <= 64) are also timed under CUDA-graph
replay by the runner. The fused DeepSeek RoPE + FP8 quant + cache append is a kv_cache case
(perf/cases/kv_cache.py).
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import rope as rref
from perf import peers
from perf.cases.base import BenchCase


def _same(got, want):
    """Float outputs within ~1 ulp: the torch.compile'd reference may contract into FMAs (lowbit does not)."""
    bad = int((~torch.isclose(got.float(), want.float(), rtol=1e-2, atol=1e-5)).sum())
    if bad:
        raise AssertionError(f"{bad} elements differ from the reference")


def _check_tuple(got, want):
    for g, w in zip(got, want, strict=True):
        _same(g, w)


def per_token_rope_bytes(t, rot):
    """What every RoPE implementation reads once per token besides the heads: its int64 position and its
    fp32 (cos, sin) row. In-place rope_ on a slice counts only the slice's bytes (read + write), never the
    untouched rest of the head."""
    return t * (8 + rot * 4)


def _rope_inputs(t, hq, hk, d, rot, max_pos=16384):
    def make(device):
        qkv = torch.randn(t, hq + 2 * hk, d, device=device, dtype=torch.bfloat16)
        pos = torch.randint(0, max_pos, (t,), device=device)
        cs = rref.rope_cos_sin_cache(max_pos, rot, device=device)
        cos, sin = cs[:, : rot // 2][pos], cs[:, rot // 2:][pos]
        return {"q": qkv[:, :hq].contiguous(), "k": qkv[:, hq:hq + hk].contiguous(), "pos": pos, "cs": cs,
                "cos": cos, "sin": sin}
    return make


def _rope_cases(bucket, t, hq, hk, d):
    p = dict(T=t, Hq=hq, Hk=hk, D=d, dtype="bf16", style="neox")
    liger = peers.liger_rope()
    peer = {} if liger is None else {
        "liger": lambda i: liger(i["q"], i["k"], i["cos"], i["sin"], rotary_dim=d)}
    return BenchCase(
        "rope", f"T={t} Hq={hq} Hk={hk} D={d} NeoX out-of-place", bucket, p, _rope_inputs(t, hq, hk, d, d),
        lambda i, b: ops.rope(i["q"], i["k"], i["pos"], i["cs"], backend=b),
        lambda i: rref.rope(i["q"], i["k"], i["pos"], i["cs"], 0, True, False), _check_tuple,
        bytes_moved=2 * t * (hq + hk) * d * 2 + per_token_rope_bytes(t, d), peers=peer)


def _rope_dsv4(bucket, t, h):
    p = dict(T=t, H=h, D=512, rot=64, dtype="bf16", style="gptj", inverse=True, inplace=True)

    def lowbit(i, b):
        ops.rope_(i["q"], None, i["pos"], i["cs"], rot_offset=448, is_neox=False, inverse=True, backend=b)
        return i["q"]

    def reference(i):
        rref.rope_(i["q"], None, i["pos"], i["cs"], 448, False, True)
        return i["q"]

    return BenchCase("rope_", f"T={t} H={h} D=512 GPT-J last-64 inverse in-place", bucket, p,
                     _rope_inputs(t, h, 0, 512, 64), lowbit, reference, _same,
                     bytes_moved=2 * t * h * 64 * 2 + per_token_rope_bytes(t, 64))


def cases() -> list[BenchCase]:
    out = []
    for bucket, t in (("decode", 64), ("prefill", 16384)):  # representative shapes: the suite fits one GPU call
        out += [_rope_cases(bucket, t, 32, 8, 128), _rope_dsv4(bucket, t, 64)]
    out.append(_rope_cases("prefill", 16384, 64, 8, 128))  # the anchors' 16384x64x128 shape
    return out
