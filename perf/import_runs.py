"""Turn the model and expert-parallel benchmark outputs into dashboard records (perf/results.py's `kind: "model"`
and `kind: "multi-gpu"`), appended to the device's results file:

    python -m perf.import_runs models perf/results/experiments/<date>-h200-models-*.json
    python -m perf.import_runs ep perf/results/experiments/<date>-h200x2-ep-moe-*.jsonl

The inputs are what `python -m perf.models` and `torchrun ... -m perf.ep_moe` write on the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _slug(device: str) -> str:
    return device.lower().replace(" ", "-")


def _run_id(*parts: str) -> str:
    return hashlib.sha1("/".join(parts).encode()).hexdigest()[:12]


def model_records(doc: dict) -> list[dict]:
    meta = doc["meta"]
    commit = meta.get("commit")
    run = _run_id("models", meta["date"], str(commit))
    out = []
    for r in doc["records"]:
        if "ms" not in r:  # a variant that failed (its error is in the benchmark's own file)
            continue
        prefill = r["shape"].startswith("prefill")
        dims = [int(x) for x in r["shape"].split()[1].strip("b").split("x")] if prefill else None
        batch = dims[0] if prefill else int(r["shape"].split()[1].lstrip("b"))
        tokens = dims[0] * dims[1] if prefill else batch
        out.append(dict(schema=1, run_id=run, timestamp=f"{meta['date']}T00:00:00+00:00", git_commit=commit,
                        device=meta["device"], device_slug=_slug(meta["device"]), arch="sm_90",
                        versions=dict(torch=meta["torch"]), kind="model", op=f"model:{r['model']}", case=r["shape"],
                        bucket="prefill" if prefill else "decode",
                        params=dict(model=r["model"], layers=meta["layers"], batch=batch, tokens=tokens),
                        provider="lowbit" if r["variant"] == "lowbit" else r["variant"],
                        timing="events", status="ok", median_us=r["ms"] * 1e3,
                        tokens_per_s=tokens / (r["ms"] * 1e-3),
                        repro=f"python -m perf.models --models {r['model']} --layers {meta['layers']} "
                              "--out models.json"))
    return out


def _ep_case(r: dict) -> tuple[str, str, str, float, float | None]:
    """(op, case, provider, median us, GB/s) of one benchmark line (layouts before and after the stage records)."""
    combine = f" {r['combine']} combine" if "combine" in r else ""
    if r["bench"] == "nccl_all_to_all":
        return "all_to_all", f"{r['stage']} {r['format']} {r['bytes']} B", "nccl", r["us"], r["gbs"]
    if r["bench"] == "single_gpu":
        return "ep_moe_layer", f"prefill {r['tokens']} tokens, all experts on one GPU", "one-gpu", r["us"], None
    what = "prefill" if r["bench"] == "ep_prefill" else "decode"
    return ("ep_moe_layer", f"{what} {r['tokens']} tokens/rank {r.get('format', 'bf16')}{combine}", "lowbit", r["us"],
            None)


def _a2a_cases(r: dict) -> list[tuple[str, str, str, float, float | None]]:
    """An a2a_stage line: the layer's stage and NCCL's bare call at the same splits, as two rows of one case."""
    what = "prefill" if r["layer"] == "ep_prefill" else "decode"
    case = (f"{what} {r['tokens']} tokens/rank {r['stage']} {r.get('format', 'bf16')} {r['combine']} combine "
            f"{r['bytes_per_rank']:.0f} B/rank")
    rows = [("all_to_all", case, "nccl", r["nccl_us"], r["nccl_gbs"]),
            ("all_to_all", case, "lowbit", r["stage_us"], r["stage_gbs"])]
    if "in_flow_us" in r:  # the same stage inside the running layer: it also waits for the slowest rank
        flow = r["in_flow_us"]
        rows.append(("all_to_all", case, "lowbit-in-flow", flow, r["bytes_per_rank"] / flow / 1e3))
    return rows


def ep_records(lines: list[dict]) -> list[dict]:
    out = []
    for r in lines:
        if r.get("smoke"):
            raise SystemExit("import_runs ep: a --smoke line (CPU, tiny dims) is not a result")
        if r["bench"] == "fp8_dispatch":
            continue  # ratios of the ep_prefill / a2a_stage lines, which are imported themselves
        run = _run_id("ep", r["date"], r["git_commit"])
        for op, case, provider, us, gbs in (_a2a_cases(r) if r["bench"] == "a2a_stage" else [_ep_case(r)]):
            out.append(dict(schema=1, run_id=run, timestamp=r["date"], git_commit=r["git_commit"], device=r["device"],
                            device_slug=_slug(r["device"]) + f"-x{r['world']}", arch="sm_90", versions=r["versions"],
                            kind="multi-gpu", op=op, case=case, bucket="decode" if "decode" in case else "prefill",
                            params=dict(world_size=r["world"]), world_size=r["world"], provider=provider,
                            timing="cuda-graph" if r.get("graph") else "events", status="ok", median_us=us,
                            gbps=gbs, repro="torchrun --nproc-per-node 2 -m perf.ep_moe --out ep_moe.jsonl"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("models", "ep"))
    ap.add_argument("path")
    args = ap.parse_args()
    text = Path(args.path).read_text()
    if args.what == "models":
        recs = model_records(json.loads(text))
    else:
        recs = ep_records([json.loads(line) for line in text.splitlines() if line.strip()])
    target = RESULTS / f"{recs[0]['device_slug']}.jsonl"
    with target.open("a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
    print(f"{len(recs)} records appended to {target}")


if __name__ == "__main__":
    main()
