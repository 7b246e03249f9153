"""Gathered paged-prefix prefill: the page gather (triton_ops/attention/paged_gather.py) bit for bit against a torch
gather through the block table (16-bit caches copied, FP8 E4M3 dequantized and rounded once), its flags for
out-of-range page ids and seqused_k past the table (those rows zero, never read), the zero rows after the last key,
the window's left-out keys, the plain kernel's flagged-only fixup, a compile-only sm_90 check of 16-byte accesses;
the composition (dispatch/composed/paged_prefill.py: gather, contiguous forward, fixup) with the plain contiguous
Triton forward on the interpreter
(pinned and drawn batches); on a GPU, the sm_90 cute row (gather + CuTeDSL forward + fixup) against the shared
reference, and under CUDA-graph replay with new seqused_k."""

from __future__ import annotations

import textwrap

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_ops import unavailable_reason
from dispatch.composed.paged_prefill import gathered_prefill_paged, prepare_gathered_prefill_paged
from dispatch.reference.attention import attention_prefill_paged as ref_paged
from tests.helpers import assert_attention_close, run_compile_script
from tests.test_attention_prefill import make_paged
from triton_ops.attention.paged_gather import PAD_ROWS, gather_paged_kv, gather_reason
from triton_ops.attention.prefill import attention_prefill, attention_prefill_paged, attention_prefill_paged_flagged

# the GPU tests that force the gathered cute row (a GPU without nvidia-cutlass-dsl skips them, as the cute tests do)
needs_dsl = pytest.mark.skipif(unavailable_reason() is not None, reason=f"cute backend: {unavailable_reason()}")


