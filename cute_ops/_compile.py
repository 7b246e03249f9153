"""Compile-once cache for CuTeDSL kernels: in-memory dict + persistent on-disk object files.

`cute.compile`'s own cache is bypassed upstream for TVM-FFI functions (upstream: NVIDIA/cutlass#3398), and a
cold compile costs seconds, so lowbit owns the cache:

* key = (kernel name, the kernel's static config tuple, target arch). Batch size is never in the key:
  kernels compile with symbolic row counts (`cute.sym_int`), so one object serves every M.
* in-memory: a dict per process, consulted first (a hit costs one dict lookup).
* on disk: `<cache dir>/<fingerprint>/<sha256(key)>.o`, written with `export_to_c` and read with
  `cute.runtime.load_module(..., enable_tvm_ffi=True)`. The fingerprint hashes every cute_ops source file,
  the cutlass-dsl and tvm-ffi versions and the Python version, so editing a kernel or upgrading the
  toolchain never loads a stale object. Safe under concurrent processes: a per-key `flock` (shared to
  load, exclusive to compile), the compile runs under the exclusive lock (racing processes wait and
  then load instead of compiling the same key N times), and the object is written to a private temp file
  and renamed into place (a killed writer never leaves a truncated .o). An object that fails to load is
  deleted and recompiled.

Env: LOWBIT_CUTE_CACHE_DIR (default ~/.cache/lowbit/cute), LOWBIT_CUTE_DISK_CACHE=0 disables the disk side.
`CUTE_DSL_ARCH=sm_90a|sm_100a` picks the compile target on a machine without a GPU (CI).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from triton_ops.contract.arch import env_reader
from triton_ops.contract.recording import CuteCall, note

EXPORT_NAME = "func"
LOCK_TIMEOUT_S = 300.0  # a cold compile of one kernel takes a few seconds; this only bounds a stuck holder
ARCH_ENV = "CUTE_DSL_ARCH"


@dataclasses.dataclass
class CacheStats:
    compiles: int = 0
    disk_loads: int = 0
    memory_hits: int = 0
    compile_s: list[float] = dataclasses.field(default_factory=list)  # cold: trace + lower + ptxas (+ export)
    load_s: list[float] = dataclasses.field(default_factory=list)  # warm: load_module of the .o


STATS = CacheStats()
_memory: dict[tuple, Callable] = {}
_lock = threading.Lock()


_read_arch_env = env_reader(ARCH_ENV)


def arch_env() -> str | bytes | None:
    """The raw CUTE_DSL_ARCH value (cheap: for per-call cache keys)."""
    values = _read_arch_env()
    return None if values is None else values[0]


def target_arch(device_index: int | None = None) -> str:
    """The compile target: CUTE_DSL_ARCH if set (CPU CI), else the CUDA device's 'sm_XYa'."""
    env = os.environ.get(ARCH_ENV)
    if env:
        return env.strip().lower()
    # None = the current device, which can change: only explicit indices are cached
    return _device_arch(device_index) if device_index is not None else _device_arch.__wrapped__(None)


