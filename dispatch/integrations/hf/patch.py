"""`lowbit_patch(model)`: swap lowbit's ops into a loaded transformers model, in place (Liger-Kernel's
`apply_liger_kernel_to_*` convention: module swaps by name, one patch function per architecture).

Every patch first plans all its swaps and collects every reason it cannot make one; if there is any, it raises
`UnsupportedModelError` listing them all and the model is untouched. Only then are the modules replaced."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from triton_ops.attention.prefill import MAX_HEAD_DIM

from . import attention as attn
from .experts import deepseek_v3_fp8_experts, gpt_oss_mxfp4_experts, held_format, plan_deepseek_v3, plan_gpt_oss
from .mla import LowbitMlaAttention
from .modules import LowbitAttention, LowbitRMSNorm, LowbitSwiGLUMLP
from .moe import LowbitDeepseekV3MoE, LowbitGptOssMLP, LowbitQwen3MoeBlock
from .rope import cos_sin_cache, rope_problems

# The dtypes of the attention kernels (fp32 runs on the Triton kernel only; bf16 / fp16 on every GPU kernel).
ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UnsupportedModelError(ValueError):
    """A model, or some of its layers, that lowbit cannot patch; `problems` lists every reason."""

    def __init__(self, model_type: str, problems: list[str]):
        self.model_type, self.problems = model_type, list(problems)
        super().__init__(f"lowbit_patch({model_type}): cannot patch, nothing was modified:\n  - "
                         + "\n  - ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class PatchReport:
    """What a patch replaced: original module class name -> count, the lowbit modules that replaced them, and the
    experts' weight format ("bf16", "mxfp4", "fp8"; None for a dense model)."""

    model_type: str
    replaced: dict[str, int]
    replacements: dict[str, str]
    attn_implementation: str
    experts: str | None = None


@dataclasses.dataclass(frozen=True)
class Swap:
    parent: nn.Module
    name: str
    build: Callable[[nn.Module], nn.Module]


def _problems_common(model: nn.Module, config) -> list[str]:
    problems = []
    dtype = next(model.parameters()).dtype
    if dtype not in ATTENTION_DTYPES:
        problems.append(f"dtype {dtype} (the attention ops take {', '.join(map(str, ATTENTION_DTYPES))})")
    if model.training:
        problems.append("model in training mode (the ops are inference only: call model.eval())")
    return problems


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _apply(model: nn.Module, model_type: str, swaps: list[Swap], problems: list[str],
           experts: str | None = None) -> PatchReport:
    if problems:
        raise UnsupportedModelError(model_type, problems)
    replaced, replacements = collections.Counter(), {}
    for swap in swaps:
        old = getattr(swap.parent, swap.name)
        new = swap.build(old)
        setattr(swap.parent, swap.name, new)
        replaced[type(old).__name__] += 1
        replacements[type(old).__name__] = type(new).__name__
    attn.register()
    model.set_attn_implementation(attn.IMPLEMENTATION)
    return PatchReport(model_type, dict(replaced), replacements, attn.IMPLEMENTATION, experts)


def _norm_swaps(layer: nn.Module, names: tuple[str, ...], eps: float) -> list[Swap]:
    return [Swap(layer, name, lambda m: LowbitRMSNorm(m, eps)) for name in names]


def _attention_swaps(model, config, problems: list[str]) -> list[Swap]:
    """The attention swap of every decoder layer (Llama-style modules: q/k/v/o projections, NeoX RoPE)."""
    problems += rope_problems(config)
    head_dim = _head_dim(config)
    if head_dim > MAX_HEAD_DIM:
        problems.append(f"head_dim {head_dim} (the attention kernels take at most {MAX_HEAD_DIM})")
    if problems:
        return []
    device = next(model.parameters()).device
    cache = cos_sin_cache(config, model.model.rotary_emb, head_dim, device)
    return [Swap(layer, "self_attn", lambda m: LowbitAttention(m, cache)) for layer in model.model.layers]


