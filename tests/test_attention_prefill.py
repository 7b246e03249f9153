"""Varlen prefill attention (Triton) against dispatch/reference/attention.py: drawn varlen batches (lengths 0 and
1, sq < sk and sq == sk, GQA ratios 1/2/4, causal, windows, sinks, bf16/fp16, strided q/k/v views, tile sizes),
pinned head dims (192, 128) and 256, paged prefixes (pages of 16 and 64 through permuted tables, 16-bit and FP8
E4M3 caches), rows that see no key (with and without a sink), empty batches, out-of-range pages and cu_seqlens,
argument errors; a compile-only sm_90 check that the kernel uses the tensor cores; on a GPU, larger cases."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch.reference.attention import attention_varlen, gather_paged
from tests.helpers import assert_attention_close, run_compile_script
from triton_ops.attention.prefill import (
    PrefillConfig,
    _prefill_config,
    attention_prefill,
    attention_prefill_paged,
    prefill_config,
    supports_attention_prefill,
    supports_attention_prefill_paged,
)
from triton_ops.contract.checks import LowbitInputError


def cu(lengths, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)


def make_qkv(lq, lk, hq, hkv, dqk, dv, dtype, seed, layout="contiguous", device="cpu"):
    """q (sum lq, hq, dqk), k (sum lk, hkv, dqk), v (sum lk, hkv, dv). layout "fused": views into one row buffer
    per token (q | k | v heads side by side, as a fused QKV projection writes them; needs lq == lk)."""
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    if layout == "fused":
        assert dqk == dv and tq == tk
        buf = torch.randn(tq, hq + 2 * hkv, dqk, generator=g).to(dtype).to(device)
        return buf[:, :hq], buf[:, hq:hq + hkv], buf[:, hq + hkv:]
    q = torch.randn(tq, hq, dqk, generator=g).to(dtype).to(device)
    k = torch.randn(tk, hkv, dqk, generator=g).to(dtype).to(device)
    v = torch.randn(tk, hkv, dv, generator=g).to(dtype).to(device)
    return q, k, v


def run_dense(lq, lk, hq=2, hkv=1, dqk=64, dv=64, dtype=torch.bfloat16, causal=False, window=(-1, -1),
              sinks=None, seed=0, layout="contiguous", cfg=None, device="cpu"):
    q, k, v = make_qkv(lq, lk, hq, hkv, dqk, dv, dtype, seed, layout, device)
    cq, ck = cu(lq, device), cu(lk, device)
    scale = 1.0 / math.sqrt(dqk)
    out, lse = attention_prefill(q, k, v, cq, ck, max(lq, default=0), max(lk, default=0), scale, causal,
                                 window[0], window[1], sinks, True, cfg=cfg)
    want = attention_varlen(q.cpu(), k.cpu(), v.cpu(), cq.cpu(), ck.cpu(), scale, causal, window,
                            None if sinks is None else sinks.cpu())
    return out, lse, want


# ------------------------------------------------------------------------------------------- drawn cases


@st.composite
def prefill_cases(draw):
    n = draw(st.integers(1, 4))
    lq, lk = [], []
    for _ in range(n):
        sk = draw(st.sampled_from([0, 1, 2, 5, 9, 17, 24, 40]))
        sq = draw(st.sampled_from([sk, sk, 0, 1, min(sk, 3)]))  # sk = 0 with a query: a row with no key
        lq.append(sq)
        lk.append(sk)
    while sum(lk) > 48:  # the interpreter's cost: keep the batch small
        lk[-1] = lq[-1] = 0
        lq.append(lq.pop(0))
        lk.append(lk.pop(0))
    hq, hkv = draw(st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (8, 2)]))
    d = draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16]))
    causal = draw(st.booleans())
    window = (draw(st.sampled_from([-1, -1, 0, 1, 4])), draw(st.sampled_from([-1, -1, 0, 2])))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(len(lq))) * 2 if draw(st.booleans()) else None
    layout = "fused" if lq == lk and draw(st.booleans()) else "contiguous"
    bm, bn = draw(st.sampled_from([(16, 16), (16, 16), (32, 16), (16, 32)]))
    cfg = PrefillConfig(block_m=bm, block_n=bn, num_warps=4, num_stages=1)
    seed = draw(st.integers(0, 2**31 - 1))
    desc = f"lq={lq} lk={lk} hq={hq} hkv={hkv} d={d} {dtype} causal={causal} window={window} " \
           f"sinks={sinks is not None} {layout} {cfg}"
    return dict(lq=lq, lk=lk, hq=hq, hkv=hkv, dqk=d, dv=d, dtype=dtype, causal=causal, window=window, sinks=sinks,
                layout=layout, cfg=cfg, seed=seed), desc


@given(case=prefill_cases())
def test_prefill_matches_reference(case):
    kwargs, desc = case
    out, lse, (want_out, want_lse) = run_dense(**kwargs)
    assert_attention_close(out, lse, want_out, want_lse, desc)


# ------------------------------------------------------------------------------------------- pinned dense


@pytest.mark.parametrize("dqk,dv,causal,window", [(192, 128, True, (-1, -1)), (192, 128, False, (5, 3)),
                                                  (256, 256, True, (6, -1))])
def test_wide_and_uneven_head_dims(dqk, dv, causal, window):
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse, (want_out, want_lse) = run_dense([5, 20], [9, 20], hq=4, hkv=2, dqk=dqk, dv=dv, causal=causal,
                                               window=window, sinks=sinks)
    assert_attention_close(out, lse, want_out, want_lse, f"dqk={dqk} dv={dv}")


@pytest.mark.parametrize("causal,window", [(False, (8, -1)), (True, (8, -1)), (False, (3, 2))])
def test_skipped_key_tiles_are_never_read(causal, window):
    # queries at key positions 48..63 with a left window of <= 8 need no key below 40: the tiles [0, 32) are
    # skipped by the loop bounds, so NaN there (which would poison the sums through 0 * NaN) must not show
    q, k, v = make_qkv([16], [64], 2, 1, 64, 64, torch.float16, 5)
    cq, ck = cu([16]), cu([64])
    want_out, want_lse = attention_varlen(q, k, v, cq, ck, 0.125, causal, window)
    k[:32], v[:32] = float("nan"), float("nan")
    cfg = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    out, lse = attention_prefill(q, k, v, cq, ck, 16, 64, 0.125, causal, window[0], window[1], None, True, cfg=cfg)
    assert_attention_close(out, lse, want_out, want_lse, f"causal={causal} window={window}")


def test_fp32_and_default_config():
    # the default interpreter tiles, fp32 throughout (IEEE dot on the GPU)
    out, lse, (want_out, want_lse) = run_dense([3, 33], [7, 40], hq=4, hkv=1, dtype=torch.float32, causal=True)
    assert_attention_close(out, lse, want_out, want_lse, "fp32")
    # softmax_scale None: 1/sqrt(Dqk), as the reference
    q, k, v = make_qkv([5], [9], 2, 2, 128, 128, torch.float32, 3)
    cq, ck = cu([5]), cu([9])
    out, lse = attention_prefill(q, k, v, cq, ck, 5, 9, None, False, -1, -1, None, True)
    assert_attention_close(out, lse, *attention_varlen(q, k, v, cq, ck), "default scale")


def test_more_queries_than_keys():
    # bottom-right alignment with sq > sk: the first sq - sk rows see no key under causal
    out, lse, (want_out, want_lse) = run_dense([10], [4], causal=True, dtype=torch.float16)
    assert torch.isneginf(lse[:6]).all() and (out[:6] == 0).all()
    assert_attention_close(out, lse, want_out, want_lse, "sq > sk")


@pytest.mark.parametrize("with_sink", [False, True])
def test_rows_without_visible_keys(with_sink):
    # window (0, 0) with keys only past the queries' positions: sq > sk puts rows at negative positions
    sinks = torch.tensor([1.5, -0.25]) if with_sink else None
    out, lse, (want_out, want_lse) = run_dense([6], [3], window=(0, 0), sinks=sinks, dtype=torch.float16)
    assert (out[:3] == 0).all()
    if with_sink:
        torch.testing.assert_close(lse[:3], sinks.expand(3, 2), rtol=1e-6, atol=1e-6)
    else:
        assert torch.isneginf(lse[:3]).all()
    assert_attention_close(out, lse, want_out, want_lse, f"no visible key, sink={with_sink}")


@pytest.mark.parametrize("with_sink", [False, True])
def test_sequence_without_keys(with_sink):
    sinks = torch.tensor([0.75, -2.0]) if with_sink else None
    out, lse, (want_out, want_lse) = run_dense([2, 3], [0, 4], sinks=sinks, causal=True)
    assert (out[:2] == 0).all()
    assert_attention_close(out, lse, want_out, want_lse, f"sk = 0, sink={with_sink}")


@pytest.mark.parametrize("batch", [0, 3])
def test_empty_batch(batch):
    q, k, v = make_qkv([0], [0], 2, 1, 64, 64, torch.bfloat16, 0)
    cq = torch.zeros(batch + 1, dtype=torch.int32)
    out, lse = attention_prefill(q, k, v, cq, cq, 0, 0, 0.125, True, -1, -1, None, True)
    assert out.shape == (0, 2, 64) and lse.shape == (0, 2)


def test_bad_cu_seqlens_stay_in_bounds():
    # non-monotonic and too-large offsets are clamped to the tensors in the kernel, so nothing faults: sequence 1
    # (rows 4..1000 -> 4..7, keys 4..-7 -> none) sees no key, 2 and 3 own no rows; sequence 0 is unaffected
    q, k, v = make_qkv([8], [8], 2, 1, 64, 64, torch.float16, 1)
    cq = torch.tensor([0, 4, 1000, 2, 2], dtype=torch.int32)
    ck = torch.tensor([0, 4, -7, 99999, 5], dtype=torch.int32)
    out, lse = attention_prefill(q, k, v, cq, ck, 1000, 99999, 0.125, False, -1, -1, None, True)
    want_out, want_lse = attention_varlen(q[:4], k[:4], v[:4], cq[:2], ck[:2], 0.125)
    assert_attention_close(out[:4], lse[:4], want_out, want_lse, "first sequence")
    assert (out[4:] == 0).all() and torch.isneginf(lse[4:]).all()


def test_argument_errors():
    q, k, v = make_qkv([4], [4], 3, 2, 64, 64, torch.bfloat16, 0)
    cq = cu([4])
    with pytest.raises(LowbitInputError, match=r"lowbit.attention_prefill: argument 'k'.*divide"):
        attention_prefill(q, k, v, cq, cq, 4, 4, 0.1, False, -1, -1, None, True)
    q, k, v = make_qkv([4], [4], 2, 2, 64, 64, torch.bfloat16, 0)
    with pytest.raises(LowbitInputError, match=r"argument 'q'.*contiguous"):
        attention_prefill(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cq, cq, 4, 4, 0.1, False, -1, -1,
                          None, True)
    with pytest.raises(LowbitInputError, match=r"argument 'cu_seqlens_k'"):
        attention_prefill(q, k, v, cq, cq.long(), 4, 4, 0.1, False, -1, -1, None, True)
    with pytest.raises(LowbitInputError, match=r"argument 'window_left'"):
        attention_prefill(q, k, v, cq, cq, 4, 4, 0.1, False, -2, -1, None, True)
    with pytest.raises(LowbitInputError, match=r"argument 'sinks'"):
        attention_prefill(q, k, v, cq, cq, 4, 4, 0.1, False, -1, -1, torch.zeros(3), True)
    with pytest.raises(LowbitInputError, match=r"lowbit.attention_prefill_paged: argument 'v_scale'"):
        attention_prefill_paged(q, k[None], v[None], cq, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([4], dtype=torch.int32), 4, 0.1, False, -1, -1, None,
                                torch.ones(1), None)
    assert supports_attention_prefill(q, k, v, cq, cq, 4, 4, 0.1, False, -1, -1, None, True) is None
    wide = torch.empty(4, 2, 320, dtype=torch.bfloat16)
    assert "320" in supports_attention_prefill(wide, wide, wide, cq, cq, 4, 4, 0.1, False, -1, -1, None, True)
    many = torch.zeros(70000, dtype=torch.int32)
    assert "65535" in supports_attention_prefill(q, k, v, many, many, 4, 4, 0.1, False, -1, -1, None, True)
    assert "cache dtype" in supports_attention_prefill_paged(q, k[None].half(), v[None].half(), cq, None, None, 4,
                                                             0.1, False, -1, -1, None, None, None)


def test_config_rule():
    assert prefill_config(128, 128, torch.bfloat16, 4096, torch.device("cpu")) == PrefillConfig(16, 16, 4, 1)
    assert _prefill_config(128, 128, torch.bfloat16, 4096, "sm_90") == PrefillConfig(128, 64, 8, 3)
    assert _prefill_config(64, 64, torch.bfloat16, 4096, "sm_90") == PrefillConfig(128, 128, 8, 3)
    assert _prefill_config(192, 128, torch.bfloat16, 4096, "sm_90") == PrefillConfig(64, 64, 4, 2)
    assert _prefill_config(128, 128, torch.bfloat16, 32, "sm_80") == PrefillConfig(64, 64, 4, 2)


# ------------------------------------------------------------------------------------------- paged


def make_paged(lq, lk, hq, hkv, d, page, dtype, kv_kind, seed, device="cpu"):
    """(q, k_cache, v_cache, cu_q, block_table, seqused_k, k_scale, v_scale, dense k, dense v, cu_k): a cache
    with twice the pages needed, sequences scattered through a permuted block table."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [max(1, -(-n // page)) for n in lk]
    num_blocks = 2 * sum(per_seq)
    q = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
    kc = torch.randn(num_blocks, page, hkv, d, generator=g)
    vc = torch.randn(num_blocks, page, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lk), max(per_seq), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    ks = vs = None
    if kv_kind == "16bit":
        kc, vc = kc.to(dtype), vc.to(dtype)
        kd, vd = kc, vc
    else:  # E4M3 codes (as float8_e4m3fn or raw bytes), value = code * scale
        ks, vs = torch.tensor([0.05]), torch.tensor([0.2])
        kc, vc = (kc * 4).to(torch.float8_e4m3fn), (vc * 2).to(torch.float8_e4m3fn)
        kd, vd = kc.float() * ks, vc.float() * vs
        if kv_kind == "u8":
            kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    seqused = torch.tensor(lk, dtype=torch.int32)
    k_dense, cu_k = gather_paged(kd, table, seqused)
    v_dense, _ = gather_paged(vd, table, seqused)
    dev = [t if t is None else t.to(device) for t in (q, kc, vc, cu(lq), table, seqused, ks, vs)]
    return (*dev, k_dense, v_dense, cu_k)


