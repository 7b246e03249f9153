"""lowbit_patch on tiny transformers models built from configs (random weights, fixed seed, nothing downloaded):
greedy generation of 64 new tokens for a left-padded batch of four prompts of different lengths equals the
unpatched eager model's, by the tie-aware rule of dispatch/integrations/hf/check.py (`compare_greedy`: the same
tokens, or a first difference at a tie of the unpatched model; per-step logits cosine >= 0.9999 before it), under
`auto` (the torch references on a CPU) and forced Triton (the interpreter, two steps, marked slow); unsupported
models and configs raise UnsupportedModelError before anything is modified."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dispatch  # noqa: E402
from dispatch.integrations.hf import UnsupportedModelError, lowbit_patch  # noqa: E402
from dispatch.integrations.hf.check import TIE_SPACINGS, build_model, compare_greedy, greedy, prompts  # noqa: E402

VOCAB = 128
PAD = 0
COSINE_MIN = 0.9999
# The generation checks: four left-padded prompts of different lengths, NEW_TOKENS greedy tokens (bf16 models);
# quantized experts and FP8 KV caches are held to QUANT_TOKENS. MAX_POSITIONS holds the longest prompt and them.
PROMPT_LENS = (7, 4, 11, 2)
NEW_TOKENS = 64
QUANT_TOKENS = 16
MAX_POSITIONS = 128
# MoE models generate NEW_TOKENS with every token routed to every expert: with random weights a router logit moved
# by one rounding can flip a top-k choice, a discrete change no token or cosine bound covers, and over 64 steps of
# four sequences one does (the routers' bytes are tested in tests/test_moe_routing.py). The top-k selection itself
# runs in a shorter generation, ROUTED_TOKENS.
ROUTED_TOKENS = 12


def _prompts(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 7 and 4 tokens, left padded as transformers' tokenizers pad for generation."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = PAD, 0
    return ids, mask


def _build(model_cls, config, dtype, seed: int = 0):
    return build_model(model_cls, config, seed=seed, dtype=dtype)


def generation_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """The generation checks' batch: PROMPT_LENS left padded, and its mask."""
    return prompts(PROMPT_LENS, VOCAB, seed=1)


def assert_generation_matches(patched, reference, new_tokens: int = NEW_TOKENS, backend: str = "auto",
                              cosine_min: float = COSINE_MIN, tie_spacings: float = TIE_SPACINGS):
    """Greedy generation of the four prompts: the same tokens, or a first difference at a tie of the reference
    (top-2 within tie_spacings bf16 spacings); every step before it at logits cosine >= cosine_min per sequence."""
    ids, mask = generation_prompts()
    want = greedy(reference, ids, mask, new_tokens)
    scope = dispatch.use_backend(backend) if backend != "auto" else contextlib.nullcontext()
    with scope:
        got = greedy(patched, ids, mask, new_tokens)
    check = compare_greedy(got, want, new_tokens, cosine_min, tie_spacings)
    assert check.agree, check.note


def assert_patched_generation_matches(reference, new_tokens: int, backend: str, expect: dict[str, int]):
    patched = copy.deepcopy(reference)
    report = lowbit_patch(patched)
    assert report.replaced == expect
    assert_generation_matches(patched, reference, new_tokens, backend)


def _snapshot(model) -> tuple:
    return ([type(m).__name__ for m in model.modules()],
            [(n, p.data_ptr(), p.shape) for n, p in model.named_parameters()], model.config._attn_implementation)


def assert_refused_unmodified(model, *reasons: str, **patch_kwargs):
    before = _snapshot(model)
    with pytest.raises(UnsupportedModelError) as err:
        lowbit_patch(model, **patch_kwargs)
    for reason in reasons:
        assert reason in str(err.value), f"{reason!r} not in {err.value}"
    assert len(err.value.problems) >= len(reasons)
    assert _snapshot(model) == before


# ------------------------------------------------------------------------------------------------ Llama


