"""Whole-model timing of `lowbit_patch` on transformers models: real per-layer dims, few layers, random weights.

    python -m perf.models --out models.json [--models llama,gpt_oss,qwen3_moe] [--layers 2]
    python -m perf.models --out v32.json --models deepseek_v32      # DeepSeek-V3.2: not in the default list
    python -m perf.models --out smoke.json --models llama --smoke     # tiny dims, any device: the script's logic
    python -m perf.models --out prefill.json --batches ''                  # prefill only (no decode variants)
    python -m perf.models --out decode.json --batches 16 --no-prefill      # decode only (no prefill variants)
    python -m perf.models --out mx.json --models gpt_oss --experts mxfp4    # patched with MXFP4 experts

Per model (the same random weights throughout; the unpatched variants first, then the model is patched in place
through the public API, `dispatch.integrations.hf`):

* prefill 4 x 2048 tokens (one forward, no cache): `eager` (unpatched), `compile` (unpatched under
  torch.compile(fullgraph=True), default mode), `compile-graphs` (the same with mode="reduce-overhead": its own
  CUDA graphs), `lowbit` (patched, the forward captured in one CUDA graph; the record says whether the replay's
  logits equal an eager call's) and `lowbit-eager` (patched, eager; not a baseline);
* decode, one token per sequence at batch 1 / 16 / 64 after a 4096-token context: `eager` (unpatched with
  transformers' StaticCache, its layers filled with random keys / values and their lengths set: no prefill),
  `compile` (the same under torch.compile(mode="reduce-overhead", fullgraph=True): transformers' static-cache decode
  recipe, CUDA graphs through torch's cudagraph trees), `lowbit` (patched, `LowbitPagedCache` filled with random
  keys / values to 4096 per sequence, the step captured in one CUDA graph by `GraphedDecode`). Before every timed
  step the caches are set back to the context length (outside the timed region), so every step is the step at
  4096 + 1. GPT-OSS's sliding layers in StaticCache are transformers' StaticSlidingWindowLayer (window-sized,
  rolled when full).

The unpatched model runs transformers' default attention (sdpa where the model supports it, else eager; the
record's `attn`) and experts (`grouped_mm`). Records: model, shape, variant, ms (median of CUDA-event timed runs),
the cache used, and on lowbit records the speedup over eager, over compile and over the better of the two. The
JSON also holds, per model, the patched prefill's and the patched b16 decode step's GPU time per op family
(torch.profiler kernel times, grouped by kernel name: attention (with the KV writes), indexer (DeepSeek-V3.2's
scores and torch.topk's selection), gemm, moe, norm, rope, swiglu, other; the twelve longest kernels with their
family, to check the grouping; the decode step profiled in GraphedDecode's eager mode, the kernels the graph
replays) and the memory estimate and peak.

DeepSeek-V3 (`--models deepseek_v3`, MLA): transformers caches the compressed latent (one head: kv_lora_rank
normalized latent as "keys", the RoPE'd 64-dim key as "values") and expands it to 128 heads of 192 / 128 every
step (counted in the memory estimate); its patched decode runs `LowbitMlaCache` (the paged latent, absorbed
`mla_decode`) in the CUDA graph (the record's `cache` says which ran).

DeepSeek-V3.2 (`--models deepseek_v32`, DeepSeek-V3's dims plus its indexer: 64 heads of 128, index_topk 2048):
transformers caches the expanded keys and values (128 heads of 192 / 128) and the indexer's keys
(StaticIndexedLayer, filled at random like the rest), and folds the indexer's top-2048 into the attention mask
(sdpa); the patched decode (`lowbit`) runs `LowbitMlaCache` with the V3.2 FP8 656-byte rows (layout "v32"), the
indexer's top-2048 as `mla_decode`'s indices, the step in the CUDA graph; `lowbit-bf16-cache` the same on bf16
latent pages. Every V3.2 decode record but compile's (the same code, where forward hooks do not fire) says how
many keys the first indexer picked (`index_topk`) among how many it scored (`keys_scored`, the 4097 positions: the
selection is active). The patched prefill is transformers' masked dense attention over the decompressed latent
(the prefill ops take no per-query key set); at 2048 tokens the top-2048 keeps every causal key, as in the model.
Not in the default `--models`: its run time on the H200 is not yet measured.

Most of a model's time on one H200 goes to torch.compile: with every variant DeepSeek-V3 (2 layers) took more than
eight minutes, so a 10-minute device call takes one model, or the prefill (`--batches ''`) and the decode batches
(`--batches 16`) of a large one in two calls. Variants that need CUDA are skipped with a printed reason on a CPU
(`--smoke`: the timings are then meaningless, the run checks the script end to end).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time

import torch

from .results import measured_commit

VOCAB = 32000  # the embedding and LM head are not what is measured: a small vocab keeps them out of the way
MEMORY_LIMIT_GB = 100
FAMILIES = (  # first match wins: the KV writes and the split-KV reduce are attention, MoE GEMMs are MoE
    ("attention", ("attn", "attention", "fmha", "flash", "decode", "paged", "split_reduce", "index_copy", "sdpa",
                   "_mla_")),
    # torch.topk's kernels: in a patched model only DeepSeek-V3.2's indexer calls it (lowbit's routers are its own);
    # the indexer's scores (ops.mla_index_scores)
    ("indexer", ("sbtopk", "mbtopk", "radixfindkth", "computeblockwise", "sortkv", "index_scores")),
    # "_align_", not "align": cuBLAS names its fp32 kernels "..._ffma_aligna4_..." (V3.2's indexer scores)
    ("moe", ("moe", "expert", "grouped", "route", "topk", "_align_", "gather", "combine", "fp4_prepacked")),
    ("norm", ("norm",)),
    ("rope", ("rope", "rotary")),
    ("swiglu", ("swiglu", "silu", "glu")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas", "aten::mm", "aten::addmm", "splitk")),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    prefill: tuple[int, int]
    batches: tuple[int, ...]
    context: int
    runs: int
    warmup: int
    page_size: int = 16
    prefill_runs: bool = True  # False: decode variants only (--no-prefill)


FULL = Sizes(prefill=(4, 2048), batches=(1, 16, 64), context=4096, runs=20, warmup=3)
SMOKE = Sizes(prefill=(2, 16), batches=(1, 2), context=32, runs=2, warmup=1, page_size=4)


def cache_dims(config) -> tuple[int, int, int]:
    """(heads, key dim, value dim) of what transformers' caches store per layer: DeepSeek-V3.2's expanded keys and
    values (every head, q/k 192, v 128), MLA's latent and RoPE key as one head, or the key / value heads."""
    if hasattr(config, "index_topk"):
        return config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    if hasattr(config, "kv_lora_rank"):
        return 1, config.kv_lora_rank, config.qk_rope_head_dim
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim, head_dim


