"""Hopper (sm_90a) Gluon FP8 MLA decode (triton_ops/attention/mla_sm90_fp8.py), sparse and dense, against
dispatch/reference/attention.py, on both of its caches: DeepSeek-V3.2's "v32" and DeepSeek-V4's "v4".

* CPU: compile for sm_90a in a fresh process with Triton 3.6 (LOWBIT_TRITON36_PATH, or the installed Triton when it
  is 3.6.x) and check the machine code of each layout: HGMMA (64x64 S of a warpgroup's own tiles, 64x256 O, both
  from shared memory), setmaxnreg between the partitions, the gathers (16-byte code loads, 16-byte cp.async of the
  RoPE columns, E4M3 unpacking), TMA of Q, no local-memory spills, wgmma not serialized by ptxas, shared memory
  within an H100's; the dense configurations too.
* CPU: the refusals, the split rule, the launcher's host side up to the launch (both layouts, sparse and dense).
* GPU (-m gpu, an sm_90 device), each test on both layouts: DeepSeek shapes (H = 128 / 64, Sq 1 / 2, contexts
  2k-8k, top-2048 lists with -1 and out-of-range entries, NaN in every cache slot no sequence writes, bad page ids),
  several split counts and block sizes, a CUDA graph replayed with new lengths and index lists, the dispatch
  routing; the dense calls (no index list) on the same shapes, plus lengths far below and past the table's
  capacity and length 0.
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
from triton_ops.contract.kv_cache import DS_LAYOUTS

LAYOUTS = ("v32", "v4")
TMA_Q_BOXES = {"v32": 3, "v4": 2}  # Q by TMA: two 256-column halves (+ v32's 64-column RoPE part)
V_DIM = 512  # both layouts' value: v32's NoPE part, v4's whole row (RoPE columns included)
# every (layout, value width) the kernel takes: v4 also with its 448-column NoPE part as the value (the op's default)
LAYOUT_VDIMS = [pytest.param(layout, v_dim, id=f"{layout}-v{v_dim}") for layout in LAYOUTS
                for v_dim in M.V_DIMS[layout]]

# ------------------------------------------------------------------------------------------- compile-only (CPU)

_COMPILE = textwrap.dedent("""
    import itertools, json, os
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from tests.helpers import sass_stats
    from cute_ops._sass import disassemble
    from triton_ops.attention import mla_sm90_fp8 as M
    res = {"triton": triton.__version__, "configs": []}
    shapes = ((1, 128, True, False, 512, False), (2, 128, True, True, 512, False), (1, 64, False, False, 512, False),
              (1, 128, True, False, 512, True), (2, 128, True, True, 512, True))
    configs = [*itertools.product(M.LAYOUTS, shapes), ("v4", (1, 128, True, True, 448, False)),
               ("v4", (1, 128, True, False, 448, True))]
    for layout, (sq, h, causal, final, v_dim, dense) in configs:
        c = M.compile_sm90(sq, h, causal, final, any_version=True, layout=layout, v_dim=v_dim, dense=dense)
        ptx = c.asm["ptx"]
        res["configs"].append({"layout": layout, "cfg": [sq, h, causal, final, v_dim, dense],
                               "wgmma": ptx.count("wgmma.mma_async"),
                               "tma": ptx.count("cp.async.bulk.tensor"), "setmaxnreg": ptx.count("setmaxnreg"),
                               "cp_async16": ptx.count("cp.async.cg.shared.global"),
                               "e4m3": ptx.count("cvt.rn.f16x2.e4m3x2"), "smem": c.metadata.shared,
                               "sass": sass_stats(c.asm["cubin"])})
    print(json.dumps(res))
