"""Benchmark cases for MoE routing plumbing: router, align (contiguous / masked), gather, combine.

Decode (T = 1, 16, 64; E = 256, k = 8): one launch per op; the runner times eager and CUDA-graph replay, and
the torch reference (topk + sort + scatter) eager and torch.compile'd. Two peers per decode case show where
the small-M specialisations win (Triton variants the dispatcher never picks: dispatch/variants.py):
* moe_route: "triton-1cta" (all T rows in one program) and "triton-row" (one row per program) next to the
  heuristic (`pick_route_config`: one row per program up to one wave, T <= 2048);
* moe_align / moe_masked_layout: "triton-general" forces the three-launch path (per-chunk counts -> scan ->
  scatter + fill) that large T takes, next to the single-launch decode path the dispatcher picks.
Throughput (T = 8192, 32768): gather / combine at DeepSeek-V4 (hidden 7168, E = 256, k = 8) and GPT-OSS-120B
(hidden 2880, E = 128, k = 4) against the measured copy bandwidth (roofline_frac).

Bytes models (what each op must move, read + written once):
* router: logits T*E fp32 (+ bias E fp32) in; ids + weights T*k*(4 + 4) out.
* hash router: the T*k selected logits (fp32; a kernel reads only those, not whole rows), T int64 token ids and
  the T table rows T*k int32 in; ids + weights T*k*(4 + 4) out.
* align: ids T*k int32 in; inv_rows T*k int32, sorted_token_ids + m_indices cap*4 each, expert_ids cap/bm*4,
  offsets (E+1)*4, counts E*4, total 4 out. masked: ids in; inv_rows, src_rows E*max_m*4, masked_m + counts out.
* gather: every real entry reads its token row (T*k rows, once per (token, slot)); every one of the cap output
  rows is written (padding rows are zero by contract); the cap row ids are read.
* combine: T*k expert-output rows read (the rows inv_rows points at), T*k weights + T*k row ids read, T rows
  written (out dtype).
"""

from __future__ import annotations

import torch

from dispatch import ops, variants
from dispatch.reference import moe as ref
from perf.cases.base import BenchCase

E, K = 256, 8
DECODE_T = (1, 16, 64)
PREFILL_T = (8192, 32768)
MAX_M = 64  # masked layout rows per expert at decode (>= T: nothing is dropped)
ROUTERS = {  # label: (E, k, moe_route kwargs); the decode bucket only
    "dsv3 sigmoid+bias g8/4": (256, 8, dict(scoring="sigmoid", renormalize=True, routed_scaling=2.5,
                                            num_groups=8, topk_groups=4)),
    "dsv4 sqrt_softplus+bias": (256, 8, dict(scoring="sqrt_softplus", renormalize=True, routed_scaling=1.5)),
}
ROUTER_T = {"dsv3 sigmoid+bias g8/4": DECODE_T, "dsv4 sqrt_softplus+bias": (64,)}
MODELS = {  # gather / combine prefill shapes: label -> (hidden, E, k)
    "dsv4": (7168, 256, 8),
    "gpt-oss": (2880, 128, 4),
}
HASH_T = (1, 64, 8192)  # DeepSeek-V4 hash layers: decode and one prefill batch
HASH_VOCAB = 129280  # DeepSeek-V4 vocabulary: the table is [vocab, k] int32
ALIGN_BM = 128  # DeepGEMM m-grouped contiguous block (the layout gather / combine use)


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


def router_bytes(t: int, e: int, k: int, bias: bool) -> int:
    return t * e * 4 + (e * 4 if bias else 0) + t * k * 8


def hash_router_bytes(t: int, k: int) -> int:
    return t * k * 4 + t * 8 + t * k * 4 + t * k * 8


def align_bytes(t: int, e: int, k: int, bm: int) -> int:
    cap = ref.contiguous_capacity(t * k, e, bm)
    return t * k * 4 * 2 + cap * 4 * 2 + cap // bm * 4 + (e + 1) * 4 + e * 4 + 4


def masked_bytes(t: int, e: int, k: int, max_m: int) -> int:
    return t * k * 4 * 2 + e * max_m * 4 + e * 4 * 2


