"""Bad inputs users tried. Each must give a clear LowbitInputError naming the op and the argument, or a defined,
documented masked result every backend agrees on: never a crash, never a read or write out of bounds.

Index values on the device are not read by the checks (that is a host sync): kernels and references mask them,
and the ops raise instead only where the values are free to read (host tensors) or LOWBIT_CHECK_INDICES=1 asks.
The masked results are tested by calling the backend functions directly with host tensors.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from dispatch import ops
from dispatch.ops import _common
from dispatch.reference import moe as ref_moe
from dispatch.reference import quant as ref_quant
from dispatch.reference import swiglu as ref_swiglu
from dispatch.reference.kv_cache import ds_kv_cache_empty
from dispatch.reference.rope import rope_cos_sin_cache
from tests.helpers import DEVICES, assert_attention_close, assert_same_bytes
from triton_ops.contract.checks import LowbitInputError

BACKENDS = ["torch", "triton"]
I32 = torch.int32


@pytest.fixture
def no_fast_path(monkeypatch):
    """Checks run on every call (ops/_common.py remembers a signature's backend after a checked call)."""
    monkeypatch.setattr(_common, "_FAST", {})


# ------------------------------------------------------------------------- 1. moe_combine: out-of-range rows


def _combine_want(eo, inv, w, shared=None):
    """fp32, slot order, skipping rows outside [0, R) (the documented rule, written out)."""
    eo2 = eo.reshape(-1, eo.shape[-1]).float()
    acc = torch.zeros(inv.shape[0], eo.shape[-1])
    for t in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            r = int(inv[t, j])
            if 0 <= r < eo2.shape[0]:
                acc[t] = acc[t] + w[t, j].float() * eo2[r]
    return acc if shared is None else acc + shared.float()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_out_of_range_rows_contribute_nothing(backend, device, no_fast_path):
    g = torch.Generator().manual_seed(0)
    eo = torch.randn(2, 3, 8, generator=g)  # masked layout [E, max_m, N]: R = 6 rows read flat
    inv = torch.tensor([[0, 6], [-1, 5], [100, -7], [2**31 - 1, 1], [-2**31, -1]], dtype=I32)
    w = torch.rand(5, 2, generator=g)
    w[2, 0] = float("nan")  # a masked slot's weight is not used at all
    shared = torch.randn(5, 8, generator=g)
    d = [t.to(device) for t in (eo, inv, w, shared)]
    got = ops.moe_combine(*d[:3], backend=backend)
    assert torch.equal(got.cpu(), _combine_want(eo, inv, w))
    got = ops.moe_combine(*d[:3], shared=d[3], out_dtype=torch.float32, backend=backend)
    assert torch.equal(got.cpu(), _combine_want(eo, inv, w, shared))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_combine_empty_expert_out(backend, device, no_fast_path):
    """R = 0 rows (nothing was routed here): every slot is masked; y = shared, or zeros."""
    inv = torch.tensor([[0, -1], [3, 1]], dtype=I32, device=device)
    w = torch.ones(2, 2, device=device)
    shared = torch.randn(2, 8, device=device)
    for eo in (torch.zeros(0, 8, device=device), torch.zeros(4, 0, 8, device=device)):
        assert torch.equal(ops.moe_combine(eo, inv, w, backend=backend), torch.zeros(2, 8, device=device))
        assert torch.equal(ops.moe_combine(eo, inv, w, shared=shared, backend=backend), shared)


def test_combine_debug_env_flags_out_of_range_rows(monkeypatch):
    eo, w = torch.randn(4, 8), torch.ones(1, 2)
    monkeypatch.setenv("LOWBIT_CHECK_INDICES", "1")
    ops.moe_combine(eo, torch.tensor([[3, -1]], dtype=I32), w)  # -1 is the layouts' marker: fine
    for bad in ([[4, 0]], [[0, -2]]):
        with pytest.raises(LowbitInputError, match=r"lowbit\.moe_combine: argument 'inv_rows'.*\[-1, 4\)"):
            ops.moe_combine(eo, torch.tensor(bad, dtype=I32), w)


# ------------------------------------------------------------------------------ 2. moe_hash_route: bad ids


def _hash_case(dtype=torch.int64):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 8, generator=g)
    table = torch.randint(0, 8, (5, 3), generator=g).to(dtype)
    table[1, 2] = 8  # past E
    table[2, 0] = -1
    table[3] = torch.tensor([9, 2**40 if dtype == torch.int64 else 2**31 - 1, -2**40 if dtype == torch.int64
                             else -2**31])  # no valid slot (int64: would wrap to small ids if truncated)
    tok = torch.tensor([0, 1, 2, 5, -1, 3], dtype=torch.int64)  # 5 >= vocab, -1 < 0
    return logits, tok, table


