"""CuTe calls in launch plans and their native replay (dispatch/launch_plan.py, dispatch/native_replay.py,
dispatch/_replay_cute.h): a call of a compiled function through cute_ops._compile.launch is recorded in order with
the call's Triton launches; the C++ replay calls the TVM-FFI function through the C ABI with DLTensors of the
replay's inputs and allocations and the recorded scalars. On the CPU the compiled function is a stand-in
tvm_ffi.Function (a Python function registered through TVM-FFI) that records what it receives, called both ways:
by TVM-FFI's Python binding with torch tensors (the recorded call) and by the extension (the replay). The GPU tests
run each CuTe op natively against its prepared launcher and the reference, and under CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from dispatch import launch_plan, native_replay
from dispatch.ops import _common
from tests.test_launch_plan_derive import KERNEL, NO_HOOKS, _FakeCompiled
from tests.test_native_replay import _compiled

tvm_ffi = pytest.importorskip("tvm_ffi")
_compile = pytest.importorskip("cute_ops._compile")


@pytest.fixture(scope="module")
def native():
    mod = native_replay.module()
    if mod is None:
        pytest.skip("the native replay extension cannot be built here (no C++ compiler or ninja)")
    if not native_replay._tvm_ffi_loaded():
        pytest.skip(f"libtvm_ffi did not load: {native_replay._state.get('tvm_ffi_why')}")
    return mod


@pytest.fixture(autouse=True)
def _no_plans_left():
    yield
    native_replay.clear()


class StandIn:
    """A TVM-FFI function that records, per call, each argument as (kind, shape, strides, dtype, data pointer) for
    tensors and the value otherwise."""

    def __init__(self, fail: str | None = None):
        self.calls: list[list] = []
        self.fail = fail
        self.fn = tvm_ffi.convert(self._receive)

    def _receive(self, *args):
        self.calls.append([("tensor", tuple(a.shape), tuple(a.strides), str(a.dtype), a.data_ptr())
                           if isinstance(a, tvm_ffi.Tensor) else a for a in args])
        if self.fail:
            raise ValueError(self.fail)


def _seen(t: torch.Tensor, dtype_name: str) -> tuple:
    return ("tensor", tuple(t.shape), tuple(t.stride()), dtype_name, t.data_ptr())


def _recorded(backend, args: tuple):
    """(outputs, plan) of backend(*args) recorded as launch_plan.record does, on the CPU."""
    from triton_ops.contract.recording import recording_launches

    with recording_launches() as launches, launch_plan._OpLog(launches) as log:
        out = backend(*args)
    return out, launch_plan._derive(out, args, launches, log.ops, NO_HOOKS, device_type="cpu")


def _toy_backend(stand_in, big_int=3):
    def backend(x, w):
        out = torch.empty(x.shape[0] - 1, x.shape[1], dtype=torch.float8_e4m3fn)
        lse = torch.empty(x.shape[0] - 1, dtype=torch.float32)
        _compile.launch(stand_in.fn, x[1:], w, out.view(torch.uint8), None, lse, 1.5, big_int, True)
        return out, lse, None
    return backend


# ----------------------------------------------------------------------------------------------- recording
def test_cute_calls_are_recorded_in_order_with_triton_launches():
    from triton_ops.contract.recording import LaunchRecord, recording_launches

    stand_in, compiled = StandIn(), _FakeCompiled()
    x = torch.randn(5, 8)

    def backend(x):
        out = torch.empty(4, 8)
        flags = torch.empty(4, dtype=torch.int32)
        # what triton_ops._launch.launch appends, around a CuTe call (no real kernel on the CPU)
        records.append(LaunchRecord(KERNEL, (2,), (x, out, flags, 4), {"BLOCK": 8}, compiled))
        _compile.launch(stand_in.fn, x[1:], out, 2.0)
        records.append(LaunchRecord(KERNEL, (1,), (out, out, flags, 4), {"BLOCK": 8}, compiled))
        return out

    with recording_launches() as records, launch_plan._OpLog(records) as log:
        out = backend(x)
    plan = launch_plan._derive(out, (x,), records, log.ops, NO_HOOKS, device_type="cpu")
    assert [launch[0] == launch_plan.CUTE for launch in plan.launches] == [False, True, False]
    _, fn, _, _, specs = plan.launches[1]
    assert fn is stand_in.fn and plan.kernels[1] is None
    assert specs == [("input", 0, 32, ((4, 8), (8, 1), torch.float32)), ("alloc", 0, 0, ((4, 8), (8, 1),
                                                                                           torch.float32)),
                     ("const", 2.0)]
    assert plan.native_only and plan.census()["launches"] == 3
    with pytest.raises(RuntimeError, match="natively only"):
        plan(x)


def test_a_cute_call_on_a_tensor_from_elsewhere_gives_no_plan():
    stand_in, kept = StandIn(), torch.randn(4)

    def backend(x):
        out = torch.empty(4)
        _compile.launch(stand_in.fn, x, out, kept)
        return out

    with pytest.raises(launch_plan.NoPlan, match="neither an input nor an allocation"):
        _recorded(backend, (torch.randn(4),))


def test_a_cute_call_argument_of_another_kind_gives_no_plan():
    stand_in = StandIn()

    def backend(x):
        out = torch.empty(4)
        _compile.launch(stand_in.fn, x, out, "a string")
        return out

    with pytest.raises(launch_plan.NoPlan, match="argument of type str"):
        _recorded(backend, (torch.randn(4),))


def test_launch_outside_a_recording_only_calls():
    stand_in = StandIn()
    _compile.launch(stand_in.fn, 1, 2.5)
    assert stand_in.calls == [[1, 2.5]]


# ------------------------------------------------------------------------------------------ native replay
@pytest.mark.parametrize("big_int", [3, -(1 << 40)])
def test_what_the_cute_function_receives(native, big_int):
    """The replay passes the views of its own allocations and of the new inputs (shape, strides, dtype as recorded,
    data pointer with the byte offset), None, float, int and bool exactly as the recorded call passed them."""
    stand_in = StandIn()
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(8)
    out, plan = _recorded(_toy_backend(stand_in, big_int), (x, w))
    recorded = stand_in.calls[-1]
    assert recorded == [_seen(x[1:], "bfloat16"), _seen(w, "float32"), _seen(out[0].view(torch.uint8), "uint8"),
                        None, _seen(out[1], "float32"), 1.5, big_int, True]
    assert native.register("toy_cute", (x, w, "auto"), native_replay.describe(plan))
    y, v = torch.randn(9, 8, dtype=torch.bfloat16)[4:], torch.randn(8)  # same metadata, other storage
    got = native.call("toy_cute", (y, v, "auto"))
    assert got[2] is None and got[0].dtype == torch.float8_e4m3fn and got[0].shape == (4, 8)
    replayed = stand_in.calls[-1]
    assert replayed == [_seen(y[1:], "bfloat16"), _seen(v, "float32"), _seen(got[0].view(torch.uint8), "uint8"),
                        None, _seen(got[1], "float32"), 1.5, big_int, True]
    assert isinstance(replayed[5], float) and isinstance(replayed[6], int) and replayed[7] is True
    assert native.call("toy_cute", (y.float(), v, "auto")) is native.MISS  # another signature


def test_dtypes_reach_the_function_as_tvm_ffi_converts_them(native):
    """Every dtype of native_replay.DL_DTYPES arrives as the dtype TVM-FFI's own conversion of the torch tensor
    gives."""
    stand_in = StandIn()
    dtypes = list(native_replay.DL_DTYPES)

    def backend(x):
        outs = [torch.empty(3, 2, dtype=d) for d in dtypes]
        _compile.launch(stand_in.fn, x, *outs)
        return tuple(outs)

    x = torch.randn(3, 2)
    _, plan = _recorded(backend, (x,))
    recorded = stand_in.calls[-1]
    assert native.register("toy_dtypes", (x, "auto"), native_replay.describe(plan))
    native.call("toy_dtypes", (torch.randn(3, 2), "auto"))
    assert [a[3] for a in stand_in.calls[-1]] == [a[3] for a in recorded]
    assert [a[3] for a in recorded[1:]] == [str(tvm_ffi.from_dlpack(torch.empty(1, dtype=d)).dtype) for d in dtypes]


def test_the_functions_error_is_raised(native):
    stand_in = StandIn()
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(8)
    _, plan = _recorded(_toy_backend(stand_in), (x, w))
    assert native.register("toy_cute_error", (x, w, "auto"), native_replay.describe(plan))
    stand_in.fail = "the stand-in refuses"
    with pytest.raises(RuntimeError, match="the stand-in refuses"):
        native.call("toy_cute_error", (x, w, "auto"))
    stand_in.fail = None
    assert native.call("toy_cute_error", (x, w, "auto"))[0].shape == (4, 8)  # the error state was cleared


def test_a_cpu_plan_mixing_cute_and_triton_launches_is_refused(native):
    plan = launch_plan.LaunchPlan(torch.device("cpu"), [], [
        (None, 1, (4, 1, 0), (1, 1, 1), [("const", 0)]),
        (launch_plan.CUTE, StandIn().fn, None, None, [("const", 1)])], ("const", None), [],
        [_compiled({"p": "i32"}), None])
    with pytest.raises(RuntimeError, match="CUDA"):
        native.register("toy_mixed", (torch.randn(2), "auto"), native_replay.describe(plan))


# --------------------------------------------------------------------------------------- fallbacks, choices
def _cute_plan(fn) -> launch_plan.LaunchPlan:
    return launch_plan.LaunchPlan(torch.device("cpu"), [], [(launch_plan.CUTE, fn, None, None, [("const", 1)])],
                                  ("const", None), [], [None])


def test_a_function_that_is_not_a_tvm_ffi_function_is_refused(native):
    assert not native_replay.adopt("toy_wrapped", (torch.randn(2), "auto"), _cute_plan(lambda *a: None))
    assert "not a tvm_ffi.Function" in native_replay.REFUSALS["toy_wrapped"]
    assert not native_replay.planned("toy_wrapped", (torch.randn(2), "auto"))


def test_without_libtvm_ffi_the_plan_is_refused(native, monkeypatch):
    monkeypatch.setitem(native_replay._state, "tvm_ffi", False)
    monkeypatch.setitem(native_replay._state, "tvm_ffi_why", "no library here")
    assert not native_replay.adopt("toy_no_ffi", (torch.randn(2), "auto"), _cute_plan(StandIn().fn))
    assert "no library here" in native_replay.REFUSALS["toy_no_ffi"]


def test_libtvm_ffi_that_does_not_load_is_reported(native, monkeypatch):
    monkeypatch.setitem(native_replay._state, "tvm_ffi", None)
    monkeypatch.setattr(native_replay, "_libtvm_ffi_path", lambda: "/nonexistent/libtvm_ffi.so")
    assert not native_replay._tvm_ffi_loaded()
    assert "/nonexistent/libtvm_ffi.so" in native_replay._state["tvm_ffi_why"]
    monkeypatch.setitem(native_replay._state, "tvm_ffi", None)  # the real library loads again
    monkeypatch.undo()
    assert native_replay._tvm_ffi_loaded()


def test_the_loaded_libtvm_ffi_is_the_one_opened():
    import os

    from tvm_ffi import libinfo

    path = native_replay._libtvm_ffi_path()
    assert os.path.basename(path) == "libtvm_ffi.so"
    assert os.path.samefile(path, libinfo.find_libtvm_ffi())  # here the package's own


def test_adopted_plan_is_kept_for_breakdowns(native):
    stand_in = StandIn()
    x, w = torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(8)
    _, plan = _recorded(_toy_backend(stand_in), (x, w))
    assert native_replay.adopt("toy_adopted", (x, w, "auto"), plan)
    assert native_replay.REFUSALS["toy_adopted"] is None and native_replay.ADOPTED["toy_adopted"] is plan
    assert native_replay.planned("toy_adopted", (x, w, "auto"))
    native_replay.clear()
    assert "toy_adopted" not in native_replay.ADOPTED


def _through_launch(x):
    """A backend entry that calls its compiled function through cute_ops._compile.launch."""
    out = torch.empty_like(x)
    _compile.launch(_ENTRY_STAND_IN.fn, x, out, 2.0)
    return out


def _bypassing_launch(x):
    """A backend entry that calls its compiled function directly: no launch is recorded."""
    out = torch.empty_like(x)
    _ENTRY_STAND_IN.fn(x, out, 2.0)
    return out


_ENTRY_STAND_IN = StandIn()


def _run_recorded(monkeypatch, backend: str, impl, op: str = "toy_unlisted_op"):
    """_common.run of a one-row op `op` (in no list anywhere) on `backend` while a plan is wanted, derived as on a
    GPU but from host tensors: (output, input, the plan run kept, the refusal run kept)."""
    import functools

    from dispatch.registry import Entry

    entry = Entry(op, backend, ("cpu",), "toy:entry", 1, "toy row")
    monkeypatch.setitem(_common.TABLE, op, [entry])
    monkeypatch.setattr(_common, "select", lambda entries, *a: entries[0])
    monkeypatch.setattr(Entry, "resolve_impl", lambda self: impl)
    monkeypatch.setattr(_common, "_on_cuda", lambda args: True)
    monkeypatch.setattr(launch_plan, "_derive", functools.partial(launch_plan._derive, device_type="cpu"))
    x = torch.randn(4, 8)
    _common._record.want_plan = True
    out = _common.run(op, backend, x)
    assert _common._record.want_plan is False
    _, _, _, _, plan = _common._record.chosen
    return out, x, plan, _common._PLAN_REFUSALS.pop(op)


@pytest.mark.parametrize("backend", ["cute", "triton", "another_backend"])
def test_every_non_reference_row_is_recorded_whatever_its_op_and_backend(backend, monkeypatch):
    """No list of ops or backends decides which calls get plans: any non-reference row's call is recorded, and its
    CuTe call becomes a (native only) launch of the plan."""
    out, x, plan, why = _run_recorded(monkeypatch, backend, _through_launch)
    assert why is None and isinstance(plan, launch_plan.LaunchPlan), why
    assert [launch[0] for launch in plan.launches] == [launch_plan.CUTE] and plan.native_only
    assert plan.launches[0][1] is _ENTRY_STAND_IN.fn and _ENTRY_STAND_IN.calls[-1][0] == _seen(x, "float32")
    assert out.shape == x.shape


@pytest.mark.parametrize("backend", ["cute", "another_backend"])
def test_a_compiled_call_outside_launch_gives_no_plan(backend, monkeypatch):
    """A backend entry whose compiled function runs outside cute_ops._compile.launch records no launch: plan building
    fails with the reason and the call's own result is returned (the entry runs as usual on later calls)."""
    before = len(_ENTRY_STAND_IN.calls)
    out, x, plan, why = _run_recorded(monkeypatch, backend, _bypassing_launch)
    assert plan is None and "made no launch" in why
    assert len(_ENTRY_STAND_IN.calls) == before + 1 and _ENTRY_STAND_IN.calls[-1][0] == _seen(x, "float32")
    assert out.shape == x.shape


