"""Launch-plan derivation (dispatch/launch_plan.py) on the CPU: a recorded call's allocations, views and launches
become a plan whose replay passes the same pointers (relative to new inputs / allocations) and rebuilds the
outputs; calls that do more than allocate, zero, view and launch get no plan."""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest
import torch

from dispatch import launch_plan
from triton_ops.contract.recording import LaunchRecord


class _FakeKernel:
    """What the derivation reads of a JITFunction: its Python signature and which parameters are constexpr."""

    def __init__(self, fn, constexprs):
        self.signature = inspect.signature(fn)
        self.params = [types.SimpleNamespace(name=n, is_constexpr=n in constexprs) for n in self.signature.parameters]


class _FakeCompiled:
    """A compiled kernel whose launcher records what it was given."""

    def __init__(self):
        self.calls = []
        self.function, self.packed_metadata = object(), object()

    def run(self, gx, gy, gz, stream, function, metadata, launch_md, enter, exit_, *values):
        self.calls.append(((gx, gy, gz), values))


def _kernel(x_ptr, out_ptr, scale_ptr, n, BLOCK):  # the parameter list of a pretend @triton.jit kernel
    pass


KERNEL = _FakeKernel(_kernel, {"BLOCK"})
NO_HOOKS = types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))


def _backend(x, compiled):
    """A pretend backend: allocates, views, zeroes a scratch word, launches once, returns views."""
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=torch.uint8)
    scale = torch.empty(1, dtype=torch.float32)
    scale.zero_()
    rows = x.view(-1, x.shape[-1])[1:]  # a view of the input at an offset
    record = LaunchRecord(KERNEL, (4,), (rows, out, scale, rows.shape[0]), {"BLOCK": 64, "num_warps": 4}, compiled)
    return (out.view(torch.int8), scale), [record]


def _record(x, compiled, extra_op=None):
    with launch_plan._OpLog() as oplog:
        out, launches = _backend(x, compiled)
        if extra_op is not None:
            extra_op(out)
    return out, launches, oplog.ops


def test_replay_rebuilds_pointers_and_outputs():
    compiled = _FakeCompiled()
    x = torch.randn(5, 8)
    out, launches, ops = _record(x, compiled)
    plan = launch_plan._derive(out, (x,), launches, ops, NO_HOOKS, device_type="cpu")
    assert [a.zero for a in plan.allocs] == [False, True]
    y = torch.randn(5, 8)
    got = plan(y)
    grid, values = compiled.calls[-1]
    assert grid == (4, 1, 1)
    assert values[0] == y.data_ptr() + 8 * 4  # rows = y[1:]: one row of 8 fp32 past y's start
    assert values[1] == got[0].data_ptr() and values[2] == got[1].data_ptr()
    assert values[3:] == (4, 64)  # the int and the constexpr, as Triton's launch passes them
    assert got[0].dtype == torch.int8 and got[0].shape == (5, 4)
    assert float(got[1]) == 0.0  # the zeroed allocation is zeroed again
    assert got[0].data_ptr() != out[0].data_ptr()  # fresh outputs each call


@pytest.mark.parametrize("extra", [lambda out: out[1].fill_(3.0), lambda out: out[0].clone(),
                                   lambda out: out[1].copy_(torch.ones(1))])
def test_calls_that_compute_on_the_host_side_get_no_plan(extra):
    compiled = _FakeCompiled()
    x = torch.randn(5, 8)
    out, launches, ops = _record(x, compiled, extra)
    with pytest.raises(launch_plan.NoPlan):
        launch_plan._derive(out, (x,), launches, ops, NO_HOOKS, device_type="cpu")


def test_no_plan_with_a_launch_hook_or_on_another_device():
    compiled = _FakeCompiled()
    x = torch.randn(5, 8)
    out, launches, ops = _record(x, compiled)
    hooked = types.SimpleNamespace(runtime=types.SimpleNamespace(
        launch_enter_hook=types.SimpleNamespace(calls=[print]), launch_exit_hook=None))
    with pytest.raises(launch_plan.NoPlan, match="hook"):
        launch_plan._derive(out, (x,), launches, ops, hooked, device_type="cpu")
    empty_chain = types.SimpleNamespace(runtime=types.SimpleNamespace(
        launch_enter_hook=types.SimpleNamespace(calls=[]), launch_exit_hook=types.SimpleNamespace(calls=[])))
    assert launch_plan._derive(out, (x,), launches, ops, empty_chain, device_type="cpu") is not None
    with pytest.raises(launch_plan.NoPlan, match="device"):
        launch_plan._derive(out, (x,), launches, ops, NO_HOOKS, device_type="cuda")


def _copying_backend(x, g, compiled, launches, copy_after_launch=False):
    """Returns a copy of the input g (a given scale) beside a launch's output, as swiglu_nvfp4 does."""
    out = torch.empty(x.shape[0], dtype=torch.float32)
    g_out = torch.empty(g.shape[0] - 1, dtype=g.dtype)
    if not copy_after_launch:
        g_out.copy_(g[1:])
    launches.append(LaunchRecord(KERNEL, (1,), (x, out, g_out, x.shape[0]), {"BLOCK": 8}, compiled))
    if copy_after_launch:
        g_out.copy_(g[1:])
    return out, g_out


