"""Summarize a pytest junit XML into a run record: counts, wall seconds, seconds per test file (summed test time:
with xdist workers this is process time, not wall) and the slowest tests.

    python -m perf.test_summary pytest.xml --wall 412 --env env.json --out summary.json
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict


def summarize(xml_path: str) -> dict:
    counts = dict(passed=0, failed=0, errors=0, skipped=0)
    per_file: dict[str, float] = defaultdict(float)
    tests_per_file: dict[str, int] = defaultdict(int)
    slowest = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/") + ".py"
        seconds = float(case.get("time") or 0.0)
        if case.find("failure") is not None:
            counts["failed"] += 1
        elif case.find("error") is not None:
            counts["errors"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            continue
        else:
            counts["passed"] += 1
        per_file[file] += seconds
        tests_per_file[file] += 1
        slowest.append((seconds, f"{file}::{case.get('name')}"))
    slowest.sort(reverse=True)
    files = sorted(per_file, key=per_file.get, reverse=True)
    return dict(counts=counts,
                seconds_per_file={f: dict(seconds=round(per_file[f], 1), tests=tests_per_file[f]) for f in files},
                slowest=[dict(test=name, seconds=round(s, 2)) for s, name in slowest[:25]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("xml")
    ap.add_argument("--wall", type=float, help="wall seconds of the pytest run")
    ap.add_argument("--env", help="env.json of the run (device, versions, commit, date)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    record = summarize(args.xml)
    record["wall_seconds"] = args.wall
    if args.env:
        with open(args.env) as f:
            record = json.load(f) | record
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    c = record["counts"]
    print(f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, {c['skipped']} skipped"
          f" in {args.wall} s wall")


if __name__ == "__main__":
    main()
