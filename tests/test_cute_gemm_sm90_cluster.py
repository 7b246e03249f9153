"""Tile-boundary variants of the sm_90a grouped GEMM (cute_ops/gemm/grouped_sm90.py): GemmConfig.cluster_m (CTA pairs
walking row-tile pairs, the B stage TMA-multicast to both), wg_stagger (the two consumer warp groups offset by a
few stages, so one group's tile boundary overlaps the other's WGMMAs) and producer_ahead (the next tile's A
descriptor rewritten after this tile's first load).

CPU: config rules; the pair walk's model (every row tile of every group exactly once, the pair's extra row tile
past its group writes nothing); each variant compiled for sm_90a with its SASS checked (one multicast B load, the
remote stage releases, the cluster barrier after the mbarrier init; the named-barrier arrive / wait of the stagger;
the promotion overlap kept, no spills). GPU (`-m gpu`, sm_90): every variant against the reference and bit-equal to
the kernel without it (contiguous with padding, an expert with 0 rows, out-of-range ids, unaligned starts; masked;
fp32 and UE8M0 scales), DeepSeek-V3 GEMM1 / GEMM2 dims with uneven experts, bf16 with multicast.
"""

from __future__ import annotations

import re

import pytest
import torch

from cute_ops.gemm import scheduler as S
from dispatch.reference import moe_gemm as ref
from tests.helpers import assert_close
from tests.test_cute_gemm_sm90 import _contiguous_case, _masked_case, _sm90_gpu, compile_dump, needs_dsl
from tests.test_cute_gemm_sm90_fp8 import _case, deepseek_case, deepseek_sampled_reference

# the schedule the variants run on in the small cases (groups under 128 rows get the plain kernel from the rule)
SCHEDULE = dict(promote_run=4, scale_prefetch=True, epilogue_prefetch=True, epilogue="smem")
VARIANTS = [dict(cluster_m=2), dict(wg_stagger=2), dict(wg_stagger=5), dict(cluster_m=2, wg_stagger=1),
            dict(producer_ahead=True), dict(producer_ahead=True, cluster_m=2, wg_stagger=2),
            dict(cluster_m=2, promote_run=0, scale_prefetch=False, epilogue_prefetch=False, epilogue="direct"),
            dict(wg_stagger=3, epilogue="direct")]


def _vid(v: dict) -> str:
    return "-".join(f"{k}{int(x) if isinstance(x, bool) else x}" for k, x in v.items())