def gather_bytes(t: int, k: int, hidden: int, cap: int, elem: int) -> int:
    return t * k * hidden * elem + cap * hidden * elem + cap * 4


def combine_bytes(t: int, k: int, n: int, elem: int, out_elem: int) -> int:
    return t * k * n * elem + t * n * out_elem + t * k * (4 + 4)


def _router_cases() -> list[BenchCase]:
    out = []
    for label, (e, k, kw) in ROUTERS.items():
        bias = "bias" in label
        for t in ROUTER_T[label]:
            def make(device, t=t, e=e, bias=bias):
                return {"x": torch.randn(t, e, device=device) * 2,
                        "bias": torch.randn(e, device=device) * 0.1 if bias else None}

            args = lambda i, k=k, kw=kw: (i["x"], i["bias"], k, kw["scoring"], kw["renormalize"],  # noqa: E731
                                          kw.get("routed_scaling", 1.0), kw.get("num_groups", 1),
                                          kw.get("topk_groups", 1))
            tp = 1 << (t - 1).bit_length()
            peers = {"triton-1cta": lambda i, a=args, tp=tp: variants.moe_route_tiled(*a(i), rows_per_program=tp,
                                                                                    num_warps=8),
                     "triton-row": lambda i, a=args: variants.moe_route_tiled(*a(i), rows_per_program=1,
                                                                              num_warps=4)}
            out.append(BenchCase(
                "moe_route", f"T={t} E={e} k={k} {label}", "decode", dict(T=t, E=e, k=k, **kw), make,
                lambda i, b, kw=kw, k=k: tuple(ops.moe_route(i["x"], k, bias=i["bias"], backend=b, **kw)),
                lambda i, a=args: ref.moe_route(*a(i)), _route_check,
                bytes_moved=router_bytes(t, e, k, bias), peers=peers))
    return out


def _hash_router_cases() -> list[BenchCase]:
    """DeepSeek-V4 hash routing (E = 256, k = 8): sqrt_softplus scores of the table's experts, renormalized."""
    out = []
    kw = dict(scoring="sqrt_softplus", renormalize=True, routed_scaling=1.5)
    for t in HASH_T:
        def make(device, t=t):
            return {"x": torch.randn(t, E, device=device) * 2,
                    "tok": torch.randint(0, HASH_VOCAB, (t,), device=device),
                    "table": torch.randint(0, E, (HASH_VOCAB, K), device=device, dtype=torch.int32)}

        out.append(BenchCase(
            "moe_hash_route", f"T={t} E={E} k={K} vocab={HASH_VOCAB} sqrt_softplus", "decode" if t <= 64 else "prefill",
            dict(T=t, E=E, k=K, vocab=HASH_VOCAB, **kw), make,
            lambda i, b: tuple(ops.moe_hash_route(i["x"], i["tok"], i["table"], backend=b, **kw)),
            lambda i: ref.moe_hash_route(i["x"], i["tok"], i["table"], kw["scoring"], kw["renormalize"],
                                         kw["routed_scaling"]),
            _route_check, bytes_moved=hash_router_bytes(t, K)))  # 4 MB table per copy: the runner makes ~47
    return out


