"""Hopper (sm_90a) Gluon MLA decode (triton_ops/attention/mla_sm90.py) against dispatch/reference/attention.py.

* CPU: compile for sm_90a in a fresh process with Triton 3.6 (LOWBIT_TRITON36_PATH, or the installed Triton when it
  is 3.6.x), and with the installed Triton when it is another version (the source's portability), and check the
  machine code of each schedule: wgmma, TMA and mbarrier waits in the PTX; HGMMA (serial / overlap: 64x32 for S,
  64x256 for O, the two warpgroups split both; pingpong: 64x64 S of a warpgroup's own tiles, 64x256 O, and
  setmaxnreg between the partitions), UTMALDG, SYNCS (mbarrier), no local-memory spills, wgmma not serialized by
  ptxas, shared memory within an H100's.
* CPU: the refusal predicate and the split rule.
* GPU (-m gpu, an sm_90 device): H = 128 / 64 / 16, Sq 1..4 folded into the rows, causal or not, lengths 0 / 1 /
  page edges / 8k, permuted pages, garbage and out-of-range page ids, NaN in every cache slot no sequence
  writes, split counts 1..7 and auto, every schedule, the dispatcher's choice, a CUDA graph replayed with new
  lengths.
"""

from __future__ import annotations

import math
import os
import textwrap

import numpy as np
import pytest
import torch

from tests.helpers import assert_attention_close
from tests.test_attention_mla import make_case
from tests.test_attention_sm90 import ROOT, _triton36_env, run_compile_json
from triton_ops.attention import mla_sm90 as M
from triton_ops.attention.mla_decode import mla_decode as portable_mla_decode

# ------------------------------------------------------------------------------------------- compile-only (CPU)

_COMPILE = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from tests.helpers import sass_stats
    from triton_ops.attention import mla_sm90 as M
from triton_ops.attention.mla_decode import mla_decode as portable_mla_decode
    res = {"triton": triton.__version__, "configs": []}
    for sq, h, causal, final, sched in ((1, 128, True, False, "serial"), (2, 128, True, True, "serial"),
                                        (3, 16, False, False, "serial"), (1, 128, True, False, "overlap"),
                                        (2, 128, True, True, "overlap"), (1, 128, True, False, "pingpong"),
                                        (2, 128, True, True, "pingpong"), (3, 16, False, False, "pingpong"),
                                        (1, 128, True, False, "pingpong_pv_first"),
                                        (2, 128, True, True, "pingpong_pv_first"),
                                        (1, 128, True, False, "pingpong_pv_first_c2"),
                                        (2, 128, True, True, "pingpong_pv_first_c2"),
                                        (1, 128, True, False, "pingpong_pv_first_c4"),
                                        (3, 16, False, False, "pingpong_pv_first_c4"),
                                        (1, 128, True, False, "pingpong_pv_first_c4_r1"),
                                        (2, 128, True, True, "pingpong_pv_first_c4_r1"),
                                        (1, 128, True, False, "pingpong_pair"), (2, 128, True, True, "pingpong_pair"),
                                        (3, 16, False, False, "pingpong_pair"),
                                        (1, 128, True, False, "pingpong_pair_rp"),
                                        (2, 128, True, True, "pingpong_pair_rp")):
        c = M.compile_sm90(sq, h, causal, final, any_version=True, schedule=sched)
        ptx = c.asm["ptx"]
        res["configs"].append({"cfg": [sq, h, causal, final, sched], "wgmma": ptx.count("wgmma.mma_async"),
                               "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                               "mbar_wait": ptx.count("mbarrier.try_wait"), "bar_sync": ptx.count("bar.sync"),
                               "arrive": ptx.count("mbarrier.arrive.shared::cta"),
                               "smem": c.metadata.shared, "sass": sass_stats(c.asm["cubin"])})
    print(json.dumps(res))