def test_the_reference_row_is_never_recorded(monkeypatch):
    from dispatch.registry import REFERENCE_BACKEND
    from triton_ops.contract.recording import recording_launches

    def no_recording(*a):
        raise AssertionError("a reference row's call was recorded")

    monkeypatch.setattr(launch_plan, "record", no_recording)
    with recording_launches() as outer:  # the entry's launch lands in the caller's scope, not in a plan's
        _, _, plan, why = _run_recorded(monkeypatch, REFERENCE_BACKEND, _through_launch)
    assert plan is None and why is None and len(outer) == 1


def _grouped_sm90_call():
    from cute_ops.gemm import grouped_sm90

    e, n, k, rows = 2, 128, 64, 8
    a, w = torch.randn(rows, k, dtype=torch.bfloat16), torch.randn(e, n, k, dtype=torch.bfloat16)
    m_indices = torch.tensor([0, 0, 0, 1, 1, -1, 1, 1], dtype=torch.int32)
    return grouped_sm90, grouped_sm90.moe_gemm_bf16, (a, w, m_indices, None, None)


def _blockscaled_sm100_call():
    from cute_ops.gemm import blockscaled_sm100

    e, n, k, max_m = 2, 128, 64, 8
    a, w = torch.randn(e, max_m, k, dtype=torch.bfloat16), torch.randn(e, n, k, dtype=torch.bfloat16)
    masked_m = torch.tensor([3, 8], dtype=torch.int32)
    return blockscaled_sm100, blockscaled_sm100.moe_gemm_bf16, (a, w, None, masked_m, None)


