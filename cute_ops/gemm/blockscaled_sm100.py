"""Grouped (MoE) block-scaled FP4 GEMM for sm_100a: tcgen05 UMMA, TMEM accumulator, TMA loads; the same pipeline
with dense bf16 / fp16 operands (fmt "bf16" / "fp16", see "Dense formats" below).

COMPILED AND SASS-INSPECTED ONLY (tests/test_cute_gemm.py, CPU, CUTE_DSL_ARCH=sm_100a); never run on Blackwell
hardware. Launchers: cute_ops/gemm/moe_sm100.py (the sm_100 rows of `moe_gemm_blockscaled`,
`moe_gemm_blockscaled_masked` and `moe_gemm_bf16`, refused unless LOWBIT_CUTE_UNVERIFIED=1).

    out[r, :] = bf16(alpha[g] * sum_k dec(a[r, k]) * dec(b[g, :, k]))     for starts[g] <= r < starts[g] + counts[g]

where dec(x) = e2m1(x) * its block scale (NVFP4: E4M3 per 16 elements; MXFP4: E8M0 per 32) and alpha[g] is an fp32
per-group factor (NVFP4: the product of the two global scales; MXFP4: 1). Operands (all K-major, K contiguous):

| arg | shape / dtype | layout |
| --- | --- | --- |
| a | [M, K/2] uint8 | E2M1 pairs, element 2i in the low nibble (`nvFP4_quantize` / `mxFP4_quantize` codes) |
| sfa | [round_up(M, 128), round_up(K/sf_vec, 4)] uint8 | 128x4 swizzled (`swizzle_scales_128x4`) |
| b | [G, N, K/2] uint8 | per-group weights, same packing |
| sfb | [G, N, round_up(K/sf_vec, 4)] uint8 | each group's [N, K/sf_vec] swizzled, N a multiple of 128 |
| out | [M, N] bf16 | rows outside every group are not written |
| starts, counts | [G] int32 | group g: rows [starts[g], +counts[g]), starts[g] a multiple of the tile's rows |
| alpha | [G] fp32 | per-group output factor |

Layouts (the launcher builds starts / counts on the device): contiguous offsets (starts = offsets[:-1], multiples of
128: `moe_align` with block_m = 128), masked [E, max_m, K/2] viewed as [E * max_m, K/2] (starts = g * max_m,
counts = clamp(masked_m, 0, max_m), max_m a multiple of the tile's rows). Every operand has ONE TMA descriptor
(a grid constant); a tile addresses its group by tile coordinates (the row tile row_start / rows_per_tile, the
group index as B's third coordinate) and the epilogue predicates its stores on the group's end: no descriptor is
rewritten on the device (contrast grouped_sm90.py). A tile never reads rows outside its group's allocation because
starts and the allocation (masked: max_m) are multiples of the tile's rows; rows past counts[g] inside it are
computed and not written. M (rows, a multiple of the tile's rows) is symbolic: one compile serves every batch; the
sfa container's rows are their own symbol (a multiple of 128). N, K, G, the format and the variant are static (the
compile key, `GemmConfig`).

Variants:
* default: UMMA 128 (rows of a) x tile_n (128 / 256 columns of out) x 64; A and SFA from a, B and SFB from b[g].
* swap_ab (decode, <= 64 rows per group): out^T tiles. UMMA M = 128 output columns (A = b[g], the weight scales as
  SFA), UMMA N = tile_n in (32, 64) rows of a (B = a, the token scales as SFB). A 128-row UMMA over a 16-row expert
  wastes 7/8 of the MMA; with the tokens on N it wastes at most the tile's padding. The token scales are TMA'd as
  their whole 128-row swizzle atom (TMEM copy unchanged; with max_m < 128 the atom also holds the next groups'
  scales, read and unused) and the MMA reads the tile's rows from TMEM column (row_start % 128) / 32 on (one column
  = 32 rows of the atom: CUTLASS's N = 64 shift, generalized to 32). The epilogue thread i owns output column
  n0 + i (its TMEM lane) and stores its tile_n tokens as 2-byte stores out[row, n0 + i], each predicated on
  row < the group's end (a warp writes 64 contiguous bytes of one row per store).

Kernel anatomy (one CTA per SM, persistent; warp roles):
* warp 5, TMA producer: for each tile of the static group scheduler (scheduler.BoundedTileScheduler) and each
  256-wide K step, TMA-loads the A tile (128 x 256), the B tile (tile_n x 256), and both scale tiles into one
  stage of an `ab_stages`-deep smem ring (PipelineTmaUmma: mbarrier with transaction bytes).
* warp 4, MMA issuer: copies the stage's scale factors smem -> TMEM (tcgen05.cp 4x32x128b), then issues 4 block-
  scaled UMMAs (tcgen05.mma.kind::mxf4nvf4.block_scale.block16 / .block32 = SASS UTCOMMA.4X / UTCOMMA,
  128 x tile_n x 64) into an fp32 TMEM accumulator; releases the
  stage with tcgen05.commit; commits the finished accumulator to the epilogue (PipelineUmmaAsync; `acc_stages`
  TMEM buffers, so with 2 the next tile's MMAs overlap this tile's epilogue).
* warps 0-3, epilogue: TMEM -> registers (tcgen05.ld 32x32b: thread i owns accumulator row i) in `epi_cols`-wide
  column slices, times alpha[g], to bf16; default: 16-byte global stores predicated on row < the group's end;
  swap_ab: the transposed 2-byte stores above.

Dense formats (bf16 / fp16, `moe_gemm_bf16`): a and b are 16-bit tensors ([M, K], [G, N, K]); no scale factor is
loaded, copied to TMEM or passed to the MMA (tcgen05.mma kind::f16 = SASS UTCHMMA, 128 x tile_n x 16, 4 per
64-wide K stage: 128 bytes per row as for FP4); out in the operand dtype; K any multiple of 8 (TMA zero-fills the
last stage); two TMEM accumulators at tile_n 256 too (no scale columns); never swap-AB. Groups start on any row: the
launcher passes each span aligned down to its 128-row tile as (starts, counts) and the group's own first row as
`lo`; the epilogue writes row r only for lo[g] <= r < end, and where m_indices[r] == g when m_indices is given, times
row_weights[r] when given (both loaded once per tile at the row clamped into the span). M is any row count (TMA
zero-fills past it); alpha, sfa, sfb are None.

What it is not (yet): no 2-CTA (cta_group::2) 256-row tiles, no clusters / TMA multicast, no TMA-store epilogue
(rows are stored straight from registers), K must be a multiple of 256 (K = 2880 of GPT-OSS is refused), N a
multiple of tile_n (swap_ab: of 128), swap_ab token tiles below 32 (a 16-row tile would start mid-column of the
token scales' TMEM layout) and masked max_m not a multiple of the tile's rows.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator

from . import scale_layout
from .scheduler import BoundedTileScheduler

BLOCK_M = 128  # UMMA M (cta_group::1) = the scale atom's rows
MMA_K = 64  # K of one FP4 UMMA instruction
BLOCK_K = 4 * MMA_K  # K per pipeline stage: 128 bytes of FP4 per row = one 128B-swizzle row
SMEM_BYTES = 232448  # sm_100 per-CTA shared memory
SMEM_RESERVED = 2048  # mbarriers, the TMEM address slot, alignment slack
TMEM_COLS = 512
WARP_EPI, WARP_MMA, WARP_TMA = (0, 1, 2, 3), 4, 5
THREADS = 32 * 6


@dataclasses.dataclass(frozen=True)
class Format:
    sf_vec: int  # elements per block scale (0: dense, no scales)
    sf_dtype: str | None  # cutlass dtype name of the scale byte
    mma_op: str  # tcgen05 MMA op class (FP4: tcgen05.mma kind::mxf4nvf4 .block16 / .block32; dense: kind::f16)
    ab_dtype: str = "Float4E2M1FN"  # cutlass dtype of the A / B elements
    out_dtype: str = "BFloat16"
    mma_k: int = MMA_K  # K of one UMMA instruction (32 bytes of each operand row)

    @property
    def dense(self) -> bool:
        return self.sf_vec == 0

    @property
    def block_k(self) -> int:
        """K elements per pipeline stage: 128 bytes per row (one 128B-swizzle row), 4 UMMAs."""
        return 4 * self.mma_k


FORMATS = {
    "nvfp4": Format(16, "Float8E4M3FN", "MmaMXF4NVF4Op"),
    "mxfp4": Format(32, "Float8E8M0FNU", "MmaMXF4Op"),
    # dense 16-bit operands (tcgen05.mma kind::f16 = SASS UTCHMMA), fp32 accumulation, output in the operand dtype
    "bf16": Format(0, None, "MmaF16BF16Op", "BFloat16", "BFloat16", 16),
    "fp16": Format(0, None, "MmaF16BF16Op", "Float16", "Float16", 16),
}


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Everything static about one compiled kernel (the compile key). M and the group extents are never here."""

    fmt: str  # nvfp4 | mxfp4 | bf16 | fp16 (FORMATS)
    n: int  # output columns (per group)
    k: int  # reduction length in elements
    num_groups: int  # G (experts)
    tile_n: int  # UMMA N: 128 (2 TMEM accumulators) or 256 (1); with swap_ab the token tile, 32 or 64
    ab_stages: int  # smem ring depth (A, B, SFA, SFB per stage)
    acc_stages: int  # TMEM accumulator buffers
    epi_cols: int  # accumulator columns per epilogue step (registers: epi_cols fp32 per thread)
    max_ctas: int  # persistent grid cap (the SM count)
    arch: str  # compile target, sm_100a
    # Decode: out^T tiles = B[g] (128 output columns on the UMMA M side) x A rows^T (tile_n tokens on the N side)
    swap_ab: bool = False
    # Dense formats only (the moe_gemm_bf16 contract): a row is written only where m_indices[row] == g (contiguous
    # layout) / multiplied by row_weights[row]
    m_indices: bool = False
    row_weights: bool = False

    def key(self) -> tuple:
        return ("blockscaled_grouped_gemm", *dataclasses.astuple(self))

    @property
    def sf_vec(self) -> int:
        return FORMATS[self.fmt].sf_vec

    @property
    def dense(self) -> bool:
        return FORMATS[self.fmt].dense

    @property
    def rows_per_tile(self) -> int:
        """Rows of A / out one tile covers (the scheduler's block_m)."""
        return self.tile_n if self.swap_ab else BLOCK_M

    @property
    def cols_per_tile(self) -> int:
        """Columns of out one tile covers."""
        return BLOCK_M if self.swap_ab else self.tile_n


