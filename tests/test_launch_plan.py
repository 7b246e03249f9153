"""Eager launch plans (dispatch/launch_plan.py): the second eager call of a signature replays the first call's
allocations and compiled launches; it must give the reference's result on new values, for every op, through the
native replay (dispatch/native_replay.py) and through the Python one. A natively replayed call can be captured in
a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from dispatch import launch_plan, native_replay
from dispatch.ops import _common
from dispatch.selfcheck import all_cases, byte_mismatches
from dispatch.table import TABLE


def _perturbed(args: tuple, seed: int) -> tuple:
    """Same metadata (so the same signature), new values for every floating-point tensor."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.element_size() > 1:
            noise = torch.rand(a.shape, generator=g, device=a.device, dtype=torch.float32) + 0.5
            b = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
            b.copy_((a.float() * noise).to(a.dtype))
            out.append(b)
        elif isinstance(a, torch.Tensor):
            out.append(a.clone())
        else:
            out.append(a)
    return tuple(out)


CASES = all_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c.op}-{i}" for i, c in enumerate(CASES)])
def test_replayed_call_matches_reference(case, native, monkeypatch):
    monkeypatch.setenv(launch_plan.PLANS_ENV, "1")
    if not native:
        monkeypatch.setenv(native_replay.NATIVE_ENV, "0")
    args = case.make_args(torch.device("cuda"), True)
    _common._FAST.clear()
    first = _perturbed(args, 1)
    _common.call(case.op, *first, "auto")  # records; in-place ops mutate `first`, not what is checked below
    second = _perturbed(args, 2)
    ref_args = _perturbed(args, 2)  # the same values, for the reference
    key = (case.op, _common._signature((*second, "auto")))
    fast = _common._FAST.get(key)
    if native and isinstance(fast, launch_plan.LaunchPlan):  # every plan must replay natively (descriptors too)
        assert native_replay.module() is not None, "the native replay extension did not build"
        assert native_replay.planned(case.op, (*second, "auto")), \
            f"{case.op} ({case.label}): no native replay: {native_replay.REFUSALS.get(case.op)}"
    out = _common.call(case.op, *second, "auto")
    want = getattr(torch.ops.lowbit, case.op)(*ref_args, "torch")
    if out is not None:
        ok, msg = case.compare(_absent_as_empty(out, want), want)
        assert ok, f"{case.op} ({case.label}) through {type(fast).__name__}: {msg}"
    for i, (got, ref) in enumerate(zip(second, ref_args, strict=True)):  # in-place ops: the written buffers
        if isinstance(got, torch.Tensor):
            assert byte_mismatches(got, ref) == 0, f"{case.op}: argument {i} differs after the replayed call"
    if any(not e.is_reference for e in TABLE[case.op]):  # which ops replay a plan, and why not (-s shows it)
        print(f"\n{case.op}: {type(fast).__name__} {_common._PLAN_REFUSALS.get(case.op) or ''}")


@pytest.mark.gpu
def test_native_replay_is_captured_by_a_cuda_graph(monkeypatch):
    monkeypatch.setenv(launch_plan.PLANS_ENV, "1")
    _common._FAST.clear()
    case = args = None
    for c in CASES:  # the first case with outputs (not in-place) whose plan replays natively
        if c.op not in ("swiglu_fp8_group", "fp8_group_quantize", "swiglu", "rms_norm_fp8_group"):
            continue
        a = c.make_args(torch.device("cuda"), True)
        if _common.call(c.op, *a, "auto") is not None and native_replay.planned(c.op, (*a, "auto")):
            case, args = c, a
            break
    assert case is not None, f"no natively replayed case: {native_replay.REFUSALS}"
    static = _perturbed(args, 3)
    _common.call(case.op, *static, "auto")  # replayed natively once outside the capture
    check_graph_replay(case, args, static, "auto")


def check_graph_replay(case, args: tuple, static: tuple, backend: str) -> None:
    """Capture `_common.call(case.op, *static, backend)` in a CUDA graph, copy new values of `args` into `static`,
    replay the graph and compare its outputs against the reference on those values."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _common.call(case.op, *static, backend)
    new, ref_args = _perturbed(args, 4), _perturbed(args, 4)
    for dst, src in zip(static, new, strict=True):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    want = getattr(torch.ops.lowbit, case.op)(*ref_args, "torch")
    ok, msg = case.compare(_absent_as_empty(out, want), want)
    assert ok, f"{case.op} ({case.label}) replayed from a CUDA graph ({backend}): {msg}"


@pytest.mark.gpu
def test_native_block_allocation_and_driver_memsets():
    """A CUDA plan's small allocations share one block; the zero-filled ones (in the block, and one allocated alone)
    are zeroed by driver memsets on the current stream, also when the call is captured in a CUDA graph; a copy
    of an input view is a driver memcpy."""
    mod = native_replay.module()
    assert mod is not None, "the native replay extension did not build"
    big = native_replay.BLOCK_MEMBER_MAX + 6  # alone, and a byte count that takes the 8-bit memset
    allocs = [launch_plan._Alloc((3, 5), (5, 1), torch.float32, zero=True), launch_plan._Alloc((7,), (1,), torch.uint8),
              launch_plan._Alloc((big,), (1,), torch.int8, zero=True), launch_plan._Alloc((4,), (1,), torch.int32),
              launch_plan._Alloc((3,), (1,), torch.float32, copy_from=(0, ((3,), (1,), 1, torch.float32)))]
    plan = launch_plan.LaunchPlan(torch.device("cuda"), allocs, [], ("tuple", [("alloc", j, None) for j in range(5)]),
                                  [])
    x = torch.arange(4, device="cuda", dtype=torch.float32)
    assert mod.register("toy_block_cuda", (x, "auto"), native_replay.describe(plan))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # fresh memory each call, zeroed again on this stream
            out = mod.call("toy_block_cuda", (x, "auto"))
            for t in out:
                assert t.device.type == "cuda"
            assert out[0].untyped_storage().data_ptr() == out[1].untyped_storage().data_ptr() \
                == out[3].untyped_storage().data_ptr() != out[2].untyped_storage().data_ptr()
            assert int(out[0].ne(0).sum()) == 0 and int(out[2].ne(0).sum()) == 0
            assert out[4].tolist() == [1.0, 2.0, 3.0]  # the copy of x[1:] (a driver memcpy)
            for t in out:
                t.fill_(1)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = mod.call("toy_block_cuda", (x, "auto"))
        for t in captured:
            t.fill_(1)
        graph.replay()
    torch.cuda.synchronize()
    assert int(captured[0].ne(0).sum()) == 0 and int(captured[2].ne(0).sum()) == 0
    native_replay.clear()


def _absent_as_empty(out, want):
    """The eager fast path returns a backend's None for an absent optional output where the torch op returns an
    empty tensor (the public wrappers accept both)."""
    if isinstance(out, tuple):
        return tuple(_absent_as_empty(o, w) for o, w in zip(out, want, strict=True))
    return want if out is None and isinstance(want, torch.Tensor) and want.numel() == 0 else out
