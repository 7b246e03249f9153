"""Quantized experts in patched transformers models (CPU, tiny configs, `auto` = the torch references): GPT-OSS
MXFP4 (the checkpoint's `*_blocks` / `*_scales` as they are, or bf16 quantized at patch time) and DeepSeek-V3 FP8
128x128 blocks (transformers' FP8Experts as loaded from a checkpoint, or bf16 quantized at patch time). The
reference is the unpatched model on the same weights dequantized as transformers dequantizes them (for the patch-time
quantizations: the patched experts' own MXFP4 / FP8 tensors dequantized into the unpatched model's bf16 experts, after
checking those tensors against transformers' conventions): the first 16 greedy tokens of the four left-padded prompts
equal by the tie-aware rule of dispatch/integrations/hf/check.py and every step's logits at cosine >= 0.99. Every
token goes to every expert (tests/test_hf_models.py: ROUTED_TOKENS says why). The FP8 experts run W8A8: their
activations are rounded to E4M3 on the way, so ties count within FP8_TIE_SPACINGS."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from tests.test_hf_models import (
    QUANT_TOKENS,
    assert_generation_matches,
    assert_refused_unmodified,
    deepseek_v3,
    gpt_oss,
    gpt_oss_all_experts,
    llama,
)

transformers = pytest.importorskip("transformers")

from dispatch.integrations.hf import lowbit_patch  # noqa: E402
from dispatch.integrations.hf.check import FP8_TIE_SPACINGS, TIE_SPACINGS  # noqa: E402
from tests.test_hf_mla_cache import deepseek_v3_real_attention  # noqa: E402
from tests.test_hf_models_gpu import QUANT_COSINE_MIN, assert_same_greedy_tokens, build_on_gpu  # noqa: E402
from tests.test_hf_models_gpu import QUANT_TOKENS as GPU_QUANT_TOKENS  # noqa: E402
from tests.test_hf_models_gpu import VOCAB as GPU_VOCAB_SIZE  # noqa: E402
from tests.test_hf_models_gpu import _generate as gpu_generate  # noqa: E402

COSINE_MIN = 0.99


def assert_quantized_generation_matches(patched, reference, tie_spacings: float = TIE_SPACINGS):
    """QUANT_TOKENS greedy tokens of the four prompts equal (tie-aware), every step's logits cosine >= COSINE_MIN."""
    assert_generation_matches(patched, reference, QUANT_TOKENS, cosine_min=COSINE_MIN, tie_spacings=tie_spacings)


def _experts(model, cls_name: str) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if type(m).__name__ == cls_name}


def _mxfp4_dequantize(state: dict, key: str) -> torch.Tensor:
    """transformers' dequantization of checkpoint MXFP4 tensors `<key>_blocks` / `<key>_scales`."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(state[f"{key}_blocks"], state[f"{key}_scales"])


def _fp8_dequantize_state(state: dict, key: str) -> torch.Tensor:
    return _fp8_dequantize(state[key], state[f"{key}_scale_inv"])


def dequantize_patched_experts_into(reference, patched, experts_cls: str, dequantize) -> None:
    """The unpatched `reference`'s bf16 experts (`experts_cls` modules) set to the patched model's quantized experts
    dequantized (`dequantize(state, "<experts path>.<proj>")`): both models then hold the same weights."""
    state = patched.state_dict()
    for name, experts in _experts(reference, experts_cls).items():
        for proj in ("gate_up_proj", "down_proj"):
            getattr(experts, proj).data = dequantize(state, f"{name}.{proj}").to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------- GPT-OSS


def _mxfp4_checkpoint(model, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random checkpoint bytes in the GPT-OSS layout (blocks (E, N, K/32, 16), E8M0 scales (E, N, K/32), scale
    2^-8 .. 2^-5); the model's bf16 experts are set to transformers' dequantization of them (what
    Mxfp4Config(dequantize=True) loads)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, experts in _experts(model, "GptOssExperts").items():
        for proj in ("gate_up_proj", "down_proj"):
            e, k, n = getattr(experts, proj).shape
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(119, 123, (e, n, k // 32), generator=g, dtype=torch.uint8)
            state |= {f"{name}.{proj}_blocks": blocks, f"{name}.{proj}_scales": scales}
            getattr(experts, proj).data = convert_moe_packed_tensors(blocks, scales).to(torch.bfloat16)
    return state


def test_gpt_oss_mxfp4_checkpoint_tensors_as_they_are():
    reference = gpt_oss_all_experts()
    state = _mxfp4_checkpoint(reference)
    patched = copy.deepcopy(reference)
    report = lowbit_patch(patched, experts="mxfp4", expert_weights=state)
    assert report.experts == "mxfp4"
    patched_state = patched.state_dict()
    for key, t in state.items():
        assert torch.equal(patched_state[key], t), key
    assert not any(k.endswith("experts.gate_up_proj") for k in patched_state)
    assert_quantized_generation_matches(patched, reference)


def test_gpt_oss_mxfp4_state_dict_loads_back():
    """The patched experts' state dict (the checkpoint's keys and layout) loads into another patched model, whose
    prepacked weights then equal the first's; blocks of the wrong shape are refused by load_state_dict."""
    reference = gpt_oss_all_experts()
    state = _mxfp4_checkpoint(reference)
    source, target = copy.deepcopy(reference), copy.deepcopy(reference)
    lowbit_patch(source, experts="mxfp4", expert_weights=state)
    lowbit_patch(target, experts="mxfp4")  # quantized at patch time: other bytes until the load
    pairs = [(m, target.get_submodule(name)) for name, m in _experts(source, "LowbitMxfp4Experts").items()]
    assert pairs

    def same() -> bool:
        return all(torch.equal(x, y) for a, b in pairs for proj in ("gate_up_proj", "down_proj")
                   for x, y in zip(a.prepacked(proj), b.prepacked(proj), strict=True))

    assert not same()
    saved = source.state_dict()
    target.load_state_dict(saved)
    assert same()
    key = next(k for k in saved if k.endswith("down_proj_blocks"))
    with pytest.raises(RuntimeError, match="down_proj: blocks / scales"):
        target.load_state_dict(saved | {key: saved[key][:, :, :1]})


