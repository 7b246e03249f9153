"""DeepSeek-V3.2 indexer scores (`mla_index_scores`, Triton) against dispatch/reference/attention.py: drawn small
shapes under the interpreter (head dims multiples of 16, visibility masks with rows that see no key, weights with
negatives and zeros, q / k with outliers, strided inputs), bad inputs (one per check), the config rule; on a GPU
DeepSeek-V3.2's dims (H 64, D 128, S = T = 2048). `LowbitIndexer`'s picks against transformers' indexer:
tests/test_hf_deepseek_v32.py::test_indexer_topk_picks_what_transformers_indexer_picks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference.attention import mla_index_scores as index_ref
from dispatch.reference.attention import visible_keys
from tests.helpers import assert_close, examples
from triton_ops.attention.indexer import index_scores_config, mla_index_scores, supports_mla_index_scores
from triton_ops.contract.checks import LowbitInputError

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _inputs(g: np.random.Generator, b, s, t, h, d, dtype, outliers: bool):
    q = torch.from_numpy(g.normal(0, 1, (b, s, h, d)).astype(np.float32))
    k = torch.from_numpy(g.normal(0, 1, (b, t, d)).astype(np.float32))
    if outliers:  # a few large entries, as the indexer's RoPE'd projections have
        for x in (q, k):
            flat = x.view(-1)
            flat[torch.from_numpy(g.integers(0, flat.numel(), max(1, flat.numel() // 50)))] *= 40
    w = torch.from_numpy(g.normal(0, 1, (b, s, h)).astype(np.float32)) * h ** -0.5
    w[torch.from_numpy(g.random((b, s, h)) < 0.2)] = 0.0  # zero weights beside negative ones
    return q.to(dtype), k.to(dtype), w


@st.composite
def index_cases(draw):
    b = draw(st.integers(1, 2))
    s = draw(st.integers(1, 40))
    t = draw(st.integers(1, 70))
    h = draw(st.sampled_from([1, 3, 8]))
    d = draw(st.sampled_from([16, 32, 48, 128]))
    dtype = draw(st.sampled_from(DTYPES))
    g = np.random.default_rng(draw(st.integers(0, 2**16)))
    q, k, w = _inputs(g, b, s, t, h, d, dtype, draw(st.booleans()))
    mask = draw(st.sampled_from(["none", "causal", "random"]))
    visible = None
    if mask == "causal":  # bottom-right aligned, as a prompt after cached keys (rows with no key when s > t)
        visible = visible_keys(s, t, True, (-1, -1))[None].repeat(b, 1, 1)
    elif mask == "random":
        visible = torch.from_numpy(g.random((b, s, t)) < 0.5)
    if visible is not None:
        visible[0, draw(st.integers(0, s - 1))] = False  # a row that sees no key
    if draw(st.booleans()):  # strided views: q's heads and k's rows from wider buffers, weights transposed
        q = torch.cat([q, q], 2)[:, :, :h]
        k = torch.cat([k, k], 1)[:, ::2]
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    scale = draw(st.sampled_from([d ** -0.5, 1.0, 0.03]))
    return q, k, w, scale, visible, f"B={b} S={s} T={t} H={h} D={d} {dtype} mask={mask}"


def assert_scores_close(got, want, what):
    """-inf exactly where the reference has it; the finite scores by the shared fp32 rule (a sum over H x D
    products in another order)."""
    assert got.dtype == torch.float32 and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    assert_close(got, want, what, dtype=torch.float32)


@settings(max_examples=examples(60))
@given(case=index_cases())
def test_index_scores_match_reference(case):
    q, k, w, scale, visible, what = case
    want = index_ref(q, k, w, scale, visible)
    assert_scores_close(mla_index_scores(q, k, w, scale, visible), want, what)
    if visible is not None:
        assert torch.isneginf(want[~visible]).all() and torch.isfinite(want[visible]).all()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_public_op_masks_rows_and_ignores_unseen_keys(backend):
    """Through the public op: a row that sees no key is all -inf; an invisible key's values never reach a score
    (NaN there stays out); the default scale is 1/sqrt(D)."""
    g = np.random.default_rng(3)
    q, k, w = _inputs(g, 2, 9, 20, 4, 32, torch.bfloat16, False)
    visible = visible_keys(9, 20, True, (-1, -1))[None].repeat(2, 1, 1)
    visible[1, 4] = False
    visible[:, :, 19] = False
    k[:, 19] = math.nan
    got = ops.mla_index_scores(q, k, w, visible=visible, backend=backend)
    want = index_ref(q, k, w, 32 ** -0.5, visible)
    assert torch.isneginf(got[1, 4]).all() and not got.isnan().any()
    assert_scores_close(got, want, backend)


def test_empty_and_zero_heads():
    q, k, w = torch.zeros(2, 0, 4, 16), torch.zeros(2, 5, 16), torch.zeros(2, 0, 4)
    assert mla_index_scores(q, k, w, 0.5, None).shape == (2, 0, 5)
    q, k, w = torch.zeros(1, 3, 4, 16), torch.zeros(1, 0, 16), torch.zeros(1, 3, 4)
    assert mla_index_scores(q, k, w, 0.5, None).shape == (1, 3, 0)
    q, k, w = torch.randn(1, 3, 0, 16), torch.randn(1, 5, 16), torch.zeros(1, 3, 0)
    assert torch.equal(mla_index_scores(q, k, w, 0.5, None), torch.zeros(1, 3, 5))


def _bad_cases():
    q, k, w = torch.randn(2, 3, 4, 16).bfloat16(), torch.randn(2, 5, 16).bfloat16(), torch.randn(2, 3, 4)
    vis = torch.ones(2, 3, 5, dtype=torch.bool)
    return [
        (dict(q=q.float()[0]), "q", "expected 4 dims"),
        (dict(q=q.to(torch.int32)), "q", "dtype int32"),
        (dict(k=k.half()), "k", "dtype float16"),
        (dict(k=k[:, :, :8]), "k", "head dim"),
        (dict(k=k[:1]), "k", "q's batch"),
        (dict(k=k[0]), "k", "expected 3 dims"),
        (dict(weights=w.bfloat16()), "weights", "dtype bfloat16"),
        (dict(weights=w[:, :, :3]), "weights", "one fp32 weight per query head"),
        (dict(visible=vis.float()), "visible", "dtype float32"),
        (dict(visible=vis[:, :, :4]), "visible", "(B, S, T)"),
        (dict(visible=[[True]]), "visible", "torch.Tensor"),
        (dict(softmax_scale=math.inf), "softmax_scale", "finite float > 0"),
        (dict(softmax_scale=math.nan), "softmax_scale", "finite float > 0"),
        (dict(softmax_scale=0.0), "softmax_scale", "finite float > 0"),
        (dict(softmax_scale=-1.0), "softmax_scale", "finite float > 0"),
        (dict(softmax_scale="0.1"), "softmax_scale", "finite float > 0"),
        (dict(softmax_scale=True), "softmax_scale", "finite float > 0"),
        (dict(q=q.float().requires_grad_(), k=k.float()), "q", "requires grad"),
    ], dict(q=q, k=k, weights=w, softmax_scale=0.25, visible=vis)


@pytest.mark.parametrize("i", range(len(_bad_cases()[0])))
def test_bad_inputs_name_op_and_argument(i):
    change, arg, text = _bad_cases()[0][i]
    kw = {**_bad_cases()[1], **change}
    q, k, w = kw.pop("q"), kw.pop("k"), kw.pop("weights")
    for fn in (lambda: ops.mla_index_scores(q, k, w, **kw, backend="torch"),
               lambda: mla_index_scores(q, k, w, kw["softmax_scale"], kw["visible"])):
        with pytest.raises(LowbitInputError) as err:
            fn()
        msg = str(err.value)
        assert "lowbit.mla_index_scores" in msg and f"'{arg}'" in msg and text in msg, msg


def test_config_rule_and_refusal():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert index_scores_config(2048, 2048, 2, gpu) == index_scores_config(4096, 8192, 2, gpu)
    big = index_scores_config(2048, 2048, 2, gpu)
    assert (big.block_s, big.block_t, big.num_warps, big.num_stages) == (64, 128, 8, 2)
    wide = index_scores_config(2048, 2048, 4, gpu)  # fp32 operands: half the keys (no spill on sm_90a)
    assert (wide.block_s, wide.block_t, wide.num_warps) == (64, 64, 8)
    small = index_scores_config(1, 5, 2, gpu)
    assert (small.block_s, small.block_t, small.num_warps) == (16, 16, 4)
    assert index_scores_config(3000, 3000, 2, cpu).block_t == 256
    q = torch.empty(1, 1, 1, 512)
    assert "head dim 512" in supports_mla_index_scores(q, None, None, 1.0, None)
    assert supports_mla_index_scores(torch.empty(1, 1, 1, 128), None, None, 1.0, None) is None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_and_compile(backend):
    """The torch op's schema, fake and real implementations agree (opcheck), with and without a mask, and a
    torch.compile'd call gives the eager result (the integration's indexer runs inside compiled models)."""
    q, k, w = _inputs(np.random.default_rng(4), 2, 7, 12, 3, 16, torch.bfloat16, False)
    visible = torch.rand(2, 7, 12) < 0.6
    op = torch.ops.lowbit.mla_index_scores.default
    torch.library.opcheck(op, (q, k, w, 0.25, visible, backend))
    torch.library.opcheck(op, (q, k, w, 0.25, None, backend))

    def step(q, k, w, visible):
        return ops.mla_index_scores(q, k, w, softmax_scale=0.25, visible=visible, backend=backend).topk(4).indices

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, w, visible)
    assert torch.equal(got, step(q, k, w, visible))


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_v32_dims_match_reference(dtype):
    """DeepSeek-V3.2's indexer dims (H 64, D 128) over a causal 2 x 2048 prompt with left padding in sequence 1,
    through auto (the Triton row on a GPU); the same top-k as the reference's where the scores are not tied."""
    g = np.random.default_rng(11)
    b, s, h, d = 2, 2048, 64, 128
    q, k, w = _inputs(g, b, s, s, h, d, dtype, True)
    visible = visible_keys(s, s, True, (-1, -1))[None].repeat(b, 1, 1)
    visible[1, :, :100] = False  # left padding
    q, k, w, visible = q.cuda(), k.cuda(), w.cuda(), visible.cuda()
    assert ops.backend_for("mla_index_scores", q, k, w, d ** -0.5, visible) == "triton"
    got = ops.mla_index_scores(q, k, w, softmax_scale=d ** -0.5, visible=visible)
    want = index_ref(q, k, w, d ** -0.5, visible)
    assert_scores_close(got, want, f"V3.2 dims {dtype}")
    full = ops.mla_index_scores(q, k, w, softmax_scale=d ** -0.5)
    assert_scores_close(full, index_ref(q, k, w, d ** -0.5, None), f"V3.2 dims {dtype}, no mask")
