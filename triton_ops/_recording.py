"""The recording scope of kernel launches (no Triton import): every lowbit launch, Triton (triton_ops._launch) or
CuTeDSL (cute_ops._compile), appends its record to the current scope, so one scope sees both kinds in call order;
eager launch plans (dispatch/launch_plan.py) are derived from it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# The records of the current `recording_launches()` scope (a context variable: per thread / task, like
# dispatch.use_backend); None outside one.
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("lowbit_launch_recording", default=None)


def note(record) -> None:
    """Append `record` (a triton_ops._launch.LaunchRecord or a cute_ops._compile.CuteCall) to the current scope."""
    recording = _RECORDING.get()
    if recording is not None:
        recording.append(record)


@contextlib.contextmanager
def recording_launches() -> Iterator[list]:
    """Collect the records of every launch inside the block (nested scopes each see their own)."""
    records: list = []
    token = _RECORDING.set(records)
    try:
        yield records
    finally:
        _RECORDING.reset(token)