""")



# ptxas spills a few registers of the 64-column chunk schedule's compute warpgroup outside its tile loop (Triton
# 3.6: 6 stores, 4 loads): at most this many there, none elsewhere
SPILL_BOUND = {"pingpong_pv_first_c4": 8, "pingpong_pv_first_c4_r1": 8}


def _check_compile(env, spills_ok=False):
    res = run_compile_json(_COMPILE, env)
    by_cfg = {tuple(r["cfg"]): r for r in res["configs"]}
    for r in res["configs"]:
        what = f"triton {res['triton']} (Sq, H, causal, final, schedule) = {r['cfg']}"
        sched = r["cfg"][4]
        unchunked = by_cfg.get((*r["cfg"][:4], "pingpong_pv_first"))
        if "_c" in sched and unchunked:  # one full-barrier wait per column chunk: more waits than the halves;
            # each chunk's barriers their own allocation, so the extra waits come without a CTA barrier (bar.sync)
            # each (Triton's barrier pass puts one between two waits on one allocation)
            extra_waits = r["mbar_wait"] - unchunked["mbar_wait"]
            assert extra_waits > 0, f"{what}: {r} vs {unchunked}"
            assert r["bar_sync"] - unchunked["bar_sync"] < extra_waits // 2, f"{what}: {r} vs {unchunked}"
        if sched.endswith("_r1") and unchunked:  # one release arrival per warpgroup and slot
            assert r["arrive"] < unchunked["arrive"], f"{what}: {r} vs {unchunked}"
        plain = by_cfg.get((*r["cfg"][:4], sched.removesuffix("_r1")))
        if sched.endswith("_r1") and plain:  # and fewer CTA barriers than the same chunks without
            assert r["bar_sync"] < plain["bar_sync"], f"{what}: {r} vs {plain}"
        assert r["wgmma"] > 0 and r["tma"] > 0 and r["mbar_wait"] > 0, f"{what}: {r}"
        assert r["smem"] <= 232448, f"{what}: {r['smem']} bytes of shared memory"
        sass = r["sass"]
        if sass is None:
            continue  # no cuobjdump / nvdisasm with this Triton: PTX checks only
        shapes = sass["HGMMA_shapes"]
        if sched.startswith("pingpong"):  # each warpgroup: the whole S of its tiles, its 256 columns of O
            assert set(shapes) == {"64x64x16", "64x256x16"}, f"{what}: {sass}"
            assert r["setmaxnreg"] > 0, f"{what}: no register reallocation between the partitions"
        else:
            assert set(shapes) == {"64x32x16", "64x256x16"}, f"{what}: the warpgroups do not split S and O: {sass}"
        assert sass["UTMALDG"] > 0 and sass["SYNCS"] > 0, f"{what}: {sass}"
        bound = SPILL_BOUND.get(sched, 0)
        assert spills_ok or (sass["STL"] <= bound and sass["LDL"] <= bound), f"{what}: register spills {sass}"
        # ptxas serializes wgmma (a wait after every HGMMA) when it cannot prove an accumulator is left alone
        # while its MMA runs; the kernel waits twice per key tile (S, then P V) in each of its three tile copies
        # (PINGPONG: one full wait per P V site, 8 in all).
        assert sass["wait0"] < sass["HGMMA"] // 4, f"{what}: wgmma serialized by ptxas: {sass}"
        if sched == "pingpong":  # S of the own tile waited with the other tile's P V still running
            assert sass["ex2_between_waits"], f"{what}: {sass}"
        if sched == "pingpong_pair":  # P_a V_a waited with P_b V_b still running (slot 0 released early)
            assert sass["ex2_between_waits"], f"{what}: {sass}"
            if unchunked:  # the row max published on an mbarrier of its own, ahead of P
                assert r["arrive"] > unchunked["arrive"], f"{what}: {r} vs {unchunked}"
        if sched.startswith("pingpong_pair"):  # the owner's P V from registers in _rp (half the P V), else none
            want = sass["HGMMA_shapes"]["64x256x16"] // 2 if sched.endswith("_rp") else 0
            assert sass["HGMMA_regA"] == want, f"{what}: {sass}"
        if sched == "overlap":  # the softmax (16 exponentials per thread) between the two waits
            assert sass["ex2_between_waits"] and min(sass["ex2_between_waits"]) >= 8, f"{what}: {sass}"
    return res


def test_sm90_compile_triton36():
    """Compile for sm_90a with Triton 3.6 (the GPU image's) without a GPU, and check the machine code."""
    env, why = _triton36_env()
    if env is None:
        pytest.skip(why)
    res = _check_compile(env)
    assert res["triton"].startswith("3.6."), res["triton"]


def test_sm90_compile_installed_triton():
    """The same source compiles with the installed Triton when it is not 3.6 (runs stay refused there). Spills are
    not checked there: Triton 3.9 spills a few registers (22 stores at 244 + spill), 3.6 none."""
    import triton

    if triton.__version__.startswith("3.6."):
        pytest.skip("the installed Triton is 3.6: test_sm90_compile_triton36 covers it")
    if not M._GLUON_OK:
        pytest.skip(f"no Gluon Hopper API in triton {triton.__version__}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    _check_compile(env, spills_ok=True)


# ------------------------------------------------------------------------------------------------ CPU


def _args(**change):
    g = np.random.default_rng(0)
    c = make_case(g, layout="bf16", batch=2, lens=[70, 5], sq=1, h=16, bs=64, max_blocks=2)
    a = dict(q=c.q, kv_cache=c.kv_cache, block_table=c.block_table, seqused_k=c.seqused_k, indices=None,
             layout="bf16", v_dim=512, softmax_scale=c.scale, causal=True, window_left=-1, num_splits=0)
    a.update(change)
    return tuple(a.values())


def test_refusals_name_the_reason():
    why = M.supports_mla_decode_sm90(*_args())
    assert why and ("triton" in why or "CUDA" in why), why  # a CPU host: the version gate or the device
    with pytest.raises(ValueError, match="sm_90 Gluon"):
        M.mla_decode(*_args())


def test_split_rule():
    """Static sizes only; one 224 KB CTA per SM: fill the SMs without a partial extra wave."""
    assert M.choose_splits(32, 64, None) == 1  # the interpreter / no SM count
    assert M.choose_splits(32, 64, 132) == 4  # B = 16, H = 128: 32 CTAs -> 128
    assert M.choose_splits(128, 64, 132) == 1  # B = 64: one wave already
    assert M.choose_splits(256, 128, 132) == 1
    assert M.choose_splits(2, 2, 132) == 1  # < 4 pages per split: no split
    for programs in (1, 7, 33, 100):
        assert 1 <= M.choose_splits(programs, 128, 132) <= M.MAX_SPLITS


# ------------------------------------------------------------------------------------------------- GPU


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


GPU_CASES = [  # (lens, sq, h, causal, splits)
    pytest.param([8192, 0, 1, 5000, 8191, 130, 64, 63], 1, 128, True, (0, 1, 3, 7), id="h128-sq1"),
    pytest.param([8192, 0, 1, 5000, 8191, 130, 64, 65], 2, 128, True, (0, 1, 5), id="h128-sq2"),
    pytest.param([300, 2, 1, 4097], 4, 128, True, (0, 2), id="h128-sq4"),
    pytest.param([1000, 1, 2, 129], 1, 64, True, (0, 1), id="h64-sq1"),
    pytest.param([1000, 2, 3, 129], 3, 16, True, (0, 4), id="h16-sq3-rows-span-queries"),
    pytest.param([777, 0, 1, 4096], 2, 128, False, (0, 3), id="h128-sq2-noncausal"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", M.SCHEDULES)
@pytest.mark.parametrize("lens,sq,h,causal,splits", GPU_CASES)
def test_gpu_matches_reference(lens, sq, h, causal, splits, schedule):
    """Permuted pages (each sequence its own random permutation), garbage ids past the used pages, NaN in every
    cache slot no sequence writes (the last page's tail included), several split counts."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    g = np.random.default_rng(31)
    max_blocks = -(-max(lens) // 64) + 1
    c = make_case(g, layout="bf16", batch=len(lens), lens=lens, sq=sq, h=h, bs=64, max_blocks=max_blocks,
                  causal=causal, device="cuda")
    assert M.supports_mla_decode_sm90(*c.args()) is None, M.supports_mla_decode_sm90(*c.args())
    want = c.reference()
    for s in splits:
        out, lse = M.mla_decode(*c.args(s), schedule=schedule)
        assert_attention_close(out, lse, *want, f"sm90 gluon lens={lens} Sq={sq} H={h} causal={causal} "
                                                f"splits={s} schedule={schedule}")


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", M.SCHEDULES)
def test_gpu_bad_page_ids_are_masked_keys(schedule):
    """Page ids -1, num_blocks and 2^30 inside the used range: masked keys (TMA zero fill, never read)."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    g = np.random.default_rng(32)
    lens = [640, 300, 129]
    nb = 3 * 11 + 3
    c = make_case(g, layout="bf16", batch=3, lens=lens, sq=2, h=128, bs=64, max_blocks=11, device="cuda",
                  bad_entries=[(0, 0, -1), (0, 5, nb), (1, 2, 2**30), (2, 2, -(2**30))])
    want = c.reference()
    for s in (0, 1, 2):
        out, lse = M.mla_decode(*c.args(s), schedule=schedule)
        assert_attention_close(out, lse, *want, f"bad page ids, splits={s} schedule={schedule}")


@pytest.mark.gpu
def test_gpu_bad_page_and_length_past_capacity():
    """A bad page id inside the used length plus seqused_k past the table's capacity (640 keys): the Sq = 4 queries
    keep their positions seqused_k - 4 + s (so causal decides which of the capacity's keys each sees), the keys
    past the capacity and behind the bad pages are masked. The default schedule and the dispatcher's choice."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    from dispatch import ops

    g = np.random.default_rng(36)
    nb = 3 * 10 + 3
    c = make_case(g, layout="bf16", batch=3, lens=[640, 300, 640], sq=4, h=128, bs=64, max_blocks=10, device="cuda",
                  bad_entries=[(0, 3, -1), (1, 1, nb + 2), (2, 9, 2**30)])
    clamped = c.reference()
    c.seqused_k.copy_(torch.tensor([642, 300, 700], dtype=torch.int32))
    want = c.reference()
    # the case tells the documented positions from the capacity-clamped ones (sequence 0's first queries)
    assert not torch.allclose(want[0][0].float(), clamped[0][0].float(), atol=1e-2)
    for s in (0, 1, 3):
        assert_attention_close(*M.mla_decode(*c.args(s)), *want, f"bad page + length past capacity, splits={s}")
    out, lse = ops.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, softmax_scale=c.scale, return_lse=True)
    assert_attention_close(out, lse, *want, "ops.mla_decode, bad page + length past capacity")
    assert_attention_close(*portable_mla_decode(*c.args(2)), *want, "portable kernel, length past capacity")


@pytest.mark.gpu
def test_gpu_dispatch_routes_by_argument():
    """auto takes the Gluon row for the bf16 dense call on sm_90, the portable kernel for what it refuses."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    from dispatch.registry import select
    from dispatch.table import TABLE

    g = np.random.default_rng(33)
    c = make_case(g, layout="bf16", batch=2, lens=[300, 64], sq=1, h=128, bs=64, max_blocks=5, device="cuda")
    entry = select(TABLE["mla_decode"], "mla_decode", "auto", c.args(), {})
    assert entry.impl.endswith("mla_sm90:mla_decode"), entry
    from dispatch import ops

    out, lse = ops.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, softmax_scale=c.scale, return_lse=True)
    assert_attention_close(out, lse, *c.reference(), "ops.mla_decode auto on sm_90")
    c16 = make_case(g, layout="bf16", batch=2, lens=[300, 64], sq=1, h=128, bs=16, max_blocks=20, device="cuda")
    why = M.supports_mla_decode_sm90(*c16.args())
    assert why and "page size 16" in why, why
    entry = select(TABLE["mla_decode"], "mla_decode", "auto", c16.args(), {})
    assert entry.impl.endswith("mla_decode:mla_decode") and "sm90" not in entry.impl, entry


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", M.SCHEDULES)
@pytest.mark.parametrize("splits", [0, 1])
def test_gpu_cuda_graph_new_lengths(splits, schedule):
    """Capture once, then change seqused_k in place between replays: the result follows."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    g = np.random.default_rng(34)
    c = make_case(g, layout="bf16", batch=3, lens=[4096] * 3, sq=2, h=128, bs=64, max_blocks=64, device="cuda")
    args = c.args(splits)
    M.mla_decode(*args, schedule=schedule)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = M.mla_decode(*args, schedule=schedule)
    for lens in ([3000, 4096, 5], [1, 0, 4095], [4096, 17, 2048]):
        c.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, *c.reference(), f"graph replay lens={lens} splits={splits} "
                                                         f"schedule={schedule}")
    assert math.isfinite(float(out.float().abs().max()))


def test_launcher_dry_run(monkeypatch):
    """The host side on CPU tensors up to the launch (the kernel itself is stubbed): grid, TMA views of q and of
    the cache (token rows, page-row tiles), the split buffers, the final flag."""
    seen = []
    monkeypatch.setattr(M, "supports_mla_decode_sm90", lambda *a: None)
    monkeypatch.setattr(M, "launch", lambda kernel, grid, *args, **kw: seen.append((grid, args, kw)))
    monkeypatch.setattr(M, "reduce_splits", lambda o_buf, l_buf, out, lse, n: o_buf is out or seen.append("reduce"))
    g = np.random.default_rng(1)
    c = make_case(g, layout="bf16", batch=3, lens=[300, 5, 64], sq=2, h=48, bs=64, max_blocks=6)
    M.mla_decode(*c.args(3), schedule="serial")
    (grid, args, kw), red = seen
    assert grid == (2, 3, 3) and red == "reduce"  # ceil(2 x 48 / 64) row blocks, B, splits
    qd, qrd, knd, krd = args[:4]
    nb = c.kv_cache.shape[0]
    assert qd.shape == [3 * 2 * 48, 576] and qd.strides == [576, 1] and qd.block_shape == [64, 512]
    assert qrd.block_shape == [64, 64] and qrd.base.data_ptr() == qd.base.data_ptr()
    assert knd.shape == [nb * 64, 576] and knd.strides == [576, 1] and knd.block_shape == [64, 512]
    assert krd.block_shape == [64, 64] and knd.base.data_ptr() == c.kv_cache.data_ptr()
    bt, seq, o_buf, l_buf = args[4:8]
    assert bt is c.block_table and seq is c.seqused_k
    assert o_buf.shape == (3, 2, 48, 3, 512) and o_buf.dtype == torch.float32 and l_buf.shape == (3, 2, 48, 3)
    assert args[9] == nb and args[10] == 2 and args[11] == 6  # num_blocks, pages per split, table capacity
    assert kw["SQ"] == 2 and kw["H"] == 48 and kw["FINAL"] is False and kw["num_warps"] == 8
    seen.clear()
    M.mla_decode(*c.args(1), schedule="serial")
    (grid, args, kw), = seen  # one split: bf16 straight into out, no reduction
    assert grid == (2, 3, 1) and kw["FINAL"] is True and args[6].dtype == torch.bfloat16
    seen.clear()
    M.mla_decode(*c.args(3), schedule="pingpong")  # the same arguments, the warp-specialized kernel
    (grid, args, kw), _ = seen
    assert grid == (2, 3, 3) and kw["num_warps"] == 4 and "OVERLAP" not in kw and kw["FINAL"] is False
    assert kw["PV_FIRST"] is False and args[0].block_shape == [64, 256] and args[2].block_shape == [64, 256]
    assert args[1].block_shape == [64, 64] and args[3].block_shape == [64, 64]  # NoPE halves, RoPE
    seen.clear()
    for sched, nch in (("pingpong_pv_first_c2", 2), ("pingpong_pv_first_c4", 4), ("pingpong_pv_first_c4_r1", 4)):
        M.mla_decode(*c.args(3), schedule=sched)  # NoPE halves in column chunks
        (grid, args, kw), _ = seen
        assert kw["PV_FIRST"] is True and kw["NCH"] == nch and kw["num_warps"] == 4
        assert kw["R1"] is sched.endswith("_r1")
        assert args[0].block_shape == [64, 256 // nch] and args[2].block_shape == [64, 256 // nch]
        seen.clear()
    M.mla_decode(*c.args(3), schedule="pingpong_pair")  # the tile-pair hand-off, on the same kernel
    (grid, args, kw), _ = seen
    assert kw["PAIR"] == 1 and kw["NCH"] == 1 and kw["R1"] is False and args[2].block_shape == [64, 256]
    seen.clear()
    M.mla_decode(*c.args(3), schedule="pingpong_pair_rp")  # and the owner's P V from registers
    (grid, args, kw), _ = seen
    assert kw["PAIR"] == 2 and kw["PV_FIRST"] is False
    seen.clear()
    M.mla_decode(*c.args(3))  # the default schedule
    (grid, args, kw), _ = seen
    assert M.DEFAULT_SCHEDULE == "pingpong_pair" and kw["num_warps"] == 4
    assert kw["NCH"] == 1 and kw["R1"] is False and kw["PAIR"] == 1
    with pytest.raises(ValueError, match="schedule"):
        M.mla_decode(*c.args(3), schedule="fast")
