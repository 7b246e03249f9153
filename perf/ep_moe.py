"""Expert-parallel MoE benchmark (docs/ep.md), public API only. Launch on one host with two GPUs:

    torchrun --nproc-per-node 2 -m perf.ep_moe [--out perf/results/experiments/ep_moe.jsonl]

and on the CPU (gloo, tiny dims, the Triton kernels under the interpreter; times mean nothing, every path runs):

    torchrun --nproc-per-node 2 -m perf.ep_moe --smoke

DeepSeek-V3 experts (hidden 7168, inner 2048, 256 experts split 128 / 128, top-8, bf16 weights). Records (rank 0
writes them, one JSON line each, with device, versions, commit and date); a time is the median over iterations of
the slowest rank's time (a collective ends when the last rank ends):

* ep_prefill (4096 tokens per rank; bf16 / FP8 dispatch x entry / rank combine): the whole EP=2 layer, and each of
  its stages (PREFILL_STAGES) from events recorded by the layer's stage hook;
* a2a_stage: each all_to_all stage of the layer (dispatch, combine) next to NCCL's bare all_to_all_single on
  buffers of exactly the same bytes and splits: both times, GB/s (mean bytes each rank sends, self included, per
  second) and nccl_us / stage_us (the bar: >= 0.8);
* fp8_dispatch: FP8 against bf16 dispatch, bytes and times (dispatch stage, pack stage, whole layer);
* single_gpu: moe_layer with all 256 experts on one GPU on one rank's and both ranks' token counts;
* ep_decode (64 tokens per rank, capacity 64): the whole layer replayed from a CUDA graph, per combine, and its
  stages timed eagerly (events cannot time inside a graph replay) with the same NCCL comparison.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also runnable as a script by torchrun


@dataclass(frozen=True)
class Dims:
    hidden: int
    inner: int
    experts: int
    top_k: int
    prefill_tokens: int
    decode_tokens: int
    iters: int
    warmup: int
    layer_timed_alone: bool  # also time the layer without the stage hook (False: the staged run's total)


FULL = Dims(hidden=7168, inner=2048, experts=256, top_k=8, prefill_tokens=4096, decode_tokens=64, iters=20, warmup=3,
            layer_timed_alone=True)
SMOKE = Dims(hidden=256, inner=128, experts=8, top_k=4, prefill_tokens=16, decode_tokens=4, iters=1, warmup=0,
             layer_timed_alone=False)


# The stages issued right before an all_to_all: a settled run waits there until every rank has finished them.
BEFORE_EXCHANGE = ("pack", "experts")


class Clock:
    """Timestamps on the device's own timeline: CUDA events on a GPU; on the CPU the host clock (gloo and the
    CPU kernels run synchronously). `stage(name)` is the layer's stage hook; `stages()` the durations in us.

    settle: before the mark that starts an exchange (BEFORE_EXCHANGE), drain the device and meet the other
    ranks at a barrier, so the exchange's time is its own (issue and transfer), as the bare call's is, and not
    the wait for the slowest rank's previous stage."""

    def __init__(self, dev: torch.device, settle: bool = False):
        self.cuda = dev.type == "cuda"
        self.settle = settle
        self.marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def stage(self, name: str) -> None:
        if self.settle and name in BEFORE_EXCHANGE:
            if self.cuda:
                torch.cuda.synchronize()
            dist.barrier()
        self.marks.append((name, self._now()))

    def stages(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, a), (name, b) in zip(self.marks, self.marks[1:], strict=False):
            out[name] = a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6
        return out


def _slowest(values: list[float], dev: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _median(rows: list[list[float]]) -> list[float]:
    return [sorted(col)[len(col) // 2] for col in zip(*rows, strict=True)]


def _time_stages(fn, dev: torch.device, d: Dims, settle: bool = False) -> tuple[dict[str, float], object]:
    """(per-stage and total us, the last call's output): fn(clock.stage) runs the layer with the hook; median
    over iterations of the slowest rank. settle: see Clock."""
    for _ in range(d.warmup):
        fn(None)
    rows, names, out = [], None, None
    for _ in range(d.iters):
        dist.barrier()
        clock = Clock(dev, settle)
        clock.start()
        out = fn(clock.stage)
        clock.stage("total")
        st = clock.stages()
        total = sum(st.values())
        st.pop("total")
        names = list(st) + ["total"]
        rows.append(_slowest(list(st.values()) + [total], dev))
    return dict(zip(names, _median(rows), strict=True)), out


def _time_us(fn, dev: torch.device, d: Dims) -> float:
    return _time_stages(lambda hook: fn(), dev, d)[0]["total"]


def _metadata(dev: torch.device, smoke: bool) -> dict:
    import triton

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or None
    versions = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version())
    if dev.type == "cuda":
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (gloo smoke run)",
                world=dist.get_world_size(), smoke=smoke, versions=versions,
                git_commit=os.environ.get("LOWBIT_GIT_COMMIT") or commit,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))