def torch_gather(cache, table, used, scale, dtype):
    """Per sequence, rows 0..min(used, cap)-1 read through the table (bad page ids: zero rows), as `dtype`."""
    page = cache.shape[1]
    cap = table.shape[1] * page
    rows = []
    for b, n in enumerate(used.tolist()):
        n = max(0, min(n, cap))
        pos = torch.arange(n)
        ids = table[b, pos // page].long()
        ok = (ids >= 0) & (ids < cache.shape[0])
        x = cache[ids.clamp(0, cache.shape[0] - 1), pos % page]
        if cache.dtype in (torch.float8_e4m3fn, torch.uint8):
            x = x.view(torch.float8_e4m3fn).float() * scale  # fp32 product, rounded once (RNE) below
        x = x.to(dtype)
        rows.append(torch.where(ok.view(-1, 1, 1), x, torch.zeros_like(x)))
    return torch.cat(rows) if rows else cache.new_zeros(0, *cache.shape[2:]).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def run_gather(kc, vc, table, used, ks, vs, dtype):
    k, v, cu_k, flags, cap = gather_paged_kv(kc, vc, table, used, ks, vs, dtype)
    n = used.clamp(0, cap)
    assert cap == table.shape[1] * kc.shape[1]
    assert cu_k.tolist() == [0, *n.cumsum(0).tolist()]
    total = int(cu_k[-1])
    assert k.shape[0] == v.shape[0] == table.numel() * kc.shape[1] + PAD_ROWS
    # zeros after the last key (a consumer's last tile reads them; the outputs start as NaN: conftest's poison)
    assert not k[total:total + PAD_ROWS].any() and not v[total:total + PAD_ROWS].any()
    return k[:total], v[:total], flags


@pytest.mark.parametrize("page,kv_kind,dtype", [
    (16, "16bit", torch.bfloat16),
    (64, "16bit", torch.float16),
    (16, "fp8", torch.bfloat16),
    (16, "u8", torch.float16),
])
def test_gather_bit_exact(page, kv_kind, dtype):
    # E4M3 under the interpreter: the kernel decodes codes arithmetically (EMULATE; the interpreter's own E4M3 cast
    # reads 0x7F as 480) and rounds with integer RNE (its fp32 -> bf16 cast truncates), so the comparison is exact;
    # the builder clamps to +-448 before casting to E4M3 (torch turns larger values into NaN codes).
    lk = [40, 0, 16, 70, 1]
    q, kc, vc, cq, table, used, ks, vs, _, _, _ = make_paged([1] * len(lk), lk, 2, 2, 32, page, dtype, kv_kind, 11)
    k, v, flags = run_gather(kc, vc, table, used, ks, vs, dtype)
    want_k = torch_gather(kc, table, used, ks, dtype)
    want_v = torch_gather(vc, table, used, vs, dtype)
    assert torch.equal(bits(k), bits(want_k))
    assert torch.equal(bits(v), bits(want_v))
    assert flags.tolist() == [0] * len(lk)


def test_gather_hkv_one_dv_differs_and_wide_rows():
    # MQA, Dv != Dqk, and a row of Hkv * D > the column chunk (several chunks per row)
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(9, 16, 3, 256, generator=g).to(torch.bfloat16)
    vc = torch.randn(9, 16, 3, 128, generator=g).to(torch.bfloat16)
    table = torch.tensor([[4, 0, 7], [2, 8, 1]], dtype=torch.int32)
    used = torch.tensor([35, 48], dtype=torch.int32)
    k, v, flags = run_gather(kc, vc, table, used, None, None, torch.bfloat16)
    assert torch.equal(bits(k), bits(torch_gather(kc, table, used, None, torch.bfloat16)))
    assert torch.equal(bits(v), bits(torch_gather(vc, table, used, None, torch.bfloat16)))
    assert flags.tolist() == [0, 0]


def test_gather_bad_pages_masked_and_flagged():
    lk = [48, 20, 30, 5]
    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged([1] * 4, lk, 2, 1, 32, 16, torch.float16, "16bit", 3)
    table[0, 1] = kc.shape[0] + 5  # past the cache
    table[1, 0] = -1  # negative
    table[2, 1] = 2**31 - 1  # far past: an unmasked read would fault
    used[3] = 1000  # past the table's width (3 pages of 16): clamped to 48 rows, flagged
    k, v, flags = run_gather(kc, vc, table, used, None, None, torch.float16)
    assert torch.equal(bits(k), bits(torch_gather(kc, table, used, None, torch.float16)))
    assert torch.equal(bits(v), bits(torch_gather(vc, table, used, None, torch.float16)))
    assert flags.tolist() == [1, 1, 1, 1]
    assert not k[16:32].any() and not k[48:64].any()  # the bad pages' rows are zeros
    # a bad id past a sequence's used keys is never read, so it flags nothing
    table[:] = 0
    table[0, 2] = -7
    used = torch.tensor([32, 1, 0, 0], dtype=torch.int32)
    _, _, flags = run_gather(kc, vc, table, used, None, None, torch.float16)
    assert flags.tolist() == [0, 0, 0, 0]


def test_gather_window_leaves_out_unseen_keys():
    # window_left 5: sequence b keeps key positions from n - Sq - 5 (>= 0) on; a bad page id before that is not read
    lq, lk = [3, 0, 16, 1, 9], [40, 5, 16, 70, 12]
    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged(lq, lk, 2, 2, 32, 16, torch.bfloat16, "16bit", 4)
    table[3, 1] = -1  # positions 16..31 of sequence 3: before its first kept key 64
    k, v, cu_k, flags, cap = gather_paged_kv(kc, vc, table, used, None, None, torch.bfloat16, cq, 5)
    start = [max(0, n - s - 5) for n, s in zip(lk, lq, strict=True)]
    assert cu_k.tolist() == [0, *torch.tensor([n - a for n, a in zip(lk, start, strict=True)]).cumsum(0).tolist()]
    full = torch_gather(kc, table, used, None, torch.bfloat16)
    full_cu = [0, *torch.tensor(lk).cumsum(0).tolist()]
    want = torch.cat([full[full_cu[b] + start[b]:full_cu[b + 1]] for b in range(len(lk))])
    assert torch.equal(bits(k[:int(cu_k[-1])]), bits(want))
    assert flags.tolist() == [0] * len(lk)


@pytest.mark.parametrize("page,kv_kind,causal,window,sink,bad", [
    (16, "16bit", True, (-1, -1), False, False),
    (16, "16bit", True, (7, -1), True, True),
    (64, "fp8", True, (-1, -1), True, False),
    (16, "u8", False, (9, 3), False, True),
    (16, "16bit", False, (-1, 0), True, False),
    (16, "fp8", True, (-1, -1), False, True),
])
def test_gathered_composition_matches_reference(page, kv_kind, causal, window, sink, bad):
    # the composition (gather, a contiguous forward, the flagged fixup) with the plain contiguous Triton kernel as
    # the forward (the cute one needs a GPU and has the same contract): the paged reference's answer
    lq, lk = [3, 0, 16, 1, 6], [40, 5, 16, 70, 6]
    q, kc, vc, cq, table, used, ks, vs, _, _, _ = make_paged(lq, lk, 4, 2, 32, page, torch.bfloat16, kv_kind, 7)
    if bad:  # first pages: flagged (the fixup) without a window; with one, before its first kept key (not read)
        table[0, 0] = kc.shape[0] + 1
        table[3, 0] = -5
    sinks = torch.tensor([0.0, 1.0, -1.0, 3.0]) if sink else None
    args = (q, kc, vc, cq, table, used, max(lq), 0.15, causal, window[0], window[1], sinks, ks, vs)
    out, lse = gathered_prefill_paged(attention_prefill, *args)
    want_out, want_lse = ref_paged(*args)
    assert_attention_close(out, lse, want_out, want_lse, f"page={page} {kv_kind} window={window}")


def test_gathered_composition_mla_widths_match_reference():
    # DeepSeek MLA prefill over pages: keys wider than values (q/k 192, v 128 in the model; 48 / 32 here)
    lq, lk = [3, 16, 1], [40, 16, 70]
    q, kc, vc, cq, table, used, ks, vs, _, _, _ = make_paged(lq, lk, 2, 2, 48, 16, torch.bfloat16, "16bit", 3)
    vc = vc[..., :32].contiguous()
    args = (q, kc, vc, cq, table, used, max(lq), 0.15, True, -1, -1, None, ks, vs)
    out, lse = gathered_prefill_paged(attention_prefill, *args)
    want_out, want_lse = ref_paged(*args)
    assert out.shape[-1] == 32
    assert_attention_close(out, lse, want_out, want_lse, "mla widths")


@st.composite
def paged_cases(draw):
    """Small chunked-prefill batches: per sequence keys 0..40 with 0..keys new queries (sq <= sk, as a chunked
    prefill has), a window or not, causal or not, sinks, 16-bit or FP8 caches, and a few out-of-range page ids."""
    b = draw(st.integers(1, 3))
    lk = [draw(st.integers(0, 40)) for _ in range(b)]
    lq = [draw(st.integers(0, n)) for n in lk]
    window = (draw(st.sampled_from([-1, 0, 3, 17])), draw(st.sampled_from([-1, 0, 5])))
    return dict(lq=lq, lk=lk, causal=draw(st.booleans()), window=window, sink=draw(st.booleans()),
                kv_kind=draw(st.sampled_from(["16bit", "fp8"])), page=draw(st.sampled_from([16, 32])),
                bad=draw(st.lists(st.tuples(st.integers(0, b - 1), st.integers(0, 2)), max_size=2)),
                seed=draw(st.integers(0, 99)))


@given(case=paged_cases())
def test_gathered_composition_drawn(case):
    lq, lk = case["lq"], case["lk"]
    q, kc, vc, cq, table, used, ks, vs, _, _, _ = make_paged(lq, lk, 2, 1, 16, case["page"], torch.bfloat16,
                                                             case["kv_kind"], case["seed"])
    for b, col in case["bad"]:
        if col < table.shape[1]:
            table[b, col] = -1 if col % 2 else kc.shape[0]
    sinks = torch.tensor([0.5, -2.0]) if case["sink"] else None
    window = case["window"]
    args = (q, kc, vc, cq, table, used, max(lq), 0.3, case["causal"], window[0], window[1], sinks, ks, vs)
    out, lse = gathered_prefill_paged(attention_prefill, *args)
    want_out, want_lse = ref_paged(*args)
    assert_attention_close(out, lse, want_out, want_lse, str(case))


def test_gathered_composition_seqused_past_table_is_the_plain_kernel():
    # keys past the table's width count as masked positions in the plain kernel: the flagged fixup keeps that
    lq, lk = [3, 4], [20, 30]
    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged(lq, lk, 2, 1, 32, 16, torch.bfloat16, "16bit", 8)
    used[1] = 40  # table width 2 pages of 16
    args = (q, kc, vc, cq, table, used, 4, 0.2, True, -1, -1, None, None, None)
    out, lse = gathered_prefill_paged(attention_prefill, *args)
    want_out, want_lse = attention_prefill_paged(*args)
    assert torch.equal(out[3:], want_out[3:]) and torch.equal(lse[3:], want_lse[3:])
    ref_out, ref_lse = ref_paged(*args)
    assert_attention_close(out[:3], lse[:3], ref_out[:3], ref_lse[:3], "unflagged sequence")


def test_gather_empty():
    kc = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)
    k, v, cu_k, flags, cap = gather_paged_kv(kc, kc, torch.zeros(0, 3, dtype=torch.int32),
                                             torch.zeros(0, dtype=torch.int32), None, None, torch.bfloat16)
    assert cu_k.tolist() == [0] and flags.numel() == 0 and k.shape[0] >= 1
    used = torch.tensor([0, 5], dtype=torch.int32)  # a table of no columns: nothing gathered, keys flagged
    k, v, cu_k, flags, cap = gather_paged_kv(kc, kc, torch.zeros(2, 0, dtype=torch.int32), used, None, None,
                                             torch.bfloat16)
    assert cap == 0 and cu_k.tolist() == [0, 0, 0] and flags.tolist() == [0, 1]


