"""The whole MoE layer on one GPU: `ops.moe_layer` fused (GEMM1 + SwiGLU (+ FP8 quantize) and GEMM2 + combine) against
the chain of lowbit's separate ops (`fused=False`) and against the same layer on torch's grouped GEMMs, with the
kernel time per stage from the profiler.

    python -m perf.moe_layer --out layer.json [--models dsv3,gpt_oss_120b] [--smoke]

Shapes: DeepSeek-V3 (hidden 7168, expert inner 2048, 256 experts top-8; bf16 and FP8 block-scaled weights) and
GPT-OSS-120b (hidden 2880, inner 2880, 128 experts top-4; bf16), SwiGLU (silu) in both; prefill 4096 tokens (the
contiguous layout) and decode 64 tokens (the masked layout, 64 rows per expert: no token dropped); uniform random
routing (distinct experts per token, softmax weights). Every variant is timed under a CUDA graph (perf/runner.py
`time_passes`, median over samples). The torch layer: a stable sort of the (token, slot) entries by expert, the
rows gathered, `torch._grouped_mm` for both GEMMs with the SwiGLU in between, the weighted rows added back in
token order with `index_add_` (bf16 only: torch's FP8 grouped GEMM takes rowwise scales, not 128x128 blocks).
Stages: the kernel time of one eager call of each variant under `torch.profiler`, per op family with the longest
kernels by name (`perf.models.op_families`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import torch

from dispatch import ops

from .models import op_families
from .results import measured_commit
from .runner import time_passes

FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden: int
    inner: int
    experts: int
    top_k: int
    weights: tuple[str, ...]


MODELS = {"dsv3": LayerShape(7168, 2048, 256, 8, ("bf16", "fp8")),
          "gpt_oss_120b": LayerShape(2880, 2880, 128, 4, ("bf16",))}
SMOKE = {"tiny": LayerShape(256, 128, 8, 2, ("bf16", "fp8"))}
TOKENS = {"prefill": 4096, "decode": 64}
SMOKE_TOKENS = {"prefill": 64, "decode": 4}


def make_weights(shape: LayerShape, kind: str, device) -> dict:
    """w1 (E, 2I, H) gate|up, w2 (E, H, I): bf16 with unit-variance outputs, or E4M3 codes with 128x128 scales."""
    e, i, h = shape.experts, shape.inner, shape.hidden
    if kind == "bf16":
        return dict(w1=torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16).mul_(h ** -0.5),
                    w2=torch.randn(e, h, i, device=device, dtype=torch.bfloat16).mul_(i ** -0.5))
    out = {}
    for name, (n, k) in (("w1", (2 * i, h)), ("w2", (h, i))):
        out[name] = torch.randn(e, n, k, device=device).clamp_(-8, 8).to(torch.float8_e4m3fn)
        out[f"{name}_scale"] = torch.rand(e, -(-n // FP8_BLOCK), k // FP8_BLOCK, device=device).add_(0.5) * k ** -0.5
    return out


def make_routing(tokens: int, shape: LayerShape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct uniformly random experts per token (int32) and softmax weights (fp32)."""
    ids = torch.rand(tokens, shape.experts, device=device).argsort(dim=1)[:, :shape.top_k].to(torch.int32)
    return ids, torch.randn(tokens, shape.top_k, device=device).softmax(dim=1)


def torch_layer(hidden, ids, weights, w1, w2):
    """The layer on torch's grouped GEMMs (bf16): entries sorted by expert, both GEMMs grouped, weighted rows added
    back in token order. Static shapes and no host sync (capturable)."""
    t, k = ids.shape
    experts, inner = w1.shape[0], w2.shape[2]
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // k
    h = torch._grouped_mm(hidden[token], w1.transpose(1, 2), offs=offs)
    a = torch.nn.functional.silu(h[:, :inner]) * h[:, inner:]
    o = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    o = o.float() * weights.reshape(-1)[order, None]
    return torch.zeros(t, o.shape[1], device=o.device).index_add_(0, token, o).to(hidden.dtype)


def variants(kind: str, phase: str, w: dict):
    """name -> callable(inputs) for one (weights, phase); decode runs the masked layout with one row per token per
    expert of room (nothing dropped)."""
    masked = phase == "decode"
    scales = dict(w1_scale=w.get("w1_scale"), w2_scale=w.get("w2_scale"))

    def layer(fused: bool):
        def run(i):
            extra = dict(layout="masked", max_m=i["hidden"].shape[0]) if masked else {}
            return ops.moe_layer(i["hidden"], i["ids"], i["weights"], w["w1"], w["w2"], weights=kind, fused=fused,
                                 **scales, **extra)
        return run

    out = {"lowbit fused": layer(True), "lowbit chain": layer(False)}
    if kind == "bf16":
        out["torch grouped_mm"] = lambda i: torch_layer(i["hidden"], i["ids"], i["weights"], w["w1"], w["w2"])
    return out


def run(models: dict, tokens: dict, device, stages: bool) -> list[dict]:
    records = []
    for model, shape in models.items():
        for kind in shape.weights:
            w = make_weights(shape, kind, device)
            for phase, t in tokens.items():
                ids, weights = make_routing(t, shape, device)
                inputs = dict(hidden=torch.randn(t, shape.hidden, device=device, dtype=torch.bfloat16), ids=ids,
                              weights=weights)
                results = {}
                for name, fn in variants(kind, phase, w).items():
                    rec = dict(model=model, weights=kind, phase=phase, tokens=t, variant=name)
                    try:
                        results[name] = fn(inputs).float()
                        rec["us"] = time_passes(fn, [inputs], device, graph=device.type == "cuda").median_us
                        if stages and device.type == "cuda":  # kernel time per family and the longest kernels
                            rec["stages"] = op_families(lambda fn=fn, i=inputs: fn(i), 1, device)
                    except Exception as exc:  # a peer that cannot run this shape is recorded with its reason
                        rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    records.append(rec)
                    print(json.dumps({k: v for k, v in rec.items() if k != "stages"}))
                _agreement(records, results, model, kind, phase)
            del w
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return records


def _agreement(records: list[dict], results: dict, model: str, kind: str, phase: str) -> None:
    """Each variant's normalized max difference from the fused layer's output (a sanity check, not the tests)."""
    base = results.get("lowbit fused")
    for r in records:
        if (r["model"], r["weights"], r["phase"]) == (model, kind, phase) and base is not None and \
                r["variant"] in results:
            diff = (results[r["variant"]] - base).abs().max() / base.abs().max().clamp(min=1e-30)
            r["max_diff_vs_fused"] = float(diff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks the script")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = SMOKE if args.smoke else {m: MODELS[m] for m in args.models.split(",")}
    records = run(models, SMOKE_TOKENS if args.smoke else TOKENS, device, stages=not args.smoke)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                commit=measured_commit(), date=datetime.date.today().isoformat(), smoke=args.smoke)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
