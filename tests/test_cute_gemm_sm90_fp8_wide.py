"""FP8 wide tiles of the sm_90a grouped GEMM (cute_ops/gemm/grouped_sm90.py: tile_m 256 x tile_n 128, 128 x 256 and
128 x 192, GemmConfig.wide): two consumer warp groups, each owning two 64 x 128 sub-tiles (waves) that share the A rows
(128 x 256) or the B rows (256 x 128) of a stage, or one 64 x 192 WGMMA whose columns span two weight-scale blocks.

CPU: the config rules (the wave schedule, the direct epilogue, 4 stages; what does not fit is refused) and each wide
config compiled for sm_90a with its SASS checked: QGMMA 64 x wave_n x 32 per wave, each wave's WGMMAs waited for before
its promotion (one partial-sum buffer), no spills. GPU (`-m gpu`, sm_90): against the reference and bit-equal to the
rule's default 128 x 128 kernel (the same WGMMA per 64 x 128 block and the same FFMA per element and block),
contiguous (padding rows, out-of-range ids, an empty expert, unaligned starts) and masked layouts, fp32 and UE8M0
scales, a partial weight-scale block (N 320: the second 128-column half of the last 256 tile is past N; 192 tiles
split at column 64 or 128 of a tile), and
DeepSeek-V3 GEMM1 / GEMM2 dimensions.
"""

from __future__ import annotations

import re

import pytest
import torch

from dispatch.reference import moe_gemm as ref
from tests.helpers import assert_close
from tests.test_cute_gemm_sm90 import _sm90_gpu, compile_dump, needs_dsl
from tests.test_cute_gemm_sm90_fp8 import _case, deepseek_case, deepseek_sampled_reference

GEMM1, GEMM2 = ("fp8", 4096, 7168, 32, "contiguous", False, 512), ("fp8", 7168, 2048, 32, "contiguous", True, 256)
WIDE = [dict(tile_m=256, tile_n=128), dict(tile_m=128, tile_n=256),
        dict(tile_m=128, tile_n=256, epilogue_prefetch=False),
        dict(tile_m=128, tile_n=192), dict(tile_m=128, tile_n=192, epilogue_prefetch=False),
        dict(tile_m=256, tile_n=128, scale_prefetch=False), dict(tile_m=128, tile_n=192, scale_prefetch=False)]


def _vid(v: dict) -> str:
    return "-".join(f"{k}{int(x) if isinstance(x, bool) else x}" for k, x in v.items())


@needs_dsl
def test_fp8_wide_config_rules():
    from cute_ops.gemm.grouped_sm90 import can_implement, pick_config

    for (tm, tn), prefetch, stages, wave_n in (((256, 128), False, 4, 128), ((128, 256), True, 4, 128),
                                               ((128, 192), True, 5, 192)):
        cfg = pick_config(*GEMM1, tile_m=tm, tile_n=tn)
        assert cfg.wide and cfg.mma_wgs == 2 and cfg.threads == 384 and cfg.wave_n == wave_n, cfg
        # the wave schedule with scales a stage ahead, the direct epilogue; 48 KiB stages: 4 fit (40 KiB: 5)
        assert (cfg.promote_run, cfg.scale_prefetch, cfg.epilogue, cfg.stages) == (0, True, "direct", stages), cfg
        assert cfg.epilogue_prefetch == prefetch
        assert not pick_config(*GEMM1, tile_m=tm, tile_n=tn, scale_prefetch=False).scale_prefetch
        assert pick_config(*GEMM1, tile_m=tm, tile_n=tn, promote_run=0).scale_prefetch
    assert not pick_config(*GEMM1).wide and pick_config(*GEMM1).threads == 384
    assert not pick_config("bf16", 4096, 7168, 32, "contiguous", False, 512, tile_n=256).wide
    for tm, tn in ((256, 256), (64, 256), (256, 64), (64, 192), (256, 192)):
        assert "wide" in can_implement("fp8", 4096, 7168, 32, tm, tn)
    assert "tile_m" in can_implement("bf16", 4096, 7168, 32, 256, 128)
    assert "tile_n" in can_implement("bf16", 4096, 7168, 32, 128, 192)
    for tn in (192, 256):
        with pytest.raises(ValueError, match="promote_run 0"):
            pick_config(*GEMM1, tile_m=128, tile_n=tn, promote_run=4)
    assert pick_config(*GEMM1, tile_m=128, tile_n=256, epilogue="smem").stages == 3  # + 64 KiB staging tile
    with pytest.raises(ValueError, match="direct"):
        pick_config(*GEMM1, tile_m=256, tile_n=128, epilogue="smem")
    with pytest.raises(ValueError, match="epilogue_prefetch"):
        pick_config(*GEMM1, tile_m=256, tile_n=128, epilogue_prefetch=True)
    with pytest.raises(ValueError, match="stages"):
        pick_config(*GEMM1, tile_m=256, tile_n=128, stages=5)


SASS_CASES = [(GEMM1, t) for t in WIDE] + [(GEMM2, dict(tile_m=tm, tile_n=tn)) for tm, tn in ((256, 128), (128, 256),
                                                                                               (128, 192))] + [
    (("fp8", 7168, 2048, 32, "masked", True, 256), dict(tile_m=256, tile_n=128)),
    (("fp8", 7168, 2048, 32, "masked", True, 256), dict(tile_m=128, tile_n=192))]


