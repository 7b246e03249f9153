"""Paged GQA decode attention (split-KV) and the LSE merge (Triton) against dispatch/reference/attention.py:
random paged caches (bf16/fp16, FP8 E4M3 with per-tensor or per-head scales) through permuted block tables,
lengths 0 and 1, speculative queries, sinks, windows, GQA ratios, split counts; out-of-range page ids; the
split rule; the merge over -inf parts; on a GPU a larger case and a CUDA graph replayed with new lengths."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.reference.attention import attention_varlen, gather_paged
from dispatch.reference.attention import merge_attn_states as merge_ref
from tests.helpers import assert_attention_close, examples, random_block_table
from triton_ops.attention.decode import (
    MAX_SPLITS,
    attention_decode,
    choose_num_splits,
    decode_config,
    supports_attention_decode,
)
from triton_ops.attention.merge import merge_attn_states
from triton_ops.contract.checks import LowbitInputError

# ----------------------------------------------------------------------------------------------- cases

KV_KINDS = ("bf16", "fp16", "fp8_tensor", "fp8_head", "u8_head")


@dataclasses.dataclass
class DecodeCase:
    q: torch.Tensor  # (B, Sq, Hq, D)
    k_cache: torch.Tensor  # as the kernel reads it (16-bit, float8_e4m3fn or uint8 codes)
    v_cache: torch.Tensor
    k_deq: torch.Tensor  # fp32 (or 16-bit) values: code * scale
    v_deq: torch.Tensor
    block_table: torch.Tensor
    seqused_k: torch.Tensor
    scale: float
    causal: bool
    window: tuple[int, int]
    sinks: torch.Tensor | None
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def args(self, device="cpu"):
        mv = lambda t: None if t is None else t.to(device)
        return (self.q.to(device), self.k_cache.to(device), self.v_cache.to(device), self.block_table.to(device),
                self.seqused_k.to(device), self.scale, self.causal, self.window[0], self.window[1],
                mv(self.sinks), mv(self.k_scale), mv(self.v_scale))


def _quantize(x, kind, g):
    """(cache, dequantized values, scale) for a kv kind."""
    if kind in ("bf16", "fp16"):
        c = x.to(torch.bfloat16 if kind == "bf16" else torch.float16)
        return c, c, None
    hkv = x.shape[2]
    per_head = kind != "fp8_tensor"
    scale = torch.from_numpy(g.uniform(0.002, 0.02, hkv if per_head else ()).astype(np.float32))
    view = scale.view(1, 1, hkv, 1) if per_head else scale
    # Clamp first: torch's float -> float8_e4m3fn cast saturates only since pytorch#178817 (2026-04); older
    # versions (the GPU image's torch 2.11) turn |v| > 464 into the NaN code 0x7F / 0xFF, and scales this small
    # overflow many values. NaN codes in valid keys made the kernel and the reference both garbage on the GPU.
    codes = (x / view).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)  # RNE below 448 in every version
    deq = codes.float() * view
    assert torch.isfinite(deq).all(), "an FP8 test cache holds NaN codes"
    return (codes.view(torch.uint8) if kind.startswith("u8") else codes), deq, scale


def make_case(g, *, batch, lens, sq, hq, hkv, d, bs, max_blocks, kind, q_dtype, causal, window, sinks,
              bad_entries=()):
    """Random q and paged caches; sequence b owns a random permutation of pages, the table's unused tail
    holds garbage ids (never to be read). bad_entries: (b, block index, id) written into the table."""
    nb = batch * max_blocks + 3
    x = torch.from_numpy(g.standard_normal((2, nb, bs, hkv, d)).astype(np.float32))
    k_cache, k_deq, k_scale = _quantize(x[0], kind, g)
    v_cache, v_deq, v_scale = _quantize(x[1], kind, g)
    if kind in ("bf16", "fp16"):
        q_dtype = k_cache.dtype
    q = torch.from_numpy(g.standard_normal((batch, sq, hq, d)).astype(np.float32)).to(q_dtype)
    bt = random_block_table(g, batch, max_blocks, nb, lens, bs, bad_entries)
    sk = torch.tensor(lens, dtype=torch.int32)
    sink = torch.from_numpy(g.normal(0.0, 2.0, hq).astype(np.float32)) if sinks else None
    return DecodeCase(q, k_cache, v_cache, k_deq, v_deq, bt, sk, 1.0 / math.sqrt(d), causal, window, sink,
                      k_scale, v_scale)


def reference_decode(c: DecodeCase, lens=None, keep=None):
    """The reference per sequence on the keys gathered through the table (code * scale values). keep: optional
    per-sequence bool mask of the gathered keys to retain (to model masked pages). A sequence with no key and
    no sink is out 0, lse -inf (the reference's documented answer; its max over zero keys would raise)."""
    bsz, sq, hq, _ = c.q.shape
    lens = c.seqused_k.tolist() if lens is None else lens
    dv = c.v_deq.shape[-1]
    out = torch.zeros(bsz, sq, hq, dv, dtype=c.q.dtype)
    lse = torch.full((bsz, sq, hq), -math.inf)
    for b, n in enumerate(lens):
        one = torch.tensor([n], dtype=torch.int32)
        k, _ = gather_paged(c.k_deq, c.block_table[b:b + 1], one)
        v, _ = gather_paged(c.v_deq, c.block_table[b:b + 1], one)
        if keep is not None:
            k, v = k[keep[b]], v[keep[b]]
        if k.shape[0] == 0 and c.sinks is None:
            continue
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32)
        o, l = attention_varlen(c.q[b], k, v, torch.tensor([0, sq], dtype=torch.int32), cu_k, c.scale, c.causal,
                                c.window, c.sinks)
        out[b], lse[b] = o, l
    return out, lse


