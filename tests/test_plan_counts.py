"""The plan census (dispatch/launch_plan.py `census`, `LaunchPlan.census`) and the CPU tool that prints it for the
eager cases (perf/plan_counts.py): what a call allocates, zeroes, copies and launches."""

from __future__ import annotations

import os

import pytest
import torch

from dispatch import launch_plan
from dispatch.selfcheck import all_cases
from perf import plan_counts
from tests.test_launch_plan_derive import NO_HOOKS, _FakeCompiled, _record


def _case(op: str, label: str = ""):
    return next(c for c in all_cases() if c.op == op and label in c.label)


def test_census_of_a_recorded_call_matches_its_plan():
    x = torch.randn(5, 8)
    out, launches, ops = _record(x, _FakeCompiled())
    counted = launch_plan.census(ops, launches)
    plan = launch_plan._derive(out, (x,), launches, ops, NO_HOOKS, device_type="cpu")
    assert counted["other_ops"] == []
    assert {k: counted[k] for k in ("allocs", "zero_fills", "copies", "launches")} == \
        {k: plan.census()[k] for k in ("allocs", "zero_fills", "copies", "launches")}
    assert counted["allocs"] == 2 and counted["zero_fills"] == 1 and counted["launches"] == 1
    assert plan.census()["alloc_bytes"] == sum(t.untyped_storage().nbytes() for t in out)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="counts CPU runs under the Triton interpreter (conftest turns it on where no GPU is)")
def test_counts_of_eager_cases_under_the_interpreter():
    """The interpreter's own copies are not counted: only what the backend's host code does."""
    two = plan_counts.case_counts(_case("nvfp4_quantize", "computed global scale"), torch.device("cpu"))
    assert two["launches"] == 2 and two["other_ops"] == [] and two["allocs"] >= 3  # global amax, then quantize
    one = plan_counts.case_counts(_case("rms_norm"), torch.device("cpu"))
    assert one["launches"] == 1 and one["copies"] == 0 and one["zero_fills"] == 0 and one["other_ops"] == []
    none = plan_counts.case_counts(_case("swizzle_scales_128x4"), torch.device("cpu"))
    assert "skipped" in none


@pytest.mark.gpu
def test_eager_breakdown_of_a_native_replay(monkeypatch):
    """perf.eager's breakdown of a natively replayed op: the census, the block layout, the host time split (every
    part measured) and the submit / GPU time per call. The Triton row is forced: with CuTeDSL installed auto takes
    the CuTe RMSNorm, whose prepared launcher is not a launch plan."""
    from perf import eager

    monkeypatch.setenv("LOWBIT_BACKEND", "triton")
    result = eager.run(["rms_norm"], ["all"])
    assert result["native_replay_built"] and result["breakdowns"]
    for name, parts in result["breakdowns"].items():
        assert "error" not in parts, f"{name}: {parts}"
        assert parts["launches"] >= 1 and parts["allocs"] >= 1, name
        assert set(parts["us_split"]) == {"python_wrapper", "key_lookup", "allocs_outputs", "launches"}, name
        assert parts["us"]["call"] > 0 and parts["per_call_us"]["gpu"] > 0, name
