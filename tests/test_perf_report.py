"""The dashboard's summary (perf/summary.py) over synthetic and committed records: auto's pick per device, its ratio
to the best peer and roof fraction, launch-bound cases labelled, regressions only for shipped backends (never the
reference backend), model-level and multi-GPU sections, and every in-page link resolving (perf/browser_check.py)."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest

from perf import browser_check, report, results, summary
from tests.test_perf_gate import _rec

REPO = Path(__file__).resolve().parent.parent
H200 = dict(device="NVIDIA H200", device_slug="nvidia-h200")


def _run(recs: list[dict], run_id: str, second: int, commit: str = "a" * 40, **meta) -> list[dict]:
    """The records as one run: its id, a timestamp `second` seconds into the day, its commit, other metadata."""
    out = copy.deepcopy(recs)
    for r in out:
        r.update(run_id=run_id, timestamp=f"2026-11-21T10:00:{second:02d}+00:00", git_commit=commit, **meta)
    return out


def _slow(recs: list[dict], provider: str, factor: float) -> list[dict]:
    out = copy.deepcopy(recs)
    for r in out:
        if r["provider"] == provider:
            for f in ("median_us", "p20_us", "p80_us"):
                r[f] *= factor
    return out


def _rms_norm_case(case: str, triton_us: float, cute_us: float | None, torch_us: float, liger_us: float,
                   graph_us: float | None = None) -> list[dict]:
    recs = [_rec("rms_norm", case, "lowbit:triton", triton_us), _rec("rms_norm", case, "lowbit:torch", torch_us),
            _rec("rms_norm", case, "liger", liger_us), _rec("rms_norm", case, "torch", torch_us)]
    if cute_us is None:
        recs.append(_rec("rms_norm", case, "lowbit:cute", 1.0, status="skipped", timing=None))
    else:
        recs.append(_rec("rms_norm", case, "lowbit:cute", cute_us))
    if graph_us is not None:
        recs.append(_rec("rms_norm", case, "lowbit:cute" if cute_us else "lowbit:triton", graph_us,
                         timing="cuda-graph"))
    return recs


def _summary(page: str) -> str:
    start = page.index('id="summary"')
    return page[start:page.index('class="muted footnote"', start)]


# ------------------------------------------------------------------------------------------------ regressions


def test_reference_backend_is_never_flagged():
    base = _run(_rms_norm_case("M=4096 K=7168 bf16", 30.0, 28.0, 100.0, 31.0), "r1", 1)
    slowed = _slow(_slow(_slow(base, "lowbit:torch", 3.0), "lowbit:triton", 1.10), "torch", 2.0)
    new = _run(slowed, "r2", 2)
    regs = summary.regressions(base + new, 0.05, 0.5)
    assert {k[3] for k in regs} == {"lowbit:triton"}
    gated = results.compare(base, new, providers="shipped")
    assert {c.key[3] for c in gated if c.verdict == "slower"} == {"lowbit:triton"}
    broken = _run(base, "r3", 3)
    for r in broken:
        if r["provider"] == "lowbit:torch":
            r.update(status="wrong", timing=None, median_us=None)
    assert not any(k[3] == "lowbit:torch" for k in summary.regressions(base + broken, 0.05, 0.5))
    page = report.render(base + new)
    box = page[page.index('id="regressions"'):page.index('<div class="card">', page.index('id="regressions"'))]
    assert "1 regression(s)" in box and "lowbit:triton" in box and "lowbit:torch" not in box


def test_regression_is_against_the_previous_run_of_the_same_case_with_commit_and_versions():
    quant = [_rec("nvfp4_quantize", "M=4096 K=7168 bf16", "lowbit:triton", 40.0)]
    norm = _rms_norm_case("M=4096 K=7168 bf16", 30.0, 28.0, 100.0, 31.0)
    first = _run(quant + norm, "r1", 1, commit="1" * 40)
    only_quant = _run(quant, "r2", 2, commit="2" * 40)  # a later run of another op: not the norm's previous run
    newer = {"torch": "2.11.0", "triton": "3.7.0", "cutlass_dsl": None, "liger": "0.8.5"}
    norm_slow = _run(_slow(norm, "lowbit:cute", 1.2), "r3", 3, commit="3" * 40, versions=newer)
    regs = summary.regressions(first + only_quant + norm_slow, 0.05, 0.5)
    (k, reg), = regs.items()
    assert k[1:] == ("rms_norm", "M=4096 K=7168 bf16", "lowbit:cute", "events")
    assert reg.base["run_id"] == "r1" and reg.ratio == pytest.approx(1.2)
    html = summary.regressions_html(regs, 0.05, 0.5)
    assert "1111111111 → 3333333333" in html and "triton 3.6.0 → 3.7.0" in html


# ------------------------------------------------------------------------------------------------ summary


def test_auto_pick_per_device_from_the_table_or_the_record():
    prefill = _rms_norm_case("M=4096 K=7168 bf16", 30.0, 28.0, 100.0, 33.6)
    h100 = _run(_rms_norm_case("M=4096 K=7168 bf16", 30.0, None, 100.0, 33.0), "h1", 1)  # no cute there: triton
    h200 = _run(prefill, "h2", 2, **H200)
    recs = h100 + h200
    assert summary.auto_pick("rms_norm", "sm_90", h200) == ("lowbit:cute", "table")
    assert summary.auto_pick("rms_norm", "sm_90", h100) == ("lowbit:triton", "table")
    # the table's preference that auto may pass over at some shapes is marked
    cute = next(r for r in h200 if r["provider"] == "lowbit:cute")
    assert summary.auto_pick("rms_norm_nvfp4", "sm_90", [dict(cute, op="rms_norm_nvfp4")]) == \
        ("lowbit:cute", "table, shape-dependent")
    recorded = [dict(r, auto="triton") for r in h200]
    assert summary.auto_pick("rms_norm", "sm_90", recorded) == ("lowbit:triton", "recorded")
    top = _summary(report.render(recs))
    h100_part, h200_part = top.split("NVIDIA H200")[0], top.split("NVIDIA H200")[1]
    assert "NVIDIA H100" in h100_part and '<span class="pick">triton</span>' in h100_part
    assert '<span class="pick">cute</span>' in h200_part
    assert "1.20x vs best peer liger" in h200_part  # liger 33.6 us / cute 28 us, same run
    assert "1.10x vs best peer liger" in h100_part


def test_launch_bound_cases_are_labelled_not_given_a_roof_fraction():
    decode = _rms_norm_case("M=16 K=7168 bf16", 60.0, 55.0, 90.0, 70.0, graph_us=3.2)
    prefill = _rms_norm_case("M=4096 K=7168 bf16", 30.0, 28.0, 100.0, 31.0)
    for r in prefill:
        r["roofline_frac"] = 0.87
    by = summary.device_results([{"records": _run(decode + prefill, "r1", 1), "arch": "sm_90"}])
    (dec,), (pre,) = by[("rms_norm", "decode")], by[("rms_norm", "prefill")]
    assert dec.launch_bound and dec.gpu_us == 3.2 and dec.host_us == 55.0
    assert not pre.launch_bound and pre.roof == 0.87
    top = _summary(report.render(_run(decode + prefill, "r1", 1)))
    decode_cell, prefill_cell = re.findall(r'<a class="cell".*?</a>', top)
    assert "launch-bound ×1: GPU 3.2 us, eager 55.0 us" in decode_cell and "% roof" not in decode_cell
    assert "87% roof" in prefill_cell and "launch-bound" not in prefill_cell
    assert f"under {summary.LAUNCH_BOUND_US:.0f} us" in summary.FOOTNOTE


def test_summary_links_resolve_and_a_broken_one_is_caught():
    page = report.render(_run(_rms_norm_case("M=4096 K=7168 bf16", 30.0, 28.0, 100.0, 31.0), "r1", 1))
    links = re.findall(r'href="#([^"]*)"', _summary(page))
    assert "op-rms_norm" in links
    assert browser_check.summary_problems(page) == []
    broken = page.replace('href="#op-rms_norm"', 'href="#op-rms-norm"', 1)
    assert browser_check.summary_problems(broken) == ["link to #op-rms-norm has no element with that id"]
    assert browser_check.summary_problems(page.replace('id="summary"', 'id="top"')) != []


def test_page_works_without_results_and_without_model_or_multi_gpu_records():
    page = report.render([])
    assert 'id="summary"' in page and 'id="models"' not in page and 'id="multi-gpu"' not in page
    assert browser_check.summary_problems(page) == []


def _kind_rec(kind: str, op: str, case: str, provider: str, median_us: float, **extra) -> dict:
    r = _rec(op, case, provider, median_us)
    r.update(kind=kind, bucket="decode", **extra)
    return r


def test_model_and_multi_gpu_records_get_their_own_sections():
    model = [_kind_rec("model", "model:llama", "decode b=16 ctx=1024", "lowbit", 8000.0, tokens_per_s=2000.0),
             _kind_rec("model", "model:llama", "decode b=16 ctx=1024", "eager", 12000.0, tokens_per_s=1333.0)]
    multi = [_kind_rec("multi-gpu", "all_to_all", "8 GPUs 64 MiB", "lowbit", 400.0, gbps=320.0, world_size=8),
             _kind_rec("multi-gpu", "all_to_all", "8 GPUs 64 MiB", "nccl", 500.0, gbps=256.0, world_size=8)]
    ops = _rms_norm_case("M=4096 K=7168 bf16", 30.0, 28.0, 100.0, 31.0)
    recs = _run(ops + model + multi, "r1", 1)
    assert [results.section_of(r) for r in recs[-4:]] == ["model", "model", "multi-gpu", "multi-gpu"]
    page = report.render(recs)
    models = page[page.index('id="models"'):page.index('id="multi-gpu"')]
    assert "model:llama" in models and "1.50x" in models and "2000" in models
    gpus = page[page.index('id="multi-gpu"'):page.index('id="regressions"')]
    assert "all_to_all" in gpus and "1.25x" in gpus and "320" in gpus
    assert page.index('id="models"') < page.index('id="regressions"') < page.index('id="op-rms_norm"')
    assert 'id="op-model:llama"' not in page and 'id="op-all_to_all"' not in page
    assert "model:llama" not in _summary(page)
    later = _run(_slow(model, "lowbit", 2.0) + _slow(multi, "lowbit", 2.0), "r2", 2)
    assert summary.regressions(recs + later, 0.05, 0.5) == {}  # not op records: not in the op gate


# ------------------------------------------------------------------------------------------------ committed


def _committed() -> list[dict]:
    paths = sorted((REPO / "perf" / "results").glob("*.jsonl"))
    if not paths:
        pytest.skip("no committed GPU results under perf/results/")
    return results.load(paths)


def test_committed_records_summary():
    recs = _committed()
    page = report.render(recs)
    top = _summary(page)
    for device in {r["device"] for r in recs}:
        assert f"<h3>{device} " in top
    for op in {r["op"] for r in recs if results.section_of(r) == "op"}:
        assert f'<th><a href="#op-{op}">{op}</a></th>' in top
    assert not any(k[3] in results.REFERENCE_BACKENDS for k in summary.regressions(recs, 0.05, 0.5))
    assert browser_check.summary_problems(page) == []
    # H200 nvfp4_quantize prefill: the roof fraction comes from graph replay (0.6+), not CUDA events
    h200 = [r for r in recs if r["device_slug"] == "nvidia-h200"]
    if h200:
        runs = report._by_device_runs(h200)["nvidia-h200"]
        pre = summary.device_results(runs)[("nvfp4_quantize", "prefill")]
        assert all(c.auto == "lowbit:triton" for c in pre)
        assert sorted(c.roof for c in pre)[len(pre) // 2] > 0.5
        assert all(c.launch_bound for c in summary.device_results(runs)[("nvfp4_quantize", "decode")])


@pytest.mark.skipif(shutil.which("chromium") is None, reason="no chromium on PATH (apt-get install chromium)")
def test_browser_check_renders_the_committed_page(tmp_path):
    page = tmp_path / "index.html"
    report.write(_committed(), page)
    shot = tmp_path / "dash.png"
    assert browser_check.check(page, shot, require_results=False) == []
    assert shot.stat().st_size > 0