def _hash_want(logits, tok, table, scoring, renorm, scaling):
    """The documented rule, written out per slot."""
    scores = ref_moe.score(logits.float(), scoring)
    t, e = scores.shape
    ids = torch.full((t, table.shape[1]), -1, dtype=I32)
    w = torch.zeros(t, table.shape[1])
    for i in range(t):
        if 0 <= tok[i] < table.shape[0]:
            for j in range(table.shape[1]):
                v = int(table[tok[i], j])
                if 0 <= v < e:
                    ids[i, j], w[i, j] = v, scores[i, v]
        if renorm and w[i].sum() > 0:
            w[i] = w[i] / w[i].sum()
    return ids, w * scaling


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("renorm", [True, False])
def test_hash_route_masks_out_of_range_ids_in_kernel_and_reference(table_dtype, renorm, device):
    from triton_ops.moe import routing

    logits, tok, table = _hash_case(table_dtype)
    want_ids, want_w = _hash_want(logits, tok, table, "sqrt_softplus", renorm, 1.5)
    for name, fn in (("torch", ref_moe.moe_hash_route), ("triton", routing.moe_hash_route)):
        ids, w = (o.cpu() for o in fn(logits.to(device), tok.to(device), table.to(device), "sqrt_softplus", renorm,
                                      1.5))
        assert torch.equal(ids, want_ids), name
        assert torch.allclose(w, want_w, rtol=1e-5, atol=0), name
        assert (w[ids < 0] == 0).all() and w.isfinite().all(), name  # masked slots weigh exactly 0, no 0/0


@pytest.mark.parametrize("backend", BACKENDS)
def test_hash_route_host_tensors_are_checked(backend):
    """Host tensors cost no sync to read: out-of-range token ids or table entries raise (every call, the eager
    fast path included)."""
    logits = torch.randn(3, 8)
    table = torch.randint(0, 8, (4, 2), dtype=I32)
    ok = torch.tensor([0, 3, 1])
    ops.moe_hash_route(logits, ok, table, backend=backend)
    ops.moe_hash_route(logits, ok, table, backend=backend)  # remembered signature
    for tok in (torch.tensor([0, 4, 1]), torch.tensor([-1, 0, 1])):
        with pytest.raises(LowbitInputError, match=r"lowbit\.moe_hash_route: argument 'token_ids'.*\[0, 4\)"):
            ops.moe_hash_route(logits, tok, table, backend=backend)
    for v in (8, -1):
        bad = table.clone()
        bad[2, 1] = v
        with pytest.raises(LowbitInputError, match=r"lowbit\.moe_hash_route: argument 'table'.*\[0, 8\)"):
            ops.moe_hash_route(logits, ok, bad, backend=backend)


# ------------------------------------------------------------------- 3. swiglu_nvfp4: expert ids past the scales


def _swiglu_moe_case():
    g = torch.Generator().manual_seed(2)
    gate = torch.where(torch.rand(6, 32, generator=g) < 0.5, torch.rand(6, 32, generator=g) * 40 + 20,
                       -100.0 - torch.rand(6, 32, generator=g) * 100)
    x = torch.cat([gate, torch.randn(6, 32, generator=g)], 1).bfloat16()
    gs = torch.tensor([0.01, 0.02, 0.005])
    ids = torch.tensor([0, 2, 3, -1, 1, 7], dtype=I32)  # 3 and 7: no scale for them
    return x, gs, ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", [False, True])
def test_swiglu_nvfp4_expert_ids_past_scales_are_masked(layout, device):
    """Triton: a row whose expert has no per-expert scale is a padding row (zero bytes), never a read past the
    scales; the bytes equal the reference's for those rows marked -1. (Before: clamped to the last scale.)
    Gates are >= 20 or <= -100 (silu exact on every backend), so the bytes must match exactly."""
    from triton_ops import swiglu as tsw

    x, gs, ids = _swiglu_moe_case()
    got = [t.cpu() for t in tsw.swiglu_nvfp4(x.to(device), 0, "silu", 1.702, None, ids.to(device), None, None,
                                             gs.to(device), layout)]
    want = ref_swiglu.swiglu_nvfp4(x, 0, "silu", 1.702, None, torch.where(ids >= 3, -1, ids), None, None, gs,
                                   layout)
    for a, b, name in zip(got, want, ("codes", "scales", "global_scale"), strict=True):
        assert_same_bytes(a, b, f"{name} swizzled={layout}")
    assert int(got[0][[2, 5]].sum()) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_swiglu_nvfp4_host_expert_ids_are_checked(backend):
    x, gs, ids = _swiglu_moe_case()
    with pytest.raises(LowbitInputError, match=r"lowbit\.swiglu_nvfp4: argument 'expert_ids': holds expert 7 "
                                               r"but global_scale has 3"):
        ops.swiglu_nvfp4(x, expert_ids=ids, global_scale=gs, backend=backend)
    ok = torch.where(ids >= 3, -5, ids)  # any negative id is a padding row
    ops.swiglu_nvfp4(x, expert_ids=ok, global_scale=gs, backend=backend)
    with pytest.raises(LowbitInputError, match="'expert_ids'"):  # also when the signature is remembered
        ops.swiglu_nvfp4(x, expert_ids=ids, global_scale=gs, backend=backend)
    ops.swiglu_nvfp4(x, expert_ids=ids, global_scale=gs[:1], backend=backend)  # one scale for all: any id