def _experts(dev: torch.device, d: Dims) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bf16 experts on every rank: one seeded device generator, drawn one expert at a time (no fp32 copy
    of the whole set)."""
    g = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.empty(d.experts, 2 * d.inner, d.hidden, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(d.experts, d.hidden, d.inner, dtype=torch.bfloat16, device=dev)
    for e in range(d.experts):
        w1[e] = torch.randn(2 * d.inner, d.hidden, generator=g, device=dev) / d.hidden ** 0.5
        w2[e] = torch.randn(d.hidden, d.inner, generator=g, device=dev) / d.inner ** 0.5
    return w1, w2


def _routing(tokens: int, seed: int, dev: torch.device, d: Dims):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d.hidden, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(d.experts, generator=g)[:d.top_k] for _ in range(tokens)])
    return x, ids.to(torch.int32).to(dev), torch.rand(tokens, d.top_k, generator=g).to(dev)


def _bare_a2a(send_rows: list[int], recv_rows: list[int], row_bytes: int, dev: torch.device, d: Dims) -> dict:
    """NCCL's (gloo's) own all_to_all_single on uint8 buffers of exactly these splits and row width."""
    from dispatch.distributed import exchange_rows

    send = torch.zeros(sum(send_rows), row_bytes, dtype=torch.uint8, device=dev)
    recv = torch.empty(sum(recv_rows), row_bytes, dtype=torch.uint8, device=dev)
    us = _time_us(lambda: exchange_rows(recv, send, recv_rows, send_rows, None), dev, d)
    mean_bytes = _mean(float(send.numel()), dev)
    return dict(bytes_per_rank=mean_bytes, nccl_us=us, nccl_gbs=mean_bytes / us / 1e3)


def _mean(value: float, dev: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def _a2a_records(bench: str, stages: dict, settled: dict, splits: dict, dev: torch.device, d: Dims,
                 **key) -> list[dict]:
    """One a2a_stage record per all_to_all stage: the layer's stage time next to the bare call at its splits.
    stage_us: the settled run's (the exchange alone, as the bare call is timed); in_flow_us: the unsettled
    run's, which also holds the wait for the slowest rank's previous stage."""
    out = []
    for stage, (send_rows, recv_rows, row_bytes) in splits.items():
        bare = _bare_a2a(send_rows, recv_rows, row_bytes, dev, d)
        us, flow = settled[stage], stages[stage]
        out.append(dict(bench="a2a_stage", layer=bench, stage=stage, **key, row_bytes=row_bytes, stage_us=us,
                        stage_gbs=bare["bytes_per_rank"] / us / 1e3, **bare, ratio=bare["nccl_us"] / us,
                        in_flow_us=flow, in_flow_ratio=bare["nccl_us"] / flow))
    return out


def _prefill(ctx: dict, d: Dims) -> list[dict]:
    from dispatch.distributed import ep_moe_prefill, exchange_sizes, message_row_bytes

    dev = ctx["dev"]
    x, ids, w = _routing(d.prefill_tokens, 1 + dist.get_rank(), dev, d)
    sizes = exchange_sizes(ids, d.experts)
    records, by_fmt = [], {}
    for fmt in ("bf16", "fp8"):
        for combine in ("entry", "rank"):
            fp8 = fmt == "fp8"
            run = lambda hook, fp8=fp8, combine=combine: ep_moe_prefill(  # noqa: E731
                x, ids, w, ctx["lw1"], ctx["lw2"], num_experts=d.experts, fp8_dispatch=fp8, combine=combine,
                stage_hook=hook, backend=ctx["backend"])
            stages, _ = _time_stages(run, dev, d)
            settled, _ = _time_stages(run, dev, d, settle=True)
            layer_us = _time_us(lambda run=run: run(None), dev, d) if d.layer_timed_alone else stages["total"]
            disp_row, comb_row = message_row_bytes(d.hidden, d.top_k, x.dtype, fp8_dispatch=fp8, combine=combine)
            back = (sizes.tokens_recv, sizes.tokens_send) if combine == "rank" else (sizes.entries_recv,
                                                                                     sizes.entries_send)
            splits = dict(dispatch=(sizes.tokens_send, sizes.tokens_recv, disp_row), combine=(*back, comb_row))
            key = dict(tokens=d.prefill_tokens, format=fmt, combine=combine)
            records.append(dict(bench="ep_prefill", **key, us=layer_us, stages_us=stages, settled_stages_us=settled,
                                dispatch_bytes=sum(sizes.tokens_send) * disp_row,
                                combine_bytes=sum(back[0]) * comb_row))
            records += _a2a_records("ep_prefill", stages, settled, splits, dev, d, **key)
            by_fmt[fmt, combine] = records[-3:]
    for combine in ("entry", "rank"):
        (b_layer, b_disp, _), (f_layer, f_disp, _) = by_fmt["bf16", combine], by_fmt["fp8", combine]
        records.append(dict(bench="fp8_dispatch", tokens=d.prefill_tokens, combine=combine,
                            bytes_ratio=f_disp["bytes_per_rank"] / b_disp["bytes_per_rank"],
                            dispatch_us=dict(bf16=b_disp["stage_us"], fp8=f_disp["stage_us"]),
                            pack_us=dict(bf16=b_layer["stages_us"]["pack"], fp8=f_layer["stages_us"]["pack"]),
                            experts_us=dict(bf16=b_layer["stages_us"]["experts"],
                                            fp8=f_layer["stages_us"]["experts"]),
                            layer_us=dict(bf16=b_layer["us"], fp8=f_layer["us"])))
    return records


def _decode(ctx: dict, d: Dims) -> list[dict]:
    from dispatch.distributed import ep_moe_decode, message_row_bytes
    from perf.runner import capture_graph

    dev, rank, world = ctx["dev"], dist.get_rank(), dist.get_world_size()
    x, ids, w = _routing(d.decode_tokens, 50 + rank, dev, d)
    cap = d.decode_tokens
    records = []
    for combine in ("entry", "rank"):
        run = lambda hook, combine=combine: ep_moe_decode(  # noqa: E731
            x, ids, w, ctx["lw1"], ctx["lw2"], num_experts=d.experts, capacity=cap, combine=combine,
            stage_hook=hook, backend=ctx["backend"])
        stages, captured = _time_stages(run, dev, d)
        settled, _ = _time_stages(run, dev, d, settle=True)
        us = stages["total"]  # the CPU smoke: no graph, the staged run's total
        if dev.type == "cuda":
            graph, captured = capture_graph(functools.partial(run, None), dev, warmup=3)
            us = _time_us(graph.replay, dev, d)
        disp_row, comb_row = message_row_bytes(d.hidden, d.top_k, x.dtype, combine=combine)
        back_rows = world * cap * (d.top_k if combine == "entry" else 1)
        equal = lambda rows: [rows // world] * world  # noqa: E731
        splits = dict(dispatch=(equal(world * cap), equal(world * cap), disp_row),
                      combine=(equal(back_rows), equal(back_rows), comb_row))
        key = dict(tokens=d.decode_tokens, capacity=cap, combine=combine)
        records.append(dict(bench="ep_decode", **key, graph=dev.type == "cuda", us=us, eager_stages_us=stages,
                            settled_stages_us=settled,
                            dispatch_bytes=world * cap * disp_row, combine_bytes=back_rows * comb_row,
                            dropped=captured.dropped.tolist()))
        records += _a2a_records("ep_decode", stages, settled, splits, dev, d, **key)
    return records


def _single_gpu(ctx: dict, d: Dims) -> list[dict]:
    from dispatch.ops import moe_layer

    records = []
    for tokens in (d.prefill_tokens, dist.get_world_size() * d.prefill_tokens):
        xs, ids_s, ws = _routing(tokens, 99, ctx["dev"], d)
        us = _time_us(lambda xs=xs, ids_s=ids_s, ws=ws: moe_layer(xs, ids_s, ws, ctx["w1"], ctx["w2"],
                                                                  backend=ctx["backend"]), ctx["dev"], d)
        records.append(dict(bench="single_gpu", tokens=tokens, experts=d.experts, us=us))
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "ep_moe.jsonl")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny dims, kernels under the interpreter")
    args = ap.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module is imported (dispatch is lazy here)
        dist.init_process_group("gloo")
        dev, d, backend = torch.device("cpu"), SMOKE, "triton"
    else:
        dist.init_process_group("nccl")
        dev, d, backend = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank()))), FULL, "auto"
        torch.cuda.set_device(dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = _metadata(dev, args.smoke)
    w1, w2 = _experts(dev, d)  # all experts on each device (the single-GPU comparison): 22.5 GB bf16 at full dims
    n = d.experts // world
    ctx = dict(dev=dev, backend=backend, w1=w1, w2=w2, lw1=w1[rank * n:(rank + 1) * n], lw2=w2[rank * n:(rank + 1) * n])
    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    for part in (_prefill, _single_gpu, _decode):
        records = part(ctx, d)
        if rank == 0:  # each part's records as soon as they exist: a run cut short keeps what it measured
            with open(args.out, "a") as f:
                for r in records:
                    f.write(json.dumps({**meta, **r}) + "\n")
            for r in records:
                print(json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