def test_gather_reason():
    kc = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)
    t, u = torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    assert gather_reason(kc, kc, t, u) is None
    assert "contiguous" in gather_reason(kc.transpose(2, 3), kc, t, u)
    assert "int32" in gather_reason(kc, kc, t.long(), u)
    assert "seqused_k" in gather_reason(kc, kc, t, u.long())


def test_flagged_fixup_writes_flagged_sequences_only():
    lq, lk = [3, 5, 2], [40, 21, 9]
    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged(lq, lk, 4, 2, 32, 16, torch.bfloat16, "16bit", 5)
    table[1, 0] = -3
    want_out, want_lse = ref_paged(q, kc, vc, cq, table, used, max(lq), 0.2, True, 9, -1, None, None, None)
    out = torch.full((sum(lq), 4, 32), 7.0, dtype=torch.bfloat16)
    lse = torch.full((sum(lq), 4), 7.0)
    flags = torch.tensor([0, 1, 0], dtype=torch.int32)
    attention_prefill_paged_flagged(out, lse, q, kc, vc, cq, table, used, max(lq), 0.2, True, 9, -1, None, None,
                                    None, flags)
    assert (out[:3] == 7).all() and (lse[:3] == 7).all() and (out[8:] == 7).all() and (lse[8:] == 7).all()
    assert_attention_close(out[3:8], lse[3:8], want_out[3:8], want_lse[3:8], "flagged sequence")


