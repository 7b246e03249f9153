"""DeepSeek MLA decode (Triton) against dispatch/reference/attention.py:mla_decode: the three latent cache layouts
(bf16, V3.2 656 B FP8, V4 584 B FP8) written by the lowbit KV-cache write op, dense and sparse (top-k index lists),
Sq 1..3, v_dim inside and past the NoPE part, split counts, LSE; every cache slot no sequence reads is NaN; page ids
and index entries out of range; empty batches; argument errors; the launches' independence from lengths (CUDA-graph
safety); an sm_90 compile without register spills; on a GPU the real shapes (H = 128, 8k keys, top-2048) and a
CUDA graph replayed with new lengths."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference.attention import mla_decode as mla_reference
from tests.helpers import assert_attention_close, examples, random_block_table, run_compile_script
from triton_ops.attention.mla_decode import mla_config, mla_decode, supports_mla_decode
from triton_ops.contract.checks import LowbitInputError
from triton_ops.contract.kv_cache import DS_LAYOUTS

LAYOUTS = ("bf16", "v32", "v4")
WIDTH = {"bf16": 576, "v32": 576, "v4": 512}

# ----------------------------------------------------------------------------------------------- cases


@dataclasses.dataclass
class MlaCase:
    q: torch.Tensor  # (B, Sq, H, D) bf16
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seqused_k: torch.Tensor
    indices: torch.Tensor | None
    layout: str
    v_dim: int
    scale: float
    causal: bool
    window_left: int = -1

    def args(self, num_splits=0):
        return (self.q, self.kv_cache, self.block_table, self.seqused_k, self.indices, self.layout, self.v_dim,
                self.scale, self.causal, self.window_left, num_splits)

    def reference(self, lens=None):
        seq = self.seqused_k if lens is None else torch.tensor(lens, dtype=torch.int32, device=self.q.device)
        return mla_reference(self.q, self.kv_cache, self.block_table, seq, self.indices, self.layout, self.v_dim,
                             self.scale, self.causal, self.window_left, 0)


def empty_cache(layout, nb, bs, d, device):
    """A cache whose every byte is 0xFF: NaN E4M3 codes, NaN fp32 / E8M0 scales, NaN bf16 values."""
    if layout == "bf16":
        return torch.full((nb, bs, 1, d), math.nan, dtype=torch.bfloat16, device=device)
    cache = ops.ds_kv_cache_empty(nb, bs, layout, device)
    cache.view(torch.uint8).fill_(0xFF)
    return cache


def write_cache(cache, kv, slots, layout):
    """The lowbit write op (the Triton kernel on a GPU; its byte-equal torch reference on the CPU, where the
    interpreter would only be slower)."""
    if layout == "bf16":
        flat = cache.view(-1, cache.shape[-1]) if cache.is_contiguous() else None
        assert flat is not None
        flat[slots.long()] = kv.to(torch.bfloat16)
    else:
        ops.ds_kv_write(kv, slots, cache, layout=layout, backend="torch" if kv.device.type == "cpu" else "auto")


def used_slots(block_table, lens, bs, num_blocks):
    """Slots of positions 0..len-1 of every sequence whose page id is valid."""
    out = []
    for b, n in enumerate(lens):
        pos = torch.arange(min(n, block_table.shape[1] * bs))
        page = block_table[b, pos // bs].long().cpu()
        ok = (page >= 0) & (page < num_blocks)
        out.append(page[ok] * bs + pos[ok] % bs)
    return torch.unique(torch.cat(out)) if out else torch.zeros(0, dtype=torch.long)


def make_case(g, *, layout, batch, lens, sq, h, bs, max_blocks, topk=0, v_dim=None, causal=True, device="cpu",
              bad_entries=(), kv_scale=2.0, window_left=-1, d=None):
    """Random q and a paged latent cache holding values only at the slots the sequences use (NaN elsewhere);
    each sequence owns a random permutation of pages, the table's unused tail holds garbage ids. topk > 0: random
    index lists over [-1, max len + 3) (out-of-range and -1 entries included). d: the bf16 layout's width."""
    d = d or WIDTH[layout]
    nb = batch * max_blocks + 3
    bt = random_block_table(g, batch, max_blocks, nb, lens, bs, bad_entries)
    slots = used_slots(bt, lens, bs, nb)
    kv = torch.from_numpy(g.standard_normal((slots.shape[0], d)).astype(np.float32)) * kv_scale
    cache = empty_cache(layout, nb, bs, d, device)
    write_cache(cache, kv.to(device), slots.to(device), layout)
    q = torch.from_numpy(g.standard_normal((batch, sq, h, d)).astype(np.float32)).to(torch.bfloat16)
    idx = None
    if topk:
        idx = torch.from_numpy(g.integers(-1, max(lens) + 3, (batch, sq, topk)).astype(np.int32)).to(device)
    v_dim = d - 64 if v_dim is None else v_dim
    return MlaCase(q.to(device), cache, bt.to(device), torch.tensor(lens, dtype=torch.int32, device=device), idx,
                   layout, v_dim, 1.0 / math.sqrt(192), causal, window_left)