def llama(dtype=torch.bfloat16, **overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD,
              rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    kw.update(overrides)
    return _build(transformers.LlamaForCausalLM, transformers.LlamaConfig(**kw), dtype)


LLAMA_SWAPS = {"LlamaAttention": 2, "LlamaRMSNorm": 5, "LlamaMLP": 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_llama_generate_matches_unpatched(dtype):
    assert_patched_generation_matches(llama(dtype), NEW_TOKENS, "auto", LLAMA_SWAPS)


@pytest.mark.slow  # the Triton interpreter: about a minute on two CPU cores
def test_llama_generate_matches_unpatched_triton():
    assert_patched_generation_matches(llama(), 2, "triton", LLAMA_SWAPS)


def test_llama_unsupported_config_refused_unmodified():
    model = llama(hidden_act="gelu", head_dim=320, num_attention_heads=2, num_key_value_heads=1,
                  rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert_refused_unmodified(model, "hidden_act 'gelu'", "head_dim 320", "rope_type 'dynamic'")


def test_unknown_model_refused_unmodified():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    assert_refused_unmodified(_build(transformers.GPT2LMHeadModel, config, torch.bfloat16), "model_type 'gpt2'")


def test_training_mode_refused_unmodified():
    model = llama().train()
    assert_refused_unmodified(model, "training mode")


# ---------------------------------------------------------------------------------------------- GPT-OSS


def gpt_oss(dtype=torch.bfloat16, **overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"], max_position_embeddings=MAX_POSITIONS,
              pad_token_id=PAD,
              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "original_max_position_embeddings": MAX_POSITIONS // 4,
                               "truncate": False})
    kw.update(overrides)
    return _build(transformers.GptOssForCausalLM, transformers.GptOssConfig(**kw), dtype)


def gpt_oss_all_experts():
    """GPT-OSS with every token routed to all 4 experts: with top-2 of 4 a logit moved by one rounding can flip an
    expert choice, a discrete change no token or cosine bound covers."""
    return gpt_oss(num_experts_per_tok=4)


GPT_OSS_SWAPS = {"GptOssAttention": 2, "GptOssRMSNorm": 5, "GptOssMLP": 2}


@pytest.mark.parametrize("experts_per_token,new_tokens", [(4, NEW_TOKENS), (2, ROUTED_TOKENS)],
                         ids=["all_experts", "top2"])
def test_gpt_oss_generate_matches_unpatched(experts_per_token, new_tokens):
    assert_patched_generation_matches(gpt_oss(num_experts_per_tok=experts_per_token), new_tokens, "auto",
                                      GPT_OSS_SWAPS)


@pytest.mark.slow  # the Triton interpreter: about a minute on two CPU cores
def test_gpt_oss_generate_matches_unpatched_triton():
    assert_patched_generation_matches(gpt_oss(), 2, "triton", GPT_OSS_SWAPS)


def test_gpt_oss_fp32_experts_refused_unmodified():
    assert_refused_unmodified(gpt_oss(torch.float32), "layer 0 experts: dtype torch.float32",
                              "layer 1 experts: dtype torch.float32")


# ------------------------------------------------------------------------------------------ DeepSeek-V3


def deepseek_v3(dtype=torch.bfloat16, seed: int = 0, **overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8,
              num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32,
              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=MAX_POSITIONS,
              pad_token_id=PAD, routed_scaling_factor=2.5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": MAX_POSITIONS // 4, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})
    kw.update(overrides)
    return _build(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(**kw), dtype, seed)


DEEPSEEK_V3_SWAPS = {"DeepseekV3RMSNorm": 9, "DeepseekV3Attention": 2, "DeepseekV3MLP": 2, "DeepseekV3MoE": 1}


def deepseek_v3_all_experts(**overrides):
    """Every token to all 8 routed experts (the reason at ROUTED_TOKENS)."""
    return deepseek_v3(num_experts_per_tok=8, topk_group=4, **overrides)


@pytest.mark.parametrize("build,new_tokens", [(deepseek_v3_all_experts, NEW_TOKENS), (deepseek_v3, ROUTED_TOKENS)],
                         ids=["all_experts", "grouped_top2"])
def test_deepseek_v3_generate_matches_unpatched(build, new_tokens):
    assert_patched_generation_matches(build(), new_tokens, "auto", DEEPSEEK_V3_SWAPS)


def test_deepseek_v3_fp32_experts_refused_unmodified():
    assert_refused_unmodified(deepseek_v3(torch.float32), "layer 1 experts: dtype torch.float32")


def test_fp32_logit_errors_teacher_forcing_matches_generate():
    """The fp32 yardstick of the GPU tests: the fp32 model's own greedy logits, recomputed by its one teacher-forced
    forward over the left-padded sequences, have error ~0 (positions and steps line up); the bf16 model's are
    larger, and a perturbed result's larger still."""
    from dispatch.integrations.hf.check import fp32_logit_errors, greedy

    exact = llama().float()
    ids, mask = _prompts()
    own = greedy(exact, ids, mask, 4)
    assert float(fp32_logit_errors(exact, own, mask, 4).max()) < 1e-5
    bf16 = greedy(copy.deepcopy(exact).to(torch.bfloat16), ids, mask, 4)
    bf16_error = float(fp32_logit_errors(exact, bf16, mask, 4).max())
    assert 1e-5 < bf16_error < 0.1
    bf16.logits[2][1] += 0.05 * bf16.logits[2][1].abs().max()
    assert float(fp32_logit_errors(exact, bf16, mask, 4).max()) > 2 * bf16_error


# -------------------------------------------------------------------------------------------- Qwen3-MoE


def qwen3_moe(dtype=torch.bfloat16, **overrides):
    """Layer 0 sparse, every token to all 4 experts (with random weights a router logit moved by one rounding can
    flip a top-k choice, a discrete change no token or cosine bound covers: the routing itself is checked on the
    block below), layer 1 dense (`mlp_only_layers`)."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=4,
              norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128, pad_token_id=PAD)
    kw.update(overrides)
    return _build(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(**kw), dtype)


# Per layer: the two layer norms and the attention's q / k norms; plus the final norm.
QWEN3_MOE_SWAPS = {"Qwen3MoeAttention": 2, "Qwen3MoeRMSNorm": 9, "Qwen3MoeSparseMoeBlock": 1, "Qwen3MoeMLP": 1}
QWEN3_YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("rope", [None, QWEN3_YARN], ids=["default", "yarn"])
def test_qwen3_moe_generate_matches_unpatched(rope):
    from dispatch.integrations.hf.check import compare_greedy, greedy

    reference = qwen3_moe(**({} if rope is None else dict(rope_parameters=rope)))
    patched = copy.deepcopy(reference)
    report = lowbit_patch(patched)
    assert report.replaced == QWEN3_MOE_SWAPS and report.experts == "bf16"
    assert report.replacements["Qwen3MoeSparseMoeBlock"] == "LowbitQwen3MoeBlock"
    ids, mask = _prompts()
    check = compare_greedy(greedy(patched, ids, mask, 12), greedy(reference, ids, mask, 12), 12, COSINE_MIN)
    assert check.agree, check.note


@pytest.mark.slow  # the Triton interpreter: the attention, norm, RoPE and MoE kernels, two steps
def test_qwen3_moe_generate_matches_unpatched_triton():
    assert_patched_generation_matches(qwen3_moe(), 2, "triton", QWEN3_MOE_SWAPS)


def test_qwen3_moe_patch_adopts_parameters():
    """Same state-dict names; the router, experts, norms and attention projections are the same parameter objects
    (the dense MLP's gate / up become views of their fused weight)."""
    model = qwen3_moe()
    before = dict(model.named_parameters())
    lowbit_patch(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and model.state_dict().keys() == before.keys()
    fused = {n for n in before if n.startswith("model.layers.1.mlp.") and ("gate_proj" in n or "up_proj" in n)}
    assert len(fused) == 2
    assert all(after[n] is before[n] for n in before.keys() - fused)
    assert all(torch.equal(after[n], before[n]) for n in fused)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_moe_block_top2_matches_fp32_block(norm_topk_prob):
    """The sparse block alone, top-2 of 4 (the routing the generation test leaves out): the patched block's
    output is as close to transformers' block in fp32 as transformers' bf16 block is (the same bf16 router logits
    pick the same experts; the fp32 block's are checked to pick them too)."""
    reference = qwen3_moe(num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, mlp_only_layers=[])
    block = reference.model.layers[0].mlp
    exact = copy.deepcopy(block).float()
    patched = copy.deepcopy(reference)
    lowbit_patch(patched)
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        assert torch.equal(block.gate(x)[2], exact.gate(x.float())[2])
        want = exact(x.float())
        errors = [float((y.float() - want).norm() / want.norm()) for y in (patched.model.layers[0].mlp(x), block(x))]
    assert errors[0] <= 1.5 * errors[1] and errors[0] < 1e-2, errors


def test_qwen3_moe_unsupported_config_refused_unmodified():
    model = qwen3_moe(hidden_act="gelu", use_sliding_window=True, sliding_window=8, output_router_logits=True,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert_refused_unmodified(model, "hidden_act 'gelu'", "use_sliding_window with sliding_window 8",
                              "output_router_logits", "rope_type 'dynamic'")


def test_qwen3_moe_fp32_experts_and_expert_formats_refused_unmodified():
    assert_refused_unmodified(qwen3_moe(torch.float32, mlp_only_layers=[]), "layer 0 experts: dtype torch.float32",
                              "layer 1 experts: dtype torch.float32")
    assert_refused_unmodified(qwen3_moe(), "experts='fp8'", "expert_weights given", experts="fp8",
                              expert_weights={})
