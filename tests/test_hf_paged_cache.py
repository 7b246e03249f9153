"""LowbitPagedCache (lowbit's paged KV layout as a transformers Cache) with patched Llama, GPT-OSS and Qwen3-MoE on
tiny configs: greedy generation of the left-padded batch of four prompts of different lengths over pages of 4 tokens
interleaved across the sequences equals the unpatched model with transformers' DynamicCache by the tie-aware rule
of dispatch/integrations/hf/check.py (bf16 pages: 64 tokens, logits cosine >= 0.9999; FP8 E4M3 pages: the first 16
tokens, cosine >= 0.99, ties within FP8_TIE_SPACINGS); forced Triton (the interpreter, bf16) marked slow. GPT-OSS
routes every token to all 4 experts: with top-2 of 4 a logit moved by a rounding can flip an expert choice, a
discrete change no cosine bound covers."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_hf_models import (
    NEW_TOKENS,
    PROMPT_LENS,
    QUANT_TOKENS,
    _prompts,
    assert_generation_matches,
    generation_prompts,
    gpt_oss,
    gpt_oss_all_experts,
    llama,
    qwen3_moe,
)

transformers = pytest.importorskip("transformers")

from dispatch.integrations.hf import LowbitPagedCache, PagedCacheError, lowbit_patch  # noqa: E402
from dispatch.integrations.hf.check import FP8_TIE_SPACINGS  # noqa: E402

PAGE = 4


class PagedModel(torch.nn.Module):
    """A patched model whose `generate` brings a fresh LowbitPagedCache (what a caller passes as
    past_key_values), so the shared generation check runs it unchanged."""

    def __init__(self, model, kv_dtype, max_cache_len: int = max(PROMPT_LENS) + NEW_TOKENS):
        super().__init__()
        self.model, self.kv_dtype, self.max_cache_len = model, kv_dtype, max_cache_len
        self.cache = None

    def generate(self, ids, **kwargs):
        self.cache = LowbitPagedCache(self.model.config, ids.shape[0], self.max_cache_len, page_size=PAGE,
                                      kv_dtype=self.kv_dtype)
        return self.model.generate(ids, past_key_values=self.cache, **kwargs)


def _paged(reference, kv_dtype) -> PagedModel:
    patched = copy.deepcopy(reference)
    lowbit_patch(patched)
    return PagedModel(patched, kv_dtype)


@pytest.mark.parametrize("build", [llama, gpt_oss_all_experts, qwen3_moe], ids=["llama", "gpt_oss", "qwen3_moe"])
def test_paged_bf16_generate_matches_unpatched(build):
    reference = build()
    paged = _paged(reference, torch.bfloat16)
    assert_generation_matches(paged, reference, NEW_TOKENS)
    _, mask = generation_prompts()
    # Each sequence holds its real tokens only: the prompt's (no padding) and every fed-back token.
    for layer in paged.cache.layers:
        assert layer.lengths.tolist() == (mask.sum(1) + NEW_TOKENS - 1).tolist()


@pytest.mark.parametrize("build", [llama, gpt_oss_all_experts, qwen3_moe], ids=["llama", "gpt_oss", "qwen3_moe"])
def test_paged_fp8_generate_close_to_unpatched(build):
    reference = build()
    paged = _paged(reference, torch.float8_e4m3fn)
    assert_generation_matches(paged, reference, QUANT_TOKENS, cosine_min=0.99, tie_spacings=FP8_TIE_SPACINGS)
    assert paged.cache.layers[0].keys.dtype == torch.float8_e4m3fn


@pytest.mark.slow  # the Triton interpreter: the paged decode and paged prefill kernels, two steps
@pytest.mark.parametrize("build", [llama, gpt_oss], ids=["llama", "gpt_oss"])
def test_paged_bf16_generate_matches_unpatched_triton(build):
    reference = build()
    assert_generation_matches(_paged(reference, torch.bfloat16), reference, 2, backend="triton")


def test_paged_cache_misuse_raises():
    model = llama()
    ids, mask = _prompts()
    with pytest.raises(PagedCacheError, match="read by lowbit's patched attention only"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=LowbitPagedCache(model.config, 2, 16))
    lowbit_patch(model)
    with pytest.raises(PagedCacheError, match="exceed max_cache_len 6"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=LowbitPagedCache(model.config, 2, 6))
    with pytest.raises(PagedCacheError, match="batch 2 != the cache's batch_size 3"), torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=LowbitPagedCache(model.config, 3, 16))
    with pytest.raises(PagedCacheError, match="argument 'kv_dtype'"):
        LowbitPagedCache(model.config, 2, 16, kv_dtype=torch.float32)
