"""Kernel variants that benchmarks time beside the table's choice (the `triton-*` peers of perf/cases/moe.py and
perf/cases/moe_gemm.py, the tile sweeps of perf/scripts): a Triton or CuTe entry run with a setting the dispatcher
never picks, named here so that the benchmarks reach kernels through dispatch only. Not table rows and not torch
ops: each calls its kernel entry directly, with that entry's own argument checks; the arguments are the op's
backend arguments (its public wrapper's defaults filled in) plus the forced setting. The kernel modules are
imported on first use, as the table's are (importing this module imports no Triton)."""

from __future__ import annotations


def moe_route_tiled(logits, bias, top_k: int, scoring: str, renormalize: bool, routed_scaling: float,
                    num_groups: int, topk_groups: int, *, rows_per_program: int, num_warps: int):
    """moe_route's Triton kernel with a forced tile: `rows_per_program` token rows per program (a power of two) and
    `num_warps` warps, instead of `pick_route_config`'s choice."""
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"lowbit.moe_route_tiled: argument 'rows_per_program': a power of two, got {rows_per_program}")
    from triton_ops.moe.routing import RouteConfig, moe_route

    return moe_route(logits, bias, top_k, scoring, renormalize, routed_scaling, num_groups, topk_groups,
                     config=RouteConfig(rows_per_program, num_warps))


def moe_align_three_launch(topk_ids, expert_map, num_experts: int, block_m: int):
    """moe_align's Triton kernels on the three-launch path (per-chunk counts, scan, scatter + fill) that large
    T * k takes, at any size."""
    from triton_ops.moe.align import moe_align

    return moe_align(topk_ids, expert_map, num_experts, block_m, path="general")


def moe_masked_layout_three_launch(topk_ids, expert_map, num_experts: int, max_m: int):
    """moe_masked_layout's Triton kernels on the three-launch path, at any size."""
    from triton_ops.moe.align import moe_masked_layout

    return moe_masked_layout(topk_ids, expert_map, num_experts, max_m, path="general")


def moe_gemm_bf16_cute_tiled(a, w, m_indices, masked_m, *, tiles: dict):
    """moe_gemm_bf16's sm_90 CuTe grouped GEMM with `tiles` (tile_m / tile_n / stages / epilogue ...) overriding
    `pick_config`'s rule field by field."""
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    return moe_gemm_bf16(a, w, m_indices, masked_m, tiles=dict(tiles))


def attention_prefill_cute_sm90_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                      softmax_scale: float, causal: bool, *, tiles: dict):
    """attention_prefill's sm_90 CuTe kernel (no window, no sinks) with `tiles` (FmhaSm90Config fields: tile_m,
    overlap, persistent, o_tma, tile_n) overriding `FmhaSm90Config.for_call`'s rule field by field."""
    from cute_ops.attention.fmha_sm90 import attention_prefill

    return attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                             -1, -1, None, True, tiles=dict(tiles))


def moe_gemm_mxfp4_dot_scaled(a, w_packed, w_scale, m_indices, masked_m):
    """moe_gemm_mxfp4's Triton kernel through tl.dot_scaled (lhs bf16, rhs E2M1 + E8M0 scales) instead of the
    in-register dequantization the table's row runs."""
    from triton_ops.moe_gemm.grouped import moe_gemm_mxfp4

    return moe_gemm_mxfp4(a, w_packed, w_scale, m_indices, masked_m, dot_scaled=True)


def moe_gemm_fp4_prepacked_configured(a, w_values, w_scales, w_global, fmt: str, m_indices, masked_m, *,
                                      config: dict):
    """moe_gemm_fp4_prepacked's Triton kernel with `config` (MoeGemmConfig fields: block_m tokens, block_n weight
    rows, block_k, num_warps, num_stages, scale_words, fold_scale, a_tma, expert_slots) overriding the rule's
    config field by field."""
    import dataclasses

    from triton_ops.moe_gemm.prepacked import config_for_call, moe_gemm_fp4_prepacked

    rule = config_for_call(a, w_values, masked_m, fmt)
    return moe_gemm_fp4_prepacked(a, w_values, w_scales, w_global, fmt, m_indices, masked_m,
                                  config=dataclasses.replace(rule, **config))


def attention_decode_rule(q, k_cache, v_cache, block_table) -> dict:
    """The configuration attention_decode's rule picks for these shapes (num_splits, block_n, num_warps, ...)."""
    import dataclasses

    from triton_ops.attention.decode import config_for_call

    return dataclasses.asdict(config_for_call(q, k_cache, v_cache, block_table))


def attention_decode_configured(q, k_cache, v_cache, block_table, seqused_k, softmax_scale: float, *,
                                k_scale=None, v_scale=None, num_splits: int, block_n: int, num_warps: int,
                                num_stages: int, v_f16_smem: bool | None = None):
    """attention_decode's Triton kernel (causal, no window, no sinks) with a forced configuration: `num_splits` key
    slices per (sequence, KV head), `block_n` keys per step, `num_warps`, `num_stages` and (FP8 caches, not None)
    `v_f16_smem`, instead of `decode_config`'s choice (the packed-row tile stays the rule's)."""
    import dataclasses

    from triton_ops.attention.decode import attention_decode, config_for_call

    forced = dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    if v_f16_smem is not None:
        forced["v_f16_smem"] = v_f16_smem
    cfg = dataclasses.replace(config_for_call(q, k_cache, v_cache, block_table, num_splits), **forced)
    return attention_decode(q, k_cache, v_cache, block_table, seqused_k, softmax_scale, True, -1, -1, None,
                            k_scale, v_scale, num_splits, cfg=cfg)[0]


__all__ = ["attention_decode_configured", "attention_decode_rule",
           "moe_align_three_launch", "moe_gemm_fp4_prepacked_configured", "moe_gemm_mxfp4_dot_scaled",
           "moe_masked_layout_three_launch",
           "moe_route_tiled"]