@st.composite
def decode_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    batch = draw(st.integers(1, 3))
    bs = draw(st.sampled_from([16, 32]))
    max_blocks = draw(st.integers(1, 4))
    cap = bs * max_blocks
    lens = [draw(st.sampled_from([0, 1, 2, cap - 1, cap, int(g.integers(0, cap + 1))])) for _ in range(batch)]
    ratio = draw(st.sampled_from([1, 4, 8]))
    hkv = draw(st.sampled_from([1, 2]))
    sq = draw(st.integers(1, 3))
    d = draw(st.sampled_from([64, 64, 128]))
    kind = draw(st.sampled_from(KV_KINDS))
    q_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (-1, -1), (7, -1), (20, 0), (3, 2), (40, 5)]))
    sinks = draw(st.booleans())
    splits = draw(st.sampled_from([1, 2, 3]))
    small_tiles = draw(st.booleans())
    c = make_case(g, batch=batch, lens=lens, sq=sq, hq=hkv * ratio, hkv=hkv, d=d, bs=bs, max_blocks=max_blocks,
                  kind=kind, q_dtype=q_dtype, causal=causal, window=window, sinks=sinks)
    desc = (f"B={batch} lens={lens} Sq={sq} Hq={hkv * ratio} Hkv={hkv} D={d} bs={bs} {kind} q={q_dtype} "
            f"causal={causal} window={window} sinks={sinks} splits={splits} small_tiles={small_tiles}")
    return c, splits, small_tiles, desc


# ---------------------------------------------------------------------------------------------- decode


