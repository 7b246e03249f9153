"""lowbit_patch on a tiny DeepSeek-V3.2 (sparse MLA: transformers' DSA indexer picks index_topk = 4 keys per query,
fewer than every sequence's keys, so the sparsity decides each step): greedy generation of the four left-padded
prompts (tests/test_hf_models.py) against the unpatched eager model, by the tie-aware rule of
dispatch/integrations/hf/check.py, with transformers' cache (64 tokens) and with `LowbitMlaCache` (bf16 pages, 64
tokens; the V3.2 FP8 656-byte rows, 16 tokens at cosine 0.99 with ties within FP8_TIE_SPACINGS), every decode step
through `mla_decode` with the indexer's keys as `indices` (counted, and their positions checked against the keys
each cache holds). The prompt runs transformers' masked dense attention (the prefill ops take no per-query key set);
with index_topk at least the prompt's width it runs the dense causal prefill.

The generation model has one (MoE) layer: the indexer's top-k is a discrete choice, and from the second layer on its
inputs carry the first layer's rounding, so with random weights a score moved by one rounding can swap a key in
or out, a change no token or cosine bound covers (as a router's top-k, tests/test_hf_models.py ROUTED_TOKENS); the
two-layer model generates TWO_LAYER_TOKENS. The models have the real model's 64 indexer heads: the index score of a
key is a weighted sum of per-head ReLU'd products, exactly 0 when every head's product is negative (1 key in 2^heads)
and such exact ties are broken by torch.topk in an order that depends on the width scored (transformers' cache
scores its padded timeline, `LowbitMlaCache` its max_cache_len columns), so a model with few heads would pick
different keys among equals. `GraphedDecode`'s eager step over `LowbitMlaCache` continues the prompt as `generate`
does, its indexer scoring the same width every step (what lets a CUDA graph replay it). Unsupported models raise
before anything is modified. The `gpu` tests run DeepSeek-V3.2's attention and indexer dims (one MoE layer) with
pages of 64 and index_topk 16, with transformers' cache and with `LowbitMlaCache` (bf16, V3.2 FP8), and the V3.2 FP8
cache's decode steps replayed in one CUDA graph against the eager steps."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_hf_models import (
    MAX_POSITIONS,
    NEW_TOKENS,
    PAD,
    PROMPT_LENS,
    QUANT_TOKENS,
    VOCAB,
    _build,
    assert_refused_unmodified,
    generation_prompts,
)

transformers = pytest.importorskip("transformers")

import dispatch  # noqa: E402
from dispatch import ops  # noqa: E402
from dispatch.integrations.hf import (  # noqa: E402
    GraphedDecode,
    LowbitMlaCache,
    LowbitPagedCache,
    PagedCacheError,
    lowbit_patch,
)
from dispatch.integrations.hf.check import FP8_TIE_SPACINGS, TIE_SPACINGS, compare_greedy, greedy, prompts  # noqa: E402

PAGE = 4
INDEX_TOPK = 4
INDEX_HEADS = 64  # DeepSeek-V3.2's: see the module docstring
# The two-layer model's generation (see the module docstring).
TWO_LAYER_TOKENS = 8


def deepseek_v32(dtype=torch.bfloat16, layers: int = 1, **overrides):
    """Every token to all 8 routed experts (tests/test_hf_models.py says why); layer 0 MoE when one layer, dense
    then MoE when two."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=layers, first_k_dense_replace=layers - 1, num_attention_heads=2,
              num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=8, n_group=4, topk_group=4,
              n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=128, qk_rope_head_dim=64,
              v_head_dim=128, index_topk=INDEX_TOPK, index_n_heads=INDEX_HEADS, index_head_dim=128,
              max_position_embeddings=MAX_POSITIONS, pad_token_id=PAD, routed_scaling_factor=2.5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                               "original_max_position_embeddings": MAX_POSITIONS // 4, "mscale": 1.0,
                               "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0})
    kw.update(overrides)
    return _build(transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config(**kw), dtype)


