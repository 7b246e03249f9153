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

import torch

from perf.runner import host_us_per_call


def per_call_us(fn) -> float:
    return host_us_per_call(fn, n=3000, warmup=100)


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

    rows["torch.empty x3"] = per_call_us(lambda: (torch.empty(16, 3584, dtype=torch.uint8, device=dev),
                                                  torch.empty(128, 448, dtype=torch.uint8, device=dev),
                                                  torch.empty((), dtype=torch.float32, device=dev)))

    # A kernel shaped like the quantize kernels (5 pointers, 7 ints, 8 constexprs): plain vs cached launch.
    src = torch.randn(16, 7168, device=dev)
    dst = torch.empty_like(src)
    kargs = (src, dst, src, dst, src, 16, 7168, 7168, 128, 448, 448, 1)
    consts = dict(C1=False, C2=False, C3=1, C4=True, C5=0, BLOCK_M=8, BLOCK_K=512, C8=1, num_warps=4)
    grid = (2, 14)
    jit_fn = _probe_kernel()
    rows["triton launch kernel[grid]"] = per_call_us(lambda: jit_fn[grid](*kargs, **consts))

    rows["launcher nvfp4_quantize"] = per_call_us(lambda: fp4.nvfp4_quantize(x, gs, True))
    rows["public nvfp4_quantize"] = per_call_us(lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled"))
    rows["public nvfp4_quantize backend=triton"] = per_call_us(
        lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled", backend="triton"))
    rows["launcher fp8_group_quantize"] = per_call_us(lambda: fp8.fp8_group_quantize(x, 128, 1e-10, False, False))
    rows["public fp8_group_quantize"] = per_call_us(lambda: ops.fp8_group_quantize(x))
    rows["public rms_norm"] = per_call_us(lambda: ops.rms_norm(x, w, 1e-6))
    rows["launcher rms_norm triton"] = per_call_us(lambda: rms.rms_norm(x, w, None, 1e-6, 0.0))
    rows["public rms_norm backend=triton"] = per_call_us(lambda: ops.rms_norm(x, w, 1e-6, backend="triton"))
    try:  # CuTe: the raw TVM-FFI callable, the backend entry, the public op
        from cute_ops import _compile, unavailable_reason
        from cute_ops import rmsnorm as cute_rms

        if unavailable_reason() is None:
            cfg = cute_rms.pick_config(x.dtype, w.dtype, 7168, "none", False, 0.0, 16, False, False,
                                       _compile.target_arch())
            fn, y = cute_rms.compiled(cfg), torch.empty_like(x)
            rows["cute raw TVM-FFI call"] = per_call_us(
                lambda: fn(x, w, None, None, y, None, None, None, None, 1e-6, 1e-10))
            rows["launcher rms_norm cute"] = per_call_us(lambda: cute_rms.rms_norm(x, w, None, 1e-6, 0.0))
            rows["public rms_norm backend=cute"] = per_call_us(lambda: ops.rms_norm(x, w, 1e-6, backend="cute"))
            r = torch.randn_like(x)
            rows["public rms_norm +residual cute"] = per_call_us(
                lambda: ops.rms_norm(x, w, 1e-6, residual=r, backend="cute"))
            rows["public rms_norm_fp8_group cute"] = per_call_us(
                lambda: ops.rms_norm_fp8_group(x, w, 1e-6, backend="cute"))
            rows["torch.empty_like x1"] = per_call_us(lambda: torch.empty_like(x))
        else:
            rows["cute"] = f"unavailable: {unavailable_reason()}"[:120]
    except Exception as exc:  # noqa: BLE001 - a probe: report and go on
        rows["cute"] = f"failed: {exc}"[:160]
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        rows["liger rms_norm"] = per_call_us(lambda: LigerRMSNormFunction.apply(x, w, 1e-6))
    except Exception as exc:
        rows["liger rms_norm"] = f"unavailable: {exc}"[:120]
    for name, value in rows.items():
        print(f"{name:40} {value if isinstance(value, str) else f'{value:8.2f} us'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           per_call_us=rows), f, indent=1)


if __name__ == "__main__":
    main()
