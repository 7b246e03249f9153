"""Paged decode configurations against cuDNN SDPA, under CUDA graphs, on one GPU: which split count, key tile,
warp count and pipeline depth read the KV cache fastest at each shape, and how far each is from the read roof.

    python -m perf.decode_sweep --out sweep.json [--budget-s 200] [--kv fp8] [--grid '{"num_warps": [2, 4]}']

Shapes: the Llama GQA decode shapes of docs/attention.md (32/8 and 64/8 heads, hd 128, page 64), bf16 and FP8 E4M3
caches. Per shape: the rule's configuration (`ops.attention_decode`, backend "triton"), then every configuration
of the grid (`dispatch.variants.attention_decode_configured`), and the peer `sdpa-cudnn` on a dense bf16 copy of the
same values. The read roof is measured here: a full reduction (`torch.sum`) over a buffer larger than L2, bytes
read / time. Records: shape, provider, config, us, GB/s of KV read, fraction of the read roof, ratio to cuDNN.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time

import torch

from dispatch import ops, variants

from .cases.attention import _decode_case
from .results import measured_commit
from .runner import time_passes

SHAPES = (  # (batch, context, Hq, Hkv, kv)
    (16, 8192, 32, 8, "bf16"), (64, 8192, 32, 8, "bf16"), (256, 1024, 32, 8, "bf16"), (1, 131072, 32, 8, "bf16"),
    (16, 8192, 64, 8, "bf16"), (64, 8192, 64, 8, "bf16"),
    (16, 8192, 32, 8, "fp8"), (64, 8192, 32, 8, "fp8"),
)
GRID = dict(block_n=(64, 128), num_warps=(4, 8), num_stages=(2, 3, 4), v_f16_smem=(None,))  # None: the rule's
SPLIT_FACTORS = (0.5, 1, 2, 4)  # times the rule's split count


def read_roof_gbs(device) -> float:
    """Bytes per second of a read-only full reduction over 2 GiB of bf16 (no writes), best of 5."""
    x = torch.randn(1 << 30, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        x.sum(dtype=torch.float32)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return x.numel() * 2 / best / 1e9


def sweep_shape(shape, device, roof_gbs: float, deadline: float, grid: dict, split_factors) -> list[dict]:
    bsz, ctx, hq, hkv, kv = shape
    case = _decode_case("llama", bsz, ctx, hq, hkv, 128, kv=kv)
    i = case.make(device)
    scale = 128 ** -0.5
    label = f"B={bsz} ctx={ctx} H={hq}/{hkv} {kv}"

    def timed(fn) -> float:
        return time_passes(lambda a: fn(a), [i], device, graph=True, budget_s=0.15).median_us

    records = []

    def add(provider: str, config: dict | None, us: float) -> None:
        gbs = case.bytes_moved / us / 1e3
        records.append(dict(shape=label, provider=provider, config=config, us=round(us, 2), kv_gbs=round(gbs, 1),
                            read_roof_fraction=round(gbs / roof_gbs, 3)))

    if "sdpa-cudnn" in case.peers:
        add("sdpa-cudnn", None, timed(case.peers["sdpa-cudnn"]))
    rule = variants.attention_decode_rule(i["q"], i["k_cache"], i["v_cache"], i["table"])
    add("lowbit", rule, timed(lambda a: ops.attention_decode(
        a["q"], a["k_cache"], a["v_cache"], a["table"], a["seqused"], k_scale=a["k_scale"], v_scale=a["v_scale"],
        backend="triton")))
    splits = sorted({max(1, int(rule["num_splits"] * f)) for f in split_factors} | {1})
    for ns, *values in itertools.product(splits, *(grid[key] for key in GRID)):
        if time.monotonic() > deadline:
            print(f"decode_sweep: {label}: budget spent, grid cut")
            break
        config = dict(num_splits=ns, **dict(zip(GRID, values, strict=True)))
        try:
            us = timed(lambda a, c=config: variants.attention_decode_configured(
                a["q"], a["k_cache"], a["v_cache"], a["table"], a["seqused"], scale, k_scale=a["k_scale"],
                v_scale=a["v_scale"], **c))
        except Exception as exc:  # a configuration that does not fit (shared memory, registers) is recorded as such
            records.append(dict(shape=label, provider="lowbit-config", config=config, error=str(exc)[:200]))
            continue
        add("lowbit-config", config, us)
    peer = next((r["us"] for r in records if r["provider"] == "sdpa-cudnn"), None)
    for r in records:
        if peer and "us" in r:
            r["vs_cudnn"] = round(peer / r["us"], 3)
    i.clear()
    torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--kv", choices=("bf16", "fp8"), help="only the shapes with this cache dtype")
    parser.add_argument("--grid", type=json.loads, default={},
                        help="JSON: replaces lists of GRID (its keys) and split_factors")
    args = parser.parse_args()
    grid = {**GRID, **{key: val for key, val in args.grid.items() if key in GRID}}
    split_factors = args.grid.get("split_factors", SPLIT_FACTORS)
    shapes = [shape for shape in SHAPES if args.kv in (None, shape[-1])]
    device = torch.device("cuda")
    roof = read_roof_gbs(device)
    print(f"decode_sweep: read roof {roof:.0f} GB/s")
    deadline = time.monotonic() + args.budget_s
    per_shape = args.budget_s / len(shapes)
    records = []
    for shape in shapes:
        records += sweep_shape(shape, device, roof, min(deadline, time.monotonic() + per_shape * 1.5), grid,
                               split_factors)
        best = min((r for r in records if r.get("shape") == records[-1]["shape"] and "us" in r and
                    r["provider"] != "sdpa-cudnn"), key=lambda r: r["us"])
        print(json.dumps(dict(best=best)))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, commit=measured_commit(),
                date=datetime.date.today().isoformat(),
                read_roof_gbs=round(roof, 1), grid=grid, split_factors=list(split_factors))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