def patch_llama(model: nn.Module, experts: str | None = None, expert_weights: Mapping | None = None) -> PatchReport:
    """LlamaForCausalLM / LlamaModel: RMSNorm -> ops.rms_norm, RoPE -> ops.rope, attention -> ops.attention /
    attention_prefill, the SwiGLU MLP's activation -> ops.swiglu (silu). A dense model: no expert arguments."""
    config = model.config
    problems = _problems_common(model, config)
    if experts is not None or expert_weights is not None:
        problems.append("experts / expert_weights given: Llama has no experts")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (the MLP patch is SwiGLU with silu)")
    swaps = _attention_swaps(model, config, problems)
    for layer in model.model.layers:
        swaps += _norm_swaps(layer, ("input_layernorm", "post_attention_layernorm"), config.rms_norm_eps)
        swaps.append(Swap(layer, "mlp", LowbitSwiGLUMLP))
    swaps += _norm_swaps(model.model, ("norm",), config.rms_norm_eps)
    return _apply(model, "llama", swaps, problems)


def _experts_format(plans: list) -> str | None:
    formats = sorted({plan.weights for plan in plans if plan is not None})
    return ",".join(formats) or None


# GPT-OSS's expert activation: transformers' GptOssExperts hard-codes these; the swap reads them from the module.
GPT_OSS_EXPERTS = {"alpha": 1.702, "limit": 7.0}


def patch_gpt_oss(model: nn.Module, experts: str | None = None, expert_weights: Mapping | None = None
                  ) -> PatchReport:
    """GptOssForCausalLM / GptOssModel: RMSNorm, RoPE (YaRN), attention with sinks and the alternating sliding /
    full layers, the router -> ops.moe_route and the experts -> lowbit's MoE op chain.

    experts: None (as the model holds them: bf16 / fp16), "bf16", or "mxfp4" (W4A16 through
    `moe_gemm_fp4_prepacked`: the checkpoint's MXFP4 tensors in `expert_weights` (a state dict with `<experts
    path>.gate_up_proj_blocks`, `_scales`, `down_proj_blocks`, `_scales`, as the GPT-OSS checkpoint names them)
    prepacked once, values unchanged, or without them the bf16 weights quantized at patch time). The replaced bf16
    experts are released."""
    config = model.config
    problems = _problems_common(model, config)
    swaps = _attention_swaps(model, config, problems)
    paths = {id(m): name for name, m in model.named_modules()}
    plans = []
    for i, layer in enumerate(model.model.layers):
        module = layer.mlp.experts
        plan = plan_gpt_oss(i, paths[id(module)], module, experts, expert_weights, problems)
        plans.append(plan)
        for name, want in GPT_OSS_EXPERTS.items():
            if getattr(module, name, None) != want:
                problems.append(f"layer {i} experts: {name} {getattr(module, name, None)} (ops.swiglu's GPT-OSS "
                                f"variant is patched with {name}={want})")
        swaps += _norm_swaps(layer, ("input_layernorm", "post_attention_layernorm"), config.rms_norm_eps)
        swaps.append(Swap(layer, "mlp", lambda m, p=plan: LowbitGptOssMLP(
            m, None if p.weights == "bf16" else gpt_oss_mxfp4_experts(p, m.experts, expert_weights))))
    swaps += _norm_swaps(model.model, ("norm",), config.rms_norm_eps)
    return _apply(model, "gpt_oss", swaps, problems, _experts_format(plans))


def _deepseek_layer(i: int, layer: nn.Module, config, experts: str | None, problems: list[str], plans: list,
                    attention: Callable[[nn.Module], nn.Module]) -> list[Swap]:
    original, eps = layer.self_attn, config.rms_norm_eps
    swaps = _norm_swaps(layer, ("input_layernorm", "post_attention_layernorm"), eps)
    swaps += _norm_swaps(original, tuple(n for n in ("q_a_layernorm", "kv_a_layernorm") if hasattr(original, n)),
                         eps)
    swaps.append(Swap(layer, "self_attn", attention))  # after its norms: it adopts the patched ones
    mlp = layer.mlp
    if not hasattr(mlp, "experts"):
        return swaps + [Swap(layer, "mlp", LowbitSwiGLUMLP)]
    plan = plan_deepseek_v3(i, mlp.experts, experts, problems)
    plans.append(plan)
    if mlp.gate.num_experts % mlp.gate.num_group:
        problems.append(f"layer {i} router: {mlp.gate.num_experts} experts in {mlp.gate.num_group} groups")
    return swaps + [Swap(mlp, "shared_experts", LowbitSwiGLUMLP), Swap(layer, "mlp", lambda m: LowbitDeepseekV3MoE(
        m, None if plan.weights == "bf16" else deepseek_v3_fp8_experts(plan, m.experts)))]


