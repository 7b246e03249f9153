"""The `moe_gemm_blockscaled` / `moe_gemm_blockscaled_masked` backends on sm_100: the CuTeDSL tcgen05 block-scaled
grouped GEMM (cute_ops/gemm/blockscaled_sm100.py) behind the ops' signatures.

Compiled and SASS-checked in CI for sm_100a; never run on a Blackwell chip, so the supports functions refuse it
unless LOWBIT_CUTE_UNVERIFIED=1 (the rule every never-run CuTe row follows, docs/cute.md). What runs on other chips
is the contract reference (dispatch/reference/moe_gemm.py).

Layouts -> the kernel's groups (starts[g], counts[g]), built on the device (no host sync; graph-safe), as the sm_90
launcher (moe_sm90.py) builds them:
* offsets [G + 1]: clamped to [0, M] and made non-decreasing (the contract), starts = offsets[:-1], counts = the
  differences.
* masked (E, max_m, K/2): a viewed as (E * max_m, K/2); starts = g * max_m (a cached constant), counts =
  clamp(masked_m, 0, max_m). max_m a multiple of the tile's rows, so no tile reads past its group's rows.
The config (pick_config) takes the swap-AB variant when a group holds at most 64 rows (masked max_m, or M / G).
Anatomy: checks (triton_ops/contract/moe_gemm.py, run by the op) -> supports -> config and compile cache -> entry.
"""

from __future__ import annotations

import os

import torch

from triton_ops.contract.arch import arch_of, sm_count
from triton_ops.contract.moe_gemm import blockscaled_views

from .. import _compile
from .moe_sm90 import masked_starts

UNVERIFIED_ENV = "LOWBIT_CUTE_UNVERIFIED"
HARDWARE_STATUS = ("CuTeDSL sm_100a block-scaled grouped GEMM: compiled and SASS-checked in CI, never run on a "
                   f"Blackwell chip (set {UNVERIFIED_ENV}=1 to run it)")
ARCHS = ("sm_100", "sm_103")


def _supports(a, a_scale, b, b_scale, fmt, rows: int, rows_per_group: int | None, what: str) -> str | None:
    """Why the kernel cannot take a call whose group starts are multiples of `rows` (None: it can): the chip, the
    static sizes, and `rows` a multiple of the tile's rows (so no tile reads past its group's allocation)."""
    if os.environ.get(UNVERIFIED_ENV) != "1":
        return HARDWARE_STATUS
    if a.device.type != "cuda" or arch_of(a.device) not in ARCHS:
        return f"tcgen05 kernel: needs an sm_100 / sm_103 GPU, got {arch_of(a.device)}"
    if not all(t.is_contiguous() for t in (a, a_scale, b, b_scale)):
        return "operands must be contiguous (one TMA descriptor each)"
    from .blockscaled_sm100 import can_implement

    g, n, kh = b.shape
    why = can_implement(fmt, n, 2 * kh, g)
    if why is not None:
        return why
    tile_rows = config(fmt, n, 2 * kh, g, rows_per_group, 148, "sm_100a").rows_per_tile
    if rows % tile_rows:
        return f"{what}={rows} is not a multiple of {tile_rows} (the rows of this call's tiles)"
    return None


def supports_moe_gemm_blockscaled(a, a_scale, b, b_scale, offsets, alpha, fmt) -> str | None:
    """Why the sm_100 kernel cannot take this call (None: it can). M a multiple of 128: moe_align with block_m=128
    gives such layouts (its offsets too, which the kernel reads on the device and does not check)."""
    return _supports(a, a_scale, b, b_scale, fmt, a.shape[0], None, "M")


def supports_moe_gemm_blockscaled_masked(a, a_scale, b, b_scale, masked_m, alpha, fmt) -> str | None:
    """Why the sm_100 kernel cannot take this masked call (None: it can): max_m a multiple of the tile's rows (128,
    or the swap-AB token tile the rule picks for it)."""
    return _supports(a, a_scale, b, b_scale, fmt, a.shape[1], a.shape[1], "max_m")


def config(fmt: str, n: int, k: int, num_groups: int, rows_per_group: int | None, sms: int, arch: str):
    """The kernel config of a call: swap-AB for groups of at most SWAP_MAX_ROWS rows (pick_config's rule)."""
    from .blockscaled_sm100 import pick_config

    return pick_config(fmt, n, k, num_groups, sm_count=sms, arch=arch, rows_per_group=rows_per_group)


def compiled(cfg):
    """The TVM-FFI callable for `cfg` (compiled once per process, cached on disk)."""
    from .blockscaled_sm100 import build

    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def offsets_bounds(offsets: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, counts) int32 [G] of group offsets [G + 1], clamped as the contract says (to [0, M], each raised to
    the largest before it). Device ops only: no host sync, graph-safe."""
    offs = torch.cummax(offsets.to(torch.int64).clamp(0, m), 0).values
    return offs[:-1].to(torch.int32).contiguous(), (offs[1:] - offs[:-1]).to(torch.int32).contiguous()


def _launch(a2, a_scale, b, b_scale, starts, counts, alpha, fmt, rows_per_group):
    """out [rows, N] bf16 (zeros where no group writes) from the kernel over groups (starts, counts)."""
    g, n, kh = b.shape
    out = torch.zeros(a2.shape[0], n, dtype=torch.bfloat16, device=a2.device)
    if a2.shape[0] and n:
        index = a2.device.index if a2.device.index is not None else torch.cuda.current_device()
        cfg = config(fmt, n, 2 * kh, g, rows_per_group, sm_count(index), _compile.target_arch(index))
        with torch.cuda.device(a2.device):  # the TVM-FFI env stream is the current device's current stream
            compiled(cfg)(a2, b, a_scale, b_scale, out, starts, counts, alpha.contiguous())
    return out


def moe_gemm_blockscaled(a, a_scale, b, b_scale, offsets, alpha, fmt):
    """out [M, N] bf16: rows of group g = alpha[g] * dec(a) @ dec(b[g]).T; rows in no group are 0."""
    a, a_scale, b, b_scale = blockscaled_views(a, a_scale, b, b_scale)
    starts, counts = offsets_bounds(offsets, a.shape[0])
    return _launch(a, a_scale, b, b_scale, starts, counts, alpha, fmt, None)


def moe_gemm_blockscaled_masked(a, a_scale, b, b_scale, masked_m, alpha, fmt):
    """out [E, max_m, N] bf16: rows r < clamp(masked_m[e], 0, max_m) of expert e = alpha[e] * dec(a[e, r]) @
    dec(b[e]).T; other rows 0. Groups: starts = e * max_m (a cached constant), counts = the clamped masked_m."""
    e, max_m, kh = a.shape
    a2, a_scale, b, b_scale = blockscaled_views(a.reshape(e * max_m, kh), a_scale, b, b_scale)
    counts = masked_m.to(torch.int32).clamp(0, max_m).contiguous()
    out = _launch(a2, a_scale, b, b_scale, masked_starts(e, max_m, a.device), counts, alpha, fmt, max_m)
    return out.view(e, max_m, b.shape[1])