@pytest.mark.parametrize("make", [_grouped_sm90_call, _blockscaled_sm100_call],
                         ids=["grouped_sm90", "blockscaled_sm100"])
def test_moe_gemm_entries_record_their_compiled_call(make, monkeypatch):
    """The MoE GEMM entries call their compiled functions through cute_ops._compile.launch (stand-ins here, on host
    tensors): the recording sees the group-bounds kernel, then the GEMM with the entry's output among its arguments.
    The sm_90 entry is allocations, views and the two calls: a plan (replayed natively only: CuTe calls); the sm_100
    entry still runs aten ops (its tile bounds, a zero fill of a non-output), so its plan is refused."""
    from cute_ops.gemm import group_bounds
    from triton_ops.contract.recording import CuteCall, recording_launches

    module, entry, args = make()
    stand_in, bounds = StandIn(), StandIn()
    monkeypatch.setattr(module, "compiled", lambda cfg: stand_in.fn)
    monkeypatch.setattr(group_bounds, "compiled", lambda cfg: bounds.fn)
    monkeypatch.setattr(group_bounds, "device_index", lambda device: 0)
    monkeypatch.setattr(module, "device_index", lambda device: 0)
    monkeypatch.setattr(module, "_sm_count" if hasattr(module, "_sm_count") else "sm_count", lambda index: 132)
    monkeypatch.setattr(_compile, "target_arch", lambda index=None: "sm_100a" if "sm100" in module.__name__
                        else "sm_90a")
    with recording_launches() as records, launch_plan._OpLog(records) as log:
        out = entry(*args)
    assert len(stand_in.calls) == len(bounds.calls) == 1 and [type(r) for r in records] == [CuteCall, CuteCall]
    assert records[0].fn is bounds.fn and records[1].fn is stand_in.fn
    assert any(isinstance(v, torch.Tensor) and v.data_ptr() == out.data_ptr() for v in records[1].args)
    if "sm100" in module.__name__:
        with pytest.raises(launch_plan.NoPlan, match="runs aten"):
            launch_plan._derive(out, args, records, log.ops, NO_HOOKS, device_type="cpu")
    else:
        plan = launch_plan._derive(out, args, records, log.ops, NO_HOOKS, device_type="cpu")
        assert plan.native_only and plan.census()["launches"] == 2


