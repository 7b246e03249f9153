"""CuTeDSL Blackwell attention (cute_ops/attention): CPU only. The kernel is compiled and SASS-checked, never run.

* Compile (skipped, with the reason, without nvidia-cutlass-dsl): the sm_100a kernel compiles on a CPU and its SASS
  has the tcgen05 instructions the design needs (UTCHMMA, LDTM/STTM, UTCBAR, UTMALDG, setmaxnreg) in the expected
  numbers, 16-byte output stores, and no local memory; `compiled` round-trips lowbit's disk cache.
* Device code on the host: a @cute.jit function that launches no kernel runs on the CPU, so the kernel's own
  mask formulas (traced Int32 arithmetic), element mask (with the coordinates of the thread's TMEM-load slice),
  softmax step helpers (portable=True forms) and the TMEM partition facts it relies on are executed here.
* Host twins against the contract (dispatch/reference/attention.py): the per-row key interval vs `visible_keys`,
  the per-tile ranges vs triton_ops/attention/mask.py (run in a Triton kernel, interpreted on CPU), the packed
  scheduler's tile mapping, the online softmax, and `emulate` -- the kernel's whole algorithm tile by tile --
  vs `attention_varlen` on drawn varlen batches (GQA, causal, windows, sinks, empty rows, rescale on/off).
Not covered anywhere: the device scheduler (warp shuffles/ballot), TMA, UMMA, TMEM traffic and the mbarrier
protocol -- they need a Blackwell GPU.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from cute_ops import unavailable_reason
from cute_ops.attention import mask as M
from cute_ops.attention import scheduler as S
from cute_ops.attention import softmax as SM
from cute_ops.attention.fmha_sm100 import FmhaSm100Config, emulate
from dispatch.reference.attention import attention_varlen, visible_keys
from tests.helpers import assert_attention_close, needs_host_bf16
from triton_ops.attention.mask import full_key_range, key_range

# range_constexpr over 128 columns is deliberate (see mask.apply_row_bounds); the DSL's hint about it is noise here
pytestmark = pytest.mark.filterwarnings("ignore:This static loop has")
needs_dsl = pytest.mark.skipif(unavailable_reason() is not None, reason=f"cute backend: {unavailable_reason()}")

WINDOW_LEFTS = (-1, 0, 1, 3, 7, 40)
WINDOW_RIGHTS = (-1, 0, 2, 5)


def cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(list(lengths), dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


# ------------------------------------------------------------------------------------------------- mask


@st.composite
def mask_cases(draw):
    sq, sk = draw(st.integers(0, 40)), draw(st.integers(0, 40))
    window = (draw(st.sampled_from(WINDOW_LEFTS)), draw(st.sampled_from(WINDOW_RIGHTS)))
    tiles = draw(st.sampled_from([(4, 4), (8, 4), (4, 8), (16, 16), (128, 128), (12, 8), (6, 10), (192, 128),
                                   (128, 192)]))  # and tiles that are not powers of two (the sm90 192-row tile)
    return sq, sk, draw(st.booleans()), window, tiles


@given(case=mask_cases())
def test_row_bounds_match_reference_visible_keys(case):
    sq, sk, causal, window, _ = case
    assert torch.equal(M.visible_from_row_bounds(sq, sk, causal, window), visible_keys(sq, sk, causal, window))


@given(case=mask_cases())
def test_tile_ranges_visit_every_visible_key_and_skip_the_mask_only_where_all_are_visible(case):
    sq, sk, causal, window, (tm, tn) = case
    vis = visible_keys(sq, sk, causal, window)
    visited, unmasked = M.visited_keys(sq, sk, causal, window, tm, tn)
    assert not (vis & ~visited).any(), "a visible key sits in a key tile the loop skips"
    assert not (unmasked & ~vis).any(), "a tile processed without the element mask holds a hidden key"
    spec = M.MaskSpec.of(causal, *window)
    for m in range(-(-sq // tm)):  # tight: every visited tile holds a key some row of the query tile sees
        n_lo, n_count, _, _ = M.tile_range(spec, m, sq, sk, window[0], window[1], tm, tn)
        assert n_count >= 0
        rows = vis[m * tm:(m + 1) * tm]
        for n in range(n_lo, n_lo + n_count):
            assert rows[:, n * tn:(n + 1) * tn].any(), f"m-tile {m} visits key tile {n} that no row sees"


@triton.jit
def _ranges_kernel(qlo_ptr, qhi_ptr, sk_ptr, out_ptr, n, CAUSAL: tl.constexpr, WL: tl.constexpr, WR: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    qlo = tl.load(qlo_ptr + offs, mask=ok, other=0)
    qhi = tl.load(qhi_ptr + offs, mask=ok, other=0)
    skv = tl.load(sk_ptr + offs, mask=ok, other=0)
    zero = tl.zeros([BLOCK], dtype=tl.int32)
    lo, hi = key_range(qlo, qhi, skv, CAUSAL, WL, WR)
    flo, fhi = full_key_range(qlo, qhi, skv, CAUSAL, WL, WR)
    tl.store(out_ptr + offs * 4, lo + zero, mask=ok)
    tl.store(out_ptr + offs * 4 + 1, hi + zero, mask=ok)
    tl.store(out_ptr + offs * 4 + 2, flo + zero, mask=ok)
    tl.store(out_ptr + offs * 4 + 3, fhi + zero, mask=ok)


def _triton_ranges(q_lo, q_hi, sk, causal, left, right):
    """(lo, hi, full_lo, full_hi) from triton_ops/attention/mask.py, run in a Triton kernel (interpreted on CPU)."""
    device = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
    args = [torch.tensor(x, dtype=torch.int32, device=device) for x in (q_lo, q_hi, sk)]
    out = torch.zeros(len(q_lo), 4, dtype=torch.int32, device=device)
    _ranges_kernel[(1,)](*args, out, len(q_lo), causal, left, right, BLOCK=triton.next_power_of_2(len(q_lo)))
    return out.cpu().tolist()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("left,right", [(-1, -1), (3, -1), (-1, 2), (0, 0), (7, 5)])
def test_ranges_match_triton_mask_rules(causal, left, right):
    cases = [(q_lo, q_lo + span, sk) for q_lo in (-9, -1, 0, 3, 17) for span in (0, 5, 31) for sk in (0, 1, 20)]
    got_triton = _triton_ranges(*zip(*cases, strict=True), causal, left, right)
    spec = M.MaskSpec.of(causal, left, right)
    for (q_lo, q_hi, sk), (lo, hi, flo, fhi) in zip(cases, got_triton, strict=True):
        assert M.key_range(spec, q_lo, q_hi, sk, left, right) == (lo, hi), (q_lo, q_hi, sk)
        assert M.full_key_range(spec, q_lo, q_hi, sk, left, right) == (flo, fhi), (q_lo, q_hi, sk)


# The device side of mask.py run on the CPU: a @cute.jit function without a kernel launch executes on the host,
# so the traced Int32 versions of the formulas (cutlass.max/min, Int32 division) and the element mask run here.


def _device_ranges(spec, cases, tile_m, tile_n):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    @cute.jit
    def ranges(inp, out, n):  # no annotations: this module's are strings (__future__), and cute is local
        for i in cutlass.range(n):
            got = M.tile_range(spec, inp[i, 0], inp[i, 1], inp[i, 2], inp[i, 3], inp[i, 4], tile_m, tile_n)
            row = M.row_key_bounds(spec, inp[i, 5], inp[i, 2], inp[i, 3], inp[i, 4])
            for c in cutlass.range_constexpr(4):
                out[i, c] = got[c]
            out[i, 4] = row[0]
            out[i, 5] = row[1]

    inp = torch.tensor(cases, dtype=torch.int32)
    out = torch.zeros(len(cases), 6, dtype=torch.int32)
    ranges(from_dlpack(inp), from_dlpack(out), cutlass.Int32(len(cases)))
    return out.tolist()


@needs_dsl
@pytest.mark.parametrize("tile_m,tile_n", [(16, 8), (12, 20)])
@pytest.mark.parametrize("causal,left,right", [(False, -1, -1), (True, -1, -1), (True, 5, -1), (False, 3, 2)])
def test_device_mask_formulas_run_on_the_host_like_the_twins(causal, left, right, tile_m, tile_n):
    spec = M.MaskSpec.of(causal, left, right)
    cases = [(m, sq, sk, left, right, q_pos) for sq, sk in ((1, 1), (40, 40), (7, 300), (300, 7), (129, 0))
             for m in range(-(-sq // tile_m)) for q_pos in (-3, 0, 17)]
    for case, got in zip(cases, _device_ranges(spec, cases, tile_m, tile_n), strict=True):
        m, sq, sk, _, _, q_pos = case
        assert got[:4] == list(M.tile_range(spec, m, sq, sk, left, right, tile_m, tile_n)), case
        assert got[4:] == list(M.row_key_bounds(spec, q_pos, sk, left, right)), case


@needs_dsl
def test_device_element_mask_runs_on_the_host():
    """apply_row_bounds exactly as the softmax warps call it: the column coordinates from the thread's slice of the
    32x32b TMEM load of S (thread 37 -> row 37), inside a dynamic loop and a dynamic branch."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
    from cutlass.cute.runtime import from_dlpack

    @cute.jit
    def masked(scores, bounds, t, n):
        dt = cutlass.BFloat16
        qk = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                tcgen05.CtaGroup.ONE, (128, 128))
        thr = qk.get_slice(0)
        frag = thr.make_fragment_C(thr.partition_shape_C((128, 128)))
        tStS = cute.make_tensor(cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16), frag.layout)
        tScS = thr.partition_C(cute.make_identity_tensor((128, 128)))
        ld = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32), tStS)
        coords = ld.get_slice(t).partition_D(tScS)
        rs = cute.make_rmem_tensor(coords.shape, Float32)
        for j in cutlass.range(n):
            for i in cutlass.range_constexpr(128):
                rs[i] = Float32(0.0)
            if bounds[j, 3] != 0:  # "an edge tile"
                M.apply_row_bounds(rs, coords, bounds[j, 0], bounds[j, 1], bounds[j, 2])
            for i in cutlass.range_constexpr(128):
                scores[j, i] = rs[i]
        scores[n, 0] = Float32(coords[0][0])

    cases = [(256, 300, 310, 1), (256, 200, 300, 1), (0, 5, 3, 1), (128, 0, 140, 1), (128, 130, 131, 0),
             (384, 400, 1000, 1), (0, -7, 9, 1)]
    scores = torch.zeros(len(cases) + 1, 128)
    masked(from_dlpack(scores), from_dlpack(torch.tensor(cases, dtype=torch.int32)), cutlass.Int32(37),
           cutlass.Int32(len(cases)))
    assert scores[-1, 0] == 37, "thread 37 does not own row 37 of S"
    for (col0, lo, hi, edge), got in zip(cases, scores[:-1], strict=True):
        cols = torch.arange(128) + col0
        want = torch.where(((cols >= lo) & (cols < hi)) | (edge == 0), 0.0, float("-inf"))
        assert torch.equal(got, want), (col0, lo, hi, edge)


