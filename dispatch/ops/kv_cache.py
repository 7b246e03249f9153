"""Paged KV-cache FP8 ops: registration, fakes, typed public API. Contract: dispatch/reference/kv_cache.py;
byte layouts: docs/kv_cache.md.

Writes mutate the caller's cache (declared in mutates_args) and return nothing; gathers return fresh tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from triton_ops.contract import checks as C
from triton_ops.contract.kv_cache import CACHE_DTYPES, DS_LAYOUTS, DS_ROPE, check_ds_cache

from ..reference.kv_cache import ds_kv_cache_empty
from ._common import call, lowbit_op
from ._fake import is_fake
from .rope import INDEX_DTYPES, check_heads, check_positions, debug_checks


def _check_slots(op: str, arg: str, slots: Tensor, n: int, n_slots: int, ref: Tensor):
    """Under LOWBIT_CHECK_INDICES=1 also range-checks the slot values (never those of fake tensors: the fake
    impls run the same checks)."""
    C.check_tensor(op, arg, slots)
    C.check_dtype(op, arg, slots, INDEX_DTYPES)
    if slots.dim() != 1 or slots.shape[0] != n:
        C.fail(op, arg, f"expected shape ({n},) (one slot per token), got {tuple(slots.shape)}")
    C.check_same_device(op, "cache", ref, arg, slots)
    if debug_checks() and not is_fake(slots) and slots.numel():
        lo, hi = int(slots.min()), int(slots.max())
        if lo < -1 or hi >= n_slots:
            C.fail(op, arg, f"values span [{lo}, {hi}] but the cache has {n_slots} slots (-1 = skip) "
                            "(LOWBIT_CHECK_INDICES=1 check)")


def _check_tensors(op: str, **tensors) -> None:
    for arg, t in tensors.items():
        C.check_tensor(op, arg, t)


def _check_optional(op: str, **tensors) -> None:
    for arg, t in tensors.items():
        C.check_tensor(op, arg, t, optional=True)


# ------------------------------------------------------------------------------------------ generic


def _check_generic_cache(op, cache, scale, scale_cache, h=None, d=None):
    C.check_tensor(op, "cache", cache)
    C.check_dtype(op, "cache", cache, CACHE_DTYPES)
    if cache.dim() != 4:
        C.fail(op, "cache", f"expected [num_blocks, block_size, heads, head_dim], got shape {tuple(cache.shape)}")
    if cache.shape[-1] > 1 and cache.stride(-1) != 1:
        C.fail(op, "cache", f"the head dim must be contiguous, got strides {cache.stride()}")
    if h is not None and tuple(cache.shape[2:]) != (h, d):
        C.fail(op, "cache", f"heads x head_dim {tuple(cache.shape[2:])} != the input's {(h, d)}")
    if (scale is None) == (scale_cache is None):
        C.fail(op, "scale", "pass exactly one of scale (static per-tensor) and scale_cache (dynamic per token/head)")
    if scale is not None:
        C.check_scalar_tensor(op, "scale", scale)
        C.check_same_device(op, "cache", cache, "scale", scale)
    else:
        C.check_dtype(op, "scale_cache", scale_cache, (torch.float32,))
        if tuple(scale_cache.shape) != tuple(cache.shape[:3]):
            C.fail(op, "scale_cache", f"expected shape {tuple(cache.shape[:3])} (num_blocks, block_size, heads), "
                                      f"got {tuple(scale_cache.shape)}")
        C.check_same_device(op, "cache", cache, "scale_cache", scale_cache)


def _check_paged_write(x, slot_mapping, cache, scale, scale_cache):
    op = "paged_kv_write_fp8"
    _check_tensors(op, x=x, slot_mapping=slot_mapping, cache=cache)
    _check_optional(op, scale=scale, scale_cache=scale_cache)
    C.check_no_grad(op, x=x, scale=scale, scale_cache=scale_cache)
    check_heads(op, "x", x)
    _check_generic_cache(op, cache, scale, scale_cache, x.shape[1], x.shape[2])
    C.check_same_device(op, "cache", cache, "x", x)
    _check_slots(op, "slot_mapping", slot_mapping, x.shape[0], cache.shape[0] * cache.shape[1], cache)


@lowbit_op("paged_kv_write_fp8", mutates_args=("cache", "scale_cache"), check=_check_paged_write)
def _paged_kv_write_fp8(x: Tensor, slot_mapping: Tensor, cache: Tensor, scale: Tensor | None,
                        scale_cache: Tensor | None, backend: str) -> None:
    return None


def _check_paged_gather(cache, slots, scale, scale_cache, out_dtype):
    op = "paged_kv_gather_fp8"
    _check_tensors(op, cache=cache, slots=slots)
    _check_optional(op, scale=scale, scale_cache=scale_cache)
    C.check_no_grad(op, scale=scale, scale_cache=scale_cache)
    _check_generic_cache(op, cache, scale, scale_cache)
    _check_slots(op, "slots", slots, slots.shape[0] if slots.dim() == 1 else -1, cache.shape[0] * cache.shape[1],
                 cache)
    if out_dtype not in C.FLOAT_INPUTS:
        C.fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")


@lowbit_op("paged_kv_gather_fp8", mutates_args=(), check=_check_paged_gather)
def _paged_kv_gather_fp8(cache: Tensor, slots: Tensor, scale: Tensor | None, scale_cache: Tensor | None,
                         out_dtype: torch.dtype, backend: str) -> Tensor:
    return cache.new_empty(slots.shape[0], cache.shape[2], cache.shape[3], dtype=out_dtype)


def paged_kv_write_fp8(x: Tensor, slot_mapping: Tensor, cache: Tensor, *, scale: Tensor | None = None,
                       scale_cache: Tensor | None = None, backend: str = "auto") -> None:
    """Quantize x [T, H, D] to E4M3 and write token t into cache [NB, BS, H, D] at slot_mapping[t]
    (block = slot // BS, offset = slot % BS; -1 skips). scale: static fp32 per-tensor scale (decode form:
    value = code * scale); or scale_cache [NB, BS, H] fp32 to receive dynamic per-(token, head) scales
    max(amax, 1e-10) / 448. x may be a strided view (heads of a fused qkv buffer).
    Inference only (every kv-cache op): with grad mode on, float inputs that require grad are refused
    (LowbitInputError). Slots outside [-1, NB*BS) are skipped like -1 (gathers: NaN rows), never written past;
    LOWBIT_CHECK_INDICES=1 raises for them instead (a device sync)."""
    call("paged_kv_write_fp8", x, slot_mapping, cache, scale, scale_cache, backend)


def paged_kv_gather_fp8(cache: Tensor, slots: Tensor, *, scale: Tensor | None = None,
                        scale_cache: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                        backend: str = "auto") -> Tensor:
    """Read slots [N] back as [N, H, D] out_dtype (code * scale in fp32, one rounding). Slot -1 -> zeros."""
    return call("paged_kv_gather_fp8", cache, slots, scale, scale_cache, out_dtype, backend)


# ----------------------------------------------------------------------------------------- DeepSeek


def _check_layout(op, layout):
    if layout not in DS_LAYOUTS:
        C.fail(op, "layout", f"{layout!r} is not one of {', '.join(DS_LAYOUTS)}")


def _check_ds_kv(op, kv, layout):
    L = DS_LAYOUTS[layout]
    C.check_tensor(op, "kv", kv)
    C.check_dtype(op, "kv", kv, C.FLOAT_INPUTS)
    if kv.dim() != 2 or kv.shape[1] != L.d:
        C.fail(op, "kv", f"expected [tokens, {L.d}] ({L.d_nope} NoPE + {DS_ROPE} RoPE) for layout {layout}, "
                         f"got shape {tuple(kv.shape)}")
    if kv.stride(-1) != 1:
        C.fail(op, "kv", f"the last dim must be contiguous, got strides {kv.stride()}")


def _check_ds_write(op, kv, slot_mapping, cache, layout):
    _check_tensors(op, kv=kv, slot_mapping=slot_mapping, cache=cache)
    C.check_no_grad(op, kv=kv)
    _check_layout(op, layout)
    _check_ds_kv(op, kv, layout)
    check_ds_cache(op, cache, layout)
    C.check_same_device(op, "cache", cache, "kv", kv)
    _check_slots(op, "slot_mapping", slot_mapping, kv.shape[0], cache.shape[0] * cache.shape[1], cache)


def _check_ds_kv_write(kv, slot_mapping, cache, layout):
    _check_ds_write("ds_kv_write", kv, slot_mapping, cache, layout)


@lowbit_op("ds_kv_write", mutates_args=("cache",), check=_check_ds_kv_write)
def _ds_kv_write(kv: Tensor, slot_mapping: Tensor, cache: Tensor, layout: str, backend: str) -> None:
    return None


def _check_ds_gather(cache, slots, layout, out_dtype):
    op = "ds_kv_gather"
    _check_tensors(op, cache=cache, slots=slots)
    _check_layout(op, layout)
    check_ds_cache(op, cache, layout)
    _check_slots(op, "slots", slots, slots.shape[0] if slots.dim() == 1 else -1, cache.shape[0] * cache.shape[1],
                 cache)
    if out_dtype not in C.FLOAT_INPUTS:
        C.fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")


@lowbit_op("ds_kv_gather", mutates_args=(), check=_check_ds_gather)
def _ds_kv_gather(cache: Tensor, slots: Tensor, layout: str, out_dtype: torch.dtype, backend: str) -> Tensor:
    return cache.new_empty(slots.shape[0], DS_LAYOUTS[layout].d, dtype=out_dtype)


def _check_fused(kv, positions, cos_sin_cache, slot_mapping, cache, layout, q, is_neox):
    op = "ds_rope_quant_append"
    _check_tensors(op, kv=kv, positions=positions, cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping,
                   cache=cache)
    _check_optional(op, q=q)
    C.check_no_grad(op, q=q, cos_sin_cache=cos_sin_cache)
    _check_ds_write(op, kv, slot_mapping, cache, layout)
    check_positions(op, positions, kv.shape[0], cos_sin_cache)
    C.check_same_device(op, "kv", kv, "positions", positions)
    if cos_sin_cache.shape[1] != DS_ROPE:
        C.fail(op, "cos_sin_cache", f"the DeepSeek RoPE part is {DS_ROPE} wide, got rot {cos_sin_cache.shape[1]}")
    if q is not None:
        check_heads(op, "q", q)
        C.check_same_device(op, "kv", kv, "q", q)
        if q.shape[0] != kv.shape[0] or q.shape[-1] < DS_ROPE:
            C.fail(op, "q", f"expected [{kv.shape[0]}, heads, >= {DS_ROPE}] (RoPE = the last {DS_ROPE} dims), "
                            f"got {tuple(q.shape)}")


@lowbit_op("ds_rope_quant_append", mutates_args=("cache", "q"), check=_check_fused)
def _ds_rope_quant_append(kv: Tensor, positions: Tensor, cos_sin_cache: Tensor, slot_mapping: Tensor,
                          cache: Tensor, layout: str, q: Tensor | None, is_neox: bool, backend: str) -> None:
    return None


def ds_kv_write(kv: Tensor, slot_mapping: Tensor, cache: Tensor, *, layout: str = "v32",
                backend: str = "auto") -> None:
    """Write kv [T, d] (NoPE | 64 RoPE; d = 576 for "v32", 512 for "v4") into a DeepSeek FP8 cache
    (see ds_kv_cache_empty and docs/kv_cache.md) at slot_mapping (-1 skips)."""
    call("ds_kv_write", kv, slot_mapping, cache, layout, backend)


def ds_kv_gather(cache: Tensor, slots: Tensor, *, layout: str = "v32", out_dtype: torch.dtype = torch.bfloat16,
                 backend: str = "auto") -> Tensor:
    """Read slots [N] of a DeepSeek cache back as [N, d] (slot -1 -> zeros)."""
    return call("ds_kv_gather", cache, slots, layout, out_dtype, backend)


def ds_rope_quant_append(kv: Tensor, positions: Tensor, cos_sin_cache: Tensor, slot_mapping: Tensor,
                         cache: Tensor, *, layout: str = "v32", q: Tensor | None = None, is_neox: bool = False,
                         backend: str = "auto") -> None:
    """One launch: RoPE (forward, cos_sin_cache [max_pos, 64]) on kv's last 64 dims, FP8 quantization of its
    NoPE part, paged append into the DeepSeek cache; and, when q [T, H, dq] is given, RoPE of q's last 64 dims
    in place. is_neox=False (GPT-J pairs) is what DeepSeek uses. kv itself is not modified."""
    call("ds_rope_quant_append", kv, positions, cos_sin_cache, slot_mapping, cache, layout, q,
                                          bool(is_neox), backend)


# ------------------------------------------------------------------------------------------ self-check


POISON = 0xAB  # the self-check caches' bytes before a write: not zero, so a write zeroing bytes it must keep shows


def self_check_cases() -> list:
    from ..reference.rope import rope_cos_sin_cache
    from ..selfcheck import Case, sample_activations

    def slots_for(t, nb, bs, dev):
        g = torch.Generator().manual_seed(1)
        s = torch.randperm(nb * bs, generator=g)[:t]
        s[::7] = -1
        return s.to(dev)

    def pw(dev, small):
        t, h, d = (8, 2, 128) if small else (4096, 8, 128)
        x = sample_activations(dev, small, k=h * d)[:t].reshape(t, h, d)
        # poisoned: a write must replace these bytes where the reference does and keep them elsewhere
        cache = torch.full((t // 4 + 2, 16, h, d), POISON, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        sc = torch.full(cache.shape[:3], -1.0, device=dev)
        return (x, slots_for(t, cache.shape[0], 16, dev), cache, None, sc)

    def pg(dev, small):
        x, slots, cache, _, sc = pw(dev, small)
        paged_kv_write_fp8(x, slots, cache, scale_cache=sc, backend="torch")
        return (cache, slots, None, sc, torch.bfloat16)

    def dsw(layout):
        def make(dev, small):
            t = 8 if small else 4096
            d = DS_LAYOUTS[layout].d
            kv = sample_activations(dev, small, k=d)[:t]
            cache = ds_kv_cache_empty(t // 64 + 1, 64, layout, dev)
            cache.untyped_storage().fill_(POISON)  # the block padding too: a write must keep it
            return (kv, slots_for(t, t // 64 + 1, 64, dev), cache, layout)
        return make

    def dsg(layout):
        def make(dev, small):
            kv, slots, cache, _ = dsw(layout)(dev, small)
            ds_kv_write(kv, slots, cache, layout=layout, backend="torch")
            return (cache, slots, layout, torch.bfloat16)
        return make

    def fused(dev, small):
        kv, slots, cache, layout = dsw("v4")(dev, small)
        t = kv.shape[0]
        pos = torch.arange(t, device=dev)
        q = sample_activations(dev, small, k=4 * 512)[:t].reshape(t, 4, 512)
        return (kv, pos, rope_cos_sin_cache(max(t, 1), 64, device=dev), slots, cache, layout, q, False)

    return [
        Case("paged_kv_write_fp8", pw, label="dynamic per-token-head scales"),
        Case("paged_kv_gather_fp8", pg, label="dynamic scales -> bf16"),
        Case("ds_kv_write", dsw("v32"), label="V3.2 656 B/token"),
        Case("ds_kv_write", dsw("v4"), label="V4 584 B/token"),
        Case("ds_kv_gather", dsg("v32"), label="V3.2 -> bf16"),
        Case("ds_kv_gather", dsg("v4"), label="V4 -> bf16"),
        Case("ds_rope_quant_append", fused, label="V4 + q rope"),
    ]
