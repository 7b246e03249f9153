"""MoE blocks for patched transformers models, composed of lowbit's MoE ops (docs/moe.md, docs/moe_gemm.md).

GPT-OSS: router logits (the model's linear with its bias) -> `ops.moe_route` softmax + renormalize (= softmax
over the top-k logits, transformers' GptOssTopKRouter) -> `moe_align` -> `moe_gather` -> `moe_gemm_bf16` (+ the
expert's gate_up bias) -> `ops.swiglu` (GPT-OSS variant, interleaved gate/up, alpha 1.702, limit 7.0) ->
`moe_gemm_bf16` (+ the down bias) -> `moe_combine`. The biases are why this is the op chain and not
`moe_layer`, which has none: each bias is added to the GEMM's rounded output, as transformers adds it. MXFP4
experts (`LowbitMxfp4Experts`, W4A16) run the same chain with `moe_gemm_fp4_prepacked` for the two GEMMs.

DeepSeek-V3: `ops.moe_layer_routed` with bf16 experts, or FP8 block-scaled ones (`LowbitFp8Experts`, W8A8: the
activations quantized per 1x128 group on the way, GEMM1 + SwiGLU + FP8 and GEMM2 + combine fused).

Qwen3-MoE: `ops.moe_layer_routed` with the model's bf16 / fp16 experts as transformers stores them (no biases,
[gate | up] rows, silu): softmax over every expert, top-k, renormalized when the config's `norm_topk_prob`.
"""

from __future__ import annotations

from torch import Tensor, nn

from ... import ops
from ...ops.moe_layer import _block_m
from .experts import LowbitFp8Experts, LowbitMxfp4Experts


def _transposed_storage(param: nn.Parameter) -> Tensor:
    """The (E, A, B) parameter's data as a contiguous (E, B, A) tensor; the parameter becomes its transposed
    view (same shape and state-dict name, one copy of the weights)."""
    data = param.detach().transpose(1, 2).contiguous()
    param.data = data.transpose(1, 2)
    return data


class LowbitGptOssMLP(nn.Module):
    """transformers' GptOssMLP (router + experts with biases) through lowbit's MoE ops; returns (out, None).
    `mxfp4` replaces the experts by MXFP4 ones (`moe_gemm_fp4_prepacked`); without it the bf16 / fp16 experts stay."""

    def __init__(self, original: nn.Module, mxfp4: LowbitMxfp4Experts | None = None):
        super().__init__()
        self.router, self.experts = original.router, original.experts if mxfp4 is None else mxfp4
        self.top_k, self.num_experts = original.router.top_k, original.router.weight.shape[0]
        self.alpha, self.limit = float(self.experts.alpha), float(self.experts.limit)
        if mxfp4 is None:
            self.register_buffer("w1", _transposed_storage(self.experts.gate_up_proj), persistent=False)  # (E, 2I, H)
            self.register_buffer("w2", _transposed_storage(self.experts.down_proj), persistent=False)  # (E, H, I)

    def _gemm(self, x: Tensor, proj: str, rows: Tensor) -> Tensor:
        if isinstance(self.experts, LowbitMxfp4Experts):
            return ops.moe_gemm_fp4_prepacked(x, *self.experts.prepacked(proj), fmt="mxfp4", m_indices=rows)
        return ops.moe_gemm_bf16(x, self.w1 if proj == "gate_up_proj" else self.w2, m_indices=rows)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, None]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)
        routing = ops.moe_route(logits, self.top_k, scoring="softmax", renormalize=True)
        layout = ops.moe_align(routing.topk_ids, self.num_experts, _block_m(routing.topk_ids.numel() /
                                                                              self.num_experts))
        rows = layout.m_indices
        expert_of_row = rows.clamp(min=0).long()  # padding rows (-1) are never combined: any expert's bias will do
        h = self._gemm(ops.moe_gather(x, layout.sorted_token_ids, self.top_k), "gate_up_proj", rows)
        h = h + self.experts.gate_up_proj_bias[expert_of_row]
        a = ops.swiglu(h, interleave=1, activation="gptoss", alpha=self.alpha, limit=self.limit, expert_ids=rows)
        out = self._gemm(a, "down_proj", rows) + self.experts.down_proj_bias[expert_of_row]
        y = ops.moe_combine(out, layout.inv_rows, routing.topk_weights, out_dtype=x.dtype)
        return y.view(shape), None


class LowbitDeepseekV3MoE(nn.Module):
    """transformers' DeepseekV3MoE: the router's fp32 logits -> `ops.moe_layer_routed` (sigmoid + correction
    bias, grouped top-k, renormalize, routed scaling; [gate | up] rows as transformers stores them) with the shared
    experts' output added in the combine. Experts bf16 / fp16, or FP8 (`fp8`: E4M3 + 128x128 scale_inv)."""

    def __init__(self, original: nn.Module, fp8: LowbitFp8Experts | None = None):
        super().__init__()
        self.gate, self.shared_experts = original.gate, original.shared_experts
        self.experts = original.experts if fp8 is None else fp8
        self.quantized = {} if fp8 is None else dict(weights="fp8", w1_scale=fp8.gate_up_proj_scale_inv,
                                                     w2_scale=fp8.down_proj_scale_inv)

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape, gate = hidden_states.shape, self.gate
        x = hidden_states.reshape(-1, shape[-1])
        logits = nn.functional.linear(x.float(), gate.weight.float())
        y = ops.moe_layer_routed(x, logits, self.experts.gate_up_proj, self.experts.down_proj, top_k=gate.top_k,
                                 scoring="sigmoid", bias=gate.e_score_correction_bias.float(),
                                 renormalize=bool(gate.norm_topk_prob),
                                 routed_scaling=float(gate.routed_scaling_factor), num_groups=gate.num_group,
                                 topk_groups=gate.topk_group,
                                 shared=self.shared_experts(x), **self.quantized)
        return y.view(shape)


class LowbitQwen3MoeBlock(nn.Module):
    """transformers' Qwen3MoeSparseMoeBlock: the router's logits (its linear in the model's dtype, as transformers
    computes them) -> `ops.moe_layer_routed` (softmax over every expert in fp32, top-k, renormalized when
    `norm_topk_prob`; [gate | up] rows, silu). The router and experts modules are kept: same parameters, same
    state-dict names."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.gate, self.experts = original.gate, original.experts

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = nn.functional.linear(x, self.gate.weight)
        y = ops.moe_layer_routed(x, logits, self.experts.gate_up_proj, self.experts.down_proj, top_k=self.gate.top_k,
                                 scoring="softmax", renormalize=bool(self.gate.norm_topk_prob))
        return y.view(shape)
