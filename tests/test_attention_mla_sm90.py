"""Hopper (sm_90a) Gluon MLA decode (triton_ops/attention/mla_sm90.py) against dispatch/reference/attention.py.

* CPU: compile for sm_90a in a fresh process with Triton 3.6 (LOWBIT_TRITON36_PATH, or the installed Triton when it
  is 3.6.x), and with the installed Triton when it is another version (the source's portability), and check the
  machine code: wgmma, TMA and mbarrier waits in the PTX; HGMMA (64x64 S of a warpgroup's own tiles, 64x256 O,
  both from shared memory, and setmaxnreg between the partitions), UTMALDG, SYNCS (mbarrier), no local-memory
  spills, wgmma not serialized by ptxas (P_a V_a waited with P_b V_b still running), shared memory within an
  H100's.
* CPU: the refusal predicate and the split rule.
* GPU (-m gpu, an sm_90 device): H = 128 / 64 / 16, Sq 1..4 folded into the rows, causal or not, lengths 0 / 1 /
  page edges / 8k, permuted pages, garbage and out-of-range page ids, NaN in every cache slot no sequence
  writes, split counts 1..7 and auto, the dispatcher's choice, a CUDA graph replayed with new lengths.
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
    res = {"triton": triton.__version__, "configs": []}
    for sq, h, causal, final in ((1, 128, True, False), (2, 128, True, True), (3, 16, False, False)):
        c = M.compile_sm90(sq, h, causal, final, any_version=True)
        ptx = c.asm["ptx"]
        res["configs"].append({"cfg": [sq, h, causal, final], "wgmma": ptx.count("wgmma.mma_async"),
                               "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                               "mbar_wait": ptx.count("mbarrier.try_wait"), "smem": c.metadata.shared,
                               "sass": sass_stats(c.asm["cubin"])})
    print(json.dumps(res))
""")


def _check_compile(env, spills_ok=False):
    res = run_compile_json(_COMPILE, env)
    for r in res["configs"]:
        what = f"triton {res['triton']} (Sq, H, causal, final) = {r['cfg']}"
        assert r["wgmma"] > 0 and r["tma"] > 0 and r["mbar_wait"] > 0, f"{what}: {r}"
        assert r["smem"] <= 232448, f"{what}: {r['smem']} bytes of shared memory"
        sass = r["sass"]
        if sass is None:
            continue  # no cuobjdump / nvdisasm with this Triton: PTX checks only
        # each warpgroup: the whole S of its tiles, its 256 columns of O, P from shared memory
        assert set(sass["HGMMA_shapes"]) == {"64x64x16", "64x256x16"}, f"{what}: {sass}"
        assert sass["HGMMA_regA"] == 0, f"{what}: {sass}"
        assert r["setmaxnreg"] > 0, f"{what}: no register reallocation between the partitions"
        assert sass["UTMALDG"] > 0 and sass["SYNCS"] > 0, f"{what}: {sass}"
        assert spills_ok or (sass["STL"] == 0 and sass["LDL"] == 0), f"{what}: register spills {sass}"
        # ptxas serializes wgmma (a wait after every HGMMA) when it cannot prove an accumulator is left alone
        # while its MMA runs
        assert sass["wait0"] < sass["HGMMA"] // 4, f"{what}: wgmma serialized by ptxas: {sass}"
        # P_a V_a waited with P_b V_b still running (slot 0 released early)
        assert sass["ex2_between_waits"], f"{what}: {sass}"
    return res


def test_sm90_compile_triton36():
    """Compile for sm_90a with Triton 3.6 (the GPU image's) without a GPU, and check the machine code."""
    env, why = _triton36_env()
    if env is None:
        pytest.skip(why)
    res = _check_compile(env)
    assert res["triton"].startswith("3.6."), res["triton"]


@pytest.mark.slow  # the newest Triton: the slow run (3.6, the GPU image's, runs by default)
def test_sm90_compile_installed_triton():
    """The same source compiles with the installed Triton when it is not 3.6 (runs stay refused there). Spills are
    not checked there: Triton 3.9 spills a few registers (22 stores at 244 + spill), 3.6 none."""
    import triton

    if triton.__version__.startswith("3.6."):
        pytest.skip("the installed Triton is 3.6: test_sm90_compile_triton36 covers it")
    from triton_ops.attention.gluon_hopper import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
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
    """Static sizes only; one 217 KB CTA per SM: fill the SMs without a partial extra wave."""
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
@pytest.mark.parametrize("lens,sq,h,causal,splits", GPU_CASES)
def test_gpu_matches_reference(lens, sq, h, causal, splits):
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
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"sm90 gluon lens={lens} Sq={sq} H={h} causal={causal} "
                                                f"splits={s}")


@pytest.mark.gpu
def test_gpu_bad_page_ids_are_masked_keys():
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
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"bad page ids, splits={s}")


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
@pytest.mark.parametrize("splits", [0, 1])
def test_gpu_cuda_graph_new_lengths(splits):
    """Capture once, then change seqused_k in place between replays: the result follows."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    g = np.random.default_rng(34)
    c = make_case(g, layout="bf16", batch=3, lens=[4096] * 3, sq=2, h=128, bs=64, max_blocks=64, device="cuda")
    args = c.args(splits)
    M.mla_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = M.mla_decode(*args)
    for lens in ([3000, 4096, 5], [1, 0, 4095], [4096, 17, 2048]):
        c.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, *c.reference(), f"graph replay lens={lens} splits={splits}")
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
    M.mla_decode(*c.args(3))
    (grid, args, kw), red = seen
    assert grid == (2, 3, 3) and red == "reduce"  # ceil(2 x 48 / 64) row blocks, B, splits
    qd, qrd, knd, krd = args[:4]  # 256-column NoPE halves (one per compute warpgroup), the RoPE part
    nb = c.kv_cache.shape[0]
    assert qd.shape == [3 * 2 * 48, 576] and qd.strides == [576, 1] and qd.block_shape == [64, 256]
    assert qrd.block_shape == [64, 64] and qrd.base.data_ptr() == qd.base.data_ptr()
    assert knd.shape == [nb * 64, 576] and knd.strides == [576, 1] and knd.block_shape == [64, 256]
    assert krd.block_shape == [64, 64] and knd.base.data_ptr() == c.kv_cache.data_ptr()
    bt, seq, o_buf, l_buf = args[4:8]
    assert bt is c.block_table and seq is c.seqused_k
    assert o_buf.shape == (3, 2, 48, 3, 512) and o_buf.dtype == torch.float32 and l_buf.shape == (3, 2, 48, 3)
    assert args[9] == nb and args[10] == 2 and args[11] == 6  # num_blocks, pages per split, table capacity
    # num_warps: the TMA partition's (the compute warpgroups are worker partitions)
    assert kw == dict(SQ=2, H=48, CAUSAL=True, FINAL=False, num_warps=4)
    seen.clear()
    M.mla_decode(*c.args(1))
    (grid, args, kw), = seen  # one split: bf16 straight into out, no reduction
    assert grid == (2, 3, 1) and kw["FINAL"] is True and args[6].dtype == torch.bfloat16