def _align_cases() -> list[BenchCase]:
    out = []
    for t in DECODE_T:
        make = lambda device, t=t: {"ids": _route_ids(t, E, K, device)}  # noqa: E731
        bm = ALIGN_BM
        out.append(BenchCase(
            "moe_align", f"T={t} E={E} k={K} block_m={bm}", "decode", dict(T=t, E=E, k=K, block_m=bm), make,
            lambda i, b, bm=bm: tuple(ops.moe_align(i["ids"], E, bm, backend=b)),
            lambda i, bm=bm: ref.moe_align(i["ids"], None, E, bm), _exact,
            bytes_moved=align_bytes(t, E, K, bm),
            peers={"triton-general": lambda i, bm=bm: variants.moe_align_three_launch(i["ids"], None, E, bm)}))
        out.append(BenchCase(
            "moe_masked_layout", f"T={t} E={E} k={K} max_m={MAX_M}", "decode", dict(T=t, E=E, k=K, max_m=MAX_M),
            make, lambda i, b: tuple(ops.moe_masked_layout(i["ids"], E, MAX_M, backend=b)),
            lambda i: ref.moe_masked_layout(i["ids"], None, E, MAX_M), _exact,
            bytes_moved=masked_bytes(t, E, K, MAX_M),
            peers={"triton-general": lambda i: variants.moe_masked_layout_three_launch(i["ids"], None, E, MAX_M)}))
    for t in PREFILL_T[:1]:  # T*k > 1024 entries: the three-launch path (docs/moe.md, Kernels)
        bm = ALIGN_BM
        out.append(BenchCase(
            "moe_align", f"T={t} E={E} k={K} block_m={bm}", "prefill", dict(T=t, E=E, k=K, block_m=bm),
            lambda device, t=t: {"ids": _route_ids(t, E, K, device)},
            lambda i, b, bm=bm: tuple(ops.moe_align(i["ids"], E, bm, backend=b)),
            lambda i, bm=bm: ref.moe_align(i["ids"], None, E, bm), _exact, bytes_moved=align_bytes(t, E, K, bm)))
    return out


def _gather_make(t, hidden, e, k, bm):
    def make(device):
        lay = ref.moe_align(_route_ids(t, e, k, device), None, e, bm)
        return {"x": torch.randn(t, hidden, device=device, dtype=torch.bfloat16), "src": lay[0]}
    return make


def _combine_make(t, hidden, e, k, bm):
    def make(device):
        lay = ref.moe_align(_route_ids(t, e, k, device), None, e, bm)
        return {"eo": torch.randn(lay[0].numel(), hidden, device=device, dtype=torch.bfloat16), "inv": lay[6],
                "w": torch.rand(t, k, device=device)}
    return make


def gather_combine_cases(shapes=None, tier: str = "full") -> list[BenchCase]:
    """shapes: (T, model label) pairs; default every PREFILL_T x MODELS. torch.compile of the reference is timed
    at T = 8192 only (its compile costs ~10 s of the suite's budget per case; 32768 adds no new comparison)."""
    out = []
    shapes = shapes or [(t, m) for m in MODELS for t in PREFILL_T]
    for t, model in shapes:
        extra = dict(tier=tier, compile_reference=t < 32768, max_copies=4)
        hidden, e, k = MODELS[model]
        bm = ALIGN_BM
        bucket = "decode" if t <= 64 else "prefill"
        cap = ref.contiguous_capacity(t * k, e, bm)
        p = dict(T=t, K=hidden, E=e, k=k, block_m=bm, dtype="bf16", model=model)
        out.append(BenchCase(
            "moe_gather", f"T={t} K={hidden} E={e} k={k} bf16 contiguous bm={bm} {model}", bucket, p,
            _gather_make(t, hidden, e, k, bm),
            lambda i, b, k=k: ops.moe_gather(i["x"], i["src"], k, backend=b),
            lambda i, k=k: ref.moe_gather(i["x"], i["src"], k), lambda g, w: _exact((g,), (w,)),
            bytes_moved=gather_bytes(t, k, hidden, cap, 2), **extra))
        out.append(BenchCase(
            "moe_combine", f"T={t} N={hidden} E={e} k={k} bf16 {model}", bucket, p, _combine_make(t, hidden, e, k, bm),
            lambda i, b: ops.moe_combine(i["eo"], i["inv"], i["w"], backend=b),
            lambda i: ref.moe_combine(i["eo"], i["inv"], i["w"], None, torch.bfloat16),
            lambda g, w: _exact((g,), (w,)),  # fixed-order fp32 sums, no FMA contraction: bytes equal
            bytes_moved=combine_bytes(t, k, hidden, 2, 2), **extra))
    return out


def cases() -> list[BenchCase]:
    # quick tier: the same cases at T = 1 (the CPU interpreter; --quick otherwise picks the smallest prefill)
    return _router_cases() + _hash_router_cases() + _align_cases() + gather_combine_cases() + \
        gather_combine_cases([(1, "dsv4")], tier="quick")