@pytest.mark.parametrize("kv_kind,causal,window,sink", [
    ("16bit", True, (-1, -1), False),
    ("fp8", True, (9, -1), True),
    ("u8", False, (-1, 3), False),
])
def test_prepared_launcher_matches_the_general_path(kv_kind, causal, window, sink):
    # prepare_gathered_prefill_paged's host logic on the interpreter, the contiguous Triton forward standing in for
    # the cute one: prepared on one call's tensors, it runs on new tensors of the same signature (new lengths, a
    # page id out of range: the fixup) with 4 launches and nothing else launched, fresh outputs, and the general
    # path's bits
    from triton_ops.contract.recording import recording_launches

    lq, lk = [3, 0, 16, 6], [40, 5, 16, 70]

    def case(seed, used=None, bad=False):
        q, kc, vc, cq, table, u, ks, vs, _, _, _ = make_paged(lq, lk, 4, 2, 32, 16, torch.bfloat16, kv_kind, seed)
        if used is not None:
            u = torch.tensor(used, dtype=torch.int32)
        if bad:
            table[3, 1] = kc.shape[0] + 2
        sinks = torch.tensor([0.0, 1.0, -1.0, 3.0]) if sink else None
        return (q, kc, vc, cq, table, u, max(lq), 0.15, causal, window[0], window[1], sinks, ks, vs)

    general = []
    fn = prepare_gathered_prefill_paged(lambda *a: attention_prefill, lambda *a: general.append(a), *case(1))
    assert fn is not None
    outs = []
    for seed, used, bad in ((2, None, False), (3, [30, 5, 16, 64], True)):
        args = case(seed, used, bad)
        with recording_launches() as launches:
            out, lse = fn(*args)
        names = [r.kernel.fn.__name__ for r in launches]
        assert names == ["_prefix_kernel", "_gather_kernel", "_attn_prefill_kernel", "_attn_prefill_kernel"], names
        want_out, want_lse = gathered_prefill_paged(attention_prefill, *args)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"seed {seed}"
        ref_out, ref_lse = ref_paged(*args)
        assert_attention_close(out, lse, ref_out, ref_lse, f"prepared {kv_kind} seed {seed}")
        outs.append(out)
    assert outs[0].data_ptr() != outs[1].data_ptr() and not general


