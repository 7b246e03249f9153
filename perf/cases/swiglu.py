"""Benchmark cases for SwiGLU (silu*mul, GPT-OSS, MoE layouts), plain and with fused FP8-group / MXFP4 / NVFP4
outputs.

Targets: prefill >= 0.88 of measured copy bandwidth, >= 2.5x torch.compile of the reference for every quantized
format, never slower than Liger for plain silu*mul; decode: one launch per call (NVFP4 with a computed global
scale: two), eager and CUDA-graph times.

The checks take the float output within one bf16 ulp and the quantized bytes to >= 99% equal (exp is not
correctly rounded anywhere: docs/swiglu.md).
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import swiglu as sref
from perf import peers as P
from perf.cases.base import BenchCase

SWIGLU_SHAPES = [  # (bucket, M, I): DeepSeek-V4 MoE inter 2048 / 3072, GPT-OSS 2880, Llama 11008 -> 4096 rows
    ("decode", 16, 3072), ("prefill", 16384, 4096),
]


def _bytes(t):
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.float32 else t.view(torch.int32)


def _close_bytes(got, want):
    got = got if isinstance(got, (tuple, list)) else (got,)
    want = want if isinstance(want, (tuple, list)) else (want,)
    for g, w in zip(got, want, strict=True):
        if g.dtype in (torch.bfloat16, torch.float16):
            d = (g.float() - w.float()).abs()
            if not bool((d <= w.float().abs() * 2**-7 + 1e-30).all()):
                raise AssertionError("float output off by more than one ulp")
        elif (_bytes(g) != _bytes(w)).float().mean() > 0.01:
            raise AssertionError("more than 1% of quantized bytes differ")


def _sw_inputs(m, i, moe=False):
    def make(device):
        x = (torch.randn(m, 2 * i, device=device) * 2).bfloat16()
        ids = (torch.arange(m, device=device, dtype=torch.int32) % 9) - 1 if moe else None
        return {"x": x, "ids": ids, "gs": torch.full((8,), 0.004, device=device)}
    return make


def _sw_cases(bucket, m, i):
    p = dict(M=m, I=i, dtype="bf16")
    xb, yb = m * 2 * i * 2, m * i * 2
    liger = P.liger_silu_mul()
    gptoss = dict(interleave=1, activation="gptoss", alpha=1.702, limit=7.0)

    def ref_q(quant, **kw):
        return lambda inp: sref.swiglu_quant(inp["x"], 1, "gptoss", 1.702, 7.0, None, None, None, quant, **kw)

    out = [
        BenchCase("swiglu", f"M={m} I={i} bf16 silu*mul", bucket, p, _sw_inputs(m, i),
                  lambda inp, b: ops.swiglu(inp["x"], backend=b),
                  lambda inp: sref.swiglu(inp["x"]), _close_bytes, bytes_moved=xb + yb,
                  peers=P.available(liger=(lambda inp: liger(inp["x"][:, :i], inp["x"][:, i:])) if liger else None)),
        BenchCase("swiglu", f"M={m} I={i} bf16 gptoss g1 limit7", bucket, p, _sw_inputs(m, i),
                  lambda inp, b: ops.swiglu(inp["x"], backend=b, **gptoss),
                  lambda inp: sref.swiglu(inp["x"], 1, "gptoss", 1.702, 7.0), _close_bytes, bytes_moved=xb + yb),
        BenchCase("swiglu_fp8_group", f"M={m} I={i} gptoss g1 -> fp8 g128", bucket, p, _sw_inputs(m, i),
                  lambda inp, b: tuple(ops.swiglu_fp8_group(inp["x"], backend=b, **gptoss)),
                  ref_q("fp8_group", group_size=128), _close_bytes,
                  bytes_moved=xb + m * i + m * i // 32) if i % 128 == 0 else None,
        BenchCase("swiglu_mxfp4", f"M={m} I={i} gptoss g1 -> mxfp4 swizzled", bucket, p, _sw_inputs(m, i),
                  lambda inp, b: tuple(ops.swiglu_mxfp4(inp["x"], scale_layout="swizzled", backend=b, **gptoss)),
                  ref_q("mxfp4", swizzle=True), _close_bytes, bytes_moved=xb + m * i // 2 + m * i // 32),
        BenchCase("swiglu_nvfp4", f"M={m} I={i} gptoss g1 -> nvfp4 computed-gs swizzled", bucket, p,
                  _sw_inputs(m, i),
                  lambda inp, b: tuple(ops.swiglu_nvfp4(inp["x"], scale_layout="swizzled", backend=b, **gptoss)),
                  ref_q("nvfp4", swizzle=True), _close_bytes, bytes_moved=xb + m * i // 2 + m * i // 16),
        BenchCase("swiglu_nvfp4", f"M={m} I={i} MoE contiguous g8 clamp -> nvfp4 per-expert gs", bucket,
                  {**p, "moe": "contiguous"}, _sw_inputs(m, i, moe=True),
                  lambda inp, b: tuple(ops.swiglu_nvfp4(inp["x"], interleave=8, limit=7.0, expert_ids=inp["ids"],
                                                        global_scale=inp["gs"], scale_layout="swizzled",
                                                        backend=b)),
                  lambda inp: sref.swiglu_quant(inp["x"], 8, "silu", 1.702, 7.0, inp["ids"], None, None, "nvfp4",
                                                global_scale=inp["gs"], swizzle=True),
                  _close_bytes, bytes_moved=xb + m * i // 2 + m * i // 16,
                  compile_reference=False),  # the per-expert reference loops over experts on the host
    ]
    return [c for c in out if c is not None]


def cases() -> list[BenchCase]:
    out = []
    for bucket, m, i in SWIGLU_SHAPES:
        out += _sw_cases(bucket, m, i)
    return out
