"""The prepacked FP4 MoE GEMM's configurations at GPT-OSS decode shapes against triton_kernels, in one process,
under CUDA graphs: which tile (weight rows, K step, warps, stages, scale options) streams the weights fastest.

    python -m perf.scripts.fp4_decode_sweep --out sweep.json [--grid '{"block_k": [128, 256]}'] [--budget-s 300]

Per case (the benchmark's decode labels, perf/cases/moe_gemm.py): the rule (`backend="triton"`), the peer
`triton_kernels` (prepared as the benchmark prepares it) and every configuration of the grid
(`dispatch.variants.moe_gemm_fp4_prepacked_configured`), each checked against the case's reference first.
Records: case, provider, config, us, normalized error, GB/s of the case's bytes, ratio to triton_kernels.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time

import torch

from dispatch import variants

from ..results import measured_commit
from ..runner import load_cases
from .sweep import checked_timings

CASES = ("gpt-oss-20b gemm1 E=32 8 rows/expert N=5760 K=2880 mxfp4 prepacked contiguous",
         "gpt-oss-120b gemm1 E=128 16 rows/expert N=5760 K=2880 mxfp4 prepacked contiguous")
GRID = dict(block_n=(64, 128), block_k=(128, 256), num_warps=(4,), num_stages=(3, 4, 5),
            options=("plain", "fold", "words_fold"))
OPTIONS = {"plain": dict(scale_words=False, fold_scale="off"), "fold": dict(scale_words=False, fold_scale="tile"),
           "fold_loop": dict(scale_words=False, fold_scale="loop"),
           "words_fold": dict(scale_words=True, fold_scale="tile")}


def configs(grid: dict | list) -> list[dict]:
    """The grid's product (a dict of value lists), or a list of configs as given (each with its options name)."""
    if isinstance(grid, list):
        return [{**OPTIONS.get(c.get("options"), {}), **{k: v for k, v in c.items() if k != "options"}} for c in grid]
    keys = list(grid)
    out = []
    for values in itertools.product(*(grid[k] for k in keys)):
        c = dict(zip(keys, values, strict=True))
        out.append({**{k: v for k, v in c.items() if k != "options"}, **OPTIONS[c.get("options", "plain")]})
    return out


def sweep_case(case, device, grid: dict, deadline: float) -> list[dict]:
    i = case.make(device)
    want = case.reference(i)
    lay = (i.get("m_indices"), i.get("masked_m"))
    providers = {"rule": lambda: case.lowbit(i, "triton")}
    if "triton_kernels" in case.peers:
        providers["triton_kernels"] = lambda: case.peers["triton_kernels"](i)
    for c in configs(grid):
        providers[json.dumps(c)] = (lambda c=c: variants.moe_gemm_fp4_prepacked_configured(
            i["a"], i["w_values"], i["w_scales"], i.get("w_global"), case.params["kind"], *lay, config=c))
    rows = []
    for label, res in checked_timings(providers, want):
        rows.append(dict(case=case.label, provider=label if label in ("rule", "triton_kernels") else "config",
                         config=None if label in ("rule", "triton_kernels") else json.loads(label), **res))
        if "us" in res:
            rows[-1]["gbs"] = round(case.bytes_moved / res["us"] / 1e3, 1)
        if time.time() > deadline:
            rows.append(dict(case=case.label, stopped="budget"))
            break
    peer = next((r["us"] for r in rows if r.get("provider") == "triton_kernels" and "us" in r), None)
    for r in rows:
        if peer and "us" in r:
            r["vs_triton_kernels"] = round(peer / r["us"], 3)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--grid", default="", help="JSON overriding GRID's axes")
    ap.add_argument("--cases", default="", help="'|'-separated labels (default: CASES)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    args = ap.parse_args()
    given = json.loads(args.grid) if args.grid else {}
    grid = given if isinstance(given, list) else {**GRID, **given}
    labels = [x for x in args.cases.split("|") if x] or list(CASES)
    by_label = {c.label: c for c in load_cases(["moe_gemm_fp4_prepacked"])}
    device = torch.device("cuda")
    deadline = time.time() + args.budget_s
    records = []
    for label in labels:
        records += sweep_case(by_label[label], device, grid, deadline)
        for r in records[-3:]:
            print(json.dumps(r), flush=True)
    best = {}
    for r in records:
        if r.get("provider") == "config" and "us" in r and (r["case"] not in best or r["us"] < best[r["case"]]["us"]):
            best[r["case"]] = r
    meta = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, commit=measured_commit(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), grid=grid)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, best=best, records=records), f, indent=1)
    for r in best.values():
        print("best", json.dumps(r))


if __name__ == "__main__":
    main()
