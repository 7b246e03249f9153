"""Grouped (MoE) block-scaled FP4 GEMM for sm_100a: tcgen05 UMMA, TMEM accumulator, TMA loads; the same pipeline
with dense bf16 / fp16 operands (fmt "bf16" / "fp16", see "Dense formats" below).

COMPILED AND SASS-INSPECTED ONLY (tests/test_cute_gemm.py, CPU, CUTE_DSL_ARCH=sm_100a); never run on Blackwell
hardware. This module: the compile key and rule (Format, GemmConfig, can_implement, pick_config), build / compiled /
dump, and the backends of the sm_100 rows of `moe_gemm_blockscaled`, `moe_gemm_blockscaled_masked` and
`moe_gemm_bf16` ("Backends" below), refused unless LOWBIT_CUTE_UNVERIFIED=1. The kernel class is in
_blockscaled_sm100_kernel.py (imported by `build` only: it imports nvidia-cutlass-dsl).

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

Backends: the supports functions refuse them unless LOWBIT_CUTE_UNVERIFIED=1 (the rule every never-run CuTe row
follows, docs/cute.md). What runs on other chips is the contract reference (dispatch/reference/moe_gemm.py).
Layouts -> the kernel's groups (starts[g], counts[g]), built on the device (no host sync; graph-safe), as the sm_90
backends (grouped_sm90.py) build them:
* offsets [G + 1]: clamped to [0, M] and made non-decreasing (the contract), starts = offsets[:-1], counts = the
  differences.
* masked (E, max_m, K/2): a viewed as (E * max_m, K/2); starts = g * max_m, counts = clamp(masked_m, 0, max_m)
  (group_bounds.py's kernel). max_m a multiple of the tile's rows, so no tile reads past its group's rows.
The config (pick_config) takes the swap-AB variant when a group holds at most 64 rows (masked max_m, or M / G).
`moe_gemm_bf16` (the contract of dispatch/reference/moe_gemm.py: contiguous m_indices or masked masked_m, optional
row_weights): groups as group_bounds.py builds them, which start on any row; the
kernel is given each span aligned down to its 128-row tile (dense_bounds) and the group's own first row (`lo`), and
writes a row only inside [lo, end) and, contiguous, where m_indices[row] == g; rows are scaled by row_weights in the
epilogue. Anatomy: checks (triton_ops/contract/moe_gemm.py, run by the op) -> supports -> config and compile cache
-> entry.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from triton_ops.contract.arch import arch_of, device_index, sm_count
from triton_ops.contract.moe_gemm import blockscaled_views

from .. import _compile
from . import scale_layout
from .group_bounds import layout_groups

BLOCK_M = 128  # UMMA M (cta_group::1) = the scale atom's rows
MMA_K = 64  # K of one FP4 UMMA instruction
BLOCK_K = 4 * MMA_K  # K per pipeline stage: 128 bytes of FP4 per row = one 128B-swizzle row
SMEM_BYTES = 232448  # sm_100 per-CTA shared memory
SMEM_RESERVED = 2048  # mbarriers, the TMEM address slot, alignment slack


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


# --------------------------------------------------------------------------------------------- compile


def _fake_args(cfg: GemmConfig):
    import cutlass
    import cutlass.cute as cute

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
    import cutlass.cute as cute

    from ._blockscaled_sm100_kernel import GroupedBlockScaledGemmSm100  # imports nvidia-cutlass-dsl

    kernel = GroupedBlockScaledGemmSm100(cfg)
    return cute.compile(kernel, *_fake_args(cfg),
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def compiled(cfg):
    """The TVM-FFI callable for `cfg` (compiled once per process, cached on disk)."""
    return _compile.get_or_compile(cfg.key(), lambda: build(cfg))


def dump(cfg: GemmConfig):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from .._sass import compile_and_dump

    return compile_and_dump(lambda extra: build(cfg, extra))


# ------------------------------------------------------------------------- moe_gemm_blockscaled (FP4 operands)


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
    return pick_config(fmt, n, k, num_groups, sm_count=sms, arch=arch, rows_per_group=rows_per_group)


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
    dec(b[e]).T; other rows 0. Groups: starts = e * max_m, counts = the clamped masked_m (group_bounds.py)."""
    e, max_m, kh = a.shape
    _, _, starts, counts, _ = layout_groups(a, b, None, masked_m)
    a2, a_scale, b, b_scale = blockscaled_views(a.reshape(e * max_m, kh), a_scale, b, b_scale)
    out = _launch(a2, a_scale, b, b_scale, starts, counts, alpha, fmt, max_m)
    return out.view(e, max_m, b.shape[1])


# ------------------------------------------------------------------------- moe_gemm_bf16 (dense operands)


def dense_tile_n(n: int, rows_per_group: int) -> int:
    """Analytical: 256 output columns per tile when N allows and groups fill a 128-row tile, else 128."""
    return 256 if n % 256 == 0 and rows_per_group >= TILE_ROWS else 128


def dense_config(a, w, masked: bool, row_weights: bool, sms: int = 148, arch: str = "sm_100a"):
    """The kernel config of a moe_gemm_bf16 call (M / E rows per group for the contiguous layout)."""
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
    a2, ids, starts, counts, _ = layout_groups(a, w, m_indices, masked_m)
    out = torch.zeros(a2.shape[0], n, dtype=a.dtype, device=a.device)
    if a2.shape[0] and n:
        index = device_index(a.device)
        cfg = dense_config(a, w, masked, row_weights is not None, sm_count(index), _compile.target_arch(index))
        rw = None if row_weights is None else row_weights.reshape(-1).contiguous()
        tile_starts, tile_counts = dense_bounds(starts, counts)
        _compile.launch(compiled(cfg), a2, w, None, None, out, tile_starts, tile_counts, None, starts.contiguous(),
                        ids, rw, device=a.device)
    return out.view(*a.shape[:-1], n)
