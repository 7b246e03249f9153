"""Compile key and tile rule of the sm_90a grouped GEMM (cute_ops/gemm/grouped_sm90.py): GemmConfig (everything
static about one compiled kernel), can_implement (why a problem cannot compile) and pick_config (the analytical tile and
FP8 schedule rule, field by field overridable), with the shared-memory budget they size stages by.

Needs no CuTeDSL: the launcher (moe_sm90.py) and the tests pick and check configs without compiling.
"""

from __future__ import annotations

import dataclasses

from triton_ops.contract.moe_gemm import FP8_BLOCK  # K elements per FP8 scale (= one K stage)

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
FP8_PREFILL_ROWS = 128
# FP8 prefill from 256 rows per group, N a multiple of 256: 128 x 256 waves + smem epilogue, twice the MMA work per
# stage for 1.5x its bytes, faster than 128 x 128 from 256 rows (slower at 128: docs/cute.md, alternatives
# measured); moe_sm90.config_for applies it
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
    the direct epilogue unless `epilogue` says smem (128 rows only); moe_sm90.config_for asks for FP8_PREFILL_WIDE."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {LAYOUTS}")
    tile_m = tile_m or (64 if rows_per_group <= 64 else 128)
    tile_n = tile_n or (256 if tile_m == 128 and n % 256 == 0 and dtype != "fp8" else 128)
    why = can_implement(dtype, n, k, num_groups, tile_m, tile_n)
    if why:
        raise ValueError(why)
    rule = dict(PLAIN_SCHEDULE)
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
