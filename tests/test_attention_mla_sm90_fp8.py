"""Hopper (sm_90a) Gluon sparse FP8 MLA decode (triton_ops/attention/mla_sm90_fp8.py) against
dispatch/reference/attention.py.

* CPU: compile for sm_90a in a fresh process with Triton 3.6 (LOWBIT_TRITON36_PATH, or the installed Triton when it
  is 3.6.x) and check the machine code: HGMMA (64x64 S of a warpgroup's own tiles, 64x256 O, both from shared
  memory), setmaxnreg between the partitions, the gathers (16-byte code loads, 16-byte cp.async of the RoPE part,
  E4M3 unpacking), TMA of Q, no local-memory spills, wgmma not serialized by ptxas, shared memory within an H100's.
* CPU: the refusals, the split rule, the launcher's host side up to the launch.
* GPU (-m gpu, an sm_90 device): DeepSeek-V3.2 shapes (H = 128 / 64, Sq 1 / 2, contexts 2k-8k, top-2048 lists with
  -1 and out-of-range entries, NaN in every cache slot no sequence writes, bad page ids), several split counts, a
  CUDA graph replayed with new lengths and index lists.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

import numpy as np
import pytest
import torch

from tests.helpers import assert_attention_close
from tests.test_attention_mla import make_case
from tests.test_attention_sm90 import _triton36_env, run_compile_json
from triton_ops.attention import mla_sm90_fp8 as M

# ------------------------------------------------------------------------------------------- compile-only (CPU)

_COMPILE = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from tests.helpers import sass_stats
    from cute_ops._sass import disassemble
    from triton_ops.attention import mla_sm90_fp8 as M
    res = {"triton": triton.__version__, "configs": []}
    for sq, h, causal, final in ((1, 128, True, False), (2, 128, True, True), (1, 64, False, False)):
        c = M.compile_sm90(sq, h, causal, final, any_version=True)
        ptx = c.asm["ptx"]
        res["configs"].append({"cfg": [sq, h, causal, final], "wgmma": ptx.count("wgmma.mma_async"),
                               "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                               "cp_async16": ptx.count("cp.async.cg.shared.global"),
                               "e4m3": ptx.count("cvt.rn.f16x2.e4m3x2"), "smem": c.metadata.shared,
                               "sass": sass_stats(c.asm["cubin"])})
    print(json.dumps(res))
""")


def test_sm90_compile_triton36():
    """Compile for sm_90a with Triton 3.6 (the GPU image's) without a GPU, and check the machine code."""
    env, why = _triton36_env()
    if env is None:
        pytest.skip(why)
    res = run_compile_json(_COMPILE, env)
    assert res["triton"].startswith("3.6."), res["triton"]
    for r in res["configs"]:
        what = f"triton {res['triton']} (Sq, H, causal, final) = {r['cfg']}"
        assert r["wgmma"] > 0 and r["tma"] == 3, f"{what}: {r}"  # Q by TMA (two NoPE halves, RoPE), keys gathered
        assert r["cp_async16"] > 0 and r["e4m3"] > 0, f"{what}: no cp.async gather / E4M3 unpacking: {r}"
        assert r["setmaxnreg"] > 0, f"{what}: no register reallocation between the partitions"
        assert r["smem"] <= 232448, f"{what}: {r['smem']} bytes of shared memory"
        sass = r["sass"]
        if sass is None:
            continue  # no cuobjdump / nvdisasm with this Triton: PTX checks only
        assert set(sass["HGMMA_shapes"]) == {"64x64x16", "64x256x16"}, f"{what}: {sass}"
        assert sass["HGMMA_regA"] == 0, f"{what}: {sass}"
        assert sass["STL"] == 0 and sass["LDL"] == 0, f"{what}: register spills {sass}"
        # ptxas serializes wgmma (a wait after every HGMMA) when it cannot prove an accumulator is left alone
        # while its MMA runs
        assert sass["wait0"] < sass["HGMMA"] // 4, f"{what}: wgmma serialized by ptxas: {sass}"
        assert sass["ex2_between_waits"], f"{what}: P_a V_a not waited with P_b V_b running: {sass}"


# ------------------------------------------------------------------------------------------------ CPU


def _case(g, device="cpu", **kw):
    a = dict(layout="v32", batch=2, lens=[300, 70], sq=1, h=128, bs=64, max_blocks=6, topk=256)
    a.update(kw)
    return make_case(g, device=device, **a)