def test_grouped_sm90_entry_is_replayed_with_the_same_arguments(native, monkeypatch):
    """cute_ops.gemm.grouped_sm90's contiguous bf16 entry with stand-in compiled functions, replayed natively for new
    tensors of the same signature: the bounds kernel and the GEMM get what the entry itself passes (the new call's
    tensors, one fresh (2, E) bounds buffer whose two rows both calls share, the new output)."""
    from cute_ops.gemm import group_bounds

    module, entry, args = _grouped_sm90_call()
    stand_in, bounds = StandIn(), StandIn()
    monkeypatch.setattr(module, "compiled", lambda cfg: stand_in.fn)
    monkeypatch.setattr(group_bounds, "compiled", lambda cfg: bounds.fn)
    monkeypatch.setattr(_compile, "target_arch", lambda index=None: "sm_90a")
    monkeypatch.setattr(module, "_sm_count", lambda index: 132)
    for m in (module, group_bounds):
        monkeypatch.setattr(m, "device_index", lambda device: 0)
    _, plan = _recorded(entry, args)
    assert native.register("toy_grouped_sm90", (*args, "auto"), native_replay.describe(plan))
    a = torch.randn_like(args[0])
    m_indices = args[2].clone()
    got = native.call("toy_grouped_sm90", (a, args[1], m_indices, None, None, "auto"))
    replayed = bounds.calls[-1], stand_in.calls[-1]
    entry(a, args[1], m_indices, None, None)
    direct = bounds.calls[-1], stand_in.calls[-1]
    for rep, dir_ in zip(replayed, direct, strict=True):
        assert [type(x) for x in rep] == [type(x) for x in dir_]
        for x, y in zip(rep, dir_, strict=True):  # same metadata; the buffers' pointers are each call's own
            assert x[:4] == y[:4] if isinstance(x, tuple) else x == y
    (b_src, b_starts, b_counts, b_ws, _), g = replayed
    assert b_src[4] == m_indices.data_ptr() and g[0][4] == a.data_ptr() and g[2][4] == got.data_ptr()
    assert (g[3][4], g[4][4], g[7][4]) == (b_starts[4], b_counts[4], b_ws[4])  # the bounds kernel's outputs


