"""lowbit_patch on a GPU: the patched models run lowbit's GPU kernels (the backends `auto` picks on the card) and are
compared with the unpatched eager model on the same card, at the real head dims (Llama 128, GPT-OSS 64 with sinks
and a sliding window, DeepSeek-V3 MLA 192 / 128, Qwen3-MoE 128 with its q / k norms) with few, narrow layers and
random weights.

Greedy tokens: a batch of four left-padded prompts of different lengths, 64 new tokens. With random weights two
logits can tie to within the rounding both stacks make, so a divergence is accepted only at a step where the
unpatched model's own top-2 gap is at most a few bf16 spacings of its top logit (the rule of
dispatch/integrations/hf/check.py: compare_greedy);
every other step must give the same token, and every step before the first divergence a logits cosine of at least
0.9999 per sequence. Paged: the same model through LowbitPagedCache (the paged decode kernel) against itself
unpaged (bf16 pages), and FP8 E4M3 pages against the unpatched model: the first 16 tokens, cosine >= 0.99, ties
within FP8_TIE_SPACINGS (E4M3 carries 4 fewer significant bits than bf16)."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dispatch.integrations.hf import LowbitPagedCache, lowbit_patch  # noqa: E402
from dispatch.integrations.hf.check import (  # noqa: E402
    FP8_TIE_SPACINGS,
    TIE_SPACINGS,
    build_model,
    compare_greedy,
    greedy,
    prompts,
)

pytestmark = pytest.mark.gpu

VOCAB = 512
PAD = 0
NEW_TOKENS = 64
QUANT_TOKENS = 16  # quantized experts and FP8 KV: the first 16 tokens, logits cosine >= QUANT_COSINE_MIN
PROMPT_LENS = (29, 17, 8, 23)
COSINE_MIN = 0.9999
QUANT_COSINE_MIN = 0.99


def _generate(model, past_key_values=None, new_tokens: int = NEW_TOKENS):
    ids, mask = prompts(PROMPT_LENS, VOCAB, device="cuda")
    return greedy(model, ids, mask, new_tokens, past_key_values=past_key_values)


def assert_same_greedy_tokens(got, want, what: str, new_tokens: int = NEW_TOKENS, cosine_min: float = COSINE_MIN,
                              tie_spacings: float = TIE_SPACINGS) -> None:
    check = compare_greedy(got, want, new_tokens, cosine_min, tie_spacings)
    assert check.agree, f"{what}: {check.note}"


def build_on_gpu(model_cls, config):
    return build_model(model_cls, config, device="cuda")


def llama():
    return build_on_gpu(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=256, pad_token_id=PAD,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))


def gpt_oss():
    """Every token to all 4 experts: with random weights a router logit moved by one rounding can flip a top-k
    choice, a discrete change no token or cosine bound covers (the router's own bytes are tested in
    tests/test_moe_routing.py)."""
    return build_on_gpu(transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=4, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, pad_token_id=PAD,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}))


def deepseek_v3():
    """Every token to every expert, for the reason given at gpt_oss."""
    return build_on_gpu(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=8, n_group=4, topk_group=4, n_shared_experts=1, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=256, pad_token_id=PAD,
        routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32.0, "beta_slow": 1.0}))


def qwen3_moe():
    """Qwen3-MoE's head dim 128 with the per-head q / k norms, a sparse then a dense layer; every token to every
    expert, for the reason given at gpt_oss."""
    return build_on_gpu(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=8,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=256, pad_token_id=PAD,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))


def test_gpu_main_job_models_are_built_on_the_callers_device():
    """The main job's tiny models (check.tiny_models: build_model with no device) follow the default device of the
    caller's `with torch.device(...)`, as check_models builds them on a GPU; a builder that fell back to the CPU
    sent the GPU rows CUDA prompts for a CPU model."""
    from dispatch.integrations.hf.check import tiny_models

    for name, build in tiny_models().items():
        with torch.device("cuda"):
            model = build()
        assert all(p.is_cuda for p in model.parameters()), name
    assert all(p.device.type == "cpu" for p in tiny_models()["llama"]().parameters())


@pytest.mark.parametrize("build", [llama, gpt_oss, deepseek_v3, qwen3_moe],
                         ids=["llama", "gpt_oss", "deepseek_v3", "qwen3_moe"])
def test_gpu_patched_generation_matches_unpatched(build):
    reference = build()
    patched = copy.deepcopy(reference)
    report = lowbit_patch(patched)
    assert report.replaced
    assert_same_greedy_tokens(_generate(patched), _generate(reference), f"{build.__name__} patched")


@pytest.mark.parametrize("build", [llama, gpt_oss, qwen3_moe], ids=["llama", "gpt_oss", "qwen3_moe"])
def test_gpu_paged_cache_generation_matches_unpaged(build):
    reference = build()
    lowbit_patch(reference)
    cache = LowbitPagedCache(reference.config, len(PROMPT_LENS), max(PROMPT_LENS) + NEW_TOKENS, page_size=16,
                             kv_dtype=torch.bfloat16, device="cuda")
    assert_same_greedy_tokens(_generate(reference, cache), _generate(reference), f"{build.__name__} paged")


@pytest.mark.parametrize("build", [llama, gpt_oss], ids=["llama", "gpt_oss"])
def test_gpu_paged_fp8_cache_generation_close_to_unpatched(build):
    reference = build()
    want = _generate(reference, new_tokens=QUANT_TOKENS)
    lowbit_patch(reference)  # in place: the unpatched result is taken
    cache = LowbitPagedCache(reference.config, len(PROMPT_LENS), max(PROMPT_LENS) + QUANT_TOKENS, page_size=16,
                             kv_dtype=torch.float8_e4m3fn, device="cuda")
    got = _generate(reference, cache, new_tokens=QUANT_TOKENS)
    assert_same_greedy_tokens(got, want, f"{build.__name__} FP8 pages", QUANT_TOKENS, QUANT_COSINE_MIN,
                              FP8_TIE_SPACINGS)
    assert cache.layers[0].keys.dtype == torch.float8_e4m3fn