@needs_dsl
def test_tmem_partitions_map_thread_t_to_row_t_in_column_order():
    """The layout facts the kernel's per-thread code relies on, evaluated on the host: in the 32x32b TMEM loads of S
    (x32) and of an O chunk, and the P store (64 columns of 16-bit pairs), thread t holds row t and its registers
    run over the columns in order (so register i of S is key i, and P's pair c is keys 2c, 2c + 1)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass import Float32
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
    from cutlass.cute.nvgpu.tcgen05 import OperandSource
    from cutlass.cute.runtime import from_dlpack

    @cute.jit
    def coords(out, t):
        dt = cutlass.BFloat16
        one = tcgen05.CtaGroup.ONE
        qk = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32, one,
                                                (128, 128))
        pv = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32, one,
                                                (128, 128), OperandSource.TMEM)
        ptr = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
        qthr, pthr = qk.get_slice(0), pv.get_slice(0)
        tStS = cute.make_tensor(ptr, qthr.make_fragment_C(qthr.partition_shape_C((128, 128))).layout)
        tScS = qthr.partition_C(cute.make_identity_tensor((128, 128)))
        ld32 = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        st32 = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(32)), Float32)
        c_s = tcgen05.make_tmem_copy(ld32, tStS).get_slice(t).partition_D(tScS)
        sub = cute.make_layout((128, 64))
        tStP = cute.make_tensor(ptr, cute.composition(tStS.layout, sub))
        c_p = tcgen05.make_tmem_copy(st32, tStP).get_slice(t).partition_S(
            cute.make_tensor(tScS.iterator, cute.composition(tScS.layout, sub)))
        tOtO = cute.make_tensor(ptr, pthr.make_fragment_C(pthr.partition_shape_C((128, 128))).layout)
        tOcO = pthr.partition_C(cute.make_identity_tensor((128, 128)))
        sub32 = cute.make_layout((128, 32))
        c_o = tcgen05.make_tmem_copy(ld32, cute.make_tensor(ptr, cute.composition(tOtO.layout, sub32))).get_slice(
            t).partition_D(cute.make_tensor(tOcO.iterator, cute.composition(tOcO.layout, sub32)))
        for i in cutlass.range_constexpr(128):
            out[0, i, 0] = c_s[i][0]
            out[0, i, 1] = c_s[i][1]
        for i in cutlass.range_constexpr(64):
            out[1, i, 0] = c_p[i][0]
            out[1, i, 1] = c_p[i][1]
        for i in cutlass.range_constexpr(32):
            out[2, i, 0] = c_o[i][0]
            out[2, i, 1] = c_o[i][1]

    for t in (0, 31, 32, 77, 127):
        out = torch.full((3, 128, 2), -1, dtype=torch.int32)
        coords(from_dlpack(out), cutlass.Int32(t))
        for which, n in ((0, 128), (1, 64), (2, 32)):
            assert out[which, :n, 0].eq(t).all(), (t, which, out[which, :n, 0].tolist())
            assert out[which, :n, 1].tolist() == list(range(n)), (t, which, out[which, :n, 1].tolist())


# -------------------------------------------------------------------------------------------- scheduler


@given(lengths=st.lists(st.sampled_from([0, 0, 1, 5, 16, 17, 127, 128, 129, 300]), min_size=0, max_size=70),
       heads=st.integers(1, 4), tile_m=st.sampled_from([16, 128, 12, 192]), reverse_m=st.booleans())
def test_packed_scheduler_maps_indices_onto_the_real_tiles_once(lengths, heads, tile_m, reverse_m):
    cu_q = cu(lengths).tolist()
    bound = S.packed_grid_size(cu_q[-1], len(lengths), heads, tile_m)
    got = [S.packed_tile(cu_q, i, heads, tile_m, reverse_m) for i in range(bound + 3)]
    real = [t for t in got if t is not None]
    assert len(real) == len(set(real)), "a tile handed out twice"
    assert set(real) == S.real_tiles(cu_q, heads, tile_m)
    assert all(t is None for t in got[len(real):]), "a valid index after the first index past the end"


def test_packed_scheduler_order():
    cu_q = cu([300, 0, 129]).tolist()
    order = [S.packed_tile(cu_q, i, 2, 128) for i in range(10)]
    assert order[:6] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1)]  # heads fastest
    assert order[6:] == [(2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1)]  # the empty sequence has no tile
    assert [S.packed_tile(cu_q, i, 1, 128, reverse_m=True) for i in range(3)] == [(0, 2, 0), (0, 1, 0), (0, 0, 0)]


# ---------------------------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("sink", [None, 1.5])
def test_online_softmax_model_matches_one_pass_softmax(sink):
    g = torch.Generator().manual_seed(3)
    rows, tiles, n = 6, 5, 8
    s = torch.randn(rows, tiles * n, generator=g) * 4 + torch.linspace(0, 60, tiles * n)  # max keeps growing
    s[0] = float("-inf")  # a row that sees nothing
    s[1, : 2 * n] = float("-inf")  # a row whose first tiles are fully masked
    scale_log2 = 0.3 * SM.LOG2E
    model = SM.OnlineSoftmaxModel(rows, scale_log2, sink)
    acc = torch.zeros(rows, tiles * n, dtype=torch.float64)
    for j in range(tiles):
        p, a = model.step(s[:, j * n:(j + 1) * n])
        acc = acc * a.double()[:, None]
        acc[:, j * n:(j + 1) * n] = p.double()
    inv, lse = model.finalize()
    logits = s.double() * 0.3
    if sink is not None:
        logits = torch.cat([logits, torch.full((rows, 1), sink, dtype=torch.float64)], 1)
    want_lse = torch.logsumexp(logits, 1)
    want_p = torch.exp(logits - want_lse[:, None]).nan_to_num(0.0)[:, : tiles * n]
    torch.testing.assert_close(acc * inv.double()[:, None], want_p, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-6)
    if sink is None:
        assert lse[0] == -math.inf and inv[0] == 0
    assert model.rescales < (rows - 1) * (tiles - 1), "the threshold kept no old max"


@needs_dsl
@needs_host_bf16
@pytest.mark.parametrize("sink", [None, 2.5, -1.0])
def test_device_softmax_step_runs_on_the_host_like_the_model(sink):
    """The softmax warps' per-tile sequence (init_stats, tile_max, update_max, exp2_convert, finalize) traced as
    in the kernel and run on the host (portable=True: arith max, scalar FFMA/FADD and a division stand in for
    FMNMX, FFMA2/FADD2 and rcp.approx, which exist only on the GPU), against OnlineSoftmaxModel for one row: fully
    masked first tiles, a growing max, a masked tail."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.runtime import from_dlpack

    g = torch.Generator().manual_seed(11)
    tiles = 6
    s_rows = torch.randn(tiles, 128, generator=g) * 3 + torch.arange(tiles)[:, None] * 9.0
    s_rows[0] = float("-inf")
    s_rows[-1, 40:] = float("-inf")
    scale_log2 = 0.25 * SM.LOG2E

    @cute.jit
    def run(s_in, p_out, a_out, fin, n, scale):
        sink_log2 = None
        if cutlass.const_expr(sink is not None):
            sink_log2 = Float32(sink * SM.LOG2E)
        m, l = SM.init_stats(sink_log2)
        for j in cutlass.range(n):
            rs = cute.make_rmem_tensor(cute.make_layout(128), Float32)
            for i in cutlass.range_constexpr(128):
                rs[i] = s_in[j, i]
            m_new, m_safe, a = SM.update_max(m, SM.tile_max(rs, True), scale, True)
            rp = cute.make_rmem_tensor(cute.make_layout(128), cutlass.BFloat16)
            row_sum = SM.exp2_convert(rs, rp, scale, m_safe, portable=True)
            l = l * a + row_sum
            m = m_new
            a_out[j] = a
            for i in cutlass.range_constexpr(128):
                p_out[j, i] = rp[i].to(Float32)
        inv, lse = SM.finalize(m, l, True)
        fin[0] = inv
        fin[1] = lse

    p_dev, a_dev, fin = torch.zeros(tiles, 128), torch.zeros(tiles), torch.zeros(2)
    run(from_dlpack(s_rows), from_dlpack(p_dev), from_dlpack(a_dev), from_dlpack(fin), cutlass.Int32(tiles),
        Float32(scale_log2))
    model = SM.OnlineSoftmaxModel(1, scale_log2, sink)
    for j in range(tiles):
        p, a = model.step(s_rows[j:j + 1])
        torch.testing.assert_close(a_dev[j:j + 1], a, rtol=1e-5, atol=0, msg=f"rescale factor, tile {j}")
        torch.testing.assert_close(p_dev[j], p[0].bfloat16().float(), rtol=1e-2, atol=0, msg=f"P, tile {j}")
    inv, lse = model.finalize()
    torch.testing.assert_close(fin, torch.stack([inv[0], lse[0]]), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- the kernel's algorithm


@st.composite
def attention_cases(draw):
    n = draw(st.integers(1, 4))
    lq, lk = [], []
    for _ in range(n):
        sk = draw(st.sampled_from([0, 1, 7, 16, 23, 40]))
        lq.append(draw(st.sampled_from([sk, sk, 0, 1, min(sk, 5), sk + 3])))
        lk.append(sk)
    hq, hkv = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]))
    return dict(lq=lq, lk=lk, hq=hq, hkv=hkv, d=draw(st.sampled_from([8, 16])),
                dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])), causal=draw(st.booleans()),
                window=(draw(st.sampled_from([-1, -1, 0, 3, 9])), draw(st.sampled_from([-1, -1, 0, 4]))),
                sink=draw(st.booleans()), tiles=draw(st.sampled_from([(16, 16), (8, 16), (16, 8)])),
                seed=draw(st.integers(0, 2**16)))