@pytest.mark.parametrize("seed", range(6))
def test_pair_walk_covers_every_row_tile_once(seed):
    """cluster_m 2: cluster c walks pair tiles (row tile 2 x tile_m) as scheduler.cta_tiles_bounded; CTA rank r takes
    row tile 2 * pair + r. Over all CTAs every real row tile of every group is taken once; the others start at or
    past their group's end (nothing written)."""
    g = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 9, (1,), generator=g))
    counts = [int(c) for c in torch.randint(0, 700, (groups,), generator=g)]
    counts[int(torch.randint(0, groups, (1,), generator=g))] = 0
    starts = [sum(counts[:i]) + 3 * i for i in range(groups)]
    tile_m, n_tiles, grid = 128, 3, 2 * int(torch.randint(1, 9, (1,), generator=g))
    seen = []
    for cta in range(grid):
        rank = cta % 2
        for pt in S.cta_tiles_bounded(cta // 2, grid // 2, starts, counts, 2 * tile_m, n_tiles):
            row_start = pt.row_start + rank * tile_m
            if row_start < pt.row_end:
                seen.append((pt.group, 2 * pt.m_tile + rank, pt.n_tile, row_start))
            else:  # the pair's second row tile past an odd row-tile count
                assert rank == 1 and -(-counts[pt.group] // tile_m) == 2 * pt.m_tile + 1
    want = [(gi, m, n, starts[gi] + m * tile_m) for gi in range(groups) for n in range(n_tiles)
            for m in range(-(-counts[gi] // tile_m))]
    assert sorted(seen) == sorted(want)


@needs_dsl
def test_variant_config_rules():
    from cute_ops.gemm.grouped_sm90_config import pick_config

    base = pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512)
    assert (base.cluster_m, base.wg_stagger, base.clusters, base.producer_ahead) == (1, 0, 132, False)
    ahead = pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, producer_ahead=True)
    assert ahead.producer_ahead and ahead.key() != base.key()
    pair = pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, sm_count=133, cluster_m=2)
    assert (pair.grid, pair.clusters) == (132, 66) and pair.key() != base.key()
    assert pick_config("fp8", 7168, 2048, 32, "contiguous", False, 256, wg_stagger=3).wg_stagger == 3
    with pytest.raises(ValueError, match="cluster_m"):
        pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, cluster_m=4)
    assert pick_config("fp8", 7168, 2048, 32, "contiguous", False, 256, wg_stagger=5).wg_stagger == 5  # in run 2
    # stage wg_stagger must load before the lagging group released anything: below the 6 stages
    for bad in (dict(wg_stagger=6), dict(wg_stagger=1, promote_run=0), dict(wg_stagger=1, tile_m=64)):
        with pytest.raises(ValueError, match="wg_stagger"):
            pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, **bad)
    with pytest.raises(ValueError, match="wg_stagger"):  # no whole run: a run longer than the tile's 2 stages
        pick_config("fp8", 512, 256, 4, "masked", False, 256, promote_run=4, wg_stagger=1)
    with pytest.raises(ValueError, match="wg_stagger"):  # 9 stages in runs of 4: the tail stage 8 is not traced
        pick_config("fp8", 512, 1152, 4, "masked", False, 256, promote_run=4, stages=6, wg_stagger=8)
    with pytest.raises(ValueError, match="wg_stagger"):
        pick_config("bf16", 4096, 7168, 32, "contiguous", False, 512, wg_stagger=1)


