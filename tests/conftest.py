"""Test configuration shared by every op family.

* No GPU: Triton kernels run under the interpreter (TRITON_INTERPRET=1, set here before any kernel module
  is imported). Tests parametrized over `DEVICES` run on "cpu" by default; the "cuda" params carry the
  `gpu` marker (run them on the device machine with `-m gpu`).
* Hypothesis profiles: "ci" (default; derandomized, 8 examples, sized for 2 CPU cores), "gpu" (sized for one device
  call), "gpu-exhaustive" (150 examples per test), "dev" (random, for local bug hunting). Select with
  HYPOTHESIS_PROFILE.
* `slow`: long property runs, skipped unless `--run-slow` (or LOWBIT_SLOW=1); the default run keeps the pinned
  edge cases and a short derandomized property pass of every family.
* Poison: every test runs with torch's fill_uninitialized_memory on, so torch.empty outputs start as NaN
  (floats) or the max integer: an output element a kernel forgets to write cannot look right.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per xdist worker: the workers already take every core (the interpreter and the
    # compilers are single-threaded), and torch's pool on top of them only oversubscribes.
    torch.set_num_threads(1)

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

# No "explain" phase: it re-runs a failing example under a line tracer, which makes the Triton
# interpreter take many minutes; the shrunk example and its reproduce blob are enough.
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])
settings.register_profile("ci", max_examples=8, derandomize=True, **_common)
# "gpu" is sized so the whole `-m gpu` suite runs in one 10-minute device call from a cold compile cache (most of
# its time is Triton compiling one kernel per drawn constexpr combination); "gpu-exhaustive" is the long opt-in.
settings.register_profile("gpu", max_examples=12, derandomize=True, **_common)
settings.register_profile("gpu-exhaustive", max_examples=150, derandomize=True, **_common)
settings.register_profile("dev", max_examples=200, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def poison_uninitialized_memory():
    """torch.empty -> NaN / max-int filled (torch.utils.deterministic.fill_uninitialized_memory)."""
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(prev, warn_only=prev_warn)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=os.environ.get("LOWBIT_SLOW") == "1",
                     help="also run the long property runs marked `slow` (or set LOWBIT_SLOW=1)")


def pytest_configure(config):
    if config.getoption("--run-slow"):
        os.environ["LOWBIT_SLOW"] = "1"  # read at import by tests/helpers.py (example counts, compile targets)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--run-slow"):
        skip_slow = pytest.mark.skip(reason="long property run: opt in with --run-slow or LOWBIT_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