def test_refusals_name_the_reason(monkeypatch):
    c = _case(np.random.default_rng(0))
    why = M.supports_mla_decode_sparse_fp8_sm90(*c.args())
    assert why and ("triton" in why or "CUDA" in why), why  # a CPU host: the version gate or the device
    with pytest.raises(ValueError, match="sparse FP8 sm_90 Gluon"):
        M.mla_decode(*c.args())
    monkeypatch.setattr(M, "sm90_gluon_reason", lambda q: None)  # past the gate: the call's own refusals
    assert M.supports_mla_decode_sparse_fp8_sm90(*c.args()) is None
    a = list(c.args())
    for i, value, expect in ((4, None, "sparse"), (5, "v4", "layout 'v4'"), (6, 448, "v_dim 448"),
                             (9, 128, "window_left 128"), (7, float("inf"), "softmax_scale")):
        b = list(a)
        b[i] = value
        why = M.supports_mla_decode_sparse_fp8_sm90(*b)
        assert why and expect in why, (i, why)
    for kw, expect in ((dict(h=32), "32 query heads"), (dict(sq=3), "3 queries"), (dict(layout="bf16"), "layout")):
        ci = _case(np.random.default_rng(1), **kw)
        why = M.supports_mla_decode_sparse_fp8_sm90(*ci.args())
        assert why and expect in why, (kw, why)


