"""The `moe_gemm_blockscaled` backend on sm_100: the CuTeDSL tcgen05 block-scaled grouped GEMM
(cute_ops/gemm/blockscaled_sm100.py) behind the op's signature.

Compiled and SASS-checked in CI for sm_100a; never run on a Blackwell chip, so `supports_moe_gemm_blockscaled`
refuses it unless LOWBIT_CUTE_UNVERIFIED=1 (the rule every never-run CuTe row follows, docs/cute.md). What runs on
other chips is the contract reference (dispatch/reference/moe_gemm.py `grouped_blockscaled_gemm`).
Anatomy: checks (triton_ops/contract/moe_gemm.py `check_blockscaled`, run by the op) -> supports -> config and
compile cache -> entry.
"""

from __future__ import annotations

import os

import torch

from triton_ops.contract.arch import arch_of, sm_count
from triton_ops.contract.moe_gemm import blockscaled_views

from .. import _compile

UNVERIFIED_ENV = "LOWBIT_CUTE_UNVERIFIED"
HARDWARE_STATUS = ("CuTeDSL sm_100a block-scaled grouped GEMM: compiled and SASS-checked in CI, never run on a "
                   f"Blackwell chip (set {UNVERIFIED_ENV}=1 to run it)")
ARCHS = ("sm_100", "sm_103")
ROW_ALIGN = 128  # group offsets and M: multiples of the UMMA tile's rows (the scale atom)


def supports_moe_gemm_blockscaled(a, a_scale, b, b_scale, offsets, alpha, fmt) -> str | None:
    """Why the sm_100 kernel cannot take this call (None: it can)."""
    if os.environ.get(UNVERIFIED_ENV) != "1":
        return HARDWARE_STATUS
    if a.device.type != "cuda" or arch_of(a.device) not in ARCHS:
        return f"tcgen05 kernel: needs an sm_100 / sm_103 GPU, got {arch_of(a.device)}"
    from .blockscaled_sm100 import can_implement

    g, n, kh = b.shape
    why = can_implement(fmt, n, 2 * kh, g)
    if why is not None:
        return why
    if a.shape[0] % ROW_ALIGN:
        return f"M={a.shape[0]} is not a multiple of {ROW_ALIGN} (moe_align with block_m=128 gives such layouts)"
    if not all(t.is_contiguous() for t in (a, a_scale, b, b_scale)):
        return "operands must be contiguous (one TMA descriptor each)"
    return None


def compiled(fmt: str, n: int, k: int, num_groups: int, index: int):
    """The TVM-FFI callable for this problem's static sizes (compiled once per process, cached on disk)."""
    from .blockscaled_sm100 import build, pick_config

    cfg = pick_config(fmt, n, k, num_groups, sm_count=sm_count(index),
                      arch=_compile.target_arch(index))
    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def moe_gemm_blockscaled(a, a_scale, b, b_scale, offsets, alpha, fmt):
    """out [M, N] bf16: rows of group g = alpha[g] * dec(a) @ dec(b[g]).T; rows in no group are 0."""
    a, a_scale, b, b_scale = blockscaled_views(a, a_scale, b, b_scale)
    g, n, kh = b.shape
    out = torch.zeros(a.shape[0], n, dtype=torch.bfloat16, device=a.device)
    if a.shape[0] and n:
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        fn = compiled(fmt, n, 2 * kh, g, index)
        with torch.cuda.device(a.device):  # the TVM-FFI env stream is the current device's current stream
            fn(a, b, a_scale, b_scale, out, offsets.contiguous(), alpha.contiguous())
    return out
