"""Quant ops as torch ops: opcheck, torch.compile, CUDA graphs, large shapes (64-bit indexing)."""

from __future__ import annotations

import pytest
import torch

from dispatch import ops
from tests.helpers import assert_same_bytes, make_values

BACKENDS = ["torch", "triton"]


def _x(rows=6, k=256, dtype=torch.bfloat16, device="cpu"):
    return make_values(rows, k, "mixed_scale", 7).to(device=device, dtype=dtype)


def _opcheck_cases(backend):
    x = _x()
    nv = ops.nvfp4_quantize(x, backend="torch", scale_layout="swizzled")
    mx = ops.mxfp4_quantize(x, backend="torch")
    f8 = ops.fp8_group_quantize(x, 64, backend="torch", column_major_scales=True)
    gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
    lowbit = torch.ops.lowbit
    return [
        (lowbit.nvfp4_quantize, (x, None, True, backend)),
        (lowbit.nvfp4_quantize, (x, gs, False, backend)),
        (lowbit.nvfp4_dequantize, (nv.codes, nv.scales, nv.global_scale, True, torch.float16, backend)),
        (lowbit.mxfp4_quantize, (x, "rceil", True, backend)),
        (lowbit.mxfp4_dequantize, (mx.codes, mx.scales, False, torch.bfloat16, backend)),
        (lowbit.fp8_group_quantize, (x, 64, 1e-10, True, True, backend)),
        (lowbit.fp8_group_dequantize, (f8.codes, f8.scales, 64, torch.float32, backend)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    for op, args in _opcheck_cases(backend):
        fp8_input = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
        if not fp8_input:
            torch.library.opcheck(op, args)
            continue
        # SchemaCheckMode cannot compare fp8 inputs on CPU (torch has no fp8 mul there): run the other
        # checks, and check the no-mutation part of the schema by hand.
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))
        op(*args)
        for a, b in zip(args, before, strict=True):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                   b.view(torch.uint8) if b.element_size() == 1 else b)
    s = torch.randint(0, 255, (130, 5), dtype=torch.uint8)
    torch.library.opcheck(torch.ops.lowbit.swizzle_scales_128x4, (s, "auto"))
    torch.library.opcheck(torch.ops.lowbit.unswizzle_scales_128x4, (ops.swizzle_scales_128x4(s), 130, 5, "auto"))


def _assert_pipelines_equal(got, want, what):
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert_same_bytes(g, w, what)


def _pipeline(x, gs):
    nv = ops.nvfp4_quantize(x, gs, scale_layout="swizzled")
    mx = ops.mxfp4_quantize(x * 2, rounding="rceil")
    f8 = ops.fp8_group_quantize(x, 128, column_major_scales=True)
    deq = ops.nvfp4_dequantize(*nv, scale_layout="swizzled", out_dtype=torch.float32)
    return nv, mx, f8, deq


def test_torch_compile_fullgraph_cpu():
    x = _x(rows=5, k=256)
    gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
    compiled = torch.compile(_pipeline, fullgraph=True, backend="aot_eager", dynamic=True)
    _assert_pipelines_equal(compiled(x, gs), _pipeline(x, gs), "compiled vs eager")
    compiled(_x(rows=9, k=256), gs)  # a new batch size under dynamic=True: no error, no graph break


# ---------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_triton_is_auto_on_gpu():
    x = _x(device="cuda")
    assert ops.backend_for("nvfp4_quantize", x, None, False) == "triton"
    assert ops.backend_for("fp8_group_quantize", x, 128, 1e-10, False, False) == "triton"


@pytest.mark.gpu
def test_torch_compile_inductor_gpu():
    x = _x(rows=300, k=2048, device="cuda")
    gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
    compiled = torch.compile(_pipeline, fullgraph=True)
    _assert_pipelines_equal(compiled(x, gs), _pipeline(x, gs), "inductor vs eager")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_cuda_graph_capture_and_replay(rows):
    x = _x(rows=rows, k=7168, device="cuda")
    gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
    static_x = x.clone()
    _pipeline(static_x, gs)  # warm up (compiles kernels) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _pipeline(static_x, gs)
    new_x = _x(rows=rows, k=7168, device="cuda") * 3 + 1
    static_x.copy_(new_x)
    graph.replay()
    torch.cuda.synchronize()
    _assert_pipelines_equal(outs, _pipeline(new_x, gs), "graph replay vs eager")