@pytest.mark.parametrize("page,kv_kind,causal,window,sink", [
    (16, "16bit", True, (-1, -1), False),
    (64, "16bit", True, (7, -1), True),
    (16, "fp8", True, (-1, -1), True),
    (64, "u8", False, (-1, 3), False),
])
def test_paged_matches_reference(page, kv_kind, causal, window, sink):
    lq, lk = [3, 0, 16, 1], [40, 5, 16, 70]  # chunked prefill: each sequence's queries are its last keys
    q, kc, vc, cq, table, used, ks, vs, kd, vd, ck = make_paged(lq, lk, 4, 2, 64, page, torch.bfloat16, kv_kind, 7)
    sinks = torch.tensor([0.0, 1.0, -1.0, 3.0]) if sink else None
    out, lse = attention_prefill_paged(q, kc, vc, cq, table, used, max(lq), 0.125, causal, window[0], window[1],
                                       sinks, ks, vs)
    want_out, want_lse = attention_varlen(q, kd, vd, cq, ck, 0.125, causal, window, sinks)
    assert_attention_close(out, lse, want_out, want_lse, f"page={page} {kv_kind}")


def test_paged_out_of_range_page_reads_as_masked():
    # sequence 0's second page id is past the cache and sequence 1's first is -1: those keys are masked. Without
    # causal / window the key positions do not matter, so the answer is the reference over the remaining keys.
    lq, lk = [4, 3], [48, 20]
    q, kc, vc, cq, table, used, _, _, kd, vd, _ = make_paged(lq, lk, 2, 1, 64, 16, torch.float16, "16bit", 3)
    table[0, 1] = kc.shape[0] + 5
    table[1, 0] = -1
    keep = torch.ones(sum(lk), dtype=torch.bool)
    keep[16:32] = False  # sequence 0, page 1
    keep[48:64] = False  # sequence 1, page 0
    out, lse = attention_prefill_paged(q, kc, vc, cq, table, used, 4, 0.125, False, -1, -1, None, None, None)
    want_out, want_lse = attention_varlen(q, kd[keep], vd[keep], cq, cu([32, 4]), 0.125)
    assert_attention_close(out, lse, want_out, want_lse, "out-of-range pages")
    # a seqused_k past the table's width reads the missing columns as masked keys too
    used[1] = 1000
    out, lse = attention_prefill_paged(q, kc, vc, cq, table, used, 4, 0.125, False, -1, -1, None, None, None)
    assert_attention_close(out[:4], lse[:4], want_out[:4], want_lse[:4], "seqused past the table")


