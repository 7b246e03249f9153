"""The native replay of launch plans (dispatch/native_replay.py, dispatch/_replay.cpp) on the CPU: its call key
makes the decisions of `_signature`, it packs each Triton parameter type as Triton's launcher does, it replays a
plan's allocations and outputs, and everything falls back to the Python replay when it is off or unavailable."""

from __future__ import annotations

import dataclasses
import math
import struct
import types

import pytest
import torch

from dispatch import launch_plan, native_replay, use_backend
from dispatch.ops import _common
from tests.test_launch_plan_derive import NO_HOOKS, _copying_backend, _FakeCompiled, _record


@pytest.fixture(scope="module")
def native():
    mod = native_replay.module()
    if mod is None:
        pytest.skip("the native replay extension cannot be built here (no C++ compiler or ninja)")
    return mod


@pytest.fixture(autouse=True)
def _no_plans_left():
    yield
    native_replay.clear()


# ------------------------------------------------------------------------------------------------------- key
def _variants():
    """Argument tuples (backend last) that differ from the first in one field `_signature` keeps, or not at all."""
    base = torch.randn(64, 32)
    x, w = base[:8], torch.randn(32)
    same = (torch.randn(64, 32)[:8], torch.randn(32), 1e-6, "auto")
    return [
        ("base", (x, w, 1e-6, "auto")),
        ("same metadata, other values", same),
        ("dtype", (x.to(torch.float16), w, 1e-6, "auto")),
        ("shape", (base[:9], w, 1e-6, "auto")),
        ("strides", (torch.randn(32, 8).t(), w, 1e-6, "auto")),
        ("storage offset not 16-aligned", (base.view(-1)[1:257].view(8, 32), w, 1e-6, "auto")),
        ("plain value", (x, w, 1e-5, "auto")),
        ("backend", (x, w, 1e-6, "triton")),
        ("int vs float", (x, w, 2, "auto")),
        ("None", (x, None, 1e-6, "auto")),
        ("dtype argument", (x, w, torch.float16, "auto")),
        ("another dtype argument", (x, w, torch.bfloat16, "auto")),
    ]


def test_key_makes_the_decisions_of_signature(native):
    variants = _variants()
    for name_a, a in variants:
        for name_b, b in variants:
            python_same = _common._signature(a) == _common._signature(b)
            native_same = native.key("rms_norm", a) == native.key("rms_norm", b)
            assert python_same == native_same, (name_a, name_b)
    assert native.key("rms_norm", variants[0][1]) != native.key("swiglu", variants[0][1])  # the op is in the key


def test_no_key_for_the_checked_path(native, monkeypatch):
    x = torch.randn(4, 8)
    assert native.key("rms_norm", (x.requires_grad_(), "auto")) is None  # autograd inputs take the checked path
    assert native.key("rms_norm", ([1, 2], "auto")) is None  # another kind of argument
    assert native.key("rms_norm", (1 << 70, "auto")) is None  # an int beyond int64
    with use_backend("torch"):  # a backend scope: the Python path (its key holds the scope)
        assert native.key("rms_norm", (torch.randn(2), "auto")) is None
    monkeypatch.setenv("LOWBIT_CHECK_INDICES", "1")  # value checks on: every call takes the checked path
    assert _common._signature((torch.randn(2), "auto")) is None
    assert native.key("rms_norm", (torch.randn(2), "auto")) is None


@pytest.mark.parametrize("env", ["LOWBIT_BACKEND", "LOWBIT_ARCH", launch_plan.PLANS_ENV, native_replay.NATIVE_ENV])
def test_env_overrides_are_part_of_the_key(native, monkeypatch, env):
    args = (torch.randn(4, 8), "auto")
    before = native.key("rms_norm", args)
    monkeypatch.setenv(env, "1")
    assert native.key("rms_norm", args) not in (None, before)
    monkeypatch.delenv(env)
    assert native.key("rms_norm", args) == before


def test_env_values_are_followed_across_changes(native, monkeypatch):
    """The key's env part is cached while the environment is unchanged; every set, change, unset and re-set of a
    value (back to an earlier one too) gives the key of that environment, as getenv would."""
    args = (torch.randn(4, 8), "auto")
    keys = {}
    for value in ("1", "2", None, "1", "2", "10", None, "2"):
        if value is None:
            monkeypatch.delenv("LOWBIT_BACKEND", raising=False)
        else:
            monkeypatch.setenv("LOWBIT_BACKEND", value)
        monkeypatch.setenv("LOWBIT_UNRELATED_NAME", str(len(keys)))  # other entries changing: no effect
        got = native.key("rms_norm", args)
        assert keys.setdefault(value, got) == got and native.key("rms_norm", args) == got
    assert len(set(keys.values())) == 4
    monkeypatch.setenv("LOWBIT_CHECK_INDICES", "1")  # the last name set: no key at all
    assert native.key("rms_norm", args) is None