# ------------------------------------------------------------------------------------ 4. moe_align: int64 ids


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["single", "general"])
def test_align_int64_ids_are_not_truncated(path, device):
    """int64 ids (and expert maps) are compared at full width: 2^32 + 3 is out of range, not expert 3."""
    from triton_ops.moe import align as talign

    ids = torch.tensor([[2**32 + 3, 1], [0, -2**32 + 2], [5, 2**40 + 1], [7, 2]], dtype=torch.int64)
    for emap in (None, torch.tensor([2**32, 1, 0, -1, 3, 2**33 + 2, 1, 0], dtype=torch.int64)):
        dmap = None if emap is None else emap.to(device)
        want = ref_moe.moe_align(ids, emap, 4 if emap is not None else 8, 4)
        got = talign.moe_align(ids.to(device), dmap, 4 if emap is not None else 8, 4, path=path)
        for a, b, name in zip(got, want, ops.ContiguousLayout._fields, strict=True):
            assert_same_bytes(a.cpu(), b, f"{name} map={emap is not None}")
        want = ref_moe.moe_masked_layout(ids, emap, 8, 2)
        got = [t.cpu() for t in talign.moe_masked_layout(ids.to(device), dmap, 8, 2, path=path)]
        for a, b, name in zip(got, want, ops.MaskedLayout._fields, strict=True):
            assert_same_bytes(a, b, f"masked {name} map={emap is not None}")
    assert want[3].tolist()[0][0] == -1  # 2^32 + 3: no local expert


@pytest.mark.parametrize("device", DEVICES)
def test_align_int64_through_the_op(device):
    ids = torch.tensor([[2**32 + 3, 1], [3, -2**33]], dtype=torch.int64, device=device)
    for backend in ("triton", "torch"):  # the backends agree, on the values int64 ids mean
        lay = ops.moe_align(ids, 8, 2, backend=backend)
        assert lay.inv_rows.tolist() == [[-1, 0], [2, -1]], backend
        assert lay.expert_counts.tolist() == [0, 1, 0, 1] + [0] * 4, backend


# ------------------------------------------------------------------------------------ 5. rope_: q and k alias


def _rope_args(t=3, d=8):
    return torch.arange(t), rope_cos_sin_cache(16, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_inplace_refuses_aliasing_q_k(backend, device, no_fast_path):
    pos, cs = (t.to(device) for t in _rope_args())
    q = torch.randn(3, 2, 8, device=device)
    before = q.clone()
    with pytest.raises(LowbitInputError, match=r"lowbit\.rope_: argument 'k': is the same tensor as q"):
        ops.rope_(q, q, pos, cs, backend=backend)
    buf = torch.randn(3, 6, 8, device=device)
    for k in (buf[:, 1:3], buf[:, :2].view(3, 2, 8)):  # overlapping head slices; a view of the same heads
        with pytest.raises(LowbitInputError, match=r"lowbit\.rope_: argument 'k': shares memory with q"):
            ops.rope_(buf[:, :2], k, pos, cs, backend=backend)
    assert torch.equal(q, before)  # refused before anything was written
    # disjoint head slices of one fused buffer (vLLM's qkv views) are fine, and rotate once
    qkv = torch.randn(3, 6, 8, device=device)
    want = ops.rope(qkv[:, :4], qkv[:, 4:5], pos, cs, backend="torch")
    ops.rope_(qkv[:, :4], qkv[:, 4:5], pos, cs, backend=backend)
    assert torch.allclose(qkv[:, :4], want.q) and torch.allclose(qkv[:, 4:5], want.k)
    ops.rope(q, q, pos, cs, backend=backend)  # out of place: aliasing inputs are harmless


def test_rope_alias_check_runs_on_remembered_signatures():
    """`k is q` is tested in the public wrapper, so a signature the eager fast path remembers still raises."""
    pos, cs = _rope_args()
    q, k = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ops.rope_(q, k, pos, cs, backend="torch")
    ops.rope_(q, k, pos, cs, backend="torch")
    with pytest.raises(LowbitInputError, match="'k': is the same tensor as q"):
        ops.rope_(q, q, pos, cs, backend="torch")


def test_heads_overlap_is_exact():
    """heads_overlap against element sets on random strided [T, H, D] views of one buffer (and two buffers)."""
    from dispatch.ops.rope import heads_overlap

    rng = random.Random(0)
    buf = torch.zeros(2048)

    def view():
        t, h, d = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 5)
        s1 = rng.choice([d, d + rng.randint(0, 3), rng.randint(1, 8)])
        s0 = rng.choice([h * s1, rng.randint(1, 40), h * s1 + rng.randint(0, 5)])
        return t, h, d, (s0, s1, 1), rng.randint(0, 60)

    def elements(x):
        idx = x.storage_offset() + sum(torch.arange(n).view([-1 if i == j else 1 for j in range(3)]) * st
                                       for i, (n, st) in enumerate(zip(x.shape, x.stride(), strict=True)))
        return set(idx.flatten().tolist())

    for _ in range(400):
        t, h, d, st, off = view()
        _, h2, _, st2, off2 = view()
        a = buf.as_strided((t, h, d), st, off)
        b = buf.as_strided((t, h2, d), st2, off2)
        assert heads_overlap(a, b) == bool(elements(a) & elements(b)), (a.stride(), off, b.stride(), off2)
        assert not heads_overlap(a, torch.zeros(t, h2, d))


# ---------------------------------------------------------- 6. non-tensors where tensors go, in every public op