def test_rmsnorm_general_entry_is_replayed_with_the_same_arguments(native, monkeypatch):
    """cute_ops.rmsnorm's general entry (FP8 groups, column-major scales: a strided view of one allocation) with a
    stand-in compiled function: the replay passes what the entry passes for the new call's tensors."""
    from cute_ops import rmsnorm

    stand_in = StandIn()
    monkeypatch.setattr(rmsnorm, "_compiled_for", lambda *a: stand_in.fn)
    x, w, r = torch.randn(6, 256, dtype=torch.bfloat16), torch.randn(256, dtype=torch.bfloat16), None
    args = (x, w, r, 1e-6, 0.0, 128, 1e-10, False, True)
    _, plan = _recorded(rmsnorm.rms_norm_fp8_group, args)
    assert native.register("toy_rmsnorm", (*args, "auto"), native_replay.describe(plan))
    y = torch.randn(6, 256, dtype=torch.bfloat16)
    got = native.call("toy_rmsnorm", (y, w, r, 1e-6, 0.0, 128, 1e-10, False, True, "auto"))
    replayed = stand_in.calls[-1]
    want = rmsnorm.rms_norm_fp8_group(y, w, r, 1e-6, 0.0, 128, 1e-10, False, True)  # the entry itself
    direct = stand_in.calls[-1]
    assert [type(a) for a in replayed] == [type(a) for a in direct]
    for a, b in zip(replayed, direct, strict=True):  # same metadata; the outputs' pointers are each call's own
        assert a[:4] == b[:4] if isinstance(a, tuple) else a == b
    assert replayed[0][4] == y.data_ptr() and replayed[5][4] == got[0].data_ptr()
    assert replayed[6][4] == got[1].data_ptr() and got[1].stride() == want[1].stride()


