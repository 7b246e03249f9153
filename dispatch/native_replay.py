"""Native replay of eager launch plans: one Python-to-C++ call per replayed op call.

A LaunchPlan (dispatch/launch_plan.py) replayed in Python costs ~15-20 us of host time per call: the signature key,
torch.empty_strided per output, the pointer slots and views, and Triton's launcher, each a Python-level call. The
extension built from dispatch/_replay.cpp does all of it in one call: it computes the call's key from the argument
tuple (the fields of dispatch/ops/_common.py `_signature`, plus the env names below), finds the plan, allocates
(`block_layout`: one at::empty per call for the plan's small allocations, zero-fills as one driver memset),
fills the pointer parameters and launches each compiled kernel with cuLaunchKernelEx on the current stream
(libcuda.so.1 opened with dlopen; the parameters packed as the installed Triton's launcher packs them, the global /
profile scratch pointers last and null), then returns the outputs.

Derivation stays in Python: `adopt` converts a plan the extension can run (no global or profile scratch, no
cooperative launch, only pointer / integer / float parameters and, with Triton 3.6's launcher, host tensor
descriptors: the extension encodes each one's CUtensorMap per call with cuTensorMapEncodeTiled as Triton's
fillTMADescriptor does, then passes its shape and strides) and registers it under the call's key; any other plan
keeps its Python replay (`REFUSALS` says why).

A plan with CuTe calls replays only here: the extension calls each compiled CuTeDSL function (a tvm_ffi.Function)
through the TVM-FFI C ABI (dispatch/_replay_cute.h) with DLTensors it builds from the call's inputs and allocations,
on the current stream set as TVM-FFI's environment stream of the device, as TVM-FFI's Python binding does;
libtvm_ffi is the library the `tvm_ffi` package loaded (`_libtvm_ffi_path`). Without it, or for a function that is
not a plain tvm_ffi.Function, the row's prepared launcher (or its general entry) serves the signature. A CUDA plan
with CuTe calls misses (the Python path runs) while the current device is not the plan's.

The extension is compiled on first use
into torch's extensions cache under a name that hashes its source, torch's and Python's versions (with torch's
ninja build where ninja is installed, else one direct compiler call). Without a compiler, or with NATIVE_ENV=0,
plans replay in Python (one debug log line says why).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from . import launch_plan

log = logging.getLogger("lowbit.dispatch")
NATIVE_ENV = "LOWBIT_EAGER_NATIVE"
_SOURCE = Path(__file__).with_name("_replay.cpp")
_HEADERS = (_SOURCE.with_name("_replay_driver.h"), _SOURCE.with_name("_replay_cute.h"))  # included by _SOURCE
# One block per call: allocations of at most BLOCK_MEMBER_MAX bytes share it, each at a BLOCK_ALIGN aligned offset.
BLOCK_ALIGN = 256
BLOCK_MEMBER_MAX = 1 << 20

# The extension's `call(name, args)` once it is loaded (None before and without it), and what it returns for a
# call without a plan.
call = None
MISS = object()
# op -> why its last plan was not converted (None: it was); op -> the last plan it was (perf/eager.py breakdowns).
REFUSALS: dict = {}
ADOPTED: dict = {}
_state: dict = {"module": None, "tried": False, "tvm_ffi": None}

# Triton 3.6's generated launcher: signature string -> parameter type code (the extension's codes, which are
# Triton 3.9's extractor indices; 3.9's launcher gives its codes as `kernel_signature` bytes).
_CODES_36 = {"i1": 2, "i8": 2, "i16": 3, "i32": 4, "i64": 5, "u1": 6, "u8": 6, "u16": 7, "u32": 8, "u64": 9,
             "fp16": 10, "bf16": 11, "fp32": 12, "f32": 12, "fp64": 13}
PTR = 1
I32, I64 = 4, 5
TMA = 14  # a CUtensorMap by value (the extension encodes it per call)
_FLOAT_CODES = frozenset({10, 11, 12, 13})
# Triton 3.6's TMA element types: the kernel's (device) enum -> the driver's (host) one (its driver.py).
_TMA_DTYPE_DEVICE_TO_HOST = {8: 10, 9: 8, 10: 9}
# CuTe call arguments: TVM-FFI type indices (c_api.h TVMFFITypeIndex), and DLPack's (type code, bits) per dtype.
FFI_NONE, FFI_INT, FFI_BOOL, FFI_FLOAT, FFI_DLTENSOR = 0, 1, 2, 3, 7
DL_DTYPES = {torch.bool: (6, 8), torch.uint8: (1, 8), torch.int8: (0, 8), torch.int16: (0, 16), torch.int32: (0, 32),
             torch.int64: (0, 64), torch.float16: (2, 16), torch.bfloat16: (4, 16), torch.float32: (2, 32),
             torch.float64: (2, 64), torch.float8_e4m3fn: (10, 8), torch.float8_e5m2: (12, 8)}


class NoNative(Exception):
    """Why a plan keeps its Python replay."""


def module():
    """The extension (built on first use), or None where it cannot be built or NATIVE_ENV=0."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if os.environ.get(NATIVE_ENV) == "0":
        log.debug("lowbit native replay: off (%s=0)", NATIVE_ENV)
        return None
    try:
        _state["module"] = _build()
    except Exception as exc:  # no compiler, no headers, no ninja: the Python replay serves every call
        log.debug("lowbit native replay: unavailable (%s: %s); plans replay in Python", type(exc).__name__, exc)
    return _state["module"]


