"""The models part of the main job (`python -m dispatch check`): each supported architecture, built small from a
config with random weights (nothing downloads), generates greedily patched and unpatched on this machine's
device; a row says what was replaced, whether the tokens agree and how long a generation took each way.
DeepSeek-V3 and V3.2 have a second row generating with the paged latent cache (`LowbitMlaCache`: the absorbed MLA
decode, sparse for V3.2).

Tokens agree when every step gives the same token, or the first step that differs is a tie of the unpatched
model: its top-2 logits within `TIE_SPACINGS` bf16 spacings of each other (random weights make such ties, and two
correct stacks may round them either way); steps before the first difference must have logits cosine >= 0.9999.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable

import torch

VOCAB = 256
PAD = 0
NEW_TOKENS = 8
PROMPT_LENS = (11, 6)
COSINE_MIN = 0.9999
TIE_SPACINGS = 4
# The tie window where FP8 E4M3 values enter the logits (an FP8 KV cache, FP8 activations): E4M3 carries 4 fewer
# significant bits than bf16, so its rounding moves a logit by up to 2^4 times as many bf16 spacings.
FP8_TIE_SPACINGS = 16 * TIE_SPACINGS


@dataclasses.dataclass(frozen=True)
class TokenCheck:
    agree: bool
    note: str  # "same tokens", "tie at step s", or what differs


def prompts(lens=PROMPT_LENS, vocab: int = VOCAB, device="cpu", seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of the given lengths (as transformers' tokenizers pad for generation) and their mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, vocab, (len(lens), width), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lens):
        ids[row, : width - n] = PAD
        mask[row, width - n:] = 1
    return ids.to(device), mask.to(device)


def greedy(model, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, **kwargs):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=PAD,
                              **kwargs)


def compare_greedy(got, want, new_tokens: int, cosine_min: float = COSINE_MIN,
                   tie_spacings: float = TIE_SPACINGS) -> TokenCheck:
    """got / want: `generate(..., output_logits=True, return_dict_in_generate=True)` results of one prompt batch.
    tie_spacings: how close (in bf16 spacings of the top logit) the reference's top-2 must be for a differing token
    to count as a tie (wider for an FP8 KV cache, whose values carry 4 fewer significant bits than bf16's)."""
    width = want.sequences.shape[1] - new_tokens
    notes = []
    for row in range(want.sequences.shape[0]):
        for step in range(new_tokens):
            a, b = got.logits[step][row].float(), want.logits[step][row].float()
            if got.sequences[row, width + step] != want.sequences[row, width + step]:
                top2 = b.topk(2).values
                spacing = 2.0 ** (int(torch.frexp(top2[0].abs()).exponent) - 8)  # bf16: 8 significant bits
                gap = float(top2[0] - top2[1]) / spacing
                if gap > tie_spacings:
                    return TokenCheck(False, f"sequence {row} step {step}: tokens differ, top-2 gap {gap:.1f} "
                                             "bf16 spacings")
                notes.append(f"tie at seq {row} step {step}")
                break  # the sequences differ from here on: later logits are of different prefixes
            cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
            if cos < cosine_min:
                return TokenCheck(False, f"sequence {row} step {step}: logits cosine {cos:.6f}")
    return TokenCheck(True, "; ".join(notes) or "same tokens")


def fp32_logit_errors(reference_fp32, result, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """(rows, new_tokens) relative L2 error of a greedy result's per-step logits against the fp32 model's logits on
    the same tokens: one teacher-forced forward of `result.sequences` (positions numbered as generate numbers a
    left-padded batch). The error of a bf16 stack against its fp32 twin is the yardstick for another bf16 stack's:
    at real model widths with random weights the logits are nearly flat, so a fixed cosine floor measures the width
    more than the stack."""
    width = result.sequences.shape[1] - new_tokens
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], new_tokens)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = reference_fp32(input_ids=result.sequences, attention_mask=full_mask, position_ids=positions).logits
    errors = torch.empty(mask.shape[0], new_tokens)
    for step in range(new_tokens):
        exact = logits[:, width - 1 + step].double()
        got = result.logits[step].double()
        errors[:, step] = ((got - exact).norm(dim=-1) / exact.norm(dim=-1)).cpu()
    return errors


# Zero-initialized parameters (GPT-OSS's attention and expert biases) take values of this scale in `build_model`.
ZERO_INIT_STD = 0.1


