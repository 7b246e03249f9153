"""The empty CuTe kernel (cute_ops/noop.py, perf.eager's host floor of a CuTe call) and `_compile.direct`: a fresh
compile is cached as the plain TVM-FFI function (what a disk-cache load gives), with the wrapper's arity; objects
without a TVM-FFI function underneath are kept as they are. Compiles for sm_90a on the CPU; the GPU calls are
perf.eager's."""

from __future__ import annotations

import textwrap

import pytest

from cute_ops import unavailable_reason
from tests.helpers import run_compile_script

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"cute backend: {unavailable_reason()}")


_SCRIPT = textwrap.dedent("""
    import os
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"  # before cutlass loads: the JIT engine is made for this arch
    os.environ["LOWBIT_CUTE_DISK_CACHE"] = "0"
    import torch, tvm_ffi
    from cute_ops import _compile, noop
    wrapped = noop.build(1, "sm_90a")
    fn = _compile.direct(wrapped)
    print(isinstance(wrapped, tvm_ffi.Function), isinstance(fn, tvm_ffi.Function),
          isinstance(noop.compiled(1, "sm_90a"), tvm_ffi.Function))
    try:  # the wrapper's positional list (no stream): 7 parameters
        fn(torch.empty(16, 64, dtype=torch.bfloat16), None, None, None, None, 1.0)
    except TypeError as exc:
        print("Expects 7 parameters" in str(exc))
""")


def test_fresh_compile_is_cached_as_the_plain_function():
    out = run_compile_script(_SCRIPT, 300).split()
    assert out == ["False", "True", "True", "True"], out


def test_direct_keeps_other_callables():
    from cute_ops import _compile

    def plain(*a):
        return a

    assert _compile.direct(plain) is plain

    class PointerArgs:  # a wrapper that converts pointer arguments: kept
        execution_args = type("A", (), {"has_pointer_address_arg_specs": True})()

        def __tvm_ffi_object__(self):
            raise AssertionError("not unwrapped")

    w = PointerArgs()
    assert _compile.direct(w) is w
