"""Which machine are we on? Resolved once per device, with an env override.

Nothing here runs at import time: `resolve_arch()` is called lazily (by the dispatcher on the first op call,
or by `python -m dispatch`). `LOWBIT_ARCH=sm_100` makes a CPU machine *describe* itself as that GPU (to
print its table or compile CuTe kernels for it); it never changes where tensors live.
"""

from __future__ import annotations

import functools
import os

import torch

ARCH_ENV = "LOWBIT_ARCH"

# Every arch the table knows about, oldest first. "cpu" is a pseudo-arch: tensors on the host. Blackwell: sm_100 /
# sm_103 (B200 / B300), sm_120 (RTX 50xx, RTX PRO 6000), sm_121 (GB10, DGX Spark); what ran where: docs/blackwell.md.
KNOWN_ARCHS = ("cpu", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "sm_121")
GPU_ARCHS = KNOWN_ARCHS[1:]


def normalize_arch(name: str) -> str:
    """'sm_90a' / 'SM90' / '90' -> 'sm_90'. The 'a' (arch-specific features) is a compile-target detail."""
    s = name.strip().lower()
    if s == "cpu":
        return s
    s = s.removeprefix("sm_").removeprefix("sm").rstrip("af")
    if not s.isdigit():
        raise ValueError(f"{ARCH_ENV}: cannot parse arch {name!r}; expected e.g. 'cpu', 'sm_90', 'sm_100a' "
                         f"(lowbit supports {', '.join(KNOWN_ARCHS)})")
    return f"sm_{s}"


def arch_at_least(arch: str, minimum: str) -> bool:
    if arch == "cpu" or minimum == "cpu":
        return arch == minimum
    return int(arch[3:]) >= int(minimum[3:])


@functools.cache
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}"


def device_index(device: torch.device) -> int:
    """The CUDA device index of `device` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def arch_of(device: torch.device) -> str:
    """The arch that runs work on `device`. The env override applies to CUDA devices and to the
    machine description (`resolve_arch`), never to host tensors."""
    if device.type != "cuda":
        return "cpu"
    override = os.environ.get(ARCH_ENV)
    if override:
        return normalize_arch(override)
    return _cuda_arch(device_index(device))


def resolve_arch() -> str:
    """This machine's arch: the override, else the current CUDA device, else 'cpu'."""
    override = os.environ.get(ARCH_ENV)
    if override:
        return normalize_arch(override)
    if torch.cuda.is_available():
        return _cuda_arch(torch.cuda.current_device())
    return "cpu"


def env_reader(*names: str):
    """A function returning the raw values of env vars `names` (None where unset), cheap enough for per-call
    cache keys: os.environ.get of a missing key costs ~2 us (it raises and catches KeyError inside); the raw
    mapping under os.environ, which its setters (and so monkeypatch and users) keep in sync, costs ~0.1 us.
    When none of them is set (the usual case) it returns None after one C-level set test (~0.35 us on the CI
    host against ~0.75 for reading five keys)."""
    raw = getattr(os.environ, "_data", None)
    if raw is None:  # not CPython's _Environ: the public, slower path
        return lambda: tuple(map(os.environ.get, names))
    keys = tuple(os.environ.encodekey(name) for name in names)
    key_set = frozenset(keys)
    present = raw.keys()
    return lambda: None if present.isdisjoint(key_set) else tuple(map(raw.get, keys))


@functools.cache
def sm_count(index: int) -> int:
    """Streaming multiprocessors of CUDA device `index` (a device property: looked up once per device)."""
    return torch.cuda.get_device_properties(index).multi_processor_count