ONE_LAYER_SWAPS = {"DeepseekV32RMSNorm": 5, "DeepseekV32Attention": 1, "DeepseekV32MLP": 1, "DeepseekV32MoE": 1}
TWO_LAYER_SWAPS = {"DeepseekV32RMSNorm": 9, "DeepseekV32Attention": 2, "DeepseekV32MLP": 2, "DeepseekV32MoE": 1}


def _record_mla_decode(monkeypatch) -> list:
    """Replace ops.mla_decode by a wrapper recording each call's indices and lengths (copies)."""
    calls, op = [], ops.mla_decode

    def recorded(q, kv_cache, block_table, seqused_k, **kwargs):
        indices = kwargs.get("indices")
        calls.append((None if indices is None else indices.clone(), seqused_k.clone()))
        return op(q, kv_cache, block_table, seqused_k, **kwargs)

    monkeypatch.setattr(ops, "mla_decode", recorded)
    return calls


def _generate(reference, new_tokens: int, layout: str | None):
    """(patched greedy result, unpatched result, the LowbitMlaCache or None for transformers' cache, the report)."""
    ids, mask = generation_prompts()
    want = greedy(reference, ids, mask, new_tokens)
    patched = copy.deepcopy(reference)
    report = lowbit_patch(patched)
    cache = None if layout is None else LowbitMlaCache(patched.config, len(PROMPT_LENS), max(PROMPT_LENS) + new_tokens,
                                                       page_size=PAGE, layout=layout)
    extra = {} if cache is None else {"past_key_values": cache}
    return greedy(patched, ids, mask, new_tokens, **extra), want, cache, report


def test_deepseek_v32_generate_matches_unpatched(monkeypatch):
    """transformers' cache: every decode step is `mla_decode` over the cached latent, one page per sequence of the
    padded timeline, with the indexer's picks there: the shortest prompt (2 tokens after 9 of padding) takes its
    3 keys, 9 .. 11, and one -1 at the first step."""
    calls = _record_mla_decode(monkeypatch)
    got, want, _, report = _generate(deepseek_v32(), NEW_TOKENS, None)
    assert report.replaced == ONE_LAYER_SWAPS and report.model_type == "deepseek_v32"
    assert report.replacements["DeepseekV32Attention"] == "LowbitSparseMlaAttention"
    check = compare_greedy(got, want, NEW_TOKENS)
    assert check.agree, check.note
    assert len(calls) == NEW_TOKENS - 1 and all(i is not None and i.shape == (4, 1, INDEX_TOPK) for i, _ in calls)
    first, lengths = calls[0]
    width = max(PROMPT_LENS) + 1
    assert lengths.tolist() == [width] * len(PROMPT_LENS)
    assert sorted(first[3, 0].tolist()) == [-1, width - 3, width - 2, width - 1]


@pytest.mark.parametrize("layout", [None, "bf16"], ids=["transformers_cache", "mla_cache"])
def test_deepseek_v32_prompt_within_topk_runs_dense_prefill(monkeypatch, layout):
    """index_topk at least the padded prompt width: the indexer picks every key, so the prompt runs the dense causal
    prefill (the "lowbit" attention function), never the masked dense form, and generation matches the unpatched
    model (whose decode steps then attend over more keys than index_topk: the sparse decode path)."""
    from dispatch.integrations.hf import sparse_mla

    def no_masked(*args, **kwargs):
        raise AssertionError("the prompt took the masked dense form")

    monkeypatch.setattr(sparse_mla.LowbitSparseMlaAttention, "_masked_dense", no_masked)
    prefill_calls = []
    forward = sparse_mla.lowbit_attention_forward

    def counted(module, query, *args, **kwargs):
        prefill_calls.append(query.shape)
        return forward(module, query, *args, **kwargs)

    monkeypatch.setattr(sparse_mla, "lowbit_attention_forward", counted)
    decode = _record_mla_decode(monkeypatch)
    got, want, _, _ = _generate(deepseek_v32(index_topk=max(PROMPT_LENS)), NEW_TOKENS, layout)
    check = compare_greedy(got, want, NEW_TOKENS)
    assert check.agree, check.note
    assert prefill_calls == [(len(PROMPT_LENS), 2, max(PROMPT_LENS), 192)]
    assert len(decode) == NEW_TOKENS - 1 and all(i.shape == (4, 1, max(PROMPT_LENS)) for i, _ in decode)