SWAP_TILES = (32, 64)  # token tiles of the swap-AB variant (the token scales' TMEM column is 32 rows)
SWAP_MAX_ROWS = 64  # pick_config: swap-AB when a group holds at most this many rows


def stage_bytes(fmt: str, tile_n: int) -> int:
    if FORMATS[fmt].dense:  # 128 bytes of K per row of A and B
        return (BLOCK_M + tile_n) * 128
    sf_per_row = BLOCK_K // FORMATS[fmt].sf_vec
    # the N side's scale tile is whole 128-row atoms
    return (BLOCK_M + tile_n) * BLOCK_K // 2 + (BLOCK_M + scale_layout.round_up(tile_n, BLOCK_M)) * sf_per_row


def can_implement(fmt: str, n: int, k: int, num_groups: int, tile_n: int = 128, swap_ab: bool = False) -> str | None:
    """Why this problem cannot compile (None when it can)."""
    if fmt not in FORMATS:
        return f"format {fmt!r}: one of {sorted(FORMATS)}"
    tiles = SWAP_TILES if swap_ab else (128, 256)
    if tile_n not in tiles:
        return f"tile_n={tile_n}: one of {tiles}" + (" (swap-AB token tile)" if swap_ab else "")
    if FORMATS[fmt].dense:
        if swap_ab:
            return "swap-AB is block-scaled only"
        if k <= 0 or k % 8:
            return f"K={k} must be a positive multiple of 8 (16-byte TMA rows; the last stage is zero-filled)"
    elif k <= 0 or k % BLOCK_K:
        return f"K={k} must be a positive multiple of {BLOCK_K} (one pipeline stage)"
    if swap_ab and (n <= 0 or n % BLOCK_M):
        return f"N={n} must be a positive multiple of {BLOCK_M} (swap-AB: the weight rows on the UMMA M side)"
    if not swap_ab and (n <= 0 or n % tile_n):
        return f"N={n} must be a positive multiple of tile_n={tile_n}"
    if num_groups < 1:
        return "needs at least one group"
    return None


