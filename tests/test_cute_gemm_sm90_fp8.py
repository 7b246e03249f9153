"""FP8 prefill schedules of the sm_90a grouped GEMM (cute_ops/gemm/grouped_sm90.py: GemmConfig.promote_run and
scale_prefetch).

CPU: the config fields' rules and defaults, and each schedule compiled for sm_90a with its SASS checked: the WGMMAs
of a run issued ahead of the previous stage's promotion (WARPGROUP.DEPBAR 1, so ptxas did not serialize them), one
wait-all per run, no spills. GPU (`-m gpu`, sm_90): every schedule against the reference and bit-equal to the
rule's default kernel (same FFMA per element and block; the plain schedule, promote_run 0, is one of them),
contiguous (padding rows, out-of-range ids, an expert with 0 rows, unaligned starts) and masked layouts, fp32 and
UE8M0 (power-of-two) scales, row- and column-major activation scales, row weights.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

from dispatch.reference import moe_gemm as ref
from dispatch.reference.formats import e4m3_encode
from dispatch.reference.quant import fp8_group_quantize
from tests.helpers import assert_close
from tests.test_cute_gemm_sm90 import _contiguous_case, _masked_case, _sm90_gpu, compile_dump, needs_dsl

# (promote_run, scale_prefetch, epilogue_prefetch, epilogue): every schedule the FP8 prefill sweep times, and more
SCHEDULES = [(1, True, False, "direct"), (2, False, True, "smem"), (2, True, False, "direct"),
             (3, True, True, "direct"), (4, True, False, "smem"), (4, True, True, "direct"), (8, True, True, "smem"),
             (0, False, False, "smem"), (0, False, False, "direct")]


@needs_dsl
def test_fp8_schedule_config_rules():
    from cute_ops.gemm.grouped_sm90 import FP8_PREFILL_SCHEDULE, PLAIN_SCHEDULE, pick_config

    def fields(cfg):
        return dict(promote_run=cfg.promote_run, scale_prefetch=cfg.scale_prefetch,
                    epilogue_prefetch=cfg.epilogue_prefetch, epilogue=cfg.epilogue)

    base = pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512)
    assert fields(base) == FP8_PREFILL_SCHEDULE and (base.stages, base.tile_n) == (6, 128)
    assert fields(base) == dict(promote_run=8, scale_prefetch=True, epilogue_prefetch=True, epilogue="smem")
    short_k = pick_config("fp8", 7168, 2048, 32, "contiguous", False, 256)  # 16 stages per tile: runs of 4
    assert fields(short_k) == dict(FP8_PREFILL_SCHEDULE, promote_run=4) and short_k.stages == 6
    decode = pick_config("fp8", 4096, 7168, 256, "masked", False, 16)
    assert fields(decode) == PLAIN_SCHEDULE == dict(promote_run=0, scale_prefetch=False, epilogue_prefetch=False,
                                                    epilogue="direct")
    # bf16 / fp16: the plain schedule; at the 128 x 256 tile the smem epilogue (3 stages), other tiles direct
    wide_bf16 = pick_config("bf16", 4096, 7168, 32, "contiguous", False, 512)
    assert fields(wide_bf16) == dict(PLAIN_SCHEDULE, epilogue="smem") and wide_bf16.stages == 3
    assert pick_config("fp16", 7168, 2048, 32, "masked", True, 256).epilogue == "smem"
    assert fields(pick_config("bf16", 4224, 7168, 32, "contiguous", False, 512)) == PLAIN_SCHEDULE  # 128 x 128
    assert fields(pick_config("bf16", 4096, 7168, 256, "masked", False, 16)) == PLAIN_SCHEDULE  # 64 x 128
    assert pick_config("bf16", 4096, 7168, 32, "contiguous", False, 512, epilogue="direct").stages == 4
    plain = pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, **PLAIN_SCHEDULE)
    assert fields(plain) == PLAIN_SCHEDULE and plain.stages == 6 and plain.key() != base.key()
    # field by field: an overridden promote_run 0 turns the rule's scale_prefetch off; the rest stays the rule's
    assert fields(pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, promote_run=0)) == dict(
        FP8_PREFILL_SCHEDULE, promote_run=0, scale_prefetch=False)
    cfg = pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, promote_run=4, epilogue="direct")
    assert fields(cfg) == dict(FP8_PREFILL_SCHEDULE, promote_run=4, epilogue="direct")
    with pytest.raises(ValueError, match="FP8 only"):
        pick_config("bf16", 4096, 7168, 32, "contiguous", False, 512, promote_run=2)
    with pytest.raises(ValueError, match="needs promote_run"):
        pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, promote_run=0, scale_prefetch=True)
    with pytest.raises(ValueError, match="promote_run=-1"):
        pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, promote_run=-1)


SASS_CASES = [(("fp8", 4096, 7168, 32, "contiguous", False, 512), 4, True, False, "direct"),  # 56 stages: 14 runs
              (("fp8", 4096, 7168, 32, "contiguous", False, 256), 8, True, True, "direct"),
              (("fp8", 7168, 2048, 32, "masked", True, 256), 3, True, True, "direct"),  # 16 stages: 5 runs of 3 + 1
              (("fp8", 7168, 2048, 32, "contiguous", True, 256), 2, False, True, "direct"),
              (("fp8", 4096, 7168, 32, "contiguous", False, 512), 1, True, False, "direct"),
              (("fp8", 4096, 7168, 32, "contiguous", True, 512), 4, True, True, "smem"),
              # the rule's defaults: GEMM1 (runs of 8), GEMM2 (K 2048: runs of 4)
              (("fp8", 4096, 7168, 32, "contiguous", False, 256), 8, True, True, "smem"),
              (("fp8", 7168, 2048, 32, "contiguous", True, 256), 4, True, True, "smem")]


@needs_dsl
@pytest.mark.parametrize("case", SASS_CASES,
                         ids=lambda c: f"{c[0][1]}x{c[0][2]}-{c[0][4]}-run{c[1]}-pf{int(c[2])}-ep{int(c[3])}-{c[4]}")
def test_fp8_schedule_sass(case):
    shape, run, prefetch, epilogue_prefetch, epilogue = case
    cfg, d = compile_dump(shape, promote_run=run, scale_prefetch=prefetch, epilogue_prefetch=epilogue_prefetch,
                          epilogue=epilogue)
    ops = d.opcodes()
    k_tiles = cfg.k // 128
    tail = k_tiles % run
    stages_traced = run + tail  # the run body and the tail run, each unrolled
    assert re.findall(r"\bQGMMA\.[0-9x]+\.F32\S*", d.sass) == ["QGMMA.64x128x32.F32.E4M3.E4M3"] * 4 * stages_traced
    # each traced stage: one ARRIVE (wgmma.fence) and a first QGMMA that does not accumulate (a fresh partial sum)
    assert ops["WARPGROUP.ARRIVE"] == stages_traced, ops
    assert len(re.findall(r"QGMMA\.\S+ R\d+, gdesc\[UR\d+\], RZ, !UPT", d.sass)) == stages_traced
    # Overlap: every stage after a run's first waits with one group still in flight (its own), the run's end
    # waits for all; a serialized pipeline (ptxas C7514) shows a wait-all after every QGMMA instead
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x(\d)", d.sass)
    assert sorted(waits) == sorted(["1"] * (run - 1) + ["0"] + (["1"] * (tail - 1) + ["0"] if tail else [])), waits
    # two partial-sum buffers' promotions: one FFMA per accumulator element and traced stage
    assert ops["FFMA"] >= stages_traced * cfg.tile_n // 2, ops
    assert ops["UTMALDG.2D"] == 1 and ops["UTMALDG.3D"] == 1, ops
    assert ops["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1, ops
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops
    assert not re.search(r"@!?U?P\w+\s+R2UR", d.sass)
    if epilogue == "smem":
        _assert_smem_epilogue(cfg, d)
    else:
        assert d.ptx.count("st.global.b32") == cfg.tile_n * 64 // 128 // 2 and d.count("STG.E.U16") == 0, ops
    if epilogue_prefetch and cfg.layout == "contiguous" and cfg.row_weights and epilogue == "direct":
        # m_indices and row weights loaded at the tile's start: after the last QGMMA only the tile walk's loads
        # (the next tile's group bounds) and the zero-row pass's id load remain; without the prefetch 4 more (2 rows
        # x 2 values)
        seq = re.findall(r"\b(LDG|QGMMA)", d.sass)
        last = len(seq) - 1 - seq[::-1].index("QGMMA")
        assert seq[last:].count("LDG") <= 4, seq[last:]


def _assert_smem_epilogue(cfg, d):
    """Per thread: one 4-byte smem write per accumulator pair, 16-byte smem reads and predicated 16-byte global
    stores of its chunks (64 x tile_n x 2 bytes per warp group / 128 threads / 16 bytes), the two warp-group
    barriers; no 4-byte or 2-byte global stores of the output."""
    ops = d.opcodes()
    chunks = 64 * cfg.tile_n * 2 // 128 // 16
    assert ops["STS"] == cfg.tile_n // 4 and ops["LDS.128"] == chunks, ops
    # STG.E.128 also writes the descriptor slots (4 per slot) and the zero rows (one store in the zero-row pass)
    assert ops["STG.E.128"] == chunks + 4 * cfg.desc_slots + 1 and d.ptx.count("st.global.b32") == 0, ops
    assert d.count("STG.E.U16") == 0 and ops["BAR.SYNC.DEFER_BLOCKING"] == 3, ops
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops


@needs_dsl
def test_smem_epilogue_config_and_sass_bf16():
    """The smem epilogue's staging tile costs stages (128 x 256 bf16: 3 instead of 4); its SASS at 128 x 256."""
    from cute_ops.gemm.grouped_sm90 import dump, pick_config

    assert pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, epilogue="smem").stages == 6
    assert pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, epilogue="smem", stages=6).stages == 6
    with pytest.raises(ValueError, match="stages"):
        pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, epilogue="smem", stages=7)
    with pytest.raises(ValueError, match="epilogue"):
        pick_config("fp8", 4096, 7168, 32, "contiguous", False, 512, epilogue="tma")
    cfg = pick_config("bf16", 4096, 7168, 32, "contiguous", True, 256, epilogue="smem")
    assert (cfg.tile_m, cfg.tile_n, cfg.stages) == (128, 256, 3)
    _assert_smem_epilogue(cfg, dump(cfg))