def configs(layers: int, smoke: bool) -> dict:
    """Llama-3.1-8B, GPT-OSS-20b, DeepSeek-V3 (one dense layer, then MoE), Qwen3-30B-A3B (every layer MoE) and
    DeepSeek-V3.2 (DeepSeek-V3's and its indexer's: 64 heads of 128, top-2048) per-layer dims, or tiny dims of the
    same architectures (`smoke`; V3.2's latent at the real 512, the FP8 cache's width, and top-8 of fewer keys than
    the smoke context)."""
    import transformers as tf

    common = dict(num_hidden_layers=layers, vocab_size=256 if smoke else VOCAB, max_position_embeddings=8192)
    llama = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    gpt_oss = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128)
    deepseek = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
                    num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
                    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    qwen3_moe = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8)
    indexer = dict(index_topk=2048, index_n_heads=64, index_head_dim=128)
    if smoke:
        llama = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
        gpt_oss = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
        deepseek = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=2,
                        num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32)
        qwen3_moe = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)
        indexer = dict(index_topk=8, index_n_heads=4, index_head_dim=128)
    deepseek_v32 = dict(deepseek, **indexer, kv_lora_rank=512) if smoke else dict(deepseek, **indexer)
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **llama, **common)),
        "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig(
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
            **gpt_oss, **common)),
        "deepseek_v3": (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, **deepseek, **common)),
        "qwen3_moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **qwen3_moe,
            **common)),
        "deepseek_v32": (tf.DeepseekV32ForCausalLM, tf.DeepseekV32Config(
            first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5, **deepseek_v32, **common)),
    }