def patch_deepseek_v3(model: nn.Module, experts: str | None = None, expert_weights: Mapping | None = None
                      ) -> PatchReport:
    """DeepseekV3ForCausalLM / DeepseekV3Model: RMSNorm (the latent norms too), MLA attention (`LowbitMlaAttention`:
    the projections and the interleaved RoPE as transformers computes them; with a `LowbitMlaCache` the latent in
    pages, the absorbed `ops.mla_decode` for decode and `ops.attention_prefill_paged` over the decompressed latent
    for a prompt; otherwise transformers' cache and ops.attention / attention_prefill with the q/k 192 and v 128 head
    dims), the dense and shared SwiGLU MLPs, and the routed experts -> ops.moe_layer_routed (sigmoid + correction
    bias, grouped top-k).

    experts: None (as the model holds them: bf16 / fp16, or transformers' FP8Experts from an FP8 checkpoint, whose
    E4M3 weights and 128x128 `*_scale_inv` are used as they are), "bf16", or "fp8" (the bf16 weights quantized to
    128x128 E4M3 blocks at patch time, the checkpoints' scale_inv convention). FP8 experts run W8A8 (activations
    quantized per 1x128 group)."""
    return _patch_deepseek(model, "deepseek_v3", LowbitMlaAttention, experts, expert_weights)


def patch_deepseek_v32(model: nn.Module, experts: str | None = None, expert_weights: Mapping | None = None
                       ) -> PatchReport:
    """DeepseekV32ForCausalLM / DeepseekV32Model: DeepSeek-V3's patch (norms, dense and shared MLPs, routed experts
    bf16 or FP8, as `patch_deepseek_v3`) with the sparse MLA attention (`LowbitSparseMlaAttention`): transformers'
    DSA indexer kept as it is picks each query's index_topk keys; decode is the absorbed `ops.mla_decode` with those
    keys as `indices` (over a `LowbitMlaCache`'s pages, or transformers' cached latent as one page per sequence);
    a prompt runs transformers' masked dense attention over the decompressed latent (the prefill ops take no
    per-query key set). A bf16 model: `mla_decode` takes bf16."""
    from .sparse_mla import LowbitSparseMlaAttention

    dtype = next(model.parameters()).dtype
    problems = [] if dtype == torch.bfloat16 else [f"dtype {dtype} (DeepSeek-V3.2's sparse decode runs "
                                                   "ops.mla_decode, which takes bf16)"]
    return _patch_deepseek(model, "deepseek_v32", LowbitSparseMlaAttention, experts, expert_weights, problems)