def test_split_rule():
    """Static sizes only: (B x Sq x H / 64) CTAs, topk / 64 tiles; no split is empty; a forced count is clamped."""
    assert M.sparse_fp8_sm90_config(2, 1, 128, 2048, None) == M.SparseFp8Sm90Config(1, 32, M.COMPUTE_REGS)
    cfg = M.sparse_fp8_sm90_config(2, 1, 128, 2048, 132)  # 4 CTAs on 132 SMs: split the 32 tiles
    assert cfg.num_splits > 1 and cfg.num_splits * cfg.tiles_per_split >= 32
    assert (cfg.num_splits - 1) * cfg.tiles_per_split < 32
    assert M.sparse_fp8_sm90_config(64, 1, 128, 2048, 132).num_splits == 1  # 128 CTAs: one wave already
    assert M.sparse_fp8_sm90_config(2, 2, 64, 100, 132, num_splits=9) == M.SparseFp8Sm90Config(2, 1, M.COMPUTE_REGS)
    for b, sq, h, topk in ((1, 1, 64, 2048), (3, 2, 128, 2048), (4, 2, 128, 640), (2, 1, 64, 1)):
        cfg = M.sparse_fp8_sm90_config(b, sq, h, topk, 132)
        tiles = -(-topk // 64)
        assert cfg.num_splits * cfg.tiles_per_split >= tiles > (cfg.num_splits - 1) * cfg.tiles_per_split, cfg


def test_launcher_dry_run(monkeypatch):
    """The host side on CPU tensors up to the launch (the kernel itself is stubbed): grid, the Q descriptors, the
    cache's byte views, the split buffers, the constexprs."""
    seen = []
    monkeypatch.setattr(M, "supports_mla_decode_sparse_fp8_sm90", lambda *a: None)
    monkeypatch.setattr(M, "sm_count", lambda dev: 132)
    monkeypatch.setattr(M, "device_index", lambda dev: 0)
    monkeypatch.setattr(M, "launch", lambda kernel, grid, *args, **kw: seen.append((grid, args, kw)))
    monkeypatch.setattr(M, "reduce_splits", lambda o_buf, l_buf, out, lse, n: o_buf is out or seen.append("reduce"))
    c = _case(np.random.default_rng(2), batch=3, lens=[300, 5, 64], sq=2, topk=200)
    M.mla_decode(*c.args(2))
    (grid, args, kw), red = seen
    assert grid == (2, 3 * 2, 2) and red == "reduce"  # H / 64 head blocks, B x Sq, splits
    qd, qrd, kv8, kvb, kv32 = args[:5]
    assert qd.shape == [3 * 2 * 128, 576] and qd.block_shape == [64, 256] and qrd.block_shape == [64, 64]
    assert kv8.dtype == torch.uint8 and kvb.dtype == torch.bfloat16 and kv32.dtype == torch.float32
    assert kv8.data_ptr() == kvb.data_ptr() == kv32.data_ptr() == c.kv_cache.data_ptr()
    bt, seq, idx, o_buf, l_buf = args[5:10]
    assert bt is c.block_table and seq is c.seqused_k and idx is c.indices
    assert o_buf.shape == (3, 2, 128, 2, 512) and o_buf.dtype == torch.float32 and l_buf.shape == (3, 2, 128, 2)
    nb = c.kv_cache.shape[0]
    # num_blocks, capacity, tiles per split, topk, its tiles, block stride / 16
    assert args[11:17] == (nb, 6 * 64, 2, 200, 4, 64 * 656 // 16)
    assert kw == dict(SQ=2, H=128, BS=64, CAUSAL=True, FINAL=False, WS_REGS=M.COMPUTE_REGS, num_warps=4)
    seen.clear()
    M.mla_decode(*c.args(1))
    (grid, args, kw), = seen  # one split: bf16 straight into out, no reduction
    assert grid == (2, 6, 1) and kw["FINAL"] is True and args[8].dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------- GPU


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _v32_case(seed, lens, sq, h, topk, causal=True, bad_entries=()):
    """A V3.2 decode batch: random top-k lists over [-1, max len + 3) (so -1 and out-of-range entries), a
    quarter of each list pointing at the last 64 keys (the recent window an indexer keeps), NaN in every slot no
    sequence writes."""
    g = np.random.default_rng(seed)
    c = make_case(g, layout="v32", batch=len(lens), lens=lens, sq=sq, h=h, bs=64, max_blocks=-(-max(lens) // 64) + 1,
                  topk=topk, causal=causal, device="cuda", bad_entries=bad_entries)
    recent = torch.tensor([max(n - 64, 0) for n in lens], dtype=torch.int32, device="cuda").view(-1, 1, 1)
    c.indices[:, :, : topk // 4] = recent + torch.randint(0, 64, (len(lens), sq, topk // 4), device="cuda",
                                                          dtype=torch.int32)
    return c


GPU_CASES = [  # (lens, sq, h, causal, splits)
    pytest.param([8192, 2048, 5000, 4097], 1, 128, True, (0, 1, 3), id="h128-sq1"),
    pytest.param([8192, 3000, 2049], 2, 128, True, (0, 1, 4), id="h128-sq2"),
    pytest.param([4096, 2048], 2, 64, True, (0, 2), id="h64-sq2"),
    pytest.param([6000, 2500], 1, 128, False, (0, 5), id="h128-sq1-noncausal"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("lens,sq,h,causal,splits", GPU_CASES)
def test_gpu_matches_reference(lens, sq, h, causal, splits):
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    c = _v32_case(41, lens, sq, h, 2048, causal)
    assert M.supports_mla_decode_sparse_fp8_sm90(*c.args()) is None, M.supports_mla_decode_sparse_fp8_sm90(*c.args())
    want = c.reference()
    for s in splits:
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"sparse fp8 sm90 lens={lens} Sq={sq} H={h} causal={causal} "
                                                f"splits={s}")


@pytest.mark.gpu
def test_gpu_empty_lists_bad_pages_and_short_topk():
    """A sequence of length 0 (every entry unused: out 0, lse -inf), one whose list is all -1, bad page ids inside
    the used range (masked keys, never read), a top-k that is not a multiple of 64."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    lens = [2048, 0, 3000]
    c = _v32_case(42, lens, 2, 128, 1000, bad_entries=[(0, 3, -1), (2, 7, 2**30)])
    c.indices[2, 1].fill_(-1)
    want = c.reference()
    for s in (0, 1, 3):
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"empty lists / bad pages, splits={s}")
        assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1])
def test_gpu_cuda_graph_new_lengths_and_indices(splits):
    """Capture once, then change seqused_k and the index lists in place between replays: the result follows."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    c = _v32_case(43, [8192, 8192, 8192], 2, 128, 2048)
    args = c.args(splits)
    M.mla_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = M.mla_decode(*args)
    g = torch.Generator(device="cuda").manual_seed(7)
    for lens in ([3000, 8192, 5], [1, 0, 8191], [8192, 17, 2048]):
        c.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        c.indices.copy_(torch.randint(-1, 8195, c.indices.shape, generator=g, device="cuda", dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, *c.reference(), f"graph replay lens={lens} splits={splits}")
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
def test_gpu_dispatch_routes_sparse_v32_here():
    """auto takes this kernel's row for a sparse v32 call on sm_90 and the portable kernel for the dense v32 call it
    refuses; the public op's answer matches the reference."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    from dispatch import ops
    from dispatch.registry import select
    from dispatch.table import TABLE

    c = _v32_case(44, [4096, 2500], 1, 128, 2048)
    entry = select(TABLE["mla_decode"], "mla_decode", "auto", c.args(), {})
    assert entry.impl.endswith("mla_sm90_fp8:mla_decode"), entry
    out, lse = ops.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, indices=c.indices, layout="v32",
                              softmax_scale=c.scale, return_lse=True)
    assert_attention_close(out, lse, *c.reference(), "ops.mla_decode auto, sparse v32 on sm_90")
    dense = dataclasses.replace(c, indices=None)
    entry = select(TABLE["mla_decode"], "mla_decode", "auto", dense.args(), {})
    assert entry.impl.endswith("mla_decode:mla_decode") and "sm90" not in entry.impl, entry
