"""Benchmark cases for the FP8 KV caches: the fused DeepSeek RoPE + FP8 quant + paged append (V3.2 and V4
layouts, q's RoPE in the same launch), the DeepSeek cache write, the generic paged FP8 write (GPT-OSS kv heads),
and the two cache gathers (DeepSeek V3.2 / V4 -> bf16, generic FP8 -> bf16). Decode cases (T <= 64) are also
timed under CUDA-graph replay by the runner. Every case checks bytes exactly (cache bytes for writes, bf16 bytes
for gathers: one rounding of code * scale).

Gather bytes model (what a gather must move): the cache bytes of the gathered slots (DeepSeek: E4M3 NoPE + tile
scales + bf16 RoPE, the V4 per-block scale padding byte not counted; generic: E4M3 codes + fp32 per-(token, head)
scales), the bf16 rows written, and the int64 slot ids read."""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import kv_cache as kref
from dispatch.reference import rope as rref
from dispatch.selfcheck import byte_mismatches
from perf.cases.base import BenchCase
from perf.cases.rope import per_token_rope_bytes


def _exact(got, want):
    """Cache bytes (writes) and gathered floats are bit-exact with the reference (NaN payloads canonicalized)."""
    bad = byte_mismatches(got, want)
    if bad:
        raise AssertionError(f"{bad} bytes differ from the reference")


# ------------------------------------------------------------------------------------- DeepSeek


