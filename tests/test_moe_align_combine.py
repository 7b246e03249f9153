"""MoE align (contiguous + masked), gather, combine: Triton == reference (exact integers / bytes, combine
included), invariants of the layouts, and a route -> align -> gather -> GEMM -> combine pipeline."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference import moe as ref
from tests.helpers import DEVICES, assert_close, assert_same_bytes
from triton_ops.contract.checks import LowbitInputError


def _ids(t, k, e_global, dist, seed):
    g = torch.Generator().manual_seed(seed)
    if dist == "uniform":  # distinct experts per token, like a real router
        return torch.rand(t, e_global, generator=g).argsort(-1)[:, :k].to(torch.int32) if t else \
            torch.zeros(0, k, dtype=torch.int32)
    if dist == "hot":  # every token to the same few experts
        return (torch.arange(k, dtype=torch.int32) * 3 % e_global).repeat(t, 1)
    if dist == "repeats":  # the same expert in several slots of one token (allowed; order still defined)
        return torch.randint(0, min(3, e_global), (t, k), generator=g, dtype=torch.int32)
    raise ValueError(dist)


@st.composite
def align_cases(draw):
    e_global = draw(st.sampled_from([1, 16, 129, 256]))
    k = draw(st.sampled_from([1, 2, 8])) if e_global > 1 else 1
    k = min(k, e_global)
    t = draw(st.sampled_from([0, 1, 5, 64, 150]))  # 150 * 8 > 1024: the three-launch path
    dist = draw(st.sampled_from(["uniform", "hot", "repeats"]))
    ids = _ids(t, k, e_global, dist, draw(st.integers(0, 2**31 - 1)))
    emap, e = None, e_global
    if draw(st.booleans()) and e_global > 1:  # expert parallel: a strided subset is local, in shuffled order
        local = torch.arange(draw(st.integers(0, 1)), e_global, 2)
        local = local[torch.randperm(local.numel(), generator=torch.Generator().manual_seed(t))]
        emap = torch.full((e_global,), -1, dtype=torch.int32)
        emap[local] = torch.arange(local.numel(), dtype=torch.int32)
        e = max(local.numel(), 1)
    return ids, emap, e, f"T={t} k={k} E_global={e_global} E={e} {dist} ep={emap is not None}"


def _on(x, device):
    return None if x is None else x.to(device)


@pytest.mark.parametrize("device", DEVICES)
@given(case=align_cases(), block_m=st.sampled_from([1, 4, 16, 64]))
def test_align_matches_reference(device, case, block_m):
    ids, emap, e, desc = case
    want = ops.moe_align(ids, e, block_m, expert_map=emap, backend="torch")
    got = ops.moe_align(ids.to(device), e, block_m, expert_map=_on(emap, device), backend="triton")
    for name in want._fields:
        assert_same_bytes(getattr(got, name), getattr(want, name), f"{name} [{desc} bm={block_m}]")
    _check_contiguous_invariants(ids, emap, e, block_m, want)


def _check_contiguous_invariants(ids, emap, e, bm, lay):
    n = ids.numel()
    loc = ref.local_experts(ids, e, emap)
    total = int(lay.num_tokens_post_padded)
    assert total % bm == 0 and total <= lay.sorted_token_ids.numel()
    assert torch.equal(lay.expert_counts.long(), torch.bincount(loc[loc >= 0], minlength=e)[:e])
    real = lay.m_indices >= 0
    assert int(real.sum()) == int((loc >= 0).sum())
    assert torch.equal(real, lay.sorted_token_ids < n)
    src = lay.sorted_token_ids[real].long()
    assert torch.equal(loc[src], lay.m_indices[real].long())  # every row holds an entry of its expert
    assert torch.equal(lay.inv_rows.view(-1)[src], real.nonzero().flatten().int())  # inv is the inverse
    for b in range(total // bm):  # one expert per block; its rows in entry order
        rows = lay.m_indices[b * bm:(b + 1) * bm]
        assert (rows[rows >= 0] == lay.expert_ids[b]).all()
    assert (lay.expert_ids[total // bm:] == -1).all()


@pytest.mark.parametrize("device", DEVICES)
@given(case=align_cases(), max_m=st.sampled_from([1, 3, 16, 700]))
def test_masked_layout_matches_reference(device, case, max_m):
    ids, emap, e, desc = case
    want = ops.moe_masked_layout(ids, e, max_m, expert_map=emap, backend="torch")
    got = ops.moe_masked_layout(ids.to(device), e, max_m, expert_map=_on(emap, device), backend="triton")
    for name in want._fields:
        assert_same_bytes(getattr(got, name), getattr(want, name), f"{name} [{desc} max_m={max_m}]")
    assert torch.equal(want.masked_m, want.expert_counts.clamp(max=max_m))
    kept = want.inv_rows.view(-1) >= 0
    assert int(kept.sum()) == int(want.masked_m.sum())


@pytest.mark.parametrize("device", DEVICES)
@given(t=st.sampled_from([0, 1, 7, 40]), kdim=st.sampled_from([16, 96, 300]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32]),
       layout=st.sampled_from(["contiguous", "masked"]), seed=st.integers(0, 2**31 - 1))
def test_gather_matches_reference(device, t, kdim, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, kdim, generator=g) * 100).to(dtype)
    ids = _ids(t, 4, 16, "uniform", seed)
    if layout == "contiguous":
        src = ops.moe_align(ids, 16, 8, backend="torch").sorted_token_ids
    else:
        src = ops.moe_masked_layout(ids, 16, 5, backend="torch").src_rows
    got = ops.moe_gather(x.to(device), src.to(device), 4, backend="triton")
    want = ops.moe_gather(x, src, 4, backend="torch")
    assert got.shape == (*src.shape, kdim)
    assert_same_bytes(got, want, f"gather T={t} K={kdim} {dtype} {layout}")


@pytest.mark.parametrize("device", DEVICES)
@given(t=st.sampled_from([0, 1, 9, 64]), n=st.sampled_from([8, 200, 1024]), k=st.sampled_from([1, 4, 8]),
       eo_dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float32]), shared=st.booleans(), ep=st.booleans(),
       layout=st.sampled_from(["contiguous", "masked"]), seed=st.integers(0, 2**31 - 1))
def test_combine_matches_reference(device, t, n, k, eo_dtype, out_dtype, shared, ep, layout, seed):
    g = torch.Generator().manual_seed(seed)
    ids = _ids(t, k, 32, "uniform", seed)
    emap = None
    if ep:  # half the experts live elsewhere: their slots contribute nothing
        emap = torch.where(torch.arange(32) < 16, torch.arange(32), -1).to(torch.int32)
    e = 16 if ep else 32
    if layout == "contiguous":
        inv = ops.moe_align(ids, e, 4, expert_map=emap, backend="torch").inv_rows
        rows = ref.contiguous_capacity(t * k, e, 4)
        eo = torch.randn(rows, n, generator=g).to(eo_dtype)
    else:
        inv = ops.moe_masked_layout(ids, e, 6, expert_map=emap, backend="torch").inv_rows
        eo = torch.randn(e, 6, n, generator=g).to(eo_dtype)
    w = torch.rand(t, k, generator=g)
    sh = torch.randn(t, n, generator=g).to(eo_dtype) if shared else None
    want = ops.moe_combine(eo, inv, w, shared=sh, out_dtype=out_dtype, backend="torch")
    got = ops.moe_combine(eo.to(device), inv.to(device), w.to(device), shared=_on(sh, device),
                          out_dtype=out_dtype, backend="triton")
    # fp32 sums in the reference's order, w*v rounded before the add (the launch disables FMA contraction)
    assert_same_bytes(got, want, f"combine T={t} N={n} k={k} {eo_dtype} -> {out_dtype} {layout}")


# ------------------------------------------------------------------------------------------- pinned cases

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_align_pinned_example(backend):
    # T=3, k=2: entries 0..5 = (t0: e2, e0), (t1: e2, e1), (t2: e0, e2); block_m=2
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], dtype=torch.int32)
    lay = ops.moe_align(ids, 3, 2, backend=backend)
    s = 6  # sentinel = T*k
    assert lay.sorted_token_ids.tolist()[:8] == [1, 4, 3, s, 0, 2, 5, s]
    assert lay.m_indices.tolist()[:8] == [0, 0, 1, -1, 2, 2, 2, -1]
    assert lay.expert_ids.tolist()[:4] == [0, 1, 2, 2]
    assert lay.num_tokens_post_padded.tolist() == [8]
    assert lay.expert_offsets.tolist() == [0, 2, 4, 8]
    assert lay.expert_counts.tolist() == [2, 1, 3]
    assert lay.inv_rows.tolist() == [[4, 0], [5, 2], [1, 6]]
    cap = ref.contiguous_capacity(6, 3, 2)
    assert lay.sorted_token_ids.numel() == cap == 10 and lay.sorted_token_ids.tolist()[8:] == [s, s]
    assert lay.expert_ids.tolist()[4:] == [-1]
    m = ops.moe_masked_layout(ids, 3, 2, backend=backend)
    assert m.src_rows.tolist() == [[1, 4], [3, s], [0, 2]]  # expert 2's third entry (5) is dropped
    assert m.masked_m.tolist() == [2, 1, 2] and m.expert_counts.tolist() == [2, 1, 3]
    assert m.inv_rows.tolist() == [[4, 0], [5, 2], [1, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_local_expert_and_empty(backend):
    ids = torch.tensor([[5, 6], [7, 5]], dtype=torch.int32)
    emap = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)  # experts 4..7 on another rank
    lay = ops.moe_align(ids, 4, 16, expert_map=emap, backend=backend)
    assert int(lay.num_tokens_post_padded) == 0 and (lay.inv_rows == -1).all()
    assert (lay.m_indices == -1).all() and (lay.sorted_token_ids == 4).all() and (lay.expert_ids == -1).all()
    y = ops.moe_combine(torch.randn(lay.sorted_token_ids.numel(), 8), lay.inv_rows, torch.rand(2, 2),
                        backend=backend)
    assert torch.equal(y, torch.zeros(2, 8))
    empty = ops.moe_align(torch.zeros(0, 8, dtype=torch.int32), 256, 128, backend=backend)
    assert empty.sorted_token_ids.numel() == 0 and empty.expert_counts.tolist() == [0] * 256
    assert empty.expert_offsets.tolist() == [0] * 257


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_shape_e256_bm128(backend):
    """The DeepGEMM-sized case: T=64, k=8, E=256, block_m=128 (single-launch path on Triton)."""
    ids = _ids(64, 8, 256, "uniform", 1)
    lay = ops.moe_align(ids, 256, 128, backend=backend)
    want = ops.moe_align(ids, 256, 128, backend="torch")
    for name in want._fields:
        assert_same_bytes(getattr(lay, name), getattr(want, name), name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t", [1, 64, 150])
def test_align_paths_agree(device, t):
    """The single-launch and three-launch Triton paths (benchmarked against each other) give the same bytes."""
    from triton_ops.moe import align as tri

    ids = _ids(t, 8, 256, "uniform", t).to(device)
    for fn, arg in ((tri.moe_align, 128), (tri.moe_masked_layout, 64)):
        single, general = fn(ids, None, 256, arg, path="single"), fn(ids, None, 256, arg, path="general")
        for i, (a, b) in enumerate(zip(single, general, strict=True)):
            assert_same_bytes(a, b, f"{fn.__name__} output {i} T={t}")


@pytest.mark.parametrize("dist, ep", [("uniform", True), ("repeats", False), ("hot", True)])
def test_align_general_gpu_chunks(monkeypatch, dist, ep):
    """The three-launch path with its GPU chunking (128 entries per chunk program, a partial last chunk) and a
    scan that loops over chunk blocks, run under the interpreter (where the default is one large chunk)."""
    from triton_ops.moe import align as tri

    monkeypatch.setattr(tri, "GENERAL_CHUNK_CPU", tri.GENERAL_CHUNK)
    monkeypatch.setattr(tri, "SCAN_ELEMS_CPU", 4 * tri.SCAN_EB)  # 4 chunks per scan step: 3 steps
    ids = _ids(150, 8, 64, dist, 7)  # 1200 entries: 10 chunks, the last one 48 long
    emap = torch.where(torch.arange(64) % 2 == 1, torch.arange(64) // 2, -1).to(torch.int32) if ep else None
    e = 32 if ep else 64
    for bm in (1, 16):
        got, want = tri.moe_align(ids, emap, e, bm, path="general"), ref.moe_align(ids, emap, e, bm)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(a, b, f"moe_align output {i} bm={bm}")
    for max_m in (3, 64):
        got = tri.moe_masked_layout(ids, emap, e, max_m, path="general")
        want = ref.moe_masked_layout(ids, emap, e, max_m)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(a, b, f"moe_masked_layout output {i} max_m={max_m}")


@pytest.mark.parametrize("t, dist, ep", [(64, "uniform", True), (5, "hot", False)])
def test_align_single_launch_gpu_grid(monkeypatch, t, dist, ep):
    """The single-launch kernel with its GPU grid (one expert per program; the rows past the padded total
    shared by all programs), run under the interpreter, where the default is one program for everything."""
    from triton_ops.moe import align as tri

    config = tri._small_config
    monkeypatch.setattr(tri, "_small_config", lambda *a: config(*a[:-1], False))
    assert tri._small_config(t * 4, 12, 8, 1, False, False, True)[0] == 12  # really one program per expert
    ids = _ids(t, 4, 24, dist, t)
    emap = torch.where(torch.arange(24) % 2 == 1, torch.arange(24) // 2, -1).to(torch.int32) if ep else None
    e = 12 if ep else 24
    for bm in (1, 8):
        got, want = tri.moe_align(ids, emap, e, bm), ref.moe_align(ids, emap, e, bm)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(a.view(-1), b.view(-1), f"moe_align output {i} T={t} bm={bm}")
    got, want = tri.moe_masked_layout(ids, emap, e, 3), ref.moe_masked_layout(ids, emap, e, 3)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_same_bytes(a, b, f"moe_masked_layout output {i} T={t}")


def test_gather_fp8_equals_quantizing_gathered_rows():
    x = torch.randn(6, 256) * torch.exp(torch.randn(6, 1))
    ids = _ids(6, 4, 16, "uniform", 2)
    src = ops.moe_align(ids, 16, 4, backend="torch").sorted_token_ids
    for backend in BACKENDS:
        got = ops.moe_gather_fp8(x, src, 4, 128, backend=backend)
        q = ops.fp8_group_quantize(ops.moe_gather(x, src, 4, backend="torch"), 128, backend="torch")
        assert_same_bytes(got.codes, q.codes, f"codes {backend}")
        pad = src >= 24
        assert (got.scales[pad] == 0).all()  # padding rows: zero scales (dequantize to zero rows)
        assert_same_bytes(got.scales[~pad], q.scales[~pad], f"scales {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_pipeline_equals_dense_moe(backend):
    """route -> align -> gather -> per-expert GEMM on the contiguous layout -> combine == dense MoE."""
    g = torch.Generator().manual_seed(0)
    t, h, n, e, k = 9, 32, 24, 16, 4
    x, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
    wexp = torch.randn(e, h, n, generator=g)
    r = ops.moe_route(logits, k, scoring="softmax", renormalize=True, backend=backend)
    lay = ops.moe_align(r.topk_ids, e, 8, backend=backend)
    a = ops.moe_gather(x, lay.sorted_token_ids, k, backend=backend)
    eo = torch.zeros(a.shape[0], n)
    real = lay.m_indices >= 0
    eo[real] = torch.bmm(a[real][:, None], wexp[lay.m_indices[real].long()])[:, 0]
    y = ops.moe_combine(eo, lay.inv_rows, r.topk_weights, backend=backend)
    dense = torch.einsum("tkn,tk->tn", torch.einsum("th,tkhn->tkn", x, wexp[r.topk_ids.long()]), r.topk_weights)
    assert_close(y, dense, "gather -> expert matmul -> combine vs dense")


def test_bad_inputs_name_op_and_argument():
    ids = torch.zeros(2, 2, dtype=torch.int32)
    cases = [
        (lambda: ops.moe_align(ids.float(), 4, 16), "moe_align", "topk_ids"),
        (lambda: ops.moe_align(ids, 4, 0), "moe_align", "block_m"),
        (lambda: ops.moe_align(ids, 0, 16), "moe_align", "num_experts"),
        (lambda: ops.moe_masked_layout(ids, 4, 0), "moe_masked_layout", "max_m"),
        (lambda: ops.moe_gather(torch.randn(2, 8), ids.long(), 2), "moe_gather", "src_rows"),
        (lambda: ops.moe_combine(torch.randn(4, 8), ids, torch.rand(2, 3)), "moe_combine", "weights"),
        (lambda: ops.moe_combine(torch.randn(4, 8), ids, torch.rand(2, 2), shared=torch.randn(2, 9)),
         "moe_combine", "shared"),
    ]
    for fn, op, arg in cases:
        with pytest.raises(LowbitInputError, match=rf"lowbit\.{op}: argument '{arg}'"):
            fn()


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ids = _ids(5, 4, 16, "uniform", 0)
    emap = torch.arange(16, dtype=torch.int32) - 4
    for op, args in [
        ("moe_align", (ids, emap, 12, 4, backend)),
        ("moe_masked_layout", (ids, None, 16, 3, backend)),
        ("moe_gather", (torch.randn(5, 16), ref.moe_align(ids, None, 16, 4)[0], 4, backend)),
        ("moe_combine", (torch.randn(16, 3, 8), ref.moe_masked_layout(ids, None, 16, 3)[3], torch.rand(5, 4),
                         torch.randn(5, 8), torch.float32, backend)),
    ]:
        torch.library.opcheck(getattr(torch.ops.lowbit, op).default, args)


def test_torch_compile_fullgraph():
    def f(logits, x):
        r = ops.moe_route(logits, 4, scoring="sigmoid", renormalize=True, backend="torch")
        lay = ops.moe_masked_layout(r.topk_ids, 16, 8, backend="torch")
        a = ops.moe_gather(x, lay.src_rows, 4, backend="torch")
        return ops.moe_combine(a * 2, lay.inv_rows, r.topk_weights, backend="torch")

    logits, x = torch.randn(6, 16), torch.randn(6, 32)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(logits, x)
    torch.testing.assert_close(got, f(logits, x))


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 8192])
def test_gpu_cuda_graph_pipeline(t):
    """Route + align + masked layout + gather + combine captured in one CUDA graph, replayed on new data."""
    dev = "cuda"
    logits = torch.randn(t, 256, device=dev)
    x = torch.randn(t, 512, device=dev, dtype=torch.bfloat16)

    def step():
        r = ops.moe_route(logits, 8, scoring="sigmoid", renormalize=True)
        lay = ops.moe_align(r.topk_ids, 256, 128)
        m = ops.moe_masked_layout(r.topk_ids, 256, 64)
        a = ops.moe_gather(x, lay.sorted_token_ids, 8)
        return r, lay, m, a, ops.moe_combine(a, lay.inv_rows, r.topk_weights)

    step()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x))
    g.replay()
    r, lay, m, a, y = outs
    r_ref = ops.moe_route(logits.cpu(), 8, scoring="sigmoid", renormalize=True, backend="torch")
    assert torch.equal(r.topk_ids.cpu(), r_ref.topk_ids)
    for got, want in ((lay, ops.moe_align(r_ref.topk_ids, 256, 128, backend="torch")),
                      (m, ops.moe_masked_layout(r_ref.topk_ids, 256, 64, backend="torch"))):
        for name in want._fields:
            assert_same_bytes(getattr(got, name), getattr(want, name), name)
    assert_same_bytes(a, ops.moe_gather(x.cpu(), lay.sorted_token_ids.cpu(), 8, backend="torch"), "gather")
    assert_same_bytes(y, ops.moe_combine(a.cpu(), lay.inv_rows.cpu(), r.topk_weights.cpu(), backend="torch"),
                      "combine")


@pytest.mark.gpu
def test_gpu_large_gather_64bit_offsets():
    """Row offsets past 2^31 elements: 300K gathered rows x 7168 bf16."""
    t, k, kdim = 40000, 8, 7168
    x = torch.randn(t, kdim, device="cuda", dtype=torch.bfloat16)
    src = torch.arange(t * k, device="cuda", dtype=torch.int32).flip(0)
    out = ops.moe_gather(x, src, k)
    rows = torch.tensor([0, t * k - 1, t * k // 2], device="cuda")
    assert torch.equal(out[rows], x[(src[rows] // k).long()])