# --------------------------------------------------------------------------------------------------- packing
def _bf16_truncated(v: float) -> bytes:
    return struct.pack("<f", v)[2:]


PACK_CASES = [  # (type code, values, the reference packing of one value)
    (native_replay.PTR, [0, None, 0x7F00_1234_5678, 2**64 - 16], lambda v: struct.pack("<Q", v or 0)),
    (2, [0, 1, -1, 127, -128, True], lambda v: struct.pack("<b", v)),
    (3, [0, -1, 32767, -32768], lambda v: struct.pack("<h", v)),
    (4, [0, 7, -1, 2**31 - 1, -(2**31), False], lambda v: struct.pack("<i", v)),
    (5, [0, -1, 2**63 - 1, -(2**63)], lambda v: struct.pack("<q", v)),
    (6, [0, 255, 1], lambda v: struct.pack("<B", v)),
    (7, [0, 65535], lambda v: struct.pack("<H", v)),
    (8, [0, 2**32 - 1], lambda v: struct.pack("<I", v)),
    (9, [0, 2**64 - 1], lambda v: struct.pack("<Q", v)),
    (10, [0.0, -2.5, 1e-6, 65504.0, 1 / 3, 3], lambda v: struct.pack("<e", v)),
    (11, [0.0, 1.0, -3.14159, 1e-6, 1 / 3, 7], _bf16_truncated),
    (12, [0.0, 1e-6, -1 / 3, 3.4e38, math.inf, 5], lambda v: struct.pack("<f", v)),
    (13, [0.0, 1e-300, -1 / 3, math.pi, 9], lambda v: struct.pack("<d", v)),
]


@pytest.mark.parametrize("code,values,ref", PACK_CASES, ids=[str(c[0]) for c in PACK_CASES])
def test_packing_of_each_triton_type(native, code, values, ref):
    assert native.pack(bytes([code] * len(values)), values) == b"".join(ref(v) for v in values)


def test_packing_of_a_mixed_parameter_list(native):
    codes = bytes([1, 4, 11, 2, 5, 12])
    values = [0x1000, -3, 0.5, 1, 1 << 40, 2.0]
    want = struct.pack("<Qi", 0x1000, -3) + _bf16_truncated(0.5) + struct.pack("<bqf", 1, 1 << 40, 2.0)
    assert native.pack(codes, values) == want
    with pytest.raises(ValueError):
        native.pack(bytes([0]), [1])


def test_param_codes_follow_the_installed_launcher():
    src = types.SimpleNamespace(signature={"x": "*bf16", "n": "i32", "flag": "i1", "eps": "fp32", "B": "constexpr",
                                           "u": "u1", "s": "bf16"})
    old = types.SimpleNamespace(src=src, run=types.SimpleNamespace())  # 3.6: C types from the signature strings
    assert native_replay.param_codes(old) == bytes([1, 4, 2, 12, 6, 11])
    new = types.SimpleNamespace(src=src, run=types.SimpleNamespace(kernel_signature=bytes([1, 4, 4, 12, 8, 11])))
    assert native_replay.param_codes(new) == bytes([1, 4, 4, 12, 8, 11])  # 3.9: the launcher's own codes
    desc = types.SimpleNamespace(src=types.SimpleNamespace(signature={"d": "tensordesc<bf16[64, 64]>"}), run=None)
    with pytest.raises(native_replay.NoNative):
        native_replay.param_codes(desc)


def _compiled(signature, **launcher):
    """A CompiledKernel as the conversion reads it."""
    run = types.SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, launch_cooperative_grid=False,
                                launch_pdl=False)
    for k, v in launcher.items():
        setattr(run, k, v)
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=signature), run=run,
                                 metadata=types.SimpleNamespace())


