"""Torch twin of the grouped block-scaled GEMM (blockscaled_sm100.py): the bytes a GPU run must match.

Same arguments as the kernel (uint8 codes and swizzled scale bytes, int32 offsets, fp32 alpha), decoded with the
contract's own decoders (dispatch/reference/quant.py) and the scale layout of scale_layout.py:

    out[r, :] = bf16(alpha[g] * (dec(a[r]) @ dec(b[g]).T))    for offsets[g] <= r < offsets[g + 1]

fp32 products summed in fp32 (the UMMA accumulates in fp32; its summation order differs, so a GPU comparison needs
a tolerance of a few fp32 ulps of the row sums before the bf16 rounding, not bit equality). Rows in no group
keep `out`'s initial value (the kernel does not write them).
"""

from __future__ import annotations

import torch

from dispatch.reference.formats import e2m1_decode, unpack_nibbles
from dispatch.reference.quant import e8m0_decode

from .scale_layout import swizzled_offset

SF_VEC = {"nvfp4": 16, "mxfp4": 32}


def decode(codes: torch.Tensor, scales: torch.Tensor, fmt: str) -> torch.Tensor:
    """[rows, K/2] uint8 codes + their swizzled scale container (read flat) -> fp32 [rows, K]."""
    rows, k = codes.shape[0], codes.shape[1] * 2
    sf_vec = SF_VEC[fmt]
    kblocks = k // sf_vec
    r = torch.arange(rows, device=codes.device)[:, None]
    kb = torch.arange(kblocks, device=codes.device)[None, :]
    sbytes = scales.reshape(-1).view(torch.uint8)[swizzled_offset(r, kb, kblocks)]
    s = sbytes.view(torch.float8_e4m3fn).float() if fmt == "nvfp4" else e8m0_decode(sbytes)
    vals = e2m1_decode(unpack_nibbles(codes.view(torch.uint8))).reshape(rows, kblocks, sf_vec)
    return (vals * s[..., None]).reshape(rows, k)


def grouped_blockscaled_gemm(a, sfa, b, sfb, offsets, alpha, fmt: str, out: torch.Tensor | None = None):
    """a [M, K/2] u8, sfa [M, K4] u8 (swizzled), b [G, N, K/2] u8, sfb [G, N, K4] u8 (each group swizzled),
    offsets [G + 1] int32, alpha [G] fp32 -> out [M, N] bf16 (rows outside every group: out's values, or 0)."""
    m, (g, n, _) = a.shape[0], b.shape
    if out is None:
        out = torch.zeros(m, n, dtype=torch.bfloat16, device=a.device)
    a32 = decode(a, sfa, fmt)
    offs = [int(x) for x in offsets.tolist()]
    for e in range(g):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            w = decode(b[e], sfb[e], fmt)
            out[lo:hi] = (alpha[e].float() * (a32[lo:hi] @ w.T)).to(torch.bfloat16)
    return out
