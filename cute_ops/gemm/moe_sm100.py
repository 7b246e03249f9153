"""The `moe_gemm_blockscaled` / `moe_gemm_blockscaled_masked` / `moe_gemm_bf16` backends on sm_100: the CuTeDSL
tcgen05 grouped GEMM (cute_ops/gemm/blockscaled_sm100.py; block-scaled FP4, or dense bf16 / fp16 operands) behind the
ops' signatures.

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
`moe_gemm_bf16` (the contract of dispatch/reference/moe_gemm.py: contiguous m_indices or masked masked_m, optional
row_weights): groups as moe_sm90 builds them (contiguous_bounds / masked_starts), which start on any row; the kernel
is given each span aligned down to its 128-row tile (dense_bounds) and the group's own first row (`lo`), and writes a
row only inside [lo, end) and, contiguous, where m_indices[row] == g; rows are scaled by row_weights in the epilogue.
Anatomy: checks (triton_ops/contract/moe_gemm.py, run by the op) -> supports -> config and compile cache -> entry.
"""

from __future__ import annotations

import os

import torch

from triton_ops.contract.arch import arch_of, device_index, sm_count
from triton_ops.contract.moe_gemm import blockscaled_views

from .. import _compile
from .moe_sm90 import layout_groups, masked_starts

UNVERIFIED_ENV = "LOWBIT_CUTE_UNVERIFIED"
HARDWARE_STATUS = ("CuTeDSL sm_100a block-scaled grouped GEMM: compiled and SASS-checked in CI, never run on a "
                   f"Blackwell chip (set {UNVERIFIED_ENV}=1 to run it)")
DENSE_HARDWARE_STATUS = ("CuTeDSL sm_100a bf16 / fp16 grouped GEMM (tcgen05 UMMA): compiled and SASS-checked in CI, "
                         f"never run on a Blackwell chip (set {UNVERIFIED_ENV}=1 to run it)")
ARCHS = ("sm_100", "sm_103")
_DENSE = {torch.bfloat16: "bf16", torch.float16: "fp16"}
TILE_ROWS = 128  # the dense kernel's row tile (UMMA M)


def _unverified_device(a, status: str) -> str | None:
    """The gate every never-run sm_100 row shares: the opt-in, then an sm_100 / sm_103 CUDA device."""
    if os.environ.get(UNVERIFIED_ENV) != "1":
        return status
    if a.device.type != "cuda" or arch_of(a.device) not in ARCHS:
        return f"tcgen05 kernel: needs an sm_100 / sm_103 GPU, got {arch_of(a.device)}"
    return None


def _supports(a, a_scale, b, b_scale, fmt, rows: int, rows_per_group: int | None, what: str) -> str | None:
    """Why the kernel cannot take a call whose group starts are multiples of `rows` (None: it can): the chip, the
    static sizes, and `rows` a multiple of the tile's rows (so no tile reads past its group's allocation)."""
    why = _unverified_device(a, HARDWARE_STATUS)
    if why is not None:
        return why
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
        index = device_index(a2.device)
        cfg = config(fmt, n, 2 * kh, g, rows_per_group, sm_count(index), _compile.target_arch(index))
        _compile.launch(compiled(cfg), a2, b, a_scale, b_scale, out, starts, counts, alpha.contiguous(), None, None,
                        None, device=a2.device)
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


# ------------------------------------------------------------------------- moe_gemm_bf16 (dense operands)


def dense_tile_n(n: int, rows_per_group: int) -> int:
    """Analytical: 256 output columns per tile when N allows and groups fill a 128-row tile, else 128."""
    return 256 if n % 256 == 0 and rows_per_group >= TILE_ROWS else 128


def dense_config(a, w, masked: bool, row_weights: bool, sms: int = 148, arch: str = "sm_100a"):
    """The kernel config of a moe_gemm_bf16 call (M / E rows per group for the contiguous layout)."""
    from .blockscaled_sm100 import pick_config

    e, n, k = w.shape
    per_group = a.shape[1] if masked else a.shape[0] // max(1, e)
    return pick_config(_DENSE[a.dtype], n, k, e, tile_n=dense_tile_n(n, per_group), sm_count=sms, arch=arch,
                       m_indices=not masked, row_weights=row_weights)


def supports_moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None) -> str | None:
    """Why the sm_100 kernel cannot take this call (None: it can): the opt-in and chip, 16-bit operands of one dtype,
    contiguous and 16-byte aligned (one TMA descriptor each), N a multiple of the column tile."""
    why = _unverified_device(a, DENSE_HARDWARE_STATUS)
    if why is not None:
        return why
    if a.dtype not in _DENSE or w.dtype != a.dtype:
        return f"a {a.dtype} / w {w.dtype}: bf16 or fp16, both the same"
    if not a.is_contiguous() or not w.is_contiguous() or a.data_ptr() % 16 or w.data_ptr() % 16:
        return "a and w must be contiguous and 16-byte aligned (one TMA descriptor each)"
    from .blockscaled_sm100 import can_implement

    e, n, k = w.shape
    return can_implement(_DENSE[a.dtype], n, k, e, 128)


def dense_bounds(starts: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's groups: each non-empty span [start, start + count) widened down to its 128-row tile boundary
    (same end), so every tile is a tile coordinate of the one A descriptor. Device ops only."""
    head = starts % TILE_ROWS
    return (starts - head).contiguous(), torch.where(counts > 0, counts + head, 0).to(torch.int32).contiguous()


def moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None):
    """out in a's dtype: row r of group g = row_weights[r] * a[r] @ w[g].T (fp32 accumulation); contiguous
    (M, K) with m_indices or masked (E, max_m, K) with masked_m; rows no group writes are 0."""
    e, n, k = w.shape
    masked = masked_m is not None
    a2, ids, starts, counts = layout_groups(a, w, m_indices, masked_m)
    out = torch.zeros(a2.shape[0], n, dtype=a.dtype, device=a.device)
    if a2.shape[0] and n:
        index = device_index(a.device)
        cfg = dense_config(a, w, masked, row_weights is not None, sm_count(index), _compile.target_arch(index))
        rw = None if row_weights is None else row_weights.reshape(-1).contiguous()
        tile_starts, tile_counts = dense_bounds(starts, counts)
        _compile.launch(compiled(cfg), a2, w, None, None, out, tile_starts, tile_counts, None, starts.contiguous(),
                        ids, rw, device=a.device)
    return out.view(*a.shape[:-1], n)