def build_model(cls, config, device: torch.device | str | None = None, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16, attn_implementation: str | None = "eager") -> torch.nn.Module:
    """A transformers model with random weights (bf16 unless `dtype`) and eager attention (None: transformers'
    default for the model), for checks against the unpatched model and for timing it.
    Built in the dtype (as from_pretrained(dtype=...) builds): the rotary inverse frequencies stay fp32; a
    `.to(torch.bfloat16)` would round them and the unpatched RoPE would drift from the exact angles with position.
    Parameters transformers initializes to zero (GPT-OSS's projection and expert biases) are drawn too, so every
    weight a patched module reads takes part in the comparison; normalization layers keep their initialization (a
    LayerNorm bias moves every key of DeepSeek-V3.2's indexer alike, crowding its top-k scores into ties)."""
    torch.manual_seed(seed)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    # device None: the current default device (a caller's `with torch.device(...)` holds)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = cls._from_config(config, dtype=dtype).eval()
    with torch.no_grad():
        for module in model.modules():
            if "Norm" in type(module).__name__:
                continue
            for param in module.parameters(recurse=False):
                if param.is_floating_point() and not param.any():
                    param.normal_(std=ZERO_INIT_STD)
    return model


def tiny_models() -> dict[str, Callable[[], torch.nn.Module]]:
    """Builders of each supported architecture at a few narrow layers (the CPU main job's size). The MoE models
    route every token to every expert: with random weights a router logit moved by one rounding can flip a top-k
    choice, a discrete change no token or cosine bound covers (the routers' bytes are checked by the op rows)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=64, pad_token_id=PAD)
    return {
        "llama": lambda: build_model(tf.LlamaForCausalLM, tf.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, **common)),
        "gpt_oss": lambda: build_model(tf.GptOssForCausalLM, tf.GptOssConfig(
            hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_local_experts=4, num_experts_per_tok=4, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 16, "truncate": False},
            **common)),
        "deepseek_v3": lambda: build_model(tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=1,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=8, n_group=4,
            topk_group=4, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0}, **common)),
        # one (MoE) layer: the indexer's top-k (4 of up to 19 keys) is a discrete choice whose inputs, from a second
        # layer on, carry the first layer's rounding (the router's case); the real model's 64 indexer heads: a key
        # scores exactly 0 when every head's ReLU'd product is 0 (1 in 2^heads), and torch.topk breaks such ties by
        # the width scored, which differs between transformers' cache and LowbitMlaCache
        "deepseek_v32": lambda: build_model(tf.DeepseekV32ForCausalLM, tf.DeepseekV32Config(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, first_k_dense_replace=0,
            num_attention_heads=2, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=8, n_group=4,
            topk_group=4, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5, index_topk=4, index_n_heads=64,
            index_head_dim=128,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                             "beta_slow": 1.0}, **dict(common, num_hidden_layers=1))),
        "qwen3_moe": lambda: build_model(tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=4, norm_topk_prob=True,
            mlp_only_layers=[1], **common)),
    }


def _mla_cache(model, batch: int, max_len: int, device) -> object:
    from .mla_cache import LowbitMlaCache

    return LowbitMlaCache(model.config, batch, max_len, page_size=16, device=device)


# Models checked a second time with a lowbit cache passed to generate: model -> (row label, cache builder).
CACHED_RUNS = {"deepseek_v3": ("deepseek_v3+mla", _mla_cache), "deepseek_v32": ("deepseek_v32+mla", _mla_cache)}


def _timed_greedy(model, ids, mask, device, cache=None) -> tuple[object, float]:
    """The second of two greedy generations (the first compiles and fills caches) and its time in ms; cache: a
    builder of a fresh cache per generation, or None (transformers' own)."""
    def run():
        extra = {} if cache is None else {"past_key_values": cache(model, ids.shape[0], ids.shape[1] + NEW_TOKENS,
                                                                   device)}
        return greedy(model, ids, mask, NEW_TOKENS, **extra)

    run()
    start = time.perf_counter()
    out = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - start) * 1e3


def check_models(device: torch.device) -> list[dict]:
    """One row per architecture (and per cached run in CACHED_RUNS): replaced modules, token agreement, generate
    time patched and unpatched."""
    from .patch import lowbit_patch

    rows = []
    ids, mask = prompts(device=device)
    for name, build in tiny_models().items():
        with torch.device(device):
            reference = build()
        patched = copy.deepcopy(reference)
        report = lowbit_patch(patched)
        want, unpatched_ms = _timed_greedy(reference, ids, mask, device)
        runs = [(name, None)] + ([CACHED_RUNS[name]] if name in CACHED_RUNS else [])
        for label, cache in runs:
            got, lowbit_ms = _timed_greedy(patched, ids, mask, device, cache)
            check = compare_greedy(got, want, NEW_TOKENS)
            rows.append(dict(model=label, replaced=sum(report.replaced.values()), ok=check.agree, tokens=check.note,
                             unpatched_ms=unpatched_ms, lowbit_ms=lowbit_ms))
    return rows