def test_gpt_oss_mxfp4_quantized_at_patch_time():
    reference = gpt_oss_all_experts()
    patched = copy.deepcopy(reference)
    assert lowbit_patch(patched, experts="mxfp4").experts == "mxfp4"
    state = patched.state_dict()
    for name, experts in _experts(reference, "GptOssExperts").items():
        for proj in ("gate_up_proj", "down_proj"):
            deq, w = _mxfp4_dequantize(state, f"{name}.{proj}"), getattr(experts, proj)
            cos = torch.nn.functional.cosine_similarity(deq.float().flatten(), w.float().flatten(), dim=0)
            assert cos > 0.99, f"{name}.{proj}: MXFP4 round trip cosine {cos}"
    dequantize_patched_experts_into(reference, patched, "GptOssExperts", _mxfp4_dequantize)
    assert_quantized_generation_matches(patched, reference)


def test_gpt_oss_mxfp4_bad_expert_weights_refused_unmodified():
    model = gpt_oss()
    state = _mxfp4_checkpoint(model)
    state.pop("model.layers.1.mlp.experts.down_proj_scales")
    state["model.layers.0.mlp.experts.gate_up_proj_blocks"] = state[
        "model.layers.0.mlp.experts.gate_up_proj_blocks"][:, :, :1]
    assert_refused_unmodified(model, "expert_weights has no model.layers.1.mlp.experts.down_proj_blocks / _scales",
                              "layer 0 experts: gate_up_proj_blocks (4, 128, 1, 16)", experts="mxfp4",
                              expert_weights=state)


def test_wrong_expert_formats_refused_unmodified():
    assert_refused_unmodified(gpt_oss(), "layer 0 experts: experts='fp8'", experts="fp8")
    assert_refused_unmodified(llama(), "Llama has no experts", experts="mxfp4")
    assert_refused_unmodified(deepseek_v3(), "layer 1 experts: hidden 64 / intermediate 32", experts="fp8")


# ------------------------------------------------------------------------------------------ DeepSeek-V3


def deepseek_v3_fp8_dims():
    """FP8 block-scaled experts need hidden and the expert intermediate size in multiples of 128; every token to all
    8 routed experts."""
    return deepseek_v3(hidden_size=128, moe_intermediate_size=128, num_experts_per_tok=8, topk_group=4)


def _fp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own checkpoint quantizer (Fp8Quantize, 128x128 blocks): (E4M3 codes, fp32 scale_inv)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    out = Fp8Quantize(types.SimpleNamespace(quantization_config=config))._quantize_one("w", w)
    return out["w"], out["w_scale_inv"]


