"""The recording scope of kernel launches and the records it holds (no Triton, no CuTeDSL import): every lowbit
launch, Triton (`triton_ops._launch.launch`: a `LaunchRecord`) or CuTeDSL (`cute_ops._compile.launch`: a
`CuteCall`), appends its record to the current scope, so one scope sees both kinds in call order; eager launch
plans (dispatch/launch_plan.py) are derived from it. Both backends import this module and neither imports the
other."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator

# The records of the current `recording_launches()` scope (a context variable: per thread / task, like
# dispatch.use_backend); None outside one.
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("lowbit_launch_recording", default=None)


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """One Triton kernel launch as `triton_ops._launch.launch` saw it: what an eager launch plan replays."""

    kernel: object  # the JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    compiled: object  # the CompiledKernel the launch ran (None under the interpreter)


@dataclasses.dataclass(frozen=True)
class CuteCall:
    """One call of a compiled CuTeDSL function as `cute_ops._compile.launch` saw it: what an eager launch plan
    replays, natively through the TVM-FFI C ABI."""

    fn: Callable  # the compiled function (a tvm_ffi.Function, or cute.compile's wrapper around one)
    args: tuple


def note(kind: type[LaunchRecord] | type[CuteCall], *fields) -> None:
    """Append the record kind(*fields) to the current scope. Outside one nothing is built: every eager launch calls
    this, and a record (a frozen dataclass) costs about a microsecond to make."""
    recording = _RECORDING.get()
    if recording is not None:
        recording.append(kind(*fields))


@contextlib.contextmanager
def recording_launches() -> Iterator[list]:
    """Collect the records of every launch inside the block (nested scopes each see their own)."""
    records: list = []
    token = _RECORDING.set(records)
    try:
        yield records
    finally:
        _RECORDING.reset(token)