@functools.cache
def _device_arch(device_index: int | None) -> str:
    # cached: every eager launch asks (the capability query cost ~2 us per call)
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device and {ARCH_ENV} is unset: set {ARCH_ENV}=sm_90a or sm_100a to compile "
                           "CuTeDSL kernels on a machine without a GPU")
    major, minor = torch.cuda.get_device_capability(device_index)
    # 'a' = arch-specific features (wgmma/tcgen05/setmaxnreg); sm_8x has no 'a' variant
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def cache_dir() -> Path:
    root = os.environ.get("LOWBIT_CUTE_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "lowbit" / "cute"


def disk_enabled() -> bool:
    return os.environ.get("LOWBIT_CUTE_DISK_CACHE", "1") not in ("0", "false", "no")


@functools.cache
def fingerprint() -> str:
    """Hash of the cute_ops sources + toolchain versions: part of every on-disk path."""
    import cutlass

    try:
        import tvm_ffi

        tvm_version = tvm_ffi.__version__
    except Exception:  # noqa: BLE001 - tvm-ffi absent: the objects would not load anyway; still a distinct key
        tvm_version = "none"
    h = hashlib.sha256()
    h.update(f"py{sys.version_info.major}.{sys.version_info.minor}|cutlass={cutlass.__version__}|"
             f"tvm_ffi={tvm_version}".encode())
    root = Path(__file__).resolve().parent
    for src in sorted(root.rglob("*.py")):  # subpackages (gemm/, attention/) too
        data = src.read_bytes()
        h.update(src.name.encode() + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:24]


class _FileLock:
    def __init__(self, path: Path, exclusive: bool):
        self.path, self.exclusive, self.fd = path, exclusive, -1

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        mode = (fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, mode)
                return self
            except OSError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(f"lowbit cute cache: lock {self.path} held for over {LOCK_TIMEOUT_S}s") from None
                time.sleep(0.05)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _load(path: Path) -> Callable:
    import cutlass.cute as cute

    t0 = time.perf_counter()
    fn = cute.runtime.load_module(str(path), enable_tvm_ffi=True)[EXPORT_NAME]
    STATS.load_s.append(time.perf_counter() - t0)
    STATS.disk_loads += 1
    return fn


def _compile(build: Callable[[], Callable]) -> Callable:
    t0 = time.perf_counter()
    fn = build()
    STATS.compile_s.append(time.perf_counter() - t0)
    STATS.compiles += 1
    return fn


def object_path(key: tuple) -> Path:
    sha = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return cache_dir() / fingerprint() / f"{sha}.o"


def direct(fn: Callable) -> Callable:
    """The plain TVM-FFI function under a freshly compiled one, where calling it positionally is the same call:
    cute.compile returns a Python wrapper (keyword arguments and defaults, a per-call initialization check) around
    the `tvm_ffi.Function` that an object loaded from the disk cache already is; lowbit calls every compiled
    function positionally with all its arguments, so both sources give the same callable kind (the wrapper's
    Python costs ~1 us per call, measured on an empty kernel; docs/perf.md). Kept as it is where the wrapper converts
    pointer arguments."""
    inner = getattr(fn, "__tvm_ffi_object__", None)
    args = getattr(fn, "execution_args", None)
    if inner is None or args is None or getattr(args, "has_pointer_address_arg_specs", True):
        return fn
    raw = inner()
    return fn if raw is None else raw


def get_or_compile(key: tuple, build: Callable[[], Callable]) -> Callable:
    """The compiled function for `key` (a tuple of plain values whose repr is stable), compiling with
    `build()` (which must return `cute.compile(..., options='--enable-tvm-ffi ...')`) at most once; called
    positionally with all its arguments (`direct`)."""
    fn = _memory.get(key)
    if fn is not None:
        STATS.memory_hits += 1
        return fn
    with _lock:  # one compile per key per process, even from several threads
        fn = _memory.get(key)
        if fn is not None:
            return fn
        fn = direct(_get_or_compile_disk(key, build) if disk_enabled() else _compile(build))
        _memory[key] = fn
        return fn


def _get_or_compile_disk(key: tuple, build: Callable[[], Callable]) -> Callable:
    path = object_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.with_suffix(".lock")
    if path.exists():
        with _FileLock(lock_path, exclusive=False):
            if path.exists():
                try:
                    return _load(path)
                except Exception:  # noqa: BLE001 - a corrupt object is a miss: recompile below
                    pass
    with _FileLock(lock_path, exclusive=True):
        if path.exists():  # another process compiled it while we waited
            try:
                return _load(path)
            except Exception:  # noqa: BLE001 - corrupt: replace it
                path.unlink(missing_ok=True)
        fn = _compile(build)
        tmp = path.with_suffix(f".o.tmp{os.getpid()}")
        try:
            fn.export_to_c(object_file_path=str(tmp), function_name=EXPORT_NAME)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return fn


def clear_memory() -> None:
    """Forget in-process compiled functions (tests use it to measure the warm disk load)."""
    with _lock:
        _memory.clear()


# ------------------------------------------------------------------------------------------ recorded calls
def launch(fn: Callable, *args, device=None):
    """fn(*args): every call of a compiled function goes through here, so that a recording scope
    (triton_ops.contract.recording.recording_launches, the one the Triton launches join) sees each call with its
    exact arguments: an eager launch plan recorded around a call that ran one outside it would replay without it.
    device: the CUDA device of the call's tensors, made current around it where it is not (TVM-FFI's environment
    stream is the current device's)."""
    if device is not None and device.index is not None:
        import torch

        if device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                return launch(fn, *args)
    out = fn(*args)
    note(CuteCall, fn, args)
    return out