def _run_emulated(c):
    g = torch.Generator().manual_seed(c["seed"])
    tq, tk = sum(c["lq"]), sum(c["lk"])
    q = torch.randn(tq, c["hq"], c["d"], generator=g).to(c["dtype"])
    k = torch.randn(tk, c["hkv"], c["d"], generator=g).to(c["dtype"])
    v = torch.randn(tk, c["hkv"], c["d"], generator=g).to(c["dtype"])
    sinks = torch.randn(c["hq"], generator=g) * 2 if c["sink"] else None
    scale = 1.0 / math.sqrt(c["d"])
    out, lse, stats = emulate(q, k, v, cu(c["lq"]), cu(c["lk"]), scale, c["causal"], c["window"], sinks, *c["tiles"])
    want_out, want_lse = attention_varlen(q, k, v, cu(c["lq"]), cu(c["lk"]), scale, c["causal"], c["window"], sinks)
    return out, lse, want_out, want_lse, stats


@given(case=attention_cases())
def test_emulated_kernel_matches_the_contract(case):
    out, lse, want_out, want_lse, _ = _run_emulated(case)
    assert_attention_close(out, lse, want_out, want_lse, str(case))


def test_emulated_kernel_full_tiles_and_rescale():
    """128 x 128 tiles (the kernel's), several key tiles per work item, edge tiles masked; FA4's threshold keeps
    the old max on most tiles after the first."""
    case = dict(lq=[300, 5], lk=[400, 260], hq=2, hkv=1, d=16, dtype=torch.bfloat16, causal=True, window=(200, -1),
                sink=True, tiles=(128, 128), seed=7)
    out, lse, want_out, want_lse, stats = _run_emulated(case)
    assert_attention_close(out, lse, want_out, want_lse, "128 x 128 tiles")
    assert stats["key_tiles"] > stats["work_items"] and stats["masked_tiles"] > 0
    assert stats["rescaled_rows"] < (stats["key_tiles"] - stats["work_items"]) * 128 // 2, stats


