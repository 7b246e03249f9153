"""LowbitMlaCache (DeepSeek-V3's MLA latent in pages) with the patched DeepSeek-V3 attention: greedy generation of the
batch of four left-padded prompts of different lengths (tests/test_hf_models.py) over pages of 4 tokens, against the
unpatched eager model with transformers' DynamicCache, compared by the main job's tie-aware rule
(dispatch/integrations/hf/check.py: the same tokens, or a first difference at a tie of the unpatched model; logits
cosine >= 0.9999 per step before it): bf16 pages, 64 tokens, under `auto` (the torch references on a CPU) and forced
Triton (the interpreter: the portable MLA decode and paged prefill kernels, 2 tokens), V3.2 FP8 pages (656 B rows,
kv_lora 512), 16 tokens at cosine >= 0.99 with ties within FP8_TIE_SPACINGS. Every token goes to every routed expert
(tests/test_hf_models.py: ROUTED_TOKENS says why). Every decode step runs `mla_decode` (counted) and each sequence
holds exactly its real tokens. With the
attention sharpened, the generated logits' error against the fp32 model is within 1.5x the unpatched bf16 model's
(what catches a wrong softmax scale: the random model's near-uniform softmax hides it from the token check). Misuse
is a named error. The `gpu` test runs the same at DeepSeek-V3's real attention dims (128 heads, kv_lora 512, RoPE 64,
NoPE 128, v 128, q_lora 1536, hidden 7168) with pages of 64 (the sm_90 MLA decode kernel's page)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_hf_models import (
    NEW_TOKENS,
    PROMPT_LENS,
    QUANT_TOKENS,
    deepseek_v3,
    deepseek_v3_all_experts,
    generation_prompts,
    llama,
)

transformers = pytest.importorskip("transformers")

import dispatch  # noqa: E402
from dispatch import ops  # noqa: E402
from dispatch.integrations.hf import LowbitMlaCache, LowbitPagedCache, PagedCacheError, lowbit_patch  # noqa: E402
from dispatch.integrations.hf.check import (  # noqa: E402
    FP8_TIE_SPACINGS,
    TIE_SPACINGS,
    compare_greedy,
    fp32_logit_errors,
    greedy,
    prompts,
)

PAGE = 4
# The fp32-yardstick check's generation (teacher-forced through the fp32 model afterwards).
FP32_CHECK_TOKENS = 8


def _count_calls(monkeypatch, name: str) -> list:
    """Replace ops.<name> by a wrapper that records each call (the cache and attention module look it up at call
    time), so a test can say which op ran."""
    calls, op = [], getattr(ops, name)

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return op(*args, **kwargs)

    monkeypatch.setattr(ops, name, counted)
    return calls


def _generate_latent(reference, new_tokens: int, layout: str = "bf16", backend: str | None = None):
    """(patched model's greedy result with a fresh LowbitMlaCache, the unpatched model's, the cache)."""
    ids, mask = generation_prompts()
    want = greedy(reference, ids, mask, new_tokens)
    patched = copy.deepcopy(reference)
    lowbit_patch(patched)
    cache = LowbitMlaCache(patched.config, len(PROMPT_LENS), max(PROMPT_LENS) + new_tokens, page_size=PAGE,
                           layout=layout)
    if backend is None:
        return greedy(patched, ids, mask, new_tokens, past_key_values=cache), want, cache
    with dispatch.use_backend(backend):
        return greedy(patched, ids, mask, new_tokens, past_key_values=cache), want, cache


def test_mla_cache_bf16_generate_matches_unpatched(monkeypatch):
    decodes = _count_calls(monkeypatch, "mla_decode")
    prefills = _count_calls(monkeypatch, "attention_prefill_paged")
    got, want, cache = _generate_latent(deepseek_v3_all_experts(), NEW_TOKENS)
    check = compare_greedy(got, want, NEW_TOKENS)
    assert check.agree, check.note
    layers = len(cache.layers)
    assert len(prefills) == layers and len(decodes) == layers * (NEW_TOKENS - 1)
    assert all(shape == (len(PROMPT_LENS), 1, 2, 32 + 64) for shape in decodes)  # (B, 1, H, kv_lora + rope)
    for layer in cache.layers:  # each sequence holds its real tokens only: the prompt's and every fed-back one
        assert layer.lengths.tolist() == [n + NEW_TOKENS - 1 for n in PROMPT_LENS]
        assert layer.seen == max(PROMPT_LENS) + NEW_TOKENS - 1


def test_mla_cache_error_against_fp32_within_unpatched_bf16s():
    """Attention sharpened (q_b_proj and kv_b_proj x4: the random model's softmax is near uniform otherwise, and a
    wrong softmax scale, e.g. the YaRN mscale left out (x0.77 here), would not show); every generated step's logits
    against the fp32 model's on the same tokens: relative error at most 1.5x the unpatched bf16 model's."""
    reference = deepseek_v3_all_experts()
    with torch.no_grad():
        for layer in reference.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(4)
            layer.self_attn.kv_b_proj.weight.mul_(4)
    got, _, _ = _generate_latent(reference, FP32_CHECK_TOKENS)
    _, mask = generation_prompts()
    full = torch.cat([mask, torch.ones(len(PROMPT_LENS), FP32_CHECK_TOKENS, dtype=mask.dtype)], dim=1)
    positions = (full.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        exact = copy.deepcopy(reference).float()(got.sequences, attention_mask=full, position_ids=positions).logits
        eager = reference(got.sequences, attention_mask=full, position_ids=positions).logits.float()
    width = mask.shape[1]

    def worst(logits):
        return max(float(((logits(t) - exact[:, width - 1 + t]).norm(dim=-1) / exact[:, width - 1 + t].norm(dim=-1))
                         .max()) for t in range(FP32_CHECK_TOKENS))

    latent_err, eager_err = worst(lambda t: got.logits[t].float()), worst(lambda t: eager[:, width - 1 + t])
    assert latent_err <= 1.5 * eager_err, f"latent cache {latent_err:.4f} vs unpatched bf16 {eager_err:.4f}"


@pytest.mark.slow  # the Triton interpreter: the portable MLA decode and paged prefill kernels, two steps
def test_mla_cache_bf16_generate_matches_unpatched_triton():
    got, want, _ = _generate_latent(deepseek_v3_all_experts(), 2, backend="triton")
    check = compare_greedy(got, want, 2)
    assert check.agree, check.note


def test_mla_cache_v32_fp8_generate_close_to_unpatched():
    got, want, cache = _generate_latent(deepseek_v3_all_experts(kv_lora_rank=512), QUANT_TOKENS, layout="v32")
    check = compare_greedy(got, want, QUANT_TOKENS, cosine_min=0.99, tie_spacings=FP8_TIE_SPACINGS)
    assert check.agree, check.note
    assert cache.layers[0].latent.dtype == torch.uint8 and cache.layers[0].latent.shape[-1] == 656


def test_mla_cache_misuse_raises():
    model = deepseek_v3()
    lowbit_patch(model)
    ids, mask = generation_prompts()
    width, batch = ids.shape[1], ids.shape[0]
    with pytest.raises(PagedCacheError, match=f"0 \\+ {width} positions exceed max_cache_len {width - 1}"), \
            torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=LowbitMlaCache(model.config, batch, width - 1))
    with pytest.raises(PagedCacheError, match=f"batch {batch} != the cache's batch_size 2"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=LowbitMlaCache(model.config, 2, 32))
    with pytest.raises(PagedCacheError, match="DeepSeek-V3's attention stores MLA's latent"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=LowbitPagedCache(model.config, batch, 32))
    with pytest.raises(PagedCacheError, match="argument 'layout': 'v32' holds a latent of 512"):
        LowbitMlaCache(model.config, batch, 32, layout="v32")
    with pytest.raises(PagedCacheError, match="argument 'layout'"):
        LowbitMlaCache(model.config, batch, 32, layout="fp8")
    with pytest.raises(PagedCacheError, match="argument 'page_size'"):
        LowbitMlaCache(model.config, batch, 32, page_size=0)
    with pytest.raises(PagedCacheError, match="argument 'rows': torch.float16"), torch.no_grad():
        fp16 = copy.deepcopy(model).half()
        fp16(ids, attention_mask=mask, past_key_values=LowbitMlaCache(model.config, batch, 32))
    dense = llama()
    with pytest.raises(PagedCacheError, match="argument 'config': llama has no MLA latent"):
        LowbitMlaCache(dense.config, batch, 32)
    cache = LowbitMlaCache(model.config, batch, 32)
    with pytest.raises(PagedCacheError, match="read by the patched DeepSeek-V3 attention only"):
        cache.attend(0, None, None, None, None)
    with pytest.raises(PagedCacheError, match="read by lowbit's patched attention only"):
        cache.update(None, None, 0)


# ---------------------------------------------------------------------------------------------------- GPU

GPU_VOCAB = 512
GPU_PROMPT_LENS = (29, 17, 8, 23)
GPU_NEW_TOKENS = 64
GPU_FP8_TOKENS = 32  # the V3.2 FP8 rows: the first 32 tokens (the FP8 bar asks for 16)


# DeepSeek-V3's attention widths (128 heads, q_lora 1536, kv_lora 512, RoPE 64, NoPE 128, v 128, hidden 7168), shared
# with the V3.2 GPU test.
DEEPSEEK_ATTENTION = dict(
    vocab_size=GPU_VOCAB, hidden_size=7168, intermediate_size=2048, num_attention_heads=128, num_key_value_heads=128,
    n_routed_experts=8, num_experts_per_tok=8, n_group=4, topk_group=4, n_shared_experts=1, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=256,
    pad_token_id=0, routed_scaling_factor=2.5,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})


def deepseek_v3_real_attention(moe_intermediate_size: int = 256):
    """DeepSeek-V3's attention dims with 2 narrow-MoE layers (8 experts of `moe_intermediate_size`, 256 by default,
    2048 is DeepSeek-V3's; every token to every expert: with random weights a router logit moved by one rounding can
    flip a top-k choice)."""
    from tests.test_hf_models_gpu import build_on_gpu

    return build_on_gpu(transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
        **DEEPSEEK_ATTENTION, moe_intermediate_size=moe_intermediate_size, num_hidden_layers=2,
        first_k_dense_replace=1))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,new_tokens,cosine_min,tie_spacings,error_factor",
                         [("bf16", GPU_NEW_TOKENS, 0.999, TIE_SPACINGS, 1.5),
                          ("v32", GPU_FP8_TOKENS, 0.99, FP8_TIE_SPACINGS, None)])
def test_gpu_mla_cache_generation_matches_unpatched(layout, new_tokens, cosine_min, tie_spacings, error_factor):
    """At DeepSeek-V3's attention widths with random weights the logits are nearly flat: bf16 (64 tokens) is held to
    the fp32 model (the patched logits' error against it at most 1.5x the unpatched bf16 model's) with a cosine floor
    of 0.999 to the unpatched model; the FP8 (V3.2) cache to cosine 0.99 and ties within FP8_TIE_SPACINGS (its
    values carry 4 fewer significant bits)."""
    reference = deepseek_v3_real_attention()
    exact = copy.deepcopy(reference).float() if error_factor else None
    ids, mask = prompts(GPU_PROMPT_LENS, GPU_VOCAB, device="cuda")
    want = greedy(reference, ids, mask, new_tokens)
    lowbit_patch(reference)  # in place: the unpatched result is taken (no second copy of the weights)
    cache = LowbitMlaCache(reference.config, len(GPU_PROMPT_LENS), ids.shape[1] + new_tokens, page_size=64,
                           layout=layout, device="cuda")
    got = greedy(reference, ids, mask, new_tokens, past_key_values=cache)
    check = compare_greedy(got, want, new_tokens, cosine_min, tie_spacings)
    assert check.agree, f"{layout}: {check.note}"
    if error_factor:
        ours, theirs = (float(fp32_logit_errors(exact, r, mask, new_tokens).max()) for r in (got, want))
        assert ours <= error_factor * theirs, f"error vs fp32: latent cache {ours:.2e}, unpatched bf16 {theirs:.2e}"
    assert cache.layers[0].lengths.tolist() == [n + new_tokens - 1 for n in GPU_PROMPT_LENS]