def _build():
    global call, MISS
    from torch.utils import cpp_extension

    from . import registry
    from .eager_env import SELECT_ENV

    source = _SOURCE.read_bytes() + b"".join(h.read_bytes() for h in _HEADERS)
    tag = hashlib.sha256(source + f"{torch.__version__}|{sys.version_info[:2]}".encode()).hexdigest()[:16]
    name = f"lowbit_replay_{tag}"
    if cpp_extension.is_ninja_available():
        mod = cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=["-O2"], verbose=False)
    else:
        mod = _compile_directly(name, cpp_extension)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_device is None or get_stream is None:  # a CPU build of torch: plans without launches only
        get_device = get_stream = _no_cuda
    # The key reads NATIVE_ENV and every env name `_signature` reads; the last one set means no key (as there).
    mod.init((NATIVE_ENV, *SELECT_ENV), registry._scoped, get_device, get_stream)
    call = mod.call
    MISS = mod.MISS
    return mod


def _compile_directly(name: str, cpp_extension):
    """The extension built by one compiler call (no ninja), cached as <extensions dir>/<name>/<name>.so."""
    import importlib.machinery
    import importlib.util
    import shutil
    import subprocess
    import sysconfig
    import tempfile

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / name
    target = root / f"{name}.so"
    if not target.exists():
        cxx = os.environ.get("CXX") or next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)
        if cxx is None:
            raise OSError("no C++ compiler (c++, g++, clang++ or $CXX)")
        root.mkdir(parents=True, exist_ok=True)
        includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
        libs = cpp_extension.library_paths()
        abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            out = Path(tmp) / target.name
            errors = []
            for std in ("c++20", "c++17"):  # torch's own standard differs between releases
                cmd = [cxx, f"-std={std}", "-O2", "-shared", "-fPIC", f"-DTORCH_EXTENSION_NAME={name}",
                       f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *(f"-isystem{p}" for p in includes), str(_SOURCE),
                       *(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs),
                       "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", "-o", str(out)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode == 0:
                    os.replace(out, target)  # atomic: concurrent builds leave one complete file
                    break
                errors.append(proc.stderr[-2000:])
            else:
                raise OSError(f"{cxx} failed: {errors[-1]}")
    spec = importlib.util.spec_from_file_location(name, target,
                                                  loader=importlib.machinery.ExtensionFileLoader(name, str(target)))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _no_cuda(*_):
    raise RuntimeError("this torch build has no CUDA")


def adopt(name: str, args: tuple, plan) -> bool:
    """Register `plan` for calls of op `name` with the signature of `args` (the public call's arguments, backend
    last) when the extension can run it; False (and REFUSALS[name] says why) otherwise."""
    if os.environ.get(NATIVE_ENV) == "0":
        return False
    mod = module()
    if mod is None:
        REFUSALS[name] = "the native replay extension is unavailable"
        return False
    try:
        kept = mod.register(name, tuple(args), describe(plan))
    except Exception as exc:  # NoNative, or what the extension refused (no driver): the Python path serves it
        REFUSALS[name] = str(exc) if isinstance(exc, NoNative) else f"{type(exc).__name__}: {exc}"
        log.debug("lowbit native replay: none for %s: %s", name, REFUSALS[name])
        return False
    REFUSALS[name] = None if kept else "the call's arguments have no native key"
    if kept:
        ADOPTED[name] = plan
    return kept


def planned(name: str, args: tuple) -> bool:
    """Whether a call of op `name` with these arguments (backend last) replays natively."""
    mod = _state["module"]
    return mod is not None and mod.lookup(name, tuple(args))


def clear() -> None:
    ADOPTED.clear()
    if _state["module"] is not None:
        _state["module"].clear()


def block_layout(allocs: list) -> tuple[list[int], int, int]:
    """Where a call's allocations go: (byte offset of each in the call's one block, -1 where it is allocated alone;
    the block's bytes; how many bytes from the block's start are zeroed).

    Allocations of at most BLOCK_MEMBER_MAX bytes share the block (when there are two or more): each at a
    BLOCK_ALIGN (256) byte aligned offset (every dtype's alignment, and what the caching allocator gives a tensor
    of its own), none overlapping another, the zero-filled ones first so that one memset clears them all (the
    padding between them included). Each is a tensor of its own on the block's storage (own metadata and version
    counter): torch semantics are those of separate allocations, except that the memory is returned when the last
    of them dies (an output kept alive keeps the block, small allocations only, alive; record_stream on one
    records the block), and an in-place `resize_` of an output to more elements would reach into the next
    allocation's bytes (as for any view; torch's out= ops warn before resizing a non-empty output): outputs are
    not to be grown in place. Larger allocations (prefill shapes) keep an allocation of their own."""
    sizes = [launch_plan._alloc_bytes(a) for a in allocs]
    members = [j for j, n in enumerate(sizes) if n <= BLOCK_MEMBER_MAX]
    offsets = [-1] * len(allocs)
    if len(members) < 2:
        return offsets, 0, 0
    at = zero_end = 0
    for j in sorted(members, key=lambda j: not allocs[j].zero):  # zero-filled first, else in plan order
        offsets[j] = at
        at += -(-max(sizes[j], 1) // BLOCK_ALIGN) * BLOCK_ALIGN
        if allocs[j].zero:
            zero_end = at
    return offsets, at, zero_end


def describe(plan) -> tuple:
    """The extension's description of a LaunchPlan: (device type, device index, allocations, launches, outputs,
    what to keep alive, block bytes, zeroed block bytes). Raises NoNative for what the extension cannot
    replicate."""
    offsets, block_bytes, block_zero = block_layout(plan.allocs)
    allocs = []
    for a, offset in zip(plan.allocs, offsets, strict=True):
        copy = None
        if a.copy_from is not None:
            index, (shape, stride, rel, _dtype) = a.copy_from
            copy = (index, tuple(shape), tuple(stride), rel)
        allocs.append((tuple(a.shape), tuple(a.stride), a.dtype, bool(a.zero), copy, offset,
                       launch_plan._alloc_bytes(a)))
    launches = [_describe_cute(launch) if launch[0] == launch_plan.CUTE else _describe_launch(launch, compiled)
                for launch, compiled in zip(plan.launches, plan.kernels, strict=True)]
    device = plan.device
    index = device.index if device.index is not None else 0
    return (device.type, index, allocs, launches, _describe_out(plan.outputs), plan, block_bytes, block_zero)


def param_codes(compiled) -> bytes:
    """The parameter type codes of a compiled kernel's non-constexpr parameters, as its launcher packs them."""
    launcher = compiled.run
    sig = list(compiled.src.signature.values())
    if any(not isinstance(t, str) or t.startswith(("tensordesc", "nvTmaDesc")) for t in sig):
        raise NoNative("a tuple or tensor-descriptor parameter")
    kernel_sig = [t for t in sig if t != "constexpr"]
    codes = getattr(launcher, "kernel_signature", None)
    if codes is not None:  # Triton's C launcher with extractor indices (3.7+)
        codes = bytes(codes)
        if len(codes) != len(kernel_sig):
            raise NoNative("the launcher's parameter list differs from the kernel's signature")
    else:  # the generated launcher (3.6): C types from the signature strings
        codes = bytes(_code_36(t) for t in kernel_sig)
    if any(not PTR <= c <= 13 for c in codes):
        raise NoNative("a parameter type the native launcher does not pack")
    return codes


def _code_36(ty: str) -> int:
    """The packing code of a Triton 3.6 signature type string."""
    code = PTR if ty.startswith("*") else _CODES_36.get(ty)
    if code is None:
        raise NoNative(f"a parameter of type {ty}")
    return code


def _describe_launch(launch, compiled) -> tuple:
    _run, function, metadata, grid, specs = launch
    if compiled is None or getattr(compiled, "src", None) is None or not hasattr(compiled.src, "signature"):
        raise NoNative("no compiled kernel source signature")
    launcher = compiled.run
    for attr in ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid", "gsan_enabled"):
        if getattr(launcher, attr, 0) or getattr(compiled.metadata, attr, 0):
            raise NoNative(f"the kernel needs {attr}")
    if not (isinstance(metadata, tuple) and len(metadata) == 3 and all(isinstance(m, int) for m in metadata)):
        raise NoNative(f"kernel metadata {metadata!r} is not (num_warps, num_ctas, shared)")
    num_warps, num_ctas, shared = metadata
    sig = list(compiled.src.signature.values())
    if len(sig) != len(specs):
        raise NoNative("the launch's arguments differ from the kernel's signature")
    if any(isinstance(t, str) and t.startswith("tensordesc") for t in sig):
        codes, values, slots, tma = _with_descriptors(compiled, sig, specs)
    else:
        codes, tma = param_codes(compiled), []
        values, slots = _plain_params(codes, sig, specs)
    gx, gy, gz = grid
    pdl = bool(getattr(launcher, "launch_pdl", False) or getattr(compiled.metadata, "launch_pdl", False))
    return (int(function), gx, gy, gz, num_warps, num_ctas, shared, pdl, codes, values, slots, tma)


def _plain_params(codes: bytes, sig, specs) -> tuple[list, list]:
    """(values, pointer slots) of a launch whose parameters (packing `codes`) are pointers and scalars."""
    values, slots = [], []
    for spec, ty in zip(specs, sig, strict=True):
        if ty != "constexpr":
            _add_param(codes[len(values)], ty, spec, values, slots)
    return values, slots


def _add_param(code: int, ty: str, spec, values: list, slots: list) -> None:
    """Appends a pointer (a slot filled per call) or scalar parameter of type code `code`."""
    if spec[0] in ("input", "alloc"):
        if code != PTR:
            raise NoNative(f"a tensor passed as a {ty} parameter")
        slots.append((len(values), spec[0] == "input", spec[1], spec[2]))
        values.append(0)
        return
    if spec[0] != "const":
        raise NoNative(f"a {spec[0]} argument for a {ty} parameter")
    value = spec[1]
    ok = (value is None or isinstance(value, int)) if code == PTR else (
        isinstance(value, (int, float)) if code in _FLOAT_CODES else isinstance(value, int))
    if not ok:
        raise NoNative(f"a {type(value).__name__} value for a {ty} parameter")
    values.append(value)


def _with_descriptors(compiled, sig, specs) -> tuple:
    """(codes, values, pointer slots, tensor-descriptor slots) of a launch with host tensor descriptors, as Triton
    3.6's generated launcher expands them: each descriptor the kernel takes as a TMA descriptor becomes a
    CUtensorMap (encoded per call from the base address; here its fixed encoding arguments, innermost dimension
    first, as fillTMADescriptor orders them), then its shape (i32 each) and strides (i64 each)."""
    if getattr(compiled.run, "kernel_signature", None) is not None:
        raise NoNative("tensor descriptors with this Triton's launcher (the native replay follows Triton 3.6's)")
    metas = list(getattr(compiled.metadata, "tensordesc_meta", None) or [])
    codes, values, slots, tma = [], [], [], []
    n_desc = 0
    for spec, ty in zip(specs, sig, strict=True):
        if not (isinstance(ty, str) and ty.startswith("tensordesc")):
            if ty != "constexpr":
                code = _code_36(ty)
                codes.append(code)
                _add_param(code, ty, spec, values, slots)
            continue
        meta = metas[n_desc] if n_desc < len(metas) else None
        n_desc += 1
        if meta is None or spec[0] != "desc":
            raise NoNative("a tensor descriptor the kernel takes as a pointer, or another argument for one")
        _, kind, index, template, view = spec
        shape, strides = [int(d) for d in template.shape], [int(d) for d in template.strides]
        if meta.get("fp4_padded"):
            shape[-1] *= 2
        if strides[-1] != 1 or not 1 <= len(shape) <= 5:
            raise NoNative("a tensor descriptor with a non-unit inner stride or rank > 5")
        elem = int(meta["elem_size"])
        offset = 0 if view is None else view[2] * view[3].itemsize
        fill = 1 if getattr(template, "padding", "zero") == "nan" else 0
        tma.append((len(values), kind == "input", index, offset,
                    _TMA_DTYPE_DEVICE_TO_HOST.get(int(meta["elem_type"]), int(meta["elem_type"])),
                    int(meta["swizzle"]), fill, shape[::-1], [elem * st for st in strides[-2::-1]],
                    [int(b) for b in meta["block_size"]][::-1]))
        codes += [TMA] + [I32] * len(shape) + [I64] * len(strides)
        values += [0, *shape, *strides]
    if n_desc != len(metas):
        raise NoNative("the kernel's tensor-descriptor metadata differs from its descriptor parameters")
    return bytes(codes), values, slots, tma



def _describe_cute(launch) -> tuple:
    """("cute", the function's TVM-FFI handle, [argument]) of a CuTe call (dispatch/_replay_cute.h `parse_cute`)."""
    _, fn, _, _, specs = launch
    if not _tvm_ffi_loaded():
        raise NoNative(f"libtvm_ffi is not loaded into the extension ({_state.get('tvm_ffi_why')})")
    import tvm_ffi

    if not isinstance(fn, tvm_ffi.Function):
        raise NoNative(f"a compiled CuTe function of type {type(fn).__name__}, not a tvm_ffi.Function")
    args = []
    for spec in specs:
        if spec[0] == "const":
            v = spec[1]
            args.append((FFI_NONE,) if v is None else (FFI_BOOL, int(v)) if isinstance(v, bool) else
                        (FFI_INT, v) if isinstance(v, int) else (FFI_FLOAT, v))
            continue
        kind, index, offset, (shape, strides, dtype) = spec
        if dtype not in DL_DTYPES:
            raise NoNative(f"a CuTe call tensor of dtype {dtype}")
        args.append((FFI_DLTENSOR, kind == "input", index, offset, tuple(shape), tuple(strides), *DL_DTYPES[dtype]))
    return ("cute", fn.__chandle__(), args)


def _tvm_ffi_loaded() -> bool:
    """Whether the extension holds libtvm_ffi's entry points (opened once: the library the tvm_ffi package
    loaded); `_state["tvm_ffi_why"]` says why not."""
    if _state.get("tvm_ffi") is None:
        _state["tvm_ffi"], _state["tvm_ffi_why"] = False, "the tvm_ffi package is not importable"
        try:
            path = _libtvm_ffi_path()
            _state["tvm_ffi"] = bool(module().init_tvm_ffi(path))
            _state["tvm_ffi_why"] = None if _state["tvm_ffi"] else f"{path} or a C ABI symbol did not load"
        except Exception as exc:  # no tvm_ffi, no library: the prepared launchers serve the CuTe rows
            _state["tvm_ffi_why"] = f"{type(exc).__name__}: {exc}"
    return _state["tvm_ffi"]


def _libtvm_ffi_path() -> str:
    """The libtvm_ffi.so this process loaded with the tvm_ffi package (the compiled CuTe functions use that one's
    environment streams and error state), else the one tvm_ffi's own lookup finds."""
    from tvm_ffi import libinfo  # importing tvm_ffi loads its library

    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(None, 5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libtvm_ffi.so"):
                    return fields[5].strip()
    except OSError:  # not Linux: the lookup below
        pass
    return libinfo.find_libtvm_ffi()


def _describe_out(spec) -> tuple:
    kind = spec[0]
    if kind == "tuple":
        return ("tuple", tuple(_describe_out(s) for s in spec[1]))
    if kind == "const":
        return spec
    if spec[2] is None:
        return (kind, spec[1])
    if kind != "alloc":
        raise NoNative("an output view of an input")
    shape, stride, offset, dtype = spec[2]
    return ("view", spec[1], tuple(shape), tuple(stride), offset, dtype)