def test_config_rejects_what_the_kernel_does_not_build():
    with pytest.raises(ValueError, match="head_dim"):
        FmhaSm100Config("bf16", 96)
    with pytest.raises(ValueError, match=r"\(192, 128\) not in \(\(64, 64\), \(128, 128\)\)"):  # sm_90's MLA dims
        FmhaSm100Config("bf16", 192, 128)
    with pytest.raises(ValueError, match="dtype"):
        FmhaSm100Config("fp8", 128)
    with pytest.raises(ValueError, match="tcgen05"):
        FmhaSm100Config("bf16", 128, arch="sm_90a")


def test_entry_checks_reach_every_rule_on_cpu():
    from cute_ops.attention.fmha_sm100 import supports_attention_prefill

    def reason(q, k, v, scale=0.125, cu_dtype=torch.int32):
        c = torch.tensor([0, q.shape[0]], dtype=cu_dtype)
        return supports_attention_prefill(q, k, v, c, c.clone(), q.shape[0], k.shape[0], scale, True, -1, -1, None,
                                          True)

    q, k = torch.zeros(4, 4, 128, dtype=torch.bfloat16), torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert "the cute backend runs on CUDA tensors only" == reason(q, k, k)
    assert "bf16 or fp16" in reason(q.float(), k.float(), k.float())
    assert "q=96 k=96 v=96: needs k's = q's (Dqk)" in reason(q[..., :96], k[..., :96], k[..., :96])
    mla = torch.zeros(4, 4, 192, dtype=torch.bfloat16), torch.zeros(4, 2, 192, dtype=torch.bfloat16)
    assert "q=192 k=192 v=128: needs" in reason(*mla, k)  # the sm_90 kernel's (192, 128), not this one's
    assert "multiple" in reason(torch.zeros(4, 3, 128, dtype=torch.bfloat16), k, k)
    assert "TMA" in reason(q, k, torch.zeros(4, 2, 256, dtype=torch.bfloat16)[..., ::2])
    assert "row max" in reason(q, k, k, scale=-1.0)
    assert "int32" in reason(q, k, k, cu_dtype=torch.int64)


