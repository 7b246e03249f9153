"""Benchmark cases for DeepSeek MLA decode (`mla_decode`, bucket "decode") and DeepSeek-V3.2's indexer scores
(`mla_index_scores`, bucket "prefill"), part of the attention family (perf/cases/attention.py adds them to its case
list).

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

`mla_index_scores` (the V3.2 indexer before its top-k): H = 64 indexer heads, D = 128, a causal prompt of B = 4 x
S = T = 2048 tokens (the mask a (B, S, T) bool tensor, as `LowbitIndexer` passes it); q and k bf16, weights fp32.
Bytes model: q, k, the weights and the mask read once, the fp32 scores written once (the torch forms' (B, S, H, T)
fp32 intermediate is not counted: the kernel never writes it). FLOPs: 2 x H x D per visible (query, key) pair (the
attention cases' rule: masked pairs are not useful work). Check: -inf exactly where the reference has it, the
finite scores within a normalized error of INDEX_TOL of `bmm_index_scores` (fp32; the fp64 contract reference in
the quick case). Peers (torch eager, fp32 as transformers computes them): `hf-matmul`, transformers'
`DeepseekV32Indexer` form (the broadcast `torch.matmul` of q (B, S, H, D) with k (B, 1, D, T), ReLU, head-weight
matmul, masked_fill); `hf-bmm`, the same with the scores as one batched GEMM per sequence (the form `LowbitIndexer`
used before the op). The reference (timed as "torch") is the bmm form.
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
    return out + index_cases()


# ------------------------------------------------------------------------------------------------ indexer scores

INDEX_TOL = 1e-4  # normalized error of fp32 scores: the same products summed in another order


def matmul_index_scores(q, k, weights, scale, visible):
    """transformers' `DeepseekV32Indexer` scores: the broadcast matmul (a (B, S, D, T) fp32 copy of the keys),
    ReLU, the head weights as a matmul over the (B, S, H, T) scores, the mask."""
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2).masked_fill(~visible, -math.inf)


def bmm_index_scores(q, k, weights, scale, visible):
    """The same scores with one batched GEMM per sequence, (S x H query rows) x (T keys): no copy of the keys."""
    b, s, h, d = q.shape
    scores = torch.bmm(q.float().view(b, s * h, d), k.float().transpose(1, 2)).view(b, s, h, k.shape[1])
    scores = torch.relu(scores * scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2).masked_fill(~visible, -math.inf)


def check_index_scores(got, want) -> None:
    if got.shape != want.shape or got.dtype != torch.float32:
        raise AssertionError(f"{got.dtype} {tuple(got.shape)}, expected float32 {tuple(want.shape)}")
    finite = torch.isfinite(want)
    if not torch.equal(torch.isneginf(got), ~finite):
        raise AssertionError("-inf at other places than the reference's")
    from perf.cases.attention import _normalized_error

    err = _normalized_error(got[finite], want[finite])
    if not err <= INDEX_TOL:
        raise AssertionError(f"normalized max error {err:.3e} > {INDEX_TOL}")


def _index_case(b: int, s: int, h: int, d: int, tier: str = "full") -> BenchCase:
    full = tier == "full"
    scale = d ** -0.5

    def make(device):
        visible = ref.visible_keys(s, s, True, (-1, -1), device)[None].repeat(b, 1, 1)
        return {"q": torch.randn(b, s, h, d, device=device, dtype=BF16),
                "k": torch.randn(b, s, d, device=device, dtype=BF16),
                "w": torch.randn(b, s, h, device=device) * h ** -0.5, "visible": visible}

    def call(i, backend):
        return ops.mla_index_scores(i["q"], i["k"], i["w"], softmax_scale=scale, visible=i["visible"],
                                    backend=backend)

    def reference(i):
        if full:
            return bmm_index_scores(i["q"], i["k"], i["w"], scale, i["visible"])
        return ref.mla_index_scores(i["q"], i["k"], i["w"], scale, i["visible"])

    peers = {}
    if full:
        peers = {"hf-matmul": lambda i: matmul_index_scores(i["q"], i["k"], i["w"], scale, i["visible"]),
                 "hf-bmm": lambda i: bmm_index_scores(i["q"], i["k"], i["w"], scale, i["visible"])}
    pairs = b * s * (s + 1) // 2
    nbytes = b * s * h * d * 2 + b * s * d * 2 + b * s * h * 4 + b * s * s * (1 + 4)
    params = dict(B=b, S=s, T=s, H=h, D=d, mask="causal", dtype="bf16")
    return BenchCase("mla_index_scores", f"V3.2 B={b} S=T={s} H={h} D={d} causal", "prefill", params, make, call,
                     reference, check_index_scores, bytes_moved=nbytes, flops=2 * pairs * h * d, peers=peers,
                     compile_reference=False, tier=tier, max_copies=4)


def index_cases() -> list[BenchCase]:
    return [_index_case(4, 2048, 64, 128), _index_case(2, 40, 8, 32, tier="quick")]