def _q(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _valid_calls() -> dict:
    """A valid tiny call (args, kwargs) of every public op, optional tensors given where the op takes them."""
    pos, cs8 = torch.arange(2), rope_cos_sin_cache(16, 8)
    ids = torch.tensor([[0, 1], [1, 2]], dtype=I32)
    f8 = torch.zeros(2, 128, dtype=torch.float8_e4m3fn)
    sw = dict(expert_ids=torch.tensor([0, -1], dtype=I32))
    return {
        "nvfp4_quantize": ((_q(2, 32),), dict(global_scale=torch.tensor(0.01))),
        "nvfp4_dequantize": ((torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.float8_e4m3fn),
                              torch.tensor(1.0)), {}),
        "mxfp4_quantize": ((_q(2, 32),), {}),
        "mxfp4_dequantize": ((torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)), {}),
        "fp8_group_quantize": ((_q(2, 128),), {}),
        "fp8_group_dequantize": ((f8, torch.ones(2, 1)), {}),
        "nvfp4_global_scale_from_amax": ((torch.tensor(3.0),), {}),
        "nvfp4_encode_global_scale": ((torch.tensor(0.01),), {}),
        "nvfp4_decode_global_scale": ((torch.tensor(100.0),), {}),
        "swizzle_scales_128x4": ((torch.zeros(2, 4, dtype=torch.uint8),), {}),
        "unswizzle_scales_128x4": ((torch.zeros(128, 4, dtype=torch.uint8), 2, 4), {}),
        "rope": ((_q(2, 2, 8), _q(2, 1, 8), pos, cs8), {}),
        "rope_": ((_q(2, 2, 8), _q(2, 1, 8), pos, cs8), {}),
        "paged_kv_write_fp8": ((_q(2, 1, 16), torch.tensor([0, 5]), torch.zeros(2, 4, 1, 16, dtype=torch.uint8)),
                               dict(scale=torch.tensor(1.0))),
        "paged_kv_gather_fp8": ((torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.tensor([0, 5])),
                                dict(scale=torch.tensor(1.0))),
        "ds_kv_write": ((_q(2, 576), torch.tensor([0, 3]), ds_kv_cache_empty(1, 64, "v32", "cpu")), {}),
        "ds_kv_gather": ((ds_kv_cache_empty(1, 64, "v32", "cpu"), torch.tensor([0, 3])), {}),
        "ds_rope_quant_append": ((_q(2, 512), pos, rope_cos_sin_cache(16, 64), torch.tensor([0, 3]),
                                  ds_kv_cache_empty(1, 64, "v4", "cpu")), dict(layout="v4", q=_q(2, 1, 64))),
        "rms_norm": ((_q(2, 32), _q(32)), dict(residual=_q(2, 32))),
        "rms_norm_fp8_group": ((_q(2, 128), _q(128)), dict(residual=_q(2, 128))),
        "rms_norm_mxfp4": ((_q(2, 32), _q(32)), dict(residual=_q(2, 32))),
        "rms_norm_nvfp4": ((_q(2, 32), _q(32)), dict(residual=_q(2, 32), global_scale=torch.tensor(0.01))),
        "swiglu": ((_q(2, 64),), sw),
        "swiglu_fp8_group": ((_q(2, 256),), sw),
        "swiglu_mxfp4": ((_q(2, 64),), sw),
        "swiglu_nvfp4": ((_q(2, 64),), dict(sw, global_scale=torch.tensor([0.01, 0.02]))),
        "moe_route": ((torch.randn(2, 8), 2), dict(bias=torch.randn(8))),
        "moe_hash_route": ((torch.randn(2, 8), torch.tensor([0, 3]), torch.randint(0, 8, (4, 2), dtype=I32)), {}),
        "moe_align": ((ids, 4, 4), dict(expert_map=torch.tensor([0, 1, 2, 3], dtype=I32))),
        "moe_masked_layout": ((ids, 4, 4), dict(expert_map=torch.tensor([0, 1, 2, 3], dtype=I32))),
        "moe_gather": ((_q(2, 16), torch.tensor([0, 3, 4], dtype=I32), 2), {}),
        "moe_gather_fp8": ((_q(2, 128), torch.tensor([0, 3, 4], dtype=I32), 2), {}),
        "moe_combine": ((torch.randn(4, 16), ids, torch.rand(2, 2)), dict(shared=torch.randn(2, 16))),
    }


def _public_ops() -> list[str]:
    """Every public function of dispatch.ops that takes a tensor (ops added by other families included)."""
    return sorted(n for n in ops.__all__ if inspect.isfunction(getattr(ops, n)) and _tensor_params(n))


def _tensor_params(name: str) -> list[str]:
    sig = inspect.signature(getattr(ops, name))
    return [p for p, v in sig.parameters.items() if "Tensor" in str(v.annotation)]


_DUMMY = {"int": 1, "float": 1.0, "bool": False, "str": "x"}


def _bound(name):
    """A valid call's bound arguments (the table above), or for an op it lacks, required arguments filled by
    annotation (tensors: zeros): enough for a check that looks at the first tensor argument first."""
    sig = inspect.signature(getattr(ops, name))
    if name in _valid_calls():
        args, kwargs = _valid_calls()[name]
        return sig.bind(*args, **kwargs)
    fill = {p: torch.zeros(2, 2) if "Tensor" in str(v.annotation) else _DUMMY.get(str(v.annotation))
            for p, v in sig.parameters.items() if v.default is inspect.Parameter.empty}
    return sig.bind(**fill)


