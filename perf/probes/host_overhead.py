"""Where the host time of one eager lowbit call goes (GPU probe, ~15 s).

Eager calls at decode size are host-bound: the GPU finishes each kernel in a few microseconds while Python
prepares the next. This probe times, per call and on the CPU clock (GPU work is tiny, so wall time per call is
host time), the layers one at a time for a few ops:

  torch.empty            the allocations an op needs
  triton launch          `kernel[grid](...)` of a kernel shaped like the quantize kernels, prepared arguments
  launcher               triton_ops.<family>.<op>(...) (allocation + tile choice + launch)
  public op              dispatch.ops.<op>(...) (checks + table choice + launcher)

Run on the GPU from the repo root:  PYTHONPATH=$PWD python perf/probes/host_overhead.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from perf.runner import host_us_per_call


def per_call_us(fn) -> float:
    return host_us_per_call(fn, n=3000, warmup=100)


def host_only_us(fn, n: int = 300, reps: int = 7) -> float:
    """Median over reps of the host time per call while the GPU is held busy by a sleep kernel queued first: the
    calls only enqueue, so the GPU's own time per kernel (launch gaps included) cannot leak into the number, as it
    can in per_call_us when a tiny kernel takes about as long on the GPU as its launch on the host."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda._sleep(40_000_000)  # ~20 ms of GPU clock: longer than n host calls
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def _probe_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(a, b, c, d, e, M, K, stride, n4, n5, n6, n7, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr,
               C4: tl.constexpr, C5: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, C8: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rows < M)[:, None] & (cols < K)[None, :]
        offs = rows[:, None] * stride + cols[None, :]
        tl.store(b + offs, tl.load(a + offs, mask=mask) * 2.0, mask=mask)

    return kernel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", "--out", dest="json", default=None)
    args = parser.parse_args()

    import triton

    import triton_ops.quant_fp4 as fp4
    import triton_ops.quant_fp8 as fp8
    import triton_ops.rmsnorm as rms
    from dispatch import ops

    dev = torch.device("cuda")
    x = torch.randn(16, 7168, dtype=torch.bfloat16, device=dev)
    gs = torch.tensor(0.01, device=dev)
    w = torch.randn(7168, dtype=torch.bfloat16, device=dev)
    rows = {}
    timed = {}

    def measure(name, fn):
        timed[name] = fn
        rows[name] = per_call_us(fn)

    measure("torch.empty x3", lambda: (torch.empty(16, 3584, dtype=torch.uint8, device=dev),
                                       torch.empty(128, 448, dtype=torch.uint8, device=dev),
                                       torch.empty((), dtype=torch.float32, device=dev)))

    # A kernel shaped like the quantize kernels (5 pointers, 7 ints, 8 constexprs): plain vs cached launch.
    src = torch.randn(16, 7168, device=dev)
    dst = torch.empty_like(src)
    kargs = (src, dst, src, dst, src, 16, 7168, 7168, 128, 448, 448, 1)
    consts = dict(C1=False, C2=False, C3=1, C4=True, C5=0, BLOCK_M=8, BLOCK_K=512, C8=1, num_warps=4)
    grid = (2, 14)
    jit_fn = _probe_kernel()
    measure("triton launch kernel[grid]", lambda: jit_fn[grid](*kargs, **consts))

    measure("launcher nvfp4_quantize", lambda: fp4.nvfp4_quantize(x, gs, True))
    measure("public nvfp4_quantize", lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled"))
    measure("public nvfp4_quantize backend=triton",
            lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled", backend="triton"))
    measure("launcher fp8_group_quantize", lambda: fp8.fp8_group_quantize(x, 128, 1e-10, False, False))
    measure("public fp8_group_quantize", lambda: ops.fp8_group_quantize(x))
    measure("public rms_norm", lambda: ops.rms_norm(x, w, 1e-6))
    measure("launcher rms_norm triton", lambda: rms.rms_norm(x, w, None, 1e-6, 0.0))
    measure("public rms_norm backend=triton", lambda: ops.rms_norm(x, w, 1e-6, backend="triton"))
    try:  # CuTe: the raw TVM-FFI callable, the backend entry, the public op
        from cute_ops import _compile, unavailable_reason
        from cute_ops import rmsnorm as cute_rms

        if unavailable_reason() is None:
            cfg = cute_rms.pick_config(x.dtype, w.dtype, 7168, "none", False, 0.0, 16, False, False,
                                       _compile.target_arch())
            fn, y = cute_rms.compiled(cfg), torch.empty_like(x)
            measure("cute raw TVM-FFI call",
            lambda: fn(x, w, None, None, y, None, None, None, None, 1e-6, 1e-10))
            measure("launcher rms_norm cute", lambda: cute_rms.rms_norm(x, w, None, 1e-6, 0.0))
            measure("public rms_norm backend=cute", lambda: ops.rms_norm(x, w, 1e-6, backend="cute"))
            r = torch.randn_like(x)
            measure("public rms_norm +residual cute",
            lambda: ops.rms_norm(x, w, 1e-6, residual=r, backend="cute"))
            measure("public rms_norm_fp8_group cute",
            lambda: ops.rms_norm_fp8_group(x, w, 1e-6, backend="cute"))
            measure("torch.empty_like x1", lambda: torch.empty_like(x))
        else:
            rows["cute"] = f"unavailable: {unavailable_reason()}"[:120]
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        rows["cute"] = f"failed: {exc}"[:160]
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        measure("liger rms_norm", lambda: LigerRMSNormFunction.apply(x, w, 1e-6))
    except Exception as exc:
        rows["liger rms_norm"] = f"unavailable: {exc}"[:120]
    # the same calls timed host-only (GPU held busy): what eager mode costs the host per call
    host_only = {name: host_only_us(fn) for name, fn in timed.items()}
    for name, value in rows.items():
        print(f"{name:40} {value if isinstance(value, str) else f'{value:8.2f} us'}"
              + (f"   host-only {host_only[name]:8.2f} us" if name in host_only else ""))
    dlpack_api = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    print(f"torch.Tensor.__dlpack_c_exchange_api__ (TVM-FFI's fast tensor path): {dlpack_api}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           per_call_us=rows, host_only_us=host_only, dlpack_c_exchange_api=dlpack_api), f, indent=1)


if __name__ == "__main__":
    main()
