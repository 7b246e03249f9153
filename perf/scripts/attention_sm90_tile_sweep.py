"""Llama hd128 prefill on the sm_90 CuTe forward: for_call's rule, FmhaSm90Config variants (the intra-warpgroup
overlap with and without the persistent grid and the O TMA store, 128- and 176-key tiles) and FA4
(`flash_attn.cute`, when installed) on the same inputs, one process.

    python -m perf.scripts.attention_sm90_tile_sweep --out sweep.jsonl

One JSON line per (case, provider), written as it is measured: CUDA-graph time (us), TFLOP/s, ratio to FA4, and the
normalized max error against FA4's output (against for_call's without FA4) checked before timing.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing

from dispatch import ops, variants

from .sweep import checked_timings

CASES = {  # name: (batch, sequence length, causal); Llama-3-8B heads: 32 query / 8 KV heads of 128
    "1x16384 causal": (1, 16384, True),
    "1x16384 non-causal": (1, 16384, False),
    "4x4096 causal": (4, 4096, True),
    "8x2048 non-causal": (8, 2048, False),
}
HQ, HKV, D = 32, 8, 128


def variant_tiles(sms: int) -> dict[str, dict]:
    return {
        "overlap persistent o_tma": dict(overlap=True, persistent=sms, o_tma=True),
        "overlap o_tma": dict(overlap=True, persistent=0, o_tma=True),
        "overlap": dict(overlap=True, persistent=0, o_tma=False),
        "overlap tile_n 176": dict(overlap=True, persistent=0, o_tma=False, tile_n=176),
        "tile_n 176": dict(overlap=False, persistent=0, o_tma=False, tile_n=176),
    }


def _fa4():
    try:
        from flash_attn import cute
    except ImportError:
        return None
    return cute


def sweep_case(name: str, b: int, s: int, causal: bool, out_file) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b * s, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (HQ, HKV, HKV))
    cu = torch.arange(0, b + 1, device="cuda", dtype=torch.int32) * s
    scale = D ** -0.5
    providers = {}
    fa4 = _fa4()
    if fa4 is not None:
        shape = (b, s)
        providers["fa4"] = lambda: fa4.flash_attn_func(
            q.view(*shape, HQ, D), k.view(*shape, HKV, D), v.view(*shape, HKV, D), softmax_scale=scale,
            causal=causal)[0].view(b * s, HQ, D)
    providers["for_call"] = lambda: ops.attention_prefill(q, k, v, cu, cu, s, s, softmax_scale=scale, causal=causal,
                                                          backend="cute")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for label, tiles in variant_tiles(sms).items():
        providers[label] = (lambda t=tiles: variants.attention_prefill_cute_sm90_tiled(
            q, k, v, cu, cu, s, s, scale, causal, tiles=t)[0])
    want = next(iter(providers.values()))().float()  # FA4's output, else for_call's
    flops = 4 * b * HQ * D * s * s / (2 if causal else 1)
    base = None
    for label, result in checked_timings(providers, want):
        if "error" in result:
            rec = dict(case=name, provider=label, error=result["error"])
        else:
            us = result["us"]
            base = us if label == "fa4" else base
            rec = dict(case=name, provider=label, us=round(us, 1), tflops=round(flops / us / 1e6, 1),
                       vs_fa4=round(base / us, 3) if base else None, err=result["err"])
        print(json.dumps(rec), flush=True)
        out_file.write(json.dumps(rec) + "\n")
        out_file.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    with open(args.out, "w") as f:
        f.write(json.dumps(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                          triton=triton.__version__))) + "\n")
        for name in args.cases.split(","):
            sweep_case(name, *CASES[name], f)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