def measure(fn, sizes: Sizes, device: torch.device, reset=None) -> float:
    """Median ms of `sizes.runs` calls after `sizes.warmup`; `reset` runs before each call, outside the timing.
    CUDA events on a GPU, the host clock on a CPU."""
    times = []
    for i in range(sizes.warmup + sizes.runs):
        if reset is not None:
            reset()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= sizes.warmup:
            times.append(elapsed)
    return statistics.median(times)


def family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in FAMILIES if any(k in low for k in keys)), "other")


def op_families(fn, steps: int, device: torch.device, reset=None) -> dict:
    """GPU time per op family (us per call of fn, `reset` before each call) from torch.profiler's kernels; on a
    CPU the CPU ops' self times (meaningless, but the same grouping)."""
    from torch.profiler import ProfilerActivity, profile

    reset = reset or (lambda: None)
    reset()
    fn()
    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            reset()
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    split: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = event.self_device_time_total / steps
        else:
            us = event.self_cpu_time_total / steps
        split[family(event.key)] = split.get(family(event.key), 0.0) + us
        kernels.append((us, event.key))
    top = [dict(name=name[:120], family=family(name), us=us) for us, name in sorted(kernels, reverse=True)[:12]]
    return dict(families_us=dict(sorted(split.items())), top=top)


def static_cache(model, batch: int, context: int, device: torch.device):
    """transformers' StaticCache for `context` + 1 positions, every layer filled with random keys / values (and
    DeepSeek-V3.2's indexer keys: StaticIndexedLayer), and a reset that sets every layer back to `context` stored
    positions (no prefill)."""
    from transformers import StaticCache

    config = model.config
    cache = StaticCache(config=config, max_cache_len=context + 1)
    heads, k_dim, v_dim = cache_dims(config)
    dtype = next(model.parameters()).dtype
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(batch, heads, 0, k_dim, dtype=dtype, device=device),
                                  torch.zeros(batch, heads, 0, v_dim, dtype=dtype, device=device))
        layer.keys.normal_()
        layer.values.normal_()
        if hasattr(layer, "lazy_initialization_indexer"):
            layer.lazy_initialization_indexer(torch.zeros(batch, 0, config.index_head_dim, dtype=dtype, device=device))
            layer.indexer_keys.normal_()

    def reset():
        for layer in cache.layers:
            layer.cumulative_length.fill_(context)
            if hasattr(layer, "indexer_cumulative_length"):  # the indexer's keys keep a count of their own
                layer.indexer_cumulative_length.fill_(context)
            if hasattr(layer, "cumulative_length_int"):  # sliding layers keep a host count too
                layer.cumulative_length_int = context

    return cache, reset


def paged_graph_decode(model, batch: int, sizes: Sizes, device: torch.device, latent_layout: str | None = None):
    """LowbitPagedCache (latent_layout: DeepSeek's LowbitMlaCache of that layout, page 64, the sm_90 MLA kernel's
    page) filled with random contents (DeepSeek-V3.2's indexer keys too), every sequence at `context`, the step in
    one CUDA graph (GraphedDecode's eager mode off CUDA, said on stdout). Returns (step, reset, eager step, cache
    name)."""
    from dispatch.integrations.hf import GraphedDecode, LowbitMlaCache, LowbitPagedCache

    if latent_layout is not None:
        cache = LowbitMlaCache(model.config, batch, sizes.context + 1, page_size=64, layout=latent_layout,
                               device=device)
    else:
        cache = LowbitPagedCache(model.config, batch, sizes.context + 1, page_size=sizes.page_size, device=device)
    cache.fill_random()
    lengths = [sizes.context] * batch
    cache.set_lengths(lengths)
    mode = "cuda_graph" if device.type == "cuda" else "eager"
    if mode == "eager":
        print("lowbit decode: no CUDA device, GraphedDecode runs its eager mode (no CUDA graph)")
    graph = GraphedDecode(model, cache, mode=mode)
    eager = graph if mode == "eager" else GraphedDecode(model, cache, mode="eager")
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=device)
    layout = "" if latent_layout is None else f" {latent_layout}"
    return (lambda: graph.step(ids)), (lambda: cache.set_lengths(lengths)), (lambda: eager.step(ids)), \
        f"{type(cache).__name__}{layout} + {mode}"