def test_prepare_refuses_what_it_cannot_map():
    # a tensor argument that is no source, or that starts where two sources start (aliased once, not always)
    from triton_ops._launch import prepare
    from triton_ops.attention import paged_gather as G

    x = torch.zeros(8, dtype=torch.int32)
    y = torch.zeros(8, dtype=torch.int32)
    args = (x, x, y, y, y, 1, 16, 0)
    kw = dict(START=False, BLOCK=1)
    assert prepare(G._prefix_kernel, (1,), (x, y), *args, **kw) is not None
    assert prepare(G._prefix_kernel, (1,), (x,), *args, **kw) is None
    assert prepare(G._prefix_kernel, (1,), (x, y, y[:1]), *args, **kw) is None
    assert prepare(G._prefix_kernel, (1,), (x, y), *args, **kw, extra=x) is None


# ------------------------------------------------------------------------------------------------ compile-only

_COMPILE = textwrap.dedent("""
    import os, re
    os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernel, not the interpreter's stand-in
    import triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton_ops.attention import paged_gather as G
    ptrs = ("k_ptr", "v_ptr", "ko_ptr", "vo_ptr", "bt_ptr", "used_ptr", "cu_ptr", "start_ptr", "flag_ptr", "ks_ptr",
            "vs_ptr")
    for fp8 in (False, True):  # Llama's 8 KV heads of 128, pages of 64: a bf16 copy, an E4M3 dequant to bf16 (window)
        w = 8 * 128
        sig = dict.fromkeys(ptrs[4:9], "*i32") | dict.fromkeys(ptrs[9:], "*fp32")
        sig |= dict(k_ptr="*u8" if fp8 else "*bf16", v_ptr="*u8" if fp8 else "*bf16", ko_ptr="*bf16", vo_ptr="*bf16")
        sig |= dict.fromkeys(("num_pages", "bt_cols", "bt_stride", "k_sb", "k_st", "v_sb", "v_st", "batch"), "i32")
        consts = dict(PAGE_SIZE=64, START=fp8, PAD=G.PAD_ROWS, WK=w, WV=w, BLOCK_T=G.BLOCK_T,
                      BLOCK_CK=min(w, G.MAX_BLOCK_C), BLOCK_CV=min(w, G.MAX_BLOCK_C), FP8=fp8, SCALE=fp8,
                      OUT_DTYPE=tl.bfloat16, EMULATE=False)
        sig |= dict.fromkeys(consts, "constexpr")
        names = [p.name for p in G._gather_kernel.params]
        # as a launch specializes them: aligned pointers, strides that are multiples of 16
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, "k_sb", "k_st", "v_sb", "v_st")}
        c = triton.compile(triton.compiler.ASTSource(fn=G._gather_kernel, signature=sig, constexprs=consts,
                                                     attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=4))
        ptx = c.asm["ptx"]
        loads = len(re.findall(r"ld\\.global(\\.\\w+)*\\.v4\\.b32", ptx))
        stores = len(re.findall(r"st\\.global(\\.\\w+)*\\.v4\\.b32", ptx))
        print(fp8, loads, stores, ptx.count("ld.local") + ptx.count("st.local"), ptx.count("e4m3x2"))
""")