# ---------------------------------------------------------------------------------------- compile + SASS


@needs_dsl
@pytest.mark.parametrize("dtype,d,extra", [
    ("bf16", 128, dict(causal=True, has_window_left=True, has_sink=True)),
    ("fp16", 64, dict(has_window_left=True, has_window_right=True)),
])
def test_sm100_sass_has_the_tcgen05_pipeline(dtype, d, extra):
    """tcgen05.mma kind::f16 is UTCHMMA in the SASS (also with A = P from TMEM); record of the numbers in
    cute_ops/attention/__init__.py."""
    from cute_ops.attention.fmha_sm100 import dump

    d_ = dump(FmhaSm100Config(dtype, d, **extra))
    ops = d_.opcodes()
    assert "sm_100a" in d_.ptx.split(".target", 1)[1][:40]
    # S = Q K^T: D/16 MMAs at two call sites (first tile, next tiles); O += P V: 128 keys / 16
    assert d_.count("UTCHMMA") == 2 * d // 16 + 128 // 16, ops
    assert "tcgen05.mma.cta_group::1.kind::f16" in d_.ptx
    assert any(line.strip().startswith("UTCHMMA tmem[") or " UTCHMMA tmem[" in line for line in d_.sass.splitlines()), \
        "no UTCHMMA reads its A operand (P) from TMEM"
    # S: 4 x 32 columns; rescale and epilogue: D / 32 each. P: 64 columns in 2 stores; rescale: D / 32
    assert d_.count("LDTM") == 4 + 2 * d // 32, ops
    assert d_.count("STTM") == 2 + d // 32, ops
    assert "tcgen05.ld.sync.aligned.32x32b.x32" in d_.ptx and "tcgen05.st.sync.aligned.32x32b.x32" in d_.ptx
    assert d_.count("UTCBAR") >= 5, ops  # commits: S full, PV done, P/K/V/Q consumed
    assert d_.count("UTMALDG") == 3 * d // 64, ops  # Q, K, V boxes of 64 columns (128-byte swizzle)
    assert d_.count("USETMAXREG") >= 3, ops
    assert d_.count("MUFU.EX2") >= 128 and d_.count("FFMA2") >= 64, ops  # exp2 of 128 scores per row and tile
    assert d_.count("F2FP") >= 64, ops  # P to 16-bit pairs
    assert d_.count("STG.E.128") == 2 * d * 2 // 16, ops  # out (and the zero path): 16-byte stores
    assert d_.count("VOTE.ANY") >= 1, ops  # conditional O rescale
    # no local memory at all (the softmax once spilled ~800 times per tile at the launch's 168 registers)
    assert d_.count("STL") == 0 and d_.count("LDL") == 0, ops


