"""Benchmark cases for DeepSeek MLA decode (`mla_decode`, bucket "decode"), part of the attention family
(perf/cases/attention.py adds them to its case list).

Shapes: H = 128 query heads, one query per sequence (Sq = 1), page 64, every sequence at the full context; the
latent cache in the three layouts lowbit writes: "bf16" (576 bf16 per token, 1152 B), "v32" (DeepSeek V3.2 FP8,
656 B per token) and "v4" (DeepSeek V4 FP8, 584 B per token; the value is the 448-wide NoPE part).
* dense: B x context 1 x 8192, 32 x 4096, 64 x 8192 for each layout;
* sparse: top-2048 (V3.2) and top-1024 (V4) index lists per query at context 8192, B = 32 and 64.
The caches are written by the lowbit write op (`ds_kv_write`, Triton on a GPU) from random latents; block tables
are random permutations of the cache's blocks; sparse index lists are random distinct positions of the context.

Bytes model (what a kernel must read + write once): the latent bytes of the keys read (dense: B x context tokens;
sparse: B x Sq x topk tokens, whether or not two lists name the same token) x bytes per token, plus q, out (bf16),
the fp32 LSE, the block-table entries of the keys and (sparse) the index lists. The kernel reads each key tile
once per 32-row block (four times at H = 128: three from L2 if the blocks run side by side), which this model does
not count: the roofline fraction says how close the HBM traffic is to one read.

Check: the normalized max error <= 2e-2 against `eager_mla` below, an fp32 torch eager implementation of the
contract (latents gathered and dequantized through the lowbit gather op, materialized logits, softmax, PV); the
fp64 contract reference (dispatch/reference/attention.py:mla_decode) checks the quick cases. Peers: `sdpa` (torch
SDPA with whatever backend it picks for a 576-wide head, on a dense (B, 1, context, 576) bf16 copy of the
dequantized latents, enable_gqa, V = its first 512 columns), dense cases only; `flashmla` (FlashMLA's sm90 kernels
through the C-ABI library of perf/peers.py, where it is present): the bf16 dense cases (its dense decode has no FP8
cache on sm90) and the V3.2 / V4 sparse cases (its sparse FP8 decode; our logical index lists turned into its
physical slots at make time), checked against `eager_mla` in its probe.
"""

from __future__ import annotations

import math

import torch

from dispatch import ops
from dispatch.reference import attention as ref
from perf import peers as peer_libs
from perf.cases.base import BenchCase

PAGE = 64
BF16 = torch.bfloat16
WIDTH = {"bf16": 576, "v32": 576, "v4": 512}
TOKEN_BYTES = {"bf16": 1152, "v32": 656, "v4": 584}


def _latents(cache, layout, slots):
    """fp32 latent rows (N, D) at the slots (-1: zeros), through the lowbit gather for the FP8 layouts."""
    if layout == "bf16":
        flat = cache.reshape(-1, cache.shape[-1]).float()
        return torch.where((slots >= 0)[:, None], flat[slots.clamp_min(0).long()], 0.0)
    return ops.ds_kv_gather(cache, slots, layout=layout, out_dtype=torch.float32)


