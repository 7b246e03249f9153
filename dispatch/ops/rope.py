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
from ._common import call, lowbit_op
from ._fake import is_fake

CHECK_ENV = "LOWBIT_CHECK_INDICES"
INDEX_DTYPES = (torch.int32, torch.int64)


def debug_checks() -> bool:
    """LOWBIT_CHECK_INDICES=1: host-side range checks of positions / slots (one sync per call)."""
    return os.environ.get(CHECK_ENV) == "1"


def host_values(*tensors) -> bool:
    """Whether index values of these tensors can be read without a device sync: eager (not tracing), plain
    host tensors (not FakeTensors or other subclasses). Public wrappers range-check such inputs before every
    call, including the calls the eager fast path (ops/_common.py) serves without running the op's checks."""
    return not torch.compiler.is_compiling() and all(type(t) is Tensor and t.is_cpu for t in tensors)


def check_positions(op: str, positions: Tensor, t: int, cos_sin_cache: Tensor) -> None:
    """Under LOWBIT_CHECK_INDICES=1 also range-checks the position values (never those of fake tensors, which
    have none: the fake impls run the same checks)."""
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
    if debug_checks() and not is_fake(positions) and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            C.fail(op, "positions", f"values span [{lo}, {hi}] but cos_sin_cache has {cos_sin_cache.shape[0]} "
                                    f"positions ({CHECK_ENV}=1 check)")