@pytest.mark.parametrize("bad", [[1.0, 2.0], 0.5], ids=["list", "float"])
@pytest.mark.parametrize("name", _public_ops())
def test_first_tensor_argument_not_a_tensor(name, bad, no_fast_path):
    """Every public op: a list or float where its first tensor goes is a named error, not an AttributeError."""
    b = _bound(name)
    arg = _tensor_params(name)[0]
    b.arguments[arg] = bad
    with pytest.raises(LowbitInputError, match=rf"lowbit\.{name}: argument '{arg}': expected a torch\.Tensor"
                                               rf"( or None)?, got {type(bad).__name__}"):
        getattr(ops, name)(*b.args, **b.kwargs)


@pytest.mark.parametrize(("name", "arg"), [(n, p) for n in sorted(_valid_calls()) for p in _tensor_params(n)[1:]])
def test_every_tensor_argument_is_checked(name, arg, no_fast_path):
    """The ops of this change: every other tensor argument too (optional ones when given something else)."""
    b = _bound(name)
    b.arguments[arg] = [1.0, 2.0]
    with pytest.raises(LowbitInputError, match=rf"lowbit\.{name}: argument '{arg}': expected a torch\.Tensor"
                                               r"( or None)?, got list"):
        getattr(ops, name)(*b.args, **b.kwargs)


# ------------------------------------------------------------------------- 8. requires_grad: inference only

GRAD_EXEMPT = {"nvfp4_global_scale_from_amax", "nvfp4_encode_global_scale", "nvfp4_decode_global_scale",
               "swizzle_scales_128x4", "unswizzle_scales_128x4"}  # plain torch compositions: autograd works


def _grad_ops():
    return [n for n in sorted(_valid_calls()) if n not in GRAD_EXEMPT and any(
        isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize > 1
        for v in _bound(n).arguments.values())]


@pytest.mark.parametrize("name", _grad_ops())
def test_requires_grad_is_refused_while_grad_is_enabled(name, no_fast_path):
    """Inference ops have no backward; the Triton path used to detach silently. With grad mode on, any input that
    requires grad is a named error; under no_grad / inference_mode the same call runs."""
    b = _bound(name)
    floats = [p for p, v in b.arguments.items()
              if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize > 1]
    for p in floats:
        b.arguments[p] = b.arguments[p].clone().requires_grad_()
    with pytest.raises(LowbitInputError, match=rf"lowbit\.{name}: argument '({'|'.join(floats)})': requires grad"):
        getattr(ops, name)(*b.args, **b.kwargs)
    with torch.no_grad():
        getattr(ops, name)(*b.args, **b.kwargs)


def test_requires_grad_names_the_argument(no_fast_path):
    x, w = torch.randn(2, 32), torch.nn.Parameter(torch.ones(32))  # a module's weight requires grad
    with pytest.raises(LowbitInputError, match=r"lowbit\.rms_norm: argument 'weight': requires grad.*no_grad"):
        ops.rms_norm(x, w, backend="triton")
    with torch.inference_mode():
        assert not ops.rms_norm(x, w, backend="triton").out.requires_grad


# ---------------------------------------------------------------------- 9. NVFP4 with a tiny global scale


def test_min_global_scale_constant_matches_the_kernels():
    from triton_ops._formats import NVFP4_MIN_GS

    assert ref_quant.NVFP4_MIN_GLOBAL_SCALE == NVFP4_MIN_GS.value == 2.0**-118


def _tiny_x(scale=1e-36):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g) * scale
    x[0, :16] = 0.0
    x[1, 3] = -x[1, 3].abs()
    return x


def _cpu(q):
    return type(q)(*(t.cpu() for t in q))


def _assert_zero_quant(q, what):
    assert int((q.codes & 0x77).max()) == 0, f"{what}: nonzero code magnitudes"  # +-0 codes (sign nibble kept)
    assert int(q.scales.view(torch.uint8).max()) == 0, f"{what}: nonzero block scales"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_nvfp4_tiny_global_scale_quantizes_to_zeros(layout, device, no_fast_path):
    """A given |gs| < 2^-118 counts as 0 for the block scales: zero scales, +-0 codes, bit-equal on every backend,
    global_scale returned unchanged. Just above the threshold the reciprocal stays finite and codes do not
    saturate. (Before: every nonzero code saturated to +-6.)"""
    x = _tiny_x()
    cases = [torch.tensor(3e-39), torch.tensor(2.0**-118 * 0.99), torch.tensor(-1e-37), torch.tensor(0.0)]
    for gs in cases:
        got = {"torch": ops.nvfp4_quantize(x, gs, scale_layout=layout, backend="torch"),
               "triton": _cpu(ops.nvfp4_quantize(x.to(device), None if gs is None else gs.to(device),
                                                 scale_layout=layout, backend="triton"))}
        for a, b_, name in zip(got["triton"], got["torch"], ops.NVFP4Quantized._fields, strict=True):
            assert_same_bytes(a, b_, f"{name} gs={gs}")
        _assert_zero_quant(got["torch"], f"gs={gs}")
        assert torch.equal(got["torch"].global_scale, gs) and torch.equal(got["triton"].global_scale, gs)
        assert (ops.nvfp4_dequantize(*got["torch"], scale_layout=layout, out_dtype=torch.float32) == 0).all()
    # just above the threshold: finite reciprocal, real codes (the largest block decodes near amax)
    xs = _tiny_x(1e-34) * (2.0**-118 * 2688 / 1e-34 * 1.01)
    q = {"torch": ops.nvfp4_quantize(xs, scale_layout=layout, backend="torch"),
         "triton": _cpu(ops.nvfp4_quantize(xs.to(device), scale_layout=layout, backend="triton"))}
    for a, b_ in zip(q["triton"], q["torch"], strict=True):
        assert_same_bytes(a, b_, "above the threshold")
    back = ops.nvfp4_dequantize(*q["torch"], scale_layout=layout, out_dtype=torch.float32)
    assert int((q["torch"].codes & 0x77).max()) > 0 and torch.allclose(back, xs, rtol=0.3, atol=xs.abs().max() / 8)


