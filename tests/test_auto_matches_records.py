"""`backend="auto"` against the committed benchmark records (perf/auto_choice.py): for every case a run timed two or
more shipped backends on (the latest such run per device file), auto's choice at that case's shape on the record's
arch is not more than 3% slower than the fastest of them under every timing the run took. No GPU: the choice is
the dispatch table's, on fake CUDA tensors of the case's shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perf import results
from perf.auto_choice import TOLERANCE, Comparison, case_index, check, choices, comparisons, verdict

# The device files holding op benchmarks (a file of only model-level or multi-GPU records compares no op backends).
RECORD_FILES = sorted(p for p in results.RESULTS_DIR.glob("*.jsonl")
                      if any(results.section_of(r) == "op" for r in results.load([p])))
COMPARISONS = [c for path in RECORD_FILES for c in comparisons(path)]
BF16_512 = "dsv3 gemm1 E=32 512 rows/expert N=4096 K=7168 bf16 contiguous"


def test_every_device_file_holds_comparisons():
    """The parametrized test below is not vacuous: each device's records compare backends, MoE GEMMs included."""
    assert {Path(c.path).name for c in COMPARISONS} == {p.name for p in RECORD_FILES} and len(RECORD_FILES) >= 2
    assert {c.op for c in COMPARISONS} >= {"moe_gemm_bf16", "moe_gemm_fp8", "rms_norm", "attention_prefill"}


@pytest.mark.parametrize("comparison", COMPARISONS, ids=lambda c: f"{Path(c.path).stem}:{c.op}:{c.case}")
def test_auto_is_not_slower_than_a_shipped_backend(comparison):
    why = check(comparison)
    if why is not None and "no benchmark case with this label" in why:
        pytest.skip(why)  # a record of a case since renamed or redefined: nothing today's rules can be held to
    assert why is None, why


def _record(run_id, stamp, provider, timing, us, case="M=16 N=7168 bf16", status="ok"):
    return {"run_id": run_id, "timestamp": stamp, "device": "NVIDIA H200", "arch": "sm_90", "op": "rms_norm",
            "case": case, "provider": provider, "timing": timing, "status": status, "median_us": us}


def test_comparisons_take_the_latest_run_that_compared_backends(tmp_path):
    path = tmp_path / "nvidia-h200.jsonl"
    rows = [_record("old", "2026-01-01T00:00", "lowbit:triton", "events", 9.0),
            _record("old", "2026-01-01T00:00", "lowbit:cute", "events", 5.0),
            _record("new", "2026-01-02T00:00", "lowbit:triton", "events", 4.0),
            _record("new", "2026-01-02T00:00", "lowbit:cute", "events", 3.0),
            _record("new", "2026-01-02T00:00", "lowbit:cute", "cuda-graph", 2.0),
            _record("new", "2026-01-02T00:00", "lowbit:torch", "events", 1.0),  # the reference: never a candidate
            _record("new", "2026-01-02T00:00", "liger", "events", 1.0),  # a peer
            _record("newest", "2026-01-03T00:00", "lowbit:triton", "events", 1.0),  # one backend: no comparison
            _record("newest", "2026-01-03T00:00", "lowbit:cute", "events", None, status="wrong")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (c,) = comparisons(path)
    assert (c.run_id, c.times) == ("new", {"events": {"triton": 4.0, "cute": 3.0}, "cuda-graph": {"cute": 2.0}})


def test_verdict_flags_only_a_choice_slower_under_every_timing():
    both = {"events": {"triton": 1971.0, "cute": 1571.0}, "cuda-graph": {"triton": 1960.0, "cute": 1560.0}}
    c = Comparison("perf/results/nvidia-h200.jsonl", "NVIDIA H200", "sm_90", "moe_gemm_bf16", BF16_512, "r1",
                   "2026-01-01T00:00", both)
    why = verdict(c, "triton")
    assert "moe_gemm_bf16" in why and BF16_512 in why and "NVIDIA H200" in why and "nvidia-h200.jsonl" in why
    assert "auto's triton 1971.0 us vs cute 1571.0 us" in why and "auto's triton 1960.0 us vs cute 1560.0 us" in why
    assert verdict(c, "cute") is None
    assert "did not time" in verdict(c, "torch")
    within = {"events": {"triton": 100.0, "cute": 100.0 * (1 + TOLERANCE) - 0.01}}
    assert verdict(Comparison(c.path, c.device, c.arch, c.op, c.case, "r", "t", within), "cute") is None
    # eager launch against kernel time: a trade-off, not a wrong choice, whichever way auto goes
    trade = {"events": {"triton": 100.0, "cute": 50.0}, "cuda-graph": {"triton": 40.0, "cute": 50.0}}
    trade_off = Comparison(c.path, c.device, c.arch, c.op, c.case, "r", "t", trade)
    assert verdict(trade_off, "triton") is None and verdict(trade_off, "cute") is None


@pytest.mark.parametrize("label, want", [
    (BF16_512, "cute"),
    ("dsv3 gemm2 E=32 512 rows/expert N=7168 K=2048 bf16 contiguous", "cute"),
    ("dsv3 gemm1 E=32 256 rows/expert N=4096 K=7168 bf16 contiguous", "cute"),
    ("dsv3 gemm2 E=32 256 rows/expert N=7168 K=2048 bf16 contiguous", "cute"),
    ("gpt-oss-120b gemm1 E=32 256 rows/expert N=5760 K=2880 bf16 contiguous", "cute"),
    ("dsv3 gemm1 E=32 128 rows/expert N=4096 K=7168 bf16 contiguous", "cute"),
    ("dsv3 gemm2 E=32 128 rows/expert N=7168 K=2048 bf16 contiguous", "cute"),
    ("dsv3 gemm1 E=256 16 rows/expert N=4096 K=7168 bf16 masked max_m=16", "triton"),
])
def test_moe_gemm_bf16_rule_on_sm90(label, want):
    """The bf16 rule through the real selection at the benchmark shapes: the CuTe kernel from 128 rows per expert
    at every K (faster than Triton under both timings on the H200, perf/results/nvidia-h200.jsonl), Triton
    at decode sizes."""
    auto, same_row = choices(case_index()[("moe_gemm_bf16", label)], "sm_90", {"triton", "cute"})
    assert auto == want and same_row == {"triton": want == "triton", "cute": want == "cute"}
