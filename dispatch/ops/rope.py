"""RoPE ops: torch.library registration, fakes, typed public API. Contract: dispatch/reference/rope.py.

Two ops, one kernel: `lowbit::rope` (out of place, fresh contiguous outputs) and `lowbit::rope_` (in place
on q and k, declared as mutations). q and k may be strided views (e.g. heads of a fused qkv buffer): only
the head dim must be contiguous.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from triton_ops.contract import checks as C

from ..reference.rope import rope_cos_sin_cache
from ._common import call, lowbit_op, run

CHECK_ENV = "LOWBIT_CHECK_INDICES"
INDEX_DTYPES = (torch.int32, torch.int64)


def debug_checks() -> bool:
    """LOWBIT_CHECK_INDICES=1: host-side range checks of positions / slots (one sync per call)."""
    return os.environ.get(CHECK_ENV) == "1"


def check_positions(op: str, positions: Tensor, t: int, cos_sin_cache: Tensor, *, sync_check: bool) -> None:
    C.check_tensor(op, "positions", positions)
    C.check_dtype(op, "positions", positions, INDEX_DTYPES)
    if positions.dim() != 1 or positions.shape[0] != t:
        C.fail(op, "positions", f"expected shape ({t},) (one per token), got {tuple(positions.shape)}")
    C.check_tensor(op, "cos_sin_cache", cos_sin_cache)
    C.check_dtype(op, "cos_sin_cache", cos_sin_cache, (torch.float32,))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] == 0:
        C.fail(op, "cos_sin_cache", f"expected fp32 [max_pos, rot] with rot even (cat(cos, sin)), got shape "
                                    f"{tuple(cos_sin_cache.shape)}")
    if not cos_sin_cache.is_contiguous():
        C.fail(op, "cos_sin_cache", "must be contiguous; call .contiguous() once when building it")
    C.check_same_device(op, "cos_sin_cache", cos_sin_cache, "positions", positions)
    if sync_check and debug_checks() and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            C.fail(op, "positions", f"values span [{lo}, {hi}] but cos_sin_cache has {cos_sin_cache.shape[0]} "
                                    f"positions ({CHECK_ENV}=1 check)")


def check_heads(op: str, arg: str, x: Tensor, *, ref: Tensor | None = None) -> None:
    C.check_tensor(op, arg, x)
    C.check_dtype(op, arg, x, C.FLOAT_INPUTS)
    if x.dim() != 3:
        C.fail(op, arg, f"expected [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        C.fail(op, arg, f"the head dim must be contiguous (stride 1), got strides {x.stride()}")
    if ref is not None:
        if x.dtype != ref.dtype:
            C.fail(op, arg, f"dtype {x.dtype} differs from q's {ref.dtype}")
        if x.shape[0] != ref.shape[0] or x.shape[2] != ref.shape[2]:
            C.fail(op, arg, f"shape {tuple(x.shape)} must match q {tuple(ref.shape)} in tokens and head_dim")
        C.check_same_device(op, "q", ref, arg, x)


def _check_rope(op, q, k, positions, cos_sin_cache, rot_offset, sync_check=True):
    check_heads(op, "q", q)
    if k is not None:
        check_heads(op, "k", k, ref=q)
    check_positions(op, positions, q.shape[0], cos_sin_cache, sync_check=sync_check)
    C.check_same_device(op, "q", q, "positions", positions)
    rot = cos_sin_cache.shape[1]
    if rot_offset < 0 or rot_offset + rot > q.shape[-1]:
        C.fail(op, "rot_offset", f"rotary slice [{rot_offset}, {rot_offset + rot}) does not fit head_dim "
                                 f"{q.shape[-1]} (rot = cos_sin_cache.shape[1] = {rot})")


@lowbit_op("rope", mutates_args=())
def _rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, rot_offset: int, is_neox: bool,
          inverse: bool, backend: str) -> tuple[Tensor, Tensor]:
    _check_rope("rope", q, k, positions, cos_sin_cache, rot_offset)
    return run("rope", backend, q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse)


@_rope.register_fake
def _(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, backend):
    _check_rope("rope", q, k, positions, cos_sin_cache, rot_offset, sync_check=False)
    return q.new_empty(q.shape), k.new_empty(k.shape)


@lowbit_op("rope_", mutates_args=("q", "k"))
def _rope_(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, rot_offset: int,
           is_neox: bool, inverse: bool, backend: str) -> None:
    _check_rope("rope_", q, k, positions, cos_sin_cache, rot_offset)
    run("rope_", backend, q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse)


@_rope_.register_fake
def _(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse, backend):
    _check_rope("rope_", q, k, positions, cos_sin_cache, rot_offset, sync_check=False)


class RopeOutput(NamedTuple):
    q: Tensor
    k: Tensor | None


def rope(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, *, rot_offset: int = 0,
         is_neox: bool = True, inverse: bool = False, backend: str = "auto") -> RopeOutput:
    """Out-of-place RoPE of q [T, Hq, D] and k [T, Hk, D] (one launch). Dims [rot_offset, rot_offset + rot)
    rotate, rot = cos_sin_cache.shape[1]; is_neox=False is GPT-J (interleaved pairs); inverse rotates
    by minus the angle (DeepSeek-V4 applies it to the attention output). Outputs are fresh, contiguous."""
    k_in = q[:, :0] if k is None else k
    qo, ko = call("rope", q, k_in, positions, cos_sin_cache, int(rot_offset), bool(is_neox),
                                   bool(inverse), backend)
    return RopeOutput(qo, None if k is None else ko)


def rope_(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, *, rot_offset: int = 0,
          is_neox: bool = True, inverse: bool = False, backend: str = "auto") -> None:
    """In-place RoPE of q and k (k may be None); same math as `rope`."""
    call("rope_", q, k, positions, cos_sin_cache, int(rot_offset), bool(is_neox), bool(inverse),
                           backend)


# ------------------------------------------------------------------------------------------ self-check


def _sample(dev, small, d=128, rot=64, hq=8, hk=2, t=None):
    t = t or (8 if small else 4096)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(t, hq + 2 * hk, d, generator=g).to(device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (t,), generator=g).to(dev)
    return qkv[:, :hq], qkv[:, hq:hq + hk], pos, rope_cos_sin_cache(4096, rot, device=dev)


def self_check_cases() -> list:
    from ..selfcheck import Case

    def neox(dev, small):
        q, k, pos, cs = _sample(dev, small, d=128, rot=128)
        return (q, k, pos, cs, 0, True, False)

    def gptj_partial_inverse(dev, small):
        q, k, pos, cs = _sample(dev, small, d=512, rot=64, hq=16, hk=1)
        return (q, k, pos, cs, 448, False, True)

    def inplace(dev, small):
        q, k, pos, cs = _sample(dev, small, d=64, rot=32)
        return (q.clone(), k.clone(), pos, cs, 0, True, False)

    def compare_inplace(out, ref):  # the op returns nothing: compare the mutated inputs instead
        return True, "in place (see tests)"

    return [
        Case("rope", neox, label="NeoX full head, qkv views"),
        Case("rope", gptj_partial_inverse, label="GPT-J last 64 of 512, inverse"),
        Case("rope_", inplace, compare=compare_inplace, label="in place NeoX rot 32 of 64"),
    ]
