"""CuTeDSL Hopper attention (cute_ops/attention/fmha_sm90.py): CPU checks, and GPU tests for an sm_90 device.

The sibling of the sm100 kernel (tests/test_cute_attention.py covers the shared mask, softmax and scheduler modules
and the tile-by-tile twin of the algorithm both kernels run). CPU: config and entry rules, the dispatch row, the
WGMMA fragment facts the kernel's per-thread code relies on (run on the host), the compile and its SASS. GPU (marked
gpu, sm_90 only): the kernel through dispatch (backend="cute") and with the ping-pong schedule against the fp64
reference, and a timing report beside the backend auto picks.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_ops import unavailable_reason
from cute_ops.attention import mask as M
from dispatch.reference.attention import attention_varlen
from tests.helpers import assert_attention_close, needs_host_bf16

# range_constexpr over a row's columns is deliberate (see mask.apply_row_bounds); the DSL's hint about it is noise
pytestmark = pytest.mark.filterwarnings("ignore:This static loop has")
needs_dsl = pytest.mark.skipif(unavailable_reason() is not None, reason=f"cute backend: {unavailable_reason()}")


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


@pytest.fixture
def dsl_arch_sm90(monkeypatch):
    """Trace host-run @cute.jit code for sm_90a (the DSL's arch is read once at import: CUTE_DSL_ARCH or sm_100a
    on a machine without a GPU)."""
    from cutlass.cutlass_dsl import CuTeDSL

    monkeypatch.setattr(CuTeDSL._get_dsl().envar, "arch", "sm_90a")


def test_sm90_config_rejects_what_the_kernel_does_not_build():
    from cute_ops.attention.fmha_sm90 import FmhaSm90Config

    with pytest.raises(ValueError, match="head_dim"):
        FmhaSm90Config("bf16", 256)
    with pytest.raises(ValueError, match="dtype"):
        FmhaSm90Config("fp32", 128)
    with pytest.raises(ValueError, match="sm_90a"):
        FmhaSm90Config("bf16", 128, arch="sm_100a")
    with pytest.raises(ValueError, match="tile_m"):
        FmhaSm90Config("bf16", 64, tile_m=256)
    with pytest.raises(ValueError, match="spills"):  # three consumer warpgroups have 160 registers each
        FmhaSm90Config("bf16", 128, tile_m=192)
    assert FmhaSm90Config("bf16", 128).smem_bytes() == 1024 + 32768 + 2 * 65536
    # DeepSeek MLA prefill (192, 128): Dv = Dqk is not a pair the kernel builds, nor is Dv = 128 beside Dqk = 64
    with pytest.raises(ValueError, match=r"\(head_dim, head_dim_v\) \(192, 192\)"):
        FmhaSm90Config("bf16", 192)
    with pytest.raises(ValueError, match="head_dim"):
        FmhaSm90Config("bf16", 64, 128)
    mla = FmhaSm90Config("bf16", 192, 128)  # Q 48 KiB + 2 x (K 48 KiB + V 32 KiB)
    assert mla.smem_bytes() == 1024 + 2 * (192 * (128 + 2 * 128) + 128 * 2 * 128) == 214016
    for more in (dict(o_tma=True), dict(persistent=132)):  # + 32 KiB O staging, + 48 KiB second Q buffer
        with pytest.raises(ValueError, match=r"SMEM \d+ bytes > 232448 \(head dims \(192, 128\)"):
            FmhaSm90Config("bf16", 192, 128, **more)


def test_sm90_every_config_fits_shared_memory():
    """The largest SharedStorage a valid config builds (hd128 persistent with the O staging tile: 225 KiB) fits the
    227 KiB an sm_90 CTA may use, and every schedule field builds at hd64 / hd128; at (192, 128) only one CTA per
    tile with register O stores fits (the config rejects the rest); the kernel asserts smem_bytes() against its
    SharedStorage when traced."""
    from cute_ops.attention.fmha_sm90 import SMEM_BYTES, FmhaSm90Config

    sizes, rejected = [], []
    for dims, tile_m in (((64, 64), 128), ((64, 64), 192), ((128, 128), 128), ((192, 128), 128)):
        for persistent in (0, 132):
            for o_tma in (False, True):
                overlap = not (tile_m == 192 and persistent)  # 192 rows + overlap spills on the persistent grid
                try:
                    sizes.append(FmhaSm90Config("bf16", *dims, tile_m=tile_m, persistent=persistent, o_tma=o_tma,
                                                overlap=overlap).smem_bytes())
                except ValueError as e:
                    assert "SMEM" in str(e), e
                    rejected.append((dims, persistent, o_tma))
    assert max(sizes) == 230400 <= SMEM_BYTES
    assert rejected == [((192, 128), 0, True), ((192, 128), 132, False), ((192, 128), 132, True)]


def test_sm90_for_call_picks_the_timed_tiles():
    """The entry's config from FOR_CALL: 128-row tiles (two consumer warpgroups);
    sliding windows and hd128 on the persistent grid (132 CTAs for host tensors; hd128 without a window with the
    overlap in bf16, and from LONG_QUERY_ROWS queries one CTA per 176-key tile); hd64 without a window:
    the 192-row tile (three warpgroups), with overlap in bf16 only; (192, 128): one CTA per 128 x 128 tile with
    overlap in bf16 only and register O stores. Every row builds a valid config with v's head dim."""
    from cute_ops.attention.fmha_sm90 import FOR_CALL, LONG_QUERY_ROWS, LONG_QUERY_RULE, FmhaSm90Config

    def tiles(d, window_left, dtype=torch.bfloat16, causal=True, d_v=None):
        q, v = torch.zeros(4, 8, d, dtype=dtype), torch.zeros(4, 8, d_v or d, dtype=dtype)
        cfg = FmhaSm90Config.for_call(q, v, causal, window_left, 0, torch.zeros(8), "sm_90a")
        assert cfg.has_sink and cfg.has_window_left == (window_left >= 0) and cfg.causal == causal
        assert (cfg.head_dim, cfg.head_dim_v) == (d, d_v or d)
        return cfg.tile_m, cfg.overlap, cfg.persistent

    for d in (64, 128):  # a sliding window: the persistent grid, one CTA per SM (132 for host tensors)
        assert tiles(d, 128) == (128, False, 132)
    assert tiles(128, -1) == (128, True, 132)
    assert tiles(128, -1, torch.float16) == (128, False, 132)
    assert tiles(64, -1) == (192, True, 0)
    assert tiles(64, -1, torch.float16) == (192, False, 0)
    for window_left, causal in ((-1, True), (-1, False), (128, True)):
        assert tiles(192, window_left, causal=causal, d_v=128) == (128, True, 0)
    assert tiles(192, -1, torch.float16, d_v=128) == (128, False, 0)
    head_dims = dict(FmhaSm90Config.HEAD_DIMS)  # Dqk -> Dv
    assert sorted(FOR_CALL) == [(d, w, c) for d in (64, 128, 192) for w in (False, True) for c in (False, True)]
    for (d, w, c), row in FOR_CALL.items():
        for dtype in (torch.bfloat16, torch.float16):
            q, v = torch.zeros(4, 8, d, dtype=dtype), torch.zeros(4, 8, head_dims[d], dtype=dtype)
            cfg = FmhaSm90Config.for_call(q, v, c, 64 if w else -1, -1, None, "sm_90a")
            assert (cfg.tile_m, cfg.o_tma, cfg.persistent > 0) == (row.tile_m, row.o_tma, row.persistent)
            assert cfg.overlap == (row.overlap and dtype == torch.bfloat16)
            # from LONG_QUERY_ROWS queries, bf16 calls take LONG_QUERY_RULE's row where it has one
            long = FmhaSm90Config.for_call(q, v, c, 64 if w else -1, -1, None, "sm_90a", LONG_QUERY_ROWS)
            short = FmhaSm90Config.for_call(q, v, c, 64 if w else -1, -1, None, "sm_90a", LONG_QUERY_ROWS - 1)
            assert short == cfg
            want = LONG_QUERY_RULE.get((d, w, c), row) if dtype == torch.bfloat16 else row
            assert (long.tile_m, long.o_tma, long.persistent > 0, long.overlap, long.tile_n) == (
                want.tile_m, want.o_tma, want.persistent, want.overlap and dtype == torch.bfloat16, want.tile_n)
            assert cfg.tile_n == row.tile_n == 128
    assert set(LONG_QUERY_RULE) == {(128, False, False), (128, False, True)}
    assert {row.tile_n for row in LONG_QUERY_RULE.values()} == {176}


