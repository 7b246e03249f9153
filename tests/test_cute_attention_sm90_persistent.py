"""The persistent grid and the SMEM + TMA-store O epilogue of the CuTeDSL Hopper attention (FmhaSm90Config.persistent,
.o_tma): CPU checks of the config, the tile walk and the epilogue's register-to-SMEM mapping, GPU tests (marked gpu,
sm_90 only) against the fp64 reference. Their compile and SASS are checked with the other configs in
tests/test_cute_attention_sm90.py (SM90_PERSISTENT_SASS, SM90_O_TMA_SASS)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_ops.attention import scheduler as S
from tests.helpers import assert_attention_close, examples
from tests.test_cute_attention_sm90 import (
    SM90_GPU_CASES,
    _case_id,
    _need_sm90,
    _sm90_case,
    _variant_id,
    cu,
    dsl_arch_sm90,  # noqa: F401 (a fixture, used by name)
    needs_dsl,
    sm90_gpu_cases,
)

pytestmark = pytest.mark.filterwarnings("ignore:This static loop has")


def test_persistent_config_rules():
    from cute_ops.attention.fmha_sm90 import FmhaSm90Config

    with pytest.raises(ValueError, match="CTA count"):
        FmhaSm90Config("bf16", 64, persistent=-1)
    with pytest.raises(ValueError, match="spills"):  # the tile loop's state on top of 192 x 128 with overlap
        FmhaSm90Config("bf16", 64, tile_m=192, overlap=True, persistent=132)
    one, two = FmhaSm90Config("bf16", 128), FmhaSm90Config("bf16", 128, persistent=132)
    assert (one.q_stages, two.q_stages) == (1, 2)
    assert two.smem_bytes() - one.smem_bytes() == 128 * 128 * 2  # a second Q buffer
    # o_tma: a tile_m x D staging tile; hd128 persistent with 2 K / V stages still fits (225 of 227 KiB)
    three = FmhaSm90Config("bf16", 128, persistent=132, o_tma=True)
    assert three.smem_bytes() - two.smem_bytes() == 128 * 128 * 2 and three.smem_bytes() == 230400
    assert FmhaSm90Config("bf16", 64, tile_m=192, o_tma=True).smem_bytes() == 1024 + 2 * 64 * (2 * 192 + 4 * 128)


@needs_dsl
@pytest.mark.usefixtures("dsl_arch_sm90")
@pytest.mark.parametrize("d,tile_m", [(64, 128), (128, 128), (64, 192)])
def test_o_tma_register_to_smem_mapping(d, tile_m):
    """Evaluated on the host with the kernel's own objects: for threads of every consumer warpgroup, the O fragment
    of the tile's MMA (2 or 3 warpgroups) retiled for the epilogue's stmatrix copy (built over one warpgroup's
    (64, D) slice) holds, value for value, the (row, column) the copy writes there, 64 * wg rows down: each O value
    lands in its warpgroup's SMEM slice at its own position."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from cute_ops.attention import fmha_sm90
    from cute_ops.attention._fmha_sm90_kernel import FmhaSm90

    kern = FmhaSm90(fmha_sm90.FmhaSm90Config("bf16", d, tile_m=tile_m, o_tma=True))
    got = torch.zeros(2, d // 2, 2, dtype=torch.int32)

    @cute.jit
    def run(o, tt):
        kern.dtype = cutlass.BFloat16
        _, pv = kern.make_mmas()
        _, thr = kern.o_smem_copy(tt)
        src = thr.retile(pv.get_slice(tt).partition_C(cute.make_identity_tensor((tile_m, d))))
        dst = thr.partition_S(cute.make_identity_tensor((64, d)))
        for i in cutlass.range_constexpr(cute.size(src)):
            for k in cutlass.range_constexpr(2):
                o[0, i, k] = src[i][k]
                o[1, i, k] = dst[i][k]

    for t in (0, 5, 77, 127, 128, 200, 255, *((300, 383) if tile_m == 192 else ())):
        run(from_dlpack(got), cutlass.Int32(t))
        src, dst = got[0], got[1]
        assert torch.equal(src[:, 0], dst[:, 0] + 64 * (t // 128)) and torch.equal(src[:, 1], dst[:, 1]), t
        lane, warp = t % 32, t % 128 // 32
        assert set(dst[:, 0].tolist()) == {16 * warp + lane // 4, 16 * warp + lane // 4 + 8}
        assert len({tuple(x) for x in src.tolist()}) == d // 2  # D / 2 distinct values per thread


@settings(max_examples=examples(60), deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 127, 128, 129, 300, 1000]), min_size=1, max_size=40),
       heads=st.sampled_from([1, 3, 8]), tile_m=st.sampled_from([128, 192]), reverse_m=st.booleans(),
       grid=st.sampled_from([1, 2, 7, 132]))
def test_persistent_walk_covers_every_tile_once(lengths, heads, tile_m, reverse_m, grid):
    """The CTAs' walks (c, c + grid, ... over the PACKED order) partition the real tiles, each CTA's items in
    PACKED order, and the busiest CTA has at most one tile more than the least busy."""
    cu_q = cu(lengths).tolist()
    walks = [S.persistent_tiles(cu_q, c, grid, heads, tile_m, reverse_m) for c in range(grid)]
    flat = [t for w in walks for t in w]
    assert len(flat) == len(set(flat)) and set(flat) == S.real_tiles(cu_q, heads, tile_m)
    for c, w in enumerate(walks):
        assert w == [S.packed_tile(cu_q, c + i * grid, heads, tile_m, reverse_m) for i in range(len(w))]
    sizes = [len(w) for w in walks]
    assert max(sizes) - min(sizes) <= 1


# Fully specified variants (the base config of a call may be the 192-row tile with overlap) with few CTAs, so each
# CTA walks many tiles: ping-pong, one CTA, ping-pong with the intra-warpgroup overlap, the SM
# count (more CTAs than tiles in the small cases: CTAs without a tile exit at once).
PERSISTENT_VARIANTS = [dict(persistent=3, tile_m=128, overlap=False),
                       dict(persistent=1, tile_m=128, overlap=False),
                       dict(persistent=5, tile_m=128, overlap=True),
                       dict(persistent=132, tile_m=128, overlap=False)]
# hd64 only: three consumer warpgroups
PERSISTENT_HD64_VARIANTS = [dict(persistent=4, tile_m=192, overlap=False)]


# The O epilogue through SMEM + TMA store (o_tma), on the persistent grid and with one CTA per tile: two and three
# consumer warpgroups, one CTA walking every tile. SM90_GPU_CASES hold varlen batches with empty sequences and
# sk = 0, slices that end inside a sequence (register stores) and last sequences that end inside a slice (the TMA
# box clipped at the tensor's end), windows, sinks, GQA / MQA; every case checks the LSE.
O_TMA_VARIANTS = [dict(o_tma=True, persistent=3, tile_m=128, overlap=False),
                  dict(o_tma=True, persistent=132, tile_m=128, overlap=False),
                  dict(o_tma=True, persistent=0, tile_m=128, overlap=False),
                  dict(o_tma=True, persistent=1, tile_m=128, overlap=False)]
O_TMA_HD64_VARIANTS = [dict(o_tma=True, persistent=4, tile_m=192, overlap=False),
                       dict(o_tma=True, persistent=0, tile_m=192, overlap=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", PERSISTENT_VARIANTS + O_TMA_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("case", SM90_GPU_CASES, ids=_case_id)
def test_gpu_sm90_persistent_matches_reference(case, variant):
    """Causal, windows (left, right, both), sinks, GQA / MQA, varlen with empty sequences and sk = 0 (tiles with no
    key tile: neither role touches the pipelines), sk < sq, LSE; the persistent grid and the o_tma epilogue."""
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 {variant} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", PERSISTENT_HD64_VARIANTS + O_TMA_HD64_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("case", [c for c in SM90_GPU_CASES if c[4] == 64], ids=_case_id)
def test_gpu_sm90_persistent_hd64_tiles_match_reference(case, variant):
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 persistent {variant} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [2, 132])
def test_gpu_sm90_persistent_gpt_oss_window_many_tiles(persistent):
    """The target shape, scaled down: GPT-OSS heads (64 / 8, hd64), window (128, 0) + sinks, 2 x 2048 plus a
    short and an empty sequence; the entry's config (for_call turns the persistent grid on for windows)."""
    _need_sm90()
    case = ([2048, 0, 2048, 77], [2048, 0, 2048, 77], 64, 8, 64, torch.bfloat16, True, (128, 0), True)
    out, lse, want_out, want_lse = _sm90_case(*case, seed=11, variant=dict(persistent=persistent))
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 persistent={persistent} gpt-oss window")


@pytest.mark.gpu
@settings(max_examples=examples(60), deadline=None)
@given(case=sm90_gpu_cases(), persistent=st.sampled_from([0, 1, 2, 5, 132]), o_tma=st.booleans())
def test_gpu_sm90_persistent_drawn_cases_match_reference(case, persistent, o_tma):
    _need_sm90()
    if sum(case[0]) == 0:
        return  # nothing to compare (the entry returns empty tensors without a launch)
    variant = dict(persistent=persistent, tile_m=128, overlap=False, o_tma=o_tma)
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 {variant} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("d,persistent", [(64, 2), (64, 0), (128, 132)])
def test_gpu_sm90_o_tma_ragged_batch(d, persistent):
    """Sequences ending at every kind of slice boundary (1, 63, 64, 65, 127, 128, 129 rows, an empty one) with the
    last one ending inside a slice, GPT-OSS window + sinks at hd64 / causal at hd128: no row of a neighbouring
    sequence is overwritten (the output is poisoned first) and each slice's rows land in place."""
    _need_sm90()
    lengths = [65, 1, 0, 128, 63, 129, 64, 300, 127, 71]
    window, sink = ((128, 0), True) if d == 64 else ((-1, -1), False)
    case = (lengths, lengths, 8, 2, d, torch.bfloat16, True, window, sink)
    out, lse, want_out, want_lse = _sm90_case(*case, seed=5, variant=dict(o_tma=True, persistent=persistent,
                                                                           tile_m=128, overlap=False))
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 o_tma ragged d={d} persistent={persistent}")
