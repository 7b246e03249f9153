"""Launcher helpers shared by the Triton op modules."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import torch
import triton
import triton.language as tl

from dispatch.arch import arch_at_least, arch_of

TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def emulate_formats(device: torch.device) -> bool:
    """True where fp8 / bf16 casts must be emulated: the interpreter (host tensors), and GPUs without
    hardware E4M3 conversion (before sm_89)."""
    arch = arch_of(device)
    return arch == "cpu" or not arch_at_least(arch, "sm_89")


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division. (`triton.cdiv` is a constexpr function object in newer Triton and costs a few
    microseconds per call from Python; launchers call it several times per op, on the eager hot path.)"""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1); host-side, see `cdiv`."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A 2-D tile of a [rows, K] problem handled by one program."""

    block_m: int  # rows per program
    block_k: int  # columns per program (a multiple of the format's block)
    num_warps: int  # warps per program (GPU only; ignored by the interpreter)


def pick_tile(rows: int, k: int, device: torch.device, *, min_block_k: int) -> TileConfig:
    return _pick_tile(rows, k, device.type == "cpu", min_block_k)


@functools.lru_cache(maxsize=4096)  # called on every eager launch; the answer depends only on the sizes
def _pick_tile(rows: int, k: int, interpreter: bool, min_block_k: int) -> TileConfig:
    """Analytical tile choice for the streaming quant kernels.

    GPU: 4096 elements and 4 warps per program (the best of a 13-config sweep on an H200 for NVFP4, MXFP4
    and FP8 at 8192x8192; scratch numbers in perf/NOTES.md), as wide as 2048 columns for long-row batches;
    short batches (decode) take 512-column tiles so a single row still spreads over several SMs.
    Interpreter: the cost is per program, so take the largest tiles that keep numpy arrays small.
    min_block_k is the format block times 4, so one program owns whole 4-column groups of swizzled scales.
    """
    if interpreter:
        target_elems, max_block_k = 32768, 2048
    else:
        target_elems, max_block_k = 4096, (2048 if rows >= 64 else 512)
    block_k = max(min_block_k, min(next_pow2(k), max_block_k))
    block_m = max(1, min(next_pow2(rows), target_elems // block_k))
    return TileConfig(block_m, block_k, num_warps=4)


# --------------------------------------------------------------------------------------- cached launches


class FastLaunchKernel:
    """A `@triton.jit` kernel whose repeat launches skip `JITFunction.run`.

    Why: on the H200 host, `kernel[grid](...)` costs ~30 us of Python per launch (argument binding,
    specialization, cache key, launch metadata: perf/probes/host_overhead.py), more than most decode kernels
    run and about the time of an 8192x8192 FP8 quantize. Eager callers feel it directly.

    How: the first launch for a given argument *signature* goes through Triton as usual and returns the
    CompiledKernel; later launches with the same signature call its launcher directly. The signature is a
    refinement of Triton's own specialization key (per tensor: dtype and 16-byte alignment; per int: Python
    type, ==1, %16 == 0 and its 32/64-bit range; per other arg: type and value; all constexprs and launch
    options by value; the device), so a cached kernel is exactly the one Triton would have picked.
    Launch hooks (profilers), the interpreter, or a launcher ABI this code does not know fall back to the
    normal path; the last case is logged once (never silent).
    """

    def __init__(self, jit_fn):
        self.jit_fn = jit_fn
        self.arg_names = tuple(getattr(jit_fn, "arg_names", ()))
        self._compiled: dict = {}

    def __getattr__(self, name):  # SASS tooling and probes reach the JITFunction's attributes through us
        return getattr(self.jit_fn, name)

    def __getitem__(self, grid):
        return functools.partial(self._launch, grid)

    def _launch(self, grid, *args, **kwargs):
        if not _FAST_LAUNCH["enabled"] or not args or not isinstance(args[0], torch.Tensor) \
                or args[0].device.type != "cuda" or callable(grid):
            return self.jit_fn[grid](*args, **kwargs)
        names = self.arg_names[len(args):]
        try:
            full = args + tuple(kwargs[n] for n in names)
        except KeyError:  # a parameter left to its default: let Triton bind it
            return self.jit_fn[grid](*args, **kwargs)
        device = args[0].device.index
        key = (device, tuple(map(_signature_of, args)), tuple(kwargs.items()))
        compiled = self._compiled.get(key)
        if compiled is None or _hooks_set():
            compiled = self.jit_fn[grid](*args, **kwargs)
            self._compiled[key] = compiled
            return compiled
        if len(grid) < 3:
            grid = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch._C._cuda_getCurrentRawStream(device)
        try:
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *full)
        except TypeError as exc:  # launcher ABI changed (another Triton version): stop using the cache
            _FAST_LAUNCH["enabled"] = False
            _log.warning("lowbit: cached Triton launches disabled (%s); using kernel[grid] launches", exc)
            return self.jit_fn[grid](*args, **kwargs)
        return compiled


_FAST_LAUNCH = {"enabled": os.environ.get("LOWBIT_FAST_LAUNCH", "1") != "0"}
_log = logging.getLogger("lowbit.launch")


def _hooks_set() -> bool:
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and (runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None)


def _signature_of(a):
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or a is None:
        return a
    if isinstance(a, int):
        return (int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63)
    return (type(a), a)


def fast_launch(jit_fn) -> FastLaunchKernel:
    """Decorator (above `@triton.jit`): see FastLaunchKernel."""
    return FastLaunchKernel(jit_fn)