""")


def test_sm90_compile_triton36():
    """Compile for sm_90a with Triton 3.6 (the GPU image's) without a GPU, and check the machine code of each
    layout's kernel."""
    env, why = _triton36_env()
    if env is None:
        pytest.skip(why)
    res = run_compile_json(_COMPILE, env)
    assert res["triton"].startswith("3.6."), res["triton"]
    assert sorted({r["layout"] for r in res["configs"]}) == sorted(LAYOUTS), res["configs"]
    assert {(r["layout"], r["cfg"][-1]) for r in res["configs"]} == {(x, d) for x in LAYOUTS for d in (False, True)}
    for r in res["configs"]:
        what = f"triton {res['triton']} {r['layout']} (Sq, H, causal, final, v_dim, dense) = {r['cfg']}"
        assert r["wgmma"] > 0 and r["tma"] == TMA_Q_BOXES[r["layout"]], f"{what}: {r}"  # Q by TMA, keys gathered
        assert r["cp_async16"] > 0 and r["e4m3"] > 0, f"{what}: no cp.async gather / E4M3 unpacking: {r}"
        assert r["setmaxnreg"] > 0, f"{what}: no register reallocation between the partitions"
        assert r["smem"] <= 232448, f"{what}: {r['smem']} bytes of shared memory"
        sass = r["sass"]
        if sass is None:
            continue  # no cuobjdump / nvdisasm with this Triton: PTX checks only
        assert set(sass["HGMMA_shapes"]) == {"64x64x16", "64x256x16"}, f"{what}: {sass}"
        assert sass["HGMMA_regA"] == 0, f"{what}: {sass}"
        # dense v32: its per-thread tile count costs each compute warpgroup 2-3 spilled values, stored before the
        # pair loop and reloaded for the lone last tile (once per CTA); everything else: no spills
        spills = 8 if r["layout"] == "v32" and r["cfg"][-1] else 0
        assert sass["STL"] <= spills and sass["LDL"] <= spills, f"{what}: register spills {sass}"
        # ptxas serializes wgmma (a wait after every HGMMA) when it cannot prove an accumulator is left alone
        # while its MMA runs
        assert sass["wait0"] < sass["HGMMA"] // 4, f"{what}: wgmma serialized by ptxas: {sass}"
        assert sass["ex2_between_waits"], f"{what}: P_a V_a not waited with P_b V_b running: {sass}"


# ------------------------------------------------------------------------------------------------ CPU


def _case(g, device="cpu", **kw):
    a = dict(layout="v32", batch=2, lens=[300, 70], sq=1, h=128, bs=64, max_blocks=6, topk=256, v_dim=V_DIM)
    a.update(kw)
    return make_case(g, device=device, **a)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_refusals_name_the_reason(monkeypatch, layout, dense):
    topk = 0 if dense else 256
    c = _case(np.random.default_rng(0), layout=layout, topk=topk)
    assert (c.indices is None) == dense
    why = M.supports_mla_decode_fp8_sm90(*c.args())
    assert why and ("triton" in why or "CUDA" in why), why  # a CPU host: the version gate or the device
    with pytest.raises(ValueError, match="FP8 sm_90 Gluon"):
        M.mla_decode(*c.args())
    monkeypatch.setattr(M, "sm90_gluon_reason", lambda q: None)  # past the gate: the call's own refusals
    assert M.supports_mla_decode_fp8_sm90(*c.args()) is None
    other = "v4" if layout == "v32" else "v32"  # the other FP8 layout: q's width is not its D
    a = list(c.args())
    for i, value, expect in ((5, "bf16", "layout 'bf16'"), (5, other, f"layout {other!r}"),
                             (6, 300, "v_dim 300"), (9, 128, "window_left 128"), (7, float("inf"), "softmax_scale")):
        b = list(a)
        b[i] = value
        why = M.supports_mla_decode_fp8_sm90(*b)
        assert why and expect in why, (i, why)
    b = list(a)
    b[6] = 448  # the NoPE part as the value: v4's (O's RoPE columns not stored), not v32's (448 of its 512)
    why = M.supports_mla_decode_fp8_sm90(*b)
    assert (why is None) if layout == "v4" else (why and "v_dim 448" in why), why
    for kw, expect in ((dict(h=32), "32 query heads"), (dict(sq=3), "3 queries"),
                       (dict(layout="bf16", v_dim=None), "layout")):
        ci = _case(np.random.default_rng(1), **{"layout": layout, "topk": topk, **kw})
        why = M.supports_mla_decode_fp8_sm90(*ci.args())
        assert why and expect in why, (kw, why)
    # a block stride that is not a multiple of 16 bytes (the 16-byte gathers of the codes and the RoPE part)
    token = DS_LAYOUTS[layout].token_bytes
    nb, bs = c.kv_cache.shape[:2]
    odd = torch.zeros(nb, bs * token + 4, dtype=torch.uint8)[:, : bs * token].view(nb, bs, 1, token)
    a[1] = odd
    why = M.supports_mla_decode_fp8_sm90(*a)
    assert why and "16-byte aligned" in why, why


def test_split_rule():
    """Static sizes only: (B x Sq x H / 64) CTAs, topk / 64 tiles; no split is empty; a forced count is clamped;
    the compute warpgroups' registers are the layout's."""
    for layout in LAYOUTS:
        regs = M.COMPUTE_REGS[layout]
        assert M.fp8_sm90_config(2, 1, 128, 2048, None, layout=layout) == M.Fp8Sm90Config(1, 32, regs)
        assert M.fp8_sm90_config(2, 2, 64, 100, 132, num_splits=9, layout=layout) == \
            M.Fp8Sm90Config(2, 1, regs)
    assert M.COMPUTE_REGS["v32"] != M.COMPUTE_REGS["v4"]
    cfg = M.fp8_sm90_config(2, 1, 128, 2048, 132, layout="v32")  # 4 CTAs on 132 SMs: split the 32 tiles
    assert cfg.num_splits > 1 and cfg.num_splits * cfg.tiles_per_split >= 32
    assert (cfg.num_splits - 1) * cfg.tiles_per_split < 32
    assert M.fp8_sm90_config(64, 1, 128, 2048, 132, layout="v4").num_splits == 1  # 128 CTAs: one wave
    for b, sq, h, topk in ((1, 1, 64, 2048), (3, 2, 128, 2048), (4, 2, 128, 640), (2, 1, 64, 1)):
        cfg = M.fp8_sm90_config(b, sq, h, topk, 132, layout="v4")
        tiles = -(-topk // 64)
        assert cfg.num_splits * cfg.tiles_per_split >= tiles > (cfg.num_splits - 1) * cfg.tiles_per_split, cfg


def _stub_launch(monkeypatch, seen):
    monkeypatch.setattr(M, "supports_mla_decode_fp8_sm90", lambda *a: None)
    monkeypatch.setattr(M, "sm_count", lambda dev: 132)
    monkeypatch.setattr(M, "device_index", lambda dev: 0)
    monkeypatch.setattr(M, "launch", lambda kernel, grid, *args, **kw: seen.append((grid, args, kw)))
    monkeypatch.setattr(M, "reduce_splits", lambda o_buf, l_buf, out, lse, n: o_buf is out or seen.append("reduce"))


@pytest.mark.parametrize("layout,v_dim", LAYOUT_VDIMS)
def test_launcher_dry_run(monkeypatch, layout, v_dim):
    """The host side on CPU tensors up to the launch (the kernel itself is stubbed): grid, the Q descriptors, the
    cache's byte views and block stride (v4: blocks padded to a multiple of 576 bytes), the split buffers (the
    value's width), the constexprs."""
    seen = []
    _stub_launch(monkeypatch, seen)
    c = _case(np.random.default_rng(2), layout=layout, batch=3, lens=[300, 5, 64], sq=2, topk=200, v_dim=v_dim)
    M.mla_decode(*c.args(2))
    (grid, args, kw), red = seen
    assert grid == (2, 3 * 2, 2) and red == "reduce"  # H / 64 head blocks, B x Sq, splits
    qd, qrd, kv8, kvb, kv32 = args[:5]
    d = DS_LAYOUTS[layout].d
    assert qd.shape == [3 * 2 * 128, d] and qd.block_shape == [64, 256]
    if layout == "v32":
        assert qrd.block_shape == [64, 64] and kv32.dtype == torch.float32  # the RoPE part; fp32 scales
    else:
        assert qrd is qd and kv32.dtype == torch.int32  # no RoPE part; E8M0 scale words
    assert kv8.dtype == torch.uint8 and kvb.dtype == torch.bfloat16
    assert kv8.data_ptr() == kvb.data_ptr() == kv32.data_ptr() == c.kv_cache.data_ptr()
    bt, seq, idx, o_buf, l_buf = args[5:10]
    assert bt is c.block_table and seq is c.seqused_k and idx is c.indices
    assert o_buf.shape == (3, 2, 128, 2, v_dim) and o_buf.dtype == torch.float32 and l_buf.shape == (3, 2, 128, 2)
    nb = c.kv_cache.shape[0]
    block_bytes = DS_LAYOUTS[layout].padded_block_bytes(64)
    assert c.kv_cache.stride(0) == block_bytes and (layout == "v32") == (block_bytes == 64 * 656)
    # num_blocks, capacity, tiles per split, topk, its tiles, block stride / 16
    assert args[11:17] == (nb, 6 * 64, 2, 200, 4, block_bytes // 16)
    assert kw == dict(SQ=2, H=128, BS=64, CAUSAL=True, FINAL=False, WS_REGS=M.COMPUTE_REGS[layout],
                      V4=layout == "v4", DV=v_dim, DENSE=False, num_warps=4)
    seen.clear()
    M.mla_decode(*c.args(1))
    (grid, args, kw), = seen  # one split: bf16 straight into out, no reduction
    assert grid == (2, 6, 1) and kw["FINAL"] is True and args[8].dtype == torch.bfloat16
    assert args[8].shape == (3, 2, 128, v_dim)


@pytest.mark.parametrize("layout,v_dim", LAYOUT_VDIMS)
def test_launcher_dry_run_dense(monkeypatch, layout, v_dim):
    """A dense call (no index list): the list is the table's capacity (6 pages x 64 = 384 positions, 6 tiles), the
    split rule takes it in place of topk, the index pointer is a placeholder with zero strides (never read),
    DENSE is set."""
    seen = []
    _stub_launch(monkeypatch, seen)
    c = _case(np.random.default_rng(3), layout=layout, batch=3, lens=[300, 0, 384], sq=2, topk=0, v_dim=v_dim)
    assert c.indices is None and c.block_table.shape[1] == 6
    M.mla_decode(*c.args(2))
    (grid, args, kw), red = seen
    assert grid == (2, 3 * 2, 2) and red == "reduce"
    block_bytes = DS_LAYOUTS[layout].padded_block_bytes(64)
    # num_blocks, capacity, tiles per split, the list's length (the capacity), its tiles, block stride / 16
    assert args[11:17] == (c.kv_cache.shape[0], 384, 3, 384, 6, block_bytes // 16)
    assert args[5] is c.block_table and args[6] is c.seqused_k and args[18:20] == (0, 0)  # index strides
    assert kw["DENSE"] is True and kw["DV"] == v_dim and kw["V4"] == (layout == "v4")
    assert M.fp8_sm90_config(3, 2, 128, 384, 132, 2, layout=layout) == M.Fp8Sm90Config(2, 3, M.COMPUTE_REGS[layout])
    seen.clear()
    M.mla_decode(*c.args())  # 12 CTAs, 6 tiles: choose_splits keeps one split (below its minimum split size)
    (grid, args, kw), = seen
    assert grid == (2, 6, 1) and kw["FINAL"] is True and args[13] == 6


# ------------------------------------------------------------------------------------------------- GPU


def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


MODES = ("sparse", "dense")


def _gpu_case(seed, layout, lens, sq, h, topk, causal=True, bad_entries=(), bs=64, v_dim=V_DIM, max_blocks=None):
    """A DeepSeek decode batch on the layout's cache (value: v_dim columns), NaN in every slot no sequence writes.
    topk > 0: random top-k lists over [-1, max len + 3) (so -1 and out-of-range entries), a quarter of each list
    pointing at the last 64 keys (the recent window an indexer keeps); topk 0: the dense call. max_blocks: the
    table's pages per sequence (default: one more than the longest sequence needs)."""
    g = np.random.default_rng(seed)
    max_blocks = max_blocks or -(-max(lens) // bs) + 1
    c = make_case(g, layout=layout, batch=len(lens), lens=lens, sq=sq, h=h, bs=bs, max_blocks=max_blocks, topk=topk,
                  v_dim=v_dim, causal=causal, device="cuda", bad_entries=bad_entries)
    if topk:
        recent = torch.tensor([max(n - 64, 0) for n in lens], dtype=torch.int32, device="cuda").view(-1, 1, 1)
        c.indices[:, :, : topk // 4] = recent + torch.randint(0, 64, (len(lens), sq, topk // 4), device="cuda",
                                                              dtype=torch.int32)
    return c


GPU_CASES = [  # (lens, sq, h, causal, splits, block size)
    pytest.param([8192, 2048, 5000, 4097], 1, 128, True, (0, 1, 3), 64, id="h128-sq1"),
    pytest.param([8192, 3000, 2049], 2, 128, True, (0, 1, 4), 64, id="h128-sq2"),
    pytest.param([4096, 2048], 2, 64, True, (0, 2), 64, id="h64-sq2"),
    pytest.param([6000, 2500], 1, 128, False, (0, 5), 64, id="h128-sq1-noncausal"),
    pytest.param([3000, 1025], 1, 128, True, (0, 2), 32, id="h128-sq1-bs32"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,v_dim", LAYOUT_VDIMS)
@pytest.mark.parametrize("lens,sq,h,causal,splits,bs", GPU_CASES)
def test_gpu_matches_reference(lens, sq, h, causal, splits, bs, layout, v_dim, mode):
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    c = _gpu_case(41, layout, lens, sq, h, 2048 if mode == "sparse" else 0, causal, bs=bs, v_dim=v_dim)
    assert M.supports_mla_decode_fp8_sm90(*c.args()) is None, M.supports_mla_decode_fp8_sm90(*c.args())
    want = c.reference()
    for s in splits:
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"{mode} fp8 sm90 {layout} v_dim={v_dim} lens={lens} Sq={sq} "
                                                f"H={h} causal={causal} splits={s} bs={bs}")


@pytest.mark.gpu
@pytest.mark.parametrize("layout,v_dim", LAYOUT_VDIMS)
def test_gpu_empty_lists_bad_pages_and_short_topk(layout, v_dim):
    """A sequence of length 0 (every entry unused: out 0, lse -inf), one whose list is all -1, bad page ids inside
    the used range (masked keys, never read), a top-k that is not a multiple of 64."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    lens = [2048, 0, 3000]
    c = _gpu_case(42, layout, lens, 2, 128, 1000, bad_entries=[(0, 3, -1), (2, 7, 2**30)], v_dim=v_dim)
    c.indices[2, 1].fill_(-1)
    want = c.reference()
    for s in (0, 1, 3):
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"{layout} v_dim={v_dim} empty lists / bad pages, splits={s}")
        assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
        assert bool(torch.isneginf(lse[2, 1]).all())  # the all -1 list


@pytest.mark.gpu
@pytest.mark.parametrize("layout,v_dim", LAYOUT_VDIMS)
def test_gpu_dense_short_empty_and_past_capacity(layout, v_dim):
    """Dense calls: sequences far shorter than a 64k-position table (their splits past the end take no tile and
    write out 0, lse -inf partials), length 0 (out 0, lse -inf), length 1 with Sq 2 (query 0 at position -1 sees
    no key), bad page ids inside the used range; then a table filled to its capacity with seqused_k past it (the
    keys past the capacity masked, the queries still at seqused_k - Sq + s)."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    lens = [1000, 0, 3000, 1]
    c = _gpu_case(45, layout, lens, 2, 128, 0, bad_entries=[(0, 3, -1), (2, 7, 2**30)], v_dim=v_dim,
                  max_blocks=1024)
    want = c.reference()
    for s in (0, 1, 3, 16):
        out, lse = M.mla_decode(*c.args(s))
        assert_attention_close(out, lse, *want, f"dense {layout} v_dim={v_dim} short / empty / bad pages, splits={s}")
        assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
        assert bool(torch.isneginf(lse[3, 0]).all()) and bool(torch.isfinite(lse[3, 1]).all())
    full = _gpu_case(46, layout, [4096, 1500], 2, 128, 0, v_dim=v_dim, max_blocks=64)  # capacity 4096
    full.seqused_k.copy_(torch.tensor([4096 + 100, 1500], dtype=torch.int32))
    want = full.reference()
    for s in (0, 1, 3):
        out, lse = M.mla_decode(*full.args(s))
        assert_attention_close(out, lse, *want, f"dense {layout} v_dim={v_dim} past capacity, splits={s}")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [0, 1])
def test_gpu_cuda_graph_new_lengths_and_indices(splits, layout, mode):
    """Capture once, then change seqused_k (and the index lists) in place between replays: the result follows
    (dense: the tile counts follow the new lengths)."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    c = _gpu_case(43, layout, [8192, 8192, 8192], 2, 128, 2048 if mode == "sparse" else 0)
    args = c.args(splits)
    M.mla_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = M.mla_decode(*args)
    g = torch.Generator(device="cuda").manual_seed(7)
    for lens in ([3000, 8192, 5], [1, 0, 8191], [8192, 17, 2048]):
        c.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        if c.indices is not None:
            c.indices.copy_(torch.randint(-1, 8195, c.indices.shape, generator=g, device="cuda", dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, *c.reference(), f"{mode} {layout} graph replay lens={lens} splits={splits}")
    assert math.isfinite(float(out.float().abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,v_dim", LAYOUT_VDIMS)
def test_gpu_dispatch_routes_fp8_here(layout, v_dim, mode):
    """auto takes this kernel's row for a sparse or dense call on the layout's cache on sm_90; the public op's
    answer matches the reference (v4's 448-column value: the op's default v_dim)."""
    if not _sm90():
        pytest.skip("needs an sm_90 GPU")
    from dispatch import ops
    from dispatch.registry import select
    from dispatch.table import TABLE

    c = _gpu_case(44, layout, [4096, 2500], 1, 128, 2048 if mode == "sparse" else 0, v_dim=v_dim)
    entry = select(TABLE["mla_decode"], "mla_decode", "auto", c.args(), {})
    assert entry.impl.endswith("mla_sm90_fp8:mla_decode"), entry
    out, lse = ops.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, indices=c.indices, layout=layout,
                              v_dim=None if v_dim == c.q.shape[-1] - 64 else v_dim, softmax_scale=c.scale,
                              return_lse=True)
    assert out.shape[-1] == v_dim, out.shape
    assert_attention_close(out, lse, *c.reference(), f"ops.mla_decode auto, {mode} {layout} v_dim={v_dim} on sm_90")
    windowed = dataclasses.replace(c, window_left=128)  # refused here (no window): the portable kernel
    entry = select(TABLE["mla_decode"], "mla_decode", "auto", windowed.args(), {})
    assert entry.impl.endswith("mla_decode:mla_decode") and "sm90" not in entry.impl, entry