# ---------------------------------------------------------------------------------------------------- GPU
def _cute_cases() -> list:
    """The self-check cases of every op with a CuTe row."""
    from dispatch.selfcheck import all_cases
    from dispatch.table import TABLE

    return [c for c in all_cases() if any(e.backend == "cute" for e in TABLE[c.op])]


# What the GPU tests expect (dispatch keeps no such list: every CuTe call is recorded): the CuTe ops whose entries
# only allocate, view and launch, so their first call gives a plan. The others (the MoE GEMMs compute their group
# bounds with torch ops on every call) must say why they have none and run as usual.
PLANNED_CUTE_OPS = frozenset({"rms_norm", "rms_norm_fp8_group", "rms_norm_nvfp4", "attention_prefill",
                              "attention_prefill_paged"})


CUTE_CASES = _cute_cases()


def _rms_variants() -> list:
    """CuTe RMSNorm signatures beside the self-check's (decode shape, 16 x 7168 bf16): no residual, FP8 row-major
    scales with a residual, UE8M0 scales, NVFP4 with a given global scale (linear, swizzled with a residual)."""
    from dispatch.selfcheck import Case

    def make(*rest, residual=False, gs=False):
        def args(dev, _small):
            g = torch.Generator().manual_seed(5)
            x, w, r = (torch.randn(shape, generator=g).to(dev, torch.bfloat16) for shape in ((16, 7168), (7168,),
                                                                                            (16, 7168)))
            scale = (torch.tensor(0.02, device=dev),) if gs else ()
            return (x, w, r if residual else None, 1e-6, 0.0, *scale, *rest)
        return args

    return [Case("rms_norm", make(), label="no residual"),
            Case("rms_norm_fp8_group", make(128, 1e-10, False, False, residual=True),
                 label="g128 row-major, residual"),
            Case("rms_norm_fp8_group", make(64, 1e-10, True, False), label="g64 UE8M0"),
            Case("rms_norm_nvfp4", make(False, gs=True), label="given global scale, linear"),
            Case("rms_norm_nvfp4", make(True, residual=True, gs=True),
                 label="given global scale, swizzled, residual")]