def test_sm90_entry_checks_and_auto_skip_on_cpu():
    from cute_ops.attention import fmha_sm90

    def reason(q, k, v, scale=0.125):
        c = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return fmha_sm90.supports_attention_prefill(q, k, v, c, c.clone(), q.shape[0], k.shape[0], scale, True, -1,
                                                    -1, None, True)

    q, k = torch.zeros(4, 4, 64, dtype=torch.float16), torch.zeros(4, 2, 64, dtype=torch.float16)
    assert reason(q, k, k) == "the cute backend runs on CUDA tensors only"
    assert "bf16 or fp16" in reason(q.float(), k.float(), k.float())
    assert "q=32 k=32 v=32: needs k's = q's (Dqk) and (Dqk, Dv) in" in reason(q[..., :32], k[..., :32], k[..., :32])
    q192, k192, v128 = (torch.zeros(4, h, d, dtype=torch.bfloat16) for h, d in ((4, 192), (2, 192), (2, 128)))
    assert reason(q192, k192, v128) == "the cute backend runs on CUDA tensors only"  # DeepSeek MLA prefill
    assert "q=192 k=192 v=192: needs" in reason(q192, k192, k192)
    assert "q=192 k=128 v=128: needs" in reason(q192, v128, v128)
    assert "row max" in reason(q, k, k, scale=0.0)
    assert fmha_sm90.auto_skip_untimed(q, k, k) is None  # hd64 and hd128 were timed faster than Gluon
    assert fmha_sm90.auto_skip_untimed(torch.zeros(4, 4, 128), k, k) is None
    assert "head dim 96 not timed" in fmha_sm90.auto_skip_untimed(torch.zeros(4, 4, 96), k, k)
    assert fmha_sm90.auto_skip_untimed(q192, k192, v128) is None  # (192, 128) timed faster than Gluon (H200)
    from dispatch.registry import _load
    from dispatch.table import TABLE

    row = next(e for e in TABLE["attention_prefill"] if e.backend == "cute")
    assert row.archs == ("sm_90",) and _load(row.impl) is fmha_sm90.attention_prefill
    assert _load(row.auto_skip) is fmha_sm90.auto_skip_untimed, "auto takes it only where it was timed"
    paged = next(e for e in TABLE["attention_prefill_paged"] if e.backend == "cute")  # the gathered forward
    assert _load(paged.auto_skip) is fmha_sm90.auto_skip_untimed


