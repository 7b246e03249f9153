"""An empty CuTeDSL kernel behind the same TVM-FFI launcher as every cute op: the host floor of one CuTe call.

perf/eager.py times it beside the ops (peer lines `cute no-op, ...`): a call of the compiled function with five
optional tensor parameters, N of them bf16 [rows, K] tensors (symbolic sizes, 16-byte aligned rows with a unit
last stride: what TVM-FFI checks per tensor for the real kernels) and the rest None, and two fp32 scalars
(rms_norm's argument list has the same shape: tensors, Nones, eps and quant_eps), launching one CTA of 32 threads
that does nothing. What a cute op's prepared launcher costs above it is its allocations and its own Python.
"""

import functools  # no `from __future__ import annotations`: CuTeDSL reads the kernel's annotations


@functools.cache
def _kernel_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    class NoOp:
        @cute.jit
        def __call__(self, t0: cute.Tensor, t1, t2, t3, t4, a: cutlass.Float32, b: cutlass.Float32,
                     stream: cuda.CUstream):
            self.kernel(t0).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, t: cute.Tensor):
            pass

    return NoOp


def build(n_tensors: int, arch: str):
    """cute.compile the no-op for `n_tensors` (1..5) tensor arguments and `arch` (uncached)."""
    import cutlass
    import cutlass.cute as cute

    tensors = [cute.runtime.make_fake_tensor(cutlass.BFloat16, (cute.sym_int(), cute.sym_int()),
                                             stride=(cute.sym_int64(divisibility=8), 1), assumed_align=16)
               if i < n_tensors else None for i in range(5)]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_kernel_class()(), *tensors, cutlass.Float32(0.0), cutlass.Float32(0.0), stream,
                        options=f"--enable-tvm-ffi --gpu-arch {arch}")


def compiled(n_tensors: int, arch: str):
    """The TVM-FFI callable: fn(t0, t1, t2, t3, t4, float, float), the first n_tensors tensors, the rest None."""
    from . import _compile

    return _compile.get_or_compile(("noop", n_tensors, arch), lambda: build(n_tensors, arch))
