"""cute_ops/gemm: the 128x4 scale layout, the grouped tile scheduler, and the sm_100a block-scaled grouped GEMM.

CPU, no DSL needed: the scale layout's byte offsets vs the contract's `swizzle_scales_128x4` (bit for bit), the
scheduler's Python model (every tile exactly once, in the documented order, rows inside their group), the torch
twin of the GEMM vs the contract's dequantizers.
CPU, nvidia-cutlass-dsl (skipped with the reason without it): the CuTe form of the scale layout traced and
evaluated vs the same offsets; the kernel compiled for sm_100a (no GPU: `--gpu-arch`), default and swap-AB
variants, and its SASS checked for the block-scaled UMMA, the tcgen05 commit barrier, TMEM loads, TMA loads, the
scale-factor TMEM copies, the epilogue's stores, no spills and no device-side descriptor rewrites.
GPU (`-m gpu`, Blackwell only): bytes vs the torch twin. NEVER RUN: no Blackwell GPU has been available.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from cute_ops.gemm import scale_layout as sl
from cute_ops.gemm import scheduler as sch
from tests.helpers import assert_close, fp4_grouped_operands

try:  # module level: the traced function's annotations (cutlass.Constexpr) are resolved in these globals
    import cutlass
    import cutlass.cute as cute
except Exception:  # noqa: BLE001 - optional dependency: the DSL tests skip with the reason
    cutlass = cute = None

HAVE_DSL = cute is not None
needs_dsl = pytest.mark.skipif(not HAVE_DSL, reason="nvidia-cutlass-dsl not installed: pip install 'lowbit[cute]'")


# ------------------------------------------------------------------------------------- scale layout (CPU)


@pytest.mark.parametrize("rows,kblocks", [(1, 1), (7, 3), (128, 4), (130, 7), (256, 16), (300, 45), (513, 8)])
def test_scale_offsets_equal_reference_swizzle(rows, kblocks):
    from dispatch.reference.quant import swizzle_scales_128x4, unswizzle_scales_128x4

    g = torch.Generator().manual_seed(rows * 1000 + kblocks)
    x = torch.randint(0, 256, (rows, kblocks), dtype=torch.uint8, generator=g)
    want = swizzle_scales_128x4(x)
    assert sl.swizzled_shape(rows, kblocks) == tuple(want.shape)
    assert torch.equal(sl.swizzle(x), want)  # scatter through swizzled_offset, zero padding included
    r, k = torch.arange(rows)[:, None], torch.arange(kblocks)[None, :]
    off = sl.swizzled_offset(r, k, kblocks)
    assert torch.equal(want.reshape(-1)[off], x)  # gather through it
    assert off.unique().numel() == rows * kblocks  # one byte per scale
    assert torch.equal(unswizzle_scales_128x4(want, rows, kblocks), x)


def test_scale_atom_tuples_are_the_offsets():
    """ATOM_SHAPE / ATOM_STRIDE (what the CuTe layout is built from) evaluate to the same bytes inside one atom."""
    for row in range(sl.ATOM_ROWS):
        for kb in range(sl.ATOM_KBLOCKS):
            assert sl.crd2idx((row, kb), sl.ATOM_SHAPE, sl.ATOM_STRIDE) == int(sl.swizzled_offset(row, kb, 4))


# ---------------------------------------------------------------------------------------- scheduler (CPU)


def _offsets(extents, align=1):
    out = [0]
    for e in extents:
        out.append(out[-1] + -(-e // align) * align)
    return out


def test_scheduler_order_small():
    # groups of 200, 0, 128 rows; block 128; 2 column tiles -> g0: 2 row tiles, g1: none, g2: 1
    offs = [0, 200, 200, 328]
    tiles = [sch.tile_of(t, offs, 128, 2) for t in range(sch.total_tiles(offs, 128, 2))]
    assert [(t.group, t.m_tile, t.n_tile) for t in tiles] == [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1),
                                                                 (2, 0, 0), (2, 0, 1)]
    assert [(t.row_start, t.row_end) for t in tiles] == [(0, 200), (128, 200), (0, 200), (128, 200),
                                                          (200, 328), (200, 328)]
    assert sch.tile_of(6, offs, 128, 2) is None


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("grid", [1, 3, 148])
def test_scheduler_persistent_walk_covers_every_tile_once(seed, grid):
    rng = random.Random(seed)
    groups = rng.choice([1, 4, 32, 256])
    extents = [rng.choice([0, 0, 1, 5, 127, 128, 129, 300, 1024]) for _ in range(groups)]
    align = rng.choice([1, 128])  # 128: moe_align(block_m=128) offsets, as the block-scaled kernel needs
    offs = _offsets(extents, align)
    n_tiles = rng.choice([1, 3, 16])
    total = sch.total_tiles(offs, 128, n_tiles)
    assert total == sum(sch.group_m_tiles(offs, 128)) * n_tiles
    linear = [sch.tile_of(t, offs, 128, n_tiles) for t in range(total)]
    assert sch.tile_of(total, offs, 128, n_tiles) is None
    walked = {}
    for cta in range(grid):
        for i, tile in enumerate(sch.cta_tiles(cta, grid, offs, 128, n_tiles)):
            t = cta + i * grid  # static stride
            assert tile == linear[t], (cta, i)
            walked[t] = tile
    assert sorted(walked) == list(range(total))
    seen = {(t.group, t.m_tile, t.n_tile) for t in linear}
    assert len(seen) == total
    for t in linear:
        lo, hi = offs[t.group], offs[t.group + 1]
        assert t.row_start == lo + 128 * t.m_tile and lo <= t.row_start < hi and t.row_end == hi
        assert 0 <= t.n_tile < n_tiles
        if align == 128:
            assert t.row_start % 128 == 0


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [32, 64, 128])
def test_scheduler_masked_tiles_stay_in_their_allocation(seed, block):
    """The sm_100 kernel's masked groups (starts g * max_m, counts clamped to [0, max_m], max_m a multiple of the
    tile's rows): every tile starts on a tile boundary of its own group's allocation and ends inside it, so a tile
    reads no other group's rows; the rows it may write end at the count."""
    rng = random.Random(seed)
    e, max_m = rng.choice([1, 4, 32]), block * rng.choice([1, 2, 3])
    counts = [min(max(rng.choice([-2, 0, 1, block - 1, block, max_m, max_m + 5]), 0), max_m) for _ in range(e)]
    starts = [g * max_m for g in range(e)]
    grid = rng.choice([1, 7, 148])
    tiles = [t for cta in range(grid) for t in sch.cta_tiles_bounded(cta, grid, starts, counts, block, 2)]
    assert len(tiles) == sum(-(-c // block) for c in counts) * 2
    for t in tiles:
        lo = t.group * max_m
        assert t.row_start % block == 0 and lo <= t.row_start and t.row_start + block <= lo + max_m
        assert t.row_end == lo + counts[t.group] and t.row_start < t.row_end


# ------------------------------------------------------------------------------------ torch twin (CPU)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_reference_matches_contract_dequantizers(fmt):
    from dispatch.reference.moe_gemm import grouped_blockscaled_gemm

    g, n, k = 3, 128, 256
    offs = [0, 128, 128, 384]  # group 1 empty; M = 384 rows
    a, sfa, b, sfb, deq_a, deq_b = fp4_grouped_operands(fmt, offs[-1], g, n, k)
    alpha = torch.tensor([0.5, 2.0, 1.0])
    got = grouped_blockscaled_gemm(a, sfa.view(torch.uint8), b, sfb, torch.tensor(offs, dtype=torch.int32), alpha,
                                   fmt)
    for e in range(g):
        lo, hi = offs[e], offs[e + 1]
        want = (alpha[e] * (deq_a[lo:hi] @ deq_b[e].T)).to(torch.bfloat16)
        assert torch.equal(got[lo:hi], want), e


# -------------------------------------------------------------------------------- DSL: CuTe scale layout


@needs_dsl
@pytest.mark.parametrize("sf_vec,rows,k,groups", [(16, 256, 128, 2), (32, 128, 256, 3), (16, 384, 64, 1)])
def test_cute_scale_layout_equals_offsets(sf_vec, rows, k, groups):
    """The layout the kernel builds its SFA / SFB tensors and TMA descriptors from, traced at compile time (static
    shape -> Python ints), maps element (row, k, group) to the byte swizzled_offset gives, group after group."""
    got = {}

    @cute.jit
    def trace(sf_vec: cutlass.Constexpr, rows: cutlass.Constexpr, k: cutlass.Constexpr, groups: cutlass.Constexpr):
        lay = sl.scale_tensor_layout((rows, k, groups), sf_vec)
        got["shape"], got["stride"] = lay.shape, lay.stride

    cute.compile(trace, sf_vec, rows, k, groups)
    shape, stride = got["shape"], got["stride"]
    kblocks = k // sf_vec
    r, kk = torch.arange(rows)[:, None], torch.arange(k)[None, :]
    want = sl.swizzled_offset(r, kk // sf_vec, kblocks)
    per_group = rows * sl.round_up(kblocks, 4)
    for g in range(groups):
        for row in range(rows):
            for col in range(0, k, 3):
                assert sl.crd2idx((row, col, g), shape, stride) == g * per_group + int(want[row, col]), (row, col, g)


# ------------------------------------------------------------------------------------- DSL: sm_100a SASS


# (format, tile_n, N, K, groups): DeepSeek-V3 GEMM1 / GEMM2 shapes (256 experts) and small ones
SASS_CASES = [("nvfp4", 128, 4096, 7168, 256), ("mxfp4", 128, 512, 1024, 8), ("nvfp4", 256, 7168, 2048, 256),
              ("mxfp4", 256, 2048, 4096, 32)]


# swap-AB (decode): (format, token tile, N, K, groups, True): DeepSeek-V3 GEMM1 at 32 / 64 tokens per expert, small
SWAP_CASES = [("nvfp4", 32, 4096, 7168, 256, True), ("mxfp4", 64, 512, 1024, 8, True),
              ("nvfp4", 64, 7168, 2048, 256, True)]


def _cfg(fmt, tile_n, n, k, groups, swap_ab=False):
    from cute_ops.gemm.blockscaled_sm100 import pick_config

    return pick_config(fmt, n, k, groups, tile_n=tile_n, arch="sm_100a", swap_ab=swap_ab)


@needs_dsl
def test_config_refusals():
    from cute_ops.gemm.blockscaled_sm100 import can_implement, pick_config

    assert can_implement("nvfp4", 4096, 7168, 256) is None
    assert "multiple of 256" in can_implement("mxfp4", 2880, 2880, 128)  # GPT-OSS K: not yet
    assert "multiple of tile_n" in can_implement("nvfp4", 192, 1024, 8)
    assert "format" in can_implement("fp8", 512, 1024, 8)
    with pytest.raises(ValueError):
        pick_config("nvfp4", 512, 1000, 8)
    cfg = pick_config("nvfp4", 4096, 7168, 256)
    assert (cfg.tile_n, cfg.acc_stages, cfg.ab_stages) == (128, 2, 6)
    assert pick_config("nvfp4", 4096, 7168, 256, tile_n=256).acc_stages == 1
    # swap-AB: token tiles 32 / 64, N a multiple of the 128 weight rows on the UMMA M side
    assert "tile_n=16" in can_implement("nvfp4", 4096, 7168, 256, 16, swap_ab=True)
    assert "multiple of 128" in can_implement("nvfp4", 192, 7168, 256, 64, swap_ab=True)
    assert can_implement("nvfp4", 4096, 7168, 256, 32, swap_ab=True) is None


@needs_dsl
@pytest.mark.parametrize("rows,want", [(None, (False, 128)), (16, (True, 32)), (32, (True, 32)), (48, (True, 64)),
                                       (64, (True, 64)), (65, (False, 128)), (4096, (False, 128))])
def test_swap_ab_rule(rows, want):
    """pick_config's static rule: swap-AB with a 32-token tile up to 32 rows per group, 64 up to 64, else the
    128-row tile."""
    from cute_ops.gemm.blockscaled_sm100 import pick_config

    cfg = pick_config("nvfp4", 4096, 7168, 256, rows_per_group=rows)
    assert (cfg.swap_ab, cfg.tile_n) == want
    assert cfg.rows_per_tile == (cfg.tile_n if cfg.swap_ab else 128)
    assert cfg.cols_per_tile == (128 if cfg.swap_ab else cfg.tile_n)


@needs_dsl
@pytest.mark.parametrize("swap_ab,tile_n", [(False, 128), (False, 256), (True, 32), (True, 64)])
def test_epilogue_thread_owns_one_accumulator_row(swap_ab, tile_n):
    """The epilogue's partition (the kernel's own `epi_partition`) traced on the host over an identity C tensor:
    thread t's registers of epilogue step s in C tile (i, j) are C[i * 128 + t, j * tile_n + s * 32 + r], r < 32.
    C is out (rows x columns) by default; with swap_ab it is out^T, so thread t holds output column i * 128 + t
    for 32 consecutive tokens, each stored to out[token, column] predicated on the token."""
    from cute_ops.gemm._blockscaled_sm100_kernel import GroupedBlockScaledGemmSm100
    from cute_ops.gemm.blockscaled_sm100 import BLOCK_M, pick_config

    cfg = pick_config("nvfp4", 512, 512, 2, tile_n=tile_n, swap_ab=swap_ab)
    kern = GroupedBlockScaledGemmSm100(cfg)
    got = {}
    tile_i, tile_j = 1, 2

    @cute.jit
    def trace(tidx: cutlass.Constexpr):
        tiled_mma = cute.make_tiled_mma(kern._mma_op(cfg.tile_n))
        acc = tiled_mma.make_fragment_C(cute.append(tiled_mma.partition_shape_C(kern.tile[:2]), cfg.acc_stages))
        ident = cute.make_identity_tensor((4 * BLOCK_M, 4 * cfg.tile_n, 1))
        tCcC = tiled_mma.get_slice(0).partition_C(
            cute.local_tile(ident, cute.slice_(kern.tile, (None, None, 0)), (None, None, None)))
        _, _, part = kern.epi_partition(tidx, acc)
        cC = part(tCcC)
        for s_ in cutlass.range_constexpr(cute.size(cC, mode=[4])):
            step = cC[(None, None, None, 0, s_, tile_i, tile_j, 0)]
            got[(tidx, s_)] = [tuple(step[i][:2]) for i in range(cute.size(step))]

    for t in (0, 31, 32, 77, 127):
        cute.compile(trace, t)
        for s_ in range(tile_n // cfg.epi_cols):
            want = [(tile_i * BLOCK_M + t, tile_j * tile_n + s_ * cfg.epi_cols + r) for r in range(cfg.epi_cols)]
            assert got[(t, s_)] == want, (t, s_)


@needs_dsl
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_swap_ab_token_scale_column_shift(fmt):
    """The swap-AB MMA reads its token scales from TMEM column (row_start % 128) / 32 on. That holds if the DSL's
    TMEM layout of the N-side scales (traced here for 32 / 64 / 128-token tiles: the same layout, built from the
    whole 128-row atom) puts row 32 c + l of the atom at lane l, column c (4 bytes per column)."""
    import cutlass.utils.blockscaled_layout as bl

    from cute_ops.gemm._blockscaled_sm100_kernel import GroupedBlockScaledGemmSm100
    from cute_ops.gemm.blockscaled_sm100 import BLOCK_M, pick_config

    got = {}
    for tile_n in (32, 64, 128):
        kern = GroupedBlockScaledGemmSm100(pick_config(fmt, 256, 512, 2, tile_n=tile_n, swap_ab=tile_n < 128))

        @cute.jit
        def trace():
            tiled_mma = cute.make_tiled_mma(kern._mma_op(kern.cfg.tile_n))  # noqa: B023 - traced right here
            smem = bl.make_smem_layout_sfb(tiled_mma, kern.tile, kern.sf_vec, 1)  # noqa: B023
            lay = bl.make_tmem_layout_sfb(tiled_mma, kern.tile, kern.sf_vec,  # noqa: B023
                                          cute.slice_(smem, (None, None, None, 0)))
            got["layout"] = (lay.shape, lay.stride)

        cute.compile(trace)
        got[tile_n] = got.pop("layout")
    assert got[32] == got[64] == got[128]
    shape, stride = got[128]
    (rows_shape, _), (rows_stride, _) = shape[0][0], stride[0][0]  # ((32, 4), 4 copies): row modes
    lane = rows_stride[0]
    for r in range(BLOCK_M):
        assert sl.crd2idx(r, rows_shape, rows_stride) == (r % 32) * lane + (r // 32) * 4, r


_DUMPS: dict = {}


def _dump(case):
    from cute_ops.gemm.blockscaled_sm100 import dump

    if case not in _DUMPS:  # one compile per config per test process (~1-2 s each)
        _DUMPS[case] = dump(_cfg(*case))
    return _DUMPS[case]


@needs_dsl
@pytest.mark.parametrize("case", SASS_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm100_blockscaled_grouped_gemm_sass(case):
    from cute_ops.gemm.blockscaled_sm100 import BLOCK_K, MMA_K

    fmt, tile_n = case[:2]
    cfg = _cfg(*case)
    d = _dump(case)
    assert "sm_100a" in d.ptx.split(".target", 1)[1][:40]
    ops = d.opcodes()
    # Block-scaled FP4 UMMA: the DSL emits UTCOMMA (never UTCQMMA, the f8f6f4 kind, nor UTCHMMA) for both formats:
    # NVFP4 as UTCOMMA.4X (scale vector 16: 4 scales per 64-wide K), MXFP4 as plain UTCOMMA (vector 32).
    # One per 64-wide K slice of a 256-wide stage (the K loop is not unrolled).
    assert d.count("UTCOMMA") == BLOCK_K // MMA_K, ops
    assert d.count("UTCQMMA") == 0 and d.count("UTCHMMA") == 0, ops
    assert (ops["UTCOMMA.4X"] == BLOCK_K // MMA_K) == (fmt == "nvfp4"), ops
    block = "block16" if fmt == "nvfp4" else "block32"
    assert f"tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.{block}" in d.ptx
    # tcgen05.commit -> mbarrier: the smem stage release and the accumulator hand-off to the epilogue
    assert d.count("UTCBAR") >= 2, ops
    # TMEM -> registers in the epilogue: one 32x32b.x32 load per 32-column slice of the tile
    assert d.count("LDTM") == tile_n // cfg.epi_cols, ops
    assert d.ptx.count("tcgen05.wait::ld") >= tile_n // cfg.epi_cols  # each load waited before its registers
    # TMA loads: A, B (3-D: the group is a coordinate), SFA, SFB; descriptors prefetched
    assert d.count("UTMALDG") == 4, ops
    _assert_no_descriptor_update(d)
    # scale factors smem -> TMEM before the MMAs
    assert d.count("UTCCP") > 0, ops
    # bf16 epilogue: 16-byte stores of each thread's row, times alpha, converted with F2FP.BF16
    assert d.count("STG.E.128") == tile_n * 2 // 16, ops
    assert d.count("STG") == d.count("STG.E.128"), ops
    assert d.count("F2FP.BF16") > 0, ops
    # no register spills
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops


def _assert_no_descriptor_update(d):
    """Groups are tile coordinates in one descriptor per operand: the four descriptors are prefetched
    (UTMACCTL.PF) and never rewritten (no tensormap.replace / tensormap proxy fences, no UTMACCTL.IV), unlike the
    sm_90 grouped GEMM's per-group A descriptor."""
    ops = d.opcodes()
    assert ops["UTMACCTL.PF"] == 4 and d.count("UTMACCTL") == 4, ops
    assert "tensormap.replace" not in d.ptx and "fence.proxy.tensormap" not in d.ptx


@needs_dsl
@pytest.mark.parametrize("case", SWAP_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm100_swap_ab_sass(case):
    """Swap-AB: out^T tiles = B[g] (128 weight rows, UMMA M) x the group's tokens (UMMA N = 32 / 64), the weight
    scales on the M side and the token scales (whole 128-row atoms, read from the tile's TMEM column) on the N
    side; the epilogue stores out[token, n] transposed back."""
    from cute_ops.gemm.blockscaled_sm100 import BLOCK_K, MMA_K

    fmt, tokens = case[:2]
    d = _dump(case)
    assert "sm_100a" in d.ptx.split(".target", 1)[1][:40]
    ops = d.opcodes()
    assert d.count("UTCOMMA") == BLOCK_K // MMA_K and d.count("UTCQMMA") == 0 and d.count("UTCHMMA") == 0, ops
    assert (ops["UTCOMMA.4X"] == BLOCK_K // MMA_K) == (fmt == "nvfp4"), ops
    block = "block16" if fmt == "nvfp4" else "block32"
    assert f"tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.{block}" in d.ptx
    assert d.count("UTCBAR") >= 2, ops
    # TMEM loads of 32 tokens each: thread i = output column i, its registers = 32 of the tile's tokens
    assert d.count("LDTM") == tokens // 32, ops
    assert "tcgen05.ld.sync.aligned.32x32b.x32.b32" in d.ptx
    assert d.count("UTMALDG") == 4 and d.count("UTCCP") > 0, ops
    _assert_no_descriptor_update(d)
    # transposed stores: one 2-byte store per token of the tile (each predicated on the group's end), nothing else
    assert ops["STG.E.U16"] == tokens and d.count("STG") == tokens, ops
    assert d.count("F2FP.BF16") > 0, ops
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops


@needs_dsl
def test_sm100_sass_counts_report(capsys):
    """Prints the instruction counts docs/cute.md records (not asserted beyond the test above)."""
    rows = []
    for case in SASS_CASES + SWAP_CASES:
        d = _dump(case)
        names = ("UTCOMMA.4X", "UTCOMMA", "UTCBAR", "LDTM", "UTMALDG.2D", "UTMALDG.3D", "UTMALDG.4D",
                 "UTCCP.T.S.4", "UTMACCTL.PF", "STG.E.128", "STG.E.U16", "F2FP.BF16.F32.PACK_AB")
        ops = d.opcodes()
        head = "{} tile_n={} N={} K={} G={}".format(*case[:5]) + (" swap-AB" if len(case) > 5 else "")
        rows.append(head + ": " + ", ".join(f"{n} {ops.get(n, 0)}" for n in names))
    with capsys.disabled():
        print("\n[sm_100a grouped block-scaled GEMM SASS]\n  " + "\n  ".join(rows))


# ------------------------------------------------------------------------------------ GPU (never run)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, {"swap_ab": True, "tile_n": 32}, {"swap_ab": True, "tile_n": 64}],
                         ids=["default", "swap32", "swap64"])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_blackwell_matches_reference(fmt, variant):
    """NEVER RUN (no Blackwell GPU available): the kernel (default and swap-AB tiles, groups as starts + counts of
    128-aligned offsets) vs the torch twin on a small MoE problem."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs an sm_100 GPU")
    pytest.importorskip("cutlass")
    from cute_ops.gemm.blockscaled_sm100 import build, pick_config
    from dispatch.reference.moe_gemm import grouped_blockscaled_gemm

    torch.manual_seed(0)
    g, n, k = 4, 256, 512
    offs = torch.tensor(_offsets([130, 0, 300, 5], 128), dtype=torch.int32)
    m = int(offs[-1]) + 128  # capacity past the last group: rows nobody writes
    kb4 = sl.round_up(k // (16 if fmt == "nvfp4" else 32), 4)
    a = torch.randint(0, 256, (m, k // 2), dtype=torch.uint8)
    b = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8)
    # scale bytes in a tame range (E4M3 0x30-0x3f ~ 0.5-1; E8M0 124-130)
    lo, hi = (0x30, 0x40) if fmt == "nvfp4" else (124, 131)
    sfa = torch.randint(lo, hi, (m, kb4), dtype=torch.uint8)
    sfb = torch.randint(lo, hi, (g, n, kb4), dtype=torch.uint8)
    alpha = torch.tensor([1.0, 2.0, 0.5, 1.0])
    want = grouped_blockscaled_gemm(a, sfa, b, sfb, offs, alpha, fmt,
                                    out=torch.full((m, n), 7.0, dtype=torch.bfloat16))
    fn = build(pick_config(fmt, n, k, g, **variant))
    dev = [t.cuda() for t in (a, b, sfa, sfb)]
    out = torch.full((m, n), 7.0, dtype=torch.bfloat16, device="cuda")
    starts, counts = offs[:-1].contiguous(), (offs[1:] - offs[:-1]).contiguous()
    fn(*dev, out, starts.cuda(), counts.cuda(), alpha.cuda(), None, None, None)
    torch.cuda.synchronize()
    assert_close(out.cpu(), want, "grouped block-scaled GEMM")


# ------------------------------------------------------- dense bf16 / fp16 variant (moe_gemm_bf16 on sm_100)

# (format, tile_n, N, K, groups, m_indices, row_weights): DeepSeek-V3 GEMM1 (contiguous, row weights) and GEMM2
# (masked), and a small fp16 one
DENSE_CASES = [("bf16", 128, 4096, 7168, 256, True, True), ("bf16", 256, 7168, 2048, 256, False, False),
               ("fp16", 128, 512, 1000, 8, True, False)]


def _dense_cfg(fmt, tile_n, n, k, groups, m_indices, row_weights):
    from cute_ops.gemm.blockscaled_sm100 import pick_config

    return pick_config(fmt, n, k, groups, tile_n=tile_n, arch="sm_100a", m_indices=m_indices,
                       row_weights=row_weights)


def test_dense_config_rules():
    from cute_ops.gemm.blockscaled_sm100 import can_implement, pick_config, stage_bytes

    cfg = pick_config("bf16", 4096, 7168, 256, rows_per_group=16)  # never swap-AB; 2 accumulators at either tile
    assert not cfg.swap_ab and cfg.dense and cfg.acc_stages == 2 and cfg.rows_per_tile == 128
    assert cfg.ab_stages == 7 and stage_bytes("bf16", 128) == 256 * 128
    assert pick_config("fp16", 7168, 2048, 8, tile_n=256).ab_stages == 4
    assert can_implement("bf16", 4096, 1004, 8) is not None  # 16-byte TMA rows
    assert can_implement("bf16", 4096, 1000, 8) is None  # partial last stage: zero-filled
    assert can_implement("bf16", 4096, 1024, 8, 32, swap_ab=True) is not None
    with pytest.raises(ValueError):
        pick_config("nvfp4", 4096, 7168, 8, row_weights=True)


@needs_dsl
@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm100_dense_grouped_gemm_sass(case):
    """The same pipeline without scale factors: tcgen05.mma kind::f16 (UTCHMMA), 4 per 64-wide K stage, A and B TMA
    loads only (no UTCCP), TMEM -> registers, 16-byte stores in the operand dtype, no spills."""
    from cute_ops.gemm.blockscaled_sm100 import dump

    fmt, tile_n = case[:2]
    if case not in _DUMPS:
        _DUMPS[case] = dump(_dense_cfg(*case))
    d = _DUMPS[case]
    assert "sm_100a" in d.ptx.split(".target", 1)[1][:40]
    ops = d.opcodes()
    assert "tcgen05.mma.cta_group::1.kind::f16" in d.ptx and "block_scale" not in d.ptx
    assert ops["UTCHMMA"] == 4 and d.count("UTCHMMA") == 4, ops
    # the instruction descriptor (PTX immediates; the runtime negate-A bit selects between two): D fp32 (1), A and
    # B bf16 (1) / fp16 (0), both K-major, N = tile_n, M = 128
    code = 1 if fmt == "bf16" else 0
    idescs = [int(v) for pair in re.findall(r"selp\.b32\s+%r\d+, (\d+), (\d+), %p\d+;", d.ptx) for v in pair
              if int(v) >> 24 & 31 == 128 >> 4 and int(v) >> 17 & 63 == tile_n >> 3]
    assert idescs, "no instruction descriptor found"
    for v in idescs:
        assert (v >> 4 & 3, v >> 7 & 7, v >> 10 & 7, v >> 15 & 3) == (1, code, code, 0), bin(v)
    assert d.count("UTCOMMA") == 0 and d.count("UTCQMMA") == 0 and d.count("UTCCP") == 0, ops
    assert d.count("UTCBAR") >= 2, ops
    assert d.count("LDTM") == tile_n // 32, ops
    assert d.ptx.count("tcgen05.wait::ld") >= tile_n // 32
    # A (2-D) and B (3-D: the group is a coordinate), both descriptors prefetched and never rewritten
    assert ops["UTMALDG.2D"] == 1 and ops["UTMALDG.3D"] == 1 and d.count("UTMALDG") == 2, ops
    assert ops["UTMACCTL.PF"] == 2 and d.count("UTMACCTL") == 2, ops
    assert "tensormap.replace" not in d.ptx and "fence.proxy.tensormap" not in d.ptx
    assert d.count("STG.E.128") == tile_n * 2 // 16 and d.count("STG") == d.count("STG.E.128"), ops
    assert d.count("F2FP.BF16" if fmt == "bf16" else "F2FP.F16") > 0, ops
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops


def _dense_kernel_model(cfg):
    """The dense kernel's contract in torch with its preconditions asserted (what blockscaled_sm100.moe_gemm_bf16 must
    feed it): tile-aligned spans (starts multiples of 128, same ends), rows written only in [lo, end) and, contiguous,
    where m_indices[row] == g."""
    def run(a, w, sfa, sfb, out, starts, counts, alpha, lo, m_indices, row_weights):
        rows, (e, n, k) = a.shape[0], w.shape
        assert (cfg.n, cfg.k, cfg.num_groups, cfg.dense) == (n, k, e, True) and out.shape == (rows, n)
        assert sfa is None and sfb is None and alpha is None and out.dtype == a.dtype == w.dtype
        assert all(t.dtype == torch.int32 and t.shape == (e,) and t.is_contiguous() for t in (starts, counts, lo))
        assert (m_indices is not None) == cfg.m_indices and (row_weights is not None) == cfg.row_weights
        for g in range(e):
            s0, c, first = int(starts[g]), int(counts[g]), int(lo[g])
            assert c >= 0 and s0 % 128 == 0, (g, s0)
            if c == 0:
                continue
            assert s0 <= first < s0 + c <= rows and first - s0 < 128, (g, s0, c, first)
            for r in range(first, s0 + c):
                if m_indices is None or int(m_indices[r]) == g:
                    y = a[r].float() @ w[g].float().T
                    out[r] = (y * row_weights[r] if row_weights is not None else y).to(out.dtype)

    return run


@pytest.mark.parametrize("row_weights", [False, True])
def test_dense_launcher_matches_reference_on_a_kernel_model(monkeypatch, row_weights):
    """blockscaled_sm100.moe_gemm_bf16 on CPU tensors with the compiled kernel replaced by the model above: unaligned
    contiguous groups (moe_align padding, an out-of-range id, interleaved experts) and masked max_m not a multiple
    of 128 (counts above max_m, negative) equal the reference; NaN rows no group owns are never written."""
    from cute_ops.gemm import blockscaled_sm100
    from tests.test_cute_gemm_sm90 import _check, _contiguous_case, _masked_case, stub_cuda_launch

    stub_cuda_launch(monkeypatch, blockscaled_sm100, _dense_kernel_model, "sm_100a")
    monkeypatch.setattr(blockscaled_sm100, "sm_count", lambda index: 148)
    a, w, mi, rw = _contiguous_case(5, 128, 64, [37, 0, 130, 1, 200], torch.bfloat16, 2, row_weights)
    out = blockscaled_sm100.moe_gemm_bf16(a, w, mi, None, rw)
    assert not torch.isnan(out).any()
    _check(out, a, w, mi, None, rw, "contiguous")
    a, w, mm, rw = _masked_case(6, 100, 256, 48, [0, 1, 99, 100, 500, -3], torch.float16, 1, row_weights)
    out = blockscaled_sm100.moe_gemm_bf16(a, w, None, mm, rw)
    assert not torch.isnan(out).any()
    _check(out, a, w, None, mm, rw, "masked")
    g = torch.Generator().manual_seed(5)  # interleaved experts: overlapping spans
    mi = torch.randint(-1, 4, (300,), generator=g, dtype=torch.int32)
    a, w = torch.randn(300, 32, generator=g).bfloat16(), torch.randn(4, 128, 32, generator=g).bfloat16()
    _check(blockscaled_sm100.moe_gemm_bf16(a, w, mi, None, None), a, w, mi, None, None, "interleaved")


def test_dense_bounds_and_refusals(monkeypatch):
    from cute_ops.gemm import blockscaled_sm100

    starts, counts = torch.tensor([0, 130, 300, 5], dtype=torch.int32), torch.tensor([130, 0, 45, 0],
                                                                                     dtype=torch.int32)
    s, c = blockscaled_sm100.dense_bounds(starts, counts)
    assert s.tolist() == [0, 128, 256, 0] and c.tolist() == [130, 0, 89, 0]
    a, w = torch.zeros(64, 256, dtype=torch.bfloat16), torch.zeros(2, 256, 256, dtype=torch.bfloat16)
    mi = torch.zeros(64, dtype=torch.int32)
    monkeypatch.delenv(blockscaled_sm100.UNVERIFIED_ENV, raising=False)
    assert "never run on a Blackwell chip" in blockscaled_sm100.supports_moe_gemm_bf16(a, w, mi, None)
    monkeypatch.setenv(blockscaled_sm100.UNVERIFIED_ENV, "1")
    assert "sm_100" in blockscaled_sm100.supports_moe_gemm_bf16(a, w, mi, None)  # CPU tensors: not this kernel's device
    assert blockscaled_sm100.dense_tile_n(4096, 256) == 256 and blockscaled_sm100.dense_tile_n(4096, 16) == 128
    assert blockscaled_sm100.dense_tile_n(384, 256) == 128


def test_dense_row_on_blackwell_fake_tensors(monkeypatch):
    """(Fake) sm_100 CUDA tensors of DeepSeek-V3 shapes: the row refuses without the opt-in (auto stays on Triton),
    takes both layouts with it, and `backend="cute"` selects the sm_100 row (not the sm_90 one)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from cute_ops.gemm import blockscaled_sm100
    from dispatch.ops._common import backend_for
    from dispatch.registry import select
    from dispatch.table import TABLE

    monkeypatch.setenv("LOWBIT_ARCH", "sm_100")
    monkeypatch.setattr(FakeTensor, "data_ptr", lambda self: (1 << 20) + self.storage_offset() * self.element_size())
    bf, i32 = torch.bfloat16, torch.int32
    with FakeTensorMode(allow_non_fake_inputs=True):
        def E(*shape, dt=bf):
            return torch.empty(*shape, dtype=dt, device="cuda")

        a, w, mi = E(8192, 7168), E(256, 4096, 7168), E(8192, dt=i32)
        a3, w2, mm, rw = E(256, 64, 2048), E(256, 7168, 2048), E(256, dt=i32), E(256, 64, dt=torch.float32)
        monkeypatch.delenv(blockscaled_sm100.UNVERIFIED_ENV, raising=False)
        assert blockscaled_sm100.supports_moe_gemm_bf16(a, w, mi, None) == blockscaled_sm100.DENSE_HARDWARE_STATUS
        assert backend_for("moe_gemm_bf16", a, w, mi, None, None) == "triton"
        monkeypatch.setenv(blockscaled_sm100.UNVERIFIED_ENV, "1")
        assert blockscaled_sm100.supports_moe_gemm_bf16(a, w, mi, None) is None
        assert blockscaled_sm100.supports_moe_gemm_bf16(a3, w2, None, mm, rw) is None
        assert "tile_n" in blockscaled_sm100.supports_moe_gemm_bf16(E(64, 512), E(8, 200, 512), E(64, dt=i32), None)
        assert "bf16 or fp16" in blockscaled_sm100.supports_moe_gemm_bf16(a.float(), w.float(), mi, None)
        strided = torch.empty_strided((8192, 7168), (1, 8192), dtype=bf, device="cuda")
        assert "contiguous" in blockscaled_sm100.supports_moe_gemm_bf16(strided, w, mi, None)
        assert backend_for("moe_gemm_bf16", a, w, mi, None, None) == "triton"  # below Triton's priority
        entry = select(TABLE["moe_gemm_bf16"], "moe_gemm_bf16", "cute", (a3, w2, None, mm, rw), {})
        assert entry.impl == "cute_ops.gemm.blockscaled_sm100:moe_gemm_bf16"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "masked", "contiguous-tile256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row_weights", [False, True])
def test_gpu_blackwell_dense_matches_reference(monkeypatch, layout, dtype, row_weights):
    """NEVER RUN (no Blackwell GPU available): `moe_gemm_bf16` with backend="cute" on sm_100 (unaligned
    contiguous groups, masked max_m not a multiple of 128 and a partial last K stage, NaN in rows no group owns; the
    256-column tile from 128 rows per expert) vs the reference."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs an sm_100 GPU")
    pytest.importorskip("cutlass")
    import dispatch
    from cute_ops.gemm import blockscaled_sm100
    from tests.test_cute_gemm_sm90 import _check, _contiguous_case, _masked_case

    monkeypatch.setenv(blockscaled_sm100.UNVERIFIED_ENV, "1")
    if layout == "masked":
        a, w, mm, rw = _masked_case(5, 100, 256, 200, [0, 100, 7, 300, 1], dtype, 3, row_weights)
        mi = None
    elif layout == "contiguous":
        a, w, mi, rw = _contiguous_case(5, 384, 512, [33, 0, 140, 2, 300], dtype, 4, row_weights)
        mm = None
    else:
        a, w, mi, rw = _contiguous_case(4, 512, 256, [200, 0, 301, 250], dtype, 5, row_weights)
        mm = None
        assert blockscaled_sm100.dense_config(a, w, False, row_weights).tile_n == 256
    dev = [None if t is None else t.cuda() for t in (a, w, mi, mm, rw)]
    out = dispatch.moe_gemm_bf16(*dev, backend="cute")
    torch.cuda.synchronize()
    _check(out, a, w, mi, mm, rw, f"sm_100 cute moe_gemm_bf16 {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_gpu_blackwell_dense_routing_and_graph(monkeypatch, layout):
    """NEVER RUN (no Blackwell GPU available): the sm_100 moe_gemm_bf16 backend through the sm_90 kernel's checks:
    new routings and row counts without a recompile, and CUDA-graph replays with new group sizes."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        pytest.skip("needs an sm_100 GPU")
    pytest.importorskip("cutlass")
    from cute_ops.gemm import blockscaled_sm100
    from tests.test_cute_gemm_sm90 import (
        check_graph_replays_with_new_group_sizes,
        check_routing_change_does_not_recompile,
    )

    monkeypatch.setenv(blockscaled_sm100.UNVERIFIED_ENV, "1")
    if layout == "masked":
        check_routing_change_does_not_recompile(blockscaled_sm100.moe_gemm_bf16)
    check_graph_replays_with_new_group_sizes(blockscaled_sm100.moe_gemm_bf16, layout)
