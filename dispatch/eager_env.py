"""The environment every eager call's signature key reads: the eager fast path's key (dispatch/ops/_common.py
`_signature`) and the native replay's (dispatch/_replay.cpp, given these names by dispatch/native_replay.py) read
the same names, so both modules import them from here and neither imports the other for them."""

from __future__ import annotations

from triton_ops.contract.arch import ARCH_ENV, env_reader

from .launch_plan import PLANS_ENV
from .registry import BACKEND_ENV

# Environment that select() or a backend's refusal reads on every call (tests and users flip these at runtime).
# The last one turns on value checks that sync (ops/rope.py): while it is set, every call takes the checked path.
SELECT_ENV = (BACKEND_ENV, ARCH_ENV, "TRITON_INTERPRET", "LOWBIT_CUTE_UNVERIFIED", PLANS_ENV, "LOWBIT_CHECK_INDICES")
read_select_env = env_reader(*SELECT_ENV)