@pytest.mark.parametrize("layout", [None, "bf16"], ids=["transformers_cache", "mla_cache"])
def test_deepseek_v32_two_layers_generate_matches_unpatched(layout):
    got, want, _, report = _generate(deepseek_v32(layers=2), TWO_LAYER_TOKENS, layout)
    assert report.replaced == TWO_LAYER_SWAPS
    check = compare_greedy(got, want, TWO_LAYER_TOKENS)
    assert check.agree, check.note


def test_deepseek_v32_mla_cache_generate_matches_unpatched(monkeypatch):
    """bf16 pages: every decode step is `mla_decode` with indices (B, 1, index_topk) of stored keys: each entry -1
    (a padding key the indexer's top-k had to take: fewer real keys than index_topk) or below the sequence's length,
    the shortest prompt (2 tokens) taking 3 real keys and one -1 at the first step."""
    calls = _record_mla_decode(monkeypatch)
    got, want, cache, _ = _generate(deepseek_v32(), NEW_TOKENS, "bf16")
    check = compare_greedy(got, want, NEW_TOKENS)
    assert check.agree, check.note
    assert len(calls) == NEW_TOKENS - 1
    for indices, lengths in calls:
        assert indices is not None and indices.shape == (len(PROMPT_LENS), 1, INDEX_TOPK)
        assert bool(((indices == -1) | ((indices >= 0) & (indices < lengths[:, None, None]))).all())
    first, lengths = calls[0]
    assert lengths.tolist() == [n + 1 for n in PROMPT_LENS]
    assert sorted(first[3, 0].tolist()) == [-1, 0, 1, 2]
    assert (first[:3] >= 0).all()
    assert cache.layers[0].lengths.tolist() == [n + NEW_TOKENS - 1 for n in PROMPT_LENS]


@pytest.mark.slow  # the Triton interpreter: the portable sparse MLA decode, norm and MoE kernels, two steps
@pytest.mark.parametrize("layout", [None, "bf16"], ids=["transformers_cache", "mla_cache"])
def test_deepseek_v32_generate_matches_unpatched_triton(monkeypatch, layout):
    calls = _record_mla_decode(monkeypatch)
    with dispatch.use_backend("triton"):
        got, want, _, _ = _generate(deepseek_v32(), 2, layout)
    check = compare_greedy(got, want, 2)
    assert check.agree, check.note
    assert len(calls) == 1 and calls[0][0] is not None


def test_deepseek_v32_mla_cache_v32_fp8_generate_close_to_unpatched(monkeypatch):
    calls = _record_mla_decode(monkeypatch)
    got, want, cache, _ = _generate(deepseek_v32(kv_lora_rank=512), QUANT_TOKENS, "v32")
    check = compare_greedy(got, want, QUANT_TOKENS, cosine_min=0.99, tie_spacings=FP8_TIE_SPACINGS)
    assert check.agree, check.note
    assert cache.layers[0].latent.shape[-1] == 656
    assert len(calls) == QUANT_TOKENS - 1 and all(indices is not None for indices, _ in calls)
    # the random model's attention at kv_lora 512 is near uniform, so the keys' positions are checked directly
    assert sorted(calls[0][0][3, 0].tolist()) == [-1, 0, 1, 2]
    assert all(bool(((i == -1) | ((i >= 0) & (i < n[:, None, None]))).all()) for i, n in calls)


def _prefilled(model, ids, mask, max_len: int, layout: str, page_size: int = PAGE):
    """The prompt through a fresh LowbitMlaCache (positions as `generate` numbers a left-padded batch); returns the
    cache and the last position's logits."""
    cache = LowbitMlaCache(model.config, ids.shape[0], max_len, page_size=page_size, layout=layout, device=ids.device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1]


