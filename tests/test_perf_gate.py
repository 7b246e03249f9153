"""The perf layer on a CPU: the regression gate (`python -m perf compare`) on recorded-looking data, the
dashboard built from it, and the runner end to end on one op in --quick mode.

"Deliberately slowed kernel": we take a run's records (the committed GPU history when there is one, else
records shaped exactly like a GPU run's), slow one lowbit case by 10% and check the gate names it; a 3%
wobble, a sub-noise-floor change and a slower *peer* must pass.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from perf import report, results, runner
from perf.__main__ import main as perf_main

REPO = Path(__file__).resolve().parent.parent


def _rec(op, case, provider, median_us, run_id="r1", status="ok", timing="events", device="nvidia-h100-80gb-hbm3"):
    return dict(schema=1, run_id=run_id, timestamp=f"2026-11-21T10:00:0{run_id[-1]}+00:00", git_commit="0" * 40,
                git_dirty=False, device="NVIDIA H100 80GB HBM3", device_slug=device, arch="sm_90",
                versions=dict(torch="2.11.0", triton="3.6.0", cutlass_dsl=None, liger="0.8.5"),
                roofline=dict(copy_gbps=2900.0, bf16_tflops=700.0, fp8_tflops=1300.0, how="test"), quick=False,
                op=op, case=case, bucket="prefill" if "4096" in case else "decode", params={}, provider=provider,
                kind="lowbit" if provider.startswith("lowbit:") else "peer", timing=timing, status=status,
                note="", verified="passed", median_us=median_us, p20_us=median_us * 0.98,
                p80_us=median_us * 1.02, samples=30, calls_per_sample=1, bytes_moved=88_080_384, flops=0,
                gbps=88_080_384 / median_us / 1e3, tflops=None, roofline_frac=0.8, bound="memory",
                repro=f"python -m perf run --ops {op} --case '{case}' --providers {provider}")


def _recorded_run() -> list[dict]:
    return [
        _rec("nvfp4_quantize", "M=4096 K=7168 bf16", "lowbit:triton", 40.0),
        _rec("nvfp4_quantize", "M=4096 K=7168 bf16", "torch.compile", 52.0),
        _rec("nvfp4_quantize", "M=1 K=7168 bf16", "lowbit:triton", 4.0),
        _rec("nvfp4_quantize", "M=1 K=7168 bf16", "lowbit:triton", 2.1, timing="cuda-graph"),
        _rec("rms_norm", "M=4096 K=7168 bf16", "lowbit:triton", 30.0),
        _rec("rms_norm", "M=4096 K=7168 bf16", "liger", 31.0),
    ]


def _write(path: Path, recs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _slowed(recs: list[dict], pick, factor: float, run_id: str = "r2") -> list[dict]:
    out = copy.deepcopy(recs)
    for r in out:
        r["run_id"] = run_id
        r["timestamp"] = r["timestamp"].replace("T", "T2")  # later than the base run
        if pick(r):
            for f in ("median_us", "p20_us", "p80_us"):
                r[f] *= factor
    return out


def _gate(tmp_path, base, new, *extra) -> tuple[int, str]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = perf_main(["compare", str(_write(tmp_path / "base.jsonl", base)),
                        str(_write(tmp_path / "new.jsonl", new)), *extra])
    return rc, buf.getvalue()


def test_gate_catches_a_slowed_kernel(tmp_path):
    base = _recorded_run()
    new = _slowed(base, lambda r: r["op"] == "rms_norm" and r["provider"] == "lowbit:triton", 1.10)
    rc, out = _gate(tmp_path, base, new)
    assert rc == 1, out
    assert "REGRESSION" in out and "rms_norm [M=4096 K=7168 bf16] lowbit:triton" in out
    flagged = [ln for ln in out.splitlines() if "<-- REGRESSION" in ln]
    assert len(flagged) == 1, out  # only the slowed case


def test_gate_passes_within_noise(tmp_path):
    base = _recorded_run()
    wobble = _slowed(base, lambda r: r["provider"] == "lowbit:triton", 1.03)  # 3% < 5% threshold
    assert _gate(tmp_path, base, wobble)[0] == 0
    # 10% slower but only 0.21 us on a 2.1 us graph replay: under the 0.5 us noise floor.
    tiny = _slowed(base, lambda r: r["timing"] == "cuda-graph", 1.10)
    assert _gate(tmp_path, base, tiny)[0] == 0
    # ...unless the floor is lowered.
    assert _gate(tmp_path, base, tiny, "--noise-floor-us", "0.1")[0] == 1


def test_gate_ignores_peers_by_default(tmp_path):
    base = _recorded_run()
    new = _slowed(base, lambda r: r["provider"] in ("liger", "torch.compile"), 1.5)
    assert _gate(tmp_path, base, new)[0] == 0
    assert _gate(tmp_path, base, new, "--providers", "all")[0] == 1


def test_gate_catches_a_broken_kernel_and_threshold_option(tmp_path):
    base = _recorded_run()
    new = copy.deepcopy(base)
    new[0].update(status="wrong", error="AssertionError: 12 elements differ", median_us=None)
    rc, out = _gate(tmp_path, base, new)
    assert rc == 1 and "broken" in out
    slow8 = _slowed(base, lambda r: r["op"] == "nvfp4_quantize", 1.08)
    assert _gate(tmp_path, base, slow8)[0] == 1
    assert _gate(tmp_path, base, slow8, "--threshold", "0.10")[0] == 0


def test_gate_with_nothing_in_common_is_an_error(tmp_path):
    base = _recorded_run()
    other = [dict(r, device_slug="nvidia-h200") for r in base]
    assert _gate(tmp_path, base, other)[0] == 2


def test_gate_uses_newest_record_of_a_history_file(tmp_path):
    """BASE may be the committed append-only history: the newest record per case is the baseline."""
    old = _slowed(_recorded_run(), lambda r: True, 2.0, run_id="r0")
    for r in old:
        r["timestamp"] = "2026-11-01T00:00:00+00:00"
    history = old + _recorded_run()
    new = _slowed(_recorded_run(), lambda r: r["op"] == "nvfp4_quantize" and r["timing"] == "events", 1.2)
    rc, out = _gate(tmp_path, history, new)
    assert rc == 1 and out.count("<-- REGRESSION") == 2, out


def _committed_runs() -> list[Path]:
    return sorted((REPO / "perf" / "results").glob("*.jsonl"))


@pytest.mark.parametrize("path", _committed_runs() or [None], ids=lambda p: p.name if p else "none-committed")
def test_gate_on_committed_gpu_results(tmp_path, path):
    """The same check on the real recorded GPU history: slow its newest run's first lowbit case by 10%."""
    if path is None:
        pytest.skip("no committed GPU results under perf/results/ yet")
    recs = [r for r in results.load([path]) if results.section_of(r) == "op"]
    if not recs:
        pytest.skip(f"{path.name} holds no op benchmarks (model-level or multi-GPU records only)")
    newest = results.runs(recs)[-1]["run_id"]
    run = [r for r in recs if r["run_id"] == newest]
    victim = next(r for r in run if r["status"] == "ok" and r["provider"].startswith("lowbit:")
                  and r["median_us"] > 10)
    new = _slowed(run, lambda r: results.key(r) == results.key(victim), 1.10, run_id="slowed")
    rc, out = _gate(tmp_path, run, new)
    assert rc == 1 and out.count("<-- REGRESSION") == 1, out
    assert f"{victim['op']} [{victim['case']}] {victim['provider']}" in out
    assert _gate(tmp_path, run, _slowed(run, lambda r: False, 1.0, run_id="same"))[0] == 0