def _kernels_launched(fn) -> list[str]:
    """Names of the CUDA kernels one call of fn launches (after the GPU is idle)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
def test_decode_shapes_are_one_launch():
    """Decode (M <= 16) with a given global scale: exactly one kernel per quantize call."""
    torch.utils.deterministic.fill_uninitialized_memory = False  # the poison fills are kernels too
    x = _x(rows=16, k=7168, device="cuda")
    gs = ops.nvfp4_global_scale_from_amax(x.float().abs().amax())
    calls = {
        "nvfp4": lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled"),
        "mxfp4": lambda: ops.mxfp4_quantize(x),
        "fp8": lambda: ops.fp8_group_quantize(x, column_major_scales=True),
    }
    for name, fn in calls.items():
        fn()
        kernels = _kernels_launched(fn)
        assert len(kernels) == 1, f"{name}: {kernels}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_fused_decode_calls_are_one_launch(backend):
    """Decode (M = 16) RMSNorm / SwiGLU with every output format and a given global scale: one kernel per call
    (the returned copy of a given global scale is written by that kernel, not by a second copy launch)."""
    from cute_ops import unavailable_reason

    if backend == "cute" and unavailable_reason() is not None:
        pytest.skip(f"cute backend unavailable: {unavailable_reason()}")
    torch.utils.deterministic.fill_uninitialized_memory = False  # the poison fills are kernels too
    x = _x(rows=16, k=7168, device="cuda")
    w = torch.ones(7168, device="cuda", dtype=torch.bfloat16)
    gs = torch.tensor(0.01, device="cuda")
    calls = {
        "rms_norm": lambda: ops.rms_norm(x, w, backend=backend),
        "rms_norm +residual": lambda: ops.rms_norm(x, w, residual=x, backend=backend),
        "rms_norm_fp8_group": lambda: ops.rms_norm_fp8_group(x, w, backend=backend),
        "rms_norm_nvfp4 swizzled": lambda: ops.rms_norm_nvfp4(x, w, global_scale=gs, scale_layout="swizzled",
                                                              backend=backend),
    }
    if backend == "triton":
        calls.update({
            "rms_norm_mxfp4": lambda: ops.rms_norm_mxfp4(x, w, scale_layout="swizzled", backend=backend),
            "swiglu_nvfp4": lambda: ops.swiglu_nvfp4(x, global_scale=gs, backend=backend),
            "swiglu_mxfp4": lambda: ops.swiglu_mxfp4(x, backend=backend),
            "swiglu_fp8_group": lambda: ops.swiglu_fp8_group(x, backend=backend),
        })
    for name, fn in calls.items():
        fn()
        fn()  # the second call takes the eager fast path (and the CuTe prepared launcher): count that one
        kernels = _kernels_launched(fn)
        assert len(kernels) == 1, f"{name} ({backend}): {kernels}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_reference_equals_cpu_reference(dtype):
    """The torch backend on CUDA (the eager peer in benchmarks) is the same function as on the CPU."""
    x = _x(rows=256, k=1024, dtype=dtype)
    for fn in (lambda t: ops.nvfp4_quantize(t, backend="torch"), lambda t: ops.mxfp4_quantize(t, backend="torch"),
               lambda t: ops.fp8_group_quantize(t, backend="torch")):
        for g, w in zip(fn(x.cuda()), fn(x), strict=True):
            assert_same_bytes(g, w, "cuda reference vs cpu reference")


@pytest.mark.gpu
def test_large_shapes_64bit_indexing():
    """x with more than 2^31 elements: the last rows must still be right (offsets are 64-bit)."""
    rows, k = 2**17 + 3, 16384  # 2.15e9 elements, 4.3 GB bf16
    try:
        x = torch.empty(rows, k, device="cuda", dtype=torch.bfloat16).normal_()
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element tensor")
    tail = slice(rows - 5, rows)
    f8 = ops.fp8_group_quantize(x)
    want = ops.fp8_group_quantize(x[tail], backend="torch")
    assert_same_bytes(f8.codes[tail], want.codes, "fp8 codes tail")
    del f8
    gs = torch.tensor(0.01, device="cuda")
    nv = ops.nvfp4_quantize(x, gs)
    want = ops.nvfp4_quantize(x[tail], gs, backend="torch")
    assert_same_bytes(nv.codes[tail], want.codes, "nvfp4 codes tail")
    assert_same_bytes(nv.scales[tail], want.scales, "nvfp4 scales tail")
