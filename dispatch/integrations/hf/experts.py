"""Expert weights of patched MoE models in the formats lowbit's MoE GEMMs take, from what the model (or its
checkpoint) holds: planned first (every problem collected, nothing touched), converted only when the patch applies.

GPT-OSS MXFP4 (transformers' checkpoint format, `integrations/mxfp4.py`): per projection `<proj>_blocks` uint8
(E, N, K/32, 16), element 2i of a 32-block in the low nibble of byte i, and `<proj>_scales` uint8 E8M0 (E, N, K/32)
(value = e2m1 * 2^(s - 127)); rows N are the output features (gate_up: 2I rows, gate and up interleaved; down: H
rows), K the input features. That is `moe_gemm_mxfp4`'s linear layout ((E, N, K/2) codes is a view of the blocks);
the patched experts hold it prepacked once for `moe_gemm_fp4_prepacked` (a byte permutation, values unchanged).
Loaded with `Mxfp4Config(dequantize=True)` (and on every machine without the GPT-OSS Triton kernels, which
transformers then falls back to) the model holds bf16 `GptOssExperts` (E, K, N) parameters, the checkpoint's values
exactly; with `dequantize=False` it holds `Mxfp4GptOssExperts`, whose weights are the Triton kernels' swizzled
tensors (refused here: pass the checkpoint tensors as `expert_weights` instead).

DeepSeek-V3 FP8 (the checkpoint's `weight` E4M3 + `weight_scale_inv` fp32 per 128x128 block, value = code *
scale_inv): transformers' `FP8Experts` holds them merged per layer, `gate_up_proj` (E, 2I, H) with
`gate_up_proj_scale_inv` (E, 2I/128, H/128) and `down_proj` (E, H, I) with (E, H/128, I/128): `moe_gemm_fp8`'s
weight layout and decode-form block scales as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from triton_ops.contract.formats import MXFP4_BLOCK
from triton_ops.contract.moe_gemm import FP8_BLOCK

from ... import ops
from ...reference.moe_gemm import moe_gemm_fp4_unpack

E4M3_MAX = 448.0
# The checkpoint's blocks hold a 32-element MXFP4 block as 16 bytes.
MXFP4_BLOCK_BYTES = MXFP4_BLOCK // 2
# GPT-OSS's own quantizer (the Triton kernels' downcast) rounds the scale up: amax / 6 never saturates.
PATCH_TIME_MXFP4_ROUNDING = "rceil"
GPT_OSS_PROJECTIONS = ("gate_up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
    """Where a layer's expert weights come from: `source` "bf16" (the module's bf16 / fp16 parameters, used as
    they are), "quantize" (those parameters quantized to `weights` when the patch applies), "checkpoint" (the
    MXFP4 tensors of `expert_weights` under `prefix`), "module" (the module's own FP8 tensors)."""

    weights: str
    source: str
    prefix: str = ""


def held_format(experts: nn.Module) -> str:
    """What an experts module holds: "bf16" (bf16 / fp16 parameters), "fp8" (E4M3 + scale_inv), "mxfp4-swizzled"
    (transformers' Mxfp4GptOssExperts), or its weight dtype."""
    if getattr(experts, "gate_up_proj_precision_config", None) is not None:
        return "mxfp4-swizzled"
    dtype = experts.gate_up_proj.dtype
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype == torch.float8_e4m3fn and hasattr(experts, "gate_up_proj_scale_inv"):
        return "fp8"
    return str(dtype)


# ---------------------------------------------------------------------------------------------- GPT-OSS


def plan_gpt_oss(i: int, prefix: str, experts: nn.Module, want: str | None, expert_weights: Mapping | None,
                 problems: list[str]) -> ExpertsPlan | None:
    """The plan of GPT-OSS layer i's experts (module path `prefix`), or None with the reasons in `problems`."""
    held, where = held_format(experts), f"layer {i} experts"
    if want not in (None, "bf16", "mxfp4"):
        problems.append(f"{where}: experts={want!r} (GPT-OSS experts: 'bf16' or 'mxfp4')")
        return None
    if expert_weights is not None:
        if want == "bf16":
            problems.append(f"{where}: expert_weights given with experts='bf16' (they are MXFP4 checkpoint tensors)")
            return None
        return _plan_checkpoint(i, prefix, experts, expert_weights, problems)
    if held == "mxfp4-swizzled":
        problems.append(f"{where}: transformers' Mxfp4GptOssExperts (the Triton kernels' swizzled layout): load "
                        "with Mxfp4Config(dequantize=True) and pass the checkpoint's *_blocks / *_scales as "
                        "expert_weights")
        return None
    if held != "bf16":
        problems.append(f"{where}: dtype {held} (the expert GEMMs take bf16 / fp16 or MXFP4 weights)")
        return None
    if want == "mxfp4":
        if experts.gate_up_proj.dtype != torch.bfloat16:
            problems.append(f"{where}: MXFP4 experts take bf16 activations, the model is {experts.gate_up_proj.dtype}")
            return None
        return ExpertsPlan("mxfp4", "quantize")
    return ExpertsPlan("bf16", "bf16")


def _plan_checkpoint(i: int, prefix: str, experts: nn.Module, expert_weights: Mapping,
                     problems: list[str]) -> ExpertsPlan | None:
    e, hidden, two_i = experts.gate_up_proj_bias.shape[0], experts.down_proj_bias.shape[1], \
        experts.gate_up_proj_bias.shape[1]
    shapes = {"gate_up_proj": (e, two_i, hidden), "down_proj": (e, hidden, two_i // 2)}
    before = len(problems)
    for proj, (ne, n, k) in shapes.items():
        blocks, scales = expert_weights.get(f"{prefix}.{proj}_blocks"), expert_weights.get(f"{prefix}.{proj}_scales")
        if blocks is None or scales is None:
            problems.append(f"layer {i} experts: expert_weights has no {prefix}.{proj}_blocks / _scales")
            continue
        want_b, want_s = (ne, n, k // MXFP4_BLOCK, MXFP4_BLOCK_BYTES), (ne, n, k // MXFP4_BLOCK)
        if tuple(blocks.shape) != want_b or tuple(scales.shape) != want_s:
            problems.append(f"layer {i} experts: {proj}_blocks {tuple(blocks.shape)} / _scales "
                            f"{tuple(scales.shape)}, expected {want_b} / {want_s}")
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            problems.append(f"layer {i} experts: {proj}_blocks / _scales dtypes {blocks.dtype} / {scales.dtype}, "
                            "expected uint8 (packed E2M1 pairs, E8M0 bytes)")
    if experts.gate_up_proj_bias.dtype != torch.bfloat16:
        problems.append(f"layer {i} experts: MXFP4 experts take bf16 activations, the model is "
                        f"{experts.gate_up_proj_bias.dtype}")
    return ExpertsPlan("mxfp4", "checkpoint", prefix) if len(problems) == before else None


def mxfp4_quantize_experts(w: Tensor) -> tuple[Tensor, Tensor]:
    """bf16 (E, N, K) -> the checkpoint's (blocks (E, N, K/32, 16), scales (E, N, K/32)) via `ops.mxfp4_quantize`."""
    e, n, k = w.shape
    q = ops.mxfp4_quantize(w.reshape(e * n, k).contiguous(), rounding=PATCH_TIME_MXFP4_ROUNDING)
    return (q.codes.view(e, n, k // MXFP4_BLOCK, MXFP4_BLOCK_BYTES),
            q.scales.view(e, n, k // MXFP4_BLOCK))


class LowbitMxfp4Experts(nn.Module):
    """GPT-OSS experts as MXFP4 in the layout `moe_gemm_fp4_prepacked` takes: `<proj>_values` int32 (E, N, KP/8)
    and `<proj>_packed_scales` uint8 (E, N, SP), prepacked once here from the checkpoint's tensors (a byte
    permutation: `moe_gemm_fp4_prepack`). The state dict keeps the checkpoint's keys: `state_dict()` writes
    `<proj>_blocks` / `<proj>_scales` (the exact inverse permutation) beside `<proj>_bias`, and `load_state_dict`
    takes them and prepacks them again. One copy of the weights is held, the prepacked one."""

    def __init__(self, tensors: dict[str, Tensor], alpha: float, limit: float):
        super().__init__()
        self.in_features = {}  # proj -> K, what the inverse permutation needs (the values are padded to KP)
        for proj in GPT_OSS_PROJECTIONS:
            blocks = tensors[f"{proj}_blocks"]
            self.in_features[proj] = blocks.shape[-2] * MXFP4_BLOCK
            values, scales = _prepack(blocks, tensors[f"{proj}_scales"])
            self.register_buffer(f"{proj}_values", values, persistent=False)
            self.register_buffer(f"{proj}_packed_scales", scales, persistent=False)
            self.register_parameter(f"{proj}_bias", nn.Parameter(tensors[f"{proj}_bias"], requires_grad=False))
        self.alpha, self.limit = alpha, limit

    def prepacked(self, proj: str) -> tuple[Tensor, Tensor]:
        return getattr(self, f"{proj}_values"), getattr(self, f"{proj}_packed_scales")

    def checkpoint_tensors(self, proj: str) -> tuple[Tensor, Tensor]:
        """The projection's weights in the checkpoint's layout: (blocks (E, N, K/32, 16), scales (E, N, K/32))."""
        k = self.in_features[proj]
        codes, scales = moe_gemm_fp4_unpack(*self.prepacked(proj), k, "mxfp4")
        return codes.view(*codes.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK_BYTES), scales

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)  # the biases
        for proj in GPT_OSS_PROJECTIONS:
            blocks, scales = self.checkpoint_tensors(proj)
            destination[f"{prefix}{proj}_blocks"], destination[f"{prefix}{proj}_scales"] = blocks, scales

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        ours = set()
        for proj in GPT_OSS_PROJECTIONS:
            keys = (f"{prefix}{proj}_blocks", f"{prefix}{proj}_scales")
            if not all(key in state_dict for key in keys):
                missing_keys.extend(key for key in keys if key not in state_dict)
                continue
            ours.update(keys)
            e, n, blocks = *self.prepacked(proj)[0].shape[:2], self.in_features[proj] // MXFP4_BLOCK
            want = [(e, n, blocks, MXFP4_BLOCK_BYTES), (e, n, blocks)]
            got = [state_dict[key] for key in keys]
            if [tuple(t.shape) for t in got] != want:
                error_msgs.append(f"{prefix}{proj}: blocks / scales {[tuple(t.shape) for t in got]}, the module's "
                                  f"are {want}")
                continue
            for buffer, packed in zip(self.prepacked(proj), _prepack(*got), strict=True):
                buffer.copy_(packed)
        rest = {key: value for key, value in state_dict.items() if key not in ours}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _prepack(blocks: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """Checkpoint blocks (E, N, K/32, 16) and E8M0 scales (E, N, K/32) -> `moe_gemm_fp4_prepack`'s layout."""
    return ops.moe_gemm_fp4_prepack(blocks.flatten(-2), scales, "mxfp4")


def gpt_oss_mxfp4_experts(plan: ExpertsPlan, experts: nn.Module, expert_weights: Mapping | None
                          ) -> LowbitMxfp4Experts:
    """Build the MXFP4 experts of one layer from its plan (the checkpoint tensors as they are, or the module's
    bf16 (E, K, N) parameters quantized)."""
    tensors = {}
    for proj in GPT_OSS_PROJECTIONS:
        if plan.source == "checkpoint":
            blocks = expert_weights[f"{plan.prefix}.{proj}_blocks"]
            scales = expert_weights[f"{plan.prefix}.{proj}_scales"]
        else:
            blocks, scales = mxfp4_quantize_experts(getattr(experts, proj).detach().transpose(1, 2))
        bias = getattr(experts, f"{proj}_bias").detach()
        device = bias.device
        tensors |= {f"{proj}_blocks": blocks.to(device).contiguous(), f"{proj}_scales": scales.to(device).contiguous(),
                    f"{proj}_bias": bias.to(torch.bfloat16)}
    return LowbitMxfp4Experts(tensors, float(experts.alpha), float(experts.limit))


# ------------------------------------------------------------------------------------------ DeepSeek-V3


def plan_deepseek_v3(i: int, experts: nn.Module, want: str | None, problems: list[str]) -> ExpertsPlan | None:
    """The plan of DeepSeek-V3 layer i's routed experts, or None with the reasons in `problems`."""
    held, where = held_format(experts), f"layer {i} experts"
    if want not in (None, "bf16", "fp8"):
        problems.append(f"{where}: experts={want!r} (DeepSeek-V3 experts: 'bf16' or 'fp8')")
        return None
    if held not in ("bf16", "fp8"):
        problems.append(f"{where}: dtype {held} (the expert GEMMs take bf16 / fp16 or FP8 block-scaled weights)")
        return None
    if held == "fp8" and want == "bf16":
        problems.append(f"{where}: the model holds FP8 experts, experts='bf16' asked (dequantize them first)")
        return None
    if held == "bf16" and want != "fp8":
        return ExpertsPlan("bf16", "bf16")
    two_i, hidden = experts.gate_up_proj.shape[1:]
    before = len(problems)
    if hidden % FP8_BLOCK or two_i % (2 * FP8_BLOCK):
        problems.append(f"{where}: hidden {hidden} / intermediate {two_i // 2} (FP8 block-scaled experts need "
                        f"multiples of {FP8_BLOCK})")
    if held == "fp8":
        _fp8_module_problems(where, experts, problems)
    return ExpertsPlan("fp8", "module" if held == "fp8" else "quantize") if len(problems) == before else None


def _fp8_module_problems(where: str, experts: nn.Module, problems: list[str]) -> None:
    if tuple(getattr(experts, "block_size", None) or ()) != (FP8_BLOCK, FP8_BLOCK):
        problems.append(f"{where}: block_size {getattr(experts, 'block_size', None)} (lowbit's FP8 weights are "
                        f"{FP8_BLOCK}x{FP8_BLOCK} blocks)")
    if getattr(experts, "activation_scheme", "dynamic") != "dynamic":
        problems.append(f"{where}: activation_scheme {experts.activation_scheme!r} (activations are quantized "
                        "per 1x128 group on the fly: 'dynamic')")
    for proj in ("gate_up_proj", "down_proj"):
        w, s = getattr(experts, proj), getattr(experts, f"{proj}_scale_inv")
        want = (w.shape[0], -(-w.shape[1] // FP8_BLOCK), w.shape[2] // FP8_BLOCK)
        if tuple(s.shape) != want or s.dtype not in (torch.float32, torch.float8_e8m0fnu):
            problems.append(f"{where}: {proj}_scale_inv {tuple(s.shape)} {s.dtype}, expected {want} float32 or "
                            "float8_e8m0fnu")


def fp8_block_quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """(E, N, K) with N, K multiples of 128 -> E4M3 codes and fp32 `weight_scale_inv` (E, N/128, K/128), the
    checkpoints' convention as transformers' Fp8Quantize computes it: scale = 448 / amax (1 for an all-zero block),
    codes = e4m3(clamp(w * scale)), scale_inv = 1 / scale."""
    e, n, k = w.shape
    blocks = w.float().reshape(e, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, 1.0), 1.0)
    codes = (blocks * scale[:, :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.reshape(e, n, k), (1.0 / scale).float()


class LowbitFp8Experts(nn.Module):
    """DeepSeek-V3 routed experts as E4M3 + fp32 128x128 `scale_inv`, with transformers' FP8Experts names
    (`gate_up_proj`, `gate_up_proj_scale_inv`, `down_proj`, `down_proj_scale_inv`)."""

    def __init__(self, tensors: dict[str, Tensor]):
        super().__init__()
        for name, t in tensors.items():
            self.register_parameter(name, t if isinstance(t, nn.Parameter) else nn.Parameter(t, requires_grad=False))


def deepseek_v3_fp8_experts(plan: ExpertsPlan, experts: nn.Module) -> LowbitFp8Experts:
    """The module's own FP8 tensors (the same parameter objects; UE8M0 scales widened to fp32, exact), or its
    bf16 weights quantized to 128x128 blocks."""
    tensors = {}
    for proj in ("gate_up_proj", "down_proj"):
        if plan.source == "module":
            w, s = getattr(experts, proj), getattr(experts, f"{proj}_scale_inv")
            tensors |= {proj: w, f"{proj}_scale_inv": s if s.dtype == torch.float32 else s.detach().float()}
        else:
            codes, scale_inv = fp8_block_quantize(getattr(experts, proj).detach())
            tensors |= {proj: codes, f"{proj}_scale_inv": scale_inv}
    return LowbitFp8Experts(tensors)
