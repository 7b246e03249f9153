"""Load the dashboard in headless Chromium (the Debian package; no browser download) and fail on JS/console
errors, a missing op section, a missing summary table or an in-page link without its target; keep a screenshot.

    python perf/browser_check.py [--html perf/dashboard/index.html] [--screenshot perf/dashboard/dashboard.png]
                                 [--require-results]

Expected sections: one `<section id="op-<name>">` per op of the dispatch table; the summary card (`id="summary"`,
a `<table class="summary">` per device once any op has results) whose every `href="#..."` (and every other in-page
link) names an id of the rendered page. `--require-results` also fails
when an op's section has no results (the "done" bar: committed GPU results for every registered op).
Console errors are caught twice: Chromium's own log (`--enable-logging=stderr`: CONSOLE lines at error level,
"Uncaught ..."), and the page's window 'error' handler, which writes `<div id="js-error">` into the DOM, which
`--dump-dom` shows; the page also sets `data-ready="1"` on <body> once its script ran.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
CONSOLE_ERROR = re.compile(r"(Uncaught|CONSOLE\(\d+\)\].*(error|Error)|:ERROR:CONSOLE|SyntaxError|ReferenceError|"
                           r"TypeError)")


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("browser_check: no chromium on PATH (Debian: apt-get install -y chromium)")


def _chromium(args: list[str], timeout: int = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="lowbit-chromium-") as profile:
        cmd = [find_chromium(), *FLAGS, f"--user-data-dir={profile}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def expected_ops() -> list[str]:
    sys.path.insert(0, str(REPO))
    from dispatch.table import TABLE

    return list(TABLE)


def summary_problems(dom: str) -> list[str]:
    """The summary card is there (with a table per device once any op has results) and every in-page link of the page,
    the summary's cells first, names an element id that the rendered page has."""
    problems = []
    start = dom.find('id="summary"')
    if start < 0:
        return ['missing the summary card (id="summary")']
    end = dom.find('class="muted footnote"', start)
    block = dom[start:end if end > 0 else len(dom)]
    has_results = re.search(r'<section class="op card"', dom) is not None  # an op section without "no-results"
    if has_results and '<table class="summary">' not in block:
        problems.append("the summary card has no per-device table although some op has results")
    ids = set(re.findall(r'\sid="([^"]+)"', dom))
    links = re.findall(r'href="#([^"]*)"', block) + re.findall(r'href="#([^"]*)"', dom)
    problems += [f"link to #{target} has no element with that id" for target in dict.fromkeys(links)
                 if target not in ids]
    return problems


def check(html: Path, screenshot: Path | None, require_results: bool, ops: list[str] | None = None) -> list[str]:
    """Problems found (empty: the page is fine)."""
    url = html.resolve().as_uri()
    problems: list[str] = []
    dom = _chromium(["--dump-dom", "--virtual-time-budget=5000", url])
    if dom.returncode != 0:
        problems.append(f"chromium --dump-dom exited {dom.returncode}: {dom.stderr[-2000:]}")
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    errors = [ln for ln in console if CONSOLE_ERROR.search(ln)]
    problems += [f"console: {ln.strip()}" for ln in errors]
    text = dom.stdout
    if 'id="js-error"' in text:
        m = re.search(r'id="js-error"[^>]*>([^<]*)', text)
        problems.append(f"page error: {m.group(1) if m else '?'}")
    if 'data-ready="1"' not in text:
        problems.append("the page's script did not run to the end (no data-ready on <body>)")
    problems += summary_problems(text)
    for op in ops if ops is not None else expected_ops():
        m = re.search(rf'<section class="([^"]*)" id="op-{re.escape(op)}"', text)
        if not m:
            problems.append(f"missing op section: op-{op}")
        elif require_results and "no-results" in m.group(1):
            problems.append(f"op section op-{op} has no results")
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        if screenshot.exists():
            os.remove(screenshot)
        shot = _chromium([f"--screenshot={screenshot.resolve()}", "--window-size=1320,3000",
                          "--virtual-time-budget=5000", url])
        if not screenshot.exists() or screenshot.stat().st_size == 0:
            problems.append(f"no screenshot written ({shot.returncode}): {shot.stderr[-1000:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--html", default=str(REPO / "perf" / "dashboard" / "index.html"))
    ap.add_argument("--screenshot", default=str(REPO / "perf" / "dashboard" / "dashboard.png"))
    ap.add_argument("--require-results", action="store_true", help="fail when an op section has no results")
    ap.add_argument("--ops", nargs="+", help="expected op sections (default: every op of dispatch.table.TABLE)")
    a = ap.parse_args(argv)
    html = Path(a.html)
    if not html.exists():
        print(f"browser_check: {html} does not exist (run `python -m perf report` first)", file=sys.stderr)
        return 2
    problems = check(html, Path(a.screenshot) if a.screenshot else None, a.require_results, a.ops)
    for p in problems:
        print(f"browser_check: FAIL: {p}", file=sys.stderr)
    if not problems:
        print(f"browser_check: ok ({html}; screenshot {a.screenshot})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
