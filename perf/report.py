"""The static HTML dashboard: one self-contained file (inline CSS, inline SVG, a few lines of inline JS; no
network needed to view it), built only from the JSONL records.

Per op (section id="op-<name>"): for each device, the newest run's cases as bar groups (one bar per provider,
length = fraction of the measured roofline, label = time, GB/s and speed-up over the eager reference), graph-
replay timings beside the event timings for decode cases, the numbers with p20/p80 and the repro command in a
table, and the history of every lowbit backend over the device's runs (median time relative to the first run).
At the top (perf/summary.py): per device, what `backend="auto"` ships for each op and regime against the best peer
and the roofline, the model-level and multi-GPU sections once such records exist, and the regressions of shipped
backends (a case's newest record vs the run before it), which are also outlined in red in the charts and marked in
the tables.
"""

from __future__ import annotations

import datetime
import html
import math
from pathlib import Path

from perf import results, summary

PALETTE = {
    "lowbit:triton": "#2563eb", "lowbit:cute": "#7c3aed", "lowbit:torch": "#64748b",
    "torch": "#9ca3af", "torch.compile": "#f59e0b", "liger": "#16a34a",
}
EXTRA = ["#0d9488", "#db2777", "#84cc16", "#0ea5e9", "#a16207", "#4f46e5"]
ORDER = ["lowbit:triton", "lowbit:cute", "lowbit:torch", "torch", "torch.compile", "liger"]
SERIES = ["#2563eb", "#dc2626", "#16a34a", "#f59e0b", "#7c3aed", "#0d9488", "#db2777", "#65a30d", "#0ea5e9",
          "#a16207", "#4f46e5", "#be123c"]

CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#111827;background:#f8fafc}
header{background:#0f172a;color:#e2e8f0;padding:16px 24px}header h1{margin:0 0 4px;font-size:22px}
header .sub{color:#94a3b8;font-size:13px}main{padding:16px 24px;max-width:1280px}
.card{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:12px 16px;margin:12px 0}
.devices td,.devices th{padding:2px 10px 2px 0;text-align:left;font-size:13px}
nav{display:flex;flex-wrap:wrap;gap:6px}nav a{display:inline-block;padding:4px 8px;border-radius:6px;
background:#eef2ff;color:#1e3a8a;text-decoration:none;font-size:13px}nav a.reg{background:#fee2e2;color:#991b1b}
nav a.none{background:#f1f5f9;color:#94a3b8}nav .pct{color:#475569;margin-left:4px}
section h2{margin:4px 0 8px;font-size:19px}section h3{margin:12px 0 4px;font-size:15px;color:#334155}
.bucket{font-weight:600;color:#475569;margin:8px 0 2px;font-size:13px}
table.num{border-collapse:collapse;font-size:12px;width:100%}table.num th{text-align:left;background:#f1f5f9}
table.num td,table.num th{padding:2px 6px;border-bottom:1px solid #f1f5f9;white-space:nowrap}
table.num td.r{text-align:right;font-variant-numeric:tabular-nums}table.num code{font-size:11px;color:#334155}
tr.regressed td{background:#fef2f2}tr.bad td{background:#fff7ed}.regtag{color:#b91c1c;font-weight:600}
.legend span{display:inline-block;margin-right:12px;font-size:12px}.legend i{display:inline-block;width:10px;
height:10px;margin-right:4px;border-radius:2px;vertical-align:-1px}.warn{color:#9a3412;background:#fff7ed;
padding:6px 10px;border-radius:6px;margin:6px 0}.ok{color:#166534}.muted{color:#64748b;font-size:12px}
ul.regs{margin:4px 0;padding-left:18px}ul.regs li{color:#991b1b}details summary{cursor:pointer;color:#334155}
#filter{padding:4px 8px;border:1px solid #cbd5e1;border-radius:6px;margin-bottom:8px;width:260px}
svg text{font-family:system-ui,sans-serif}
table.summary{border-collapse:collapse;font-size:12.5px;margin:4px 0 12px}table.summary th{text-align:left;
background:#f1f5f9;padding:3px 8px}table.summary td,table.summary tr>th{padding:4px 8px;border-bottom:1px solid
#e2e8f0;vertical-align:top}table.summary tr>th{background:none;font-weight:600}table.summary a{color:inherit;
text-decoration:none}a.cell{display:block}a.cell:hover{background:#f8fafc}.pick{font-weight:600;color:#1e3a8a}
.good{color:#166534}.slow{color:#b91c1c}.lb{color:#9a3412}.footnote{max-width:1200px}
"""

JS = """
window.addEventListener('error',function(e){var d=document.createElement('div');d.id='js-error';
d.textContent='JS error: '+e.message;document.body.prepend(d);});
document.addEventListener('DOMContentLoaded',function(){var f=document.getElementById('filter');
f.addEventListener('input',function(){var q=f.value.toLowerCase();
document.querySelectorAll('section.op').forEach(function(s){s.style.display=s.id.indexOf(q)>=0?'':'none';});
document.querySelectorAll('nav a').forEach(function(a){a.style.display=a.textContent.toLowerCase()
.indexOf(q)>=0?'':'none';});});document.body.setAttribute('data-ready','1');});
"""

E = html.escape


def _color(provider: str, extra: dict[str, str]) -> str:
    if provider in PALETTE:
        return PALETTE[provider]
    if provider not in extra:
        extra[provider] = EXTRA[len(extra) % len(EXTRA)]
    return extra[provider]


def _prov_order(p: str) -> tuple:
    return (ORDER.index(p) if p in ORDER else len(ORDER), p)


def _fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    if us >= 1000:
        return f"{us / 1000:.2f} ms"
    return f"{us:.2f} us" if us < 100 else f"{us:.0f} us"


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if x == 0:
        return "0"
    return f"{x:.{max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))}f}"


# ------------------------------------------------------------------------------------------------- model


def _by_device_runs(records: list[dict]) -> dict[str, list[dict]]:
    """device_slug -> runs (oldest first), each {meta..., 'records': [...]}"""
    runs: dict[str, dict[str, dict]] = {}
    for r in records:
        dev, rid = r.get("device_slug", "?"), r.get("run_id", "?")
        run = runs.setdefault(dev, {}).setdefault(rid, {k: r.get(k) for k in (
            "run_id", "timestamp", "git_commit", "git_dirty", "device", "device_slug", "arch", "versions",
            "roofline", "quick", "interpret")} | {"records": []})
        run["records"].append(r)
    return {d: sorted(v.values(), key=lambda x: x.get("timestamp") or "") for d, v in runs.items()}


# -------------------------------------------------------------------------------------------------- plots


def _bars_svg(cases: list[tuple[str, list[dict]]], regs: dict[tuple, summary.Regression], extra: dict,
              metric: str = "roof") -> str:
    """Bar groups, one per case (its label on a header row), one bar per (provider, timing).
    metric "roof": bar = fraction of the measured roofline (prefill: the bandwidth/compute story);
    metric "time": bar = median time per call, shorter is faster (decode: launch-bound, a % of roofline
    is ~0 for everyone and says nothing)."""
    W, name_w, bar_h, head_h, gap = 1180, 190, 13, 15, 8
    plot_w = 600
    rows = sum(len(rs) for _, rs in cases)
    H = rows * (bar_h + 2) + len(cases) * (head_h + gap) + 24
    if metric == "roof":
        xmax = max([1.0] + [min(r.get("roofline_frac") or 0, 2.0) for _, rs in cases for r in rs])
        xmax = 1.0 if xmax <= 1.0 else math.ceil(xmax * 4) / 4
        ticks = [(t * xmax / 4, f"{t * xmax / 4:.0%}") for t in range(5)]
        value = lambda r: min(r.get("roofline_frac") or 0.0, xmax)
        axis = "fraction of measured roofline"
    else:
        xmax = max([1e-9] + [r.get("median_us") or 0 for _, rs in cases for r in rs if r.get("status") == "ok"])
        step = 10 ** math.floor(math.log10(xmax / 4)) if xmax > 0 else 1
        step = next(m * step for m in (1, 2, 2.5, 5, 10) if m * step * 5 >= xmax)
        xmax = step * 5
        ticks = [(i * step, _fmt_us(i * step)) for i in range(6)]
        value = lambda r: r.get("median_us") or 0.0
        axis = "median time per call (shorter is faster)"
    x0 = name_w
    sx = lambda v: x0 + plot_w * v / xmax
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    for v, lab in ticks:
        full = metric == "roof" and abs(v - 1.0) < 1e-9
        dash = ' stroke-dasharray="4 3"' if full else ""
        col = "#64748b" if full else "#e2e8f0"
        out.append(f'<line x1="{sx(v):.1f}" y1="14" x2="{sx(v):.1f}" y2="{H - 4}" stroke="{col}"{dash}/>'
                   f'<text x="{sx(v):.1f}" y="10" font-size="10" text-anchor="middle" fill="#64748b">{E(lab)}</text>')
    out.append(f'<text x="{x0 + plot_w + 44}" y="10" font-size="10" fill="#64748b">{E(axis)} | '
               'median · GB/s · TFLOP/s · speed-up over torch eager</text>')
    y = 18
    for label, rs in cases:
        out.append(f'<text x="4" y="{y + head_h - 3}" font-size="11.5" font-weight="600" fill="#0f172a">'
                   f'{E(label)}</text>')
        y += head_h
        for r in rs:
            c = _color(r["provider"], extra)
            graph = r.get("timing") == "cuda-graph"
            name = r["provider"] + (" · graph" if graph else "") + (" · interp." if r.get("note") else "")
            ty = y + bar_h - 3
            reg = regs.get(results.key(r))
            out.append(f'<text x="{x0 - 6}" y="{ty}" font-size="10.5" text-anchor="end" '
                       f'fill="{"#b91c1c" if reg else "#334155"}">{E(name)}</text>')
            if r.get("status") != "ok":
                msg = f'{r.get("status", "?").upper()}: {r.get("error") or ""}'[:110]
                out.append(f'<text x="{x0 + 4}" y="{ty}" font-size="10" fill="#b91c1c">{E(msg)}'
                           f'<title>{E(r.get("repro") or "")}</title></text>')
                y += bar_h + 2
                continue
            w = max(sx(value(r)) - x0, 1.5)
            f = r.get("roofline_frac")
            tip = (f'{r["provider"]} {r.get("timing")}: median {_fmt_us(r["median_us"])} '
                   f'(p20 {_fmt_us(r.get("p20_us"))}, p80 {_fmt_us(r.get("p80_us"))}), {_fmt(r.get("gbps"))} GB/s'
                   + (f", {100 * f:.1f}% of roofline" if f else "") + f'\n{r.get("repro", "")}')
            stroke = ' stroke="#dc2626" stroke-width="2"' if reg else ""
            op = ' fill-opacity="0.5"' if graph else ""
            out.append(f'<rect x="{x0}" y="{y}" width="{w:.1f}" height="{bar_h}" rx="2" fill="{c}"{op}{stroke}>'
                       f'<title>{E(tip)}</title></rect>')
            bits = [_fmt_us(r["median_us"])]
            if r.get("gbps"):
                bits.append(f'{_fmt(r["gbps"])} GB/s')
            if r.get("tflops"):
                bits.append(f'{_fmt(r["tflops"])} TFLOP/s')
            if metric == "roof" and f:
                bits.append(f"{100 * f:.0f}% roof")
            vs = (r.get("vs") or {}).get("torch")
            if vs and r["provider"] != "torch":
                bits.append(f"{vs:.2f}x")
            txt = " · ".join(bits)
            if reg:
                txt += f"  ▲ {100 * (reg.ratio - 1):+.0f}% vs previous run" if reg.ratio else "  ▲ broke"
            weight = ' font-weight="600"' if r["provider"].startswith("lowbit:") else ""
            fill = "#b91c1c" if reg else "#334155"
            out.append(f'<text x="{x0 + plot_w + 8}" y="{ty}" font-size="10" fill="{fill}"{weight}>{E(txt)}</text>')
            y += bar_h + 2
        y += gap
    out.append("</svg>")
    return "".join(out)


def _history_svg(op: str, runs: list[dict], regs: dict[tuple, summary.Regression]) -> str:
    """Median time of each (case, lowbit backend, timing) relative to its first run, over this device's runs."""
    runs = [run for run in runs if any(r["op"] == op for r in run["records"])]
    if len(runs) < 2:
        c = runs[0]["git_commit"] if runs else None
        return f'<p class="muted">History: one run so far (commit {E((c or "?")[:10])}); the chart starts with ' \
               'the next one.</p>'
    series: dict[tuple, list[float | None]] = {}
    for i, run in enumerate(runs):
        for r in run["records"]:
            if r["op"] != op or not r["provider"].startswith("lowbit:") or r.get("status") != "ok" \
                    or r.get("timing") == "cuda-graph":
                continue
            k = (r["case"], r["provider"], r.get("timing"))
            series.setdefault(k, [None] * len(runs))[i] = r["median_us"]
    W, H, L, R, T, B = 1180, 240, 50, 330, 12, 40
    pw, ph = W - L - R, H - T - B
    rel = {}
    for k, vals in series.items():
        first = next((v for v in vals if v), None)
        rel[k] = [v / first if (v and first) else None for v in vals]
    flat = [v for vs in rel.values() for v in vs if v is not None]
    lo, hi = min(flat + [0.9]), max(flat + [1.1])
    lo, hi = lo - 0.02, hi + 0.02
    sx = lambda i: L + pw * (i / (len(runs) - 1))
    sy = lambda v: T + ph * (1 - (v - lo) / (hi - lo))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img">']
    for v in (lo + 0.02, 1.0, hi - 0.02):
        out.append(f'<line x1="{L}" x2="{L + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#e2e8f0"/>'
                   f'<text x="{L - 4}" y="{sy(v) + 3:.1f}" font-size="10" text-anchor="end" fill="#64748b">'
                   f'{v:.2f}x</text>')
    for i, run in enumerate(runs):
        lab = (run.get("git_commit") or "?")[:7] + ("*" if run.get("git_dirty") else "")
        out.append(f'<text x="{sx(i):.1f}" y="{H - B + 14}" font-size="10" text-anchor="middle" fill="#475569">'
                   f'{E(lab)}<title>{E(str(run.get("timestamp")))}</title></text>')
    out.append(f'<text x="{L}" y="{H - 6}" font-size="10" fill="#64748b">commits, oldest → newest; y = median time '
               'relative to the first run (up = slower)</text>')
    dev = runs[-1]["device_slug"]
    ordered = sorted(rel.items(), key=lambda kv: ((dev, op, *kv[0]) not in regs, kv[0]))  # regressed first
    for n, (k, vals) in enumerate(ordered):
        col = SERIES[n % len(SERIES)]
        pts = [(sx(i), sy(v)) for i, v in enumerate(vals) if v is not None]
        if len(pts) > 1:
            out.append(f'<polyline fill="none" stroke="{col}" stroke-width="1.5" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        reg = regs.get((dev, op, k[0], k[1], k[2]))
        for i, v in enumerate(vals):
            if v is None:
                continue
            last = i == len(vals) - 1
            red = reg is not None and last
            out.append(f'<circle cx="{sx(i):.1f}" cy="{sy(v):.1f}" r="{5 if red else 2.5}" '
                       f'fill="{"#dc2626" if red else col}"><title>{E(k[0])} {E(k[1])} {E(str(k[2]))}: '
                       f'{v:.3f}x</title></circle>')
        if n < 14:
            ly = T + 12 * n + 4
            out.append(f'<rect x="{L + pw + 12}" y="{ly - 7}" width="9" height="9" fill="{col}"/>'
                       f'<text x="{L + pw + 25}" y="{ly + 1}" font-size="10" fill="{"#b91c1c" if reg else "#334155"}">'
                       f'{E(k[0][:34])} · {E(k[1][7:])}{" graph" if k[2] == "cuda-graph" else ""}'
                       f'{" ▲" if reg else ""}</text>')
    if len(rel) > 14:
        out.append(f'<text x="{L + pw + 12}" y="{T + 12 * 14 + 4}" font-size="10" fill="#64748b">'
                   f'+{len(rel) - 14} more series</text>')
    out.append("</svg>")
    return "".join(out)


# --------------------------------------------------------------------------------------------------- page


def _table(recs: list[dict], regs: dict[tuple, summary.Regression]) -> str:
    peers = sorted({p for r in recs for p in (r.get("vs") or {}) if not p.startswith("lowbit:")}, key=_prov_order)
    head = "".join(f"<th>vs {E(p)}</th>" for p in peers)
    rows = []
    for r in recs:
        reg = regs.get(results.key(r))
        cls = ' class="regressed"' if reg else (' class="bad"' if r.get("status") not in ("ok", "skipped") else "")
        if r.get("status") != "ok":
            rows.append(f'<tr{cls}><td>{E(r["case"])}</td><td>{E(r["provider"])}</td><td>{E(str(r.get("timing")))}'
                        f'</td><td colspan="{6 + len(peers)}">{E(r.get("status", ""))}: {E(r.get("error") or "")}'
                        f'</td><td><code>{E(r.get("repro") or "")}</code></td></tr>')
            continue
        vs = r.get("vs") or {}
        ratios = "".join(f'<td class="r">{_fmt(vs.get(p)) + "x" if vs.get(p) else "-"}</td>' for p in peers)
        tag = f' <span class="regtag">▲ x{reg.ratio:.2f}</span>' if reg and reg.ratio else ""
        frac = r.get("roofline_frac")
        rows.append(
            f'<tr{cls}><td>{E(r["case"])}</td><td>{E(r["provider"])}{" (interp.)" if r.get("note") else ""}</td>'
            f'<td>{E(str(r.get("timing")))}</td><td class="r">{_fmt_us(r["median_us"])}{tag}</td>'
            f'<td class="r">{_fmt(r.get("p20_us"))}–{_fmt(r.get("p80_us"))}</td>'
            f'<td class="r">{_fmt(r.get("gbps"))}</td><td class="r">{_fmt(r.get("tflops"))}</td>'
            f'<td class="r">{"-" if frac is None else f"{100 * frac:.1f}%"}</td>'
            f'<td>{E(str(r.get("verified", ""))[:40])}</td>{ratios}'
            f'<td><code>{E(r.get("repro") or "")}</code></td></tr>')
    return (f'<table class="num"><tr><th>case</th><th>provider</th><th>timing</th><th>median</th><th>p20–p80 us</th>'
            f'<th>GB/s</th><th>TFLOP/s</th><th>roofline</th><th>verified</th>{head}<th>repro</th></tr>'
            + "".join(rows) + "</table>")


def _device_block(op: str, runs: list[dict], regs, extra) -> str:
    run = next(run for run in reversed(runs) if any(r["op"] == op for r in run["records"]))
    recs = [r for r in run["records"] if r["op"] == op]
    shown = [r for r in recs if r.get("status") != "skipped"]
    roof = run.get("roofline") or {}
    cpu = (run.get("device_slug") or "").startswith("cpu")
    parts = [f'<h3>{E(run.get("device") or "?")} — commit {E((run.get("git_commit") or "?")[:10])}'
             f'{" (dirty)" if run.get("git_dirty") else ""}, {E(str(run.get("timestamp")))}</h3>']
    if cpu or run.get("quick"):
        parts.append('<div class="warn">CPU / --quick run: wall-clock and Triton-interpreter timings for testing the '
                     'pipeline. These are not GPU numbers.</div>')
    parts.append(f'<div class="muted">roofline measured in this run: copy {_fmt(roof.get("copy_gbps"))} GB/s, '
                 f'bf16 {_fmt(roof.get("bf16_tflops"))} TFLOP/s, fp8 {_fmt(roof.get("fp8_tflops"))} TFLOP/s. '
                 'Bars: fraction of the roofline (dashed line = 100%); faded bars = CUDA-graph replay.</div>')
    skipped = sorted({(r["provider"], r.get("error") or "") for r in recs if r.get("status") == "skipped"})
    if skipped:
        parts.append('<div class="muted">not measured: ' + "; ".join(f"{E(p)} ({E(w[:80])})" for p, w in skipped)
                     + "</div>")
    for bucket in ("decode", "prefill"):
        cases: dict[str, list[dict]] = {}
        for r in shown:
            if r.get("bucket") == bucket:
                cases.setdefault(r["case"], []).append(r)
        if not cases:
            continue
        for rs in cases.values():
            rs.sort(key=lambda r: (_prov_order(r["provider"]), r.get("timing") != "events"))
        parts.append(f'<div class="bucket">{bucket} ({"M ≤ 64 tokens" if bucket == "decode" else "M ≥ 4096"})</div>')
        parts.append(_bars_svg(list(cases.items()), regs, extra, "time" if bucket == "decode" else "roof"))
    others = [r for r in shown if r.get("bucket") not in ("decode", "prefill")]
    if others:
        cases = {}
        for r in others:
            cases.setdefault(r["case"], []).append(r)
        parts.append('<div class="bucket">other</div>' + _bars_svg(list(cases.items()), regs, extra))
    parts.append(_history_svg(op, runs, regs))
    parts.append("<details><summary>numbers, p20–p80, ratios and repro commands</summary>"
                 + _table(sorted(shown, key=lambda r: (r["bucket"], r["case"], _prov_order(r["provider"]))), regs)
                 + "</details>")
    return "".join(parts)


def _registered_ops() -> list[str]:
    try:
        from dispatch.table import TABLE

        return list(TABLE)
    except Exception:
        return []


def render(records: list[dict], threshold: float = 0.05, noise_floor_us: float = 0.5) -> str:
    dev_runs = _by_device_runs(records)
    regs = summary.regressions(records, threshold, noise_floor_us)
    op_records = [r for r in records if results.section_of(r) == "op"]
    ops = list(dict.fromkeys(_registered_ops() + sorted({r["op"] for r in op_records})))
    extra: dict[str, str] = {}
    devs = "".join(
        f'<tr><td>{E(runs[-1].get("device") or d)}</td><td>{len(runs)} run(s)</td>'
        f'<td>newest {E((runs[-1].get("git_commit") or "?")[:10])} {E(str(runs[-1].get("timestamp")))}</td>'
        f'<td>torch {E(str((runs[-1].get("versions") or {}).get("torch")))}, triton '
        f'{E(str((runs[-1].get("versions") or {}).get("triton")))}, liger '
        f'{E(str((runs[-1].get("versions") or {}).get("liger")))}</td>'
        f'<td>copy {_fmt((runs[-1].get("roofline") or {}).get("copy_gbps"))} GB/s · bf16 '
        f'{_fmt((runs[-1].get("roofline") or {}).get("bf16_tflops"))} · fp8 '
        f'{_fmt((runs[-1].get("roofline") or {}).get("fp8_tflops"))} TFLOP/s</td></tr>'
        for d, runs in sorted(dev_runs.items()))
    with_results = {r["op"] for r in op_records}
    nav = []
    for op in ops:
        nreg = sum(1 for k in regs if k[1] == op)
        cls = "reg" if nreg else ("" if op in with_results else "none")
        nav.append(f'<a href="#op-{E(op)}" class="{cls}">{E(op)}{" ▲" + str(nreg) if nreg else ""}</a>')
    legend = "".join(f'<span><i style="background:{c}"></i>{E(p)}</span>' for p, c in PALETTE.items())
    sections = []
    for op in ops:
        body = [_device_block(op, runs, regs, extra) for runs in dev_runs.values()
                if any(r["op"] == op for run in runs for r in run["records"])]
        if not body:
            body = ['<div class="warn">No results for this op yet: run <code>python -m perf run --ops '
                    f'{E(op)}</code> on a GPU and commit perf/results/.</div>']
        n = len({(r.get("device_slug"), r["case"]) for r in op_records if r["op"] == op})
        sections.append(f'<section class="op card{" no-results" if n == 0 else ""}" id="op-{E(op)}">'
                        f'<h2>{E(op)}</h2><div class="muted">{n} case(s) over all devices</div>{"".join(body)}'
                        "</section>")
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>lowbit performance</title>"
        f"<style>{CSS}</style><script>{JS}</script></head><body>"
        f"<header><h1>lowbit performance</h1><div class=\"sub\">{len(records)} records · {len(dev_runs)} device(s) · "
        f"built {E(now)} by <code>python -m perf report</code></div></header><main>"
        + summary.summary_html(ops, dev_runs)
        + summary.kind_section(results.MODEL_KIND, records) + summary.kind_section(results.MULTI_GPU_KIND, records)
        + summary.regressions_html(regs, threshold, noise_floor_us)
        + f'<div class="card"><table class="devices"><tr><th>device</th><th>history</th><th>newest run</th>'
        f"<th>versions</th><th>measured roofline</th></tr>{devs}</table></div>"
        f'<div class="card"><input id="filter" placeholder="filter ops…" aria-label="filter ops">'
        f'<nav>{"".join(nav)}</nav><div class="legend" style="margin-top:8px">{legend}</div></div>'
        + "".join(sections) + "</main></body></html>")


def write(records: list[dict], out: Path, threshold: float = 0.05, noise_floor_us: float = 0.5) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(records, threshold, noise_floor_us))