def test_paged_seqused_past_capacity_keeps_query_positions():
    """seqused_k past the table's capacity (48 keys): the queries sit at seqused_k - Sq + s (docs/attention.md), the
    keys past the capacity are masked. Causal + window (4, 0) makes the positions matter: the kernel and the
    reference agree, and differ from the answer with the length clamped to the capacity."""
    from dispatch.reference.attention import attention_prefill_paged as reference_paged

    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged([3, 2], [48, 20], 2, 1, 64, 16, torch.bfloat16, "16bit",
                                                         5)
    args = lambda n: (q, kc, vc, cq, table, torch.tensor([n, 20], dtype=torch.int32), 3, 0.125, True, 4, 0, None,
                      None, None)
    out, lse = attention_prefill_paged(*args(50))
    want = reference_paged(*args(50))
    assert_attention_close(out, lse, *want, "seqused_k past the capacity")
    clamped = reference_paged(*args(48))
    assert not torch.allclose(want[0][:3].float(), clamped[0][:3].float(), atol=0.05)


# ------------------------------------------------------------------------------------------- compile-only


_COMPILE = textwrap.dedent("""
    import os
    os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernel, not the interpreter's stand-in
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton_ops.attention import prefill as P
    TY = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
          torch.uint8: "*u8"}
    CASES = ((64, 64, torch.bfloat16, False), (128, 128, torch.bfloat16, False), (192, 128, torch.bfloat16, True),
             (256, 256, torch.float16, False), (128, 128, torch.float32, False))
    for dqk, dv, dt, paged in CASES:
        hq, hkv = 8, 2
        q, out, lse = torch.empty(4, hq, dqk, dtype=dt), torch.empty(4, hq, dv, dtype=dt), torch.empty(4, hq)
        cu = torch.zeros(2, dtype=torch.int32)
        if paged:  # FP8 pages
            k = torch.empty(4, 64, hkv, dqk, dtype=torch.float8_e4m3fn)
            v = torch.empty(4, 64, hkv, dv, dtype=torch.float8_e4m3fn)
            bt, used, sc = torch.zeros(1, 4, dtype=torch.int32), cu[:1], torch.ones(1)
        else:
            k, v, bt, used, sc = torch.empty(4, hkv, dqk, dtype=dt), torch.empty(4, hkv, dv, dtype=dt), None, None, None
        cfg = P._prefill_config(dqk, dv, dt, 4096, "sm_90")
        args, consts = P._launch_args(q, k, v, out, lse, torch.zeros(hq), cu, cu, bt, used, sc, sc, 0.1, True, -1, -1,
                                      cfg, False, False)
        kern = P._attn_prefill_kernel
        names = [p.name for p in kern.params]
        values = dict(zip([p.name for p in kern.params if not p.is_constexpr], args, strict=True))
        sig = {n: TY[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
               for n, a in values.items()}
        sig.update(dict.fromkeys(consts, "constexpr"))
        # what a launch tells the compiler: 16-byte aligned pointers, integers that are multiples of 16 (without
        # it no load is wide enough to become an async copy, and nothing is pipelined)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, a in values.items()
                 if isinstance(a, torch.Tensor) or (isinstance(a, int) and a % 16 == 0)}
        c = triton.compile(triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True))
        ptx, ttgir = c.asm["ptx"], c.asm["ttgir"]
        print(dqk, dv, str(dt)[6:], paged, ptx.count("wgmma.mma_async"), ttgir.count("async_copy_global_to_local"),
              c.metadata.shared, ptx.count("ex2.approx"))
""")
SM90_SHARED = 232448  # bytes of shared memory one CTA may use on an H100