def eager_mla(q, cache, layout, table, seqused, indices, v_dim, scale):
    """fp32 eager MLA decode (Sq = 1 causal dense = every key; sparse: the listed keys), vectorized over B."""
    bsz, sq, h, d = q.shape
    if indices is None:
        cap = table.shape[1] * PAGE
        pos = torch.arange(cap, device=q.device).expand(bsz, sq, cap)
        ok = pos < seqused.view(bsz, 1, 1)
    else:
        pos = indices.long()
        ok = (pos >= 0) & (pos < seqused.view(bsz, 1, 1))
    pos = pos.clamp_min(0)
    page = torch.gather(table.long(), 1, (pos // PAGE).reshape(bsz, -1)).view_as(pos)
    slots = torch.where(ok, page * PAGE + pos % PAGE, -1)
    kv = _latents(cache, layout, slots.reshape(-1).to(torch.int32)).view(bsz, sq, -1, d)
    logits = torch.einsum("bshd,bskd->bshk", q.float(), kv) * scale
    logits = logits.masked_fill(~ok[:, :, None, :], -math.inf)
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("bshk,bskd->bshd", p, kv[..., :v_dim]).to(q.dtype)


def _check(got, want) -> None:
    from perf.cases.attention import check_out

    check_out(got, want)


def _mla_case(layout: str, bsz: int, ctx: int, topk: int = 0, h: int = 128, tier: str = "full") -> BenchCase:
    full = tier == "full"
    d = WIDTH[layout]
    v_dim = d - 64
    scale = 1.0 / math.sqrt(192)
    peers: dict = {}
    state: dict = {}
    where = f"mla_decode [{layout} B={bsz} ctx={ctx} topk={topk}]"
    if full and not topk:
        peers["sdpa"] = lambda i: torch.nn.functional.scaled_dot_product_attention(
            i["q"].transpose(1, 2), i["dense"], i["dense"][..., :v_dim], scale=scale, enable_gqa=True)
    if full and (topk or layout == "bf16"):
        flashmla = peer_libs.flashmla_mla_decode(layout, v_dim, scale, check=lambda i, got: _check(got, eager_mla(
            i["q"], i["cache"], layout, i["table"], i["seqused"], i["indices"], v_dim, scale)))
        if flashmla is not None:
            peers["flashmla"] = flashmla

    def make(device):
        from perf.cases.attention import _probe_peers

        nb = bsz * (ctx // PAGE)
        kv = torch.randn(nb * PAGE, d, device=device) * 2
        if layout == "bf16":
            cache = kv.to(BF16).view(nb, PAGE, 1, d)
        else:
            cache = ops.ds_kv_cache_empty(nb, PAGE, layout, device)
            ops.ds_kv_write(kv, torch.arange(nb * PAGE, device=device), cache, layout=layout)
        table = torch.randperm(nb, device=device).to(torch.int32).view(bsz, ctx // PAGE)
        i = {"q": torch.randn(bsz, 1, h, d, device=device, dtype=BF16), "cache": cache, "table": table,
             "seqused": torch.full((bsz,), ctx, dtype=torch.int32, device=device), "indices": None}
        if topk:
            i["indices"] = torch.argsort(torch.rand(bsz, 1, ctx, device=device), dim=-1)[..., :topk].to(torch.int32)
        if peers:  # the dequantized latents, dense per sequence, bf16 (B, 1, ctx, D)
            slots = (table.long()[:, :, None] * PAGE + torch.arange(PAGE, device=device)).view(-1).to(torch.int32)
            i["dense"] = _latents(cache, layout, slots).to(BF16).view(bsz, 1, ctx, d)
        _probe_peers(peers, state, i, device, where)
        return i

    def call(i, backend):
        return ops.mla_decode(i["q"], i["cache"], i["table"], i["seqused"], indices=i["indices"], layout=layout,
                              v_dim=v_dim, softmax_scale=scale, backend=backend)

    def reference(i):
        if full:
            return eager_mla(i["q"], i["cache"], layout, i["table"], i["seqused"], i["indices"], v_dim, scale)
        return ref.mla_decode(i["q"], i["cache"], i["table"], i["seqused"], i["indices"], layout, v_dim, scale, True,
                              -1, 0)[0]

    keys = bsz * (topk or ctx)
    index_bytes = keys * 8 if topk else bsz * (ctx // PAGE) * 4  # sparse: the index and its page's table entry
    nbytes = keys * TOKEN_BYTES[layout] + index_bytes + bsz * h * (2 * d + 2 * v_dim + 4) + bsz * 4
    label = f"{layout} B={bsz} ctx={ctx} H={h} " + (f"top-{topk}" if topk else "dense") + f" page={PAGE}"
    params = dict(layout=layout, B=bsz, ctx=ctx, H=h, Sq=1, D=d, v_dim=v_dim, topk=topk, page=PAGE, dtype="bf16")
    return BenchCase("mla_decode", label, "decode", params, make, call, reference, _check, bytes_moved=int(nbytes),
                     flops=2 * keys * h * (d + v_dim), peers=peers, compile_reference=False, tier=tier)


def mla_cases() -> list[BenchCase]:
    out = [_mla_case(layout, b, ctx) for layout in ("bf16", "v32", "v4") for b, ctx in ((1, 8192), (32, 4096),
                                                                                          (64, 8192))]
    out += [_mla_case("v32", 32, 8192, topk=2048), _mla_case("v32", 64, 8192, topk=2048),
            _mla_case("v4", 64, 8192, topk=1024)]
    out += [_mla_case("v32", 2, 128, h=16, tier="quick"), _mla_case("v4", 2, 128, topk=32, h=16, tier="quick")]
    return out