def _relative_error(back, x):
    return float((back - x).abs().max() / x.abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amax", [1e-36, 1e-35, 1e-33, 5e-33])
def test_nvfp4_tiny_tensor_computed_scale_round_trips(amax, device, no_fast_path):
    """A tiny tensor with the global scale computed (amax / 2688 below 2^-118): the computed scale is raised to
    2^-118, so the block scales stay normal E4M3 and the tensor round-trips within the format's error (E2M1 step
    of the largest block: <= 1/6 of its amax, plus the E4M3 scale's rounding), bytes equal on every backend.
    (Before: every code 0, relative error 1.0.)"""
    x = _tiny_x() * (amax / float(_tiny_x().abs().max()))
    q = {"torch": ops.nvfp4_quantize(x, backend="torch"),
         "triton": _cpu(ops.nvfp4_quantize(x.to(device), backend="triton"))}
    for a, b_, name in zip(q["triton"], q["torch"], ops.NVFP4Quantized._fields, strict=True):
        assert_same_bytes(a, b_, f"{name} amax={amax}")
    gs = q["torch"].global_scale
    assert float(gs) >= 2.0**-118 and torch.equal(ops.nvfp4_global_scale_from_amax(x.abs().amax()), gs)
    back = ops.nvfp4_dequantize(*q["torch"], out_dtype=torch.float32)
    assert _relative_error(back, x) < 0.2, (amax, _relative_error(back, x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_expert", [False, True])
def test_swiglu_nvfp4_tiny_global_scale(per_expert, device, no_fast_path):
    """The fused SwiGLU NVFP4 output follows the same rules: a given tiny scale (scalar or per expert) gives zeros,
    a computed one is raised to 2^-118 and the output keeps real codes."""
    x = (torch.randn(4, 64) * 1e-17).bfloat16()  # y ~ g * u / 2 ~ 1e-34: computed gs below 2^-118
    kw = dict(expert_ids=torch.tensor([0, 1, -1, 1], dtype=I32), global_scale=torch.tensor([1e-40, 0.01])) \
        if per_expert else dict(global_scale=None)
    dkw = {k: None if v is None else v.to(device) for k, v in kw.items()}
    got = {"torch": ops.swiglu_nvfp4(x, backend="torch", **kw),
           "triton": _cpu(ops.swiglu_nvfp4(x.to(device), backend="triton", **dkw))}
    for a, b_, name in zip(got["triton"], got["torch"], ops.NVFP4Quantized._fields, strict=True):
        assert_same_bytes(a, b_, f"{name} per_expert={per_expert}")
    if per_expert:  # expert 0's scale is tiny: its row is zeros; expert 1's (0.01) is fine for y ~ 1e-34 too
        row0 = ops.NVFP4Quantized(got["torch"].codes[0], got["torch"].scales[0], got["torch"].global_scale)
        _assert_zero_quant(row0, "expert 0 (gs 1e-40)")
    else:
        assert float(got["torch"].global_scale) == 2.0**-118 and int((got["torch"].codes & 0x77).max()) > 0
    for gs in (torch.tensor(1e-38),):
        a = _cpu(ops.swiglu_nvfp4(x.to(device), global_scale=gs.to(device), backend="triton"))
        b_ = ops.swiglu_nvfp4(x, global_scale=gs, backend="torch")
        for u, v in zip(a, b_, strict=True):
            assert_same_bytes(u, v, "given scalar")
        _assert_zero_quant(b_, "given scalar")


@pytest.mark.parametrize("backend", [
    "torch",
    "triton",
])
@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_nvfp4_tiny_global_scale(backend, device, no_fast_path):
    x = torch.randn(4, 64).bfloat16()
    w = torch.ones(64, dtype=torch.bfloat16)
    want = ops.rms_norm_nvfp4(x, w, global_scale=torch.tensor(1e-39), backend="torch").quantized
    got = _cpu(ops.rms_norm_nvfp4(x.to(device), w.to(device), global_scale=torch.tensor(1e-39, device=device),
                                  backend=backend).quantized)
    _assert_zero_quant(want, "torch")
    for a, b_ in zip(got, want, strict=True):
        assert_same_bytes(a, b_, backend)


# ------------------------------------------------------------------------------ 10. attention: windows, shapes


def _prefill_args(lq=(3,), lk=(5,), hq=2, hkv=1, d=16):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(lq), hq, d, generator=g).bfloat16()
    k = torch.randn(sum(lk), hkv, d, generator=g).bfloat16()
    v = torch.randn(sum(lk), hkv, d, generator=g).bfloat16()
    cu = lambda n: torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=I32)
    return q, k, v, cu(lq), cu(lk), max(lq), max(lk)


def _paged_args():
    q = torch.randn(1, 2, 2, 16).bfloat16()
    cache = torch.randn(2, 4, 1, 16).bfloat16()
    return q, cache, torch.tensor([[0, 1]], dtype=I32), torch.tensor([6], dtype=I32)


BAD_WINDOWS = [((8,), "must be a pair of ints"), (8, "must be a pair of ints"), ((8, 0, 0), "must be a pair of ints"),
               ([4], "must be a pair of ints"), ("ab", "must be a pair of ints"),
               ((7.9, 0), r"left: expected an int .*got 7\.9"), ((0, 2.0), r"right: expected an int .*got 2\.0"),
               ((True, 0), "left: expected an int"), ((-2, 0), "left: -2 is neither -1")]


@pytest.mark.parametrize(("window", "msg"), BAD_WINDOWS, ids=[str(w) for w, _ in BAD_WINDOWS])
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_window_is_a_pair_of_ints(window, msg, backend, no_fast_path):
    """Every attention op parses `window` the same way (contract.attention.window_pair): a named error for a
    wrong length or type, never a raw unpacking error and never a float silently truncated."""
    q, k, v, cq, ck, mq, mk = _prefill_args()
    pq, cache, table, used = _paged_args()
    calls = {
        "attention_prefill": lambda: ops.attention_prefill(q, k, v, cq, ck, mq, mk, window=window, backend=backend),
        "attention": lambda: ops.attention(q[None], k[None], v[None], window=window, backend=backend),
        "attention_prefill_paged": lambda: ops.attention_prefill_paged(
            pq[0], cache, cache, torch.tensor([0, 2], dtype=I32), table, used, 2, window=window, backend=backend),
        "attention_decode": lambda: ops.attention_decode(pq, cache, cache, table, used, window=window,
                                                         backend=backend),
    }
    for op, fn in calls.items():
        with pytest.raises(LowbitInputError, match=rf"lowbit\.{op}: argument 'window': {msg}"):
            fn()


@pytest.mark.parametrize("bad", [7.9, "3", True, -2, None])
def test_mla_window_left_is_an_int(bad, no_fast_path):
    pq, cache, table, used = _paged_args()
    q = torch.randn(1, 1, 2, 576).bfloat16()
    with pytest.raises(LowbitInputError, match=r"lowbit\.mla_decode: argument 'window_left': "):
        ops.mla_decode(q, torch.zeros(2, 4, 576, dtype=torch.bfloat16), table, used, window_left=bad)


def test_attention_window_accepts_integer_types(no_fast_path):
    """numpy and 0-dim integer tensor bounds are ints (operator.index); the result equals the plain ints'."""
    import numpy as np

    q, k, v, cq, ck, mq, mk = _prefill_args()
    want = ops.attention_prefill(q, k, v, cq, ck, mq, mk, window=(1, 0), backend="torch")
    for w in ((np.int64(1), np.int32(0)), (torch.tensor(1), torch.tensor(0)), [1, 0]):
        assert torch.equal(ops.attention_prefill(q, k, v, cq, ck, mq, mk, window=w, backend="torch"), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 4, 5), (2, 0, 5), (2, 3, 0)], ids=["B0", "Sq0", "Sk0"])
