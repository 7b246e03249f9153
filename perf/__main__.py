"""`python -m perf run | compare | report` (see docs/perf.md)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _split(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [v for item in values for v in item.split(",") if v]


def cmd_run(a: argparse.Namespace) -> int:
    import torch

    from perf import peers, results, runner

    if a.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(a.device)
    provs = _split(a.providers)
    excluded = set(_split(a.exclude_providers) or [])

    def wanted(name: str) -> bool:
        if name in excluded:
            return False
        return provs is None or name in provs or ("lowbit" in provs and name.startswith("lowbit:"))

    cases = runner.select_cases(runner.load_cases(_split(a.ops)), a.quick)
    if a.case:
        cases = [c for c in cases if c.label in a.case]
    if a.bucket:
        cases = [c for c in cases if c.bucket == a.bucket]
    if a.ops:  # run in the order asked (a time-limited run measures the first ops first)
        order = {op: i for i, op in enumerate(_split(a.ops))}
        cases.sort(key=lambda c: order[c.op])
    if not cases:
        print("perf run: no case selected", file=sys.stderr)
        return 2
    for mod, why in peers.unavailable_reasons().items():
        print(f"perf: peer module {mod} unavailable ({why}); its peers are omitted")
    out = Path(a.out) if a.out else results.default_out(device)
    t0 = time.time()
    roof = runner.measure_roofline(device, quick=a.quick)
    meta = results.run_metadata(device, roof, a.quick)
    label = "GPU" if device.type == "cuda" else "CPU (wall clock; Triton under the interpreter: NOT GPU numbers)"
    print(f"perf run {meta['run_id']} on {meta['device']} [{label}], commit {meta['git_commit']}")
    print(f"roofline: copy {roof.copy_gbps:.0f} GB/s, bf16 mm {roof.bf16_tflops or 0:.1f} TFLOP/s, "
          f"fp8 mm {roof.fp8_tflops or 0:.1f} TFLOP/s ({roof.how})")
    print(f"{len(cases)} case(s) -> {out if not a.no_save else '(not saved)'}")
    failures = graph_failures = 0
    n_rec = 0
    not_run = []
    for case in cases:
        if a.time_limit and time.time() - t0 > a.time_limit:
            not_run.append(case)
            continue
        recs = [dict(meta, **r) for r in runner.run_case(case, device, roof, a.quick, wanted, print)]
        runner.add_ratios(recs)
        for r in recs:
            r["repro"] = results.repro_command(r)
            if r["kind"] == "lowbit" and r["status"] in ("wrong", "error"):
                if r["timing"] == "cuda-graph":  # e.g. a host sync inside the op: shown, not fatal
                    graph_failures += 1
                else:
                    failures += 1
        _print_case(case, recs)
        if not a.no_save:
            results.append(out, recs)
        n_rec += len(recs)
    print(f"perf run: {n_rec} records in {time.time() - t0:.0f} s" + (f"; {failures} lowbit FAILURE(S)" if failures
                                                                        else ""))
    if graph_failures:
        print(f"perf run: {graph_failures} lowbit decode case(s) could not be timed under CUDA-graph capture")
    if not_run:
        print(f"perf run: --time-limit {a.time_limit:.0f} s reached; {len(not_run)} case(s) NOT run, e.g. "
              + "; ".join(f"{c.op} [{c.label}]" for c in not_run[:5]))
    if runner.LOAD_ERRORS:
        print(f"perf run: case families that failed to load: {', '.join(runner.LOAD_ERRORS)}")
    # A family that failed to import fails a full run; with --ops, every requested op was found (load_cases
    # checks), so another family's breakage is only reported.
    return 1 if (failures or not_run or (runner.LOAD_ERRORS and not a.ops)) else 0


def _print_case(case, recs: list[dict]) -> None:
    print(f"{case.op} [{case.label}] ({case.bucket})")
    for r in recs:
        if r["status"] != "ok":
            if r["status"] != "skipped":
                print(f"    {r['provider']:<16} {r['timing'] or '':<13} {r['status'].upper()}: {r.get('error')}")
            continue
        vs = r.get("vs", {})
        ratio = " ".join(f"{p}:{x:.2f}x" for p, x in vs.items() if not p.startswith("lowbit:")) \
            if r["kind"] == "lowbit" else ""
        gbps = f"{r['gbps']:8.1f} GB/s" if r.get("gbps") else " " * 13
        frac = f"{100 * r['roofline_frac']:5.1f}% roof" if r.get("roofline_frac") else ""
        note = f" ({r['note']})" if r.get("note") else ""
        print(f"    {r['provider'] + note:<16} {r['timing']:<13} {r['median_us']:10.2f} us "
              f"[{r['p20_us']:.2f}-{r['p80_us']:.2f}] {gbps} {frac}  {ratio}")


def cmd_compare(a: argparse.Namespace) -> int:
    from perf import results

    base = results.load([Path(a.base)])
    new = results.load([Path(a.new)])
    changes = results.compare(base, new, a.threshold, a.noise_floor_us, a.providers)
    if a.ops:
        ops = set(_split(a.ops))
        changes = [c for c in changes if c.key[1] in ops]
    return results.print_compare(changes, a.threshold)


def cmd_merge(a: argparse.Namespace) -> int:
    """Append records from run outputs (e.g. fetched from the GPU machine) to perf/results/<device>.jsonl,
    skipping records already there (same run_id and key): merging twice changes nothing."""
    from perf import results

    recs = results.load([Path(p) for p in a.files])
    by_dev: dict[str, list[dict]] = {}
    for r in recs:
        if a.commit and not r.get("git_commit"):
            r["git_commit"] = a.commit
        by_dev.setdefault(r.get("device_slug") or "unknown", []).append(r)
    for dev, rs in by_dev.items():
        if dev.startswith("cpu") and not a.allow_cpu:
            print(f"perf merge: {len(rs)} CPU record(s) ({dev}) not merged: CPU numbers stay out of perf/results/")
            continue
        dest = results.RESULTS_DIR / f"{dev}.jsonl"
        have = {(r.get("run_id"), results.key(r)) for r in (results.load([dest]) if dest.exists() else [])}
        fresh = [r for r in rs if (r.get("run_id"), results.key(r)) not in have]
        results.append(dest, fresh)
        print(f"perf merge: {len(fresh)} new record(s) -> {dest} ({len(rs) - len(fresh)} already there)")
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from perf import report, results

    paths = [Path(p) for p in (a.results or [str(results.RESULTS_DIR)])]
    recs = results.load([p for p in paths if p.exists()])
    out = Path(a.out)
    report.write(recs, out, threshold=a.threshold, noise_floor_us=a.noise_floor_us)
    n_ops = len({r["op"] for r in recs})
    print(f"perf report: {len(recs)} records, {n_ops} op(s) with results -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="benchmark cases, append JSONL records")
    r.add_argument("--ops", nargs="+", help="op names (space or comma separated); default: all")
    r.add_argument("--case", action="append", help="exact case label (repeatable)")
    r.add_argument("--bucket", choices=("decode", "prefill"), help="only this bucket's cases")
    r.add_argument("--providers", nargs="+", help="provider names; 'lowbit' = every lowbit backend")
    r.add_argument("--exclude-providers", nargs="+", help="e.g. torch.compile")
    r.add_argument("--quick", action="store_true", help="tiny shapes, few samples (CI; the CPU interpreter)")
    r.add_argument("--out", help="JSONL to append to (default: perf/results/<gpu>.jsonl, perf/out/<cpu>.jsonl)")
    r.add_argument("--no-save", action="store_true")
    r.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu")
    r.add_argument("--time-limit", type=float, help="seconds: start no new case after this (exit 1 if any left)")
    r.set_defaults(fn=cmd_run)
    m = sub.add_parser("merge", help="append run outputs to perf/results/<device>.jsonl (idempotent)")
    m.add_argument("files", nargs="+")
    m.add_argument("--commit", help="git commit to record where a run could not see one (a copy without .git)")
    m.add_argument("--allow-cpu", action="store_true")
    m.set_defaults(fn=cmd_merge)
    c = sub.add_parser("compare", help="per-case ratios NEW/BASE; exit 1 past the threshold")
    c.add_argument("base")
    c.add_argument("new")
    c.add_argument("--threshold", type=float, default=0.05, help="relative slowdown of the median (0.05 = 5%%)")
    c.add_argument("--noise-floor-us", type=float, default=0.5, help="ignore slowdowns smaller than this")
    c.add_argument("--providers", default="lowbit",
                   help="lowbit (default) | shipped (not the reference backend) | all | comma list")
    c.add_argument("--ops", nargs="+")
    c.set_defaults(fn=cmd_compare)
    p = sub.add_parser("report", help="write the static HTML dashboard")
    p.add_argument("--results", nargs="+", help="JSONL files or dirs (default: perf/results)")
    p.add_argument("--out", default="perf/dashboard/index.html")
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--noise-floor-us", type=float, default=0.5)
    p.set_defaults(fn=cmd_report)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