@pytest.mark.slow  # sm_90 SASS properties of a kernel the GPU suite runs: the slow run
def test_sm90_compile_uses_tensor_cores():
    """Compile for sm_90 without a GPU (a fresh process: the interpreter's kernels cannot be compiled) and check
    each config: 16-bit matmuls on wgmma, K/V loads pipelined as async copies, shared memory within the SM's,
    exponentials on ex2. (fp32 runs IEEE FMA dots: no wgmma.)"""
    stdout = run_compile_script(_COMPILE, 240)
    lines = [line.split() for line in stdout.splitlines() if line]
    assert len(lines) == 5, stdout
    for dqk, dv, dtype, paged, wgmma, async_copies, shared, ex2 in lines:
        what = f"dqk={dqk} dv={dv} {dtype} paged={paged}"
        assert dtype == "float32" or int(wgmma) > 0, f"{what}: no wgmma"
        assert paged == "True" or int(async_copies) > 0, f"{what}: K/V loads not pipelined"
        assert int(shared) <= SM90_SHARED, f"{what}: {shared} bytes of shared memory"
        assert int(ex2) > 0, what


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dqk,dv,dtype,causal,window,sink", [
    (128, 128, torch.bfloat16, True, (-1, -1), False),
    (64, 64, torch.float16, False, (-1, -1), True),
    (192, 128, torch.bfloat16, True, (255, -1), False),
    (256, 256, torch.bfloat16, False, (100, 50), True),
    (128, 128, torch.float32, True, (-1, -1), False),
])
def test_gpu_large_matches_reference(dqk, dv, dtype, causal, window, sink):
    lq, lk = [1, 700, 0, 1500, 333], [1, 900, 17, 1500, 2000]
    sinks = torch.randn(8, device="cuda") if sink else None
    out, lse, (want_out, want_lse) = run_dense(lq, lk, hq=8, hkv=2, dqk=dqk, dv=dv, dtype=dtype, causal=causal,
                                               window=window, sinks=sinks, device="cuda")
    assert_attention_close(out, lse, want_out, want_lse, f"gpu dqk={dqk} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("page,kv_kind", [(16, "16bit"), (64, "fp8"), (64, "u8")])
def test_gpu_paged_matches_reference(page, kv_kind):
    lq, lk = [300, 1, 128], [1000, 77, 128]
    q, kc, vc, cq, table, used, ks, vs, kd, vd, ck = make_paged(lq, lk, 8, 1, 128, page, torch.bfloat16, kv_kind,
                                                                 5, device="cuda")
    out, lse = attention_prefill_paged(q, kc, vc, cq, table, used, max(lq), 0.088, True, -1, -1, None, ks, vs)
    want_out, want_lse = attention_varlen(q.cpu(), kd, vd, cq.cpu(), ck, 0.088, True)
    assert_attention_close(out, lse, want_out, want_lse, f"gpu paged {page} {kv_kind}")
