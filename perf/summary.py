"""The top of the dashboard: per device, what `backend="auto"` ships for each op and regime, held against the best
peer timed in the same run and against the roofline; the regressions of shipped backends; and the model-level and
multi-GPU sections (records of `kind` "model" / "multi-gpu", perf/results.py).

Per (op, case) the newest run of the device that measured the case is used; a cell of the summary table gathers an
op's cases of one regime (the case's `bucket`, see FOOTNOTE).
"""

from __future__ import annotations

import dataclasses
import html
import math
import statistics

from dispatch.describe import auto_candidates
from perf import results

E = html.escape
REGIMES = ("decode", "prefill")
# GPU time per call under which a case is launch-bound: a kernel that short is a few waves at most, and a launch (~2-5
# us on the device, more from the host) is the same order; a fraction of the roofline says nothing there.
LAUNCH_BOUND_US = 10.0

FOOTNOTE = (
    "<b>Regime</b>: the case's bucket, set in <code>perf/cases/&lt;family&gt;.py</code> from its shape: decode = at "
    "most 64 tokens (rows) per call (MoE GEMMs: at most 64 rows per expert; attention and MLA decode: one query per "
    "sequence against a cache), prefill = larger (4096 tokens and up). "
    "<b>auto</b>: the backend <code>backend=\"auto\"</code> chose for the case's inputs on that device (the record's "
    "<code>auto</code> field); records without it take the dispatch table's order for the device's arch "
    "(<code>python -m dispatch --arch sm_XX</code>: the highest-priority row whose backend was measured there), and "
    "† marks a row with a per-shape preference (<code>auto_skip</code>) that auto may pass over at that shape. "
    "<b>vs best peer</b>: the fastest non-lowbit provider (torch eager, torch.compile, Liger, FA4, FlashMLA, ...) "
    "of the same run and process, its median time over auto's, both with CUDA-event timing of back-to-back calls "
    "(peers are not graph-timed); &gt; 1: auto is faster; median over the cases, worst case beside it. "
    "<b>roof</b>: median fraction of the roofline measured in the same run, from CUDA-graph replay where the op has "
    "it (the kernel's time without host overhead), else CUDA events. "
    f"<b>launch-bound</b>: GPU time per call under {LAUNCH_BOUND_US:.0f} us (graph replay where measured); those "
    "cases are shown as their GPU time and the eager (events) time per call, host overhead included, not as a "
    "roofline fraction.")


def newest_cases(runs: list[dict]) -> dict[tuple[str, str], tuple[dict, list[dict]]]:
    """(op, case) -> (run, that case's records) from the newest run of the device that measured the case."""
    out: dict[tuple[str, str], tuple[dict, list[dict]]] = {}
    for run in runs:  # oldest first: newer runs overwrite
        by_case: dict[tuple[str, str], list[dict]] = {}
        for r in run["records"]:
            if results.section_of(r) == "op":
                by_case.setdefault((r["op"], r["case"]), []).append(r)
        for k, recs in by_case.items():
            out[k] = (run, recs)
    return out


def auto_pick(op: str, arch: str | None, recs: list[dict]) -> tuple[str | None, str]:
    """(auto's provider, how it is known): the record's `auto`, else the table's order for `arch` (see FOOTNOTE)."""
    recorded = next((r["auto"] for r in recs if r.get("auto")), None)
    if recorded:
        return f"lowbit:{recorded}", "recorded"
    measured = {r["provider"] for r in recs if r.get("status") != "skipped"}
    candidates = auto_candidates(op, arch or "")
    for backend, auto_skip in candidates:
        if f"lowbit:{backend}" in measured:  # a skipped backend is unavailable there: auto moves on as well
            return f"lowbit:{backend}", "table, shape-dependent" if auto_skip else "table"
    if candidates:  # the run measured none of them (e.g. --providers): the table's first choice, shown as missing
        backend, auto_skip = candidates[0]
        return f"lowbit:{backend}", "table, shape-dependent" if auto_skip else "table"
    return None, "table"


@dataclasses.dataclass(frozen=True)
class CaseResult:
    op: str
    case: str
    regime: str
    auto: str | None  # provider, e.g. "lowbit:triton"
    auto_source: str  # "recorded" | "table" | "table, shape-dependent"
    status: str  # auto's status ("ok", "wrong", "error", "not measured")
    host_us: float | None  # auto's events median: what a back-to-back eager caller gets
    gpu_us: float | None  # graph replay where measured, else the events median
    roof: float | None  # roofline fraction of the gpu_us timing
    peer: str | None  # the fastest peer (events)
    peer_ratio: float | None  # peer median / auto median (events): > 1, auto is faster

    @property
    def launch_bound(self) -> bool:
        return self.gpu_us is not None and self.gpu_us < LAUNCH_BOUND_US


