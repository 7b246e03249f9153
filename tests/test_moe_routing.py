"""MoE router: Triton ids == reference ids exactly, weights within a tight fp32 tolerance; pinned tie cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference import moe as ref
from tests.helpers import DEVICES, assert_close_elementwise
from triton_ops.contract.checks import LowbitInputError

# exp/log differ by a few ulps between torch and Triton (libdevice / numpy); everything else is IEEE fp32


def _logits(t, e, dist, seed, dtype):
    g = np.random.default_rng(seed)
    if dist == "normal":
        x = g.standard_normal((t, e)) * 2
    elif dist == "ties":  # few distinct values: many exact ties at every rank
        x = g.choice([-1.0, 0.0, 0.5, 2.0], (t, e))
    elif dist == "all_equal":
        x = np.full((t, e), 0.75)
    elif dist == "extreme":  # saturating sigmoid / softplus regions, where scores round to ties but logits don't
        x = g.choice([-1.0, 1.0], (t, e)) * g.uniform(15, 90, (t, e))
    else:
        raise ValueError(dist)
    return torch.from_numpy(x.astype(np.float32)).to(dtype)


def _compare(got, want, desc):
    assert got.topk_ids.dtype == torch.int32 and got.topk_weights.dtype == torch.float32
    assert torch.equal(got.topk_ids.cpu(), want.topk_ids), f"ids differ [{desc}]"
    assert_close_elementwise(got.topk_weights, want.topk_weights, f"weights [{desc}]")


@st.composite
def route_cases(draw):
    e = draw(st.sampled_from([8, 16, 129, 256, 384]))
    t = draw(st.sampled_from([0, 1, 3, 17, 64]))
    k = draw(st.sampled_from([1, 2, 4, 6, 8] + ([16] if e >= 16 else [])))
    scoring = draw(st.sampled_from(ref.SCORINGS))
    bias = draw(st.booleans())
    groups = draw(st.sampled_from([g for g in (1, 4, 8) if e % g == 0 and e // g >= 2]))
    topk_groups = draw(st.integers(1, groups))
    if k > topk_groups * (e // groups):
        topk_groups = groups
    dist = draw(st.sampled_from(["normal", "normal", "ties", "all_equal", "extreme"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    renorm = draw(st.booleans())
    scaling = draw(st.sampled_from([1.0, 2.5]))
    seed = draw(st.integers(0, 2**31 - 1))
    x = _logits(t, e, dist, seed, dtype)
    b = torch.from_numpy(np.random.default_rng(seed + 1).standard_normal(e).astype(np.float32)) if bias else None
    kw = dict(scoring=scoring, bias=b, renormalize=renorm, routed_scaling=scaling, num_groups=groups,
              topk_groups=topk_groups)
    return x, k, kw, f"T={t} E={e} k={k} {scoring} bias={bias} G={groups}/{topk_groups} {dist} {dtype}"


@pytest.mark.parametrize("device", DEVICES)
@given(case=route_cases())
def test_route_matches_reference(device, case):
    x, k, kw, desc = case
    want = ops.moe_route(x, k, backend="torch", **kw)
    dkw = dict(kw, bias=None if kw["bias"] is None else kw["bias"].to(device))
    got = ops.moe_route(x.to(device), k, backend="triton", **dkw)
    _compare(got, want, desc)


@pytest.mark.parametrize("device", DEVICES)
@given(e=st.sampled_from([16, 129, 256]), k=st.sampled_from([1, 6, 8]), t=st.sampled_from([0, 1, 5, 40]),
       scoring=st.sampled_from(ref.SCORINGS), renorm=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_hash_route_matches_reference(device, e, k, t, scoring, renorm, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, e, (500, k), generator=g, dtype=torch.int32)
    tok = torch.randint(0, 500, (t,), generator=g)
    x = torch.randn(t, e, generator=g)
    kw = dict(scoring=scoring, renormalize=renorm, routed_scaling=1.5)
    want = ops.moe_hash_route(x, tok, table, backend="torch", **kw)
    got = ops.moe_hash_route(x.to(device), tok.to(device), table.to(device), backend="triton", **kw)
    _compare(got, want, f"hash T={t} E={e} k={k} {scoring}")
    assert torch.equal(want.topk_ids, table[tok])


# ------------------------------------------------------------------------------------------- pinned cases

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_lowest_index_first(backend):
    x = torch.zeros(3, 10)
    x[0] = 1.0  # all equal -> 0..k-1
    x[1, [7, 3, 5]] = 2.0  # a three-way tie at the top -> 3, 5, 7, then the lowest of the rest
    x[2] = torch.tensor([-0.0, 0.0, -0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0])  # -0 == +0
    got = ops.moe_route(x, 4, scoring="sigmoid", backend=backend)
    assert got.topk_ids.tolist() == [[0, 1, 2, 3], [3, 5, 7, 0], [3, 4, 0, 1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_selection_uses_logits_not_rounded_scores(backend):
    """sigmoid(30) == sigmoid(40) == 1.0 in fp32, but expert 1 has the larger logit and must win."""
    x = torch.tensor([[30.0, 40.0, -5.0, 35.0]])
    got = ops.moe_route(x, 2, scoring="sigmoid", backend=backend)
    assert got.topk_ids.tolist() == [[1, 3]]
    assert got.topk_weights.tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_selects_but_does_not_weigh(backend):
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    got = ops.moe_route(x, 2, scoring="sigmoid", bias=bias, backend=backend)
    assert got.topk_ids.tolist() == [[0, 3]]
    assert_close_elementwise(got.topk_weights, torch.sigmoid(x[:, [0, 3]]), "weights")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_topk_restricts_to_top_groups(backend):
    # 4 groups of 4. Without bias a group scores its max: groups 1 (max 9) and 3 (max 8) win, although group 0
    # holds the next three largest logits.
    x = torch.tensor([[7.0, 7.5, 7.9, 0.0, 9.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 8.0, 0.0, 0.0, 0.5]])
    got = ops.moe_route(x, 3, scoring="softmax", num_groups=4, topk_groups=2, backend=backend)
    assert got.topk_ids.tolist() == [[4, 12, 15]]
    # with a bias, groups score their top-2 sum: group 0 (7.9+7.5) beats group 1 (9+0) and group 3 (8+0.5)
    bias = torch.zeros(16)
    got = ops.moe_route(x, 3, scoring="sigmoid", bias=bias, num_groups=4, topk_groups=1, backend=backend)
    assert got.topk_ids.tolist() == [[2, 1, 0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_never_win(backend):
    x = torch.tensor([[float("nan"), 1.0, float("nan"), 2.0, 0.0]])
    got = ops.moe_route(x, 3, scoring="sigmoid", backend=backend)
    assert got.topk_ids.tolist() == [[3, 1, 4]]
    assert torch.isfinite(got.topk_weights).all()
    # with k covering the NaN experts they come last, lowest index first, and their weight is NaN
    got = ops.moe_route(x, 5, scoring="sigmoid", backend=backend)
    assert got.topk_ids.tolist() == [[3, 1, 4, 0, 2]]
    assert torch.isnan(got.topk_weights[0, 3:]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_renormalize_and_scaling(backend):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    got = ops.moe_route(x, 4, scoring="sqrt_softplus", renormalize=True, routed_scaling=2.5, backend=backend)
    torch.testing.assert_close(got.topk_weights.sum(-1), torch.full((5,), 2.5), rtol=1e-6, atol=0)
    # GPT-OSS: softmax over the top-k logits equals softmax + renormalize
    sm = ops.moe_route(x, 4, scoring="softmax", renormalize=True, backend=backend)
    assert_close_elementwise(sm.topk_weights, torch.softmax(x.gather(1, sm.topk_ids.long()), -1), "weights")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    got = ops.moe_route(torch.randn(0, 256), 8, scoring="sigmoid", num_groups=8, topk_groups=4, backend=backend)
    assert got.topk_ids.shape == (0, 8) and got.topk_weights.shape == (0, 8)


def test_bad_inputs_name_op_and_argument():
    x = torch.randn(4, 16)
    cases = [
        (lambda: ops.moe_route(x, 17), "top_k"),
        (lambda: ops.moe_route(x, 2, scoring="relu"), "scoring"),
        (lambda: ops.moe_route(x, 2, bias=torch.zeros(15)), "bias"),
        (lambda: ops.moe_route(x, 2, num_groups=3), "num_groups"),
        (lambda: ops.moe_route(x, 2, num_groups=4, topk_groups=5), "topk_groups"),
        (lambda: ops.moe_route(x, 9, num_groups=4, topk_groups=2), "top_k"),
        (lambda: ops.moe_route(x.int(), 2), "logits"),
        (lambda: ops.moe_hash_route(x, torch.zeros(3, dtype=torch.long), torch.zeros(8, 2, dtype=torch.int32)),
         "token_ids"),
    ]
    for fn, arg in cases:
        with pytest.raises(LowbitInputError, match=rf"lowbit\.moe_(hash_)?route: argument '{arg}'"):
            fn()


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x = torch.randn(5, 32)
    bias = torch.randn(32)
    torch.library.opcheck(torch.ops.lowbit.moe_route.default, (x, bias, 4, "sigmoid", True, 2.5, 4, 2, backend))
    table = torch.randint(0, 32, (50, 4), dtype=torch.int32)
    tok = torch.randint(0, 50, (5,))
    torch.library.opcheck(torch.ops.lowbit.moe_hash_route.default,
                          (x, tok, table, "sqrt_softplus", True, 1.0, backend))


def test_torch_compile_fullgraph():
    x = torch.randn(6, 64)
    bias = torch.randn(64)

    def f(x, bias):
        r = ops.moe_route(x, 8, scoring="sigmoid", bias=bias, renormalize=True, routed_scaling=2.5, num_groups=8,
                          topk_groups=4, backend="torch")
        return r.topk_ids, r.topk_weights * 2

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, bias)
    want = f(x, bias)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# -------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 64, 4096])
def test_gpu_cuda_graph_and_auto(t):
    x = torch.randn(t, 256, device="cuda")
    bias = torch.randn(256, device="cuda")
    kw = dict(scoring="sqrt_softplus", bias=bias, renormalize=True, routed_scaling=2.5)
    assert ops.backend_for("moe_route", x, bias, 8, "sqrt_softplus", True, 2.5, 1, 1) == "triton"
    want = ops.moe_route(x.cpu(), 8, **dict(kw, bias=bias.cpu()), backend="torch")
    ops.moe_route(x, 8, **kw)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = ops.moe_route(x, 8, **kw)
    x.copy_(torch.randn_like(x))
    g.replay()
    want = ops.moe_route(x.cpu(), 8, **dict(kw, bias=bias.cpu()), backend="torch")
    _compare(got, want, f"graph replay T={t}")


@pytest.mark.gpu
def test_gpu_inductor_compile():
    x = torch.randn(32, 256, device="cuda")
    f = torch.compile(lambda x: ops.moe_route(x, 8, scoring="softmax", renormalize=True).topk_weights * 3,
                      fullgraph=True)
    torch.testing.assert_close(f(x), ops.moe_route(x, 8, scoring="softmax", renormalize=True).topk_weights * 3)


@pytest.mark.parametrize("block_t", [1, 16])
@pytest.mark.parametrize("dist", ["normal", "ties", "extreme"])
@pytest.mark.parametrize("preset", ["dsv3", "dsv4", "softmax"])
def test_gpu_configs_match_reference(block_t, dist, preset):
    """The configs the GPU picks (one row per program up to T = 2048, 16 rows beyond) under the interpreter:
    the int64 (key, index) selection and the re-read weights give the reference's ids and weights."""
    from triton_ops.moe.routing import RouteConfig
    from triton_ops.moe.routing import moe_route as triton_route

    x = _logits(20, 256, dist, 7, torch.float32)
    x[3, 5] = float("nan")
    b = torch.from_numpy(np.random.default_rng(8).standard_normal(256).astype(np.float32)) * 0.1
    args = {"dsv3": (x, b, 8, "sigmoid", True, 2.5, 8, 4), "dsv4": (x, b, 8, "sqrt_softplus", True, 1.5, 1, 1),
            "softmax": (x, None, 4, "softmax", True, 1.0, 1, 1)}[preset]
    want = ref.moe_route(*args)
    ids, w = triton_route(*args, config=RouteConfig(block_t, 4))
    assert torch.equal(ids, want[0]), f"ids differ [{preset} {dist} block_t={block_t}]"
    assert_close_elementwise(w, want[1], f"weights [{preset} {dist} block_t={block_t}]")
