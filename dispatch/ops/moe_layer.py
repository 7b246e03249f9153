"""The whole MoE expert layer in one call: align -> gather (+ FP8 quantize) -> GEMM1 + SwiGLU (+ FP8 quantize) ->
GEMM2 into token order -> weighted combine, composed of the moe and moe_gemm ops (docs/moe_gemm.md).

No host sync and static shapes throughout (the layouts' capacities depend on shapes only), so the layer is
CUDA-graph capturable and torch.compile sees one custom op per stage. fused=False runs the chain of separate ops
(moe_gemm, swiglu, moe_combine); fused=True (the default for prepacked FP4 weights, and for FP8 weights where
the chain's GEMMs would run the Triton kernel on the contiguous layout: there it is faster) has GEMM1
apply SwiGLU (and the FP8 quantization) in its epilogue, so its (rows, 2I) output never goes to memory, and GEMM2
scatter its rows into token order for the combine (the same bytes as the chain, on the CPU interpreter and on the
H100: docs/moe_gemm.md). The activations between GEMM1 and GEMM2 are written once (FP8: as codes + scales).
Expert parallelism: `expert_map` maps global to local expert ids (-1 = not on this rank); tokens routed elsewhere
get no row and contribute nothing here.
`moe_layer_routed` takes router logits instead of a routing and runs `moe_route` first.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from triton_ops.contract import checks as C

from ._common import backend_for
from .moe import moe_align, moe_combine, moe_gather, moe_gather_fp8, moe_masked_layout, moe_route
from .moe_gemm import (
    moe_gemm_bf16,
    moe_gemm_combine,
    moe_gemm_combine_fp4_prepacked,
    moe_gemm_fp4_prepacked,
    moe_gemm_fp8,
    moe_gemm_mxfp4,
    moe_gemm_nvfp4,
    moe_gemm_swiglu,
    moe_gemm_swiglu_fp4_prepacked,
    moe_gemm_swiglu_fp8_group,
    moe_gemm_w4a8,
)
from .swiglu import swiglu, swiglu_fp8_group

OP = "moe_layer"
FORMATS = ("bf16", "fp8", "mxfp4", "w4a8", "nvfp4")


def _block_m(rows_per_expert: float) -> int:
    """Contiguous-layout padding unit: the grouped GEMM's row tile for this load (decode 16, prefill 128), so a
    tile holds one expert and takes one pass over K."""
    return 128 if rows_per_expert >= 128 else (64 if rows_per_expert >= 32 else 16)


def moe_layer(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, *,
              weights: Literal["bf16", "fp8", "mxfp4", "w4a8", "nvfp4"] = "bf16", w1_scale: Tensor | None = None,
              w2_scale: Tensor | None = None, activation: Literal["silu", "gptoss"] = "silu", interleave: int = 0,
              alpha: float = 1.702, limit: float | None = None, layout: Literal["contiguous", "masked"] = "contiguous",
              max_m: int | None = None, expert_map: Tensor | None = None, shared: Tensor | None = None,
              fused: bool | None = None, backend: str = "auto", w1_global: Tensor | None = None,
              w2_global: Tensor | None = None, prepacked: bool = False) -> Tensor:
    """y[t] = sum_j topk_weights[t, j] * W2[e] . act(W1[e] . hidden[t]) over the token's experts e = topk_ids[t, j]
    (+ shared[t]), in hidden's dtype.

    hidden (T, H) bf16; topk_ids (T, k) int32/int64; topk_weights (T, k) fp32; w1 (E, 2I, H) (gate|up halves, or
    interleaved: `interleave`), w2 (E, H, I). weights: "bf16" (w1/w2 bf16), "fp8" (E4M3 weights with 128x128
    block scales w1_scale / w2_scale; activations quantized to 1x128 groups on the way: before GEMM1 by
    moe_gather_fp8, before GEMM2 by the fused swiglu_fp8_group), "mxfp4" (W4A16: w1/w2 packed e2m1 (E, N, K/2)
    uint8 with E8M0 scales (E, N, K/32)), "w4a8" (those MXFP4 weights with FP8 activations quantized as for
    "fp8"), "nvfp4" (W4A16, hidden bf16 / fp16: packed e2m1 (E, N, K/2) uint8 with E4M3 scales per 16 (E, N,
    K/16) and fp32 (E,) global scales per expert w1_global / w2_global, which only nvfp4 takes). layout:
    "contiguous" (moe_align rows; prefill) or "masked" (E, max_m, .) rows per expert (decode; tokens past max_m
    for an expert are dropped, as moe_masked_layout defines).
    fused: GEMM1 with SwiGLU (+ quantization) in its epilogue and GEMM2 scattered into token order
    (moe_gemm_swiglu[_fp8_group], moe_gemm_combine: 4 launches + the align); False: the chain of separate ops
    (moe_gemm_*, swiglu[_fp8_group], moe_combine). Same bytes given the same GEMM accumulators. None (default): for FP8
    weights fused only on the contiguous layout where the chain's GEMMs would run the Triton kernel (there timed faster
    than the chain on an H100: GEMM1 + SwiGLU + FP8 1.08x, GEMM2 + combine 1.23x), the chain where they run the CuTe
    kernel and on the masked layout (`_fp8_fused_by_default`); fused for prepacked FP4 weights (the one-pass GEMM1 +
    SwiGLU tile: the GPT-OSS-120b layer 1.00-1.03x the chain at 64 / 4096 tokens, H100; docs/moe_gemm.md names the
    records), the chain otherwise (linear-layout MXFP4 GEMM1 + SwiGLU timed 0.97-0.99x the chain, NVFP4 0.97-1.05x).
    prepacked: w1 / w2 and w1_scale / w2_scale are `moe_gemm_fp4_prepack`'s output for weights "mxfp4" / "nvfp4"
    (int32 values (E, N, KP/8), uint8 scales (E, N, SP); globals as above), and both GEMMs run the prepacked kernel:
    the chain (`moe_gemm_fp4_prepacked`, swiglu, `moe_gemm_fp4_prepacked`, moe_combine), or with fused=True
    `moe_gemm_swiglu_fp4_prepacked` and `moe_gemm_combine_fp4_prepacked` (the fused ops' prepacked forms). The same
    math as the linear weights they were prepacked from (the GEMMs sum in another order)."""
    for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w1", w1),
                    ("w2", w2)):
        C.check_tensor(OP, name, t)
    if weights not in FORMATS:
        C.fail(OP, "weights", f"{weights!r} is not one of {', '.join(FORMATS)}")
    if weights == "fp8" and (w1_scale is None or w2_scale is None):
        C.fail(OP, "w1_scale", "FP8 weights need w1_scale and w2_scale (128x128 block scales)")
    if weights in ("mxfp4", "w4a8") and (w1_scale is None or w2_scale is None):
        C.fail(OP, "w1_scale", "MXFP4 weights need w1_scale and w2_scale (E8M0 per 32)")
    if weights == "nvfp4" and (w1_scale is None or w2_scale is None):
        C.fail(OP, "w1_scale", "NVFP4 weights need w1_scale and w2_scale (E4M3 per 16)")
    for name, g in (("w1_global", w1_global), ("w2_global", w2_global)):
        if weights == "nvfp4" and g is None:
            C.fail(OP, name, "NVFP4 weights need w1_global and w2_global (fp32 (E,), a global scale per expert)")
        if weights != "nvfp4" and g is not None:
            C.fail(OP, name, f"only NVFP4 weights take global scales ({weights} weights: give None)")
    if hidden.dim() != 2 or topk_ids.dim() != 2:
        C.fail(OP, "hidden", f"expected hidden (T, H) and topk_ids (T, k), got {tuple(hidden.shape)} and "
                             f"{tuple(topk_ids.shape)}")
    if prepacked and weights not in ("mxfp4", "nvfp4"):
        C.fail(OP, "prepacked", f"only MXFP4 / NVFP4 weights have a prepacked layout (weights={weights!r})")
    num_experts, top_k = w1.shape[0], topk_ids.shape[1]
    if fused is None and weights != "fp8":
        fused = prepacked  # FP8: decided once the activations are gathered (`_fp8_fused_by_default`)
    act = dict(interleave=interleave, activation=activation, alpha=alpha, limit=limit)
    if layout == "contiguous":
        lay = moe_align(topk_ids, num_experts, _block_m(topk_ids.numel() / max(num_experts, 1)),
                        expert_map=expert_map, backend=backend)
        rows, place, inv_rows = lay.sorted_token_ids, dict(m_indices=lay.m_indices), lay.inv_rows
        act_place = dict(expert_ids=lay.m_indices)
    elif layout == "masked":
        if max_m is None:
            C.fail(OP, "max_m", "the masked layout needs max_m (rows per expert)")
        lay = moe_masked_layout(topk_ids, num_experts, max_m, expert_map=expert_map, backend=backend)
        rows, place, inv_rows = lay.src_rows, dict(masked_m=lay.masked_m), lay.inv_rows
        act_place = dict(masked_m=lay.masked_m)
    else:
        C.fail(OP, "layout", f"{layout!r} is not 'contiguous' or 'masked'")
    if prepacked:
        x = moe_gather(hidden, rows, top_k, backend=backend)
        pk = dict(fmt=weights, **place, backend=backend)
        if fused:
            a = moe_gemm_swiglu_fp4_prepacked(x, w1, w1_scale, w_global=w1_global, **pk, **act)
            return moe_gemm_combine_fp4_prepacked(a, w2, w2_scale, rows, inv_rows, topk_weights, w_global=w2_global,
                                                  shared=shared, out_dtype=hidden.dtype, **pk)
        a = swiglu(moe_gemm_fp4_prepacked(x, w1, w1_scale, w_global=w1_global, **pk), **act, **act_place,
                   backend=backend)
        out = moe_gemm_fp4_prepacked(a, w2, w2_scale, w_global=w2_global, **pk)
    elif weights in ("fp8", "w4a8"):
        gemm = moe_gemm_fp8 if weights == "fp8" else moe_gemm_w4a8
        g = moe_gather_fp8(hidden, rows, top_k, backend=backend)
        if fused is None:
            fused = _fp8_fused_by_default(g, w1, w1_scale, place, backend)
        if fused:
            a = moe_gemm_swiglu_fp8_group(g.codes, w1, a_scale=g.scales, w_scale=w1_scale, weights=weights, **place,
                                          **act, backend=backend)
            return moe_gemm_combine(a.codes, w2, rows, inv_rows, topk_weights, a_scale=a.scales, w_scale=w2_scale,
                                    weights=weights, **place, shared=shared, out_dtype=hidden.dtype, backend=backend)
        h = gemm(g.codes, g.scales, w1, w1_scale, **place, backend=backend)
        a = swiglu_fp8_group(h, **act, **act_place, backend=backend)
        out = gemm(a.codes, a.scales, w2, w2_scale, **place, backend=backend)
    elif fused:
        return _fused_experts(hidden, rows, top_k, place, inv_rows, topk_weights, w1, w2, weights, w1_scale, w2_scale,
                              act, shared, backend, w1_global, w2_global)
    else:
        x = moe_gather(hidden, rows, top_k, backend=backend)
        gemm = {"bf16": moe_gemm_bf16, "mxfp4": moe_gemm_mxfp4, "nvfp4": moe_gemm_nvfp4}[weights]
        scale1, scale2 = {"bf16": ((), ()), "mxfp4": ((w1_scale,), (w2_scale,)),
                          "nvfp4": ((w1_scale, w1_global), (w2_scale, w2_global))}[weights]
        h = gemm(x, w1, *scale1, **place, backend=backend)
        a = swiglu(h, **act, **act_place, backend=backend)
        out = gemm(a, w2, *scale2, **place, backend=backend)
    return moe_combine(out, inv_rows, topk_weights, shared=shared, out_dtype=hidden.dtype, backend=backend)


def moe_layer_routed(hidden: Tensor, router_logits: Tensor, w1: Tensor, w2: Tensor, *, top_k: int,
                     scoring: Literal["softmax", "sigmoid", "sqrt_softplus"] = "softmax", bias: Tensor | None = None,
                     renormalize: bool = False, routed_scaling: float = 1.0, num_groups: int = 1,
                     topk_groups: int = 1, backend: str = "auto", **layer) -> Tensor:
    """moe_layer from router logits [T, E]: `moe_route` (its scoring presets: GPT-OSS softmax + renormalize,
    DeepSeek-V3 sigmoid + bias + groups + routed_scaling, DeepSeek-V4 sqrt_softplus + bias) picks each token's
    top_k experts and weights on the device, then the layer runs on them; `layer` takes moe_layer's keyword
    arguments (weights, scales, w1_global / w2_global, activation, layout, expert_map, shared, fused, ...). With
    expert parallelism the logits cover the global experts and `expert_map` maps them to this rank's."""
    for name, t in (("hidden", hidden), ("router_logits", router_logits), ("w1", w1), ("w2", w2)):
        C.check_tensor("moe_layer_routed", name, t)
    routing = moe_route(router_logits, top_k, scoring=scoring, bias=bias, renormalize=renormalize,
                        routed_scaling=routed_scaling, num_groups=num_groups, topk_groups=topk_groups,
                        backend=backend)
    return moe_layer(hidden, routing.topk_ids, routing.topk_weights, w1, w2, backend=backend, **layer)


def _fp8_fused_by_default(gathered, w1, w1_scale, place: dict, backend: str) -> bool:
    """fused=None with FP8 weights: the fused GEMM1 + SwiGLU + FP8 quantize only on the contiguous layout where the
    chain's GEMMs would run the Triton kernel (prefill without the CuTe FP8 GEMM: fused 1.12x / 1.16x the chain,
    H100). The chain where they run the CuTe kernel (DeepSeek-V3 dims, 4096 tokens, H200: chain 6.21 ms, fused
    10.15 ms) and on the masked layout (64 tokens: chain 3.28 ms, fused 5.47 ms; the fused GEMM1 runs at half the
    plain GEMM's weight rate there): perf/results/experiments/2026-11-29-h200-moe-layer-6429f7b.json."""
    if "m_indices" not in place:
        return False
    chain_gemm = backend_for("moe_gemm_fp8", gathered.codes, gathered.scales, w1, w1_scale, place["m_indices"], None,
                             None, backend=backend)
    return chain_gemm != "cute"


def _fused_experts(hidden, rows, top_k, place, inv_rows, topk_weights, w1, w2, weights, w1_scale, w2_scale, act,
                   shared, backend, w1_global=None, w2_global=None):
    """gather -> GEMM1 with SwiGLU in its epilogue -> GEMM2 scattered into token order -> slot-order combine (16-bit
    activations; FP8 runs the same steps in `moe_layer`'s FP8 branch): the same bytes as the unfused chain, without
    the (rows, 2I) GEMM1 output in memory."""
    x = moe_gather(hidden, rows, top_k, backend=backend)
    x2 = moe_gemm_swiglu(x, w1, w_scale=w1_scale, weights=weights, **place, **act, backend=backend,
                         w_global=w1_global)
    return moe_gemm_combine(x2, w2, rows, inv_rows, topk_weights, w_scale=w2_scale, weights=weights, **place,
                            shared=shared, out_dtype=hidden.dtype, backend=backend, w_global=w2_global)


def moe_layer_reference(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor,
                        act) -> Tensor:
    """The layer's math in fp32 on dequantized bf16 weights, token by token (tests): act maps (T, 2I) -> (T, I)."""
    y = torch.zeros(hidden.shape[0], w2.shape[1], dtype=torch.float32, device=hidden.device)
    for j in range(topk_ids.shape[1]):
        for e in torch.unique(topk_ids[:, j]).tolist():
            if not 0 <= e < w1.shape[0]:
                continue
            sel = topk_ids[:, j] == e
            h = hidden[sel].float() @ w1[e].float().t()
            y[sel] += topk_weights[sel, j:j + 1] * (act(h) @ w2[e].float().t())
    return y.to(hidden.dtype)
