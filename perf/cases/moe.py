"""Benchmark cases for MoE routing plumbing: router, align (contiguous / masked), gather, combine.

Decode (T = 1..64, E = 256, k = 8): one launch per op; the runner times eager and CUDA-graph replay, and
the torch reference (topk + sort + scatter) eager and torch.compile'd. Router decode cases also time two
fixed Triton configs as peers ("1cta": all T rows in one program; "row": one row per program) next to the
heuristic, to show where the single-CTA specialisation wins.
Throughput (T = 4096..32768): gather / combine against the measured copy bandwidth (roofline_frac).
"""

from __future__ import annotations

import torch

from dispatch import ops
from dispatch.reference import moe as ref
from perf.cases.base import BenchCase

E, K = 256, 8
DECODE_T = (1, 64)  # representative shapes: a session has ~7 device-minutes for the whole suite
PREFILL_T = (8192,)
ROUTERS = {  # label: (E, k, moe_route kwargs)
    "dsv3 sigmoid+bias g8/4": (256, 8, dict(scoring="sigmoid", renormalize=True, routed_scaling=2.5,
                                            num_groups=8, topk_groups=4)),
    "dsv4 sqrt_softplus+bias": (256, 8, dict(scoring="sqrt_softplus", renormalize=True, routed_scaling=1.5)),
    "gpt-oss softmax renorm": (128, 4, dict(scoring="softmax", renormalize=True)),
}


def _route_ids(t, e, k, device):
    return torch.rand(t, e, device=device).argsort(-1)[:, :k].to(torch.int32)


def _exact(got, want):
    for g, w in zip(got, want, strict=True):
        if not torch.equal(g, w):
            raise AssertionError(f"{int((g != w).sum())} elements differ from the reference")


def _route_check(got, want):
    if not torch.equal(got[0], want[0]):
        raise AssertionError("topk_ids differ from the reference")
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-12)


def _close(got, want):
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-5)


def _router_cases() -> list[BenchCase]:
    from triton_ops.moe_routing import RouteConfig
    from triton_ops.moe_routing import moe_route as triton_route

    out = []
    for label, (e, k, kw) in ROUTERS.items():
        bias = "bias" in label
        for t in DECODE_T + PREFILL_T:
            bucket = "decode" if t <= 64 else "prefill"

            def make(device, t=t, e=e, bias=bias):
                return {"x": torch.randn(t, e, device=device) * 2,
                        "bias": torch.randn(e, device=device) * 0.1 if bias else None}

            args = lambda i, k=k, kw=kw: (i["x"], i["bias"], k, kw["scoring"], kw["renormalize"],  # noqa: E731
                                          kw.get("routed_scaling", 1.0), kw.get("num_groups", 1),
                                          kw.get("topk_groups", 1))
            peers = {}
            if bucket == "decode":
                tp = 1 << (t - 1).bit_length()
                peers = {"triton-1cta": lambda i, a=args, tp=tp: triton_route(*a(i), config=RouteConfig(tp, 8)),
                         "triton-row": lambda i, a=args: triton_route(*a(i), config=RouteConfig(1, 4))}
            out.append(BenchCase(
                "moe_route", f"T={t} E={e} k={k} {label}", bucket, dict(T=t, E=e, k=k, **kw), make,
                lambda i, b, kw=kw, k=k: tuple(ops.moe_route(i["x"], k, bias=i["bias"], backend=b, **kw)),
                lambda i, a=args: ref.moe_route(*a(i)), _route_check,
                bytes_moved=t * e * 4 + t * k * 8, peers=peers))
    return out


def _align_cases() -> list[BenchCase]:
    out = []
    for t in DECODE_T + PREFILL_T:
        bucket = "decode" if t <= 64 else "prefill"
        make = lambda device, t=t: {"ids": _route_ids(t, E, K, device)}  # noqa: E731
        for bm in (16, 128):  # vLLM fused_moe-like block, DeepGEMM contiguous block
            cap = ref.contiguous_capacity(t * K, E, bm)
            out.append(BenchCase(
                "moe_align", f"T={t} E={E} k={K} block_m={bm}", bucket, dict(T=t, E=E, k=K, block_m=bm), make,
                lambda i, b, bm=bm: tuple(ops.moe_align(i["ids"], E, bm, backend=b)),
                lambda i, bm=bm: ref.moe_align(i["ids"], None, E, bm), _exact,
                bytes_moved=t * K * 4 * 2 + cap * 8 + cap // bm * 4))
        if bucket == "decode":
            out.append(BenchCase(
                "moe_masked_layout", f"T={t} E={E} k={K} max_m=64", bucket, dict(T=t, E=E, k=K, max_m=64), make,
                lambda i, b: tuple(ops.moe_masked_layout(i["ids"], E, 64, backend=b)),
                lambda i: ref.moe_masked_layout(i["ids"], None, E, 64), _exact,
                bytes_moved=t * K * 4 * 2 + E * 64 * 4))
    return out


def _gather_combine_cases() -> list[BenchCase]:
    out = []
    shapes = [("decode", t, 7168, 256, 8) for t in DECODE_T] + \
        [("prefill", t, 7168, 256, 8) for t in PREFILL_T]
    for bucket, t, hdim, e, k in shapes:
        bm = 128

        def make(device, t=t, hdim=hdim, e=e, k=k, bm=bm):
            ids = _route_ids(t, e, k, device)
            lay = ref.moe_align(ids, None, e, bm)
            return {"x": torch.randn(t, hdim, device=device, dtype=torch.bfloat16), "src": lay[0], "inv": lay[6],
                    "eo": torch.randn(lay[0].numel(), hdim, device=device, dtype=torch.bfloat16),
                    "w": torch.rand(t, k, device=device)}

        cap = ref.contiguous_capacity(t * k, e, bm)
        p = dict(T=t, K=hdim, E=e, k=k, block_m=bm, dtype="bf16")
        # gather: reads T*k rows, writes all cap rows (padding rows are written as zeros by contract)
        out.append(BenchCase(
            "moe_gather", f"T={t} K={hdim} k={k} bf16 contiguous bm={bm}", bucket, p, make,
            lambda i, b, k=k: ops.moe_gather(i["x"], i["src"], k, backend=b),
            lambda i, k=k: ref.moe_gather(i["x"], i["src"], k), lambda g, w: _exact((g,), (w,)),
            bytes_moved=(t * k + cap) * hdim * 2 + cap * 4, max_copies=8 if bucket == "prefill" else None))
        # combine: reads T*k expert rows + weights + row ids, writes T rows
        out.append(BenchCase(
            "moe_combine", f"T={t} N={hdim} k={k} bf16", bucket, p, make,
            lambda i, b: ops.moe_combine(i["eo"], i["inv"], i["w"], backend=b),
            lambda i: ref.moe_combine(i["eo"], i["inv"], i["w"], None, torch.bfloat16), _close,
            bytes_moved=t * k * hdim * 2 + t * hdim * 2 + t * k * 8, max_copies=8 if bucket == "prefill" else None))
    return out


def cases() -> list[BenchCase]:
    return _router_cases() + _align_cases() + _gather_combine_cases()