def test_batched_attention_empty_dims(shape, backend, device, no_fast_path):
    """ops.attention with B = 0 or Sq = 0: the empty out (B, Sq, Hq, Dv) and lse (B, Sq, Hq) in the right dtypes;
    Sk = 0: every row sees no key (out 0, lse -inf), or the sink's logit with a sink."""
    b, sq, sk = shape
    q = torch.randn(b, sq, 4, 16, device=device).bfloat16()
    k = torch.randn(b, sk, 2, 16, device=device).bfloat16()
    v = torch.randn(b, sk, 2, 8, device=device).bfloat16()
    out, lse = ops.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    assert out.shape == (b, sq, 4, 8) and out.dtype == torch.bfloat16
    assert lse.shape == (b, sq, 4) and lse.dtype == torch.float32
    assert (out == 0).all() and torch.isneginf(lse).all()
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=device)
    out, lse = ops.attention(q, k, v, sinks=sinks, return_lse=True, backend=backend)
    assert out.shape == (b, sq, 4, 8) and (out == 0).all() and torch.equal(lse, sinks.expand(b, sq, 4))


def test_batched_attention_batch_mismatch(no_fast_path):
    q = torch.randn(2, 3, 2, 16).bfloat16()
    with pytest.raises(LowbitInputError, match=r"lowbit\.attention: argument 'k': batch 3 != q's 2"):
        ops.attention(q, torch.randn(3, 3, 2, 16).bfloat16(), q)


# -------------------------------------------------------------------- 11. attention: cu_seqlens values


