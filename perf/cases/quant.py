"""Benchmark cases for the quantization primitives (NVFP4, MXFP4, FP8 per-token-group)."""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import quant as ref
from perf.cases.base import BenchCase

SHAPES = [  # (bucket, M, K)
    ("decode", 1, 7168), ("decode", 16, 7168), ("decode", 64, 2880),
    ("prefill", 4096, 7168), ("prefill", 8192, 8192), ("prefill", 16384, 2880),
]


def _bytes_equal(got, want):
    for g, w in zip(got, want, strict=True):
        g, w = g.contiguous().reshape(-1), w.contiguous().reshape(-1)
        if g.dtype != torch.float32:
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        if not torch.equal(g, w):
            raise AssertionError(f"{int((g != w).sum())} elements differ from the reference")


def _x(m, k, dtype=torch.bfloat16):
    def make(device):
        x = torch.randn(m, k, device=device, dtype=torch.float32) * torch.exp(torch.randn(m, 1, device=device))
        x = x.to(dtype)
        return {"x": x, "gs": ops.nvfp4_global_scale_from_amax(x.float().abs().amax())}
    return make


def cases() -> list[BenchCase]:
    out = []
    for bucket, m, k in SHAPES:
        p = dict(M=m, K=k, dtype="bf16")
        x_bytes = m * k * 2
        out += [
            BenchCase("nvfp4_quantize", f"M={m} K={k} bf16 given-gs swizzled", bucket, p, _x(m, k),
                      lambda i, b: ops.nvfp4_quantize(i["x"], i["gs"], scale_layout="swizzled", backend=b),
                      lambda i: ref.nvfp4_quantize(i["x"], i["gs"], True), _bytes_equal,
                      bytes_moved=x_bytes + m * k // 2 + m * k // 16),
            BenchCase("nvfp4_quantize", f"M={m} K={k} bf16 computed-gs linear", bucket, p, _x(m, k),
                      lambda i, b: ops.nvfp4_quantize(i["x"], backend=b),
                      lambda i: ref.nvfp4_quantize(i["x"], None, False), _bytes_equal,
                      bytes_moved=x_bytes + m * k // 2 + m * k // 16),
            BenchCase("mxfp4_quantize", f"M={m} K={k} bf16 floor linear", bucket, p, _x(m, k),
                      lambda i, b: ops.mxfp4_quantize(i["x"], backend=b),
                      lambda i: ref.mxfp4_quantize(i["x"], "floor", False), _bytes_equal,
                      bytes_moved=x_bytes + m * k // 2 + m * k // 32),
            BenchCase("fp8_group_quantize", f"M={m} K={k} bf16 g128", bucket, p, _x(m, k),
                      lambda i, b: ops.fp8_group_quantize(i["x"], 128, backend=b),
                      lambda i: ref.fp8_group_quantize(i["x"], 128, 1e-10, False, False), _bytes_equal,
                      bytes_moved=x_bytes + m * k + m * k // 128 * 4),
        ]
    return out