def latent_graph_decode(model, batch: int, sizes: Sizes, device: torch.device):
    return paged_graph_decode(model, batch, sizes, device, latent_layout="bf16")


def v32_graph_decode(model, batch: int, sizes: Sizes, device: torch.device):
    """DeepSeek-V3.2's FP8 656-byte latent rows, what the V3.2 checkpoints' own inference stores."""
    return paged_graph_decode(model, batch, sizes, device, latent_layout="v32")


# model -> its patched decode variants, (variant, builder) with builder (model, batch, sizes, device) -> (step,
# reset, eager step, cache name); the first is the model's "lowbit" record and the one profiled.
PATCHED_DECODE = {"llama": (("lowbit", paged_graph_decode),), "gpt_oss": (("lowbit", paged_graph_decode),),
                  "deepseek_v3": (("lowbit", latent_graph_decode),), "qwen3_moe": (("lowbit", paged_graph_decode),),
                  "deepseek_v32": (("lowbit", v32_graph_decode), ("lowbit-bf16-cache", latent_graph_decode))}


def indexer_selection(model, fn, reset) -> dict | None:
    """For DeepSeek-V3.2 (None for other models): one call of fn after reset, the first layer's indexer watched:
    how many keys it picks per query and among how many it scored (topk < keys: the sparse selection is active)."""
    indexer = getattr(model.model.layers[0].self_attn, "indexer", None)
    if indexer is None:
        return None
    seen = []  # its positional arguments: hidden states, q latent, RoPE, the visible keys (B, S, keys), positions
    handle = indexer.register_forward_hook(lambda module, args, out: seen.append((out.shape[-1], args[3].shape[-1])))
    try:
        reset()
        fn()
    finally:
        handle.remove()
    return dict(topk=seen[0][0], keys=seen[0][1])


def graphed_prefill(prefill, device: torch.device):
    """(replay, logits equal) of `prefill` captured in one CUDA graph after two warm-up calls on a side stream, the
    replay's logits compared with an eager call's; (None, None) off CUDA (the record then times the eager call)."""
    if device.type != "cuda":
        print("lowbit prefill: no CUDA device, timed eagerly (no CUDA graph)")
        return None, None
    from .runner import capture_graph

    graph, logits = capture_graph(prefill, device, warmup=2)
    want = prefill()
    graph.replay()
    return graph.replay, bool(torch.equal(logits, want))


def _unpatched_decode(forward, model, batch: int, context: int, device: torch.device):
    cache, reset = static_cache(model, batch, context, device)
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    pos = torch.full((batch, 1), context, device=device)
    return (lambda: forward(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)), reset