@needs_dsl
def test_launcher_cluster_grid_is_the_clusters_that_fit(monkeypatch):
    """cluster_m 2: the launcher's grid is 2 x the clusters the occupancy query says run at once (capped by the SM
    count rounded down to even); the kernel model still gets every group's rows."""
    from cute_ops.gemm import moe_sm90
    from tests.test_cute_gemm_sm90 import _kernel_model, stub_cuda_launch

    grids = []

    def model(cfg):
        grids.append((cfg.cluster_m, cfg.grid, cfg.clusters))
        return _kernel_model(cfg)

    stub_cuda_launch(monkeypatch, moe_sm90, model, "sm_90a")
    monkeypatch.setattr(moe_sm90, "_sm_count", lambda index: 133)
    for fit, want in ((60, 120), (80, 132)):
        monkeypatch.setattr(moe_sm90, "max_active_clusters", lambda index, size, fit=fit: fit)
        a, w, mi, rw = _contiguous_case(3, 16, 32, [5, 0, 9], torch.bfloat16, 3, True)
        out = moe_sm90.moe_gemm_bf16(a, w, mi, None, rw, tiles=dict(cluster_m=2))
        assert grids[-1] == (2, want, want // 2)
        want_out = ref.moe_gemm_bf16(a, w, mi, None, rw)
        assert_close(out, want_out, "bf16 contiguous through the cluster launcher")
    moe_sm90.moe_gemm_bf16(a, w, mi, None, rw)
    assert grids[-1] == (1, 133, 133)


SASS_CASES = [(("fp8", 4096, 7168, 32, "contiguous", True, 512), dict(cluster_m=2)),  # GEMM1, runs of 8
              (("fp8", 7168, 2048, 32, "masked", False, 256), dict(cluster_m=2, wg_stagger=2)),  # GEMM2, runs of 4
              (("fp8", 7168, 2048, 32, "contiguous", True, 256), dict(wg_stagger=2)),
              (("fp8", 4096, 7168, 32, "contiguous", False, 256), dict(wg_stagger=4)),
              (("fp8", 7168, 2048, 32, "contiguous", False, 512), dict(wg_stagger=5)),  # arrives in the second run
              (("bf16", 4096, 7168, 32, "contiguous", True, 512), dict(cluster_m=2)),
              (("fp8", 7168, 2048, 32, "contiguous", True, 256), dict(producer_ahead=True)),
              (("fp8", 7168, 2048, 32, "masked", False, 256), dict(producer_ahead=True, cluster_m=2, wg_stagger=2)),
              (("bf16", 4096, 7168, 256, "masked", False, 16), dict(producer_ahead=True))]


@needs_dsl
@pytest.mark.parametrize("case", SASS_CASES, ids=lambda c: f"{c[0][0]}-{c[0][1]}x{c[0][2]}-{c[0][4]}-{_vid(c[1])}")
def test_variant_sass(case):
    shape, variant = case
    cfg, d = compile_dump(shape, **variant)
    ops = d.opcodes()
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops
    assert not re.search(r"@!?U?P\w+\s+R2UR", d.sass)
    assert ops["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1, ops
    if cfg.dtype == "fp8":
        # the schedule's promotion overlap is kept: one wait-all per run, every other wait leaves one group in flight
        run = cfg.promote_run
        tail = cfg.k // 128 % run
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", d.sass)
        assert sorted(waits) == sorted(["1"] * (run - 1) + ["0"] + (["1"] * (tail - 1) + ["0"] if tail else [])), waits
        assert len(re.findall(r"\bQGMMA\.64x128x32\.F32\.E4M3\.E4M3", d.sass)) == 4 * (run + tail)
    if cfg.cluster_m == 2:
        # B: one multicast TMA load (this CTA's half of the stage to both CTAs); A: the per-CTA 2-D load
        assert ops["UTMALDG.3D.MULTICAST"] == 1 and ops["UTMALDG.2D"] == 1 and ops["UTMALDG.3D"] == 0, ops
        assert d.ptx.count(".multicast::cluster") == 1
        # stage releases arrive on the peer's empty barrier too (mapa + cluster-scope arrive), the mbarrier init is
        # fenced for the cluster and followed by one cluster barrier
        assert d.ptx.count("mbarrier.arrive.shared::cluster.b64") >= 1 and "mapa.shared::cluster" in d.ptx
        assert d.ptx.count("fence.mbarrier_init.release.cluster") == 1
        assert ops["UCGABAR_ARV"] == 1 and ops["UCGABAR_WAIT"] == 1, ops
    else:
        assert ops["UTMALDG.3D"] == 1 and ops["UTMALDG.3D.MULTICAST"] == 0 and ops["UCGABAR_ARV"] == 0, ops
    bars = re.findall(r"BAR\.(?:SYNC\.DEFER_BLOCKING|ARV) 0x3, 0x100", d.sass)
    if cfg.wg_stagger:  # group 1 waits once on named barrier 3 (256 threads), group 0 arrives once
        assert sorted(bars) == ["BAR.ARV 0x3, 0x100", "BAR.SYNC.DEFER_BLOCKING 0x3, 0x100"], bars
    else:
        assert bars == [] and ops["BAR.ARV"] == 0, ops
    # the A descriptor rewrite: at the first tile's start, and (producer_ahead) after each tile's first load
    sites = 2 if cfg.producer_ahead else 1
    assert d.ptx.count("tensormap.replace.tile.global_address.global.b1024.b64") == sites
    assert d.ptx.count("fence.proxy.tensormap::generic.release.gpu;") == sites
    assert d.ptx.count("fence.proxy.tensormap::generic.acquire.gpu") == sites and ops["UTMACCTL.IV"] == sites, ops


# -------------------------------------------------------------------------------------- GPU (sm_90)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS, ids=_vid)
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_gpu_variants_match_reference_and_base(variant, layout, ue8m0):
    """K = 1152 (9 stages); groups with odd row-tile counts (the pair's extra row tile), an empty expert, padding and
    an out-of-range id (contiguous), counts 0 / full / partial (masked)."""
    _sm90_gpu()
    from cute_ops.gemm.moe_sm90 import moe_gemm_fp8

    host = _case(layout, ue8m0, layout == "masked", row_weights=ue8m0)
    dev = [None if t is None else t.cuda() for t in host]
    tiles = dict(SCHEDULE, **variant)
    out = moe_gemm_fp8(*dev, tiles=tiles)
    base = moe_gemm_fp8(*dev, tiles={k: v for k, v in tiles.items()
                                     if k not in ("cluster_m", "wg_stagger", "producer_ahead")})
    torch.cuda.synchronize()
    assert_close(out.cpu(), ref.moe_gemm_fp8(*host), f"fp8 {layout} {variant}")
    assert torch.equal(out, base), (out.float() - base.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(4096, 7168), (7168, 2048)], ids=["gemm1", "gemm2"])
def test_gpu_variants_deepseek_dims(dims):
    """DeepSeek-V3 GEMM1 / GEMM2 dims, 8 uneven experts (odd row-tile counts, an empty one, padding rows): the rule's
    schedule with each variant bit-equal to it, sampled rows against the reference."""
    _sm90_gpu()
    from cute_ops.gemm.moe_sm90 import moe_gemm_fp8

    a, sa, w, sw, ids = deepseek_case(*dims, 6)
    base = moe_gemm_fp8(a, sa, w, sw, ids, None)
    rows, want = deepseek_sampled_reference(a, sa, w, sw, ids)
    for variant in (dict(cluster_m=2), dict(wg_stagger=2), dict(wg_stagger=4), dict(cluster_m=2, wg_stagger=2),
                    dict(producer_ahead=True)):
        out = moe_gemm_fp8(a, sa, w, sw, ids, None, tiles=variant)
        torch.cuda.synchronize()
        assert torch.equal(out, base), (variant, (out.float() - base.float()).abs().max())
        assert_close(out[rows].cpu(), want, f"fp8 DeepSeek {dims} {variant}, sampled rows")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gpu_bf16_variants(layout):
    """cluster_m 2 on the bf16 kernel (128 x 256: each CTA multicasts 128 weight rows; and 128 x 128), producer_ahead
    (64 x 128 tiles: a new group nearly every tile; and with multicast), bit-equal."""
    _sm90_gpu()
    from cute_ops.gemm.moe_sm90 import moe_gemm_bf16

    if layout == "contiguous":
        a, w, mi, rw = _contiguous_case(7, 512, 256, [37, 0, 300, 1, 200, 129, 5], torch.bfloat16, 64, True)
        args = (a.cuda(), w.cuda(), mi.cuda(), None, rw.cuda())
    else:
        a, w, mm, rw = _masked_case(5, 400, 512, 256, [0, 400, 3, 265, 129], torch.bfloat16, 65, True)
        args = (a.cuda(), w.cuda(), None, mm.cuda(), rw.cuda())
    for tiles, variant in ((dict(tile_m=128, tile_n=256), dict(cluster_m=2)),
                           (dict(tile_m=128, tile_n=128, epilogue="smem"), dict(cluster_m=2)),
                           (dict(tile_m=64, tile_n=128), dict(producer_ahead=True)),
                           (dict(tile_m=128, tile_n=256), dict(producer_ahead=True, cluster_m=2))):
        out = moe_gemm_bf16(*args, tiles=dict(tiles, **variant))
        base = moe_gemm_bf16(*args, tiles=tiles)
        torch.cuda.synchronize()
        assert torch.equal(out, base), (tiles, variant, (out.float() - base.float()).abs().max())
