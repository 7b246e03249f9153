"""bf16 MoE grouped GEMM at DeepSeek-V3 prefill dims, one process: auto, the Triton and CuTe rules, CuTe tile
overrides, and `torch._grouped_mm` on the same operands (contiguous layout, every expert the same row count).

    python -m perf.scripts.moe_bf16_tile_sweep --out sweep.json

Each line: case, provider, CUDA-graph time (us), TFLOP/s, ratio to `torch._grouped_mm`. Every provider's output is
compared with `torch._grouped_mm`'s (normalized max error) before it is timed.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import triton.testing

from dispatch import ops, variants

from .sweep import checked_timings

CASES = {  # name: (N, K)
    "GEMM1": (4096, 7168),
    "GEMM2": (7168, 2048),
}
CUTE_TILES = [dict(tile_n=128), dict(tile_n=256), dict(tile_n=128, epilogue="smem"), dict(tile_n=256, epilogue="smem")]


def grouped_providers(n: int, k: int, e: int, rows: int) -> tuple[dict[str, Callable[[], torch.Tensor]], tuple]:
    """({label: call} for `torch._grouped_mm`, auto and the forced Triton / CuTe backends on one set of operands,
    the operands (a, w, m_indices)): e experts of `rows` rows each, contiguous layout, bf16."""
    a = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    m_indices = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
    wt = w.transpose(1, 2)
    providers = {
        "torch._grouped_mm": lambda: torch._grouped_mm(a, wt, offs, out_dtype=torch.bfloat16),
        "auto": lambda: ops.moe_gemm_bf16(a, w, m_indices=m_indices),
        "triton": lambda: ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="triton"),
        "cute": lambda: ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="cute"),
    }
    return providers, (a, w, m_indices)


def sweep_case(name: str, n: int, k: int, e: int, rows: int) -> list[dict]:
    providers, (a, w, m_indices) = grouped_providers(n, k, e, rows)
    for t in CUTE_TILES:
        label = "cute " + " ".join(f"{key}={val}" for key, val in t.items())
        providers[label] = (lambda t=t: variants.moe_gemm_bf16_cute_tiled(a, w, m_indices, None, tiles=t))
    want = providers["torch._grouped_mm"]().float()
    flops = 2 * e * rows * n * k
    base, out = None, []
    for label, result in checked_timings(providers, want):
        if "error" in result:
            print(json.dumps(dict(case=f"{name} {e}x{rows}", provider=label, error=result["error"])))
            continue
        us = result["us"]
        base = us if label == "torch._grouped_mm" else base
        rec = dict(case=f"{name} {e}x{rows}", n=n, k=k, experts=e, rows=rows, provider=label, us=round(us, 2),
                   tflops=round(flops / us / 1e6, 1), vs_grouped_mm=round(base / us, 3), err=result["err"])
        print(json.dumps(rec))
        out.append(rec)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", default="256,512")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = []
    for rows in map(int, args.rows.split(",")):
        for name, (n, k) in CASES.items():
            out += sweep_case(name, n, k, args.experts, rows)
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=out), f, indent=1)


if __name__ == "__main__":
    main()
