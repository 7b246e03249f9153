"""The decode step of a patched model outside `generate` (CPU, tiny configs, the torch references):

* `GraphedDecode(mode="eager")` (the step a CUDA graph captures, its static inputs and host bookkeeping, without
  the graph) continues a left-padded prefill through LowbitPagedCache with the tokens of the patched model's own
  `generate` and of the unpatched model's, logits cosine >= 0.9999 against the unpatched model; the cache's host
  counter and device lengths advance one per step; refusals (`mode="cuda_graph"` off CUDA, other caches, shapes);
* the cache without a prefill: `write_prefix` + `set_lengths` give the logits of the unpatched model over the
  same keys in a left-padded DynamicCache; `fill_random`'s values; `advance` / `snapshot` / `restore`;
* `torch.compile(fullgraph=True, backend="eager")` of the patched model: a paged decode step (Llama, GPT-OSS,
  Qwen3-MoE), and for Llama also a prefill and a DynamicCache decode through the same compiled model (dynamic
  shapes), equal to the uncompiled patched model; with inductor (the default backend) a Llama paged decode step
  within the bf16 tolerance, same greedy tokens.
CUDA-graph replay itself is tests/test_hf_graph_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_hf_models import VOCAB, _prompts, gpt_oss, llama, qwen3_moe

transformers = pytest.importorskip("transformers")

from dispatch.integrations.hf import (  # noqa: E402
    GraphDecodeError,
    GraphedDecode,
    LowbitPagedCache,
    PagedCacheError,
    lowbit_patch,
)

STEPS = 4
PAGE = 4
COSINE_MIN = 0.9999


def _patched(reference):
    model = copy.deepcopy(reference)
    lowbit_patch(model)
    return model


def prefill(model, ids, mask, max_len: int, page_size: int = PAGE) -> tuple[LowbitPagedCache, torch.Tensor]:
    """The prompt through a fresh paged cache, positions numbered as `generate` numbers a left-padded batch (each
    sequence's real tokens from 0); returns the cache and the last position's logits."""
    cache = LowbitPagedCache(model.config, ids.shape[0], max_len, page_size=page_size, device=ids.device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1]


def _generate(model, ids, mask, new_tokens, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                              **kwargs)


@pytest.mark.parametrize("build", [llama, gpt_oss, qwen3_moe], ids=["llama", "gpt_oss", "qwen3_moe"])
def test_eager_step_continues_prefill_like_generate(build):
    reference = build()
    model = _patched(reference)
    ids, mask = _prompts()
    width = ids.shape[1]
    cache, first_logits = prefill(model, ids, mask, width + STEPS)
    decode = GraphedDecode(model, cache, mode="eager")
    tokens, logits = decode.greedy(first_logits.argmax(-1), STEPS)
    paged = LowbitPagedCache(model.config, 2, width + STEPS + 1, page_size=PAGE)
    want_patched = _generate(model, ids, mask, STEPS + 1, past_key_values=paged)
    want = _generate(reference, ids, mask, STEPS + 1)
    assert torch.equal(tokens, want_patched.sequences[:, width + 1:])
    assert torch.equal(tokens, want.sequences[:, width + 1:])
    for step, got in enumerate(logits):
        cos = torch.nn.functional.cosine_similarity(got.float(), want.logits[step + 1].float(), dim=-1)
        assert bool((cos >= COSINE_MIN).all()), f"step {step}: cosine {cos.tolist()}"
    assert [layer.seen for layer in cache.layers] == [width + STEPS] * len(cache.layers)
    for layer in cache.layers:
        assert layer.lengths.tolist() == (mask.sum(1) + STEPS).tolist()
    with pytest.raises(PagedCacheError, match="exceed max_cache_len"):
        decode.step(tokens[:, -1])


def test_graphed_decode_refusals():
    model = _patched(llama())
    cache = LowbitPagedCache(model.config, 2, 16, page_size=PAGE)
    with pytest.raises(GraphDecodeError, match="'cuda_graph' needs the cache on a CUDA device"):
        GraphedDecode(model, cache)
    with pytest.raises(GraphDecodeError, match="argument 'mode'"):
        GraphedDecode(model, cache, mode="compile")
    with pytest.raises(GraphDecodeError, match="argument 'cache': DynamicCache lacks"):
        GraphedDecode(model, transformers.DynamicCache(config=model.config), mode="eager")
    decode = GraphedDecode(model, cache, mode="eager")
    with pytest.raises(GraphDecodeError, match="argument 'input_ids'"):
        decode.step(torch.zeros(3, dtype=torch.long))
    with pytest.raises(GraphDecodeError, match="argument 'position_ids'"):
        decode.step(torch.zeros(2, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long))


def test_write_prefix_matches_left_padded_dynamic_cache():
    """Random RoPE'd keys written as sequences of 5 and 3 positions, then one decode step at positions 5 and 3: the
    patched model on the paged cache (no mask) gives the unpatched model's logits over the same keys left-padded in
    a DynamicCache with its padding mask."""
    reference = llama()
    model = _patched(reference)
    lengths, width = [5, 3], 5
    cache = LowbitPagedCache(model.config, 2, 12, page_size=PAGE)
    dense = transformers.DynamicCache(config=reference.config)
    g = torch.Generator().manual_seed(3)
    for i, layer in enumerate(cache.layers):
        k, v = (torch.randn(2, width, *layer.keys.shape[2:], generator=g).bfloat16() for _ in range(2))
        cache.write_prefix(i, k, v, lengths)
        left_k, left_v = torch.zeros_like(k), torch.zeros_like(v)  # sequence b's keys at the right end
        for b, n in enumerate(lengths):
            left_k[b, width - n:], left_v[b, width - n:] = k[b, :n], v[b, :n]
        dense.update(left_k.transpose(1, 2), left_v.transpose(1, 2), i)
    cache.set_lengths(lengths)
    assert [layer.seen for layer in cache.layers] == [5, 5]
    ids = torch.tensor([[7], [9]])
    positions = torch.tensor(lengths)[:, None]
    mask = torch.tensor([[1] * 6, [0, 0] + [1] * 4])
    with torch.no_grad():
        want = reference(ids, attention_mask=mask, position_ids=positions, past_key_values=dense).logits[:, -1]
    got = GraphedDecode(model, cache, mode="eager").step(ids)  # positions: the stored lengths
    cos = torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=-1)
    assert bool((cos >= COSINE_MIN).all()), cos.tolist()
    assert cache.layers[0].lengths.tolist() == [6, 4]
    with pytest.raises(PagedCacheError, match="set_lengths: argument 'lengths'"):
        cache.set_lengths([13, 1])
    with pytest.raises(PagedCacheError, match="write_prefix: arguments"):
        cache.write_prefix(0, k[:1], v[:1], lengths)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_fill_random_values(kv_dtype):
    cache = LowbitPagedCache(llama().config, 4, 64, page_size=PAGE, kv_dtype=kv_dtype, kv_scale=0.25)
    cache.fill_random(seed=1, std=0.5)
    for layer in cache.layers:
        for pages in (layer.keys, layer.values):
            values = pages.float() * (0.25 if kv_dtype == torch.float8_e4m3fn else 1.0)
            assert abs(values.std().item() - 0.5) < 0.05 and abs(values.mean().item()) < 0.05
    assert not torch.equal(cache.layers[0].keys, cache.layers[1].keys)
    assert cache.layers[0].lengths.tolist() == [0, 0, 0, 0]


def test_advance_snapshot_restore():
    cache = LowbitPagedCache(llama().config, 2, 8, page_size=PAGE)
    cache.set_lengths([6, 2])
    state = cache.snapshot()
    cache.advance(2)
    assert [layer.seen for layer in cache.layers] == [8, 8]
    with pytest.raises(PagedCacheError, match="8 \\+ 1 positions exceed max_cache_len 8"):
        cache.advance(1)
    for layer in cache.layers:
        layer.lengths.add_(1)
    cache.restore(state)
    assert [layer.seen for layer in cache.layers] == [6, 6]
    assert [layer.lengths.tolist() for layer in cache.layers] == [[6, 2], [6, 2]]


@pytest.mark.parametrize("build", [llama, gpt_oss, qwen3_moe], ids=["llama", "gpt_oss", "qwen3_moe"])
def test_compile_fullgraph_paged_decode_step(build):
    model = _patched(build())
    ids, mask = _prompts()
    caches = [prefill(model, ids, mask, 12) for _ in range(2)]
    token = caches[0][1].argmax(-1)[:, None]
    positions = caches[0][0].layers[0].lengths.long()[:, None]
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=token, position_ids=positions, past_key_values=caches[0][0], use_cache=True).logits
        want = model(input_ids=token, position_ids=positions, past_key_values=caches[1][0], use_cache=True).logits
    assert torch.equal(got, want)
    for cache, _ in caches:  # the compiled step made the host and device updates the eager one did
        assert [layer.seen for layer in cache.layers] == [ids.shape[1] + 1] * 2
        assert cache.layers[1].lengths.tolist() == (mask.sum(1) + 1).tolist()


def test_compile_inductor_paged_decode_step():
    """torch.compile's default backend (inductor; C++ on the CPU) of the patched Llama's paged decode step: lowbit's
    ops stay opaque custom ops and inductor fuses the rest (embedding, residual adds, LM head) with its own
    rounding, so the logits are held to the bf16 tolerance, the greedy tokens to equality and the cache to the
    eager step's updates."""
    from tests.helpers import assert_close

    model = _patched(llama())
    ids, mask = _prompts()
    caches = [prefill(model, ids, mask, 12) for _ in range(2)]
    token = caches[0][1].argmax(-1)[:, None]
    positions = caches[0][0].layers[0].lengths.long()[:, None]
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        got = compiled(input_ids=token, position_ids=positions, past_key_values=caches[0][0], use_cache=True).logits
        want = model(input_ids=token, position_ids=positions, past_key_values=caches[1][0], use_cache=True).logits
    assert_close(got, want, "inductor-compiled patched decode step")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for cache, _ in caches:
        assert [layer.seen for layer in cache.layers] == [ids.shape[1] + 1] * 2
        assert cache.layers[1].lengths.tolist() == (mask.sum(1) + 1).tolist()


def test_compile_fullgraph_prefill_and_dynamic_cache_decode():
    """One compiled model, prefill (6 tokens) then a decode step: the second shape recompiles with dynamic
    sizes (the attention ops' sequence-length arguments become SymInts)."""
    model = _patched(llama())
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    outs = []
    for forward in (compiled, model):
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            prefill = forward(input_ids=ids, past_key_values=cache, use_cache=True).logits
            token = prefill[:, -1:].argmax(-1)
            decode = forward(input_ids=token, position_ids=torch.full((2, 1), 6), past_key_values=cache,
                             use_cache=True).logits
        outs.append((prefill, decode))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