def case_result(op: str, case: str, arch: str | None, recs: list[dict]) -> CaseResult:
    auto, source = auto_pick(op, arch, recs)
    mine = {r.get("timing"): r for r in recs if r["provider"] == auto}
    events, graph = mine.get("events"), mine.get("cuda-graph")
    failed = next((r for r in mine.values() if r.get("status") not in ("ok", "skipped")), None)
    status = "not measured" if events is None and graph is None and failed is None else (
        failed["status"] if failed is not None else "ok")
    ok = lambda r: r is not None and r.get("status") == "ok"
    gpu = graph if ok(graph) else (events if ok(events) else None)
    peers = [r for r in recs if not r["provider"].startswith("lowbit:") and r.get("timing") == "events" and ok(r)]
    best = min(peers, key=lambda r: r["median_us"], default=None)
    ratio = best["median_us"] / events["median_us"] if best is not None and ok(events) and events["median_us"] else None
    return CaseResult(op, case, recs[0].get("bucket") or "other", auto, source, status,
                      events["median_us"] if ok(events) else None, gpu["median_us"] if gpu else None,
                      gpu.get("roofline_frac") if gpu else None, best["provider"] if best else None, ratio)


def device_results(runs: list[dict]) -> dict[tuple[str, str], list[CaseResult]]:
    """(op, regime) -> the case results of the device's newest measurement of each case."""
    out: dict[tuple[str, str], list[CaseResult]] = {}
    for (op, case), (run, recs) in newest_cases(runs).items():
        cr = case_result(op, case, run.get("arch"), recs)
        out.setdefault((op, cr.regime), []).append(cr)
    return out


# ------------------------------------------------------------------------------------------------- cells


def _us(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else (f"{us:.1f} us" if us < 100 else f"{us:.0f} us")


def _span(values: list[float], fmt) -> str:
    lo, hi = min(values), max(values)
    return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)}–{fmt(hi)}"


def _pick_label(crs: list[CaseResult]) -> str:
    picks: dict[str, int] = {}
    for c in crs:
        name = (c.auto or "none").removeprefix("lowbit:") + ("†" if c.auto_source.endswith("dependent") else "")
        picks[name] = picks.get(name, 0) + 1
    if len(picks) == 1:
        return next(iter(picks))
    return " / ".join(f"{p} ×{n}" for p, n in sorted(picks.items(), key=lambda kv: -kv[1]))


def cell(op: str, crs: list[CaseResult]) -> str:
    """One summary cell: auto's pick, its ratio to the best peer, roof fraction or launch-bound times."""
    bits = [f'<span class="pick">{E(_pick_label(crs))}</span> <span class="muted">{len(crs)} case(s)</span>']
    bad = [c for c in crs if c.status != "ok"]
    if bad:
        bits.append(f'<span class="regtag">{len(bad)} {E("/".join(sorted({c.status for c in bad})))}</span>')
    ratios = [c for c in crs if c.peer_ratio is not None]
    if ratios:
        med = statistics.median(c.peer_ratio for c in ratios)
        worst = min(ratios, key=lambda c: c.peer_ratio)
        cls = "good" if worst.peer_ratio >= 1 else ("slow" if med < 1 else "")
        extra = f" (worst {worst.peer_ratio:.2f}x {E(worst.peer)})" if len(ratios) > 1 else f" {E(worst.peer)}"
        bits.append(f'<span class="{cls}">{med:.2f}x vs best peer{extra}</span>')
    else:
        bits.append('<span class="muted">no peer timed</span>')
    roofed = [c for c in crs if c.roof is not None and not c.launch_bound]
    if roofed:
        bits.append(f"{100 * statistics.median(c.roof for c in roofed):.0f}% roof"
                    + (f' <span class="muted">({len(roofed)} case(s))</span>' if len(roofed) != len(crs) else ""))
    launch = [c for c in crs if c.launch_bound]
    if launch:
        host = [c.host_us for c in launch if c.host_us is not None]
        bits.append(f'<span class="lb">launch-bound ×{len(launch)}: GPU {_span([c.gpu_us for c in launch], _us)}'
                    + (f", eager {_span(host, _us)}" if host else "") + "</span>")
    tip = "\n".join(f"{c.case}: {c.auto} ({c.auto_source}) {c.status}; GPU {_us(c.gpu_us) if c.gpu_us else '-'}, "
                    f"eager {_us(c.host_us) if c.host_us else '-'}"
                    + (", launch-bound" if c.launch_bound else (f", {100 * c.roof:.1f}% roof" if c.roof else ""))
                    + (f", {c.peer_ratio:.2f}x {c.peer}" if c.peer_ratio else "") for c in crs)
    return f'<a class="cell" href="#op-{E(op)}" title="{E(tip)}">' + "<br>".join(bits) + "</a>"