def _cute_args(case):
    """(the case's arguments on the GPU, tests.test_launch_plan's `_perturbed`), or a skip where the CuTe row
    cannot take them."""
    import cute_ops
    from dispatch.ops._common import backend_for
    from tests.test_launch_plan import _perturbed

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if cute_ops.unavailable_reason() is not None:
        pytest.skip(cute_ops.unavailable_reason())
    args = case.make_args(torch.device("cuda"), True)
    try:
        backend_for(case.op, *args, backend="cute")
    except Exception as exc:  # the CuTe row does not take this case (arch, shape): nothing to replay
        pytest.skip(f"the cute row refuses {case.op} ({case.label}): {exc}")
    return args, _perturbed


def _same_bytes(got, want) -> None:
    from dispatch.selfcheck import byte_mismatches

    if isinstance(want, tuple):
        for g, w in zip(got, want, strict=True):
            _same_bytes(g, w)
    elif isinstance(want, torch.Tensor):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
        assert byte_mismatches(got, want) == 0
    else:
        assert got is want or got == want


@pytest.mark.gpu
@pytest.mark.parametrize("case", CUTE_CASES + _rms_variants(),
                         ids=[f"{c.op}-{c.label}" for c in CUTE_CASES + _rms_variants()])
def test_cute_op_replays_natively_as_its_prepared_launcher(case, monkeypatch):
    """The second call of a signature replays natively (the CuTe call through the C ABI; the paged op's Triton
    gather and fixup around it) for the PLANNED_CUTE_OPS, and any other CuTe op's call either does too or says why
    it has no plan; the outputs equal the Python path's (prepared launcher or entry) byte for byte and the
    reference's within the case's tolerance."""
    from tests.test_launch_plan import _absent_as_empty

    args, perturbed = _cute_args(case)
    monkeypatch.setenv(launch_plan.PLANS_ENV, "1")
    _common._FAST.clear()
    _common.call(case.op, *perturbed(args, 1), "cute")  # records
    second = perturbed(args, 2)
    planned = native_replay.planned(case.op, (*second, "cute"))
    why = f"{native_replay.REFUSALS.get(case.op)} / {_common._PLAN_REFUSALS.get(case.op)}"
    print(f"\n{case.op} ({case.label}): {'native replay' if planned else 'no native replay: ' + why}")
    assert planned or (case.op not in PLANNED_CUTE_OPS and _common._PLAN_REFUSALS.get(case.op)), \
        f"{case.op} ({case.label}): no native replay: {why}"
    out = _common.call(case.op, *second, "cute")
    torch.cuda.synchronize()
    monkeypatch.setenv(native_replay.NATIVE_ENV, "0")  # the Python path: the prepared launcher
    _common._FAST.clear()
    _common.call(case.op, *perturbed(args, 1), "cute")
    prepared_args = perturbed(args, 2)
    assert not native_replay.planned(case.op, (*prepared_args, "cute"))
    prepared = _common.call(case.op, *prepared_args, "cute")
    _same_bytes(out, prepared)
    want = getattr(torch.ops.lowbit, case.op)(*perturbed(args, 2), "torch")
    ok, msg = case.compare(_absent_as_empty(out, want), want)
    assert ok, f"{case.op} ({case.label}) replayed natively: {msg}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm_fp8_group", "attention_prefill", "attention_prefill_paged"])