def test_dashboard_marks_the_regression(tmp_path):
    base = _recorded_run()
    new = _slowed(base, lambda r: r["op"] == "rms_norm" and r["provider"] == "lowbit:triton", 1.10)
    page = report.render(base + new)
    assert 'id="op-nvfp4_quantize"' in page and 'id="op-rms_norm"' in page
    assert "1 regression(s)" in page and 'class="regressed"' in page
    assert "python -m perf run --ops rms_norm" in page  # repro commands are on the page
    assert "<svg" in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # self-contained


# ------------------------------------------------------------------------------------------------- runner


def test_runner_quick_cpu_one_op(tmp_path):
    out = tmp_path / "cpu.jsonl"
    rc = perf_main(["run", "--ops", "fp8_group_quantize", "--quick", "--out", str(out)])
    assert rc == 0
    recs = results.load([out])
    by = {(r["provider"], r["status"]) for r in recs}
    assert ("torch", "ok") in by and ("lowbit:torch", "ok") in by
    assert ("lowbit:triton", "ok") in by  # tests run with TRITON_INTERPRET=1 on a CPU
    tri = next(r for r in recs if r["provider"] == "lowbit:triton")
    assert tri["note"] == "interpreter" and tri["verified"] == "passed" and tri["timing"] == "cpu-wallclock"
    assert tri["p20_us"] <= tri["median_us"] <= tri["p80_us"] and tri["gbps"] > 0
    assert tri["quick"] and tri["device_slug"].startswith("cpu") and "--quick" in tri["repro"]
    assert {"torch", "lowbit:torch"} <= set(tri["vs"])
    assert any(r["provider"] == "torch.compile" and r["status"] == "skipped" for r in recs)
    assert {r["auto"] for r in recs} == {"torch"}  # what auto chose for the case's inputs on a CPU (the table)


