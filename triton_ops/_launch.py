"""Launcher helpers shared by the Triton op modules."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator

import torch
import triton.language as tl

from triton_ops.contract.arch import arch_at_least, arch_of

TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def emulate_formats(device: torch.device) -> bool:
    """True where fp8 / bf16 casts must be emulated: the interpreter (host tensors), and GPUs without
    hardware E4M3 conversion (before sm_89)."""
    arch = arch_of(device)
    return arch == "cpu" or not arch_at_least(arch, "sm_89")


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """One kernel launch as `launch` saw it: what an eager launch plan (dispatch/launch_plan.py) replays."""

    kernel: object  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    compiled: object  # the CompiledKernel the launch ran (None under the interpreter)


# The launches of the current `recording_launches()` scope (a context variable: per thread / task, like
# dispatch.use_backend); None outside one.
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("lowbit_launch_recording", default=None)


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs): every lowbit Triton launch goes through here, so that a recording scope can
    see the compiled kernel and the exact arguments of each launch."""
    compiled = kernel[grid](*args, **kwargs)
    recording = _RECORDING.get()
    if recording is not None:
        recording.append(LaunchRecord(kernel, tuple(grid), args, kwargs, compiled))
    return compiled


@contextlib.contextmanager
def recording_launches() -> Iterator[list[LaunchRecord]]:
    """Collect the LaunchRecords of every `launch` inside the block (nested scopes each see their own)."""
    records: list[LaunchRecord] = []
    token = _RECORDING.set(records)
    try:
        yield records
    finally:
        _RECORDING.reset(token)


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


def pick_tile(rows: int, k: int, device: torch.device, *, min_block_k: int, max_block_k: int = 2048) -> TileConfig:
    return _pick_tile(rows, k, device.type == "cpu", min_block_k, max_block_k)


@functools.lru_cache(maxsize=4096)  # called on every eager launch; the answer depends only on the sizes
def _pick_tile(rows: int, k: int, interpreter: bool, min_block_k: int, max_block_k: int) -> TileConfig:
    """Analytical tile choice for the streaming quant kernels.

    GPU: 4096 elements and 4 warps per program (the best of a 13-config sweep on an H200 for NVFP4, MXFP4
    and FP8 at 8192x8192; scratch numbers in docs/design_notes.md), as wide as 2048 columns for long-row batches;
    short batches (decode) take 512-column tiles so a single row still spreads over several SMs.
    Interpreter: the cost is per program, so take the largest tiles that keep numpy arrays small.
    min_block_k is the format block times 4, so one program owns whole 4-column groups of swizzled scales.
    max_block_k: the widest tile for long-row batches (GPU); the FP4 quantizers take one 4096-column row per program
    (H200, 8192x8192 bf16, graph replay, commit e0dd1e2: NVFP4 swizzled 53.7 us vs 57.4 at 2x2048, MXFP4 47.1 vs
    48.5; perf/results/experiments), the others keep 2048 (FP8 measured equal; dequantizers not swept).
    """
    if interpreter:
        target_elems, widest = 32768, 2048
    else:
        target_elems, widest = 4096, (max_block_k if rows >= 64 else 512)
    block_k = max(min_block_k, min(next_pow2(k), widest))
    block_m = max(1, min(next_pow2(rows), target_elems // block_k))
    return TileConfig(block_m, block_k, num_warps=4)

