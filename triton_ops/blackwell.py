"""Blackwell-only device helpers (sm_100a / sm_103a / sm_120a / sm_121a).

`e2m1x2_hw(lo, hi)`: two fp32 values -> one E2M1 pair byte (lo in the low nibble, as every lowbit FP4 format stores
element 2i) with the hardware conversion `cvt.rn.satfinite.e2m1x2.f32` (PTX ISA 8.6+), one SASS instruction
(`F2FP.SATFINITE.E2M1.F32.PACK_AB_MERGE_C`) per pair where the software encoders spend ~7 (`_formats.fp4_encode_pairs`)
to ~20 (`_formats.e2m1_encode`) integer/fp32 instructions per element. ptxas refuses it before
Blackwell ("Feature 'cvt.e2m1x2.f32' not supported on .target 'sm_90a'") and the interpreter cannot run inline PTX,
so a kernel may only reach it behind a constexpr its launcher sets from the arch: `HW_FP4 = hw_fp4(device)` (sm_100
or newer; False on the interpreter and before Blackwell). Wired into the FP4 encode of the quantize kernels and the
fused RMSNorm / SwiGLU FP4 epilogues (`_formats.fp4_encode_pairs` / `fp4_encode_exact`): docs/blackwell.md.

Rounding (PTX ISA `cvt`, and the host model in CUDA's cuda_fp4.hpp): round to nearest even on the E2M1 grid
(0, 0.5, 1, 1.5, 2, 3, 4, 6), magnitudes above 6 (and +-Inf) saturate to +-6, the sign is kept (-0.1 -> 0x8), and NaN
becomes +6 (0x7, "positive MAXNORM"). The lowbit contract (dispatch/reference/formats.py `e2m1_encode`) is the same
on every non-NaN fp32 input and writes NaN as 0x0: tests/test_blackwell_compile.py compares a torch model of the
instruction with the reference on every bf16-representable fp32 value and the fp32 neighbours of each rounding tie.
Nothing here has run on a Blackwell GPU: the SASS is checked by compiling for each arch on a CPU machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.contract.arch import arch_at_least, arch_of

# Archs with the e2m1x2 conversion (sm_100a, sm_103a, sm_120a, sm_121a; the 'a' targets Triton compiles for).
HW_E2M1_ARCHS = ("sm_100", "sm_103", "sm_120", "sm_121")
# What the instruction writes for a NaN input (the reference writes 0x0: see the module docstring).
HW_E2M1_NAN_CODE = 0x7


def hw_fp4(device: torch.device) -> bool:
    """The FP4 kernels' HW_FP4 constexpr: True where the device's arch is sm_100 or newer (the e2m1x2 convert);
    False on host tensors (the interpreter cannot run inline PTX) and on every arch before Blackwell (sm_90a's
    ptxas refuses the instruction)."""
    return arch_at_least(arch_of(device), "sm_100")


@triton.jit
def e2m1x2_hw(lo, hi):
    """fp32 lo, hi (same shape) -> uint8 pair byte (code(hi) << 4) | code(lo), one cvt.rn.satfinite.e2m1x2.f32 each.
    The instruction puts its first source in the high nibble, so hi goes first."""
    word = tl.inline_asm_elementwise(
        "{ .reg .b8 pair; cvt.rn.satfinite.e2m1x2.f32 pair, $2, $1; cvt.u32.u8 $0, pair; }",
        "=r,f,f", [lo.to(tl.float32), hi.to(tl.float32)], dtype=tl.int32, is_pure=True, pack=1)
    return word.to(tl.uint8)


@triton.jit
def _e2m1x2_pack_kernel(x_ptr, out_ptr, n_pairs, BLOCK: tl.constexpr):
    """out[i] = e2m1x2_hw(x[2i], x[2i + 1]) over a flat fp32 buffer."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_pairs
    pair = tl.load(x_ptr.to(tl.pointer_type(tl.int64)) + offs, mask=mask, other=0)  # (x[2i], x[2i+1]) as one word
    lo = pair.to(tl.int32).to(tl.float32, bitcast=True)
    hi = (pair >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, e2m1x2_hw(lo, hi), mask=mask)


E2M1X2_PACK_BLOCK = 1024


def e2m1x2_pack_hw(x: torch.Tensor) -> torch.Tensor:
    """Contiguous fp32 CUDA tensor with an even element count -> uint8 pair bytes by the hardware conversion (sm_100+
    only). For checking the instruction against the reference on a Blackwell GPU (the ops reach the instruction
    through `_formats.fp4_encode_pairs`, not through this)."""
    if (x.dtype != torch.float32 or not x.is_contiguous() or x.numel() % 2 or x.device.type != "cuda"
            or x.data_ptr() % 8):
        raise ValueError("e2m1x2_pack_hw: expected a contiguous, 8-byte aligned fp32 CUDA tensor with an even number "
                         "of elements")
    out = torch.empty(x.numel() // 2, dtype=torch.uint8, device=x.device)
    if out.numel():
        grid = (triton.cdiv(out.numel(), E2M1X2_PACK_BLOCK),)
        _e2m1x2_pack_kernel[grid](x, out, out.numel(), BLOCK=E2M1X2_PACK_BLOCK, num_warps=4)
    return out
