"""How far the per-rank combine of the expert-parallel layer (combine="rank", docs/ep.md) lands from the
single-rank slot-order combine, on the CPU (the deviation is the fp32 sum order's alone: both read the same bf16
expert rows and fp32 products; the GPU combine kernel rounds w * v and each add separately, like torch here).

    python -m perf.ep_combine_order [--tokens 4096] [--out perf/results/experiments/ep_combine_order.json]

Model: DeepSeek-V3 shapes (hidden 7168, 256 experts over `--world` ranks, top-8 distinct ids), expert rows
N(0, 1) rounded to bf16, router weights sigmoid scores normalized over the top-8 times the routed scaling 2.5.
Compared: slot order ((w0 v0 + w1 v1) + ...) -> bf16 (what moe_layer computes) against per rank in slot order, then
ranks in order, in fp32 -> bf16 ("rank") and with each partial rounded to bf16 on the way ("rank, bf16 partials").
Reports the bf16 ulp distances and the largest |difference| / (2^-24 * sum_j |w_j v_j|): the a priori bound of a
reordered fp32 sum of k terms is 2 (k - 1) in those units, plus the final rounding's half ulp each side.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

H, E, K, SCALING = 7168, 256, 8, 2.5


def _ordered(x: torch.Tensor) -> torch.Tensor:
    b = x.contiguous().view(torch.int16).int()
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _chunk(g: torch.Generator, t: int, world: int) -> dict:
    ids = torch.rand(t, E, generator=g).argsort(dim=1)[:, :K]
    s = torch.sigmoid(torch.randn(t, K, generator=g))
    w = s / s.sum(1, keepdim=True) * SCALING
    v = torch.randn(t, K, H, generator=g).bfloat16().float()
    terms = w[:, :, None] * v  # fp32 products, rounded once each (as the combine kernel does)
    ref = torch.zeros(t, H)
    for j in range(K):
        ref = ref + terms[:, j]
    rank = ids // (E // world)
    fp32, bf16 = torch.zeros(t, H), torch.zeros(t, H)
    for r in range(world):
        part = torch.zeros(t, H)
        for j in range(K):
            part = part + torch.where((rank[:, j] == r)[:, None], terms[:, j], 0.0)
        fp32 = fp32 + part
        bf16 = bf16 + part.bfloat16().float()
    scale = 2.0 ** -24 * terms.abs().sum(1)
    want = ref.bfloat16()
    out = {}
    for name, got in (("rank", fp32), ("rank_bf16_partials", bf16)):
        ulps = (_ordered(got.bfloat16()) - _ordered(want)).abs()
        out[name] = dict(ulps=torch.bincount(ulps.reshape(-1).clamp(max=8), minlength=9),
                         fp32_over_bound_unit=float(((got - ref).abs() / scale).max()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    total: dict = {}
    for start in range(0, args.tokens, 256):
        for name, r in _chunk(g, min(256, args.tokens - start), args.world).items():
            acc = total.setdefault(name, dict(ulps=torch.zeros(9, dtype=torch.long), fp32_over_bound_unit=0.0))
            acc["ulps"] += r["ulps"]
            acc["fp32_over_bound_unit"] = max(acc["fp32_over_bound_unit"], r["fp32_over_bound_unit"])
    n = args.tokens * H
    record = dict(bench="ep_combine_order", tokens=args.tokens, hidden=H, experts=E, top_k=K, world=args.world,
                  torch=torch.__version__, elements=n)
    for name, acc in total.items():
        u = acc["ulps"].tolist()
        record[name] = dict(ulps_0=u[0], ulps_1=u[1], ulps_2=u[2], ulps_3_to_7=sum(u[3:8]), ulps_8_or_more=u[8],
                            max_diff_in_2e_minus_24_sum_abs_terms=acc["fp32_over_bound_unit"])
    print(json.dumps(record, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