def device_table(ops: list[str], runs: list[dict]) -> str:
    """The summary table of one device: a row per op it has results for, a column per regime."""
    by = device_results(runs)
    regimes = [g for g in REGIMES if any(k[1] == g for k in by)] + sorted({k[1] for k in by} - set(REGIMES))
    rows = []
    for op in ops:
        if not any((op, g) in by for g in regimes):
            continue
        tds = "".join(f"<td>{cell(op, by[(op, g)])}</td>" if (op, g) in by else '<td class="muted">-</td>'
                      for g in regimes)
        rows.append(f'<tr><th><a href="#op-{E(op)}">{E(op)}</a></th>{tds}</tr>')
    new = runs[-1]
    head = "".join(f"<th>{E(g)}</th>" for g in regimes)
    return (f'<h3>{E(new.get("device") or "?")} <span class="muted">({E(str(new.get("arch")))}; {len(runs)} run(s), '
            f'newest {E((new.get("git_commit") or "?")[:10])})</span></h3>'
            f'<table class="summary"><tr><th>op</th>{head}</tr>{"".join(rows)}</table>')


def summary_html(ops: list[str], dev_runs: dict[str, list[dict]]) -> str:
    tables = [device_table(ops, runs) for _, runs in sorted(dev_runs.items())
              if any(results.section_of(r) == "op" for run in runs for r in run["records"])]
    body = "".join(tables) or '<div class="warn">No op results yet: run <code>python -m perf run</code> on a GPU.</div>'
    return (f'<div class="card" id="summary"><h2>What auto ships, per device</h2>{body}'
            f'<p class="muted footnote">{FOOTNOTE}</p></div>')


# ------------------------------------------------------------------------------------------------- regressions


@dataclasses.dataclass(frozen=True)
class Regression:
    change: results.Change
    base: dict  # the previous run's record of the case
    new: dict  # the newest record

    @property
    def ratio(self) -> float | None:
        return self.change.ratio


def regressions(records: list[dict], threshold: float, noise_floor_us: float) -> dict[tuple, Regression]:
    """Per device, the newest record of every (op, case, shipped backend, timing) against the same key's record from
    the run before (the rule of `python -m perf compare`); only slower or broken ones. The reference backend
    (results.REFERENCE_BACKENDS) and peers are never flagged. A failure recorded without a timing counts against the
    events timing."""
    history: dict[tuple, list[tuple[str, int, dict]]] = {}
    for i, r in enumerate(records):
        if results.section_of(r) != "op" or not results.shipped(r["provider"]) or r.get("status") == "skipped":
            continue
        k = results.key(r)
        if k[4] is None:
            k = (*k[:4], "events")
        history.setdefault(k, []).append((r.get("timestamp") or "", i, r))
    out: dict[tuple, Regression] = {}
    for k, rs in history.items():
        rs.sort(key=lambda t: t[:2])
        new = rs[-1][2]
        base = next((r for _, _, r in reversed(rs) if r.get("run_id") != new.get("run_id")), None)
        if base is None:
            continue
        c = results.change(k, base, new, threshold, noise_floor_us)
        if c.verdict in ("slower", "broken"):
            out[k] = Regression(c, base, new)
    return out


def _versions(base: dict, new: dict) -> str:
    vb, vn = base.get("versions") or {}, new.get("versions") or {}
    changed = [f"{n} {vb.get(n)} → {vn.get(n)}" for n in ("torch", "triton", "cutlass_dsl") if vb.get(n) != vn.get(n)]
    if changed:
        return "; ".join(changed)
    return f"torch {vn.get('torch')}, triton {vn.get('triton')}, cutlass-dsl {vn.get('cutlass_dsl')} (unchanged)"


