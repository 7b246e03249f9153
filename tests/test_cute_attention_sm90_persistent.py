"""The persistent grid of the CuTeDSL Hopper attention (FmhaSm90Config.persistent): CPU checks of the config and the
tile walk, GPU tests (marked gpu, sm_90 only) against the fp64 reference. Its compile and SASS are checked with
the other configs in tests/test_cute_attention_sm90.py (SM90_PERSISTENT_SASS)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_ops.attention import scheduler as S
from tests.helpers import assert_attention_close
from tests.test_cute_attention_sm90 import (
    SM90_GPU_CASES,
    _case_id,
    _need_sm90,
    _sm90_case,
    _variant_id,
    cu,
    sm90_gpu_cases,
)

pytestmark = pytest.mark.filterwarnings("ignore:This static loop has")


def test_persistent_config_rules():
    from cute_ops.attention.fmha_sm90 import FmhaSm90Config

    with pytest.raises(ValueError, match="packed schedule"):
        FmhaSm90Config("bf16", 64, persistent=132, schedule="grid")
    with pytest.raises(ValueError, match="CTA count"):
        FmhaSm90Config("bf16", 64, persistent=-1)
    with pytest.raises(ValueError, match="spills"):  # the tile loop's state on top of 192 x 128 with overlap
        FmhaSm90Config("bf16", 64, tile_m=192, overlap=True, persistent=132)
    one, two = FmhaSm90Config("bf16", 128), FmhaSm90Config("bf16", 128, persistent=132)
    assert (one.q_stages, two.q_stages) == (1, 2)
    assert two.smem_bytes() - one.smem_bytes() == 128 * 128 * 2  # a second Q buffer
    with pytest.raises(ValueError, match="SMEM"):  # 2 x 32 KiB Q + 3 x 64 KiB K / V
        FmhaSm90Config("bf16", 128, kv_stages=3, persistent=132)


@settings(max_examples=60, deadline=None)
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
# CTA walks many tiles: ping-pong, one CTA without ping-pong, ping-pong with the intra-warpgroup overlap, the SM
# count (more CTAs than tiles in the small cases: CTAs without a tile exit at once).
PERSISTENT_VARIANTS = [dict(persistent=3, tile_m=128, overlap=False),
                       dict(persistent=1, tile_m=128, pingpong=False, overlap=False),
                       dict(persistent=5, tile_m=128, overlap=True),
                       dict(persistent=132, tile_m=128, overlap=False)]
# hd64 only: three consumer warpgroups, a deeper K / V ring
PERSISTENT_HD64_VARIANTS = [dict(persistent=4, tile_m=192, overlap=False),
                            dict(persistent=6, tile_m=128, kv_stages=4, overlap=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", PERSISTENT_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("case", SM90_GPU_CASES, ids=_case_id)
def test_gpu_sm90_persistent_matches_reference(case, variant):
    """Causal, windows (left, right, both), sinks, GQA / MQA, varlen with empty sequences and sk = 0 (tiles with no
    key tile: neither role touches the pipelines), sk < sq, LSE."""
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 persistent {variant} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", PERSISTENT_HD64_VARIANTS, ids=_variant_id)
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
@settings(max_examples=40, deadline=None)
@given(case=sm90_gpu_cases(), persistent=st.sampled_from([1, 2, 5, 132]))
def test_gpu_sm90_persistent_drawn_cases_match_reference(case, persistent):
    _need_sm90()
    if sum(case[0]) == 0:
        return  # nothing to compare (the entry returns empty tensors without a launch)
    variant = dict(persistent=persistent, tile_m=128, overlap=False)
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 persistent {variant} {case}")
