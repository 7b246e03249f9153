"""Expert-parallel MoE benchmark (docs/ep.md), public API only. Launch on one host with two GPUs:

    torchrun --nproc-per-node 2 perf/ep_moe.py [--out perf/results/experiments/ep_moe.jsonl]

DeepSeek-V3 experts (hidden 7168, inner 2048, 256 experts split 128 / 128, top-8, bf16 weights). Records (rank 0
writes them, one JSON line each, with device, versions, commit and date):

* nccl_all_to_all: NCCL's own all_to_all_single on buffers the size of the layer's dispatch (bf16 and FP8 rows) and
  combine messages: time and GB/s (bytes each rank sends, self included, per second);
* ep_prefill (4096 tokens per rank, bf16 and FP8 dispatch) and ep_decode (64 tokens per rank, replayed from a CUDA
  graph): the whole EP=2 layer, with the bytes its dispatch and combine move;
* single_gpu: moe_layer with all 256 experts on one GPU, the same tokens (per rank's count, and both ranks' count).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script by torchrun

from dispatch.distributed import ep_moe_decode, ep_moe_prefill, exchange_rows  # noqa: E402
from dispatch.ops import moe_layer  # noqa: E402

H, INNER, E, K = 7168, 2048, 256, 8
FP8_ROW = H + 4 * (H // 128)  # codes + fp32 1x128 scales
ID_BYTES = 4 * K


def _metadata(device: torch.device) -> dict:
    import triton

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    return dict(device=torch.cuda.get_device_name(device), world=dist.get_world_size(),
                versions=dict(torch=torch.__version__, triton=triton.__version__, nccl=".".join(
                    map(str, torch.cuda.nccl.version())), python=platform.python_version()),
                git_commit=os.environ.get("LOWBIT_GIT_COMMIT") or commit,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _time_us(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median over iterations of the slowest rank's time (a collective ends when the last rank ends)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end) * 1e3], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return sorted(times)[len(times) // 2]


def _experts(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bf16 experts on every rank: one seeded device generator, drawn one expert at a time (no fp32 copy
    of the whole set)."""
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.empty(E, 2 * INNER, H, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(E, H, INNER, dtype=torch.bfloat16, device=dev)
    for e in range(E):
        w1[e] = torch.randn(2 * INNER, H, generator=g, device=dev) / H ** 0.5
        w2[e] = torch.randn(H, INNER, generator=g, device=dev) / INNER ** 0.5
    return w1, w2


def _routing(tokens: int, seed: int, dev: torch.device):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).to(torch.int32).to(dev)
    return x, ids, torch.rand(tokens, K, generator=g).to(dev)


def _message_rows(ids: torch.Tensor, world: int) -> tuple[int, int]:
    """(tokens sent summed over destinations, entries returned) of one rank for this routing."""
    dest = ids.long() // (E // world)
    tokens = sum(int((dest == r).any(1).sum()) for r in range(world))
    return tokens, ids.numel()


def _nccl(rows: int, row_bytes: int, dev) -> tuple[float, float]:
    world = dist.get_world_size()
    rows -= rows % world
    send = torch.empty(rows, row_bytes, dtype=torch.uint8, device=dev)
    recv = torch.empty_like(send)
    us = _time_us(lambda: exchange_rows(recv, send, None, None, None))
    return us, send.numel() / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "ep_moe.jsonl")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(dev)
    meta = _metadata(dev)
    records = []
    w1, w2 = _experts(dev)  # all 256 experts on each GPU (the single-GPU comparison): 22.5 GB bf16
    n = E // world
    lw1, lw2 = w1[rank * n:(rank + 1) * n], w2[rank * n:(rank + 1) * n]

    x, ids, w = _routing(args.prefill_tokens, 1 + rank, dev)
    sent, entries = _message_rows(ids, world)
    for fmt, row in (("bf16", 2 * H + ID_BYTES), ("fp8", FP8_ROW + ID_BYTES)):
        us, gbs = _nccl(sent, row, dev)
        records.append(dict(bench="nccl_all_to_all", stage="dispatch", format=fmt, bytes=sent * row, us=us, gbs=gbs))
        fp8 = fmt == "fp8"
        us = _time_us(lambda fp8=fp8: ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=E, fp8_dispatch=fp8))
        records.append(dict(bench="ep_prefill", tokens=args.prefill_tokens, format=fmt, dispatch_bytes=sent * row,
                            combine_bytes=entries * 2 * H, us=us))
    us, gbs = _nccl(entries, 2 * H, dev)
    records.append(dict(bench="nccl_all_to_all", stage="combine", format="bf16", bytes=entries * 2 * H, us=us,
                        gbs=gbs))

    for tokens in (args.prefill_tokens, world * args.prefill_tokens):
        xs, ids_s, ws = _routing(tokens, 99, dev)
        us = _time_us(lambda xs=xs, ids_s=ids_s, ws=ws: moe_layer(xs, ids_s, ws, w1, w2))
        records.append(dict(bench="single_gpu", tokens=tokens, experts=E, us=us))

    xd, idd, wd = _routing(args.decode_tokens, 50 + rank, dev)
    step = lambda: ep_moe_decode(xd, idd, wd, lw1, lw2, num_experts=E, capacity=args.decode_tokens)  # noqa: E731
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    us = _time_us(graph.replay)
    records.append(dict(bench="ep_decode", tokens=args.decode_tokens, graph=True, us=us,
                        dropped=captured.dropped.tolist()))
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            for r in records:
                f.write(json.dumps({**meta, **r}) + "\n")
        for r in records:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