def regressions_html(regs: dict[tuple, Regression], threshold: float, noise_floor_us: float) -> str:
    if not regs:
        return ('<div class="card ok" id="regressions">No regressions: every shipped backend\'s newest record of a '
                f'case is within {threshold:.0%} (or {noise_floor_us} us) of the run before it, or there is no run '
                'before it.</div>')
    by_device: dict[str, list[str]] = {}
    # per device, broken first, then the largest slowdown first
    for k, g in sorted(regs.items(), key=lambda kv: (str(kv[0][0]), -(kv[1].ratio or math.inf), str(kv[0]))):
        c = g.change
        what = f"{c.base_us:.2f} → {c.new_us:.2f} us (x{c.ratio:.3f})" if c.ratio else E(c.detail)
        by_device.setdefault(g.new.get("device") or str(k[0]), []).append(
            f'<li><a href="#op-{E(k[1])}">{E(c.label)}</a>: {what}; commit '
            f'{E((g.base.get("git_commit") or "?")[:10])} → {E((g.new.get("git_commit") or "?")[:10])}'
            f'{" (dirty)" if g.new.get("git_dirty") else ""}; {E(_versions(g.base, g.new))}</li>')
    lists = "".join(f'<div class="bucket">{E(dev)}: {len(items)}</div><ul class="regs">{"".join(items)}</ul>'
                    for dev, items in by_device.items())
    return (f'<div class="card" id="regressions"><b class="regtag">{len(regs)} regression(s)</b> of shipped backends '
            f'(newest record of a case vs the run before it on the same device; &gt;{threshold:.0%} slower at the '
            f'median and &gt;{noise_floor_us} us, or broken; the reference backend is not gated):{lists}</div>')


# --------------------------------------------------------------------------------------- model / multi-GPU


SECTIONS = {  # kind -> (section id, title, what "lowbit" is held against)
    results.MODEL_KIND: ("models", "Models: patched with lowbit vs their own stack", "stack"),
    results.MULTI_GPU_KIND: ("multi-gpu", "Multi-GPU: expert-parallel layers and all-to-all", "library"),
}


def kind_section(kind: str, records: list[dict]) -> str:
    """A section for the model-level or multi-GPU records (empty string when there are none): per device and case,
    the newest run's lowbit record against each other provider of that run (their median over lowbit's)."""
    sid, title, other = SECTIONS[kind]
    recs = [r for r in records if results.section_of(r) == kind]
    if not recs:
        return ""
    newest: dict[tuple, list[dict]] = {}
    for r in sorted(recs, key=lambda r: r.get("timestamp") or ""):
        k = (r.get("device") or r.get("device_slug"), r["op"], r["case"])
        if newest.get(k) and newest[k][0].get("run_id") != r.get("run_id"):
            newest[k] = []
        newest.setdefault(k, []).append(r)
    rows = []
    for (dev, op, case), rs in sorted(newest.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        mine = next((r for r in rs if r["provider"] == "lowbit" and r.get("status") == "ok"), None)
        for r in sorted(rs, key=lambda r: (r["provider"] != "lowbit", r["provider"])):
            ok = r.get("status") == "ok"
            ratio = (r["median_us"] / mine["median_us"] if ok and mine is not None and r is not mine else None)
            extra = r.get("tokens_per_s") if kind == results.MODEL_KIND else r.get("gbps")
            world = (r.get("params") or {}).get("world_size", r.get("world_size"))
            rows.append(
                f'<tr><td>{E(str(dev))}</td><td>{E(op)}</td><td>{E(case)}</td><td>{E(str(r.get("bucket") or "-"))}</td>'
                + (f'<td class="r">{E(str(world))}</td>' if kind == results.MULTI_GPU_KIND else "")
                + f'<td>{E(r["provider"])}</td><td>{E(str(r.get("timing")))}</td>'
                f'<td class="r">{_us(r["median_us"]) if ok else E(r.get("status", "?"))}</td>'
                f'<td class="r">{f"{extra:.4g}" if ok and extra else "-"}</td>'
                f'<td class="r">{f"{ratio:.2f}x" if ratio else "-"}</td>'
                f'<td>{E((r.get("git_commit") or "?")[:10])}</td></tr>')
    world_h = "<th>GPUs</th>" if kind == results.MULTI_GPU_KIND else ""
    extra_h = "tokens/s" if kind == results.MODEL_KIND else "GB/s"
    return (f'<div class="card" id="{sid}"><h2>{E(title)}</h2><table class="num"><tr><th>device</th><th>what</th>'
            f'<th>case</th><th>regime</th>{world_h}<th>provider</th><th>timing</th><th>median</th><th>{extra_h}</th>'
            f'<th>{other} / lowbit</th><th>commit</th></tr>{"".join(rows)}</table>'
            f'<p class="muted">Newest run per case; the ratio is each {other}\'s median time over lowbit\'s in the '
            f'same run (&gt; 1: lowbit is faster). Schema: perf/results.py.</p></div>')
