"""CuTeDSL backends of `lowbit::moe_gemm_bf16` / `moe_gemm_fp8` on sm_90: the grouped WGMMA GEMM of grouped_sm90.py.

Contract: dispatch/reference/moe_gemm.py (docs/moe_gemm.md); same signature as the op minus `backend`.
Runs on the H100 and the H200 (HARDWARE_STATUS); `auto` takes it where it was timed faster than the Triton kernel
(auto_skip_bf16 / auto_skip_fp8), backend="cute" forces it.

Layouts -> the kernel's groups (starts[g], counts[g]), built on the device (no host sync; graph-safe):
* masked (E, max_m, K): a viewed as (E * max_m, K); starts = g * max_m (a cached constant), counts =
  clamp(masked_m, 0, max_m).
* contiguous (M, K) with m_indices: group g spans [first row with id g, last row with id g]; the kernel writes a
  row of that span only where m_indices[row] == g, so padding (-1), out-of-range ids and any interleaving stay
  correct (an interleaved layout only costs MMA work on rows that are then not written).
Rows no group writes are 0: the kernel writes them (the output is allocated uninitialized).
"""

from __future__ import annotations

import os

import torch

from triton_ops.contract.arch import device_index
from triton_ops.contract.arch import sm_count as _sm_count  # module attribute: tests stub it
from triton_ops.contract.moe_gemm import FP8_BLOCK

from .. import _compile
from .grouped_sm90_config import FP8_PREFILL_WIDE, FP8_PREFILL_WIDE_ROWS, pick_config

UNVERIFIED_ENV = "LOWBIT_CUTE_UNVERIFIED"
HARDWARE_STATUS = "CuTeDSL sm_90 grouped GEMM: its GPU tests pass on an H100 and an H200 (docs/cute.md)"
# Where auto takes the kernel (docs/cute.md and docs/moe_gemm.md, Measured): FP8 prefill is well ahead of the
# Triton kernel, whose per-K-step scaling drains the MMA pipeline; bf16 only pulls ahead at 512 rows per expert;
# decode streams the weights, where Triton is at the copy roof.
PREFILL_ROWS_PER_EXPERT = 128  # FP8: auto takes the cute kernel from here (timed at 256 and 512); below, Triton
BF16_ROWS_PER_EXPERT = 512  # bf16: auto takes it from here (faster than Triton at 512; about even at 256)
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _rows_per_expert(a, masked_m, w) -> int:
    return a.shape[1] if masked_m is not None else a.shape[0] // max(1, w.shape[0])


def auto_skip_bf16(a, w, m_indices, masked_m, *rest) -> str | None:
    """auto_skip of the bf16 row: auto takes it from BF16_ROWS_PER_EXPERT rows per expert (timed faster than
    Triton there); below, the two were within a few percent of each other across runs, and Triton stays."""
    if os.environ.get(UNVERIFIED_ENV) == "1" or _rows_per_expert(a, masked_m, w) >= BF16_ROWS_PER_EXPERT:
        return None
    return (f"cute moe_gemm_bf16: under {BF16_ROWS_PER_EXPERT} rows per expert the Triton kernel was as fast "
            "(H100)")


def auto_skip_fp8(a, a_scale, w, w_scale, m_indices, masked_m, *rest) -> str | None:
    """auto_skip of the FP8 row: auto takes it for prefill-sized groups (faster than Triton there); decode sizes,
    untimed for it, stay on Triton (at the copy roof there)."""
    if os.environ.get(UNVERIFIED_ENV) == "1" or _rows_per_expert(a, masked_m, w) >= PREFILL_ROWS_PER_EXPERT:
        return None
    return (f"cute moe_gemm_fp8: under {PREFILL_ROWS_PER_EXPERT} rows per expert (decode), not timed; Triton is at "
            "the copy roof there")


def _supports(a, w) -> str | None:
    if a.device.type != "cuda":
        return "the cute backend runs on CUDA tensors only"
    n, k = w.shape[1], w.shape[2]
    if k == 0:
        return "K = 0 (nothing to reduce; the TMA descriptors need a non-empty K)"
    if k * a.element_size() % 16 or n % 8:
        return f"N={n}, K={k}: rows of a and w must be multiples of 16 bytes (TMA), N a multiple of 8"
    if not a.is_contiguous() or not w.is_contiguous():
        return "a and w must be contiguous (one TMA descriptor pitch for every group)"
    if a.data_ptr() % 16 or w.data_ptr() % 16:
        return "a and w must be 16-byte aligned (TMA)"
    if w.shape[0] < 1:
        return "needs at least one expert"
    return None


def supports_moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None) -> str | None:
    if a.dtype not in _DTYPES or w.dtype != a.dtype:
        return f"a {a.dtype} / w {w.dtype}: bf16 or fp16, both the same"
    return _supports(a, w)


def supports_moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m, row_weights=None) -> str | None:
    if a.dtype != torch.float8_e4m3fn or w.dtype != torch.float8_e4m3fn:
        return f"a {a.dtype} / w {w.dtype}: only E4M3 (float8_e4m3fn)"
    if a.shape[-1] % FP8_BLOCK:
        return f"K={a.shape[-1]} is not a multiple of {FP8_BLOCK}"
    return _supports(a, w)


_MASKED_STARTS: dict = {}


