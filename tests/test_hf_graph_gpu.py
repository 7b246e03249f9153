"""CUDA-graph decode (`GraphedDecode`) on a GPU, patched models on lowbit's GPU kernels, random weights:

* greedy decode: four left-padded prompts of different lengths prefilled through LowbitPagedCache, then 63 graph
  replays (64 new tokens; positions from the cache's lengths) give the tokens of the patched model's eager `generate`
  on the paged cache and of the unpatched model's `generate` (the tie rule of dispatch/integrations/hf/check.py: a
  divergence only at a step where the reference's top-2 logits are within a few bf16 spacings; logits cosine >= 0.9999
  before it): Llama at tiny dims, Llama-3-8B's per-layer dims (hidden 4096, 32 / 8 heads of 128, MLP 14336) with 2
  layers, GPT-OSS at its head dim 64 with sinks and a sliding window, Qwen3-MoE at its head dim 128 and at
  Qwen3-30B-A3B's attention and expert widths with 2 layers (the fp32 yardstick as at Llama-3-8B's);
* replay with new lengths: a cache filled by `fill_random`, lengths set, then set again to other lengths between
  replays of the same graph: each replay's logits equal the eager step's (`mode="eager"`) on a copy of the cache
  (same kernels, same inputs: bit-equal).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dispatch.integrations.hf import GraphedDecode, LowbitPagedCache, lowbit_patch  # noqa: E402
from dispatch.integrations.hf.check import compare_greedy, fp32_logit_errors, greedy, prompts  # noqa: E402
from tests.test_hf_graph import prefill  # noqa: E402
from tests.test_hf_models_gpu import VOCAB, build_on_gpu, gpt_oss, llama, qwen3_moe  # noqa: E402

pytestmark = pytest.mark.gpu

PROMPT_LENS = (29, 17, 8, 23)
STEPS = 63  # replays after the prefill's token: 64 new tokens
COSINE_MIN = 0.9999
# Llama-3-8B widths with random weights: nearly flat logits, where two correct bf16 stacks sit further apart than
# 0.9999 (0.9997 measured); there the bar is the fp32 model: the patched logits' error against it at most
# FP32_ERROR_FACTOR x the unpatched bf16 model's, with a cosine floor of WIDE_COSINE_MIN to the unpatched model.
WIDE_COSINE_MIN = 0.999
FP32_ERROR_FACTOR = 1.5


def llama_8b_layers():
    return build_on_gpu(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=256, pad_token_id=0,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))


def qwen3_30b_a3b_layers():
    """Qwen3-30B-A3B's attention and expert widths (hidden 2048, 32 / 4 heads of 128, experts of width 768, top-8)
    with 2 sparse layers. 8 experts, all routed: the 8 experts a token runs are the real model's shapes, and a top-8
    of 128 with random weights would flip on one rounding of a router logit, a discrete change no token, cosine or
    error bound covers (the routing's bytes are tests/test_moe_routing.py's)."""
    return build_on_gpu(transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=256, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))


def _graph_greedy(model, ids, mask):
    """Prefill, then STEPS graph replays: a generate-like result (sequences, per-step logits)."""
    cache, first = prefill(model, ids, mask, ids.shape[1] + STEPS + 1, page_size=16)
    decode = GraphedDecode(model, cache)
    tokens, logits = decode.greedy(first.argmax(-1), STEPS)
    sequences = torch.cat([ids, first.argmax(-1)[:, None], tokens], dim=1)
    return types.SimpleNamespace(sequences=sequences, logits=[first.clone(), *logits]), cache


@pytest.mark.parametrize("build,cosine_min", [(llama, COSINE_MIN), (llama_8b_layers, WIDE_COSINE_MIN),
                                               (gpt_oss, COSINE_MIN), (qwen3_moe, COSINE_MIN),
                                               (qwen3_30b_a3b_layers, WIDE_COSINE_MIN)],
                         ids=["llama", "llama_8b_layers", "gpt_oss", "qwen3_moe", "qwen3_30b_a3b_layers"])
def test_gpu_graph_decode_matches_eager_and_unpatched(build, cosine_min):
    reference = build()
    model = copy.deepcopy(reference)
    lowbit_patch(model)
    ids, mask = prompts(PROMPT_LENS, VOCAB, device="cuda")
    got, cache = _graph_greedy(model, ids, mask)
    paged = LowbitPagedCache(model.config, len(PROMPT_LENS), ids.shape[1] + STEPS + 1, page_size=16, device="cuda")
    unpatched = greedy(reference, ids, mask, STEPS + 1)
    for what, want, floor in (("patched eager", greedy(model, ids, mask, STEPS + 1, past_key_values=paged),
                               COSINE_MIN), ("unpatched", unpatched, cosine_min)):
        check = compare_greedy(got, want, STEPS + 1, floor)
        assert check.agree, f"{build.__name__} graph vs {what}: {check.note}"
    exact = copy.deepcopy(reference).float()
    ours, theirs = (float(fp32_logit_errors(exact, r, mask, STEPS + 1).max()) for r in (got, unpatched))
    assert ours <= FP32_ERROR_FACTOR * theirs, f"error vs fp32: graph {ours:.2e}, unpatched bf16 {theirs:.2e}"
    assert [layer.seen for layer in cache.layers] == [ids.shape[1] + STEPS] * len(cache.layers)
    assert cache.layers[-1].lengths.tolist() == [n + STEPS for n in PROMPT_LENS]


@pytest.mark.parametrize("build", [llama, gpt_oss, qwen3_moe], ids=["llama", "gpt_oss", "qwen3_moe"])
def test_gpu_graph_replay_with_new_lengths(build):
    model = build()
    lowbit_patch(model)
    cache = LowbitPagedCache(model.config, 4, 160, page_size=16, device="cuda")
    cache.fill_random(seed=4, std=0.5)
    cache.set_lengths([100, 3, 57, 16])
    twin = copy.deepcopy(cache)
    graph, eager = GraphedDecode(model, cache), GraphedDecode(model, twin, mode="eager")
    g = torch.Generator(device="cuda").manual_seed(0)
    for lengths in ([100, 3, 57, 16], [1, 140, 33, 64]):
        cache.set_lengths(lengths)
        twin.set_lengths(lengths)
        for _ in range(3):
            ids = torch.randint(1, VOCAB, (4,), device="cuda", generator=g)
            assert torch.equal(graph.step(ids), eager.step(ids))
        assert cache.layers[0].lengths.tolist() == [n + 3 for n in lengths]
        assert cache.layers[0].seen == max(lengths) + 3