def pick_config(fmt: str, n: int, k: int, num_groups: int, *, tile_n: int | None = None, sm_count: int = 148,
                arch: str = "sm_100a", rows_per_group: int | None = None, swap_ab: bool | None = None,
                m_indices: bool = False, row_weights: bool = False) -> GemmConfig:
    """Analytical. swap_ab (unless given): when a group holds at most SWAP_MAX_ROWS rows (`rows_per_group`: the
    masked layout's max_m, or the contiguous layout's rows / G), with a 32-token tile up to 32 rows, else 64 (a
    128-row UMMA would leave 3/4 or more of its rows empty). Otherwise tile_n 128 unless asked (two TMEM
    accumulators: the epilogue of tile i overlaps the MMAs of tile i + 1; 256 fits only one next to the scale
    columns). As many smem stages as fit (at most 8). Dense formats: never swap-AB, two accumulators at either
    tile_n (no scale columns in TMEM); m_indices / row_weights select their epilogue inputs."""
    dense = fmt in FORMATS and FORMATS[fmt].dense
    if (m_indices or row_weights) and not dense:
        raise ValueError("m_indices / row_weights: dense formats only")
    if swap_ab is None:
        swap_ab = not dense and rows_per_group is not None and rows_per_group <= SWAP_MAX_ROWS
    if swap_ab:
        tile_n = tile_n or (32 if rows_per_group is not None and rows_per_group <= 32 else 64)
    tile_n = tile_n or 128
    why = can_implement(fmt, n, k, num_groups, tile_n, swap_ab)
    if why:
        raise ValueError(why)
    acc_stages = 1 if tile_n == 256 and not dense else 2
    stages = min(8, (SMEM_BYTES - SMEM_RESERVED) // stage_bytes(fmt, tile_n))
    return GemmConfig(fmt, n, k, num_groups, tile_n, stages, acc_stages, 32, sm_count, arch, swap_ab, m_indices,
                      row_weights)


# ------------------------------------------------------------------------------------------------- kernel


class GroupedBlockScaledGemmSm100:
    def __init__(self, cfg: GemmConfig):
        f = FORMATS[cfg.fmt]
        self.cfg = cfg
        self.dense = f.dense  # no scale factors: every SF piece (TMA, smem, tcgen05.cp, TMEM columns) is skipped
        self.sf_vec = cfg.sf_vec
        self.sf_dtype = getattr(cutlass, f.sf_dtype) if f.sf_dtype else None
        self.ab_dtype = getattr(cutlass, f.ab_dtype)
        self.out_dtype = getattr(cutlass, f.out_dtype)
        self.tile = (BLOCK_M, cfg.tile_n, f.block_k)  # UMMA (M, N, K) per tile
        # the UMMA N side's scale tile: whole 128-row atoms (a 32 / 64-token tile reads its columns of one)
        self.tile_sfb = (BLOCK_M, scale_layout.round_up(cfg.tile_n, BLOCK_M), f.block_k)
        self.k_tiles = -(-cfg.k // f.block_k)  # dense: a partial last stage is zero-filled by TMA
        self.n_tiles = cfg.n // cfg.cols_per_tile
        self.epi_tile = (BLOCK_M, cfg.epi_cols)

    def _mma_op(self, n: int):
        shape = (BLOCK_M, n, self.tile[2] // 4)
        args = (shape, tcgen05.CtaGroup.ONE, tcgen05.OperandSource.SMEM)
        op = getattr(tcgen05, FORMATS[self.cfg.fmt].mma_op)
        if self.dense:  # tcgen05.mma kind::f16, both operands K-major
            k_major = cute.nvgpu.OperandMajorMode.K
            return op(self.ab_dtype, cutlass.Float32, *args, k_major, k_major)
        return op(self.sf_dtype, *args) if op is tcgen05.MmaMXF4NVF4Op else op(*args)

    @cute.jit
    def __call__(self, a: cute.Tensor, b: cute.Tensor, sfa: cute.Tensor | None, sfb: cute.Tensor | None,
                 out: cute.Tensor, starts: cute.Tensor, counts: cute.Tensor, alpha: cute.Tensor | None,
                 lo: cute.Tensor | None, m_indices: cute.Tensor | None, row_weights: cute.Tensor | None, stream):
        cfg = self.cfg
        m = a.shape[0]
        n, k, groups = cfg.n, cfg.k, cfg.num_groups
        # Byte tensors from the host (FP4) or 16-bit tensors (dense), typed views here
        mAct = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=self.ab_dtype),
                                cute.make_ordered_layout((m, k, 1), order=(1, 0, 2)))
        mW = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=self.ab_dtype),
                              cute.make_ordered_layout((n, k, groups), order=(1, 0, 2)))
        mSFAct = mSFW = None
        if cutlass.const_expr(not self.dense):
            # the activation scale container has round_up(M, 128) rows (its own extent: M need not be a multiple
            # of 128); scale bytes as their float8 type
            mSFAct = cute.make_tensor(cute.recast_ptr(sfa.iterator, dtype=self.sf_dtype),
                                      scale_layout.scale_tensor_layout((sfa.shape[0], k, 1), self.sf_vec))
            mSFW = cute.make_tensor(cute.recast_ptr(sfb.iterator, dtype=self.sf_dtype),
                                    scale_layout.scale_tensor_layout(mW.shape, self.sf_vec))
        if cutlass.const_expr(cfg.swap_ab):
            # UMMA A = the weights (output columns on M), B = the tokens; C = out^T: (n, m) with the token stride n
            mA, mB, mSFA, mSFB = mW, mAct, mSFW, mSFAct
            mC = cute.make_tensor(out.iterator, cute.make_ordered_layout((n, m, 1), order=(0, 1, 2)))
        else:
            mA, mB, mSFA, mSFB = mAct, mW, mSFAct, mSFW
            mC = cute.make_tensor(out.iterator, cute.make_ordered_layout((m, n, 1), order=(1, 0, 2)))

        tiled_mma = cute.make_tiled_mma(self._mma_op(cfg.tile_n))
        stages = cfg.ab_stages
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.tile, self.ab_dtype, stages)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.tile, self.ab_dtype, stages)
        tiled_mma_sfb = sfa_smem = sfb_smem = None
        if cutlass.const_expr(not self.dense):
            # the N-side scales are loaded (and copied to TMEM) as whole 128-row atoms: partitioned by an N = 128
            # MMA
            tiled_mma_sfb = cute.make_tiled_mma(self._mma_op(self.tile_sfb[1]))
            sfa_smem = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.tile, self.sf_vec, stages)
            sfb_smem = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.tile, self.sf_vec, stages)

        one_cta = cute.make_layout((1, 1, 1, 1))
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)

        def stage0(layout):
            return cute.slice_(layout, (None, None, None, 0))

        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(g2s, mA, stage0(a_smem), self.tile, tiled_mma,
                                                         one_cta.shape)
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mB, stage0(b_smem), self.tile, tiled_mma,
                                                         one_cta.shape)
        self.tx_bytes = (cute.size_in_bytes(self.ab_dtype, stage0(a_smem))
                         + cute.size_in_bytes(self.ab_dtype, stage0(b_smem)))
        tma_sfa = tma_mSFA = tma_sfb = tma_mSFB = None
        if cutlass.const_expr(not self.dense):
            # scale tiles: TMA'd with a 16-bit internal element type, as CUTLASS's block-scaled kernels do
            tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(g2s, mSFA, stage0(sfa_smem), self.tile, tiled_mma,
                                                                 one_cta.shape, internal_type=cutlass.Int16)
            tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(g2s, mSFB, stage0(sfb_smem), self.tile_sfb,
                                                                 tiled_mma_sfb, one_cta.shape,
                                                                 internal_type=cutlass.Int16)
            self.tx_bytes += (cute.size_in_bytes(self.sf_dtype, stage0(sfa_smem))
                              + cute.size_in_bytes(self.sf_dtype, stage0(sfb_smem)))

        @cute.struct
        class Storage:
            ab_bar: cute.struct.MemRange[cutlass.Int64, stages * 2]
            acc_bar: cute.struct.MemRange[cutlass.Int64, cfg.acc_stages * 2]
            tmem_addr: cutlass.Int32

        self.storage = Storage
        # Upper bound of the tile count: the grid never exceeds it nor the SM count. Dense: groups start anywhere
        # (their spans are tile-aligned by the launcher: one more row tile per group at most)
        row_tiles = (m + (cfg.rows_per_tile - 1)) // cfg.rows_per_tile + (groups if cfg.dense else 0)
        max_tiles = row_tiles * self.n_tiles
        grid = cutlass.min(max_tiles, cutlass.Int32(cfg.max_ctas))
        grid = cutlass.max(grid, cutlass.Int32(1))
        self.kernel(tiled_mma, tiled_mma_sfb, tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
                    mC, starts, counts, alpha, lo, m_indices, row_weights, a_smem, b_smem, sfa_smem,
                    sfb_smem).launch(
            grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tiled_mma_sfb: cute.TiledMma | None, tma_a: cute.CopyAtom,
               mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor, tma_sfa: cute.CopyAtom | None,
               mSFA: cute.Tensor | None, tma_sfb: cute.CopyAtom | None, mSFB: cute.Tensor | None, mC: cute.Tensor,
               starts: cute.Tensor, counts: cute.Tensor, alpha: cute.Tensor | None, lo: cute.Tensor | None,
               m_indices: cute.Tensor | None, row_weights: cute.Tensor | None, a_smem: cute.ComposedLayout,
               b_smem: cute.ComposedLayout, sfa_smem: cute.Layout | None, sfb_smem: cute.Layout | None):
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()

        if warp == WARP_TMA:
            for atom in (tma_a, tma_b) if self.dense else (tma_a, tma_b, tma_sfa, tma_sfb):
                cpasync.prefetch_descriptor(atom)

        smem = SmemAllocator()
        storage = smem.allocate(self.storage)
        sA = smem.allocate_tensor(self.ab_dtype, a_smem.outer, byte_alignment=1024, swizzle=a_smem.inner)
        sB = smem.allocate_tensor(self.ab_dtype, b_smem.outer, byte_alignment=1024, swizzle=b_smem.inner)
        sSFA = sSFB = None
        if cutlass.const_expr(not self.dense):
            sSFA = smem.allocate_tensor(self.sf_dtype, sfa_smem, byte_alignment=128)
            sSFB = smem.allocate_tensor(self.sf_dtype, sfb_smem, byte_alignment=128)

        thread = pipeline.Agent.Thread
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_bar.data_ptr(), num_stages=cfg.ab_stages,
            producer_group=pipeline.CooperativeGroup(thread), consumer_group=pipeline.CooperativeGroup(thread, 1),
            tx_count=self.tx_bytes)
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_bar.data_ptr(), num_stages=cfg.acc_stages,
            producer_group=pipeline.CooperativeGroup(thread),
            consumer_group=pipeline.CooperativeGroup(thread, 32 * len(WARP_EPI)))
        tmem = TmemAllocator(storage.tmem_addr.ptr, allocator_warp_id=WARP_EPI[0],
                             barrier_for_retrieve=pipeline.NamedBarrier(
                                 barrier_id=2, num_threads=32 * (len(WARP_EPI) + 1)))
        epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(WARP_EPI))

        # Global tiles: (bM, bK, RestM, RestK, RestL) etc., partitioned as the MMA sees them
        thr_mma = tiled_mma.get_slice(0)
        tile_mk = cute.slice_(self.tile, (None, 0, None))
        tile_nk = cute.slice_(self.tile, (0, None, None))
        tCgA = thr_mma.partition_A(cute.local_tile(mA, tile_mk, (None, None, None)))
        tCgB = thr_mma.partition_B(cute.local_tile(mB, tile_nk, (None, None, None)))
        tCgSFA = tCgSFB = None
        if cutlass.const_expr(not self.dense):
            tCgSFA = thr_mma.partition_A(cute.local_tile(mSFA, tile_mk, (None, None, None)))
            tCgSFB = tiled_mma_sfb.get_slice(0).partition_B(
                cute.local_tile(mSFB, cute.slice_(self.tile_sfb, (0, None, None)), (None, None, None)))
        tile_mn = cute.slice_(self.tile, (None, None, 0))
        tCgC = thr_mma.partition_C(cute.local_tile(mC, tile_mn, (None, None, None)))
        tCcC = thr_mma.partition_C(cute.local_tile(cute.make_identity_tensor(mC.shape), tile_mn,
                                                   (None, None, None)))

        # Accumulator layout (MMA, MMA_M, MMA_N, ACC_STAGE); TMEM address bound later
        acc_shape = tiled_mma.partition_shape_C(self.tile[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, cfg.acc_stages))

        # Groups as (starts, counts): one descriptor per operand, groups addressed by tile coordinates (no
        # descriptor rewrites); rows past a group's count are computed from its own allocation and not written
        sched = BoundedTileScheduler(starts, counts, cfg.num_groups, cfg.rows_per_tile, self.n_tiles)

        if warp == WARP_TMA:
            self.produce(sched, bidx, nctas, ab_pipe, tma_a, tma_b, tma_sfa, tma_sfb, tCgA, tCgB, tCgSFA,
                         tCgSFB, sA, sB, sSFA, sSFB)
        if warp == WARP_MMA:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            self.mma(sched, bidx, nctas, tiled_mma, ab_pipe, acc_pipe, acc_ptr, tCtAcc_fake, sA, sB, sSFA, sSFB,
                     sfa_smem, sfb_smem)
        if warp < WARP_MMA:
            tmem.allocate(TMEM_COLS)
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(cutlass.Float32)
            self.epilogue(sched, bidx, nctas, tidx, acc_pipe, acc_ptr, tCtAcc_fake, tCgC, tCcC, alpha, lo,
                          m_indices, row_weights)
            tmem.relinquish_alloc_permit()
            epi_barrier.arrive_and_wait()
            tmem.free(acc_ptr)

    def _tile(self, row_start, n_tile, g):
        """Tile coordinates of the tile whose rows start at row_start (column tile n_tile, group g):
        ((A tile, A l), (B tile, B l), N-side scale atom, (C tile m, C tile n)) in the UMMA's A / B / C terms."""
        rows = self.cfg.rows_per_tile
        act, wgt = (row_start // rows, 0), (n_tile, g)
        if cutlass.const_expr(self.cfg.swap_ab):
            return wgt, act, row_start // BLOCK_M, (n_tile, row_start // rows)
        return act, wgt, n_tile, (row_start // rows, n_tile)

    # ------------------------------------------------------------------------------------ warp roles

    @cute.jit
    def produce(self, sched, bidx, nctas, ab_pipe, tma_a, tma_b, tma_sfa, tma_sfb, tCgA, tCgB, tCgSFA, tCgSFB,
                sA, sB, sSFA, sSFB):
        one = cute.make_layout(1)
        tAsA, tAgA = cpasync.tma_partition(tma_a, 0, one, cute.group_modes(sA, 0, 3),
                                           cute.group_modes(tCgA, 0, 3))
        tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 3),
                                           cute.group_modes(tCgB, 0, 3))
        if cutlass.const_expr(not self.dense):
            tAsSFA, tAgSFA = cpasync.tma_partition(tma_sfa, 0, one, cute.group_modes(sSFA, 0, 3),
                                                   cute.group_modes(tCgSFA, 0, 3))
            tBsSFB, tBgSFB = cpasync.tma_partition(tma_sfb, 0, one, cute.group_modes(sSFB, 0, 3),
                                                   cute.group_modes(tCgSFB, 0, 3))
            # the scale atoms broadcast over the sf_vec elements (stride 0): drop those modes for the copy
            tAsSFA, tAgSFA = cute.filter_zeros(tAsSFA), cute.filter_zeros(tAgSFA)
            tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.ab_stages)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            _, n_tile, row_start, _ = sched.coords(t, g, base)
            (a_t, a_l), (b_t, b_l), sfb_t, _ = self._tile(row_start, n_tile, g)
            gA = tAgA[(None, a_t, None, a_l)]
            gB = tBgB[(None, b_t, None, b_l)]
            if cutlass.const_expr(not self.dense):
                gSFA = tAgSFA[(None, a_t, None, a_l)]
                gSFB = tBgSFB[(None, sfb_t, None, b_l)]
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ab_pipe.producer_acquire(state)
                bar = ab_pipe.producer_get_barrier(state)
                cute.copy(tma_a, gA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                cute.copy(tma_b, gB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar)
                if cutlass.const_expr(not self.dense):
                    cute.copy(tma_sfa, gSFA[(None, kt)], tAsSFA[(None, state.index)], tma_bar_ptr=bar)
                    cute.copy(tma_sfb, gSFB[(None, kt)], tBsSFB[(None, state.index)], tma_bar_ptr=bar)
                state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)
        ab_pipe.producer_tail(state)

    @cute.jit
    def mma(self, sched, bidx, nctas, tiled_mma, ab_pipe, acc_pipe, acc_ptr, tCtAcc_fake, sA, sB, sSFA, sSFB,
            sfa_smem, sfb_smem):
        tCtAcc_all = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
        if cutlass.const_expr(not self.dense):
            # scale factors live in TMEM right after the accumulators
            sf_col = tcgen05.find_tmem_tensor_col_offset(tCtAcc_all)
            tCtSFA_layout = blockscaled_utils.make_tmem_layout_sfa(tiled_mma, self.tile, self.sf_vec,
                                                                   cute.slice_(sfa_smem, (None, None, None, 0)))
            tCtSFA = cute.make_tensor(cute.recast_ptr(acc_ptr + sf_col, dtype=self.sf_dtype), tCtSFA_layout)
            sfb_col = sf_col + tcgen05.find_tmem_tensor_col_offset(tCtSFA)
            tCtSFB_layout = blockscaled_utils.make_tmem_layout_sfb(tiled_mma, self.tile, self.sf_vec,
                                                                   cute.slice_(sfb_smem, (None, None, None, 0)))
            tCtSFB = cute.make_tensor(cute.recast_ptr(acc_ptr + sfb_col, dtype=self.sf_dtype), tCtSFB_layout)

            s2t_sfa, tCsSFA_s2t, tCtSFA_s2t = self._s2t(sSFA, tCtSFA)
            s2t_sfb, tCsSFB_s2t, tCtSFB_s2t = self._s2t(sSFB, tCtSFB)

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        ab_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.ab_stages)
        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.cfg.acc_stages)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            tCtAcc = tCtAcc_all[(None, None, None, acc_state.index)]
            tCtSFB_mma = None if self.dense else tCtSFB
            if cutlass.const_expr(self.cfg.tile_n < BLOCK_M):
                # The N side's scales were copied as a whole 128-row atom; one TMEM column holds 32 rows: the MMA
                # reads this tile's rows from column (row_start % 128) / 32 on (CUTLASS's N = 64 shift, generalized)
                _, _, row_start, _ = sched.coords(t, g, base)
                shift = (row_start % BLOCK_M) // 32
                tCtSFB_mma = cute.make_tensor(cute.recast_ptr(acc_ptr + sfb_col + shift, dtype=self.sf_dtype),
                                              tCtSFB_layout)
            acc_pipe.producer_acquire(acc_state)
            for kt in cutlass.range(self.k_tiles, unroll=1):
                ab_pipe.consumer_wait(ab_state)
                if cutlass.const_expr(not self.dense):
                    stage = (None, None, None, None, ab_state.index)
                    cute.copy(s2t_sfa, tCsSFA_s2t[stage], tCtSFA_s2t)
                    cute.copy(s2t_sfb, tCsSFB_s2t[stage], tCtSFB_s2t)
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, (kt != 0) | (kb != 0))
                    crd = (None, None, kb, ab_state.index)
                    if cutlass.const_expr(self.dense):
                        cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                    else:
                        sf_crd = (None, None, kb)
                        cute.gemm(tiled_mma, tCtAcc, [tCrA[crd], tCtSFA[sf_crd]], [tCrB[crd], tCtSFB_mma[sf_crd]],
                                  tCtAcc)
                ab_pipe.consumer_release(ab_state)
                ab_state.advance()
            acc_pipe.producer_commit(acc_state)
            acc_state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)
        acc_pipe.producer_tail(acc_state)

    def _s2t(self, sSF, tSF):
        """smem -> TMEM copy of one stage's scale factors (tcgen05.cp.4x32x128b), partitioned both sides."""
        sSF_compact = cute.filter_zeros(sSF)
        tSF_compact = cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), self.sf_dtype)
        tiled = tcgen05.make_s2t_copy(atom, tSF_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(sSF_compact))
        return tiled, src, thr.partition_D(tSF_compact)

    def epi_partition(self, tidx, tCtAcc_all):
        """This thread's share of the epilogue: the TMEM -> register copy (tcgen05.ld 32x32b, epi_cols columns), its
        source (T2R, T2R_M, T2R_N, #EPI_M, #EPI_N, ACC_STAGE), and the function that partitions an MMA-partitioned
        C-shaped tensor (tCgC, tCcC) the same way: (T2R, T2R_M, T2R_N, #EPI_M, #EPI_N, RestM, RestN, RestL).
        Traced on the host by tests/test_cute_gemm.py (which output element each register of a thread is)."""
        # (EPI_M, EPI_N, #EPI_M, #EPI_N, ACC_STAGE)
        tAcc_epi = cute.flat_divide(tCtAcc_all[((None, None), 0, 0, None)], self.epi_tile)
        t2r_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(self.cfg.epi_cols)),
                                       cutlass.Float32)
        t2r = tcgen05.make_tmem_copy(t2r_atom, tAcc_epi[(None, None, 0, 0, 0)])
        thr_t2r = t2r.get_slice(tidx)

        def part(tCxC):
            return thr_t2r.partition_D(cute.flat_divide(tCxC[((None, None), 0, 0, None, None, None)], self.epi_tile))

        return t2r, thr_t2r.partition_S(tAcc_epi), part

    @cute.jit
    def epilogue(self, sched, bidx, nctas, tidx, acc_pipe, acc_ptr, tCtAcc_fake, tCgC, tCcC, alpha, lo, m_indices,
                 row_weights):
        t2r, tTR_tAcc, epi_part = self.epi_partition(tidx, cute.make_tensor(acc_ptr, tCtAcc_fake.layout))
        tTR_gC, tTR_cC = epi_part(tCgC), epi_part(tCcC)
        tTR_rAcc = cute.make_rmem_tensor(tTR_gC[(None, None, None, 0, 0, 0, 0, 0)].shape, cutlass.Float32)
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.out_dtype)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.out_dtype, num_bits_per_copy=128)
        n_sub = cute.size(tTR_tAcc, mode=[4])

        acc_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.cfg.acc_stages)
        t = cutlass.Int32(bidx)
        g, base = sched.seek(t, cutlass.Int32(0), cutlass.Int32(0))
        while g < sched.num_groups:
            _, n_tile, row_start, row_end = sched.coords(t, g, base)
            _, _, _, (c_m, c_n) = self._tile(row_start, n_tile, g)
            gC = tTR_gC[(None, None, None, 0, None, c_m, c_n, 0)]
            cC = tTR_cC[(None, None, None, 0, None, c_m, c_n, 0)]
            row = cC[(0, 0, 0, 0)][0]  # default variant: this thread's accumulator row (its TMEM lane)
            if cutlass.const_expr(self.dense):
                # The launcher aligned the group's span down to a tile boundary: rows before the group's own first
                # row lo[g] belong to others, as do (contiguous layout) rows whose m_indices is not g. Per-row
                # values are loaded at the row clamped into the span (always in bounds), before any store
                keep = (row >= lo[g]) & (row < row_end)
                clamped = cutlass.min(row, row_end - 1)
                if cutlass.const_expr(m_indices is not None):
                    keep = keep & (m_indices[clamped] == g)
                scale = cutlass.Float32(1.0)
                if cutlass.const_expr(row_weights is not None):
                    scale = row_weights[clamped]
            else:
                scale = alpha[g]
                keep = row < row_end
            acc_pipe.consumer_wait(acc_state)
            tAcc = tTR_tAcc[(None, None, None, 0, None, acc_state.index)]
            for sub in cutlass.range_constexpr(n_sub):
                cute.copy(t2r, tAcc[(None, None, None, sub)], tTR_rAcc)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the registers are valid after it
                if cutlass.const_expr(self.dense and row_weights is None):
                    tTR_rC.store(tTR_rAcc.load().to(self.out_dtype))
                else:
                    tTR_rC.store((tTR_rAcc.load() * scale).to(self.out_dtype))
                if cutlass.const_expr(self.cfg.swap_ab):
                    # out^T: this thread's TMEM lane is one output column, its registers the tile's tokens (row
                    # stride N): 2-byte stores (a warp's 32 lanes write 64 contiguous bytes of a row), each on
                    # token < the group's end
                    gC_sub, cC_sub = gC[(None, None, None, sub)], cC[(None, None, None, sub)]
                    for i in cutlass.range_constexpr(cute.size(tTR_rC)):
                        if cC_sub[i][1] < row_end:
                            gC_sub[i] = tTR_rC[i]
                else:
                    # this thread's accumulator row (32x32b: one TMEM lane = one row per thread)
                    if keep:
                        cute.copy(store, tTR_rC, gC[(None, None, None, sub)])
            # every tcgen05.ld of this buffer has completed (waited above): hand it back to the MMA warp
            acc_pipe.consumer_release(acc_state)
            acc_state.advance()
            t = t + nctas
            g, base = sched.seek(t, g, base)