def test_a_copy_of_an_input_view_into_an_allocation_is_replayed():
    compiled, launches = _FakeCompiled(), []
    x, g = torch.randn(4), torch.randn(5)
    with launch_plan._OpLog(launches) as oplog:
        out = _copying_backend(x, g, compiled, launches)
    plan = launch_plan._derive(out, (x, g), launches, oplog.ops, NO_HOOKS, device_type="cpu")
    g2 = torch.randn(8)[2:7]  # another storage offset: the view is rebuilt relative to the new input
    got = plan(torch.randn(4), g2)
    assert torch.equal(got[1], g2[1:])
    assert compiled.calls[-1][1][2] == got[1].data_ptr()
    launches.clear()
    with launch_plan._OpLog(launches) as oplog:
        out = _copying_backend(x, g, compiled, launches, copy_after_launch=True)
    with pytest.raises(launch_plan.NoPlan, match="after a launch"):
        launch_plan._derive(out, (x, g), launches, oplog.ops, NO_HOOKS, device_type="cpu")


@dataclasses.dataclass
class _Descriptor:
    """What a host tensor descriptor (Gluon's / Triton's TensorDescriptor) is to a plan: a base tensor and fixed
    metadata."""
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list


def _descriptor_backend(x, compiled, launches, base_of_view=False):
    out = torch.empty(x.shape[0], 4)
    base = x[1:] if base_of_view else x
    descs = (_Descriptor(base, list(base.shape), list(base.stride()), [2, 8]), _Descriptor(out, [5, 4], [4, 1], [2, 4]))
    launches.append(LaunchRecord(KERNEL, (3,), (*descs, x, x.shape[0]), {"BLOCK": 8}, compiled))
    return out


def test_host_tensor_descriptors_are_rebased_on_each_call():
    compiled, launches = _FakeCompiled(), []
    x = torch.randn(5, 8)
    with launch_plan._OpLog(launches) as oplog:
        out = _descriptor_backend(x, compiled, launches)
    plan = launch_plan._derive(out, (x,), launches, oplog.ops, NO_HOOKS, device_type="cpu")
    assert all(s[3].base is None for s in plan.launches[0][4] if s[0] == "desc")  # no tensor of the recorded call kept
    y = torch.randn(5, 8)
    got = plan(y)
    d_in, d_out, ptr, n, block = compiled.calls[-1][1]
    assert d_in.base is y and d_out.base.data_ptr() == got.data_ptr() and (ptr, n, block) == (y.data_ptr(), 5, 8)
    assert (d_in.shape, d_in.strides, d_in.block_shape) == ([5, 8], [8, 1], [2, 8])
    assert plan.census()["launches"] == 1
    from dispatch import native_replay

    run, function, _, grid, specs = plan.launches[0]
    as_compiled = dataclasses.replace(plan, launches=[(run, 1, (4, 1, 0), grid, specs)],
                                      kernels=[_tensordesc_compiled()])
    with pytest.raises(native_replay.NoNative, match="as a pointer"):  # no TMA metadata: Python replays it
        native_replay.describe(as_compiled)
    meta = dict(swizzle=3, elem_size=4, elem_type=7, block_size=[2, 8], fp4_padded=False)
    as_compiled.kernels[0].metadata.tensordesc_meta = [meta, dict(meta, block_size=[2, 4])]
    launch = native_replay.describe(as_compiled)[3][0]  # with it: the extension encodes both per call
    assert [t[:4] for t in launch[11]] == [(0, True, 0, 0), (5, False, 0, 0)]  # map, 2 x i32, 2 x i64 each


def _tensordesc_compiled():
    sig = {"x_ptr": "tensordesc<fp32[2, 8]>", "out_ptr": "tensordesc<fp32[2, 4]>", "scale_ptr": "*fp32", "n": "i32",
           "BLOCK": "constexpr"}
    return types.SimpleNamespace(src=types.SimpleNamespace(signature=sig), run=types.SimpleNamespace(),
                                 metadata=types.SimpleNamespace(), function=1)


def test_a_descriptor_over_a_view_of_an_input_is_rebuilt_as_that_view():
    compiled, launches = _FakeCompiled(), []
    x = torch.randn(5, 8)
    with launch_plan._OpLog(launches) as oplog:
        out = _descriptor_backend(x, compiled, launches, base_of_view=True)
    plan = launch_plan._derive(out, (x,), launches, oplog.ops, NO_HOOKS, device_type="cpu")
    y = torch.randn(21, 8)[16:]  # another storage offset, the same alignment bits
    plan(y)
    d_in = compiled.calls[-1][1][0]
    assert d_in.base.data_ptr() == y[1:].data_ptr() and d_in.base.shape == (4, 8) and d_in.base.stride() == (8, 1)


def test_a_descriptor_over_a_tensor_of_its_own_gets_no_plan():
    compiled, launches = _FakeCompiled(), []
    x, other = torch.randn(5, 8), torch.randn(5, 8)  # other: neither an input nor an allocation of the call
    with launch_plan._OpLog(launches) as oplog:
        out = torch.empty(5, 4)
        launches.append(LaunchRecord(KERNEL, (3,), (_Descriptor(other, [5, 8], [8, 1], [2, 8]), out, x, 5),
                                     {"BLOCK": 8}, compiled))
    with pytest.raises(launch_plan.NoPlan, match="descriptor"):
        launch_plan._derive(out, (x,), launches, oplog.ops, NO_HOOKS, device_type="cpu")


def test_no_record_is_built_outside_a_recording_scope():
    """Every eager launch notes its record: outside a recording scope nothing is built (no per-call cost)."""
    from triton_ops.contract.recording import note, recording_launches

    built = []

    def kind(*fields):
        built.append(fields)
        return fields

    note(kind, 1, 2)
    assert built == []
    with recording_launches() as records:
        note(kind, 1, 2)
    assert built == [(1, 2)] and records == [(1, 2)]