def test_deepseek_v32_graphed_decode_eager_step_like_generate():
    model = deepseek_v32()
    lowbit_patch(model)
    ids, mask = generation_prompts()
    width, steps = ids.shape[1], 4
    cache, first = _prefilled(model, ids, mask, width + steps, "bf16")
    widths = []
    hook = model.model.layers[0].self_attn.indexer.register_forward_hook(
        lambda module, args, out: widths.append(args[3].shape[-1]))  # the visible keys (B, S, keys scored)
    tokens, _ = GraphedDecode(model, cache, mode="eager").greedy(first.argmax(-1), steps - 1)
    hook.remove()
    want = greedy(model, ids, mask, steps, past_key_values=LowbitMlaCache(model.config, len(PROMPT_LENS),
                                                                          width + steps, page_size=PAGE))
    assert torch.equal(tokens, want.sequences[:, width + 1:])
    assert widths == [width + steps] * (steps - 1)
    assert cache.layers[0].lengths.tolist() == [n + steps - 1 for n in PROMPT_LENS]


def test_deepseek_v32_mla_cache_misuse_raises():
    model = deepseek_v32()
    lowbit_patch(model)
    ids, mask = generation_prompts()
    cache = LowbitMlaCache(model.config, len(PROMPT_LENS), 64)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        with pytest.raises(PagedCacheError, match="DeepSeek-V3.2 takes its prompt in one forward"):
            model(ids[:, :2], attention_mask=torch.cat([mask, mask[:, :2]], dim=1), past_key_values=cache)
        with pytest.raises(PagedCacheError, match="DeepSeek-V3.2's attention stores MLA's latent"):
            model(ids, attention_mask=mask, past_key_values=LowbitPagedCache(model.config, len(PROMPT_LENS), 32))


def test_deepseek_v32_unsupported_refused_unmodified():
    assert_refused_unmodified(deepseek_v32(torch.float32), "layer 0 experts: dtype torch.float32",
                              "dtype torch.float32 (DeepSeek-V3.2's sparse decode runs ops.mla_decode")
    assert_refused_unmodified(deepseek_v32(hidden_act="gelu"), "hidden_act 'gelu'", "experts='mxfp4'",
                              "expert_weights given", experts="mxfp4", expert_weights={})


# ---------------------------------------------------------------------------------------------------- GPU

GPU_VOCAB = 512
GPU_PROMPT_LENS = (29, 17, 8, 23)
GPU_NEW_TOKENS = 64
GPU_FP8_TOKENS = 32
GPU_INDEX_TOPK = 16  # fewer keys than every sequence's after its first steps: the sparsity decides


def deepseek_v32_real_attention():
    """DeepSeek-V3.2's attention and indexer dims (128 heads, q_lora 1536, kv_lora 512, RoPE 64, NoPE 128, v 128,
    hidden 7168; indexer 64 heads of 128) with one MoE layer of 8 experts of 256, every token to every expert (the
    module docstring says why one layer)."""
    from tests.test_hf_mla_cache import DEEPSEEK_ATTENTION
    from tests.test_hf_models_gpu import build_on_gpu

    return build_on_gpu(transformers.DeepseekV32ForCausalLM, transformers.DeepseekV32Config(
        **DEEPSEEK_ATTENTION, moe_intermediate_size=256, num_hidden_layers=1, first_k_dense_replace=0,
        index_topk=GPU_INDEX_TOPK, index_n_heads=64, index_head_dim=128))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,new_tokens,cosine_min,tie_spacings",
                         [(None, GPU_NEW_TOKENS, 0.999, TIE_SPACINGS), ("bf16", GPU_NEW_TOKENS, 0.999, TIE_SPACINGS),
                          ("v32", GPU_FP8_TOKENS, 0.99, FP8_TIE_SPACINGS)],
                         ids=["transformers_cache", "mla_cache_bf16", "mla_cache_v32"])