def heads_overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two [T, H, D] tensors of one dtype with a unit stride along D share a memory element. Exact
    (tests/test_bad_inputs.py checks it against element sets): disjoint address ranges first (separate
    tensors); head slices of one row-strided buffer (fused qkv views) by interval arithmetic over the rows;
    other layouts by sorting head start offsets. Reads addresses only (real tensors; no device sync)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    (ta, ha, d), (tb, hb, _) = a.shape, b.shape
    (a0, a1, _), (b0, b1, _) = a.stride(), b.stride()
    es = a.element_size()
    la, lb = (ha - 1) * a1 + d, (hb - 1) * b1 + d  # one row's footprint, in elements
    if pb >= pa + ((ta - 1) * a0 + la) * es or pa >= pb + ((tb - 1) * b0 + lb) * es:
        return False  # disjoint address ranges (whatever the storages)
    delta, rem = divmod(pb - pa, es)
    if rem:
        return True  # element-misaligned views of one buffer: treated as aliasing
    s = a0 if ta > 1 else b0 if tb > 1 else 0
    if (ta <= 1 or a0 == s) and (tb <= 1 or b0 == s) and (ha <= 1 or a1 == d) and (hb <= 1 or b1 == d):
        # rows are the intervals [t*s, t*s + la) and [delta + t*s, delta + t*s + lb): two meet iff
        # m*s lies in (delta - la, delta + lb) for a row distance |m| < T
        if s == 0:
            return -lb < delta < la
        t = max(ta, tb)
        return max((delta - la) // s + 1, 1 - t) <= min(-(-(delta + lb) // s) - 1, t - 1)
    xa = (torch.arange(ta)[:, None] * a0 + torch.arange(ha)[None, :] * a1).flatten()
    xb = ((torch.arange(tb)[:, None] * b0 + torch.arange(hb)[None, :] * b1).flatten() + delta).sort().values
    i = torch.searchsorted(xb, xa - d, right=True)  # the first head of b that starts after x - d
    return bool(((i < xb.numel()) & (xb[i.clamp(max=xb.numel() - 1)] < xa + d)).any())


def check_no_alias(op: str, q: Tensor, k: Tensor | None) -> None:
    """In-place RoPE: q and k must not share memory (k is q, or overlapping views), or the shared elements
    would be rotated twice (or once, depending on the backend). Address arithmetic only: FakeTensors and other
    tensor subclasses get the identity test alone."""
    if k is None:
        return
    if k is q:
        C.fail(op, "k", "is the same tensor as q: in-place RoPE would rotate it twice; pass k=None to rotate q "
                        "alone, or separate tensors")
    if type(q) in (Tensor, torch.nn.Parameter) and type(k) in (Tensor, torch.nn.Parameter) \
            and q.device.type != "meta" and heads_overlap(q, k):
        C.fail(op, "k", "shares memory with q (overlapping views): in-place RoPE would rotate the shared "
                        "elements twice; q and k must not alias")


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


def _check_rope(op, q, k, positions, cos_sin_cache, rot_offset):
    C.check_tensor(op, "q", q)
    C.check_tensor(op, "k", k, optional=True)
    C.check_tensor(op, "positions", positions)
    C.check_tensor(op, "cos_sin_cache", cos_sin_cache)
    C.check_no_grad(op, q=q, k=k, cos_sin_cache=cos_sin_cache)
    check_heads(op, "q", q)
    if k is not None:
        check_heads(op, "k", k, ref=q)
    check_positions(op, positions, q.shape[0], cos_sin_cache)
    C.check_same_device(op, "q", q, "positions", positions)
    rot = cos_sin_cache.shape[1]
    if rot_offset < 0 or rot_offset + rot > q.shape[-1]:
        C.fail(op, "rot_offset", f"rotary slice [{rot_offset}, {rot_offset + rot}) does not fit head_dim "
                                 f"{q.shape[-1]} (rot = cos_sin_cache.shape[1] = {rot})")
    if op == "rope_":
        check_no_alias(op, q, k)


def _check_rope_out(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    _check_rope("rope", q, k, positions, cos_sin_cache, rot_offset)


def _check_rope_inplace(q, k, positions, cos_sin_cache, rot_offset, is_neox, inverse):
    _check_rope("rope_", q, k, positions, cos_sin_cache, rot_offset)


@lowbit_op("rope", mutates_args=(), check=_check_rope_out)
def _rope(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor, rot_offset: int, is_neox: bool,
          inverse: bool, backend: str) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape)


@lowbit_op("rope_", mutates_args=("q", "k"), check=_check_rope_inplace)
def _rope_(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, rot_offset: int,
           is_neox: bool, inverse: bool, backend: str) -> None:
    return None


class RopeOutput(NamedTuple):
    q: Tensor
    k: Tensor | None


def rope(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, *, rot_offset: int = 0,
         is_neox: bool = True, inverse: bool = False, backend: str = "auto") -> RopeOutput:
    """Out-of-place RoPE of q [T, Hq, D] and k [T, Hk, D] (one launch). Dims [rot_offset, rot_offset + rot)
    rotate, rot = cos_sin_cache.shape[1]; is_neox=False is GPT-J (interleaved pairs); inverse rotates
    by minus the angle (DeepSeek-V4 applies it to the attention output). Outputs are fresh, contiguous.
    Inference only (rope and rope_): with grad mode on, inputs that require grad are refused (LowbitInputError).
    Positions outside [0, max_pos) are not checked (a device sync) unless LOWBIT_CHECK_INDICES=1."""
    C.check_tensor("rope", "q", q)  # sliced below, before the op's checks
    k_in = q[:, :0] if k is None else k
    qo, ko = call("rope", q, k_in, positions, cos_sin_cache, int(rot_offset), bool(is_neox),
                                   bool(inverse), backend)
    return RopeOutput(qo, None if k is None else ko)


def rope_(q: Tensor, k: Tensor | None, positions: Tensor, cos_sin_cache: Tensor, *, rot_offset: int = 0,
          is_neox: bool = True, inverse: bool = False, backend: str = "auto") -> None:
    """In-place RoPE of q and k (k may be None); same math as `rope`.

    q and k must not alias: k is q, or views sharing elements (e.g. overlapping head slices of one buffer),
    raise LowbitInputError naming 'k' on every backend (disjoint head slices of a fused qkv buffer are fine).
    The identity test runs on every call; the memory test on every checked call (the first of each argument
    signature: see ops/_common.py call)."""
    if k is q and k is not None:
        check_no_alias("rope_", q, k)
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

    def inplace(dev, small):  # q and k stay views of one qkv buffer: the v heads between them must keep their bytes
        q, k, pos, cs = _sample(dev, small, d=64, rot=32)
        return (q, k, pos, cs, 0, True, False)

    return [
        Case("rope", neox, label="NeoX full head, qkv views"),
        Case("rope", gptj_partial_inverse, label="GPT-J last 64 of 512, inverse"),
        Case("rope_", inplace, label="in place NeoX rot 32 of 64, qkv views"),
    ]