def masked_starts(e: int, max_m: int, device: torch.device) -> torch.Tensor:
    """g * max_m for g < E (int32), one cached constant per (E, max_m, device): never written, so graph-safe."""
    key = (e, max_m, device)
    t = _MASKED_STARTS.get(key)
    if t is None:
        t = torch.arange(e, dtype=torch.int32, device=device) * max_m
        # never keep a tensor of a graph's private pool
        if torch.device(device).type != "cuda" or not torch.cuda.is_current_stream_capturing():
            _MASKED_STARTS[key] = t
    return t


def contiguous_bounds(m_indices: torch.Tensor, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, counts) int32 [E] of the contiguous layout: the span from the first to the last row of each expert
    (an expert without rows: count 0). Device ops only (scatter_reduce), no host sync."""
    ids = m_indices.reshape(-1).to(torch.int64)
    rows = ids.numel()
    slot = torch.where((ids >= 0) & (ids < e), ids, e)  # everything else lands in a dropped slot E
    r = torch.arange(rows, dtype=torch.int64, device=ids.device)
    first = torch.full((e + 1,), rows, dtype=torch.int64, device=ids.device).scatter_reduce_(0, slot, r, "amin")
    last = torch.full((e + 1,), -1, dtype=torch.int64, device=ids.device).scatter_reduce_(0, slot, r, "amax")
    counts = (last - first + 1).clamp_min_(0)[:e].to(torch.int32)
    starts = first.clamp_max_(max(rows - 1, 0))[:e].to(torch.int32)
    return starts, counts


def config_for(kind: str, a, w, layout: str, row_weights: bool, arch: str, sm_count: int, tiles: dict | None = None):
    """The kernel config for a call; `tiles` (tile_m / tile_n / stages / ...) overrides the analytical rule. With no
    `tiles`, contiguous FP8 prefill (>= FP8_PREFILL_WIDE_ROWS rows per group, N a multiple of 256) takes
    FP8_PREFILL_WIDE (the masked layout's rows per group is its capacity, not its rows: it keeps 128 x 128); any
    `tiles` replaces that choice as a whole."""
    e, n, k = w.shape
    per_group = a.shape[1] if layout == "masked" else max(1, a.shape[0] // e)
    wide_ok = per_group >= FP8_PREFILL_WIDE_ROWS and n % 256 == 0
    if tiles is None and kind == "fp8" and layout == "contiguous" and wide_ok:
        tiles = FP8_PREFILL_WIDE
    return pick_config(kind, n, k, e, layout, row_weights, per_group, sm_count=sm_count, arch=arch, **(tiles or {}))


def compiled(cfg):
    """The TVM-FFI callable for `cfg` (compiled once per process, loaded from disk when cached)."""
    from .grouped_sm90 import build

    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def layout_groups(a, w, m_indices, masked_m):
    """(a as (rows, K), int32 row ids or None, group starts, group counts) of a contiguous (m_indices) or masked
    (masked_m) layout, as the grouped kernels take them. Device ops only."""
    e, k = w.shape[0], a.shape[-1]
    if masked_m is not None:
        max_m = a.shape[1]
        return a.view(e * max_m, k), None, masked_starts(e, max_m, a.device), masked_m.to(torch.int32).clamp(0, max_m)
    ids = m_indices.to(torch.int32).contiguous()
    return (a, ids, *contiguous_bounds(ids, e))


def _run(kind, a, w, m_indices, masked_m, row_weights, a_scale=None, w_scale=None, out_dtype=None, tiles=None):
    e, n, k = w.shape
    dev = a.device
    masked = masked_m is not None
    a2, ids, starts, counts = layout_groups(a, w, m_indices, masked_m)
    rows = a2.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype or a.dtype, device=dev)  # the kernel writes every row
    if rows and n:
        index = device_index(dev)
        cfg = config_for(kind, a, w, "masked" if masked else "contiguous", row_weights is not None,
                         _compile.target_arch(index), _sm_count(index), tiles)
        fn = compiled(cfg)
        rw = None if row_weights is None else row_weights.reshape(-1).contiguous()
        if kind == "fp8":  # (rows, K/128) in whatever strides it has (a copy only for an unmergeable 3-D view)
            a_scale = a_scale.reshape(rows, k // FP8_BLOCK)
            w_scale = w_scale.contiguous()
        # descriptor slots: rewritten by the kernel before use; zeroed so bytes past what the DSL copies (it copies
        # the first 64 of each 128-byte descriptor) are defined
        workspace = torch.zeros(cfg.workspace_words, dtype=torch.int64, device=dev)
        _compile.launch(fn, a2, w, out, starts, counts.contiguous(), ids, rw, workspace, a_scale, w_scale, device=dev)
    return out.view(*a.shape[:-1], n)


# ------------------------------------------------------------------------- backend entry points
# Same signatures as the torch ops in dispatch/ops/moe_gemm.py, minus `backend`.


def moe_gemm_bf16(a, w, m_indices, masked_m, row_weights=None, *, tiles: dict | None = None):
    """tiles: {tile_m, tile_n, stages} overrides for tuning (the dispatcher never passes it)."""
    return _run(_DTYPES[a.dtype], a, w, m_indices, masked_m, row_weights, tiles=tiles)


def moe_gemm_fp8(a, a_scale, w, w_scale, m_indices, masked_m, row_weights=None, *, tiles: dict | None = None):
    # E4M3 codes travel as bytes (the kernel types them): TVM-FFI checks byte tensors like any other
    return _run("fp8", a.view(torch.uint8), w.view(torch.uint8), m_indices, masked_m, row_weights, a_scale, w_scale,
                torch.bfloat16, tiles)
