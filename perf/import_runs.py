"""Turn the model and expert-parallel benchmark outputs into dashboard records (perf/results.py's `kind: "model"`
and `kind: "multi-gpu"`), appended to the device's results file:

    python -m perf.import_runs models perf/results/experiments/<date>-h200-models-*.json
    python -m perf.import_runs ep perf/results/experiments/<date>-h200x2-ep-moe-*.jsonl

The inputs are what `python -m perf.models` and `torchrun ... perf/ep_moe.py` write on the GPU machine.
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
                        repro=f"python -m perf.models --models {r['model']} --layers {meta['layers']} --no-compile"))
    return out


def ep_records(lines: list[dict]) -> list[dict]:
    out = []
    for r in lines:
        run = _run_id("ep", r["date"], r["git_commit"])
        if r["bench"] == "nccl_all_to_all":
            op, case, provider = "all_to_all", f"{r['stage']} {r['format']} {r['bytes']} B", "nccl"
        elif r["bench"] == "single_gpu":
            op, case, provider = "ep_moe_layer", f"prefill {r['tokens']} tokens, all experts on one GPU", "one-gpu"
        else:
            what = "prefill" if r["bench"] == "ep_prefill" else "decode"
            op, case, provider = "ep_moe_layer", f"{what} {r['tokens']} tokens/rank {r.get('format', 'bf16')}", "lowbit"
        out.append(dict(schema=1, run_id=run, timestamp=r["date"], git_commit=r["git_commit"], device=r["device"],
                        device_slug=_slug(r["device"]) + f"-x{r['world']}", arch="sm_90", versions=r["versions"],
                        kind="multi-gpu", op=op, case=case, bucket="decode" if "decode" in case else "prefill",
                        params=dict(world_size=r["world"]), world_size=r["world"], provider=provider,
                        timing="cuda-graph" if r.get("graph") else "events", status="ok", median_us=r["us"],
                        gbps=r.get("gbs"), repro="torchrun --nproc-per-node 2 perf/ep_moe.py --out ep_moe.jsonl"))
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