def memory_estimate_gb(model, sizes: Sizes) -> float:
    """Weights plus the largest decode's cache (one cache is alive at a time; bf16: 2 bytes x layers x batch x
    positions x heads x (k + v dims)), plus DeepSeek-V3.2's indexer keys, or DeepSeek-V3's per-step expansion of
    one layer's latent to every head's key and value; prefill activations are not counted."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    heads, k_dim, v_dim = cache_dims(config)
    positions = max(sizes.batches, default=0) * (sizes.context + 1)
    cache = 2 * config.num_hidden_layers * positions * heads * (k_dim + v_dim)
    if hasattr(config, "index_topk"):
        cache += 2 * config.num_hidden_layers * positions * config.index_head_dim
    elif hasattr(config, "kv_lora_rank"):
        cache += 2 * positions * config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                              + config.v_head_dim)
    return (weights + cache) / 2**30


def _timed(record: dict, fn, sizes: Sizes, device: torch.device, reset=None) -> dict:
    """The record with `ms`, or for a torch.compile variant that fails, with the `error` (printed, not raised:
    the other variants still run)."""
    try:
        return {**record, "ms": measure(fn, sizes, device, reset)}
    except Exception as err:  # compile failures come from torch / transformers internals, of any type
        if record["variant"] != "compile":
            raise
        print(f"{record['model']} {record['shape']} compile: {type(err).__name__}: {str(err)[:300]}")
        return {**record, "error": f"{type(err).__name__}: {str(err)[:300]}"}


def _unpatched_records(name, model, sizes, batches, device, compile_) -> list[dict]:
    b, s = sizes.prefill
    prefill_ids = torch.randint(0, model.config.vocab_size, (b, s), device=device)
    common = dict(model=name, shape=f"prefill {b}x{s}", attn=model.config._attn_implementation)
    records = []
    if sizes.prefill_runs:
        records.append(_timed(dict(common, variant="eager"), lambda: model(input_ids=prefill_ids, use_cache=False),
                              sizes, device))
        for variant, mode in (("compile", "default"), ("compile-graphs", "reduce-overhead")) if compile_ else ():
            compiled = torch.compile(model, mode=mode, fullgraph=True, dynamic=False)
            records.append(_timed(dict(common, variant=variant),
                                  lambda fn=compiled: fn(input_ids=prefill_ids, use_cache=False), sizes, device))
            torch._dynamo.reset()
    variants = [("eager", model)]
    if compile_:
        variants.append(("compile", torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)))
    for batch in batches:
        for variant, forward in variants:
            step, reset = _unpatched_decode(forward, model, batch, sizes.context, device)
            record = dict(common, shape=f"decode b{batch} ctx{sizes.context}", variant=variant, cache="StaticCache")
            if variant == "eager":  # the compiled model runs the same code, where forward hooks do not fire
                record = _with_selection(record, indexer_selection(model, step, reset))
            records.append(_timed(record, step, sizes, device, reset))
            del step, reset
    torch._dynamo.reset()  # drops the compiled graphs and their CUDA-graph pools before the patched runs
    return records


def _patched_records(name, model, sizes, batches, device, experts) -> tuple[list[dict], dict]:
    from dispatch.integrations.hf import lowbit_patch

    report = lowbit_patch(model, experts=experts)
    tag = f"-{experts}" if experts else ""  # "lowbit-mxfp4": quantized experts, not the baselines' weights
    records, split = _patched_prefill(name, model, report, sizes, device, tag) if sizes.prefill_runs else ([], {})
    profile_batch = 16 if 16 in batches or not batches else batches[-1]
    for batch in batches:
        shape = f"decode b{batch} ctx{sizes.context}"
        for i, (variant, build) in enumerate(PATCHED_DECODE[name]):
            step, reset, eager_step, cache_name = build(model, batch, sizes, device)
            record = _with_selection(dict(model=name, shape=shape, variant=variant + tag, cache=cache_name,
                                          experts=report.experts),
                                     indexer_selection(model, eager_step, reset))
            records.append(dict(record, ms=measure(step, sizes, device, reset)))
            if batch == profile_batch and i == 0:
                split[f"{shape} (eager step)"] = op_families(eager_step, 2, device, reset)
            del step, reset, eager_step
    return records, split


def _patched_prefill(name, model, report, sizes, device, tag) -> tuple[list[dict], dict]:
    b, s = sizes.prefill
    prefill_ids = torch.randint(0, model.config.vocab_size, (b, s), device=device)
    prefill = lambda: model(input_ids=prefill_ids, use_cache=False).logits  # noqa: E731
    eager_ms = measure(prefill, sizes, device)
    graphed, same = graphed_prefill(prefill, device)
    records = [dict(model=name, shape=f"prefill {b}x{s}", variant=f"lowbit{tag}", replaced=report.replaced,
                    experts=report.experts,
                    ms=measure(graphed, sizes, device) if graphed else eager_ms,
                    cuda_graph=graphed is not None, graph_logits_equal_eager=same),
               dict(model=name, shape=f"prefill {b}x{s}", variant=f"lowbit{tag}-eager", ms=eager_ms)]
    del graphed  # the graph's memory pool goes before the decode caches are built
    return records, {f"prefill {b}x{s}": op_families(prefill, 2, device)}


def _with_selection(record: dict, selection: dict | None) -> dict:
    return record if selection is None else dict(record, index_topk=selection["topk"], keys_scored=selection["keys"])


def _speedups(records: list[dict]) -> None:
    """Each lowbit variant's ("lowbit", "lowbit-bf16-cache") speedup over each unpatched one of its shape."""
    for r in records:
        if not r["variant"].startswith("lowbit"):
            continue
        base = {x["variant"]: x["ms"] for x in records
                if x["shape"] == r["shape"] and not x["variant"].startswith("lowbit") and "ms" in x}
        for variant, ms in base.items():
            r[f"speedup_vs_{variant}"] = ms / r["ms"]
        if base:
            r["speedup_vs_best"] = min(base.values()) / r["ms"]


