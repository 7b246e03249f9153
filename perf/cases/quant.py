"""Benchmark cases for the quantization primitives (NVFP4, MXFP4, FP8 per-token-group)."""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import quant as ref
from dispatch.selfcheck import byte_mismatches
from perf.cases.base import BenchCase

SHAPES = [  # (bucket, M, K)
    ("decode", 16, 7168), ("prefill", 4096, 7168), ("prefill", 8192, 8192),
]


def _bytes_equal(got, want):
    for g, w in zip(got, want, strict=True):
        if bad := byte_mismatches(g, w):
            raise AssertionError(f"{bad} bytes differ from the reference")


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
            BenchCase("nvfp4_quantize", f"M={m} K={k} bf16 given-gs linear", bucket, p, _x(m, k),
                      lambda i, b: ops.nvfp4_quantize(i["x"], i["gs"], backend=b),
                      lambda i: ref.nvfp4_quantize(i["x"], i["gs"], False), _bytes_equal,
                      bytes_moved=x_bytes + m * k // 2 + m * k // 16),
            BenchCase("mxfp4_quantize", f"M={m} K={k} bf16 floor swizzled", bucket, p, _x(m, k),
                      lambda i, b: ops.mxfp4_quantize(i["x"], scale_layout="swizzled", backend=b),
                      lambda i: ref.mxfp4_quantize(i["x"], "floor", True), _bytes_equal,
                      bytes_moved=x_bytes + m * k // 2 + m * k // 32),
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
        if (m, k) not in ((16, 7168), (8192, 8192)):  # dequantize: one decode and one throughput shape
            continue
        out += _dequant_cases(bucket, m, k, p, x_bytes)
    out += _swizzle_cases()
    return out


def _quantized(m, k, kind):
    """Inputs for a dequantize case: the reference's quantization of random activations."""
    def make(device):
        x = _x(m, k)(device)["x"]
        if kind == "nvfp4":
            return {"q": tuple(ops.nvfp4_quantize(x, scale_layout="swizzled", backend="torch"))}
        if kind == "mxfp4":
            return {"q": tuple(ops.mxfp4_quantize(x, backend="torch"))}
        return {"q": tuple(ops.fp8_group_quantize(x, 128, backend="torch"))}
    return make


def _dequant_cases(bucket, m, k, p, out_bytes):
    eq = lambda got, want: _bytes_equal((got,), (want,))  # noqa: E731
    return [
        BenchCase("nvfp4_dequantize", f"M={m} K={k} swizzled -> bf16", bucket, p, _quantized(m, k, "nvfp4"),
                  lambda i, b: ops.nvfp4_dequantize(*i["q"], scale_layout="swizzled", backend=b),
                  lambda i: ref.nvfp4_dequantize(*i["q"], True, torch.bfloat16), eq,
                  bytes_moved=out_bytes + m * k // 2 + m * k // 16),
        BenchCase("mxfp4_dequantize", f"M={m} K={k} linear -> bf16", bucket, p, _quantized(m, k, "mxfp4"),
                  lambda i, b: ops.mxfp4_dequantize(*i["q"], backend=b),
                  lambda i: ref.mxfp4_dequantize(*i["q"], False, torch.bfloat16), eq,
                  bytes_moved=out_bytes + m * k // 2 + m * k // 32),
        BenchCase("fp8_group_dequantize", f"M={m} K={k} g128 -> bf16", bucket, p, _quantized(m, k, "fp8"),
                  lambda i, b: ops.fp8_group_dequantize(*i["q"], 128, backend=b),
                  lambda i: ref.fp8_group_dequantize(*i["q"], 128, torch.bfloat16), eq,
                  bytes_moved=out_bytes + m * k + m * k // 128 * 4),
    ]


def _swizzle_cases():
    """Scale-layout conversion of an NVFP4 scale matrix for M=16384 x K=7168 (448 scale columns)."""
    m, s = 16384, 7168 // 16
    eq = lambda got, want: _bytes_equal((got,), (want,))  # noqa: E731

    def lin(device):
        return {"s": torch.randint(0, 255, (m, s), dtype=torch.uint8, device=device)}

    def swz(device):
        return {"s": ref.swizzle_scales_128x4(lin(device)["s"])}

    p = dict(M=m, S=s)
    return [
        BenchCase("swizzle_scales_128x4", f"M={m} S={s}", "prefill", p, lin,
                  lambda i, b: ops.swizzle_scales_128x4(i["s"], backend=b),
                  lambda i: ref.swizzle_scales_128x4(i["s"]), eq, bytes_moved=2 * m * s),
        BenchCase("unswizzle_scales_128x4", f"M={m} S={s}", "prefill", p, swz,
                  lambda i, b: ops.unswizzle_scales_128x4(i["s"], m, s, backend=b),
                  lambda i: ref.unswizzle_scales_128x4(i["s"], m, s), eq, bytes_moved=2 * m * s),
    ]