@needs_dsl
def test_compile_cache_round_trip(tmp_path, monkeypatch):
    """`compiled` goes through lowbit's cache (TVM-FFI object on disk, keyed on this package's sources too)."""
    from cute_ops import _compile
    from cute_ops.attention.fmha_sm100 import compiled

    monkeypatch.setenv("LOWBIT_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOWBIT_CUTE_DISK_CACHE", "1")
    cfg = FmhaSm100Config("bf16", 64, causal=True)
    before = (_compile.STATS.compiles, _compile.STATS.disk_loads)
    compiled(cfg)
    assert _compile.object_path(cfg.key()).is_file() and _compile.STATS.compiles == before[0] + 1
    _compile.clear_memory()
    compiled(cfg)
    assert (_compile.STATS.compiles, _compile.STATS.disk_loads) == (before[0] + 1, before[1] + 1)


def test_prepared_launcher_passes_the_shared_argument_list(monkeypatch):
    """launch.prepared (the cute prefill rows' per-signature launcher): scale and plain arguments resolved once,
    fresh out / lse per call (out with v's head dim), the kernels' argument order (module docstring of launch.py); on
    another current device the general entry runs."""
    from cute_ops.attention import launch

    calls, general = [], []
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: None, raising=False)  # q's device (CPU: index None)
    q, k, v = torch.randn(5, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 32)  # Dv != Dqk
    cu_q, cu_k, sinks = cu([2, 3]), cu([3, 4]), torch.randn(4)
    assert not launch.preparable(q, cu_q, cu_k, sinks)  # CPU tensors have no device index: the general entry
    assert not launch.preparable(q, cu_q, cu_k, sinks.double())
    fn = launch.prepared(lambda *a: calls.append(a), lambda *a: general.append(a) or "general", q, v, None, 128, 0)
    args = (q, k, v, cu_q, cu_k, 3, 4, None, True, 128, 0, sinks, True)
    out, lse = fn(*args)
    got = calls[-1]
    assert got[:3] == (q, k, v) and got[3] is out and got[4] is lse and got[5] is cu_q and got[6] is cu_k
    assert got[7] is sinks and got[8:] == (0.125, 128, 0)
    assert out.shape == (5, 4, 32) and out.dtype == q.dtype and lse.shape == (5, 4) and lse.dtype == torch.float32
    assert fn(*args)[0].data_ptr() != out.data_ptr()  # fresh outputs each call
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    fn = launch.prepared(lambda *a: calls.append(a), lambda *a: general.append(a) or "general", q, v, None, 128, 0)
    assert fn(*args) == "general" and general[-1] == args