def test_sm90_compile_copies_16_bytes_per_access():
    """The gather at copy bandwidth: compiled for sm_90, every global load and store of a row is 16 bytes wide
    (128 threads, 32 rows of 1024 elements of K and of V: 64 stores of bf16 per thread, and 64 more in the zero
    rows' branch; 64 loads of bf16, 32 of E4M3 bytes), no local memory, E4M3 decoded by the hardware convert."""
    lines = [line.split() for line in run_compile_script(_COMPILE, 240).splitlines() if line]
    assert lines == [["False", "64", "128", "0", "0"], ["True", "32", "128", "0", lines[1][4]]], lines
    assert int(lines[1][4]) > 0, lines


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("page,kv_kind,hq,hkv,d,causal,window,sink,bad", [
    (64, "16bit", 8, 2, 128, True, (-1, -1), False, False),
    (16, "16bit", 8, 8, 64, True, (100, 0), True, False),
    (64, "fp8", 8, 1, 128, True, (-1, -1), False, False),
    (64, "u8", 4, 2, 128, False, (-1, 20), True, False),
    (16, "16bit", 8, 2, 128, True, (-1, -1), True, True),
    (64, "fp8", 8, 2, 64, True, (50, -1), False, True),
])
def test_gpu_gathered_paged_prefill_matches_reference(page, kv_kind, hq, hkv, d, causal, window, sink, bad):
    from dispatch import ops

    lq, lk = [300, 1, 0, 128, 77], [1000, 77, 40, 128, 77]
    q, kc, vc, cq, table, used, ks, vs, _, _, _ = make_paged(lq, lk, hq, hkv, d, page, torch.bfloat16, kv_kind, 5,
                                                             device="cuda")
    if bad:  # an out-of-range page id in sequence 0 and seqused_k past the table in sequence 4: the fixup's sequences
        table[0, 1] = kc.shape[0] + 3
        used[4] = table.shape[1] * page + 9
    sinks = torch.randn(hq, device="cuda") if sink else None
    out, lse = ops.attention_prefill_paged(q, kc, vc, cq, table, used, max(lq), softmax_scale=0.09, causal=causal,
                                           window=window, sinks=sinks, k_scale=ks, v_scale=vs, return_lse=True,
                                           backend="cute")
    torch.cuda.synchronize()
    want_out, want_lse = ref_paged(q.cpu(), kc.cpu(), vc.cpu(), cq.cpu(), table.cpu(), used.cpu(), max(lq), 0.09,
                                   causal, window[0], window[1], None if sinks is None else sinks.cpu(),
                                   None if ks is None else ks.cpu(), None if vs is None else vs.cpu())
    if bad:  # past the table: the plain kernel (and so this path) keeps those missing keys as masked positions
        rows = slice(0, cq[4].item())
        out, lse, want_out, want_lse = out[rows], lse[rows], want_out[rows], want_lse[rows]
    assert_attention_close(out, lse, want_out, want_lse, f"gathered paged {page} {kv_kind} d={d}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [pytest.param("cute", marks=needs_dsl), "auto"])
def test_gpu_gathered_paged_prefill_mla_dims(backend):
    """DeepSeek MLA prefill's (192, 128) over pages (the hf latent cache's prompt path; auto takes the gathered cute
    path there)."""
    from dispatch import ops

    lq, lk = [300, 1, 128, 77], [1000, 77, 128, 77]
    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged(lq, lk, 8, 8, 192, 64, torch.bfloat16, "16bit", 9,
                                                           device="cuda")
    vc = vc[..., :128].contiguous()
    out, lse = ops.attention_prefill_paged(q, kc, vc, cq, table, used, max(lq), softmax_scale=0.07, causal=True,
                                           return_lse=True, backend=backend)
    torch.cuda.synchronize()
    want_out, want_lse = ref_paged(q.cpu(), kc.cpu(), vc.cpu(), cq.cpu(), table.cpu(), used.cpu(), max(lq), 0.07,
                                   True, -1, -1, None, None, None)
    assert_attention_close(out, lse, want_out, want_lse, f"gathered paged (192, 128) {backend}")


@pytest.mark.gpu
@needs_dsl
def test_gpu_gathered_paged_prefill_graph_replays_new_lengths():
    # no host read of a device value: a CUDA graph captured once replays with new seqused_k
    from dispatch import ops

    lq, lk = [64, 32], [512, 200]
    q, kc, vc, cq, table, used, _, _, _, _, _ = make_paged(lq, lk, 8, 2, 128, 64, torch.bfloat16, "16bit", 9,
                                                           device="cuda")
    fn = lambda: ops.attention_prefill_paged(q, kc, vc, cq, table, used, 64, causal=True,  # noqa: E731
                                             return_lse=True, backend="cute")
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fn()
    used.copy_(torch.tensor([300, 100], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want, want_lse = ref_paged(q.cpu(), kc.cpu(), vc.cpu(), cq.cpu(), table.cpu(), used.cpu(), 64, None, True, -1,
                               -1, None, None, None)
    assert_attention_close(out, lse, want, want_lse, "graph replay")



@pytest.mark.gpu
@needs_dsl
@pytest.mark.parametrize("kv_kind,window,sink", [("16bit", (-1, -1), True), ("fp8", (100, 0), False)])
def test_gpu_repeated_calls_take_the_prepared_launcher(kv_kind, window, sink, monkeypatch):
    # from the second eager call of a signature on, the launcher specialize_attention_prefill_paged prepared runs
    # (compiled gather / fixup launchers, the cute forward's prepared launcher) where the native replay is off (it
    # is the Python path: tests/test_native_replay_cute.py covers the native one): new values each call (lengths,
    # an out-of-range page id: the fixup), fresh outputs, the reference's answer
    from dispatch import native_replay, ops
    from dispatch.ops import _common

    monkeypatch.setenv(native_replay.NATIVE_ENV, "0")

    lq, lk = [64, 32, 7], [512, 200, 90]
    outs = []
    for call, used in enumerate(([512, 200, 90], [300, 120, 90], [450, 33, 9])):
        q, kc, vc, cq, table, seq, ks, vs, _, _, _ = make_paged(lq, lk, 8, 2, 128, 64, torch.bfloat16, kv_kind,
                                                                20 + call, device="cuda")
        seq.copy_(torch.tensor(used, dtype=torch.int32))
        if call == 2:
            table[0, 1] = kc.shape[0] + 5
        sinks = torch.randn(8, device="cuda") if sink else None
        out, lse = ops.attention_prefill_paged(q, kc, vc, cq, table, seq, 64, softmax_scale=0.09, causal=True,
                                               window=window, sinks=sinks, k_scale=ks, v_scale=vs, return_lse=True,
                                               backend="cute")
        torch.cuda.synchronize()
        want_out, want_lse = ref_paged(q.cpu(), kc.cpu(), vc.cpu(), cq.cpu(), table.cpu(), seq.cpu(), 64, 0.09, True,
                                       window[0], window[1], None if sinks is None else sinks.cpu(),
                                       None if ks is None else ks.cpu(), None if vs is None else vs.cpu())
        assert_attention_close(out, lse, want_out, want_lse, f"call {call}")
        outs.append(out)
    assert len({o.data_ptr() for o in outs}) == 3
    fast = [f for (n, _), f in _common._FAST.items() if n == "attention_prefill_paged"]
    assert any("prepare_gathered_prefill_paged" in getattr(f, "__qualname__", "") for f in fast), fast
