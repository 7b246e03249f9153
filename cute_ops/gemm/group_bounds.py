"""The row bounds (starts[g], counts[g]) of a grouped GEMM's groups, built on the device by one small kernel
(_group_bounds_kernel.py), for the CuTe grouped GEMMs' two layouts:

* contiguous (M, K) rows with m_indices [M]: group g spans [first row with id g, last row with id g]; an expert
  without rows gets count 0 and start max(M - 1, 0). The GEMM kernels write a row of a span only where
  m_indices[row] == g, so padding (-1), out-of-range ids and interleaved experts stay correct.
* masked (E, max_m, K) with masked_m [E]: start = g * max_m, count = clamp(masked_m[g], 0, max_m).

One launch also zeroes the GEMM's descriptor workspace. Why a kernel: the same bounds as torch ops took ~28 calls
per GEMM (a diff, edge masks, two scatter-reduces, clamps and casts), and on the H200's host each costs more than
the launch itself: the eager grouped GEMM at 32 x 128 rows spent 815 us of host time for 316 us of GPU time
(docs/moe_gemm.md). No host sync, graph-safe; rows and groups are symbolic (one compile per layout, workspace and
arch). The kernel's Python model is in tests/test_cute_gemm_sm90.py.
"""

from __future__ import annotations

import dataclasses

import torch

from triton_ops.contract.arch import device_index

from .. import _compile

LAYOUTS = ("contiguous", "masked")


@dataclasses.dataclass(frozen=True)
class BoundsConfig:
    layout: str  # LAYOUTS
    workspace: bool  # also zero an int64 workspace
    arch: str  # compile target, e.g. "sm_90a"

    def key(self) -> tuple:
        return ("group_bounds", 1, self.layout, self.workspace, self.arch)


def _fake_args(cfg: BoundsConfig):
    import cutlass
    import cutlass.cute as cute

    def vector(dtype, n, align=4):
        return cute.runtime.make_fake_tensor(dtype, (n,), stride=(1,), assumed_align=align)

    groups = cute.sym_int()
    src = vector(cutlass.Int32, cute.sym_int() if cfg.layout == "contiguous" else groups)
    workspace = vector(cutlass.Int64, cute.sym_int(), 8) if cfg.workspace else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return src, vector(cutlass.Int32, groups), vector(cutlass.Int32, groups), workspace, cutlass.Int32(0), stream


def build(cfg: BoundsConfig, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached)."""
    import cutlass.cute as cute

    from ._group_bounds_kernel import GroupBounds  # imports nvidia-cutlass-dsl

    return cute.compile(GroupBounds(cfg), *_fake_args(cfg),
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def compiled(cfg: BoundsConfig):
    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def dump(cfg: BoundsConfig):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from .._sass import compile_and_dump

    return compile_and_dump(lambda extra: build(cfg, extra))


def layout_groups(a, w, m_indices, masked_m, workspace_words: int = 0):
    """(a as (rows, K), int32 row ids or None, starts [E], counts [E], zeroed int64 workspace [workspace_words] or
    None) of a contiguous (m_indices) or masked (masked_m) layout, as the grouped kernels take them. a is on CUDA."""
    e, k = w.shape[0], a.shape[-1]
    dev = a.device
    if masked_m is not None:
        max_m = a.shape[1]
        a2, ids, src, layout = a.reshape(e * max_m, k), None, masked_m.to(torch.int32).contiguous(), "masked"
    else:
        max_m = 0
        ids = m_indices.to(torch.int32).contiguous()
        a2, src, layout = a, ids, "contiguous"
    bounds = torch.empty(2, e, dtype=torch.int32, device=dev)
    starts, counts = bounds[0], bounds[1]  # views by select (a launch plan replays views, not unbind)
    workspace = torch.empty(workspace_words, dtype=torch.int64, device=dev) if workspace_words else None
    if src.numel() == 0:  # no rows: every group empty (nothing to launch on an empty tensor)
        bounds.zero_()
        if workspace is not None:
            workspace.zero_()
    else:
        cfg = BoundsConfig(layout, workspace is not None, _compile.target_arch(device_index(dev)))
        _compile.launch(compiled(cfg), src, starts, counts, workspace, max_m, device=dev)
    return a2, ids, starts, counts, workspace
