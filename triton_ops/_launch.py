"""Launcher helpers shared by the Triton op modules."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch
import triton.language as tl

from triton_ops.contract.arch import arch_at_least, arch_of
from triton_ops.contract.recording import LaunchRecord, note

TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def emulate_formats(device: torch.device) -> bool:
    """True where fp8 / bf16 casts must be emulated: the interpreter (host tensors), and GPUs without
    hardware E4M3 conversion (before sm_89)."""
    arch = arch_of(device)
    return arch == "cpu" or not arch_at_least(arch, "sm_89")


def launch(kernel, grid, *args, **kwargs):
    """kernel[grid](*args, **kwargs): every lowbit Triton launch goes through here, so that a recording scope
    (triton_ops.contract.recording.recording_launches) can see the compiled kernel and the exact arguments of each
    launch."""
    compiled = kernel[grid](*args, **kwargs)
    note(LaunchRecord, kernel, tuple(grid), args, kwargs, compiled)
    return compiled


def launch_hooks_set(knobs=None) -> bool:
    """Whether a Triton launch hook of `knobs` (default: triton.knobs) would run (profilers need the full launch
    path): Triton 3.6 keeps a HookChain (never None; empty: nothing runs), older versions a callable or None."""
    if knobs is None:
        from triton import knobs
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(h is not None and bool(getattr(h, "calls", True)) for h in hooks)


def bound_values(kernel, args: tuple, kwargs: dict) -> list | None:
    """[(value, is_constexpr)] of a JITFunction's parameters in order, as Triton's launch passes them to the
    compiled kernel's launcher (constexpr parameters included: the launcher skips them); None for a kernel
    without a Python signature."""
    params = getattr(kernel, "signature", None)
    if not isinstance(params, inspect.Signature):
        return None
    kw = {k: v for k, v in kwargs.items() if k in params.parameters}
    bound = params.bind(*args, **kw)
    bound.apply_defaults()
    constexpr = {p.name for p in getattr(kernel, "params", ()) if p.is_constexpr}
    return [(v, name in constexpr) for name, v in bound.arguments.items()]


def prepare(kernel, grid, sources: tuple, *args, **kwargs):
    """A launcher of `launch(kernel, grid, *args, **kwargs)` for repeated calls whose tensors change and nothing
    else: fn(*tensors) launches with `tensors` (one per entry of `sources`, same dtypes, shapes, strides and
    16-byte alignment; None where the source is None) in place of `sources`, every other argument as given here;
    None where no such launcher is made: a tensor argument is none of the sources, or several sources start at its
    address (aliased here, they may differ in a later call).

    Each positional tensor argument must start where exactly one source starts (the source itself, or a view of
    it of the same element size: `x.view(torch.uint8)`). On a GPU (the current device must be the tensors') the
    kernel is compiled here without launching (`JITFunction.warmup`, which specializes on these tensors as a launch
    does) and a call fills the pointers into a fixed argument list and calls the compiled launcher on the current
    device's current stream, as an eager launch plan does (dispatch/launch_plan.py); under the interpreter (host
    tensors) a call runs `launch` with the substituted arguments."""
    if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        return None
    slots = []  # (argument position, source index)
    for pos, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            continue
        same = [i for i, s in enumerate(sources) if s is not None and s.data_ptr() == a.data_ptr()]
        if len(same) != 1:  # aliased sources: which one a call means is not known
            return None
        slots.append((pos, same[0]))
    if any(sources[i].dtype.itemsize != args[pos].dtype.itemsize for pos, i in slots):
        return None
    if all(s.device.type == "cpu" for s in sources if s is not None):
        base = list(args)

        def interpreted(*tensors):
            values = base.copy()
            for pos, i in slots:
                values[pos] = tensors[i].view(args[pos].dtype)
            launch(kernel, grid, *values, **kwargs)

        return interpreted
    values = bound_values(kernel, args, kwargs)
    if values is None or launch_hooks_set():
        return None
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    if hasattr(compiled, "result"):  # an asynchronous compile
        compiled = compiled.result()
    if compiled is None:
        return None
    run = compiled.run  # loads the module: `function` is set from here on
    function, metadata = compiled.function, compiled.packed_metadata
    template = [v for v, _ in values]
    for pos, _ in slots:
        template[pos] = 0
    gx, gy, gz = tuple(grid) + (1,) * (3 - len(grid))
    get_stream, get_device = torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice

    def launcher(*tensors):
        values = template.copy()
        for pos, i in slots:
            values[pos] = tensors[i].data_ptr()
        run(gx, gy, gz, get_stream(get_device()), function, metadata, None, None, None, *values)

    return launcher


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

    GPU: 4096 elements and 4 warps per program (the best of a 13-config sweep on the H200 for NVFP4, MXFP4
    and FP8 at 8192x8192), as wide as 2048 columns for long-row batches;
    short batches (decode) take 512-column tiles so a single row still spreads over several SMs.
    Interpreter: the cost is per program, so take the largest tiles that keep numpy arrays small.
    min_block_k is the format block times 4, so one program owns whole 4-column groups of swizzled scales.
    max_block_k: the widest tile for long-row batches (GPU); the FP4 quantizers take one 4096-column row per program
    (faster than 2x2048 on the H200 at 8192x8192: docs/quant.md, alternatives measured), the others keep 2048 (FP8
    measured equal; dequantizers not swept).
    """
    if interpreter:
        target_elems, widest = 32768, 2048
    else:
        target_elems, widest = 4096, (max_block_k if rows >= 64 else 512)
    block_k = max(min_block_k, min(next_pow2(k), widest))
    block_m = max(1, min(next_pow2(rows), target_elems // block_k))
    return TileConfig(block_m, block_k, num_warps=4)