def small_tiles(c: MlaCase, splits: int, v_split: int = 1):
    """The GPU's tile shapes at a small size: 16 rows, 16-key tiles (several per split); v_split 2: the value
    columns split between two programs (the sm_90 wgmma tiles)."""
    bsz, sq, h, _ = c.q.shape
    keys = c.indices.shape[2] if c.indices is not None else c.block_table.shape[1] * c.kv_cache.shape[1]
    cfg = mla_config(bsz, sq, h, keys, c.indices is not None, c.q.device, splits)
    return dataclasses.replace(cfg, block_m=16, block_n=16, v_split=v_split)


# ---------------------------------------------------------------------------------------------- tests


@st.composite
def mla_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    layout = draw(st.sampled_from(LAYOUTS))
    batch = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([16, 32]))
    max_blocks = draw(st.integers(1, 3))
    cap = bs * max_blocks
    lens = [draw(st.sampled_from([0, 1, 2, cap - 1, cap, int(g.integers(0, cap + 1))])) for _ in range(batch)]
    sq = draw(st.integers(1, 3))
    h = draw(st.sampled_from([1, 4, 16, 20]))
    topk = draw(st.sampled_from([0, 0, 8, 37]))
    d = WIDTH[layout]
    v_dim = draw(st.sampled_from([d - 64, d - 64, d, 100, d - 30]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([-1, -1, 0, 5, 40]))
    splits = draw(st.sampled_from([1, 2, 3]))
    tiles = draw(st.sampled_from([0, 1, 2]))  # 0: the interpreter's config; 1, 2: small tiles, v_split 1 / 2
    c = make_case(g, layout=layout, batch=batch, lens=lens, sq=sq, h=h, bs=bs, max_blocks=max_blocks, topk=topk,
                  v_dim=v_dim, causal=causal, window_left=window)
    desc = (f"{layout} B={batch} lens={lens} Sq={sq} H={h} bs={bs} topk={topk} v_dim={v_dim} causal={causal} "
            f"window_left={window} splits={splits} small_tiles={tiles}")
    return c, splits, tiles, desc


@settings(max_examples=examples(30))
@given(case=mla_cases())
def test_mla_matches_reference(case):
    c, splits, tiles, desc = case
    out, lse = mla_decode(*c.args(splits), cfg=small_tiles(c, splits, tiles) if tiles else None)
    assert_attention_close(out, lse, *c.reference(), desc)


@pytest.mark.parametrize("layout", [pytest.param(x, marks=pytest.mark.slow) if x != "v32" else x for x in LAYOUTS])
@pytest.mark.parametrize("topk", [0, pytest.param(24, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sq", [1, pytest.param(3, marks=pytest.mark.slow)])  # Sq = 3: the interpreter's longest
def test_mla_layouts_poisoned(layout, topk, sq):
    """Every layout, dense and sparse, one and several queries: several sequences (empty, one key, lengths ending
    mid-page, the table's capacity), 1 and 3 splits at the GPU's tile shapes, the value as the NoPE part and
    as the whole row, causal and not (sparse: index entries past the length then reach poisoned slots unless
    masked); every slot no sequence reads is NaN."""
    g = np.random.default_rng(11)
    lens = [0, 1, 37, 70, 95, 16]
    for v_extra, causal in ((0, True), (64, False)):
        c = make_case(g, layout=layout, batch=len(lens), lens=lens, sq=sq, h=16, bs=16, max_blocks=6, topk=topk,
                      v_dim=WIDTH[layout] - 64 + v_extra, causal=causal)
        want = c.reference()
        for splits, v_split in ((1, 2), (3, 1), (3, 2)):
            out, lse = mla_decode(*c.args(splits), cfg=small_tiles(c, splits, v_split))
            assert_attention_close(out, lse, *want, f"{layout} topk={topk} Sq={sq} v_dim={c.v_dim} splits={splits} "
                                                    f"v_split={v_split}")
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()  # no key: out 0, lse -inf


@pytest.mark.parametrize("topk", [0, 40])
def test_bad_pages_are_masked_keys(topk):
    """Table entries outside [0, num_blocks) inside a sequence's used pages: those keys are masked, never read;
    a sequence whose pages are all bad has no key; lengths beyond the table's capacity see the capacity's keys."""
    g = np.random.default_rng(3)
    c = make_case(g, layout="v32", batch=3, lens=[64, 40, 20], sq=2, h=4, bs=16, max_blocks=4, topk=topk,
                  bad_entries=[(0, 1, -1), (0, 3, 1000), (1, 0, 2**31 - 1), (2, 0, -(2**31)), (2, 1, 77)])
    for splits in (1, 2):
        out, lse = mla_decode(*c.args(splits))
        assert_attention_close(out, lse, *c.reference(), f"bad pages topk={topk} splits={splits}")
        assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    c = make_case(g, layout="bf16", batch=1, lens=[64], sq=1, h=4, bs=16, max_blocks=4, topk=topk)
    want = c.reference()
    c.seqused_k[0] = 64 + 100
    assert_attention_close(*mla_decode(*c.args(2)), *want, "length beyond capacity")


@pytest.mark.parametrize("topk", [0, 40])
def test_length_past_capacity_keeps_query_positions(topk):
    """seqused_k past the table's capacity (64 keys) with a bad page inside it: query s sits at seqused_k - Sq + s
    (docs/attention.md), the keys past the capacity and behind the bad page are masked; causal with Sq = 3 and a
    window of 4 keys (and sparse index lists reaching past the capacity) make the positions matter. The kernel and
    the reference agree, and differ from the answer with the length clamped to the capacity."""
    g = np.random.default_rng(6)
    c = make_case(g, layout="bf16", batch=2, lens=[64, 20], sq=3, h=4, bs=16, max_blocks=4, topk=topk,
                  bad_entries=[(0, 1, -1)], window_left=4)
    if topk:
        c.indices[0] = torch.from_numpy(g.integers(-1, 68, (3, topk)).astype(np.int32))
    clamped = c.reference()
    c.seqused_k[0] = 66
    want = c.reference()
    assert_attention_close(*mla_decode(*c.args(2)), *want, f"length past capacity topk={topk}")
    assert not torch.allclose(want[0][0].float(), clamped[0][0].float(), atol=0.05)


@pytest.mark.parametrize("topk", [0, 30])
def test_sliding_window_bf16_512(topk):
    """V4's sliding-window branch: a bf16 cache of 512-wide rows (448 NoPE + 64 RoPE), the value the whole row,
    window_left 20 with two queries, at the GPU's tile shapes with 1 and 3 splits (the window starts inside a
    split and inside a key tile); H = 4 packs both queries in one row block (their windows differ by one key),
    H = 16 gives each its own; every slot no sequence reads is NaN."""
    g = np.random.default_rng(9)
    lens = [0, 1, 37, 70, 95]
    for h in (4, 16):
        c = make_case(g, layout="bf16", d=512, batch=len(lens), lens=lens, sq=2, h=h, bs=16, max_blocks=6,
                      topk=topk, v_dim=512, window_left=20)
        want = c.reference()
        for splits in (1, 3):
            out, lse = mla_decode(*c.args(splits), cfg=small_tiles(c, splits))
            assert_attention_close(out, lse, *want, f"window H={h} topk={topk} splits={splits}")


def test_sparse_index_semantics():
    """Sparse: only the listed positions count (a repeated index counts twice), -1 and positions >= seqused_k
    are unused, causal drops positions after the query's own; all unused gives out 0, lse -inf."""
    g = np.random.default_rng(4)
    c = make_case(g, layout="v4", batch=1, lens=[50], sq=2, h=4, bs=16, max_blocks=4, topk=6, v_dim=512)
    c.indices = torch.tensor([[[3, 3, -1, 49, 50, 7], [-1, -1, 60, 50, -5, 70]]], dtype=torch.int32)
    out, lse = mla_decode(*c.args(1))
    assert_attention_close(out, lse, *c.reference(), "index semantics")
    assert (out[0, 1] == 0).all() and torch.isneginf(lse[0, 1]).all()
    # causal: query 0 sits at position 48, so 49 drops out; non-causal keeps it
    c.indices = torch.tensor([[[49, -1, -1, -1, -1, -1], [49, -1, -1, -1, -1, -1]]], dtype=torch.int32)
    out, lse = mla_decode(*c.args(1))
    assert torch.isneginf(lse[0, 0]).all() and torch.isfinite(lse[0, 1]).all()
    c.causal = False
    out, lse = mla_decode(*c.args(1))
    assert torch.isfinite(lse).all()
    assert_attention_close(out, lse, *c.reference(), "non-causal")


@pytest.mark.parametrize("topk", [0, pytest.param(32, marks=pytest.mark.slow)])
def test_new_lengths_in_place(topk):
    """CPU form of the CUDA-graph test: one set of argument tensors, lengths (and index lists) rewritten in place
    between calls, the result follows them, and the launches (grids and every non-tensor argument) are the same
    for every length."""
    from triton_ops.contract.recording import recording_launches

    g = np.random.default_rng(12)
    c = make_case(g, layout="v32", batch=3, lens=[64] * 3, sq=2, h=16, bs=16, max_blocks=4, topk=topk)
    cfg = small_tiles(c, 3, 2)
    launches = []
    for lens in ([37, 64, 5], [1, 0, 63], [64, 17, 32]):
        c.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        if topk:
            c.indices.copy_(torch.from_numpy(g.integers(-1, 64, c.indices.shape).astype(np.int32)))
        with recording_launches() as rec:
            out, lse = mla_decode(*c.args(3), cfg=cfg)
        launches.append([(r.grid, [a for a in r.args if not isinstance(a, torch.Tensor)], r.kwargs) for r in rec])
        assert_attention_close(out, lse, *c.reference(), f"lens={lens}")
    assert len(launches[0]) == 2
    assert launches[0] == launches[1] == launches[2]


def test_empty_batch_and_zero_lengths():
    g = np.random.default_rng(5)
    for topk in (0, 8):
        c = make_case(g, layout="v4", batch=2, lens=[0, 0], sq=3, h=4, bs=16, max_blocks=2, topk=topk)
        for splits in (1, 2):
            out, lse = mla_decode(*c.args(splits))
            assert (out == 0).all() and torch.isneginf(lse).all()
        c.q, c.block_table, c.seqused_k = c.q[:0], c.block_table[:0], c.seqused_k[:0]
        c.indices = None if c.indices is None else c.indices[:0]
        out, lse = mla_decode(*c.args(2))
        assert out.shape == (0, 3, 4, 448) and lse.shape == (0, 3, 4)
    # an empty index list (topk 0) and a block table without columns: no key anywhere
    c = make_case(g, layout="v32", batch=2, lens=[5, 9], sq=1, h=4, bs=16, max_blocks=1, topk=4)
    for indices, table in ((c.indices[:, :, :0], c.block_table), (None, c.block_table[:, :0])):
        c2 = dataclasses.replace(c, indices=indices, block_table=table)
        out, lse = mla_decode(*c2.args(0))
        assert (out == 0).all() and torch.isneginf(lse).all()
        assert_attention_close(out, lse, *c2.reference(), "no keys")


def test_public_op_and_layout_inference():
    """ops.mla_decode: layout inferred from the cache, v_dim defaulting to the NoPE width, the interpreter's
    Triton backend against the torch backend, the fake implementation's shapes."""
    g = np.random.default_rng(6)
    for layout in LAYOUTS:
        c = make_case(g, layout=layout, batch=2, lens=[30, 9], sq=2, h=4, bs=16, max_blocks=2, topk=0)
        got = ops.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, softmax_scale=c.scale, return_lse=True,
                             backend="triton")
        want = ops.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, layout=layout, v_dim=c.v_dim,
                              softmax_scale=c.scale, return_lse=True, backend="torch")
        assert got[0].shape == (2, 2, 4, WIDTH[layout] - 64)
        assert_attention_close(*got, *want, f"op {layout}")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        out, lse = torch.ops.lowbit.mla_decode(c.q, c.kv_cache, c.block_table, c.seqused_k, None, "v4", 512, 0.1,
                                               True, -1, 0, "auto")
    assert out.shape == (2, 2, 4, 512) and lse.shape == (2, 2, 4) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_and_compile(backend):
    """The torch op's schema, fake and real implementations agree (opcheck), and a torch.compile'd step holding
    the op (dense and sparse) gives the eager result."""
    g = np.random.default_rng(8)
    c = make_case(g, layout="v4", batch=2, lens=[20, 33], sq=2, h=4, bs=16, max_blocks=3, topk=8, v_dim=512)
    op = torch.ops.lowbit.mla_decode.default
    torch.library.opcheck(op, (*c.args(), backend))
    torch.library.opcheck(op, (c.q, c.kv_cache, c.block_table, c.seqused_k, None, "v4", 448, 0.1, True, 7, 2,
                               backend))

    def step(q, cache, table, seq, idx):
        dense = ops.mla_decode(q, cache, table, seq, softmax_scale=0.1, backend=backend)
        sparse = ops.mla_decode(q, cache, table, seq, indices=idx, v_dim=448, softmax_scale=0.1, backend=backend)
        return dense + sparse

    args = (c.q, c.kv_cache, c.block_table, c.seqused_k, c.indices)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(got, step(*args))


def test_argument_errors():
    g = np.random.default_rng(1)
    c = make_case(g, layout="v32", batch=1, lens=[5], sq=1, h=2, bs=16, max_blocks=1, topk=4)
    assert supports_mla_decode(*c.args()[:7]) is None

    def bad(arg, **change):
        d = dict(zip(("q", "kv_cache", "block_table", "seqused_k", "indices", "layout", "v_dim", "scale", "causal",
                      "window_left", "num_splits"), c.args(), strict=True))
        d.update(change)
        with pytest.raises(LowbitInputError, match=rf"lowbit\.mla_decode: argument '{arg}'"):
            mla_decode(*d.values())

    bad("q", q=c.q[..., :512])  # V3.2 needs 576
    bad("q", q=c.q.float())
    bad("q", q=c.q.expand(1, 9, 2, 576))
    bad("kv_cache", kv_cache=c.kv_cache[..., :584])
    bad("kv_cache", kv_cache=c.kv_cache.view(torch.uint8)[..., :656].float())
    bad("layout", layout="fp8")
    bad("block_table", block_table=c.block_table.long())
    bad("seqused_k", seqused_k=c.seqused_k.repeat(2))
    bad("indices", indices=c.indices.long())
    bad("indices", indices=c.indices[:, :, None].expand(1, 1, 2, 4))
    bad("v_dim", v_dim=577)
    bad("v_dim", v_dim=0)
    bad("num_splits", num_splits=1.5)
    bad("window_left", window_left=-2)
    bad("kv_cache", layout="bf16")  # a byte cache named bf16
    with pytest.raises(LowbitInputError, match=r"lowbit\.mla_decode: argument 'layout'"):
        ops.mla_decode(c.q, c.kv_cache.view(torch.uint8)[..., :600], c.block_table, c.seqused_k)
    assert DS_LAYOUTS["v4"].token_bytes == 584 and DS_LAYOUTS["v32"].token_bytes == 656


# ------------------------------------------------------------------------------------------- compile-only

_COMPILE = textwrap.dedent("""
    import json, os, re, subprocess, tempfile
    os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions, not the interpreter's
    os.environ["LOWBIT_ARCH"] = "sm_90"
    import torch, triton
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    TARGET = GPUTarget("cuda", 90, 32)
    BACKEND = make_backend(TARGET)
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    LAUNCHES = []
    jit.JITFunction.run = lambda self, *args, grid, warmup, **kwargs: LAUNCHES.append((self, args, kwargs))
    FakeTensor.data_ptr = lambda self: (1 << 20) + self.storage_offset() * self.element_size()
    from triton_ops.attention import mla_decode as M
    M._sm_count = lambda index: 132  # H100
    bf, i32, u8 = torch.bfloat16, torch.int32, torch.uint8
    def E(*shape, dt=bf):
        return torch.empty(*shape, dtype=dt, device="cuda")
    CASES = {
        "bf16/dense": lambda: M.mla_decode(E(64, 1, 128, 576), E(8192, 64, 1, 576), E(64, 128, dt=i32),
                                           E(64, dt=i32), None, "bf16", 512, 0.1, True, -1, 0),
        "v32/dense": lambda: M.mla_decode(E(64, 1, 128, 576), E(8192, 64, 1, 656, dt=u8), E(64, 128, dt=i32),
                                          E(64, dt=i32), None, "v32", 512, 0.1, True, -1, 0),
        "v4/dense": lambda: M.mla_decode(E(64, 1, 128, 512), E(8192, 64, 1, 584, dt=u8), E(64, 128, dt=i32),
                                         E(64, dt=i32), None, "v4", 448, 0.1, True, -1, 0),
        "v32/sparse": lambda: M.mla_decode(E(64, 1, 128, 576), E(8192, 64, 1, 656, dt=u8), E(64, 128, dt=i32),
                                           E(64, dt=i32), E(64, 1, 2048, dt=i32), "v32", 512, 0.1, True, -1, 0),
        "v4/sparse/v512": lambda: M.mla_decode(E(4, 2, 128, 512), E(8192, 64, 1, 584, dt=u8), E(4, 128, dt=i32),
                                               E(4, dt=i32), E(4, 2, 1024, dt=i32), "v4", 512, 0.1, True, -1, 0),
        "v32/dense/mma": lambda: M.mla_decode(E(64, 1, 128, 576), E(8192, 64, 1, 656, dt=u8), E(64, 128, dt=i32),
                                              E(64, dt=i32), None, "v32", 512, 0.1, True, -1, 0,
                                              M.mla_config(64, 1, 128, 8192, False, E(1).device, 0, "mma")),
        "bf16/sparse/h64": lambda: M.mla_decode(E(64, 1, 64, 576), E(8192, 64, 1, 576), E(64, 128, dt=i32),
                                                E(64, dt=i32), E(64, 1, 2048, dt=i32), "bf16", 512, 0.1, True, -1,
                                                0),
    }
    class Ptr:
        def __init__(self, t):
            self.dtype, self.address = t.dtype, t.data_ptr()
        def data_ptr(self):
            return self.address
    for case, call in CASES.items():
        LAUNCHES.clear()
        with FakeTensorMode(allow_non_fake_inputs=True):
            call()
        kernel, args, kwargs = LAUNCHES[0]  # the attention kernel (a split reduction may follow)
        args = tuple(Ptr(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: Ptr(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        bound, spec, opts = jit.create_function_from_signature(kernel.signature, kernel.params, BACKEND)(
            *args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(BACKEND, kwargs, bound, spec, opts)
        c = triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                           options=options.__dict__)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(c.asm["cubin"])
            f.flush()
            usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                                   text=True, check=True).stdout
        regs, stack = (int(v) for v in re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups())
        print("LOWBIT", json.dumps(dict(case=case, regs=regs, stack=stack, shared=c.metadata.shared,
                                        mma=c.asm["ptx"].count("mma.sync"),
                                        wgmma=c.asm["ptx"].count("wgmma.mma_async"))), flush=True)
""")


@pytest.mark.slow  # sm_90 SASS properties of a kernel the GPU suite runs: the slow run
def test_sm90_compile_no_spills():
    """Compile the kernel for sm_90 without a GPU (a fresh process: the interpreter's kernels cannot be compiled),
    through the launcher's own configs at the real shapes (H = 128 and 64, top-2048) and the former mma.sync
    tiles: wgmma where the launcher picks the 64-128-row tiles (mma.sync in the V4 whole-row-value case and the
    mma tiles), no local-memory stack (register spills), shared memory within an H100's."""
    import triton

    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 6):
        pytest.skip(f"Triton {triton.__version__}")
    stdout = run_compile_script(_COMPILE, 400)
    recs = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("LOWBIT ")]
    assert len(recs) == 7, stdout
    for r in recs:
        wgmma = r["case"] not in ("v4/sparse/v512", "v32/dense/mma")
        assert (r["wgmma"] > 0 if wgmma else r["mma"] > 0 and r["wgmma"] == 0), r
        assert r["stack"] == 0 and r["shared"] <= 232448, r


