"""Grouped (MoE) bf16 / fp16 / FP8 GEMM for sm_90a: WGMMA, TMA loads, per-group TMA descriptors updated on the device.

    out[r, :] = cast(row_weight[r] * sum_k a[r, k] * w[g, :, k])      for starts[g] <= r < starts[g] + counts[g]

FP8 (E4M3 a and w, fp32 scales): sum_k becomes sum over 128-wide K blocks kb of
(sum_{k in kb} a[r, k] * w[g, n, k]) * a_scale[r, kb] * w_scale[g, n // 128, kb]; out is bf16.

This module: the compile key and tile rule (GemmConfig, can_implement, pick_config, the FP8 schedule constants),
build / compiled / dump, and the `moe_gemm_bf16` / `moe_gemm_fp8` backends of the table's "cute" rows
("Backends" below). The kernel class is in _grouped_sm90_kernel.py (imported by `build` only: it imports
nvidia-cutlass-dsl).

Operands (K-major, contiguous):

| arg | shape / dtype | what |
| --- | --- | --- |
| a | [M, K] bf16 / fp16 (FP8: uint8 E4M3 codes) | all rows of every group (masked layout: [E * max_m, K]) |
| w | [G, N, K] same dtype | per-group weights |
| out | [M, N] a's dtype (FP8: bf16) | a group's rows get its products, every other row zeros (any initial bytes) |
| starts, counts | [G] int32 | group g's rows: [starts[g], starts[g] + counts[g]), counts >= 0, inside [0, M) |
| m_indices | [M] int32 or None | contiguous layout: a row is written only where m_indices[row] == g |
| row_weights | [M] fp32 or None | multiplies each row before the one rounding |
| workspace | [grid * SLOTS * 16] int64 | per-CTA TMA descriptor slots (128 bytes each, 128-byte aligned) |
| a_scale, w_scale | FP8 only: [M, K/128] fp32 any strides; [G, ceil(N/128), K/128] fp32 | block scales |

With m_indices, a group span that holds padding or other experts' rows still writes only its own rows.
M is symbolic (one compile per (dtype, N, K, G, layout, row weights, tiles)); group sizes are data, read on the
device only: a new routing never recompiles and the launch is CUDA-graph safe.

Device-side descriptor update (what makes the groups' rows exact without host work): the A operand is loaded
through a TMA descriptor whose base address is row starts[g] of `a` and whose row extent is counts[g]. TMA
zero-fills rows past the extent, so a tile never reads another group's rows (nor rows past a masked count),
however the groups are aligned. Each CTA owns SLOTS = stages + 1 descriptor slots in `workspace`; the load warp
initializes them once from the kernel's base descriptor (a grid-constant parameter), and when its tile walk
enters a new group it rewrites the next slot in place (`tensormap.replace` of the global address, the row extent
and the strides), publishes it (`fence.proxy.tensormap::generic.release.gpu`) and acquires it for the TMA unit
(`fence.proxy.tensormap::generic.acquire.gpu`) before the first load through it. A slot is rewritten only after
`stages` further loads were issued, i.e. after every load through its previous contents completed (the producer
re-acquires a stage only once the consumers released it), so no in-flight TMA reads a descriptor being edited.
B is one 3-D descriptor (N, K, G) indexed by the group; out is written from registers (predicated per row), or
(epilogue="smem") staged per warp group in shared memory and written as coalesced 16-byte chunks.

Kernel: persistent (one CTA per SM), one producer warp group (warp 0 issues the TMA loads; the group register
budget is lowered to 40) and tile_m / 64 consumer warp groups (WGMMA 64 x tile_n x 16 from shared memory,
fp32 accumulators in registers, 232 registers each), a `stages`-deep smem ring (PipelineTmaAsync: mbarriers with
transaction bytes). The tile walk is scheduler.BoundedTileScheduler (every role walks the same order).

FP8 promotion schedules (GemmConfig.promote_run, scale_prefetch): promote_run 0 waits for each stage's WGMMAs
(wait_group 0) and then promotes them; the other consumer warp group's WGMMAs keep the tensor cores busy meanwhile.
promote_run U >= 1 issues stage i + 1's WGMMAs (into a second partial-sum buffer) before promoting stage i
(wait_group 1), in runs of U stages that end with wait_group 0: ptxas serializes every WGMMA of the kernel (C7514)
when accumulator registers of an in-flight WGMMA are copied or read across a loop edge, so nothing is in flight
where the dynamic loop turns. scale_prefetch loads each stage's scales during the previous stage's WGMMAs. Every
schedule computes the same FFMA per element and block: outputs are bit-equal. A 64 x 256 FP8 WGMMA does not fit: it
needs 128 accumulator + 128 partial-sum registers per thread.

FP8 wide tiles (GemmConfig.wide, FP8_WIDE; 128 x 256 is the launcher's FP8 prefill tile where N allows): 256 x 128 and
128 x 256 give each of the two consumer warp groups two 64 x 128 sub-tiles (waves: rows r and r + 128, sharing the
stage's B rows; or both 128-column halves, sharing its A rows) and 128 x 192 one 64 x 192 WGMMA (DeepGEMM's unaligned
block N: its columns span two 128-column weight-scale blocks, split at tile column 64 or 128; scales are taken per
64-column chunk). Per stage and wave: WGMMA into the one partial-sum buffer, wait, promote (128 accumulators + 64
partial sums, or 96 + 96, per thread); the other warp group's WGMMAs run meanwhile; scale_prefetch (on by default here)
loads the next stage's scales at the stage's start. A stage feeds 2 x the MMA work of a 128 x 128 one for 1.5 x its
bytes (192 columns: 1.5 x for 1.25 x). The direct epilogue when named; the smem one (128 rows; the rule's) spills ~20
registers per tile, outside the K loop. Same WGMMA per 64 x 128 block and FFMA per element: bit-equal to the other FP8
kernels (the 64 x 192 WGMMA sums each output over the same 4 K32 steps).

Backends (contract: dispatch/reference/moe_gemm.py, docs/moe_gemm.md; same signatures as the ops minus `backend`):
they run on the H100 and the H200 (HARDWARE_STATUS); `auto` takes them where they were timed faster than the Triton
kernel (auto_skip_bf16 / auto_skip_fp8), backend="cute" forces them. Layouts -> the kernel's groups (starts[g],
counts[g]), built on the device by group_bounds.py's kernel (no host sync; graph-safe), which also zeroes the
descriptor workspace:
* masked (E, max_m, K): a viewed as (E * max_m, K); starts = g * max_m, counts = clamp(masked_m, 0, max_m).
* contiguous (M, K) with m_indices: group g spans [first row with id g, last row with id g]; the kernel writes a
  row of that span only where m_indices[row] == g, so padding (-1), out-of-range ids and any interleaving stay
  correct (an interleaved layout only costs MMA work on rows that are then not written).
Rows no group writes are 0: the kernel writes them (the output is allocated uninitialized).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from triton_ops.contract.arch import device_index
from triton_ops.contract.arch import sm_count as _sm_count  # module attribute: tests stub it
from triton_ops.contract.moe_gemm import FP8_BLOCK  # K elements per FP8 scale (= one K stage)

from .. import _compile
from . import group_bounds

WG = 128  # threads per warp group
ROW_BYTES = 128  # bytes of one K stage per row: one 128B-swizzle row (64 bf16 / 128 E4M3 elements)
SMEM_BYTES = 232448  # sm_90 per-CTA shared memory (227 KiB)
SMEM_RESERVED = 1024  # mbarriers, alignment slack
DESC_BYTES = 128  # one TMA descriptor
DTYPES = {"bf16": "BFloat16", "fp16": "Float16", "fp8": "Float8E4M3FN"}  # operand type; fp8 writes bf16
LAYOUTS = ("contiguous", "masked")
# FP8 schedule the rule picks for prefill-sized groups (>= FP8_PREFILL_ROWS rows per group): promote_run (runs
# of 8 stages, 4 for K <= FP8_SHORT_K), scale_prefetch, epilogue_prefetch, the smem epilogue: the promotion runs
# under the next stage's WGMMAs, the fastest schedule of the sweep (docs/cute.md, alternatives measured).
FP8_PREFILL_SCHEDULE = dict(promote_run=8, scale_prefetch=True, epilogue_prefetch=True, epilogue="smem")
FP8_SHORT_K, FP8_SHORT_K_RUN = 2048, 4
# the schedule of bf16 / fp16 and of FP8 groups under FP8_PREFILL_ROWS rows: no promotion overlap (bf16 has no
# promotion; FP8 decode is at the copy roof), the direct epilogue
PLAIN_SCHEDULE = dict(promote_run=0, scale_prefetch=False, epilogue_prefetch=False, epilogue="direct")
# bf16 / fp16 at 128 x 256 stage the output in smem (3 stages instead of 4): at DeepSeek-V3 dims on the H200,
# 1.02-1.10x the direct epilogue (GEMM1 / GEMM2 at 256 and 512 rows per expert, docs/cute.md, Measured)
BF16_SMEM_EPILOGUE_TILE = (128, 256)
FP8_PREFILL_ROWS = 128
# FP8 prefill from 256 rows per group, N a multiple of 256: 128 x 256 waves + smem epilogue, twice the MMA work per
# stage for 1.5x its bytes, faster than 128 x 128 from 256 rows (slower at 128: docs/cute.md, alternatives
# measured); config_for applies it
FP8_PREFILL_WIDE = dict(tile_m=128, tile_n=256, epilogue="smem")
FP8_PREFILL_WIDE_ROWS = 256
FP8_WIDE = ((256, 128), (128, 256), (128, 192))  # FP8 tiles of the wave schedule (GemmConfig.wide)


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Everything static about one compiled kernel (the compile key). M and the group sizes are never here."""

    dtype: str  # bf16 | fp16 (a, w and out) | fp8 (E4M3 a and w with fp32 1x128 / 128x128 scales, bf16 out)
    n: int
    k: int
    num_groups: int
    layout: str  # contiguous (m_indices row filter) | masked
    row_weights: bool
    tile_m: int  # 64 | 128 (one consumer warp group per 64 rows) | FP8 256 (a wide tile, see `wide`)
    tile_n: int  # 64 | 128 | 256 (FP8: 128, or 192 / 256 as a wide tile)
    stages: int  # smem ring depth
    grid: int  # persistent CTAs (the SM count)
    arch: str  # sm_90a
    # FP8 promotion schedule. 0: each K stage's WGMMAs are waited for (wait_group 0) before its promotion
    # acc += part * scale, scales loaded while they run (the kernel timed first). U >= 1: runs of U stages over two
    # partial-sum buffers, stage i + 1's WGMMAs issued before stage i's promotion (wait_group 1), so the promotion
    # overlaps the tensor cores (192 accumulator registers per thread at 64 x 128); U = 1 is the 0 schedule in
    # this code path (a baseline for scale_prefetch).
    promote_run: int = 0
    # FP8, promote_run >= 1 or a wide tile: each stage's scales are loaded one stage ahead (during the previous
    # stage's WGMMAs)
    scale_prefetch: bool = False
    # True: the epilogue's per-row values (m_indices, row weights) are loaded when the tile starts, not after its
    # main loop (their latency, once per tile, hidden under the WGMMAs; K = 2048 has only 16 stages per tile)
    epilogue_prefetch: bool = False
    # direct: predicated 4-byte stores of column pairs from the accumulator registers. smem: each consumer warp group
    # stages its 64 rows in shared memory (16-byte chunks XOR-swizzled by row: conflict-free) and writes them with
    # coalesced predicated 16-byte stores (tile_m * tile_n * 2 bytes of smem: fewer stages may fit)
    epilogue: str = "direct"

    def key(self) -> tuple:
        return ("grouped_gemm_sm90", *dataclasses.astuple(self))

    @property
    def desc_slots(self) -> int:
        return self.stages + 1

    @property
    def workspace_words(self) -> int:
        """int64 words of the descriptor workspace the launcher allocates."""
        return self.grid * self.desc_slots * DESC_BYTES // 8

    @property
    def wide(self) -> bool:
        """FP8 256 x 128, 128 x 256 (two consumer warp groups, each owning two 64 x 128 sub-tiles: waves) or 128 x 192
        (one 64 x 192 wave per warp group, two weight-scale blocks per tile)."""
        return self.dtype == "fp8" and (self.tile_m, self.tile_n) in FP8_WIDE

    @property
    def wave_n(self) -> int:
        """Columns of one WGMMA (a wave's width)."""
        return (self.tile_n if self.tile_n % FP8_BLOCK else FP8_BLOCK) if self.wide else self.tile_n

    @property
    def mma_wgs(self) -> int:
        return min(self.tile_m // 64, 2)

    @property
    def threads(self) -> int:
        return WG * (1 + self.mma_wgs)


def block_k(dtype: str) -> int:
    return ROW_BYTES if dtype == "fp8" else ROW_BYTES // 2


def stage_bytes(tile_m: int, tile_n: int) -> int:
    return (tile_m + tile_n) * ROW_BYTES


EPILOGUES = ("direct", "smem")


def epilogue_bytes(epilogue: str, tile_m: int, tile_n: int) -> int:
    """Shared memory of the output staging tile (2-byte outputs)."""
    return tile_m * tile_n * 2 if epilogue == "smem" else 0


def can_implement(dtype: str, n: int, k: int, num_groups: int, tile_m: int = 128, tile_n: int = 128) -> str | None:
    """Why this problem cannot compile (None when it can)."""
    if dtype not in DTYPES:
        return f"dtype {dtype!r}: one of {sorted(DTYPES)}"
    fp8 = dtype == "fp8"
    if tile_m not in ((64, 128, 256) if fp8 else (64, 128)) or tile_n not in ((64, 128, 192, 256) if fp8 else
                                                                             (64, 128, 256)):
        return f"tile {tile_m}x{tile_n}: tile_m 64 / 128 (FP8 also 256), tile_n 64 / 128 / 256 (FP8 also 192)"
    if k <= 0 or k % 8:
        return f"K={k} must be a positive multiple of 8 (16-byte TMA row pitch)"
    if fp8 and (k % FP8_BLOCK or (tile_m, tile_n) not in FP8_WIDE and (tile_n != FP8_BLOCK or tile_m == 256)):
        return (f"FP8: K={k} must be a multiple of {FP8_BLOCK}; tiles 64 / 128 x {FP8_BLOCK} (one weight scale per "
                f"tile) or the wide {' / '.join(f'{m} x {n}' for m, n in FP8_WIDE)} (not {tile_m}x{tile_n})")
    if n <= 0 or n % 8:
        return f"N={n} must be a positive multiple of 8 (16-byte weight rows)"
    if num_groups < 1:
        return "needs at least one group"
    return None


def pick_config(dtype: str, n: int, k: int, num_groups: int, layout: str, row_weights: bool, rows_per_group: int,
                *, sm_count: int = 132, arch: str = "sm_90a", tile_m: int | None = None,
                tile_n: int | None = None, stages: int | None = None,
                promote_run: int | None = None, scale_prefetch: bool | None = None,
                epilogue_prefetch: bool | None = None, epilogue: str | None = None) -> GemmConfig:
    """Analytical (not tuned): 64-row tiles when groups hold <= 64 rows (decode: weight streaming, half the
    wasted MMA rows), else 128; tile_n 256 for 128-row tiles with N a multiple of 256 (the CUTLASS Hopper
    default), else 128; as many stages as fit (at most 8); FP8 groups of >= FP8_PREFILL_ROWS rows: the
    FP8_PREFILL_SCHEDULE fields (promote_run FP8_SHORT_K_RUN for K <= FP8_SHORT_K), else the plain kernel
    (promote_run 0, direct epilogue). tile_m / tile_n / stages / promote_run / scale_prefetch / epilogue_prefetch /
    epilogue override the rule field by field (scale_prefetch follows an overridden promote_run 0: off). An FP8 wide
    tile (FP8_WIDE) runs its wave schedule (promote_run 0),
    the direct epilogue unless `epilogue` says smem (128 rows only); config_for asks for FP8_PREFILL_WIDE."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    tile_m = tile_m or (64 if rows_per_group <= 64 else 128)
    tile_n = tile_n or (256 if tile_m == 128 and n % 256 == 0 and dtype != "fp8" else 128)
    why = can_implement(dtype, n, k, num_groups, tile_m, tile_n)
    if why:
        raise ValueError(why)
    rule = dict(PLAIN_SCHEDULE)
    if dtype != "fp8" and (tile_m, tile_n) == BF16_SMEM_EPILOGUE_TILE:
        rule["epilogue"] = "smem"
    if dtype == "fp8" and rows_per_group >= FP8_PREFILL_ROWS:
        rule = dict(FP8_PREFILL_SCHEDULE)
        if k <= FP8_SHORT_K:
            rule["promote_run"] = FP8_SHORT_K_RUN
    wide = dtype == "fp8" and (tile_m, tile_n) in FP8_WIDE
    if wide:  # the wave schedule, scales a stage ahead, the direct epilogue (smem: opt-in at 128 rows, see above)
        rule.update(promote_run=0, scale_prefetch=True, epilogue="direct")
        if tile_m == 256:
            rule.update(epilogue_prefetch=False)
    if promote_run is not None and scale_prefetch is None:
        scale_prefetch = rule["scale_prefetch"] and (promote_run > 0 or wide)
    promote_run = rule["promote_run"] if promote_run is None else promote_run
    scale_prefetch = rule["scale_prefetch"] if scale_prefetch is None else bool(scale_prefetch)
    epilogue_prefetch = rule["epilogue_prefetch"] if epilogue_prefetch is None else bool(epilogue_prefetch)
    epilogue = epilogue or rule["epilogue"]
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r}: one of {EPILOGUES}")
    if wide and (promote_run or (tile_m == 256 and (epilogue_prefetch or epilogue != "direct"))):
        raise ValueError(f"FP8 wide tile {tile_m}x{tile_n}: promote_run 0 (its own wave schedule); 256 rows: the "
                         f"direct epilogue, no epilogue_prefetch")
    fit = (SMEM_BYTES - SMEM_RESERVED - epilogue_bytes(epilogue, tile_m, tile_n)) // stage_bytes(tile_m, tile_n)
    if stages is not None and not 2 <= stages <= fit:
        raise ValueError(f"stages={stages}: 2 to {fit} fit in shared memory for a {tile_m}x{tile_n} tile")
    # FP8 6 rather than the 7 that fit: the 7th stage was no faster (docs/cute.md, alternatives measured)
    stages = stages or min(6 if dtype == "fp8" else 8, fit)
    if (promote_run or scale_prefetch) and dtype != "fp8":
        raise ValueError("promote_run / scale_prefetch: FP8 only (the bf16 / fp16 main loop has no promotion)")
    if promote_run < 0 or (scale_prefetch and not promote_run and not wide):
        raise ValueError(f"promote_run={promote_run} (>= 0), scale_prefetch={scale_prefetch} (needs promote_run >= 1)")
    return GemmConfig(dtype, n, k, num_groups, layout, bool(row_weights), tile_m, tile_n, stages, sm_count, arch,
                      promote_run=promote_run, scale_prefetch=scale_prefetch,
                      epilogue_prefetch=bool(epilogue_prefetch), epilogue=epilogue)


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


# --------------------------------------------------------------------------------------------- compile


def _fake_args(cfg: GemmConfig):
    import cutlass
    import cutlass.cute as cute

    fp8 = cfg.dtype == "fp8"
    dt = cutlass.Uint8 if fp8 else getattr(cutlass, DTYPES[cfg.dtype])  # E4M3 codes are passed as bytes
    out_dt = cutlass.BFloat16 if fp8 else dt
    m = cute.sym_int()  # every row count is this one symbol (TVM-FFI checks they agree)
    g, n, k = cfg.num_groups, cfg.n, cfg.k
    a = cute.runtime.make_fake_tensor(dt, (m, k), stride=(k, 1), assumed_align=16)
    w = cute.runtime.make_fake_tensor(dt, (g, n, k), stride=(n * k, k, 1), assumed_align=16)
    out = cute.runtime.make_fake_tensor(out_dt, (m, n), stride=(n, 1), assumed_align=16)
    starts = cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4)
    counts = cute.runtime.make_fake_tensor(cutlass.Int32, (g,), stride=(1,), assumed_align=4)
    m_indices = (cute.runtime.make_fake_tensor(cutlass.Int32, (m,), stride=(1,), assumed_align=4)
                 if cfg.layout == "contiguous" else None)
    row_weights = (cute.runtime.make_fake_tensor(cutlass.Float32, (m,), stride=(1,), assumed_align=4)
                   if cfg.row_weights else None)
    workspace = cute.runtime.make_fake_tensor(cutlass.Int64, (cfg.workspace_words,), stride=(1,),
                                              assumed_align=DESC_BYTES)
    a_scale = w_scale = None
    if cfg.dtype == "fp8":  # 1x128 activation scales in any strides (row-major or column-major); weight scales dense
        kb, nb = k // FP8_BLOCK, -(-n // FP8_BLOCK)
        a_scale = cute.runtime.make_fake_tensor(cutlass.Float32, (m, kb), stride=(cute.sym_int64(), cute.sym_int64()),
                                                assumed_align=4)
        w_scale = cute.runtime.make_fake_tensor(cutlass.Float32, (g, nb, kb), stride=(nb * kb, kb, 1), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return a, w, out, starts, counts, m_indices, row_weights, workspace, a_scale, w_scale, stream


def build(cfg: GemmConfig, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options` e.g. keep/dump flags for SASS tests)."""
    import cutlass.cute as cute

    from ._grouped_sm90_kernel import GroupedGemmSm90  # imports nvidia-cutlass-dsl

    return cute.compile(GroupedGemmSm90(cfg), *_fake_args(cfg),
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def compiled(cfg):
    """The TVM-FFI callable for `cfg` (compiled once per process, loaded from disk when cached)."""
    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def dump(cfg: GemmConfig):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from .._sass import compile_and_dump

    return compile_and_dump(lambda extra: build(cfg, extra))


# ------------------------------------------------------------------------------------- supports, auto_skip

UNVERIFIED_ENV = "LOWBIT_CUTE_UNVERIFIED"
HARDWARE_STATUS = "CuTeDSL sm_90 grouped GEMM: its GPU tests pass on an H100 and an H200 (docs/cute.md)"
# Where auto takes the kernel (docs/cute.md and docs/moe_gemm.md, Measured), for both dtypes: from 128 rows per
# expert, the smallest timed prefill size. FP8 is 2.1-2.5x the Triton kernel there (whose per-K-step scaling drains
# the MMA pipeline); bf16 1.08-1.42x at 128-512 rows per expert at every timed K on the H200 under both timings, once
# the group bounds became one small kernel (as torch ops they had cost 4-136 us of GPU time per call). Below, decode
# streams the weights, where Triton is at the copy roof.
PREFILL_ROWS_PER_EXPERT = 128
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _rows_per_expert(a, masked_m, w) -> int:
    return a.shape[1] if masked_m is not None else a.shape[0] // max(1, w.shape[0])


def auto_skip_bf16(a, w, m_indices, masked_m, *rest) -> str | None:
    """auto_skip of the bf16 row: auto takes it from PREFILL_ROWS_PER_EXPERT rows per expert (timed faster than
    Triton there); decode sizes stay on Triton (at the copy roof there)."""
    if os.environ.get(UNVERIFIED_ENV) == "1" or _rows_per_expert(a, masked_m, w) >= PREFILL_ROWS_PER_EXPERT:
        return None
    return (f"cute moe_gemm_bf16: under {PREFILL_ROWS_PER_EXPERT} rows per expert (decode) the Triton kernel stays "
            "(at the copy roof there)")


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


# ------------------------------------------------------------------------- launcher


def _run(kind, a, w, m_indices, masked_m, row_weights, a_scale=None, w_scale=None, out_dtype=None, tiles=None):
    e, n, k = w.shape
    dev = a.device
    masked = masked_m is not None
    rows = e * a.shape[1] if masked else a.shape[0]
    out = torch.empty(rows, n, dtype=out_dtype or a.dtype, device=dev)  # the kernel writes every row
    if rows and n:
        index = device_index(dev)
        cfg = config_for(kind, a, w, "masked" if masked else "contiguous", row_weights is not None,
                         _compile.target_arch(index), _sm_count(index), tiles)
        # the descriptor slots are rewritten by the kernel before use; zeroed (by the bounds kernel) so bytes past
        # what the DSL copies (it copies the first 64 of each 128-byte descriptor) are defined
        a2, ids, starts, counts, workspace = group_bounds.layout_groups(a, w, m_indices, masked_m,
                                                                        cfg.workspace_words)
        rw = None if row_weights is None else row_weights.reshape(-1).contiguous()
        if kind == "fp8":  # (rows, K/128) in whatever strides it has (a copy only for an unmergeable 3-D view)
            a_scale = a_scale.reshape(rows, k // FP8_BLOCK)
            w_scale = w_scale.contiguous()
        _compile.launch(compiled(cfg), a2, w, out, starts, counts, ids, rw, workspace, a_scale, w_scale, device=dev)
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