def run_model(name: str, model_cls, config, sizes: Sizes, device: torch.device, compile_: bool,
              experts: str | None = None) -> dict:
    batches = sizes.batches
    from dispatch.integrations.hf.check import build_model

    # the seed's random weights, transformers' zero-initialized biases drawn too; transformers' default attention
    model = build_model(model_cls, config, device=device, attn_implementation=None)
    estimate = memory_estimate_gb(model, sizes)
    if estimate > MEMORY_LIMIT_GB:
        raise SystemExit(f"perf.models: {name} needs about {estimate:.0f} GB (limit {MEMORY_LIMIT_GB}): fewer layers")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        records = _unpatched_records(name, model, sizes, batches, device, compile_)
        patched, split = _patched_records(name, model, sizes, batches, device, experts)
    records += patched
    _speedups(records)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(records=records, op_families_us={name: split},
                memory={name: dict(estimate_gb=estimate, peak_gb=peak, decode_batches=list(batches),
                                   context=sizes.context)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="llama,gpt_oss,deepseek_v3,qwen3_moe")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="tiny dims and shapes: checks the script, not speed")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-prefill", action="store_true", help="decode variants only")
    parser.add_argument("--experts", default=None,
                        help="lowbit_patch's experts= for the patched variants (GPT-OSS 'mxfp4', DeepSeek 'fp8'); "
                             "the unpatched baselines keep the bf16 weights")
    parser.add_argument("--batches", default=None,
                        help="decode batch sizes, comma separated (default: the sizes' 1,16,64); '' for prefill only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = SMOKE if args.smoke else FULL
    if args.batches is not None:
        sizes = dataclasses.replace(sizes, batches=tuple(int(b) for b in args.batches.split(",") if b.strip()))
    if args.no_prefill:
        sizes = dataclasses.replace(sizes, prefill_runs=False)
    compile_ = not args.no_compile and device.type == "cuda"
    if device.type != "cuda" and not args.no_compile:
        print("compile variants skipped: torch.compile's reduce-overhead mode and its CUDA graphs need a CUDA device")
    table = configs(args.layers, args.smoke)
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                commit=measured_commit(),
                layers=args.layers, smoke=args.smoke, sizes=dataclasses.asdict(sizes),
                date=datetime.date.today().isoformat())
    result = dict(records=[], op_families_us={}, memory={})
    for name in args.models.split(","):
        model_cls, config = table[name]
        out = run_model(name, model_cls, config, sizes, device, compile_, args.experts)
        for key in result:
            result[key] = result[key] + out[key] if key == "records" else {**result[key], **out[key]}
        for r in out["records"]:
            print(json.dumps(r))
        print(json.dumps(out["op_families_us"]))
        with open(args.out, "w") as f:  # after every model: a run cut short keeps the models it finished
            json.dump(dict(meta=meta, **result), f, indent=1)


if __name__ == "__main__":
    main()