BAD_OFFSETS = [  # (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, argument, message)
    ([0, 3, 9], [0, 5, 10], 6, "cu_seqlens_q", r"offsets span \[0, 9\] but must lie in \[0, 6\]"),
    ([0, 5, 3], [0, 5, 10], 6, "cu_seqlens_q", r"non-decreasing, but entry 2 \(3\) < entry 1 \(5\)"),
    ([-1, 3, 6], [0, 5, 10], 6, "cu_seqlens_q", r"offsets span \[-1, 6\]"),
    ([0, 3, 6], [0, 11, 10], 6, "cu_seqlens_k", r"offsets span \[0, 10\]|non-decreasing"),
    ([0, 3, 6], [0, 5, 12], 6, "cu_seqlens_k", r"offsets span \[0, 12\] but must lie in \[0, 10\]"),
    ([0, 1, 6], [0, 5, 10], 4, "max_seqlen_q", r"4 is less than the longest sequence in cu_seqlens_q \(5\)"),
]


@pytest.mark.parametrize(("cq", "ck", "mq", "arg", "msg"), BAD_OFFSETS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_host_offsets_are_checked(cq, ck, mq, arg, msg, backend, no_fast_path):
    """cu_seqlens on the host are free to read: past the rows, decreasing, or longer than max_seqlen_q is a named
    error on every backend (the torch reference used to crash, the kernels to clamp)."""
    q, k, v, *_ = _prefill_args((3, 3), (5, 5))
    with pytest.raises(LowbitInputError, match=rf"lowbit\.attention_prefill: argument '{arg}': .*{msg}"):
        ops.attention_prefill(q, k, v, torch.tensor(cq, dtype=I32), torch.tensor(ck, dtype=I32), mq, 5,
                              backend=backend)
    if arg == "cu_seqlens_q":  # the paged op checks its query offsets the same way
        pq, cache, table, used = _paged_args()
        with pytest.raises(LowbitInputError, match=rf"lowbit\.attention_prefill_paged: argument '{arg}': .*{msg}"):
            ops.attention_prefill_paged(q, cache, cache, torch.tensor(cq, dtype=I32), table.expand(2, 2),
                                        used.expand(2), mq, backend=backend)


def test_prefill_device_offsets_clamp_alike():
    """Device offsets are not read on the host: the kernels clamp them into the tensors, and so does the reference
    (the torch backend on a GPU): the same result on every row some clamped sequence covers."""
    from dispatch.reference.attention import attention_prefill as reference
    from triton_ops.attention.prefill import attention_prefill as triton_prefill

    q, k, v, *_ = _prefill_args((8,), (8,))
    cq = torch.tensor([0, 3, 1000, 2, 5], dtype=I32)  # 3..8 (cut at the rows), then empty ranges
    ck = torch.tensor([0, 4, 99999, -7, 8], dtype=I32)  # 4..8, then empty ranges
    got = triton_prefill(q, k, v, cq, ck, 1000, 99999, 0.25, True, -1, -1, None, True)
    want = reference(q, k, v, cq, ck, 1000, 99999, 0.25, True, -1, -1, None, True)
    assert_attention_close(*got, *want, "clamped offsets")
    assert (want[0][3:].abs().sum() > 0) and torch.isfinite(want[1][3:]).all()  # rows 3..7 saw keys 4..7


# ------------------------------------------------------------------------- 12. merge_attn_states: bad lse

NAN, INF = float("nan"), float("inf")
# (lse_a, out_a, lse_b, out_b) -> (out, lse): the documented rules, written out (out_b is [3, 4] throughout)
MERGE_RULES = [
    ((-INF, [NAN, NAN], 0.0), ([3.0, 4.0], 0.0)),  # a -inf part adds nothing, NaN out included
    ((-INF, [INF, 1.0], -INF), ([0.0, 0.0], -INF)),  # both -inf: 0, -inf
    ((NAN, [1.0, 2.0], 0.0), ([NAN, NAN], NAN)),  # a NaN lse: NaN row (the valid part is not silently dropped)
    ((INF, [1.0, 2.0], 0.0), ([NAN, NAN], NAN)),  # +inf: no softmax gives it: NaN row
    ((INF, [1.0, 2.0], INF), ([NAN, NAN], NAN)),
    ((NAN, [1.0, 2.0], -INF), ([NAN, NAN], NAN)),
    ((0.0, [1.0, 2.0], 0.0), ([2.0, 3.0], 0.6931471805599453)),  # a finite row, for contrast
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_nonfinite_lse_rules(backend, device, no_fast_path):
    """merge_attn_states with -inf / NaN / +inf lse (docs/attention.md, Merge): identical rule on every backend,
    both orders of the parts."""
    for (la, oa, lb), (want_o, want_l) in MERGE_RULES:
        for swap in (False, True):
            parts = [(torch.tensor([[oa]]), torch.tensor([[la]])), (torch.tensor([[[3.0, 4.0]]]), torch.tensor([[lb]]))]
            (o1, l1), (o2, l2) = parts[::-1] if swap else parts
            out, lse = ops.merge_attn_states(o1.to(device), l1.to(device), o2.to(device), l2.to(device),
                                             backend=backend)
            what = f"lse_a={la} out_a={oa} lse_b={lb} swap={swap}"
            assert torch.allclose(out.cpu(), torch.tensor([[want_o]]), equal_nan=True), (what, out)
            assert torch.allclose(lse.cpu(), torch.tensor([[want_l]]), equal_nan=True), (what, lse)
