"""Where the host time of one eager lowbit call goes (GPU probe, ~15 s).

Eager calls at decode size are host-bound: the GPU finishes each kernel in a few microseconds while Python
prepares the next. This probe times, per call and on the CPU clock (GPU work is tiny, so wall time per call is
host time), the layers one at a time for a few ops:

  torch.empty            the allocations an op needs
  triton launch          `kernel[grid](...)` of the op's own kernel with prepared arguments
  compiled.run           the same kernel through the CompiledKernel launcher directly (what a launch cache
                         that skips JITFunction.run's binder/key would cost)
  launcher               triton_ops.<family>.<op>(...) (allocation + tile choice + launch)
  public op              dispatch.ops.<op>(...) (checks + table choice + launcher)

Run on the GPU from the repo root:  PYTHONPATH=$PWD python perf/probes/host_overhead.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def per_call_us(fn, n: int = 3000) -> float:
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
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

    # The op's own kernel with prepared arguments: plain launch vs the compiled launcher.
    codes = torch.empty(16, 3584, dtype=torch.uint8, device=dev)
    scales = torch.empty(128, 448, dtype=torch.uint8, device=dev)
    gs_out = torch.empty((), dtype=torch.float32, device=dev)
    words = x.view(torch.int32)
    kargs = (words, codes, scales, gs, gs_out, 16, 7168, words.stride(0), 128, 448, 448, 1)
    consts = dict(IS_MX=False, MX_RCEIL=False, GS_MODE=1, SWIZZLE=True, IN_KIND=0, BLOCK_M=8, BLOCK_K=512,
                  PARTIALS_BLOCK=1, num_warps=4)
    grid = (16, 14)
    kernel = fp4._fp4_quantize_kernel
    rows["triton launch kernel[grid]"] = per_call_us(lambda: kernel[grid](*kargs, **consts))
    compiled = kernel[grid](*kargs, **consts)
    try:
        from triton import knobs

        stream = torch.cuda.current_stream().cuda_stream

        def direct():
            compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None,
                         knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *kargs)

        direct()
        rows["compiled.run (no binder)"] = per_call_us(direct)
    except Exception as exc:  # the launcher ABI differs between Triton versions: report, do not guess
        rows["compiled.run (no binder)"] = f"failed: {type(exc).__name__}: {exc}"[:160]

    rows["launcher nvfp4_quantize"] = per_call_us(lambda: fp4.nvfp4_quantize(x, gs, True))
    rows["public nvfp4_quantize"] = per_call_us(lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled"))
    rows["public nvfp4_quantize backend=triton"] = per_call_us(
        lambda: ops.nvfp4_quantize(x, gs, scale_layout="swizzled", backend="triton"))
    rows["launcher fp8_group_quantize"] = per_call_us(lambda: fp8.fp8_group_quantize(x, 128, 1e-10, False, False))
    rows["public fp8_group_quantize"] = per_call_us(lambda: ops.fp8_group_quantize(x))
    rows["public rms_norm"] = per_call_us(lambda: ops.rms_norm(x, w, 1e-6))
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        rows["liger rms_norm"] = per_call_us(lambda: LigerRMSNormFunction.apply(x, w, 1e-6))
    except Exception as exc:
        rows["liger rms_norm"] = f"unavailable: {exc}"[:120]
    _ = rms
    for name, value in rows.items():
        print(f"{name:40} {value if isinstance(value, str) else f'{value:8.2f} us'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           per_call_us=rows), f, indent=1)


if __name__ == "__main__":
    main()