def _patch_deepseek(model: nn.Module, model_type: str, attention: Callable[[nn.Module], nn.Module],
                    experts: str | None, expert_weights: Mapping | None, problems: list[str] | None = None
                    ) -> PatchReport:
    config = model.config
    problems = _problems_common(model, config) + (problems or [])
    if expert_weights is not None:
        problems.append("expert_weights given: DeepSeek's FP8 checkpoint tensors are read from the loaded "
                        "model's FP8Experts")
    head_dims = (config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    if max(head_dims) > MAX_HEAD_DIM:
        problems.append(f"head dims (qk {head_dims[0]}, v {head_dims[1]}) (the attention kernels take at most "
                        f"{MAX_HEAD_DIM})")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (the MLP patch is SwiGLU with silu)")
    swaps, plans = [], []
    for i, layer in enumerate(model.model.layers):
        swaps += _deepseek_layer(i, layer, config, experts, problems, plans, attention)
    swaps += _norm_swaps(model.model, ("norm",), config.rms_norm_eps)
    return _apply(model, model_type, swaps, problems, _experts_format(plans))


def _qwen3_moe_problems(config, experts: str | None, expert_weights: Mapping | None) -> list[str]:
    problems = []
    if experts not in (None, "bf16"):
        problems.append(f"experts={experts!r} (Qwen3-MoE experts run as the model holds them: None or 'bf16')")
    if expert_weights is not None:
        problems.append("expert_weights given: Qwen3-MoE's experts are read from the loaded model")
    if config.hidden_act != "silu":
        problems.append(f"hidden_act {config.hidden_act!r} (the MLP and expert patches are SwiGLU with silu)")
    if getattr(config, "use_sliding_window", False) or getattr(config, "sliding_window", None) is not None:
        problems.append(f"use_sliding_window with sliding_window {config.sliding_window} (the Qwen3-MoE patch "
                        "covers full attention only)")
    if getattr(config, "output_router_logits", False):
        problems.append("output_router_logits (the router logits for the auxiliary loss are a training output: "
                        "the patched MoE blocks do not record them)")
    return problems


def patch_qwen3_moe(model: nn.Module, experts: str | None = None, expert_weights: Mapping | None = None
                    ) -> PatchReport:
    """Qwen3MoeForCausalLM / Qwen3MoeModel: RMSNorm -> ops.rms_norm (the per-head q / k norms too, applied before
    RoPE), RoPE -> ops.rope, GQA attention as Llama's, the dense SwiGLU MLPs of `mlp_only_layers` /
    `decoder_sparse_step` as Llama's, and the sparse MoE blocks -> ops.moe_layer_routed (softmax over every expert,
    top-k, renormalized when `norm_topk_prob`). experts: None or "bf16" (as the model holds them: bf16 / fp16)."""
    config = model.config
    problems = _problems_common(model, config) + _qwen3_moe_problems(config, experts, expert_weights)
    eps = config.rms_norm_eps
    # The q / k norms first: the attention swaps adopt the patched ones.
    swaps = [s for layer in model.model.layers for s in _norm_swaps(layer.self_attn, ("q_norm", "k_norm"), eps)]
    swaps += _attention_swaps(model, config, problems)
    sparse = False
    for i, layer in enumerate(model.model.layers):
        swaps += _norm_swaps(layer, ("input_layernorm", "post_attention_layernorm"), eps)
        if not hasattr(layer.mlp, "experts"):
            swaps.append(Swap(layer, "mlp", LowbitSwiGLUMLP))
            continue
        sparse = True
        held = held_format(layer.mlp.experts)
        if held != "bf16":
            problems.append(f"layer {i} experts: dtype {held} (the expert GEMMs take bf16 / fp16 weights)")
        swaps.append(Swap(layer, "mlp", LowbitQwen3MoeBlock))
    swaps += _norm_swaps(model.model, ("norm",), eps)
    return _apply(model, "qwen3_moe", swaps, problems, "bf16" if sparse else None)


PATCHES: dict[str, Callable[..., PatchReport]] = {"llama": patch_llama, "gpt_oss": patch_gpt_oss,
                                                          "deepseek_v3": patch_deepseek_v3,
                                                          "deepseek_v32": patch_deepseek_v32,
                                                          "qwen3_moe": patch_qwen3_moe}


def lowbit_patch(model: nn.Module, experts: str | None = None, expert_weights: Mapping | None = None
                 ) -> PatchReport:
    """Patch a transformers model in place for its `config.model_type`; returns what was replaced. `experts` /
    `expert_weights`: the MoE experts' format (GPT-OSS "mxfp4", DeepSeek-V3 / V3.2 "fp8", Qwen3-MoE "bf16"; see the
    patch functions)."""
    model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    patch = PATCHES.get(model_type)
    if patch is None:
        raise UnsupportedModelError(model_type, [f"model_type {model_type!r} has no lowbit patch (supported: "
                                                 f"{', '.join(sorted(PATCHES))})"])
    return patch(model, experts=experts, expert_weights=expert_weights)