def test_runner_rejects_a_fast_wrong_answer():
    good = next(c for c in runner.load_cases(["fp8_group_quantize"]))
    import dataclasses

    def wrong(inputs, backend):
        q, s = good.lowbit(inputs, backend)
        return q, s * 2  # wrong scales, and nothing slower about it

    bad = dataclasses.replace(good, lowbit=wrong)
    recs = list(runner.run_case(bad, torch.device("cpu"), runner.Roofline(10.0, 0.1, None, "t"), True,
                                lambda p: p in ("lowbit:torch", "torch"), lambda m: None))
    low = next(r for r in recs if r["provider"] == "lowbit:torch")
    assert low["status"] == "wrong" and low.get("median_us") is None


def test_runner_verifies_in_place_ops_on_pristine_inputs():
    """Timing mutates the inputs of in-place ops; each provider must still be verified on unmutated ones
    (verified on the timing inputs, the second provider of an in-place op such as rope_ would look wrong)."""
    import dataclasses

    from perf.cases.base import BenchCase

    def make(device):
        return {"x": torch.arange(8.0, device=device)}

    def bump(i, backend="torch"):
        i["x"].add_(1)  # an in-place op
        return i["x"]

    def check(got, want):
        assert torch.equal(got, want), (got, want)

    case = BenchCase("rope_", "in-place toy", "decode", {}, make, bump, bump, check, bytes_moved=64)
    case = dataclasses.replace(case, compile_reference=False)
    recs = list(runner.run_case(case, torch.device("cpu"), runner.Roofline(10.0, 0.1, None, "t"), True,
                                lambda p: p in ("lowbit:torch", "lowbit:triton", "torch"), lambda m: None))
    verified = [r for r in recs if r["provider"].startswith("lowbit:")]
    assert {r["provider"] for r in verified} == {"lowbit:torch", "lowbit:triton"}
    assert all(r["status"] == "ok" for r in recs), [(r["provider"], r["status"], r.get("error")) for r in recs]


def test_time_passes_quantiles_cpu():
    x = torch.randn(1000)
    t = runner.time_passes(lambda a: a.sum(), [x, x.clone()], torch.device("cpu"), budget_s=0.01)
    assert t.calls_per_sample == 2 and t.samples >= runner.CPU_SAMPLES[0]
    assert 0 < t.p20_us <= t.median_us <= t.p80_us


def test_merge_is_idempotent_and_keeps_cpu_out(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS_DIR", tmp_path / "results")
    run = [dict(r, git_commit=None) for r in _recorded_run()]
    cpu = [dict(r, device_slug="cpu-x86-64") for r in _recorded_run()]
    src = _write(tmp_path / "fetched.jsonl", run + cpu)
    assert perf_main(["merge", str(src), "--commit", "abc123"]) == 0
    assert perf_main(["merge", str(src)]) == 0  # again: nothing new
    merged = results.load([tmp_path / "results"])
    assert len(merged) == len(run) and all(r["git_commit"] == "abc123" for r in merged)
    assert not (tmp_path / "results" / "cpu-x86-64.jsonl").exists()
