"""Whole-model timing of `lowbit_patch` on transformers models: real per-layer dims, few layers, random weights.

    python -m perf.models --out models.json [--models llama,gpt_oss,deepseek_v3] [--layers 2] [--no-compile]

Per model and shape, the same model is timed unpatched in eager, unpatched under torch.compile, then patched
(through the public API only: `dispatch.integrations.hf.lowbit_patch`). Shapes: prefill 4 x 2048 tokens (one
forward, no cache) and decode at batch 1 / 16 / 64 (one token per sequence against a 1024-token DynamicCache,
cropped back after every step). Records: model, shape, variant, ms (median of CUDA-event timed runs) and the
patched model's speedup over eager and over compile. Sized to run within five minutes on one H200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch

PREFILL = (4, 2048)
DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXT = 1024
VOCAB = 32000  # the embedding and LM head are not what is measured: a small vocab keeps them out of the way
RUNS = 10


def configs(layers: int) -> dict:
    """The per-layer dims of Llama-3.1-8B, GPT-OSS-20b and DeepSeek-V3 (one dense + MoE layers)."""
    import transformers as tf

    common = dict(num_hidden_layers=layers, vocab_size=VOCAB, max_position_embeddings=4096)
    return {
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, **common)),
        "gpt_oss": (tf.GptOssForCausalLM, tf.GptOssConfig(
            hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
            num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
            **common)),
        "deepseek_v3": (tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, first_k_dense_replace=1,
            num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8,
            n_group=8, topk_group=4, n_shared_experts=1, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5, **common)),
    }


def _ms(fn, runs: int = RUNS) -> float:
    times = []
    for _ in range(runs + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def _cases(model, forward):
    """(shape name, timed callable) for the prefill and decode shapes, through `forward` (the model or its
    compiled form)."""
    from transformers import DynamicCache

    b, s = PREFILL
    ids = torch.randint(0, VOCAB, (b, s), device="cuda")
    yield f"prefill {b}x{s}", lambda: forward(input_ids=ids, use_cache=False)
    for batch in DECODE_BATCHES:
        cache = DynamicCache(config=model.config)
        context = torch.randint(0, VOCAB, (batch, DECODE_CONTEXT), device="cuda")
        model(input_ids=context, past_key_values=cache, use_cache=True)
        step = torch.randint(0, VOCAB, (batch, 1), device="cuda")
        position = torch.full((batch, 1), DECODE_CONTEXT, device="cuda")

        def decode(cache=cache, step=step, position=position):
            forward(input_ids=step, past_key_values=cache, position_ids=position, use_cache=True)
            cache.crop(DECODE_CONTEXT)

        yield f"decode b{batch} ctx{DECODE_CONTEXT}", decode


def run_model(name: str, model_cls, config, compile_: bool) -> list[dict]:
    from dispatch.integrations.hf import lowbit_patch

    config._attn_implementation = "eager"
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16).eval()
    records = []
    with torch.no_grad():
        variants = [("eager", model)] + ([("compile", torch.compile(model))] if compile_ else [])
        for variant, forward in variants:
            records += [dict(model=name, shape=shape, variant=variant, ms=_ms(fn)) for shape, fn in
                        _cases(model, forward)]
        report = lowbit_patch(model)
        records += [dict(model=name, shape=shape, variant="lowbit", ms=_ms(fn), replaced=report.replaced)
                    for shape, fn in _cases(model, model)]
    for r in records:
        if r["variant"] == "lowbit":
            for base in ("eager", "compile"):
                ref = next((x["ms"] for x in records if x["shape"] == r["shape"] and x["variant"] == base), None)
                if ref is not None:
                    r[f"speedup_vs_{base}"] = ref / r["ms"]
    del model
    torch.cuda.empty_cache()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="llama,gpt_oss,deepseek_v3")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    table = configs(args.layers)
    records = []
    for name in args.models.split(","):
        model_cls, config = table[name]
        records += run_model(name, model_cls, config, not args.no_compile)
        for r in records[-12:]:
            print(json.dumps(r))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, layers=args.layers,
                date=datetime.date.today().isoformat())
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, records=records), f, indent=1)


if __name__ == "__main__":
    main()
