"""Benchmark cases for RMSNorm (+ residual), plain and with fused FP8-group / MXFP4 / NVFP4 outputs.

Targets: prefill >= 0.88 of measured copy bandwidth, >= 2.5x torch.compile of the reference for every quantized
format, never slower than Liger for plain RMSNorm; decode: one launch per call (NVFP4 with a computed global
scale: two), eager and CUDA-graph times. Every case checks bytes exactly (docs/rmsnorm.md).
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import rmsnorm as rref
from dispatch.selfcheck import byte_mismatches
from perf import peers as P
from perf.cases.base import BenchCase

RMS_SHAPES = [  # (bucket, M, N): DeepSeek-V4 hidden 7168, GPT-OSS 2880, Llama 4096
    ("decode", 16, 7168), ("prefill", 4096, 7168), ("prefill", 32768, 4096),
]


def _exact(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        if g is None:
            continue
        if bad := byte_mismatches(g, w):
            raise AssertionError(f"{bad} bytes differ from the reference")


def _rms_inputs(m, n, residual):
    def make(device):
        x = (torch.randn(m, n, device=device) * torch.exp(torch.randn(m, 1, device=device))).bfloat16()
        w = (1 + 0.1 * torch.randn(n, device=device)).bfloat16()
        r = torch.randn(m, n, device=device).bfloat16() if residual else None
        return {"x": x, "w": w, "r": r, "gs": ops.nvfp4_global_scale_from_amax(x.float().abs().amax())}
    return make


def _rms_cases(bucket, m, n):
    p = dict(M=m, N=n, dtype="bf16")
    xb = m * n * 2
    liger = P.liger_rms_norm()
    out = [
        BenchCase("rms_norm", f"M={m} N={n} bf16", bucket, p, _rms_inputs(m, n, False),
                  lambda i, b: ops.rms_norm(i["x"], i["w"], 1e-6, backend=b).out,
                  lambda i: rref.rms_norm(i["x"], i["w"], 1e-6)[0], _exact, bytes_moved=2 * xb + 2 * n,
                  peers=P.available(liger=(lambda i: liger(i["x"], i["w"], 1e-6)) if liger else None)),
        BenchCase("rms_norm", f"M={m} N={n} bf16 +residual", bucket, {**p, "residual": True},
                  _rms_inputs(m, n, True),
                  lambda i, b: tuple(ops.rms_norm(i["x"], i["w"], 1e-6, residual=i["r"], backend=b)),
                  lambda i: rref.rms_norm(i["x"], i["w"], 1e-6, i["r"]), _exact, bytes_moved=4 * xb + 2 * n),
    ]
    if n % 128 == 0:
        out.append(BenchCase(
            "rms_norm_fp8_group", f"M={m} N={n} bf16 g128 +residual", bucket, {**p, "residual": True},
            _rms_inputs(m, n, True),
            lambda i, b: (*ops.rms_norm_fp8_group(i["x"], i["w"], 1e-6, residual=i["r"], backend=b).quantized,),
            lambda i: rref.rms_norm_quant(i["x"], i["w"], 1e-6, i["r"], 0.0, "fp8_group")[:2], _exact,
            bytes_moved=3 * xb + m * n + m * n // 32 + 2 * n))
    out += [
        BenchCase("rms_norm_mxfp4", f"M={m} N={n} bf16 swizzled", bucket, p, _rms_inputs(m, n, False),
                  lambda i, b: tuple(ops.rms_norm_mxfp4(i["x"], i["w"], 1e-6, scale_layout="swizzled",
                                                        backend=b).quantized),
                  lambda i: rref.rms_norm_quant(i["x"], i["w"], 1e-6, None, 0.0, "mxfp4", swizzle=True)[:2],
                  _exact, bytes_moved=xb + m * n // 2 + m * n // 32 + 2 * n),
        BenchCase("rms_norm_nvfp4", f"M={m} N={n} bf16 given-gs swizzled", bucket, p, _rms_inputs(m, n, False),
                  lambda i, b: tuple(ops.rms_norm_nvfp4(i["x"], i["w"], 1e-6, global_scale=i["gs"],
                                                        scale_layout="swizzled", backend=b).quantized),
                  lambda i: rref.rms_norm_quant(i["x"], i["w"], 1e-6, None, 0.0, "nvfp4", global_scale=i["gs"],
                                                swizzle=True)[:3],
                  _exact, bytes_moved=xb + m * n // 2 + m * n // 16 + 2 * n),
        BenchCase("rms_norm_nvfp4", f"M={m} N={n} bf16 computed-gs linear", bucket, p, _rms_inputs(m, n, False),
                  lambda i, b: tuple(ops.rms_norm_nvfp4(i["x"], i["w"], 1e-6, backend=b).quantized),
                  lambda i: rref.rms_norm_quant(i["x"], i["w"], 1e-6, None, 0.0, "nvfp4")[:3],
                  _exact, bytes_moved=xb + m * n // 2 + m * n // 16 + 2 * n),  # roofline: one read of x
    ]
    return out


def cases() -> list[BenchCase]:
    out = []
    for bucket, m, n in RMS_SHAPES:
        out += _rms_cases(bucket, m, n)
    return out