@needs_dsl
# The rule's wide GEMM1 tile by default; the other tiles and shapes (the GPU suite runs every one) in the slow run.
@pytest.mark.parametrize("case", [SASS_CASES[0], *[pytest.param(c, marks=pytest.mark.slow) for c in SASS_CASES[1:]]],
                         ids=lambda c: f"{c[0][1]}x{c[0][2]}-{c[0][4]}-{_vid(c[1])}")
def test_fp8_wide_sass(case):
    shape, tiles = case
    cfg, d = compile_dump(shape, **tiles)
    ops = d.opcodes()
    waves = cfg.tile_m * cfg.tile_n // (128 * cfg.wave_n)
    accs = cfg.tile_m * cfg.tile_n // 256  # accumulators per thread
    # one traced stage (the K loop body): waves x 4 K32 steps, each wave's first QGMMA a fresh partial sum
    qgmma = f"QGMMA.64x{cfg.wave_n}x32.F32.E4M3.E4M3"
    assert re.findall(r"\bQGMMA\.[0-9x]+\.F32\S*", d.sass) == [qgmma] * 4 * waves, ops
    assert len(re.findall(r"QGMMA\.\S+ R\d+, gdesc\[UR\d+\], RZ, !UPT", d.sass)) == waves
    assert ops["WARPGROUP.ARRIVE"] == waves, ops
    assert re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", d.sass) == ["0"] * waves
    assert ops["FFMA"] >= accs, ops  # one per accumulator element
    assert ops["UTMALDG.2D"] == 1 and ops["UTMALDG.3D"] == 1, ops
    assert ops["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1, ops
    assert d.count("LDL") == 0 and d.count("STL") == 0 and d.resources()["STACK"] == 0, ops
    # direct epilogue: one 4-byte store per accumulator pair
    assert len(re.findall(r"st\.global\.(?:b32|v2\.b16) ", d.ptx)) == accs // 2 and d.count("STG.E.U16") == 0, ops
    assert d.max_register() <= 232


SMEM_WIDE = [dict(tile_m=128, tile_n=256, epilogue="smem"), dict(tile_m=128, tile_n=192, epilogue="smem")]


@needs_dsl
@pytest.mark.parametrize("tiles", SMEM_WIDE, ids=_vid)
def test_fp8_wide_smem_epilogue_sass(tiles):
    """The smem epilogue on the 128-row wide tiles: its stores, and its register spills (~20 values per tile) only
    outside the K loop (stored before the first QGMMA, reloaded after the last wait)."""
    for shape in (GEMM1, GEMM2):
        cfg, d = compile_dump(shape, **tiles)
        seq = re.findall(r"\b(LDL|STL|QGMMA|WARPGROUP\.DEPBAR)\b", d.sass)
        first, last = seq.index("QGMMA"), len(seq) - 1 - seq[::-1].index("WARPGROUP.DEPBAR")
        assert "LDL" not in seq[first:last] and "STL" not in seq[first:last], seq
        assert d.count("STL") <= 24 and d.count("LDL") <= 24, d.opcodes()
        ops = d.opcodes()
        chunks = 64 * cfg.tile_n * 2 // 128 // 16
        assert ops["STS"] == cfg.tile_n // 4 and ops["LDS.128"] == chunks, ops
        # + the descriptor slots (4 stores per slot) and the zero-row pass's one store
        assert ops["STG.E.128"] == chunks + 4 * cfg.desc_slots + 1 and d.count("STG.E.U16") == 0, ops


# -------------------------------------------------------------------------------------- GPU (sm_90)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", WIDE + SMEM_WIDE, ids=_vid)
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_gpu_fp8_wide_match_reference_and_base(tiles, layout, ue8m0):
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_fp8

    host = _case(layout, ue8m0, column_major=layout == "masked", row_weights=ue8m0)
    dev = [None if t is None else t.cuda() for t in host]
    out = moe_gemm_fp8(*dev, tiles=tiles)
    base = moe_gemm_fp8(*dev)
    torch.cuda.synchronize()
    assert_close(out.cpu(), ref.moe_gemm_fp8(*host), f"fp8 wide {layout} {tiles}")
    assert torch.equal(out, base), (out.float() - base.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", WIDE + SMEM_WIDE, ids=_vid)
@pytest.mark.parametrize("dims", [(4096, 7168), (7168, 2048)], ids=["gemm1", "gemm2"])
def test_gpu_fp8_wide_deepseek_dims(tiles, dims):
    """DeepSeek-V3 GEMM1 / GEMM2 dimensions, 8 experts of uneven sizes: bit-equal to the default kernel."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_fp8

    a, sa, w, sw, ids = deepseek_case(*dims, 6)
    out = moe_gemm_fp8(a, sa, w, sw, ids, None, tiles=tiles)
    base = moe_gemm_fp8(a, sa, w, sw, ids, None)
    torch.cuda.synchronize()
    rows, want = deepseek_sampled_reference(a, sa, w, sw, ids)
    assert_close(out[rows].cpu(), want, f"fp8 wide {dims} sampled rows")
    assert torch.equal(out, base), (out.float() - base.float()).abs().max()