def _ds_inputs(t, hq, layout, block_size=64):
    L = kref.DS_LAYOUTS[layout]

    def make(device):
        nb = -(-t // block_size) + 1
        return {"kv": torch.randn(t, L.d, device=device, dtype=torch.bfloat16),
                "q": torch.randn(t, hq, L.d, device=device, dtype=torch.bfloat16),
                "pos": torch.randint(0, 16384, (t,), device=device),
                "cs": rref.rope_cos_sin_cache(16384, 64, device=device),
                "slots": torch.randperm(nb * block_size, device=device)[:t],
                "cache": kref.ds_kv_cache_empty(nb, block_size, layout, device)}
    return make


def _fused_case(bucket, t, hq, layout):
    L = kref.DS_LAYOUTS[layout]
    p = dict(T=t, Hq=hq, layout=layout, d=L.d, dtype="bf16")

    def lowbit(i, b):
        ops.ds_rope_quant_append(i["kv"], i["pos"], i["cs"], i["slots"], i["cache"], layout=layout, q=i["q"],
                                 backend=b)
        return i["cache"]

    def reference(i):  # the unfused torch reference: rope, then quantize + scatter
        kref.ds_rope_quant_append(i["kv"], i["pos"], i["cs"], i["slots"], i["cache"], layout, i["q"], False)
        return i["cache"]

    # kv read, cache records written, q's RoPE slice read + written, slots, and positions + cos/sin rows
    moved = t * L.d * 2 + t * L.token_bytes + 2 * t * hq * 64 * 2 + t * 8 + per_token_rope_bytes(t, 64)
    return BenchCase("ds_rope_quant_append", f"T={t} Hq={hq} {layout} +q rope", bucket, p, _ds_inputs(t, hq, layout),
                     lowbit, reference, _exact, bytes_moved=moved)


def _ds_write_case(bucket, t, layout):
    L = kref.DS_LAYOUTS[layout]
    p = dict(T=t, layout=layout, d=L.d, dtype="bf16")

    def lowbit(i, b):
        ops.ds_kv_write(i["kv"], i["slots"], i["cache"], layout=layout, backend=b)
        return i["cache"]

    def reference(i):
        kref.ds_kv_write(i["kv"], i["slots"], i["cache"], layout)
        return i["cache"]

    return BenchCase("ds_kv_write", f"T={t} {layout}", bucket, p, _ds_inputs(t, 0, layout), lowbit, reference, _exact,
                     bytes_moved=t * L.d * 2 + t * L.token_bytes + t * 8)


def _ds_gather_case(bucket, t, layout, block_size=64):
    """Read back t slots (a random permutation of the filled ones) of a cache that holds exactly those t tokens."""
    L = kref.DS_LAYOUTS[layout]
    p = dict(T=t, layout=layout, d=L.d, dtype="bf16")

    def make(device):
        nb = -(-t // block_size) + 1
        slots = torch.randperm(nb * block_size, device=device)[:t]
        cache = kref.ds_kv_cache_empty(nb, block_size, layout, device)
        kref.ds_kv_write(torch.randn(t, L.d, device=device, dtype=torch.bfloat16), slots, cache, layout)
        return {"cache": cache, "slots": slots[torch.randperm(t, device=device)]}

    token_read = L.d_nope + L.num_tiles * L.scale_bytes + 2 * kref.DS_ROPE  # 656 B (V3.2), 583 B (V4)
    return BenchCase("ds_kv_gather", f"T={t} {layout} -> bf16", bucket, p, make,
                     lambda i, b: ops.ds_kv_gather(i["cache"], i["slots"], layout=layout, backend=b),
                     lambda i: kref.ds_kv_gather(i["cache"], i["slots"], layout, torch.bfloat16), _exact,
                     bytes_moved=t * token_read + t * L.d * 2 + t * 8)


# ------------------------------------------------------------------------------------------ generic


def _paged_case(bucket, t, h, d):
    p = dict(T=t, H=h, D=d, dtype="bf16", scales="dynamic")

    def make(device):
        nb = -(-t // 16) + 1
        return {"x": torch.randn(t, h, d, device=device, dtype=torch.bfloat16),
                "slots": torch.randperm(nb * 16, device=device)[:t],
                "cache": torch.zeros(nb, 16, h, d, device=device, dtype=torch.uint8),
                "sc": torch.zeros(nb, 16, h, device=device)}

    def lowbit(i, b):
        ops.paged_kv_write_fp8(i["x"], i["slots"], i["cache"], scale_cache=i["sc"], backend=b)
        return i["cache"]

    def reference(i):
        kref.paged_kv_write_fp8(i["x"], i["slots"], i["cache"], None, i["sc"])
        return i["cache"]

    return BenchCase("paged_kv_write_fp8", f"T={t} H={h} D={d} dynamic", bucket, p, make, lowbit, reference, _exact,
                     bytes_moved=t * h * d * 3 + t * h * 4 + t * 8)


def _paged_gather_case(bucket, t, h, d, block_size=16):
    p = dict(T=t, H=h, D=d, dtype="bf16", scales="dynamic")

    def make(device):
        nb = -(-t // block_size) + 1
        slots = torch.randperm(nb * block_size, device=device)[:t]
        cache = torch.zeros(nb, block_size, h, d, device=device, dtype=torch.uint8)
        sc = torch.zeros(nb, block_size, h, device=device)
        kref.paged_kv_write_fp8(torch.randn(t, h, d, device=device, dtype=torch.bfloat16), slots, cache, None, sc)
        return {"cache": cache, "sc": sc, "slots": slots[torch.randperm(t, device=device)]}

    return BenchCase("paged_kv_gather_fp8", f"T={t} H={h} D={d} dynamic -> bf16", bucket, p, make,
                     lambda i, b: ops.paged_kv_gather_fp8(i["cache"], i["slots"], scale_cache=i["sc"], backend=b),
                     lambda i: kref.paged_kv_gather_fp8(i["cache"], i["slots"], None, i["sc"], torch.bfloat16),
                     _exact, bytes_moved=t * h * (d + 4) + t * h * d * 2 + t * 8)


def cases() -> list[BenchCase]:
    out = []
    for bucket, t in (("decode", 64), ("prefill", 16384)):  # representative shapes: the suite fits one GPU call
        for layout in ("v32", "v4"):
            out += [_fused_case(bucket, t, 16 if bucket == "decode" else 64, layout), _ds_write_case(bucket, t, layout),
                    _ds_gather_case(bucket, t, layout)]
        out += [_paged_case(bucket, t, 8, 64), _paged_gather_case(bucket, t, 8, 64)]
    return out