# -------------------------------------------------------------------------------------- GPU (sm_90)


def _ue8m0(s: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(s)))


def _quant_w(w: torch.Tensor, ue8m0: bool):
    """fp32 (E, N, K) -> E4M3 codes, (E, ceil(N/128), K/128) scales: amax / 448 (UE8M0: its power of two above)."""
    e, n, k = w.shape
    nb = -(-n // 128)
    wp = torch.zeros(e, nb * 128, k)
    wp[:, :n] = w
    blk = wp.view(e, nb, 128, k // 128, 128)
    s = blk.abs().amax((2, 4)).clamp(min=1e-10) / 448
    s = _ue8m0(s) if ue8m0 else s
    return e4m3_encode(blk / s[:, :, None, :, None]).reshape(e, nb * 128, k)[:, :n].contiguous(), s


def _case(layout: str, ue8m0: bool, column_major: bool, row_weights: bool, n=320, k=1152):
    """K = 1152: 9 stages (runs of 2, 3 and 4 with and without a tail run); N = 320: a partial weight-scale block.
    Rows that must not be read hold NaN codes and NaN scales."""
    e = 6
    if layout == "masked":
        x, w32, ids, rw = _masked_case(e, 160, n, k, [0, 160, 7, 129, 1, 64], torch.float32, 70, row_weights)
    else:  # unaligned starts (pad 8), an expert with 0 rows, one over two row tiles; -1 padding, an out-of-range id
        x, w32, ids, rw = _contiguous_case(e, n, k, [33, 0, 300, 2, 64, 129], torch.float32, 71, row_weights)
    dead = torch.isnan(x[..., 0])
    a, sa = fp8_group_quantize(x.nan_to_num().reshape(-1, k), 128, 1e-10, ue8m0, column_major)
    a, sa = a.view(*x.shape), sa.view(*x.shape[:-1], k // 128)
    a.view(torch.uint8)[dead] = 0x7F
    sa = sa.clone()
    sa[dead] = float("nan")
    w, ws = _quant_w(w32, ue8m0)
    mi, mm = (ids, None) if layout == "contiguous" else (None, ids)
    return a, sa, w, ws, mi, mm, rw


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: f"run{s[0]}-pf{int(s[1])}-ep{int(s[2])}-{s[3]}")
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32", "ue8m0"])
def test_gpu_fp8_schedules_match_reference_and_base(schedule, layout, ue8m0):
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_fp8

    run, prefetch, epilogue_prefetch, epilogue = schedule
    column_major = layout == "masked"  # both scale layouts, across the two layouts
    host = _case(layout, ue8m0, column_major, row_weights=ue8m0)
    if ue8m0:
        assert all(math.log2(float(v)).is_integer() for v in host[3].flatten()[:64])
    dev = [None if t is None else t.cuda() for t in host]
    out = moe_gemm_fp8(*dev, tiles=dict(promote_run=run, scale_prefetch=prefetch,
                                        epilogue_prefetch=epilogue_prefetch, epilogue=epilogue))
    base = moe_gemm_fp8(*dev)
    torch.cuda.synchronize()
    assert_close(out.cpu(), ref.moe_gemm_fp8(*host), f"fp8 {layout} {schedule}")
    # same products and FFMAs per element and block as the default kernel: bit-equal
    assert torch.equal(out, base), (out.float() - base.float()).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", [(4, True, False, None, "direct"), (8, True, True, None, "direct"),
                                      (0, False, False, None, "direct"), (8, True, True, None, "smem"),
                                      (4, True, True, 7, "direct"), (2, False, False, None, "direct"),
                                      (4, True, True, None, "smem"), (0, False, False, None, "smem")],
                         ids=lambda s: f"run{s[0]}-pf{int(s[1])}-ep{int(s[2])}-stages{s[3] or 6}-{s[4]}")