@needs_dsl
@pytest.mark.parametrize("d,tile_m", [(64, 128), (128, 128), (64, 192)])
def test_sm90_wgmma_fragments_line_up(dsl_arch_sm90, d, tile_m):
    """Evaluated on the host for threads of every consumer warpgroup, with the kernel's own tiled MMAs for the
    config's tile_m x TILE_N: (1) the (rows, columns) view of the S accumulator puts thread t on rows
    64 * wg + 16 * warp + lane // 4 (+ 8) and columns 8 j + 2 (lane % 4) (+ 1), so a row lives in one quad; (2) its
    A-operand view is element for element the A fragment of the RS MMA O += P V (P goes to the tensor core with the
    right (row, key) at every register); (3) the O accumulator's rows are the S rows (the per-row rescale and 1 / l
    apply to the right rows); (4) mask.apply_row_bounds with those coordinates hides exactly the keys outside each
    row's [lo, hi)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    from cute_ops.attention import fmha_sm90, wgmma
    from cute_ops.attention._fmha_sm90_kernel import FmhaSm90

    kern = FmhaSm90(fmha_sm90.FmhaSm90Config("bf16", d, tile_m=tile_m))
    tile_n = fmha_sm90.TILE_N
    n = tile_n // 4  # columns of one row per thread

    @cute.jit
    def facts(out, scores, bounds, t):
        kern.dtype = cutlass.BFloat16
        qk, pv = kern.make_mmas()
        tq, tp = qk.get_slice(t), pv.get_slice(t)
        c_s = tq.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        s = wgmma.acc_mn(c_s)
        a_from_s = wgmma.acc_as_a(c_s)
        a = tp.partition_A(cute.make_identity_tensor((tile_m, tile_n)))
        o = wgmma.acc_mn(tp.partition_C(cute.make_identity_tensor((tile_m, d))))
        for r in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(n):
                out[0, r * n + i, 0] = s[r, i][0]
                out[0, r * n + i, 1] = s[r, i][1]
            for i in cutlass.range_constexpr(d // 4):
                out[3, r * n + i, 0] = o[r, i][0]
                out[3, r * n + i, 1] = o[r, i][1]
        for i in cutlass.range_constexpr(2 * n):
            out[1, i, 0] = a_from_s[i][0]
            out[1, i, 1] = a_from_s[i][1]
            out[2, i, 0] = a[i][0]
            out[2, i, 1] = a[i][1]
        acc = cute.make_rmem_tensor(qk.partition_shape_C((tile_m, tile_n)), Float32)
        acc.fill(0.0)
        acc_rows = wgmma.acc_mn(acc)
        for r in cutlass.range_constexpr(2):
            mask_lo = bounds[r, 0]
            mask_hi = bounds[r, 1]
            M.apply_row_bounds(acc_rows[r, None], s[r, None], bounds[2, 0], mask_lo, mask_hi)
            for i in cutlass.range_constexpr(n):
                scores[r, i] = acc_rows[r, i]

    threads = (0, 5, 37, 100, 130, 255) + ((260, 301, 383) if tile_m == 192 else ())
    for t in threads:
        out = torch.full((4, 2 * n, 2), -1, dtype=torch.int32)
        scores = torch.zeros(2, n)
        bounds = torch.tensor([[256 + 9, 256 + 70], [200, 256 + 3], [256, 0]], dtype=torch.int32)
        facts(from_dlpack(out), from_dlpack(scores), from_dlpack(bounds), cutlass.Int32(t))
        wg, warp, lane = t // 128, t % 128 // 32, t % 32
        row0 = 64 * wg + 16 * warp + lane // 4
        cols = [8 * j + 2 * (lane % 4) + c for j in range(tile_n // 8) for c in range(2)]
        assert out[0, :n, 0].eq(row0).all() and out[0, n:, 0].eq(row0 + 8).all(), (t, out[0, :, 0].tolist())
        assert out[0, :n, 1].tolist() == cols and out[0, n:, 1].tolist() == cols, t
        assert torch.equal(out[1], out[2]), f"thread {t}: P's registers are not the RS MMA's A fragment"
        for r in range(2):  # O (D columns): the S rows, and the same column pattern over D / 8 blocks
            assert torch.equal(out[3, n * r:n * r + d // 4], out[0, n * r:n * r + d // 4]), f"thread {t}: O"
        for r in range(2):
            key = torch.tensor(cols) + 256
            want = torch.where((key >= bounds[r, 0]) & (key < bounds[r, 1]), 0.0, float("-inf"))
            assert torch.equal(scores[r], want), (t, r)


@needs_dsl
@needs_host_bf16
@pytest.mark.parametrize("sink,tiles_cfg", [(None, (128, 128, 45)), (1.5, (128, 128, 45)), (1.5, (64, 192, 300))])
def test_sm90_softmax_tile_runs_on_the_host_like_the_model(dsl_arch_sm90, sink, tiles_cfg):
    """The consumer's per-tile step (`softmax_tile`: element mask with the thread's accumulator coordinates, row
    max, rescale factor, exp2 to bf16 P placed in the accumulator layout, l and m) traced from the kernel class and
    run on the host for one thread (portable=True: no quad shuffles, so the thread's tile_n / 4 columns of each row
    stand for the row), against OnlineSoftmaxModel on those columns with the same mask. tiles_cfg: (head dim,
    tile_m, thread); the 192-row one is a thread of the third consumer warpgroup."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    from cute_ops.attention import fmha_sm90, wgmma
    from cute_ops.attention import softmax as SM
    from cute_ops.attention._fmha_sm90_kernel import FmhaSm90

    d, tile_m, t = tiles_cfg
    tile_n = fmha_sm90.TILE_N
    tiles, cols_n = 5, tile_n // 4
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(tiles, 2, cols_n, generator=g) * 3 + torch.arange(tiles)[:, None, None] * 6.0
    bounds = torch.tensor([[150, 560], [0, 300]], dtype=torch.int32)  # [lo, hi) per row: both edges met
    scale_log2 = 0.2 * SM.LOG2E
    kern = FmhaSm90(fmha_sm90.FmhaSm90Config("bf16", d, tile_m=tile_m))

    @cute.jit
    def run(s_in, p_out, a_out, fin, bnd, n, scale):
        kern.dtype = cutlass.BFloat16
        qk, _ = kern.make_mmas()
        s_coords = wgmma.acc_mn(qk.get_slice(t).partition_C(cute.make_identity_tensor((tile_m, tile_n))))
        row_m = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        row_l = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        row_a = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        row_lo = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
        row_hi = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
        sink_log2 = None
        if cutlass.const_expr(sink is not None):
            sink_log2 = Float32(sink * SM.LOG2E)
        for r in cutlass.range_constexpr(2):
            row_m[r], row_l[r] = SM.init_stats(sink_log2)
            row_lo[r] = bnd[r, 0]
            row_hi[r] = bnd[r, 1]
        for j in cutlass.range(n):
            acc_s = cute.make_rmem_tensor(qk.partition_shape_C((tile_m, tile_n)), Float32)
            s_mn = wgmma.acc_mn(acc_s)
            for r in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(cols_n):
                    s_mn[r, i] = s_in[j, r, i]
            r_p = kern.softmax_tile(acc_s, j, s_coords, row_m, row_l, row_lo, row_hi, row_a, scale, 0, 0,
                                    portable=True)
            p_mn = wgmma.acc_mn(r_p)
            for r in cutlass.range_constexpr(2):
                a_out[j, r] = row_a[r]
                for i in cutlass.range_constexpr(cols_n):
                    p_out[j, r, i] = p_mn[r, i].to(Float32)
        for r in cutlass.range_constexpr(2):
            fin[r, 0] = row_m[r]
            fin[r, 1] = row_l[r]

    p_dev, a_dev, fin = torch.zeros(tiles, 2, cols_n), torch.zeros(tiles, 2), torch.zeros(2, 2)
    run(from_dlpack(scores), from_dlpack(p_dev), from_dlpack(a_dev), from_dlpack(fin), from_dlpack(bounds),
        cutlass.Int32(tiles), Float32(scale_log2))
    lane = t % 32
    cols = torch.tensor([8 * j + 2 * (lane % 4) + c for j in range(tile_n // 8) for c in range(2)])
    model = SM.OnlineSoftmaxModel(2, scale_log2, sink)
    for j in range(tiles):
        keys = cols + tile_n * j
        hidden = (keys[None, :] < bounds[:, :1]) | (keys[None, :] >= bounds[:, 1:])
        p, a = model.step(scores[j].masked_fill(hidden, float("-inf")))
        torch.testing.assert_close(a_dev[j], a, rtol=1e-5, atol=0, msg=f"rescale factor, tile {j}")
        torch.testing.assert_close(p_dev[j], p.bfloat16().float(), rtol=1e-2, atol=0, msg=f"P, tile {j}")
    torch.testing.assert_close(fin[:, 0], model.m, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fin[:, 1], model.l, rtol=1e-4, atol=1e-6)


@needs_dsl
@needs_host_bf16
@pytest.mark.parametrize("tile_m,t", [(128, 0), (128, 6), (128, 77), (128, 201), (192, 130), (192, 300), (192, 383)])
def test_sm90_epilogue_runs_on_the_host(dsl_arch_sm90, tile_m, t):
    """The consumer's epilogue traced from the kernel class and run on the host for thread t, writing into a torch
    (tokens, heads, D) tensor through the kernel's (tokens, D, heads) view: each of the thread's O values lands at
    (q_start + tile_m m_block + row, h, column) divided by its row's l, rows past the sequence are not written, and the
    first thread of each quad writes its rows' natural-log lse (-inf for l = 0)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    from cute_ops.attention import fmha_sm90, wgmma
    from cute_ops.attention._fmha_sm90_kernel import FmhaSm90

    d, hq, h, q_start, m_block = 64, 3, 2, 5, 1
    sq = tile_m + 70  # the second tile's rows 70.. lie past the sequence
    kern = FmhaSm90(fmha_sm90.FmhaSm90Config("bf16", d, tile_m=tile_m))
    out = torch.full((q_start + 2 * tile_m + 4, hq, d), -7.0, dtype=torch.bfloat16)
    lse = torch.full((out.shape[0], hq), -7.0)
    stats = torch.tensor([[1.5, 4.0], [0.25, 0.0]])  # (m, l) per row (log2 units); the second row saw nothing

    @cute.jit
    def run(o_t, lse_t, st, tt):
        kern.dtype = cutlass.BFloat16
        _, pv = kern.make_mmas()
        thr = pv.get_slice(tt)
        m_o = cute.make_tensor(o_t.iterator, cute.make_layout((o_t.shape[0], d, hq),
                                                               stride=(o_t.stride[0], 1, o_t.stride[1])))
        acc_o = cute.make_rmem_tensor(thr.partition_shape_C((tile_m, d)), Float32)
        o_mn = wgmma.acc_mn(acc_o)
        c_mn = wgmma.acc_mn(thr.partition_C(cute.make_identity_tensor((tile_m, d))))
        for r in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(d // 4):
                o_mn[r, i] = Float32(c_mn[r, i][0] * 1000 + c_mn[r, i][1])  # row * 1000 + column
        row_m = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        row_l = cute.make_rmem_tensor(cute.make_layout(2), Float32)
        for r in cutlass.range_constexpr(2):
            row_m[r] = st[r, 0]
            row_l[r] = st[r, 1]
        kern.epilogue(thr, acc_o, o_mn, row_m, row_l, m_o, lse_t, tt, q_start, sq, m_block, h, portable=True)

    run(from_dlpack(out), from_dlpack(lse), from_dlpack(stats), cutlass.Int32(t))
    wg, warp, lane = t // 128, t % 128 // 32, t % 32
    rows = [64 * wg + 16 * warp + lane // 4 + 8 * r for r in range(2)]
    cols = [8 * j + 2 * (lane % 4) + c for j in range(d // 8) for c in range(2)]
    want_out = torch.full_like(out, -7.0)
    want_lse = torch.full_like(lse, -7.0)
    for r, row in enumerate(rows):
        if tile_m * m_block + row >= sq:
            continue
        tok = q_start + tile_m * m_block + row
        inv = 1.0 / stats[r, 1] if stats[r, 1] > 0 else 0.0
        want_out[tok, h, cols] = (torch.tensor([row * 1000.0 + c for c in cols]) * inv).bfloat16()
        if lane % 4 == 0:
            want_lse[tok, h] = (stats[r, 0] + math.log2(stats[r, 1])) * math.log(2) if stats[r, 1] > 0 else -math.inf
    assert torch.equal(out, want_out), (out != want_out).nonzero()[:8].tolist()
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


# hd64 tile variants (FmhaSm90Config fields): three consumer warpgroups (the 192-row query tile of FA3 / FA4 at
# hd64) with the ping-pong ring, and with FA4's intra-warpgroup overlap as well. Each compiles for sm_90a without
# spills with the GPT-OSS window mask (test_sm90_sass_has_wgmma_and_tma). On windowed calls the first runs on the
# persistent grid (for_call's); the 192-row tile with overlap spills there, so it keeps one CTA per tile.
SM90_HD64_VARIANTS = [  # fully specified: the base config may already be the 192-row tile with overlap (for_call)
    dict(tile_m=192, overlap=False), dict(tile_m=192, overlap=True, persistent=0)]
GPT_OSS_WINDOW = dict(causal=True, has_window_left=True, has_window_right=True, has_sink=True)  # window (128, 0)
# the persistent grid (dtype, head dim, other fields, CTAs): the same instruction counts as one CTA per tile (one
# call site per GEMM and load, the same turn barriers); registers: 151 of 240 at hd64 window, 182 at hd128,
# 137 of 160 with 192 rows
SM90_PERSISTENT_SASS = [
    ("bf16", 64, GPT_OSS_WINDOW, 132), ("bf16", 128, dict(causal=True, has_sink=True), 132),
    ("fp16", 64, dict(has_window_left=True, overlap=True), 7), ("bf16", 64, dict(GPT_OSS_WINDOW), 1),
    ("bf16", 64, dict(GPT_OSS_WINDOW, tile_m=192), 132),
    ("bf16", 128, dict(GPT_OSS_WINDOW, overlap=True), 132)]
# the O epilogue through SMEM + TMA store (o_tma), persistent and not: per consumer warpgroup D / 16 stmatrix.x4,
# D / 64 UTMASTG (64-column boxes), the register stores kept for slices ending inside a sequence
SM90_O_TMA_SASS = [
    ("bf16", 64, dict(GPT_OSS_WINDOW, o_tma=True, persistent=132)),
    ("bf16", 64, dict(GPT_OSS_WINDOW, o_tma=True, persistent=132, tile_m=192)),
    ("bf16", 128, dict(causal=True, o_tma=True, persistent=132)),
    ("fp16", 128, dict(o_tma=True)), ("bf16", 64, dict(causal=True, has_sink=True, tile_m=192, overlap=True,
                                                         o_tma=True)),
    ("bf16", 128, dict(has_window_left=True, o_tma=True, persistent=3))]


# DeepSeek MLA prefill (qk 192, v 128), as FOR_CALL builds it (one CTA per 128 x 128 tile, register O stores; overlap
# in bf16 only): registers 192 of 240 causal with the overlap, no local memory
MLA = (192, 128)
SM90_MLA_SASS_MORE = [
    ("bf16", MLA, dict(GPT_OSS_WINDOW, overlap=True)),  # the window and sink paths at Dqk != Dv
    ("fp16", MLA, dict(causal=True)),
]


# FA3's 176-key tile at hd128, as LONG_QUERY_RULE builds it (one CTA per 128-row tile, register O stores, no
# overlap): 205 of 240 registers, no local memory
TILE_N_176 = dict(tile_m=128, overlap=False, persistent=0, o_tma=False, tile_n=176)

SM90_SASS_MORE = [
    ("bf16", 128, dict(TILE_N_176, causal=True, has_sink=True)),
    ("bf16", 128, dict(causal=True, has_sink=True, overlap=True)),
    ("fp16", 64, dict(has_window_left=True, overlap=True)),
    ("bf16", 64, dict(causal=True, has_sink=True)),  # GPT-OSS causal as for_call builds it, and with 192 rows
    ("bf16", 64, dict(causal=True, has_sink=True, tile_m=192)),
    ("fp16", 64, dict(causal=True, tile_m=192)),
    *[("bf16", 64, dict(GPT_OSS_WINDOW, **v)) for v in SM90_HD64_VARIANTS],
    *[(dt, d, dict(extra, persistent=n)) for dt, d, extra, n in SM90_PERSISTENT_SASS],
    *SM90_O_TMA_SASS,
    *SM90_MLA_SASS_MORE,
]


@pytest.mark.parametrize("dtype,d,extra", [
    ("bf16", 128, dict(causal=True, has_window_left=True, has_sink=True)),
    ("fp16", 64, dict(has_window_left=True, has_window_right=True)),
    ("bf16", MLA, dict(causal=True, overlap=True)),
    ("bf16", 128, TILE_N_176),
    *[pytest.param(*case, marks=pytest.mark.slow) for case in SM90_SASS_MORE],  # the GPU suite runs each config
])
@needs_dsl
def test_sm90_sass_has_wgmma_and_tma(dtype, d, extra):
    """Record (nvidia-cutlass-dsl 4.8.1): bf16 D=128: HGMMA.64x128 16, UTMALDG.3D 6, MUFU.EX2 66, SHFL.BFLY 8,
    STG.E 34, USETMAXREG 2, no local memory; fp16 D=64: HGMMA 12, UTMALDG 3, STG.E 18. Ping-pong: BAR.SYNC 3
    (the CTA barrier, the first turn, the turn before PV), BAR.ARV 3 (warpgroup 0's own first turn, the turn
    after QK, the last one); with the overlap, 2 and 2 (the turn before QK_j + PV_{j-1}, the pass after them).
    Overlap: two call sites of each GEMM (the first tile's QK and the last PV outside the loop), 4 waits.
    Registers (REG at launch; registers the SASS names): 128 x 128: 168, 142 of 240 at hd64 causal + sinks;
    192 x 128 (three consumer warpgroups, 512 threads): 128, 137 of 160; with the overlap 156 of 160. The launch
    limit (65536 / threads) and setmaxnreg's split are checked. d: Dqk = Dv, or the pair (Dqk, Dv) (MLA: bf16
    causal + overlap HGMMA 40 (2 x (192 / 16 + 128 / 16)), UTMALDG 8 (Q, K 3 boxes, V 2), STG.E 34)."""
    from cute_ops.attention.fmha_sm90 import REGS, FmhaSm90Config, dump

    d, d_v = d if isinstance(d, tuple) else (d, d)
    cfg = FmhaSm90Config(dtype, d, d_v, **extra)
    d_ = dump(cfg)
    ops = d_.opcodes()
    assert "sm_90a" in d_.ptx.split(".target", 1)[1][:40]
    # S = Q K^T: Dqk / 16 k-steps of m64n{tile_n}k16; O += P V: tile_n / 16 k-steps of m64n{Dv}k16, A from registers
    tn = cfg.tile_n
    sites = 2 if extra.get("overlap") else 1
    assert d_.count("HGMMA") == sites * (d // 16 + tn // 16), ops
    ab = "bf16.bf16" if dtype == "bf16" else "f16.f16"
    assert f"wgmma.mma_async.sync.aligned.m64n{tn}k16.f32.{ab}" in d_.ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{d_v}k16.f32.{ab} {{" in d_.ptx.replace("\t", " ")
    assert any("wgmma.mma_async" in ln and "{%r" in ln.split("},", 1)[1][:8] for ln in d_.ptx.splitlines()
               if "wgmma.mma_async" in ln and f"m64n{d_v}k16" in ln), "no WGMMA takes A (P) from registers"
    # fp16 + overlap: ptxas serializes the WGMMAs (C7513: NVVM re-packs P's f16 halves into the RS operand registers
    # after QK_j is issued), one ARRIVE / DEPBAR per HGMMA; bf16 keeps P packed and is not serialized
    waits = d_.count("HGMMA") if (dtype == "fp16" and extra.get("overlap")) else 2 * sites
    assert d_.count("WARPGROUP.ARRIVE") == waits and d_.count("WARPGROUP.DEPBAR") == waits, ops
    assert d_.count("UTMALDG") == (2 * d + d_v) // 64, ops  # Q, K, V: boxes of 64 columns (128-byte swizzle)
    assert d_.count("SYNCS.ARRIVE.TRANS64") >= 3, ops  # expect-tx arrives of the TMA pipelines
    assert d_.count("USETMAXREG") == 2, ops  # producer down, consumers up
    assert d_.count("MUFU.EX2") >= tn // 2 * sites, ops  # 2 rows x TILE_N / 4 keys per thread and tile
    assert d_.count("SHFL.BFLY") >= 8, ops  # quad max and sum, 2 rows
    assert d_.count("F2FP") >= tn // 4, ops
    # 2 rows x Dv / 8 column pairs, and 2 lse values (o_tma: the TMA branch's 2 lse values as well)
    assert d_.count("STG.E") == 2 * d_v // 8 + 2 + 2 * cfg.o_tma, ops
    assert d_.count("STL") == 0 and d_.count("LDL") == 0, ops
    assert (d_.count("UTMASTG"), d_.count("STSM")) == ((d_v // 64, d_v // 16) if cfg.o_tma else (0, 0)), ops
    if cfg.o_tma:
        for op in ("cp.async.bulk.commit_group", "fence.proxy.async.shared::cta", "cp.async.bulk.wait_group.read"):
            assert op in d_.ptx, op
    sync, arv = (2, 2) if cfg.overlap else (3, 3)  # o_tma: the SMEM slice's two barriers
    assert (d_.count("BAR.SYNC"), d_.count("BAR.ARV")) == (sync + 2 * cfg.o_tma, arv), ops
    threads = 128 * (1 + cfg.consumer_warpgroups)
    res = d_.resources()
    assert f".reqntid {threads}, 1, 1" in d_.ptx, "the launch block is not the one the registers were split for"
    assert res["REG"] * threads <= 65536 and res["LOCAL"] == 0 and res["STACK"] == 0, res
    producer, consumer = REGS[cfg.consumer_warpgroups]
    assert 128 * producer + 128 * cfg.consumer_warpgroups * consumer <= 65536
    setmax = [ln.split()[-1].rstrip(";") for ln in d_.ptx.splitlines() if "setmaxnreg" in ln]
    assert setmax == [str(producer), str(consumer)], setmax
    assert d_.max_register() <= consumer, (d_.max_register(), consumer)
    # the persistent tile walk steps by the grid size; one CTA per tile never reads it
    assert ("%nctaid.x" in d_.ptx) == bool(cfg.persistent)


def _need_sm90():
    if unavailable_reason() is not None:
        pytest.skip(f"cute backend: {unavailable_reason()}")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 CuTeDSL attention kernel runs on sm_90 (H100/H200) only")


def _sm90_case(lq, lk, hq, hkv, d, dtype, causal, window, sink, seed=0, qkv_packed=False, variant=None):
    """(out, lse, want_out, want_lse) of the cute backend on the GPU (through dispatch; with `variant`, a dict of
    schedule fields of FmhaSm90Config, the compiled kernel of that variant directly) and the fp64 reference.
    d: Dqk = Dv, or the pair (Dqk, Dv)."""
    import dispatch
    from cute_ops.attention import fmha_sm90, launch

    d, d_v = d if isinstance(d, tuple) else (d, d)
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    if qkv_packed:  # q, k, v as head slices of one (tokens, Hq + 2 Hkv, D) tensor: strided heads, as from a QKV GEMM
        assert lq == lk and d == d_v
        qkv = torch.randn(tq, hq + 2 * hkv, d, device="cuda", generator=g).to(dtype)
        q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    else:
        q = torch.randn(tq, hq, d, device="cuda", generator=g).to(dtype)
        k = torch.randn(tk, hkv, d, device="cuda", generator=g).to(dtype)
        v = torch.randn(tk, hkv, d_v, device="cuda", generator=g).to(dtype)
    sinks = torch.randn(hq, device="cuda", generator=g) * 2 if sink else None
    cu_q, cu_k = cu(lq).cuda(), cu(lk).cuda()
    scale = 1.0 / math.sqrt(d)
    if variant is None:
        out, lse = dispatch.ops.attention_prefill(q, k, v, cu_q, cu_k, max(lq), max(lk), softmax_scale=scale,
                                                  causal=causal, window=window, sinks=sinks, return_lse=True,
                                                  backend="cute")
    else:
        cfg = fmha_sm90.FmhaSm90Config.for_call(q, v, causal, *window, sinks, "sm_90a")
        fn = fmha_sm90.compiled(dataclasses.replace(cfg, **variant))
        out, lse = launch.run(fn, q, k, v, cu_q, cu_k, scale, *window, sinks)
    want_out, want_lse = attention_varlen(q, k, v, cu_q, cu_k, scale, causal, window, sinks)
    return out, lse, want_out, want_lse


SM90_GPU_CASES = [  # lq, lk, hq, hkv, d, dtype, causal, window, sink
    ([1000], [1000], 4, 4, 128, torch.bfloat16, True, (-1, -1), False),
    ([1000], [1000], 4, 4, 128, torch.bfloat16, False, (-1, -1), False),
    ([300, 0, 129, 1, 256], [300, 5, 700, 64, 256], 8, 2, 64, torch.float16, True, (100, -1), True),  # varlen GQA
    ([513, 64], [1500, 64], 4, 1, 128, torch.bfloat16, False, (-1, 0), True),  # MQA, right window only
    ([700, 77], [700, 900], 8, 2, 64, torch.bfloat16, False, (37, 11), False),  # both window sides, no causal
    ([200, 3], [50, 0], 2, 2, 128, torch.float16, True, (-1, -1), False),  # sk < sq and sk = 0: empty rows
    ([200, 3], [50, 0], 2, 2, 64, torch.bfloat16, True, (-1, -1), True),  # the same with sinks: lse = sink
    ([1], [4096], 8, 8, 128, torch.bfloat16, True, (-1, -1), False),  # one query, many keys
    ([2048], [2048], 8, 1, 128, torch.bfloat16, True, (256, -1), True),  # sliding window + sinks, MQA
    ([1000, 577], [1000, 577], 8, 1, 64, torch.bfloat16, True, (-1, -1), True),  # GPT-OSS causal + sinks
    ([700, 1300], [700, 1300], 8, 1, 64, torch.bfloat16, True, (128, 0), True),  # GPT-OSS window 128 + sinks
    ([333, 64], [333, 700], 4, 2, 64, torch.float16, False, (-1, -1), False),  # fp16 hd64: 192 rows, no overlap
]


# DeepSeek MLA prefill head dims (qk 192, v 128): one CTA per 128 x 128 tile, register O stores (FOR_CALL)
SM90_MLA_GPU_CASES = [  # lq, lk, hq, hkv, (Dqk, Dv), dtype, causal, window, sink
    ([1000], [1000], 16, 16, MLA, torch.bfloat16, True, (-1, -1), False),
    ([1000], [1000], 16, 16, MLA, torch.bfloat16, False, (-1, -1), False),
    ([300, 0, 129, 1, 700], [300, 5, 129, 64, 700], 8, 8, MLA, torch.float16, True, (-1, -1), False),  # varlen
    ([513, 64], [513, 900], 8, 2, MLA, torch.bfloat16, True, (100, -1), True),  # GQA, window, sinks, sk > sq
    ([200, 3], [50, 0], 4, 4, MLA, torch.bfloat16, True, (-1, -1), False),  # sk < sq and sk = 0: empty rows
]


def _case_id(c) -> str:
    d = "/".join(map(str, c[4])) if isinstance(c[4], tuple) else c[4]
    return (f"q{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{d}-{str(c[5])[6:]}-causal{int(c[6])}-w{c[7][0]},{c[7][1]}-"
            f"sink{int(c[8])}").replace(" ", "")


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_GPU_CASES + SM90_MLA_GPU_CASES, ids=_case_id)
def test_gpu_sm90_matches_reference(case):
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 {case}")


def _variant_id(v) -> str:
    return "+".join(f"{k}={int(x)}" for k, x in v.items()) or "default"


# the two consumer schedules (both with ping-pong): without and with the intra-warpgroup overlap
SM90_VARIANTS = [dict(overlap=False), dict(overlap=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SM90_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("case", SM90_GPU_CASES[:3] + SM90_GPU_CASES[5:] + SM90_MLA_GPU_CASES[2:4], ids=_case_id)
def test_gpu_sm90_schedule_variants_match_reference(case, variant):
    """Both consumer schedules (for_call takes the overlap at hd64 bf16 without a window and at (192, 128) bf16) on
    every case, (192, 128) with the varlen and the window + sinks case."""
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 {variant} {case}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_GPU_CASES, ids=_case_id)
def test_gpu_sm90_tile_n_176_matches_reference(case):
    """The 176-key tile (LONG_QUERY_RULE's: one CTA per 128-row tile, no overlap) on every case: key counts that
    are not multiples of 176, windows, sinks, varlen with empty sequences, sk < sq, fp16."""
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case, variant=TILE_N_176)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 tile_n 176 {case}")


SM90_HD64_CASES = [SM90_GPU_CASES[2], *SM90_GPU_CASES[-3:-1]]  # varlen GQA fp16 with empty sequences; GPT-OSS


@pytest.mark.gpu
@pytest.mark.parametrize("variant", SM90_HD64_VARIANTS, ids=_variant_id)
@pytest.mark.parametrize("case", SM90_HD64_CASES, ids=_case_id)
def test_gpu_sm90_hd64_tile_variants_match_reference(case, variant):
    """The hd64 tile variants (192-row query tiles: three consumer warpgroups, with and without the overlap)
    against the fp64 reference: causal, window (128, 0) and (100, -1), sinks, GQA / MQA, varlen with an empty
    sequence and lengths that are not multiples of 192 or 128."""
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case(*case, variant=variant)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 {variant} {case}")


@pytest.mark.gpu
def test_gpu_sm90_strided_heads():
    """q/k/v as head slices of one packed QKV tensor (token stride 16 heads, not the head count)."""
    _need_sm90()
    out, lse, want_out, want_lse = _sm90_case([384, 129], [384, 129], 8, 4, 128, torch.bfloat16, True, (-1, -1),
                                              True, seed=3, qkv_packed=True)
    assert_attention_close(out, lse, want_out, want_lse, "sm90 packed qkv")


@pytest.mark.gpu
@pytest.mark.parametrize("d,d_v", [(128, 128), MLA])
@pytest.mark.parametrize("sink", [False, True])
def test_gpu_sm90_eager_calls_take_the_prepared_launcher(sink, d, d_v, monkeypatch):
    """From the second eager call of a signature on, `specialize_attention_prefill`'s launcher runs (config,
    compiled function, scale and checks resolved once) where the native replay is off (the Python path), and gives
    the general entry's bytes (out with v's head dim)."""
    _need_sm90()
    from cute_ops.attention import fmha_sm90
    from dispatch import native_replay
    from dispatch.ops import _common

    monkeypatch.setenv(native_replay.NATIVE_ENV, "0")

    g = torch.Generator(device="cuda").manual_seed(7)
    lq, lk = [130, 0, 257], [260, 7, 257]
    q = torch.randn(sum(lq), 8, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(sum(lk), 2, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(sum(lk), 2, d_v, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(8, device="cuda", generator=g) if sink else None
    args = (q, k, v, cu(lq).cuda(), cu(lk).cuda(), max(lq), max(lk), 0.1, True, -1, -1, sinks, True)
    _common._FAST.clear()
    _common.call("attention_prefill", *args, "cute")
    fast = _common._FAST.get(("attention_prefill", _common._signature((*args, "cute"))))
    assert getattr(fast, "__name__", None) == "prefill", f"no prepared launcher: {fast}"
    out, lse = _common.call("attention_prefill", *args, "cute")
    want_out, want_lse = fmha_sm90.attention_prefill(*args)
    assert out.shape == (sum(lq), 8, d_v) and torch.equal(out, want_out) and torch.equal(lse, want_lse)


@st.composite
def sm90_gpu_cases(draw):
    n = draw(st.integers(1, 4))
    lk = [draw(st.sampled_from([0, 1, 63, 128, 129, 300, 1000])) for _ in range(n)]
    lq = [draw(st.sampled_from([s, s, 0, 1, min(s, 77), s + 50])) for s in lk]
    hq, hkv = draw(st.sampled_from([(2, 2), (4, 1), (8, 2)]))
    window = (draw(st.sampled_from([-1, -1, 0, 5, 200])), draw(st.sampled_from([-1, -1, 0, 40])))
    return (lq, lk, hq, hkv, draw(st.sampled_from([64, 128])), draw(st.sampled_from([torch.bfloat16, torch.float16])),
            draw(st.booleans()), window, draw(st.booleans()), draw(st.integers(0, 2**16)))


@pytest.mark.gpu
@given(case=sm90_gpu_cases())
def test_gpu_sm90_drawn_cases_match_reference(case):
    _need_sm90()
    if sum(case[0]) == 0:
        return  # nothing to compare (the entry returns empty tensors without a launch)
    out, lse, want_out, want_lse = _sm90_case(*case)
    assert_attention_close(out, lse, want_out, want_lse, f"sm90 {case}")


# (label, batch, seqlen, hq, hkv, head dim (or (Dqk, Dv)), window_left, sinks): the benchmark set's model shapes
# (perf/cases/attention.py times them against FA4); GPT-OSS's sliding window of 128 is window (127, 0).
MODEL_SHAPES = [
    ("llama 4x4096 hd128 causal", 4, 4096, 32, 8, 128, -1, False),
    ("gpt-oss 2x8192 hd64 causal sinks", 2, 8192, 64, 8, 64, -1, True),
    ("gpt-oss 2x8192 hd64 window 127 sinks", 2, 8192, 64, 8, 64, 127, True),
    ("deepseek mla 1x8192 hd192/128 causal", 1, 8192, 16, 16, MLA, -1, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MODEL_SHAPES, ids=lambda c: c[0].replace(" ", "-"))
def test_gpu_sm90_model_shapes_match_triton(case):
    """At the model shapes, the config the rule picks (FmhaSm90Config.for_call, the persistent grid and the 192-row
    hd64 tile included) against the plain Triton kernel on the same inputs."""
    _need_sm90()
    import dispatch
    from cute_ops.attention import fmha_sm90, launch

    label, b, s_, hq, hkv, d, wl, with_sinks = case
    d, d_v = d if isinstance(d, tuple) else (d, d)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b * s_, hq, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b * s_, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b * s_, hkv, d_v, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(hq, device="cuda", generator=g) if with_sinks else None
    cu_ = cu([s_] * b).cuda()
    scale = d ** -0.5
    window = (wl, 0) if wl >= 0 else (-1, -1)
    cfg = fmha_sm90.FmhaSm90Config.for_call(q, v, True, window[0], window[1], sinks, "sm_90a")
    got = launch.run(fmha_sm90.compiled(cfg), q, k, v, cu_, cu_, scale, window[0], window[1], sinks)
    want = dispatch.ops.attention_prefill(q, k, v, cu_, cu_, s_, s_, softmax_scale=scale, causal=True, window=window,
                                          sinks=sinks, return_lse=True, backend="triton")
    assert_attention_close(*got, *want, f"{label}: cute {cfg} vs triton")