@settings(max_examples=examples(120))
@given(case=decode_cases())
def test_decode_matches_reference(case):
    c, splits, small_tiles, desc = case
    cfg = None
    if small_tiles:  # several key tiles per split (16-key steps)
        bsz, sq, hq, d = c.q.shape
        cfg = decode_config(bsz, sq, hq, c.k_cache.shape[2], c.block_table.shape[1] * c.k_cache.shape[1], d,
                            c.q.device, splits)
        cfg = dataclasses.replace(cfg, block_n=16)
    out, lse = attention_decode(*c.args(), splits, cfg=cfg)
    assert_attention_close(out, lse, *reference_decode(c), desc)


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_head_dim_256_and_mqa(splits):
    g = np.random.default_rng(7)
    c = make_case(g, batch=2, lens=[70, 33], sq=2, hq=8, hkv=1, d=256, bs=16, max_blocks=5, kind="fp8_head",
                  q_dtype=torch.bfloat16, causal=True, window=(-1, -1), sinks=True)
    assert_attention_close(*attention_decode(*c.args(), splits), *reference_decode(c), f"D=256 splits={splits}")


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_out_of_range_pages_are_masked_keys(splits):
    """Table entries outside [0, num_blocks) inside a sequence's used pages: those pages' keys are masked (they
    join neither the softmax nor the output), never read. Non-causal without a window, where dropping keys is
    the same as attending over the remaining ones. A sequence whose pages are all bad has no key: out 0, lse
    -inf (sink's logit with a sink). Lengths beyond the table's capacity see only the capacity's keys."""
    g = np.random.default_rng(3)
    bs, mb = 16, 4
    for sinks in (False, True):
        c = make_case(g, batch=3, lens=[64, 40, 20], sq=2, hq=4, hkv=1, d=64, bs=bs, max_blocks=mb, kind="fp8_head",
                      q_dtype=torch.bfloat16, causal=False, window=(-1, -1), sinks=sinks)
        nb = c.k_cache.shape[0]
        bt_ok = c.block_table.clone()
        c.block_table[0, 1] = -1
        c.block_table[0, 3] = nb
        c.block_table[1, 0] = 2**31 - 1
        c.block_table[2, :2] = torch.tensor([-(2**31), nb + 7])  # both pages of its 20 keys
        out, lse = attention_decode(*c.args(), splits)
        keep = [torch.tensor([i // bs not in (1, 3) for i in range(64)]),
                torch.tensor([i // bs != 0 for i in range(40)]), torch.zeros(20, dtype=torch.bool)]
        c.block_table = bt_ok
        want_out, want_lse = reference_decode(c, keep=keep)
        assert_attention_close(out, lse, want_out, want_lse, f"bad pages sinks={sinks}")
        assert (out[2] == 0).all()
        if sinks:
            assert torch.allclose(lse[2], c.sinks.expand(2, 4))
    # seqused_k past the table's capacity (mb * bs keys)
    c = make_case(g, batch=1, lens=[mb * bs], sq=1, hq=4, hkv=2, d=64, bs=bs, max_blocks=mb, kind="bf16",
                  q_dtype=torch.bfloat16, causal=False, window=(-1, -1), sinks=False)
    want = reference_decode(c)
    c.seqused_k[0] = mb * bs + 100
    assert_attention_close(*attention_decode(*c.args(), splits), *want, "length beyond capacity")


@pytest.mark.parametrize("splits", [1, 3])
def test_length_past_capacity_keeps_query_positions(splits):
    """seqused_k past the table's capacity (64 keys): query s sits at seqused_k - Sq + s (docs/attention.md) and
    the keys past the capacity are masked; causal + window (5, 0) makes the positions matter. The kernel and the
    reference agree, and differ from the answer with the length clamped to the capacity."""
    from dispatch.reference.attention import attention_decode as reference_op

    g = np.random.default_rng(5)
    c = make_case(g, batch=2, lens=[64, 30], sq=3, hq=4, hkv=2, d=64, bs=16, max_blocks=4, kind="bf16",
                  q_dtype=torch.bfloat16, causal=True, window=(5, 0), sinks=False)
    clamped = reference_op(*c.args(), splits)
    c.seqused_k[0] = 66
    want = reference_op(*c.args(), splits)
    assert_attention_close(*attention_decode(*c.args(), splits), *want, f"length past capacity splits={splits}")
    assert not torch.allclose(want[0][0].float(), clamped[0][0].float(), atol=0.05)


def poison_unread(c: DecodeCase, lens) -> DecodeCase:
    """A copy of the case whose caches (and dequantized values) hold NaN at every (page, slot) that no sequence
    reads for `lens` (E4M3 byte 0xFF, a NaN, in FP8 caches): unused pages, slots past a length that ends
    mid-page, pages behind garbage table ids. A kernel that lets any of them into a softmax or a P @ V product
    (0 * NaN) returns NaN; so does the reference if it reads anything but the valid keys."""
    nb, bs = c.k_cache.shape[:2]
    keep = torch.zeros(nb, bs, dtype=torch.bool)
    for b, n in enumerate(lens):
        pos = torch.arange(min(n, c.block_table.shape[1] * bs))
        pages = c.block_table[b, pos // bs].long()
        ok = (pages >= 0) & (pages < nb)
        keep[pages[ok], (pos % bs)[ok]] = True
    keep = keep[:, :, None, None]

    def nan_outside(t):
        raw = t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.uint8) else t
        return torch.where(keep, raw, torch.full_like(raw, 0xFF if raw.dtype == torch.uint8 else math.nan)
                           ).view(t.dtype)

    return dataclasses.replace(c, k_cache=nan_outside(c.k_cache), v_cache=nan_outside(c.v_cache),
                               k_deq=nan_outside(c.k_deq), v_deq=nan_outside(c.v_deq))


def gpu_like_config(c: DecodeCase, splits: int):
    """The GPU's tile shapes at a small size: 16-key tiles (several per split), 16 packed rows per program."""
    bsz, sq, hq, d = c.q.shape
    cfg = decode_config(bsz, sq, hq, c.k_cache.shape[2], c.block_table.shape[1] * c.k_cache.shape[1], d,
                        c.q.device, splits)
    return dataclasses.replace(cfg, block_n=16, block_m=16)


@pytest.mark.parametrize("kind", ["fp8_head", "fp8_tensor", "u8_head", "bf16"])
@pytest.mark.parametrize("sq,d", [(1, 64), pytest.param(4, 64, marks=pytest.mark.slow),
                                  pytest.param(2, 96, marks=pytest.mark.slow)])  # the interpreter: slow run
def test_large_decode_structure_poisoned(kind, sq, d):
    """CPU form of test_gpu_large_decode, small: several sequences (empty, one key, lengths ending mid-page, the
    table's capacity minus one, one whole page), GQA, sinks, causal (a window with Sq = 4), 1 and 3 splits, and
    every cache slot no sequence reads is NaN. Head dim 96 pads the tiles' columns to 128."""
    g = np.random.default_rng(11)
    lens = [0, 1, 37, 70, 95, 16]
    c = make_case(g, batch=len(lens), lens=lens, sq=sq, hq=8, hkv=2, d=d, bs=16, max_blocks=6, kind=kind,
                  q_dtype=torch.bfloat16, causal=True, window=(-1, -1) if sq != 4 else (25, 0), sinks=True)
    c = poison_unread(c, lens)
    want = reference_decode(c)
    for splits in (1, 3):
        out, lse = attention_decode(*c.args(), splits, cfg=gpu_like_config(c, splits))
        assert_attention_close(out, lse, *want, f"{kind} splits={splits} Sq={sq} D={d}")


@pytest.mark.parametrize("splits", [1, 4])
def test_new_lengths_in_place_poisoned(splits):
    """CPU form of test_gpu_cuda_graph_new_lengths (no graph): one set of argument tensors, seqused_k and the
    caches rewritten in place between calls (every slot past the new lengths NaN), the result follows the new
    lengths, and the launches (grids and every non-tensor argument) are the same for every length, as a captured
    graph needs."""
    from triton_ops.contract.recording import recording_launches

    g = np.random.default_rng(12)
    c = make_case(g, batch=3, lens=[64] * 3, sq=2, hq=8, hkv=2, d=64, bs=16, max_blocks=4,  # all pages valid
                  kind="fp8_head", q_dtype=torch.bfloat16, causal=True, window=(-1, -1), sinks=True)
    args = list(c.args())
    args[1], args[2] = args[1].clone(), args[2].clone()  # the kernel's buffers; c keeps the clean caches
    cfg = gpu_like_config(c, splits)
    launches = []
    for lens in ([37, 64, 5], [1, 0, 63], [64, 17, 32]):
        p = poison_unread(c, lens)
        args[1].copy_(p.k_cache)
        args[2].copy_(p.v_cache)
        args[4].copy_(torch.tensor(lens, dtype=torch.int32))
        with recording_launches() as rec:
            out, lse = attention_decode(*args, splits, cfg=cfg)
        launches.append([(r.grid, [a for a in r.args if not isinstance(a, torch.Tensor)], r.kwargs) for r in rec])
        assert_attention_close(out, lse, *reference_decode(p, lens=lens), f"lens={lens}")
    assert len(launches[0]) == (1 if splits == 1 else 2)
    assert launches[0] == launches[1] == launches[2]


def test_empty_batch_and_zero_lengths():
    g = np.random.default_rng(5)
    c = make_case(g, batch=2, lens=[0, 0], sq=3, hq=8, hkv=2, d=64, bs=16, max_blocks=2, kind="fp8_tensor",
                  q_dtype=torch.float16, causal=True, window=(-1, -1), sinks=False)
    for splits in (1, 2):
        out, lse = attention_decode(*c.args(), splits)
        assert (out == 0).all() and torch.isneginf(lse).all()
    c.q, c.block_table, c.seqused_k = c.q[:0], c.block_table[:0], c.seqused_k[:0]
    out, lse = attention_decode(*c.args(), 2)
    assert out.shape == (0, 3, 8, 64) and lse.shape == (0, 3, 8)


def test_split_rule():
    """Static sizes only: no splits on the interpreter; on a GPU enough programs to fill the SMs twice, at least
    MIN_SPLIT_KEYS keys of capacity per split, at most MAX_SPLITS."""
    assert choose_num_splits(4, 1 << 20, None) == 1
    assert choose_num_splits(8, 32768, 132) == 33  # B=1, Hkv=8: 264 programs
    assert choose_num_splits(8, 2048, 132) == 8  # capped by 256 keys per split
    assert choose_num_splits(2, 1 << 20, 132) == MAX_SPLITS
    assert choose_num_splits(512, 32768, 132) == 1  # a full batch fills the GPU on its own
    assert choose_num_splits(8, 100, 132) == 1
    cfg = decode_config(1, 1, 64, 8, 4096, 64, torch.device("cpu"))
    assert cfg.num_splits == 1 and cfg.block_m == 16


def test_config_rule_by_cache_dtype(monkeypatch):
    """The GPU's choices from static shapes (an H100 described, nothing launched): FP8 caches get V converted
    before its operand layout, 3 stages, ~4 programs per SM and 2 warps for a 16-row tile; 16-bit caches ~2
    programs per SM, 4 warps and, on sm_90 at head dim <= 128, 4 stages with one split and 3 with splits (2
    elsewhere); both 64-key tiles (page tiles at page 64); before sm_89 (no e4m3x2 -> f16x2 convert) FP8 keeps the
    16-bit choices.
    Llama 16 x 8k, page 64."""
    from triton_ops.attention import decode

    monkeypatch.setattr(decode, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    monkeypatch.setenv("LOWBIT_ARCH", "sm_90")
    f8 = decode_config(16, 1, 32, 8, 8192, 128, gpu, 0, True)
    bf = decode_config(16, 1, 32, 8, 8192, 128, gpu, 0, False)
    assert (f8.num_splits, f8.block_n, f8.num_stages, f8.v_f16_smem, f8.num_warps) == (4, 64, 3, True, 2)
    assert (bf.num_splits, bf.block_n, bf.num_stages, bf.v_f16_smem, bf.num_warps) == (2, 64, 3, False, 4)
    spec = decode_config(16, 8, 32, 8, 8192, 128, gpu, 0, True)  # 32 packed rows: the 4-warp tile
    assert (spec.block_m, spec.num_warps) == (32, 4)
    one_split = decode_config(64, 1, 32, 8, 8192, 128, gpu, 0, False)
    assert (one_split.num_splits, one_split.num_stages) == (1, 4)
    assert decode_config(16, 1, 32, 8, 8192, 256, gpu, 0, False).num_stages == 2  # hd 256: not measured deeper
    monkeypatch.setenv("LOWBIT_ARCH", "sm_80")
    old = decode_config(16, 1, 32, 8, 8192, 128, gpu, 0, True)
    assert (old.num_splits, old.num_stages, old.v_f16_smem) == (2, 2, False)
    assert decode_config(64, 1, 32, 8, 8192, 128, gpu, 0, False).num_stages == 2
    assert choose_num_splits(128, 8192, 132, per_sm=4) == 4


def test_supports_and_argument_errors():
    g = np.random.default_rng(1)
    c = make_case(g, batch=1, lens=[5], sq=1, hq=2, hkv=1, d=64, bs=16, max_blocks=1, kind="fp8_head",
                  q_dtype=torch.bfloat16, causal=True, window=(-1, -1), sinks=False)
    q, kc, vc, bt, sk = c.args()[:5]
    assert supports_attention_decode(q, kc, vc, bt, sk) is None
    assert "fp16" in supports_attention_decode(q.float(), kc, vc, bt, sk)
    assert "prefill" in supports_attention_decode(q.expand(1, 9, 2, 64), kc, vc, bt, sk)
    assert "expected" in supports_attention_decode(q, kc.float(), vc.float(), bt, sk)
    args = list(c.args())
    args[10] = None
    with pytest.raises(LowbitInputError, match=r"lowbit\.attention_decode: argument 'k_scale'"):
        attention_decode(*args, 1)
    args = list(c.args())
    args[3] = bt.long()
    with pytest.raises(LowbitInputError, match=r"argument 'block_table'"):
        attention_decode(*args, 1)


# ----------------------------------------------------------------------------------------------- merge


@st.composite
def merge_cases(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    t = draw(st.sampled_from([0, 1, 3, 9]))
    h = draw(st.sampled_from([1, 2, 5]))
    d = draw(st.sampled_from([1, 8, 40, 64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    out_a = torch.from_numpy(g.standard_normal((t, h, d)).astype(np.float32)).to(dtype)
    out_b = torch.from_numpy(g.standard_normal((t, h, d)).astype(np.float32)).to(dtype)
    lse_a = torch.from_numpy(g.normal(0, 4, (t, h)).astype(np.float32))
    lse_b = torch.from_numpy(g.normal(0, 4, (t, h)).astype(np.float32))
    pick = torch.from_numpy(g.integers(0, 4, (t, h)))  # 0: both finite, 1: a -inf, 2: b -inf, 3: both -inf
    lse_a[(pick == 1) | (pick == 3)] = -math.inf
    lse_b[(pick == 2) | (pick == 3)] = -math.inf
    if draw(st.booleans()):  # lse stored (H, T) and passed transposed (vLLM's layout), out strided over heads
        lse_a, lse_b = lse_a.t().contiguous().t(), lse_b.t().contiguous().t()
        out_a = torch.cat([out_a, out_a], 1)[:, :h]
    return out_a, lse_a, out_b, lse_b, f"T={t} H={h} D={d} {dtype}"


@given(case=merge_cases())
def test_merge_matches_reference(case):
    out_a, lse_a, out_b, lse_b, desc = case
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = merge_ref(out_a, lse_a, out_b, lse_b)
    assert_attention_close(out, lse, want_out, want_lse, desc)
    both = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    assert (out[both] == 0).all()
    only_a = torch.isneginf(lse_b) & ~torch.isneginf(lse_a)  # b contributes nothing: a passes through
    assert torch.equal(out[only_a], out_a[only_a]) and torch.equal(lse[only_a], lse_a[only_a])


def test_merge_ignores_values_of_empty_parts():
    """A part at -inf contributes nothing, even if its out holds NaN / Inf (e.g. never written)."""
    out_a = torch.randn(2, 3, 16)
    out_b = torch.full((2, 3, 16), math.nan)
    out_b[1] = math.inf
    lse_a = torch.randn(2, 3)
    lse_b = torch.full((2, 3), -math.inf)
    out, lse = merge_attn_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8_head", "fp8_tensor"])
@pytest.mark.parametrize("splits", [0, 1, 8])
@pytest.mark.parametrize("sq,d", [(1, 128), (4, 128), (2, 256)])
@pytest.mark.parametrize("bs", [16, 64])
def test_gpu_large_decode(kind, splits, sq, d, bs):
    """Page 16: a table entry per key; page 64: page tiles (one entry per key tile)."""
    g = np.random.default_rng(11)
    lens = [0, 1, 517, 1000, 1023, 64]
    c = make_case(g, batch=len(lens), lens=lens, sq=sq, hq=32, hkv=4, d=d, bs=bs, max_blocks=1024 // bs, kind=kind,
                  q_dtype=torch.bfloat16, causal=True, window=(-1, -1) if sq != 4 else (255, 0), sinks=True)
    out, lse = attention_decode(*c.args("cuda"), splits)
    assert_attention_close(out, lse, *reference_decode(c), f"{kind} splits={splits} Sq={sq} D={d} page={bs}")


@pytest.mark.gpu
@pytest.mark.parametrize("q_mag", [1e-6, 3e4, 1e6])
def test_gpu_fp8_cache_extreme_q(q_mag):
    """FP8 caches run fp16 dots: a bf16 q beyond fp16's range (or deep in its subnormals) must still match."""
    g = np.random.default_rng(13)
    c = make_case(g, batch=2, lens=[300, 77], sq=2, hq=16, hkv=2, d=128, bs=16, max_blocks=32, kind="fp8_head",
                  q_dtype=torch.bfloat16, causal=True, window=(-1, -1), sinks=False)
    c = dataclasses.replace(c, q=(c.q.float() * q_mag).bfloat16(), scale=c.scale / q_mag)  # logits stay O(1)
    out, lse = attention_decode(*c.args("cuda"), 1)
    assert_attention_close(out, lse, *reference_decode(c), f"fp8 cache, |q| ~ {q_mag}")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_cuda_graph_new_lengths(splits):
    """Capture once, then change seqused_k in place between replays: the result follows the new lengths."""
    g = np.random.default_rng(12)
    c = make_case(g, batch=3, lens=[512] * 3, sq=2, hq=16, hkv=2, d=128, bs=16, max_blocks=32,  # all pages valid
                  kind="fp8_head", q_dtype=torch.bfloat16, causal=True, window=(-1, -1), sinks=True)
    c.seqused_k = torch.tensor([300, 512, 5], dtype=torch.int32)
    args = c.args("cuda")
    seq = args[4]
    attention_decode(*args, splits)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = attention_decode(*args, splits)
    for lens in ([300, 512, 5], [1, 0, 511], [512, 17, 256]):
        seq.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert_attention_close(out, lse, *reference_decode(c, lens=lens), f"graph replay lens={lens}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8_head", "fp8_tensor"])
def test_gpu_page_tiles_bad_pages_poisoned(kind):
    """Page 64 on the GPU (FP8: page tiles): table entries outside [0, num_blocks) mask their pages' keys, and
    every slot no sequence reads (pages behind bad entries included) is NaN; 0 / 1 / 3 splits."""
    g = np.random.default_rng(14)
    bs, mb, lens = 64, 8, [512, 300, 77, 0]
    c = make_case(g, batch=4, lens=lens, sq=1, hq=32, hkv=8, d=128, bs=bs, max_blocks=mb, kind=kind,
                  q_dtype=torch.bfloat16, causal=False, window=(-1, -1), sinks=True)
    bt_ok = c.block_table.clone()
    c.block_table[0, 2] = -1
    c.block_table[1, 0] = c.k_cache.shape[0] + 5
    c = poison_unread(c, lens)
    keep = [torch.tensor([i // bs != 2 for i in range(512)]), torch.tensor([i // bs != 0 for i in range(300)]),
            torch.ones(77, dtype=torch.bool), torch.ones(0, dtype=torch.bool)]
    args = c.args("cuda")
    want = reference_decode(dataclasses.replace(c, block_table=bt_ok), keep=keep)
    for splits in (0, 1, 3):
        assert_attention_close(*attention_decode(*args, splits), *want, f"{kind} page tiles splits={splits}")