def test_cute_native_replay_is_captured_by_a_cuda_graph(op, monkeypatch):
    """Captured on the capture stream (TVM-FFI's env stream is set to it for the call): replaying the graph on new
    input values gives the reference's result."""
    from tests.test_launch_plan import check_graph_replay

    case = next(c for c in CUTE_CASES if c.op == op)
    args, perturbed = _cute_args(case)
    monkeypatch.setenv(launch_plan.PLANS_ENV, "1")
    _common._FAST.clear()
    static = perturbed(args, 3)
    _common.call(op, *static, "cute")  # records
    assert native_replay.planned(op, (*static, "cute")), native_replay.REFUSALS.get(op)
    _common.call(op, *static, "cute")  # replayed natively once outside the capture
    check_graph_replay(case, args, static, "cute")


@pytest.mark.gpu
def test_cute_native_replay_runs_on_the_current_stream(monkeypatch):
    """On a side stream the CuTe call is ordered after that stream's earlier work (its env stream is the current
    one), and TVM-FFI's env stream is restored after the call."""
    from tests.test_launch_plan import _absent_as_empty

    case = next(c for c in CUTE_CASES if c.op == "rms_norm_fp8_group")
    args, perturbed = _cute_args(case)
    monkeypatch.setenv(launch_plan.PLANS_ENV, "1")
    _common._FAST.clear()
    _common.call(case.op, *perturbed(args, 1), "cute")
    side = torch.cuda.Stream()
    before = tvm_ffi.core._env_get_current_stream(2, torch.cuda.current_device())
    with torch.cuda.stream(side):
        x = perturbed(args, 5)
        torch.cuda._sleep(10_000_000)  # the side stream is busy: a call on another stream would read x early
        x[0].mul_(-1.0)
        assert native_replay.planned(case.op, (*x, "cute"))
        out = _common.call(case.op, *x, "cute")
    side.synchronize()
    assert tvm_ffi.core._env_get_current_stream(2, torch.cuda.current_device()) == before
    want = getattr(torch.ops.lowbit, case.op)(*x, "torch")
    ok, msg = case.compare(_absent_as_empty(out, want), want)
    assert ok, msg


@pytest.mark.gpu
def test_eager_records_the_native_replay_of_cute_rows(monkeypatch):
    """perf.eager with the CuTe rows forced: each record says the op replays natively, and its breakdown splits the
    host time as for a Triton plan."""
    import cute_ops
    from perf import eager

    if cute_ops.unavailable_reason() is not None:
        pytest.skip(cute_ops.unavailable_reason())
    monkeypatch.setenv("LOWBIT_BACKEND", "cute")
    result = eager.run(["rms_norm", "rms_norm_fp8_group", "attention_prefill"], ["all"])
    records = [r for r in result["records"] if r.get("provider") == "lowbit"]
    assert records, result["records"]
    for r in records:
        assert r.get("native_replay") and r.get("launch_plan"), r
        parts = result["breakdowns"][f"{r['op']} ({r['label']})"]
        assert set(parts.get("us_split", ())) == {"python_wrapper", "key_lookup", "allocs_outputs", "launches"}, parts
        print(f"\n{r['op']} ({r['label']}): {r['host_us']} us = {r['host_ratio']} x F.rms_norm")
