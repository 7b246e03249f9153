"""CuTeDSL backend of the RMSNorm ops (lowbit::rms_norm, rms_norm_fp8_group, rms_norm_nvfp4).

Contract: dispatch/reference/rmsnorm.py, byte for byte (the same tests run against every backend).
Kernel: cute_ops/_rmsnorm_kernel.py (one source for sm_90a and sm_100a). This module holds the config
heuristic, the compile key + fake tensors (symbolic M, so a new batch size never recompiles), the TVM-FFI
launcher and the backend entry functions, with the torch ops' signatures minus `backend`.

What differs per arch: only the compile target (`--gpu-arch sm_90a|sm_100a`, from the device or
CUTE_DSL_ARCH). The kernel is a bandwidth-bound row pass whose instructions (LDG.E.128/STG, SHFL, DADD,
FMNMX.NaN, F2FP e4m3 cvt) exist on both; the sm_100-only E2M1 cvt (cvt.rn.satfinite.e2m1x2.f32) is not used
because the threshold encoding is exact on both and the kernel is memory-bound (see docs/cute.md).
Importing this module needs nvidia-cutlass-dsl; the dispatch table only imports it when
`cute_ops.unavailable_reason()` is None.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from triton_ops.contract.arch import arch_of
from triton_ops.contract.checks import rows_view
from triton_ops.contract.formats import fp8_scale_storage, round_up

from . import _compile

MODES = ("none", "fp8", "nvfp4")
NVFP4_BLOCK = 16
MAX_ITERS = 8  # 16-byte vectors per thread: the row lives in registers (<= 64 fp32 values per thread)
_TORCH_TO_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class RMSNormConfig:
    """Everything static about one compiled kernel (the compile key). M is never here: it is symbolic."""

    x_dtype: str  # bf16 | fp16 | fp32 (also y and the residual)
    w_dtype: str
    k: int  # row length (static: unrolled, vectorized, predicated at compile time)
    mode: str  # none | fp8 | nvfp4
    residual: bool
    weight_offset: float
    group_size: int  # fp8 group (elements); 16 for nvfp4
    ue8m0: bool
    swizzle: bool  # nvfp4 128x4 scales
    vec: int  # elements per 16-byte vector
    threads_per_row: int
    rows_per_cta: int
    iters: int
    arch: str  # compile target, e.g. sm_90a / sm_100a

    def key(self) -> tuple:
        # Built once per config (dataclasses.astuple deep-copies: it cost ~28 us per eager call). Not a field,
        # so eq/hash/repr are unchanged; the tuple equals ("rmsnorm", *astuple(self)), so disk paths are stable.
        k = self.__dict__.get("_key")
        if k is None:
            k = ("rmsnorm", *(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_key", k)
        return k


@functools.cache
def pick_config(x_dtype: torch.dtype, w_dtype: torch.dtype, k: int, mode: str, residual: bool,
                weight_offset: float, group_size: int, ue8m0: bool, swizzle: bool, arch: str) -> RMSNormConfig:
    """Analytical heuristic: fewest threads per row with <= MAX_ITERS vectors each and < 1/8 idle lanes.

    Few threads per row keep the cross-warp reduction short; several rows per CTA keep >= 128 threads
    per CTA. Quant groups must sit in whole lanes of one warp: threads_per_row % (group // vec) == 0.
    Memoized (every eager call asks; the search cost ~8 us), so a config object is shared by equal arguments."""
    vec = 16 // x_dtype.itemsize
    nvec = k // vec
    lanes = (group_size // vec) if mode != "none" else 1
    # FP8 groups: at most 4 vectors per thread where 1024 threads allow it: on the H200 the short FP8 g128
    # +residual batch runs ~7% faster at 256 threads x 4 vectors than at 128 x 7 (docs/rmsnorm.md, alternatives
    # measured); plain and NVFP4 rows are fastest at the fewest threads (8 vectors) and keep it.
    best = None
    for max_iters in ((4, MAX_ITERS) if mode == "fp8" else (MAX_ITERS,)):
        for tpr in (8, 16, 32, 64, 128, 256, 512, 1024):
            if tpr % lanes or tpr < lanes:
                continue
            iters = -(-nvec // tpr)
            if iters > max_iters:
                continue
            waste = (iters * tpr - nvec) / (iters * tpr)
            if best is None or (waste <= 0.125 and best[2] > 0.125):
                best = (tpr, iters, waste)
            if waste <= 0.125:
                break
        if best is not None:
            break
    if best is None:
        raise ValueError(f"row length {k} needs more than 1024 threads x {MAX_ITERS} vectors")
    tpr, iters, _ = best
    rows = max(1, 128 // tpr)
    return RMSNormConfig(_TORCH_TO_NAME[x_dtype], _TORCH_TO_NAME[w_dtype], k, mode, residual, float(weight_offset),
                         group_size, ue8m0, swizzle, vec, tpr, rows, iters, arch)


# ------------------------------------------------------------------------------------------- compile


def _fake_args(cfg: RMSNormConfig):
    import cutlass
    import cutlass.cute as cute

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
    xd, wd = dt[cfg.x_dtype], dt[cfg.w_dtype]
    m = cute.sym_int()  # one symbol for every row count: TVM-FFI checks they agree at call time

    def rows2d(dtype, cols, div, align=16):
        return cute.runtime.make_fake_tensor(dtype, (m, cols), stride=(cute.sym_int64(divisibility=div), 1),
                                             assumed_align=align)

    k = cfg.k
    x = rows2d(xd, k, cfg.vec)
    w = cute.runtime.make_fake_tensor(wd, (k,), stride=(1,), assumed_align=16)
    res = rows2d(xd, k, cfg.vec) if cfg.residual else None
    res_out = rows2d(xd, k, cfg.vec) if cfg.residual else None
    y = q = s = gs = gs_out = None
    if cfg.mode == "none":
        y = rows2d(xd, k, cfg.vec)
    elif cfg.mode == "fp8":
        q = rows2d(cutlass.Uint8, k, cfg.vec, align=8)
        s = cute.runtime.make_fake_tensor(cutlass.Float32, (m, k // cfg.group_size),
                                          stride=(cute.sym_int64(), cute.sym_int64()), assumed_align=4)
    else:
        q = rows2d(cutlass.Uint8, k // 2, cfg.vec // 2, align=cfg.vec // 2)
        if cfg.swizzle:
            s = cute.runtime.make_fake_tensor(cutlass.Uint8, (cute.sym_int(),), stride=(1,), assumed_align=1)
        else:
            s = rows2d(cutlass.Uint8, k // NVFP4_BLOCK, 1, align=1)
        gs = cute.runtime.make_fake_tensor(cutlass.Float32, (1,), stride=(1,), assumed_align=4)
        gs_out = cute.runtime.make_fake_tensor(cutlass.Float32, (1,), stride=(1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (x, w, res, res_out, y, q, s, gs, gs_out, cutlass.Float32(1e-6), cutlass.Float32(1e-10), stream), (xd, wd)


def build(cfg: RMSNormConfig, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options` e.g. keep/dump flags for SASS tests)."""
    import cutlass.cute as cute

    from ._rmsnorm_kernel import RMSNormKernel

    args, dtypes = _fake_args(cfg)
    return cute.compile(RMSNormKernel(cfg, dtypes), *args,
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def compiled(cfg: RMSNormConfig):
    """The TVM-FFI callable for `cfg` (compiled once per process, loaded from disk when cached)."""
    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def dump(cfg: RMSNormConfig):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from ._sass import compile_and_dump

    return compile_and_dump(lambda extra: build(cfg, extra))


# ------------------------------------------------------------------------------------------ supports


def _aligned(t: torch.Tensor, nbytes: int) -> bool:
    return t.data_ptr() % nbytes == 0


UNVERIFIED_ENV = "LOWBIT_CUTE_UNVERIFIED"
HARDWARE_VERIFIED_ARCHS = ("sm_90",)  # every CuTe RMSNorm GPU test bit-exact on the H200 (perf/results/runs)
HARDWARE_STATUS = (
    "not bit-exact on hardware yet for this arch (verified only on sm_90, on the H200; sm_100a builds are "
    f"compiled and SASS-checked in CI, never run on Blackwell); set {UNVERIFIED_ENV}=1 to run it anyway")


def _supports(x, weight, residual, mode: str, group_size: int = 16) -> str | None:
    # A backend not shown bit-exact on an arch's hardware is not offered there, not even when forced
    # (docs/cute.md).
    if arch_of(x.device) not in HARDWARE_VERIFIED_ARCHS and os.environ.get(UNVERIFIED_ENV) != "1":
        return HARDWARE_STATUS
    if x.device.type != "cuda":
        return "the cute backend runs on CUDA tensors only"
    if x.dtype not in _TORCH_TO_NAME or weight.dtype not in _TORCH_TO_NAME:
        return f"dtypes x={x.dtype}, weight={weight.dtype} not compiled for"
    k = x.shape[-1]
    vec = 16 // x.dtype.itemsize
    if k == 0 or x.numel() == 0:
        return None
    if k % vec:
        return f"row length {k} is not a multiple of {vec} (16-byte vectors)"
    if weight.dim() != 1 or weight.stride(-1) != 1 or not _aligned(weight, 16):
        return "weight must be a contiguous, 16-byte aligned [K] vector"
    for name, t in (("x", x), ("residual", residual)):
        if t is None:
            continue
        if t.stride(-1) != 1 or not _aligned(t, 16) or (t.dim() > 1 and t.view(-1, k).stride(0) % vec):
            return f"{name} rows must be 16-byte aligned with a unit last stride"
    if mode == "fp8" and (group_size % vec or group_size // vec > 32 or group_size & (group_size - 1)):
        return f"group_size={group_size}: a group must span a power-of-two number (<= 32) of 16-byte vectors"
    try:
        pick_config(x.dtype, weight.dtype, k, mode, residual is not None, 0.0, group_size, False, False, "sm_90a")
    except ValueError as exc:
        return str(exc)
    return None


def supports_rms_norm(x, weight, residual, eps, weight_offset) -> str | None:
    return _supports(x, weight, residual, "none")


def supports_rms_norm_fp8_group(x, weight, residual, eps, weight_offset, group_size, quant_eps, ue8m0,
                                column_major) -> str | None:
    return _supports(x, weight, residual, "fp8", group_size)


def supports_rms_norm_nvfp4(x, weight, residual, eps, weight_offset, global_scale, swizzle) -> str | None:
    if global_scale is None:
        return ("global_scale=None needs a tensor-wide amax pass before quantizing; the cute kernel takes a "
                "given global scale (pass one, or use the triton backend)")
    return _supports(x, weight, residual, "nvfp4", NVFP4_BLOCK)


# ------------------------------------------------------------------------------------------ launcher


_LAUNCH_FNS: dict = {}  # (dtypes, K, mode, flags, device index, CUTE_DSL_ARCH) -> compiled TVM-FFI function


def _rows(arg: str, t: torch.Tensor) -> torch.Tensor:
    """[rows, K] view; a 2-D tensor with a unit last stride is that view already (skips ~3-7 us per call)."""
    return t if t.dim() == 2 and t.stride(-1) == 1 else rows_view("rms_norm", arg, t)


def _compiled_for(x, weight, residual, weight_offset, mode, group_size, ue8m0, swizzle):
    """The compiled TVM-FFI function for these arguments: one dict lookup per call (pick_config + compiled +
    target_arch cost ~5-8 us on the H200's host); the arch env var is part of the key since CPU CI flips it
    between compiles."""
    dev = x.device
    launch_key = (x.dtype, weight.dtype, x.shape[-1], mode, residual is not None, weight_offset, group_size, ue8m0,
                  swizzle, dev.index, _compile.arch_env())
    fn = _LAUNCH_FNS.get(launch_key)
    if fn is None:
        arch = _compile.target_arch(dev.index)
        cfg = pick_config(x.dtype, weight.dtype, x.shape[-1], mode, residual is not None, weight_offset, group_size,
                          ue8m0, swizzle, arch)
        fn = _LAUNCH_FNS[launch_key] = compiled(cfg)
    return fn


def _launch(x, weight, residual, eps, weight_offset, *, mode, group_size=16, quant_eps=1e-10, ue8m0=False,
            column_major=False, swizzle=False, global_scale=None):
    # Host cost matters here (decode calls are ~5 us of GPU time): no per-call imports, dataclass copies or
    # redundant views; measured with tests/test_cute_rmsnorm.py::test_gpu_call_overhead_report.
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = _rows("x", x)
    rows = x2.shape[0]
    dev = x.device
    new_res = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    y = q = scales = gs_out = None
    if mode == "none":
        y = torch.empty(*lead, k, dtype=x.dtype, device=dev)
    elif mode == "fp8":
        q = torch.empty(*lead, k, dtype=torch.float8_e4m3fn, device=dev)
        scales = fp8_scale_storage(lead, k // group_size, column_major, dev)
    else:
        q = torch.empty(*lead, k // 2, dtype=torch.uint8, device=dev)
        g = k // NVFP4_BLOCK
        if swizzle:
            alloc = torch.zeros if g % 4 else torch.empty  # the kernel writes row padding, not column padding
            scales = alloc(round_up(rows, 128), round_up(g, 4), dtype=torch.float8_e4m3fn, device=dev)
        else:
            scales = torch.empty(*lead, g, dtype=torch.float8_e4m3fn, device=dev)
        gs_out = torch.empty((), dtype=torch.float32, device=dev)  # the kernel copies global_scale into it
    if rows == 0 or k == 0:
        if mode == "nvfp4":
            scales.view(torch.uint8).zero_()
            gs_out.copy_(global_scale.reshape(()))
        if residual is not None:
            new_res.copy_((x.float() + residual.float()).to(x.dtype))
        return _results(mode, y, q, scales, gs_out, new_res)
    fn = _compiled_for(x, weight, residual, weight_offset, mode, group_size, ue8m0, swizzle)
    r2 = _rows("residual", residual) if residual is not None else None
    ro2 = _rows("new residual", new_res) if residual is not None else None
    w = weight.contiguous()
    if mode == "none":
        args = (_rows("y", y), None, None, None, None)
    elif mode == "fp8":
        args = (None, _rows("q", q).view(torch.uint8), scales.view(rows, k // group_size), None, None)
    else:
        s_arg = scales.view(torch.uint8).view(-1) if swizzle else scales.view(rows, k // NVFP4_BLOCK).view(torch.uint8)
        args = (None, _rows("q", q), s_arg, global_scale.view(1), gs_out.view(1))
    _compile.launch(fn, x2, w, r2, ro2, *args, float(eps), float(quant_eps), device=dev)
    return _results(mode, y, q, scales, gs_out, new_res)


def _results(mode, y, q, scales, gs_out, new_res):
    if mode == "none":
        return y, new_res
    if mode == "nvfp4":
        return q, scales, gs_out, new_res
    return q, scales, new_res


# ------------------------------------------------------------------------------ per-signature launchers


def _specialize(entry, mode, x, weight, residual, eps, weight_offset, group_size=16, quant_eps=1e-10, ue8m0=False,
                column_major=False, global_scale=None, swizzle=False):
    """A launcher for repeated eager calls with exactly this call signature (dispatch/ops/_common.call keeps
    it per signature: dtypes, shapes, strides, alignment and the plain arguments are fixed), or None where the
    general path must run. It keeps only what a decode call cannot avoid: the output allocations and the TVM-FFI
    call (everything else, the compiled-function lookup, views and checks, was done once here). `entry` is the
    backend entry it stands for, and runs instead when the current device is not x's (the TVM-FFI env stream is
    the current device's).
    Taken for 2-D row-contiguous x (and residual) with rows > 0: bf16 outputs, FP8 with row-major or column-major
    scales (the column-major storage of `fp8_scale_storage`, made by one allocation and a strided view), NVFP4
    with a given global scale (linear scales, or swizzled ones whose column padding needs no zeroing)."""
    if x.dim() != 2 or not x.is_contiguous() or x.shape[0] == 0:
        return None
    if mode == "nvfp4" and (global_scale is None or (swizzle and (x.shape[1] // NVFP4_BLOCK) % 4)):
        return None
    if residual is not None and (residual.dim() != 2 or not residual.is_contiguous()):
        return None
    if not weight.is_contiguous() or x.device.index is None:
        return None
    fn = _compiled_for(x, weight, residual, weight_offset, mode, group_size, ue8m0, swizzle)
    eps, quant_eps = float(eps), float(quant_eps)
    device = x.device
    index = device.index
    get_device = torch._C._cuda_getDevice
    k = x.shape[-1]
    n_groups = k // group_size
    e4m3 = torch.float8_e4m3fn

    if mode == "none":
        def launch(x, weight, residual, *rest):
            if get_device() != index:
                return entry(x, weight, residual, *rest)
            y = torch.empty_like(x)
            new_res = None if residual is None else torch.empty_like(x)
            fn(x, weight, residual, new_res, y, None, None, None, None, eps, quant_eps)
            return y, new_res
    elif mode == "nvfp4":
        blocks = k // NVFP4_BLOCK  # a multiple of 4 when swizzled: no column padding

        def launch(x, weight, residual, *rest):
            if get_device() != index:
                return entry(x, weight, residual, *rest)
            global_scale = rest[2]
            rows = x.shape[0]
            q = torch.empty((rows, k // 2), dtype=torch.uint8, device=device)
            if swizzle:  # the kernel takes the 128x4 layout as flat bytes (it writes the row padding itself)
                scales = torch.empty(round_up(rows, 128) * blocks, dtype=torch.uint8, device=device)
            else:
                scales = torch.empty((rows, blocks), dtype=torch.uint8, device=device)
            gs_out = torch.empty(1, dtype=torch.float32, device=device)
            new_res = None if residual is None else torch.empty_like(x)
            fn(x, weight, residual, new_res, None, q, scales, global_scale.view(1), gs_out, eps, quant_eps)
            return q, scales.view(e4m3).view(-1, blocks), gs_out.view(()), new_res
    elif column_major:  # fp8_scale_storage's layout: storage (groups, round_up(rows, 4)), viewed as (rows, groups)
        rows = x.shape[0]
        col = round_up(rows, 4)

        def launch(x, weight, residual, *rest):
            if get_device() != index:
                return entry(x, weight, residual, *rest)
            q = torch.empty(x.shape, dtype=torch.uint8, device=device)
            scales = torch.empty(n_groups * col, dtype=torch.float32, device=device).as_strided((rows, n_groups),
                                                                                               (1, col))
            new_res = None if residual is None else torch.empty_like(x)
            fn(x, weight, residual, new_res, None, q, scales, None, None, eps, quant_eps)
            return q.view(e4m3), scales, new_res
    else:
        def launch(x, weight, residual, *rest):
            if get_device() != index:
                return entry(x, weight, residual, *rest)
            q = torch.empty(x.shape, dtype=torch.uint8, device=device)
            scales = torch.empty((x.shape[0], n_groups), dtype=torch.float32, device=device)
            new_res = None if residual is None else torch.empty_like(x)
            fn(x, weight, residual, new_res, None, q, scales, None, None, eps, quant_eps)
            return q.view(e4m3), scales, new_res
    return launch


# ------------------------------------------------------------------------------- backend entry points
# Same signatures as the torch ops in dispatch/ops/rmsnorm.py, minus `backend`.


def rms_norm(x, weight, residual, eps, weight_offset):
    return _launch(x, weight, residual, eps, weight_offset, mode="none")


def specialize_rms_norm(*args):
    """A launcher prepared for this exact call signature (the dispatch table's `specialize` hook)."""
    return _specialize(rms_norm, "none", *args)


def rms_norm_fp8_group(x, weight, residual, eps, weight_offset, group_size, quant_eps, ue8m0, column_major):
    return _launch(x, weight, residual, eps, weight_offset, mode="fp8", group_size=group_size, quant_eps=quant_eps,
                   ue8m0=ue8m0, column_major=column_major)


def specialize_rms_norm_fp8_group(*args):
    return _specialize(rms_norm_fp8_group, "fp8", *args)


def rms_norm_nvfp4(x, weight, residual, eps, weight_offset, global_scale, swizzle):
    return _launch(x, weight, residual, eps, weight_offset, mode="nvfp4", swizzle=swizzle,
                   global_scale=global_scale)


def specialize_rms_norm_nvfp4(x, w, r, eps, off, gs, swizzle):
    return _specialize(rms_norm_nvfp4, "nvfp4", x, w, r, eps, off, global_scale=gs, swizzle=swizzle)