# --------------------------------------------------------------------------------------------- compile


def _fake_args(cfg: GemmConfig):
    g, n, k = cfg.num_groups, cfg.n, cfg.k
    i32 = cutlass.Int32
    starts = cute.runtime.make_fake_tensor(i32, (g,), stride=(1,), assumed_align=4)
    counts = cute.runtime.make_fake_tensor(i32, (g,), stride=(1,), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    if cfg.dense:
        # 16-bit operands; M any row count (one symbol: TVM-FFI checks they agree); lo = the groups' own first rows
        m = cute.sym_int()
        dt = getattr(cutlass, FORMATS[cfg.fmt].ab_dtype)
        a = cute.runtime.make_fake_tensor(dt, (m, k), stride=(k, 1), assumed_align=16)
        b = cute.runtime.make_fake_tensor(dt, (g, n, k), stride=(n * k, k, 1), assumed_align=16)
        out = cute.runtime.make_fake_tensor(dt, (m, n), stride=(n, 1), assumed_align=16)
        lo = cute.runtime.make_fake_tensor(i32, (g,), stride=(1,), assumed_align=4)
        ids = cute.runtime.make_fake_tensor(i32, (m,), stride=(1,), assumed_align=4) if cfg.m_indices else None
        rw = (cute.runtime.make_fake_tensor(cutlass.Float32, (m,), stride=(1,), assumed_align=4)
              if cfg.row_weights else None)
        return a, b, None, None, out, starts, counts, None, lo, ids, rw, stream
    # every activation row count is this one symbol (TVM-FFI checks they agree); the activation scale container has
    # its own, round_up(M, 128) rows
    m = cute.sym_int(divisibility=cfg.rows_per_tile)
    m_sf = cute.sym_int(divisibility=BLOCK_M)
    u8 = cutlass.Uint8
    kb4 = scale_layout.round_up(k // cfg.sf_vec, scale_layout.ATOM_KBLOCKS)
    a = cute.runtime.make_fake_tensor(u8, (m, k // 2), stride=(k // 2, 1), assumed_align=16)
    sfa = cute.runtime.make_fake_tensor(u8, (m_sf, kb4), stride=(kb4, 1), assumed_align=16)
    b = cute.runtime.make_fake_tensor(u8, (g, n, k // 2), stride=(n * k // 2, k // 2, 1), assumed_align=16)
    sfb = cute.runtime.make_fake_tensor(u8, (g, n, kb4), stride=(n * kb4, kb4, 1), assumed_align=16)
    out = cute.runtime.make_fake_tensor(cutlass.BFloat16, (m, n), stride=(n, 1), assumed_align=16)
    alpha = cute.runtime.make_fake_tensor(cutlass.Float32, (g,), stride=(1,), assumed_align=4)
    return a, b, sfa, sfb, out, starts, counts, alpha, None, None, None, stream


def build(cfg: GemmConfig, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options` e.g. keep/dump flags for SASS tests)."""
    kernel = GroupedBlockScaledGemmSm100(cfg)
    return cute.compile(kernel, *_fake_args(cfg),
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def dump(cfg: GemmConfig):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from .._sass import compile_and_dump

    return compile_and_dump(lambda extra: build(cfg, extra))