def test_gpu_fp8_schedules_deepseek_dims(schedule):
    """DeepSeek-V3 GEMM1 (N 4096, K 7168: 56 stages), 8 experts of uneven sizes, bit-equal to the base kernel
    (the schedules, the 7-stage ring and the smem epilogue the sweep times)."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_fp8

    a, sa, w, sw, ids = deepseek_case(4096, 7168, 5)
    run, prefetch, epilogue_prefetch, stages, epilogue = schedule
    out = moe_gemm_fp8(a, sa, w, sw, ids, None, tiles=dict(promote_run=run, scale_prefetch=prefetch, stages=stages,
                                                           epilogue_prefetch=epilogue_prefetch, epilogue=epilogue))
    base = moe_gemm_fp8(a, sa, w, sw, ids, None)
    torch.cuda.synchronize()
    assert torch.equal(out, base), (out.float() - base.float()).abs().max()
    rows, want = deepseek_sampled_reference(a, sa, w, sw, ids)
    assert_close(out[rows].cpu(), want, "fp8 DeepSeek GEMM1 dims, sampled rows")


def deepseek_case(n: int, k: int, seed: int):
    """(a, a_scale, w, w_scale, m_indices) on the GPU: 8 experts of uneven sizes (256, 0, 37, 512, 129, 1, 300, 128
    rows: odd row-tile counts, an empty expert) and 5 padding rows."""
    e = 8
    counts = [256, 0, 37, 512, 129, 1, 300, 128]
    ids = torch.cat([torch.full((c,), i, dtype=torch.int32) for i, c in enumerate(counts)] + [
        torch.full((5,), -1, dtype=torch.int32)]).cuda()
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(ids.numel(), k, device="cuda", generator=g).clamp(-448, 448).to(torch.float8_e4m3fn)
    w = torch.randn(e, n, k, device="cuda", generator=g).mul(4).clamp(-448, 448).to(torch.float8_e4m3fn)
    sa = torch.rand(ids.numel(), k // 128, device="cuda", generator=g) + 0.5
    sw = torch.rand(e, n // 128, k // 128, device="cuda", generator=g) * 0.01
    return a, sa, w, sw, ids


def deepseek_sampled_reference(a, sa, w, sw, ids):
    """(every 97th row, the reference output of those rows on the CPU)."""
    rows = torch.arange(0, ids.numel(), 97, device="cuda")
    return rows, ref.moe_gemm_fp8(a[rows].cpu(), sa[rows].cpu(), w.cpu(), sw.cpu(), ids[rows].cpu(), None)


@needs_dsl
def test_epilogue_prefetch_sass_bf16():
    """epilogue_prefetch on the bf16 kernel (128 x 256 tile, contiguous, row weights): compiles without spills, the
    same stores."""
    cfg, d = compile_dump(("bf16", 4096, 7168, 32, "contiguous", True, 256), epilogue_prefetch=True,
                          epilogue="direct")
    ops = d.opcodes()
    assert re.findall(r"\bHGMMA\.[0-9x]+\.F32\S*", d.sass) == ["HGMMA.64x256x16.F32.BF16"] * 8, ops
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops
    assert d.ptx.count("st.global.b32") == cfg.tile_n * 64 // 128 // 2 and d.count("STG.E.U16") == 0, ops


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_gpu_bf16_epilogue_variants(layout):
    """epilogue_prefetch and the smem epilogue on the bf16 kernel (both tile shapes the rule picks, and 64 x 64 / 64
    x 256), bit-equal to the kernel without them."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    for tiles, extra in itertools.product(
            (dict(tile_m=128, tile_n=256), dict(tile_m=64, tile_n=128), dict(tile_m=64, tile_n=64),
             dict(tile_m=64, tile_n=256)),
            (dict(epilogue_prefetch=True), dict(epilogue="smem"), dict(epilogue_prefetch=True, epilogue="smem"))):
        if layout == "contiguous":
            a, w, mi, rw = _contiguous_case(7, 512, 256, [37, 0, 300, 1, 64, 129, 5], torch.bfloat16, 62, True)
            args = (a.cuda(), w.cuda(), mi.cuda(), None, rw.cuda())
        else:
            a, w, mm, rw = _masked_case(5, 160, 512, 256, [0, 160, 3, 65, 129], torch.bfloat16, 63, True)
            args = (a.cuda(), w.cuda(), None, mm.cuda(), rw.cuda())
        out = moe_gemm_bf16(*args, tiles=dict(tiles, **extra))
        base = moe_gemm_bf16(*args, tiles=dict(tiles, epilogue="direct"))
        torch.cuda.synchronize()
        assert torch.equal(out, base), (tiles, extra, (out.float() - base.float()).abs().max())