# ------------------------------------------------------------------------------------------------- GPU


GPU_CASES = [pytest.param(layout, topk, sq, -1, id=f"{layout}-top{topk}-sq{sq}") for layout in LAYOUTS
             for topk in (0, 2048) for sq in (1, 2)]
# V4's sliding-window branch: bf16 512-wide cache, the value the whole row
GPU_CASES += [pytest.param("bf16-512", 0, 2, w, id=f"bf16-512-window{w}") for w in (128, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout,topk,sq,window", GPU_CASES)
def test_gpu_real_shapes(layout, topk, sq, window):
    """H = 128, 576 / 512-wide latents, lengths up to 8k (and an empty and a one-key sequence), page 64, the
    cache written by the Triton write kernel, auto splits and 1 split with the chip's tiles (sm_90: wgmma), auto
    splits with the mma tiles; V4 (and the 512-wide bf16 cache of the sliding-window layers) with the value as
    the whole row at Sq = 2."""
    g = np.random.default_rng(21)
    lens = [8192, 0, 1, 5000, 8191, 130]
    d = 512 if layout == "bf16-512" else None
    layout = layout.removesuffix("-512")
    c = make_case(g, layout=layout, d=d, batch=len(lens), lens=lens, sq=sq, h=128, bs=64, max_blocks=128, topk=topk,
                  v_dim=512 if (d or WIDTH[layout]) == 512 and sq == 2 else None, window_left=window, device="cuda")
    want = c.reference()
    keys = topk or c.block_table.shape[1] * 64
    mma = mla_config(len(lens), sq, 128, keys, topk > 0, c.q.device, 0, "mma")
    for splits, cfg in ((0, None), (1, None), (0, mma)):  # the chip's tiles (wgmma on sm_90), the mma tiles
        out, lse = mla_decode(*c.args(splits), cfg=cfg)
        assert_attention_close(out, lse, *want, f"gpu {layout} d={d} topk={topk} Sq={sq} window={window} "
                                                f"splits={splits} cfg={cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize("topk", [0, 2048])
@pytest.mark.parametrize("splits", [0, 1])
def test_gpu_cuda_graph_new_lengths(topk, splits):
    """Capture once, then change seqused_k (and the index lists) in place between replays: the result follows."""
    g = np.random.default_rng(22)
    c = make_case(g, layout="v32", batch=3, lens=[4096] * 3, sq=2, h=128, bs=64, max_blocks=64, topk=topk,
                  device="cuda")
    args = c.args(splits)
    mla_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_decode(*args)
    for lens in ([3000, 4096, 5], [1, 0, 4095], [4096, 17, 2048]):
        c.seqused_k.copy_(torch.tensor(lens, dtype=torch.int32))
        if topk:
            c.indices.copy_(torch.from_numpy(g.integers(-1, 4096, c.indices.shape).astype(np.int32)))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, *c.reference(), f"graph replay lens={lens} topk={topk}")