def test_gpu_deepseek_v32_generation_matches_unpatched(monkeypatch, layout, new_tokens, cosine_min, tie_spacings):
    """The patched model (sparse `mla_decode` on the GPU's portable MLA kernel) against the unpatched one at real
    widths: the cosine floor 0.999 (bf16; random weights at these widths keep two correct stacks below 0.9999) or
    0.99 (FP8 rows), every decode step with indices."""
    calls = _record_mla_decode(monkeypatch)
    model = deepseek_v32_real_attention()
    ids, mask = prompts(GPU_PROMPT_LENS, GPU_VOCAB, device="cuda")
    want = greedy(model, ids, mask, new_tokens)
    lowbit_patch(model)  # in place: the unpatched result is taken (no second copy of the weights)
    extra = {} if layout is None else {"past_key_values": LowbitMlaCache(
        model.config, len(GPU_PROMPT_LENS), ids.shape[1] + new_tokens, page_size=64, layout=layout, device="cuda")}
    got = greedy(model, ids, mask, new_tokens, **extra)
    check = compare_greedy(got, want, new_tokens, cosine_min, tie_spacings)
    assert check.agree, f"{layout}: {check.note}"
    assert len(calls) == new_tokens - 1 and all(indices is not None for indices, _ in calls)


@pytest.mark.gpu
def test_gpu_deepseek_v32_graphed_decode_matches_eager():
    """The V3.2 FP8 cache's decode step (indexer, sparse `mla_decode`) replayed in one CUDA graph: the tokens and
    logits of the eager steps from the same prompt (the same kernels: bit-equal logits)."""
    model = deepseek_v32_real_attention()
    lowbit_patch(model)
    ids, mask = prompts(GPU_PROMPT_LENS, GPU_VOCAB, device="cuda")
    runs = []
    for mode in ("eager", "cuda_graph"):
        cache, first = _prefilled(model, ids, mask, ids.shape[1] + GPU_FP8_TOKENS, "v32", page_size=64)
        runs.append(GraphedDecode(model, cache, mode=mode).greedy(first.argmax(-1), GPU_FP8_TOKENS - 1))
    (eager_tokens, eager_logits), (graph_tokens, graph_logits) = runs
    assert torch.equal(graph_tokens, eager_tokens)
    assert all(torch.equal(a, b) for a, b in zip(graph_logits, eager_logits, strict=True))


@pytest.mark.parametrize("s,past", [(11, 0), (1, 10)], ids=["prompt", "decode"])
def test_indexer_topk_picks_what_transformers_indexer_picks(s, past):
    """`LowbitIndexer` (the scores through `ops.mla_index_scores`) against transformers' `DeepseekV32Indexer` on the
    same inputs and cache: the same keys, in the same order, with a causal and left-padding mask (fewer visible keys
    than index_topk in some rows)."""
    from dispatch.integrations.hf.sparse_mla import LowbitIndexer, visible_keys

    torch.manual_seed(5)
    model = deepseek_v32(dtype=torch.float32, index_topk=6)
    attn = model.model.layers[0].self_attn
    b, t = 3, past + s
    hidden = torch.randn(b, t, 64)
    q_resid = torch.randn(b, t, 32)
    positions = torch.arange(t)[None].expand(b, t)
    cos, sin = model.model.rotary_emb(hidden, positions)
    padding = torch.ones(b, t, dtype=torch.long)
    padding[1, :3] = 0
    padding[2, : t - 2] = 0
    caches = [transformers.DynamicCache(config=model.config) for _ in range(2)]
    picks = []
    for cache, indexer in zip(caches, (attn.indexer, LowbitIndexer(attn.indexer)), strict=True):
        if past:  # the earlier keys in the cache first
            pre = visible_keys(padding[:, :past], b, past, past, "cpu")
            indexer(hidden[:, :past], q_resid[:, :past], (cos[:, :past], sin[:, :past]), pre, None,
                    past_key_values=cache)
        vis = visible_keys(padding, b, s, t, "cpu")
        picks.append(indexer(hidden[:, past:], q_resid[:, past:], (cos[:, past:], sin[:, past:]), vis, None,
                             past_key_values=cache))
    assert picks[0].dtype == picks[1].dtype == torch.int32
    assert torch.equal(picks[0], picks[1])