def _fp8_dequantize(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    s = scale_inv.repeat_interleave(128, 1).repeat_interleave(128, 2)
    return (codes.float() * s).to(torch.bfloat16)


def _fp8_checkpoint_model(reference):
    """A copy of `reference` holding transformers' FP8Experts (checkpoint codes + scale_inv, as an FP8 checkpoint
    loads), the reference's bf16 experts set to their dequantized values."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    fp8 = copy.deepcopy(reference)
    ref_experts = _experts(reference, "DeepseekV3Experts")
    for name, experts in _experts(fp8, "DeepseekV3Experts").items():
        module = FP8Experts(fp8.config, block_size=(128, 128))
        for proj in ("gate_up_proj", "down_proj"):
            codes, scale_inv = _fp8_quantize(getattr(experts, proj).detach())
            getattr(module, proj).data, getattr(module, f"{proj}_scale_inv").data = codes, scale_inv
            getattr(ref_experts[name], proj).data = _fp8_dequantize(codes, scale_inv)
        fp8.set_submodule(name, module)
    return fp8


def test_deepseek_v3_fp8_checkpoint_experts_as_they_are():
    reference = deepseek_v3_fp8_dims()
    patched = _fp8_checkpoint_model(reference)
    held = {n: (m.gate_up_proj, m.down_proj_scale_inv) for n, m in _experts(patched, "FP8Experts").items()}
    report = lowbit_patch(patched)
    assert report.experts == "fp8" and report.replaced["DeepseekV3MoE"] == 1
    state = patched.state_dict()
    for name, (w, s) in held.items():  # the checkpoint's tensors themselves, no copy
        assert state[f"{name}.gate_up_proj"].data_ptr() == w.data_ptr()
        assert state[f"{name}.down_proj_scale_inv"].data_ptr() == s.data_ptr()
    assert_quantized_generation_matches(patched, reference, FP8_TIE_SPACINGS)


def test_deepseek_v3_fp8_quantized_at_patch_time():
    reference = deepseek_v3_fp8_dims()
    patched = copy.deepcopy(reference)
    assert lowbit_patch(patched, experts="fp8").experts == "fp8"
    state = patched.state_dict()
    for name, experts in _experts(reference, "DeepseekV3Experts").items():
        for proj in ("gate_up_proj", "down_proj"):
            codes, scale_inv = _fp8_quantize(getattr(experts, proj).detach())  # the checkpoints' convention
            assert torch.equal(state[f"{name}.{proj}"].view(torch.uint8), codes.view(torch.uint8))
            assert torch.equal(state[f"{name}.{proj}_scale_inv"], scale_inv)
    dequantize_patched_experts_into(reference, patched, "DeepseekV3Experts", _fp8_dequantize_state)
    assert_quantized_generation_matches(patched, reference, FP8_TIE_SPACINGS)


def test_deepseek_v3_fp8_experts_refuse_bf16():
    model = _fp8_checkpoint_model(deepseek_v3_fp8_dims())
    assert_refused_unmodified(model, "layer 1 experts: the model holds FP8 experts, experts='bf16'", experts="bf16")


# ---------------------------------------------------------------------------------------------------- GPU


def gpt_oss_20b_experts():
    """GPT-OSS-20b's layer dims (hidden 2880, 64 / 8 heads of 64, 32 experts of 2880, sinks, a sliding window of 128
    on every other layer) with 2 layers; every token to all 32 experts (ROUTED_TOKENS in tests/test_hf_models.py)."""
    return build_on_gpu(transformers.GptOssForCausalLM, transformers.GptOssConfig(
        vocab_size=GPU_VOCAB_SIZE, hidden_size=2880, intermediate_size=2880, num_hidden_layers=2,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=32,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 64, "truncate": False}))


def deepseek_v3_experts():
    """DeepSeek-V3's attention and expert dims (hidden 7168, experts of 2048), 8 experts, 2 layers."""
    return deepseek_v3_real_attention(moe_intermediate_size=2048)


@pytest.mark.gpu
@pytest.mark.parametrize("build,experts,experts_cls,dequantize,tie_spacings", [
    (gpt_oss_20b_experts, "mxfp4", "GptOssExperts", _mxfp4_dequantize, TIE_SPACINGS),
    (deepseek_v3_experts, "fp8", "DeepseekV3Experts", _fp8_dequantize_state, FP8_TIE_SPACINGS),
], ids=["gpt_oss_mxfp4", "deepseek_v3_fp8"])
def test_gpu_quantized_experts_generation_close_to_unpatched(build, experts, experts_cls, dequantize, tie_spacings):
    """Real expert widths: the experts quantized at patch time, the unpatched model on their dequantized weights;
    the first 16 greedy tokens of four left-padded prompts (tie-aware), logits cosine >= 0.99 per step."""
    reference = build()
    patched = copy.deepcopy(reference)
    assert lowbit_patch(patched, experts=experts).experts == experts
    dequantize_patched_experts_into(reference, patched, experts_cls, dequantize)
    want = gpu_generate(reference, new_tokens=GPU_QUANT_TOKENS)
    got = gpu_generate(patched, new_tokens=GPU_QUANT_TOKENS)
    assert_same_greedy_tokens(got, want, f"{build.__name__} {experts}", GPU_QUANT_TOKENS, QUANT_COSINE_MIN,
                              tie_spacings)