SIG = {"x_ptr": "*fp32", "out_ptr": "*u8", "scale_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}


def test_a_launch_becomes_packed_constants_and_pointer_slots():
    launch = (None, 0x1234, (4, 2, 48), (3, 1, 1),
              [("input", 0, 32), ("alloc", 1, 0), ("const", 0xABC0), ("const", 7), ("const", 64)])
    got = native_replay._describe_launch(launch, _compiled(SIG))
    function, gx, gy, gz, warps, ctas, shared, pdl, codes, values, slots, tma = got
    assert tma == []
    assert (function, gx, gy, gz, warps, ctas, shared, pdl) == (0x1234, 3, 1, 1, 4, 2, 48, False)
    assert codes == bytes([1, 1, 1, 4]) and values == [0, 0, 0xABC0, 7]  # the constexpr is not a parameter
    assert slots == [(0, True, 0, 32), (1, False, 1, 0)]


def test_tensor_descriptors_expand_as_triton_36_launcher_does():
    """A descriptor parameter becomes a CUtensorMap slot (encoding arguments innermost first, byte strides, the
    host element type, the base's byte offset in its root) and its shape (i32) and strides (i64); an fp4-padded
    one doubles its inner dimension. Triton's C launcher (3.7+, `kernel_signature`) keeps the Python replay."""
    from dispatch.launch_plan import _rebased

    sig = {"a_desc": "tensordesc<bf16[64, 128]>", "n": "i32", "b_desc": "tensordesc<u8[32, 64]>", "BLOCK": "constexpr"}
    metas = [dict(swizzle=3, elem_size=2, elem_type=9, block_size=[64, 128], fp4_padded=False),
             dict(swizzle=2, elem_size=1, elem_type=0, block_size=[32, 64], fp4_padded=True)]
    desc = types.SimpleNamespace(base=None, shape=[300, 1024], strides=[2048, 1], block_shape=[64, 128],
                                 padding="zero")
    fp4 = _rebased(desc, None)
    fp4.shape, fp4.strides = [10, 32], [64, 1]
    specs = [("desc", "input", 0, desc, (None, None, 4, torch.bfloat16)), ("const", 7),
             ("desc", "alloc", 1, fp4, None), ("const", 64)]
    compiled = types.SimpleNamespace(src=types.SimpleNamespace(signature=sig), run=types.SimpleNamespace(),
                                     metadata=types.SimpleNamespace(tensordesc_meta=metas))
    codes, values, slots, tma = native_replay._with_descriptors(compiled, list(sig.values()), specs)
    assert list(codes) == [14, 4, 4, 5, 5, 4, 14, 4, 4, 5, 5]
    assert values == [0, 300, 1024, 2048, 1, 7, 0, 10, 64, 64, 1] and slots == []
    assert tma == [(0, True, 0, 8, 8, 3, 0, [1024, 300], [4096], [128, 64]),
                   (6, False, 1, 0, 0, 2, 0, [64, 10], [64], [64, 32])]
    compiled.run.kernel_signature = b"\x01"
    with pytest.raises(native_replay.NoNative, match="3.6"):
        native_replay._with_descriptors(compiled, list(sig.values()), specs)


@pytest.mark.parametrize("attr,value", [("global_scratch_size", 256), ("profile_scratch_size", 64),
                                        ("launch_cooperative_grid", True), ("gsan_enabled", True)])
def test_kernels_the_native_launcher_cannot_replicate_keep_the_python_replay(attr, value):
    launch = (None, 1, (4, 1, 0), (1, 1, 1), [("input", 0, 0), ("alloc", 0, 0), ("const", 0), ("const", 1),
                                              ("const", 8)])
    with pytest.raises(native_replay.NoNative, match=attr):
        native_replay._describe_launch(launch, _compiled(SIG, **{attr: value}))
    bad = (None, 1, (4, 1, 0), (1, 1, 1), [("input", 0, 0), ("alloc", 0, 0), ("const", 0), ("input", 0, 0),
                                           ("const", 8)])
    with pytest.raises(native_replay.NoNative, match="tensor passed"):
        native_replay._describe_launch(bad, _compiled(SIG))


# ---------------------------------------------------------------------------------------------------- replay
def _without_launches(plan):
    """The plan's allocations and outputs only (the CPU has nothing to launch)."""
    return dataclasses.replace(plan, launches=[], kernels=[])


def test_replay_of_allocations_zeroing_and_views(native):
    x = torch.randn(5, 8)
    out, launches, ops = _record(x, _FakeCompiled())
    plan = _without_launches(launch_plan._derive(out, (x,), launches, ops, NO_HOOKS, device_type="cpu"))
    assert native.register("toy", (x, "auto"), native_replay.describe(plan))
    y = torch.randn(5, 8)
    got = native.call("toy", (y, "auto"))
    want = plan(y)
    for g, w in zip(got, want, strict=True):  # the same tensors; the native ones on one block (block_layout)
        assert (g.shape, g.stride(), g.dtype) == (w.shape, w.stride(), w.dtype)
    assert got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
    offsets = native_replay.block_layout(plan.allocs)[0]  # the int8 view of allocation 0, allocation 1 itself
    assert offsets[1] == 0 and offsets[0] == native_replay.BLOCK_ALIGN  # the zero-filled one first
    assert got[0].storage_offset() == offsets[0] + want[0].storage_offset() and got[1].storage_offset() == 0
    got[0].fill_(3)  # the view writes its own allocation's bytes only
    assert float(got[1]) == 0.0  # zeroed again
    assert got[0].data_ptr() != native.call("toy", (y, "auto"))[0].data_ptr()  # fresh outputs each call
    assert native.call("toy", (torch.randn(6, 8), "auto")) is native.MISS  # another shape: no plan
    assert native.call("toy", (y.double(), "auto")) is native.MISS  # another dtype: no plan


def _alloc(shape, dtype, zero=False):
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return launch_plan._Alloc(tuple(shape), tuple(stride), dtype, zero)


_BLOCK_ALLOCS = [_alloc((3, 5), torch.float32), _alloc((7,), torch.uint8, zero=True), _alloc((0, 4), torch.bfloat16),
                 _alloc((300,), torch.float64), _alloc((2, 3), torch.int32, zero=True),
                 _alloc((native_replay.BLOCK_MEMBER_MAX // 2 + 1, 2), torch.int8),  # just over the limit: alone
                 _alloc((1,), torch.float8_e4m3fn)]


def test_block_layout_offsets_alignment_and_no_overlap():
    offsets, total, zero = native_replay.block_layout(_BLOCK_ALLOCS)
    assert offsets[5] == -1  # above BLOCK_MEMBER_MAX: an allocation of its own
    spans = sorted((offsets[j], offsets[j] + max(launch_plan._alloc_bytes(a), 1))
                   for j, a in enumerate(_BLOCK_ALLOCS) if offsets[j] >= 0)
    assert all(o % native_replay.BLOCK_ALIGN == 0 for o, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans[:-1], spans[1:], strict=True))  # disjoint
    assert total % native_replay.BLOCK_ALIGN == 0 and spans[-1][1] <= total
    # the zero-filled ones come first and are exactly the zeroed prefix
    align = native_replay.BLOCK_ALIGN
    assert sorted(offsets[j] for j in (1, 4)) == [0, align] and zero == 2 * align
    assert offsets[0] == zero  # then the others in plan order
    assert native_replay.block_layout(_BLOCK_ALLOCS[:1]) == ([-1], 0, 0)  # one allocation: nothing to share
    assert native_replay.block_layout([_BLOCK_ALLOCS[0], _BLOCK_ALLOCS[5]]) == ([-1, -1], 0, 0)


def test_block_members_are_distinct_tensors_on_one_storage(native):
    x = torch.randn(4)
    plan = launch_plan.LaunchPlan(torch.device("cpu"), _BLOCK_ALLOCS, [],
                                  ("tuple", [("alloc", j, None) for j in range(len(_BLOCK_ALLOCS))]), [])
    desc = native_replay.describe(plan)
    offsets, total, _ = native_replay.block_layout(_BLOCK_ALLOCS)
    assert native.register("toy_block", (x, "auto"), desc)
    for _ in range(2):
        got = native.call("toy_block", (x, "auto"))
        base = got[0].untyped_storage().data_ptr()
        for j, (t, a) in enumerate(zip(got, _BLOCK_ALLOCS, strict=True)):
            assert (tuple(t.shape), t.stride(), t.dtype) == (a.shape, a.stride, a.dtype)
            if offsets[j] < 0:
                assert t.untyped_storage().data_ptr() != base and t.storage_offset() == 0
            else:
                assert t.untyped_storage().data_ptr() == base and t.untyped_storage().nbytes() == total
                assert t.storage_offset() * t.element_size() == offsets[j]
        assert got[1].eq(0).all() and got[4].eq(0).all()  # the zeroed prefix
        for t in got:  # each is written alone: no other member changes
            before = [u.clone() for u in got]
            t.view(-1).view(torch.uint8).fill_(0xA5) if t.numel() else None
            assert all(torch.equal(u.view(torch.uint8), b.view(torch.uint8)) for u, b in zip(got, before, strict=True)
                       if u is not t)
        versions = [t._version for t in got]
        got[0].add_(1)  # own version counters (in-place on one member leaves the others' alone)
        assert [t._version for t in got] == [versions[0] + 1, *versions[1:]]


def test_drop_removes_one_plan(native):
    x = torch.randn(4)
    desc = ("cpu", 0, [], [], ("input", 0, None), None)
    assert native.register("toy_a", (x, "auto"), desc) and native.register("toy_b", (x, "auto"), desc)
    assert native.drop("toy_a", (x, "auto")) and not native.drop("toy_a", (x, "auto"))
    assert native.call("toy_a", (x, "auto")) is native.MISS and native.call("toy_b", (x, "auto")) is x


def test_a_misplaced_block_member_is_refused(native):
    x = torch.randn(4)
    a = ((4,), (1,), torch.float32, False, None, 128, 16)  # not 256-aligned
    with pytest.raises(ValueError, match="block"):
        native.register("toy_bad", (x, "auto"), ("cpu", 0, [a], [], ("alloc", 0, None), None, 512, 0))
    a = ((4,), (1,), torch.float32, True, None, 256, 16)  # zeroed, but past the zeroed prefix
    with pytest.raises(ValueError, match="block"):
        native.register("toy_bad", (x, "auto"), ("cpu", 0, [a], [], ("alloc", 0, None), None, 512, 256))


def test_replay_of_a_copy_from_an_input_view(native):
    launches = []
    x, g = torch.randn(4), torch.randn(5)
    with launch_plan._OpLog(launches) as oplog:
        out = _copying_backend(x, g, _FakeCompiled(), launches)
    plan = _without_launches(launch_plan._derive(out, (x, g), launches, oplog.ops, NO_HOOKS, device_type="cpu"))
    assert native.register("toy_copy", (x, g, "auto"), native_replay.describe(plan))
    g2 = torch.randn(21)[16:]  # same alignment bits, another storage: the view is rebuilt relative to it
    got = native.call("toy_copy", (torch.randn(4), g2, "auto"))
    assert torch.equal(got[1], g2[1:])


def test_replay_of_strided_and_dense_copies(native):
    """A dense view is copied as bytes (a driver memcpy on the GPU), a strided one by ATen: both give the view."""
    x = torch.randn(4)
    dense = ((2, 3), (3, 1), torch.float32, False, (1, (2, 3), (3, 1), 2), -1, 24)
    strided = ((2, 3), (3, 1), torch.float32, False, (1, (2, 3), (1, 2), 1), -1, 24)
    desc = ("cpu", 0, [dense, strided], [], ("tuple", [("alloc", 0, None), ("alloc", 1, None)]), None)
    g = torch.randn(16)
    assert native.register("toy_copies", (x, g, "auto"), desc)
    g2 = torch.randn(32)[16:]  # same alignment bits, another storage offset
    got = native.call("toy_copies", (x, g2, "auto"))
    assert torch.equal(got[0], g2[2:8].view(2, 3))
    assert torch.equal(got[1], g2.as_strided((2, 3), (1, 2), g2.storage_offset() + 1))


def test_public_call_takes_the_native_replay_and_falls_back(native, monkeypatch):
    x = torch.randn(4, 8)
    plan = launch_plan.LaunchPlan(torch.device("cpu"), [], [], ("tuple", [("input", 0, None), ("const", None)]), [])
    args = (x, torch.randn(8), 1e-6, "auto")
    assert native.register("rms_norm_fp8_group", args, native_replay.describe(plan))
    assert native_replay.planned("rms_norm_fp8_group", args)
    got = _common.call("rms_norm_fp8_group", *args)  # the registered plan answers (the real op would not)
    assert got[0] is x and got[1] is None
    monkeypatch.setenv(native_replay.NATIVE_ENV, "0")  # off: the key differs, the call misses
    assert not native_replay.planned("rms_norm_fp8_group", args)
    assert native.call("rms_norm_fp8_group", args) is native.MISS
    assert not native_replay.adopt("rms_norm_fp8_group", args, plan)
    monkeypatch.delenv(native_replay.NATIVE_ENV)
    _common._FAST.clear()  # clearing the fast paths drops the native plans too
    assert not native_replay.planned("rms_norm_fp8_group", args)


def test_a_plan_with_launches_needs_a_cuda_device(native):
    plan = types.SimpleNamespace(allocs=[], launches=[(None, 1, (4, 1, 0), (1, 1, 1), [("const", 0)])],
                                 kernels=[_compiled({"p": "*fp32"})], device=torch.device("cpu"),
                                 outputs=("const", None))
    with pytest.raises(RuntimeError, match="CUDA"):
        native.register("toy_launch", (torch.randn(2), "auto"), native_replay.describe(plan))
    launch = (1, 1, 1, 1, 4, 1, 0, False, bytes([4]), [0], [(0, True, 0, 0)])  # a pointer slot on an i32
    with pytest.raises(ValueError, match="non-pointer"):
        native.register("toy_launch", (torch.randn(2), "auto"), ("cuda", 0, [], [launch], ("const", None), None))
    assert not native_replay.planned("toy_launch", (torch.randn(2), "auto"))
    assert not native_replay.adopt("toy_launch", (torch.randn(2), "auto"), plan)  # refused, never raised
    assert "CUDA" in native_replay.REFUSALS["toy_launch"]


def test_unavailable_extension_falls_back_to_python(monkeypatch, caplog):
    monkeypatch.setattr(native_replay, "_state", {"module": None, "tried": False})

    def no_compiler():
        raise OSError("no C++ compiler")

    monkeypatch.setattr(native_replay, "_build", no_compiler)
    with caplog.at_level("DEBUG", logger="lowbit.dispatch"):
        assert native_replay.module() is None
        assert not native_replay.adopt("swiglu", (torch.randn(2), "auto"), object())
    assert "unavailable" in caplog.text and native_replay.REFUSALS["swiglu"]
    monkeypatch.setattr(native_replay, "_state", {"module": None, "tried": False})
    monkeypatch.setenv(native_replay.NATIVE_ENV, "0")
    assert native_replay.module() is None  # off: nothing is built


_TOY_PTX = r"""
import importlib.util, json, os, re, tempfile, types
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from dispatch import native_replay

SOURCE = '''
import triton.language as tl


def toy(x_ptr, n, flag, eps, big, h, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + o + big, mask=o < n)
    tl.store(x_ptr + o, tl.where(flag, v * eps + h, v), mask=o < n)
'''
# Triton reads a kernel's source from its file: the toy kernel lives in a module of its own.
path = os.path.join(tempfile.mkdtemp(), "toy_kernel.py")
with open(path, "w") as f:
    f.write(SOURCE)
spec = importlib.util.spec_from_file_location("toy_kernel", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sig = {"x_ptr": "*fp32", "n": "i32", "flag": "i1", "eps": "fp32", "big": "i64", "h": "bf16", "BLOCK": "constexpr"}
source = ASTSource(JITFunction(mod.toy), sig, constexprs={(6,): 128})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
params = re.search(r"\.entry\s+\w+\((.*?)\)", compiled.asm["ptx"], re.S).group(1).split(",")
size = {"u64": 8, "u32": 4, "u8": 1, "f32": 4}
declared = [int(m.group(1)) if (m := re.search(r"\.b8 \w+\[(\d+)\]", p)) else size[p.split()[1][1:]] for p in params]
codes = native_replay.param_codes(types.SimpleNamespace(src=compiled.src, run=types.SimpleNamespace()))
print(json.dumps(dict(codes=list(codes), declared=declared)))
"""


def test_packed_sizes_match_a_compiled_kernels_parameters():
    """The generated-launcher mapping (Triton 3.6) against the PTX parameter list of a kernel compiled for sm_90
    with the installed Triton: one parameter per non-constexpr argument, of the size the kernel declares, then the
    global and profile scratch pointers. Compiled in a fresh process: a process that ran interpreted kernels has
    Triton's language patched for the interpreter."""
    import json

    from tests.helpers import run_compile_script

    got = json.loads(run_compile_script(_TOY_PTX, timeout=300).strip().splitlines()[-1])
    sizes = {1: 8, 2: 1, 4: 4, 5: 8, 11: 2, 12: 4}
    assert [sizes[c] for c in got["codes"]] + [8, 8] == got["declared"]


_DESCRIPTOR_PTX = r"""
import json, os, re, types
os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernel
from dispatch import native_replay
from triton_ops.attention import prefill_sm90
compiled = prefill_sm90.compile_sm90(64, 64, hq=8, hkv=1, causal=True, window=(128, 0), sink=True)
sig = list(compiled.src.signature.values())
template = types.SimpleNamespace(base=None, shape=[256, 512], strides=[512, 1], padding="zero")
specs = [("desc", "input", 0, template, None) if t.startswith("tensordesc") else ("input", 1, 0)
         if t.startswith("*") else ("const", 0.5 if t == "fp32" else 3) for t in sig]
as_launched = types.SimpleNamespace(src=compiled.src, metadata=compiled.metadata, run=types.SimpleNamespace())
codes, values, slots, tma = native_replay._with_descriptors(as_launched, sig, specs)
params = re.search(r"\.entry\s+\w+\((.*?)\)", compiled.asm["ptx"], re.S).group(1).split(",")
declared = [int(m.group(1)) if (m := re.search(r"\.b8 \w+\[(\d+)\]", p)) else
            {"u64": 8, "u32": 4, "f32": 4}[p.split()[1][1:]] for p in params]
print(json.dumps(dict(codes=list(codes), declared=declared, tma=tma)))
"""


def test_descriptor_parameters_match_a_gluon_kernels_ptx():
    """The expansion of tensor descriptors (and the other parameters) against the PTX parameter list of the sm_90
    Gluon prefill kernel compiled with Triton 3.6 (the GPU host's; a fresh process, as the Gluon compile tests):
    each descriptor a 128-byte map, then its shape (4 bytes each) and strides (8 bytes each); the scratch pointers
    last."""
    from tests.test_attention_sm90 import _triton36_env, run_compile_json

    env, why = _triton36_env()
    if env is None:
        pytest.skip(why)
    got = run_compile_json(_DESCRIPTOR_PTX, env)
    sizes = {native_replay.PTR: 8, native_replay.I32: 4, native_replay.I64: 8, 12: 4, native_replay.TMA: 128}
    assert [sizes[c] for c in got["codes"]] + [8, 8] == got["declared"]
    # bf16: the driver enum CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 (9; the kernel metadata says 10); 128-byte swizzle (3)
    assert len(got["tma"]) == 5 and all(t[4:7] == [9, 3, 0] for t in got["tma"])


@pytest.mark.slow  # a second full C++ build of the extension (the first is the fixture's): the slow run
def test_the_extension_builds_without_ninja(monkeypatch, tmp_path):
    """The direct compiler call (machines without ninja) gives a working module."""
    from torch.utils import cpp_extension

    if native_replay.module() is None:
        pytest.skip("the native replay extension cannot be built here")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    mod = native_replay._compile_directly("lowbit_replay_direct_check", cpp_extension)
    assert mod.pack(bytes([4, 12]), [-2, 0.5]) == struct.pack("<if", -2, 0.5)
    assert (tmp_path / "lowbit_replay_direct_check" / "lowbit_replay_direct_check.so").exists()


# A stand-in libcuda.so.1 that records the last cuLaunchKernelEx: what the extension hands the driver is checked on
# the CPU (in a subprocess: the stand-in must never meet a real driver).
_FAKE_DRIVER = r"""
#include <stdint.h>
#include <string.h>
typedef struct { int id; char pad[4]; union { char raw[64]; void* align; } value; } Attr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shared; void* stream; Attr* attrs; unsigned n; } Config;
static Config last; static Attr attrs[4]; static uint64_t params[64]; static int expect, launches; static void* fn;
static uint64_t map_tail;
int cuLaunchKernelEx(const Config* c, void* f, void** p, void** extra) {
  last = *c; memcpy(attrs, c->attrs, sizeof(Attr) * (c->n < 4 ? c->n : 4)); fn = f; launches++;
  for (int i = 0; i < expect; ++i) memcpy(&params[i], p[i], 8);
  if (expect > 1) memcpy(&map_tail, (char*)p[1] + 120, 8);  /* the last 8 bytes of a map in parameter 1 */
  return extra == 0 ? 0 : 1;
}
uint64_t fake_map_tail(void) { return map_tail; }
int cuCtxGetCurrent(void** c) { *c = (void*)1; return 0; }
int cuDeviceGet(int* d, int o) { *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void** c, int d) { *c = (void*)1; return 0; }
int cuCtxSetCurrent(void* c) { return 0; }
int cuFuncSetAttribute(void* f, int a, int v) { return 0; }
int cuGetErrorString(int r, const char** s) { *s = "fake"; return 0; }
static uint64_t memsets[8][4]; static int n_memsets;  /* width, pointer, count, stream */
static int memset_call(int width, uint64_t p, uint64_t n, void* s) {
  if (n_memsets < 8) { uint64_t m[4] = {width, p, n, (uint64_t)s}; memcpy(memsets[n_memsets], m, sizeof(m)); }
  n_memsets++; return 0;
}
int cuMemsetD8Async(uint64_t p, unsigned char v, size_t n, void* s) { return v ? 1 : memset_call(8, p, n, s); }
int cuMemsetD32Async(uint64_t p, unsigned v, size_t n, void* s) { return v ? 1 : memset_call(32, p, n, s); }
int cuMemcpyAsync(uint64_t d, uint64_t s, size_t n, void* st) { return 1; }  /* not expected here */
static uint64_t encoded[24]; static int n_encoded;  /* the last cuTensorMapEncodeTiled's arguments */
int cuTensorMapEncodeTiled(void* map, int type, unsigned rank, void* addr, const uint64_t* dims,
                           const uint64_t* strides, const unsigned* box, const unsigned* es, int il, int sw, int l2,
                           int fill) {
  uint64_t a = (uint64_t)addr; memcpy(map, &a, 8); memset((char*)map + 8, 0xAB, 120);  /* marks the whole map */
  encoded[0] = type; encoded[1] = rank; encoded[2] = a; encoded[3] = il; encoded[4] = sw; encoded[5] = l2;
  encoded[6] = fill; encoded[7] = (uint64_t)map % 64;
  for (unsigned i = 0; i < rank; ++i) { encoded[8 + i] = dims[i]; encoded[13 + i] = box[i] | ((uint64_t)es[i] << 32); }
  for (unsigned i = 0; i + 1 < rank; ++i) encoded[18 + i] = strides[i];
  n_encoded++; return 0;
}
uint64_t fake_encoded(int i) { return encoded[i]; }
int fake_n_encoded(void) { return n_encoded; }
int fake_memsets(void) { return n_memsets; }
uint64_t fake_memset(int i, int f) { return memsets[i][f]; }
void fake_expect(int n) { expect = n; }
int fake_launches(void) { return launches; }
void* fake_function(void) { return fn; }
void fake_config(unsigned* out) { memcpy(out, &last, 7 * sizeof(unsigned)); out[7] = last.n; }
uint64_t fake_stream(void) { return (uint64_t)last.stream; }
void fake_attr(int i, int* out) { out[0] = attrs[i].id; memcpy(out + 1, attrs[i].value.raw, 12); }
uint64_t fake_param(int i) { return params[i]; }
"""

_FAKE_RUN = r"""
import ctypes, json, sys
import torch
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
from dispatch import native_replay
mod = native_replay.module()
mod.init((native_replay.NATIVE_ENV,), None, lambda: 0, lambda device: 0x5000)
x = torch.randn(64)
empty = (0xF00, 0, 1, 1, 4, 1, 0, False, bytes([4]), [1], [])  # an empty grid: not launched
launch = (0xF00, 3, 2, 1, 4, 2, 1024, True, bytes([1, 1, 4, 11, 2]), [0, 0xABC0, -7, 0.5, 1], [(0, True, 0, 16)])
assert mod.register("fake", (x, "auto"), ("cuda", 0, [], [empty, launch], ("input", 0), None))
lib.fake_expect(7)
assert mod.call("fake", (x, "auto")) is x
cfg = (ctypes.c_uint * 8)()
lib.fake_config(cfg)
attrs = []
for i in range(cfg[7]):
    a = (ctypes.c_int * 4)()
    lib.fake_attr(i, a)
    attrs.append(list(a))
lib.fake_param.restype = lib.fake_stream.restype = lib.fake_function.restype = ctypes.c_uint64
lib.fake_memset.restype = ctypes.c_uint64
for ptr, n in ((0x10000, 512), (0x10000, 6), (0x10002, 8), (0x10000, 0)):  # words where both allow; none for 0
    mod.memset(ptr, n, 0x7000)
memsets = [[lib.fake_memset(i, f) for f in range(4)] for i in range(lib.fake_memsets())]
result = dict(launches=lib.fake_launches(), function=lib.fake_function(), config=list(cfg), stream=lib.fake_stream(),
              attrs=attrs, params=[lib.fake_param(i) for i in range(7)], x=x.data_ptr(), memsets=memsets)
# a tensor descriptor over x[2:] (a view 8 bytes in): an i32, the map, its shape (i32 x 2), its strides (i64 x 2)
tma = (0xF01, 1, 1, 1, 4, 1, 0, False, bytes([4, 14, 4, 4, 5, 5]), [9, 0, 62, 1, 1, 1], [],
       [(1, True, 0, 8, 10, 3, 0, [1, 62], [4], [1, 16])])
assert mod.register("fake_tma", (x, "auto"), ("cuda", 0, [], [tma], ("input", 0), None))
lib.fake_expect(8)
mod.call("fake_tma", (x, "auto"))
lib.fake_encoded.restype = lib.fake_map_tail.restype = ctypes.c_uint64
result.update(encoded=[lib.fake_encoded(i) for i in range(20)], n_encoded=lib.fake_n_encoded(),
              tma_params=[lib.fake_param(i) for i in range(8)], map_tail=lib.fake_map_tail())
print(json.dumps(result))
"""


def test_what_the_driver_receives(native, tmp_path):
    """Grid x clusters, block = 32 x warps, shared memory, the current stream, the PDL / cluster attributes, every
    parameter (a pointer slot filled with the input's address + offset, the packed constants) and the two null
    scratch pointers, as Triton's launcher passes them; an empty grid is not launched. Zero-fills are driver
    memsets."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("a stand-in driver must not meet the real one (the GPU tests launch for real)")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in driver")
    (tmp_path / "fake.c").write_text(_FAKE_DRIVER)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(tmp_path / "fake.c")],
                   check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _FAKE_RUN, str(lib)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["launches"] == 1 and got["function"] == 0xF00 and got["stream"] == 0x5000
    assert got["config"] == [3 * 2, 2, 1, 128, 1, 1, 1024, 3]  # grid x num_ctas, 32 x 4 warps, shared, 3 attributes
    pdl, cluster, policy = got["attrs"]
    assert pdl[:2] == [6, 1] and cluster == [4, 2, 1, 1] and policy[:2] == [5, 1]
    mask = [2**64 - 1, 2**64 - 1, 2**32 - 1, 2**16 - 1, 2**8 - 1, 2**64 - 1, 2**64 - 1]
    params = [p & m for p, m in zip(got["params"], mask, strict=True)]
    bf16_half = struct.unpack("<H", _bf16_truncated(0.5))[0]
    assert params == [got["x"] + 16, 0xABC0, 2**32 - 7, bf16_half, 1, 0, 0]
    # zero-fills: one asynchronous driver memset on the given stream, 32-bit words where pointer and size allow
    assert got["memsets"] == [[32, 0x10000, 128, 0x7000], [8, 0x10000, 6, 0x7000], [8, 0x10002, 8, 0x7000]]
    # a tensor descriptor: encoded per call for the base address (input + offset) into a 64-byte aligned map that
    # is passed whole, then its shape and strides as plain parameters
    enc = got["encoded"]
    assert got["n_encoded"] == 1 and enc[:8] == [10, 2, got["x"] + 8, 0, 3, 2, 0, 0]
    assert enc[8:10] == [1, 62] and enc[13:15] == [1 | 1 << 32, 16 | 1 << 32] and enc[18] == 4
    assert got["tma_params"][0] & 0xFFFFFFFF == 9 and got["tma_params"][1] == got["x"] + 8
    assert got["map_tail"] == 0xABABABABABABABAB
    assert [p & 0xFFFFFFFF for p in got["tma_params"][2:4]] == [62, 1] and got["tma_params"][4:8] == [1, 1, 0, 0]
