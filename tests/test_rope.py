"""RoPE: Triton == reference bit for bit (both styles, partial slices, inverse, in/out of place, strided
q/k views, int32/int64 positions, out-of-range positions), plus pinned rotations, errors, empties, opcheck,
torch.compile and (GPU) CUDA-graph capture.

Float contract: the reference computes fp32 products and sums each rounded once; the kernel is compiled with
fp fusion off, so outputs are compared as exact bytes. NaN payloads are not part of the contract (torch's
fp32->bf16 cast keeps the sign and payload, the kernel writes the canonical NaN): NaN positions must match.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference.rope import rope_cos_sin_cache
from tests.helpers import DEVICES, FLOAT_DTYPES, make_values
from triton_ops.contract.checks import LowbitInputError


def assert_same_floats(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach().cpu(), want.detach().cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape}/{got.dtype} vs {want.shape}"
    gn, wn = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gn, wn), f"{what}: NaN positions differ ({int((gn != wn).sum())} elements)"
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    a = torch.where(gn, 0, got.contiguous().view(ints))
    b = torch.where(wn, 0, want.contiguous().view(ints))
    bad = (a != b).nonzero()
    assert len(bad) == 0, f"{what}: {len(bad)} elements differ; first at {bad[0].tolist()}: " \
                          f"{got[tuple(bad[0])].item()} vs {want[tuple(bad[0])].item()}"


@st.composite
def rope_cases(draw):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    t = draw(st.sampled_from([0, 1, 3, 17]))
    hq, hk = draw(st.sampled_from([(1, 1), (4, 1), (3, 2), (2, 0), (8, 2)]))
    d = draw(st.sampled_from([16, 64, 96, 128, 512]))
    rot = draw(st.sampled_from([r for r in (8, 16, 32, 64, 96, 128) if r <= d]))
    where = draw(st.sampled_from(["first", "last", "middle"]))
    rot_offset = {"first": 0, "last": d - rot, "middle": (d - rot) // 2 // 2 * 2}[where]
    layout = draw(st.sampled_from(["qkv_view", "contiguous"]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = np.random.default_rng(seed)
    vals = make_values(max(t, 1) * (hq + 2 * hk), d, draw(st.sampled_from(["normal", "heavy_tail", "mixed_scale"])),
                       seed)[: t * (hq + 2 * hk)].reshape(t, hq + 2 * hk, d).to(dtype)
    if layout == "qkv_view":
        q, k = vals[:, :hq], vals[:, hq:hq + hk]
    else:
        q, k = vals[:, :hq].contiguous(), vals[:, hq:hq + hk].contiguous()
    max_pos = draw(st.sampled_from([1, 64, 5000]))
    pos = torch.from_numpy(g.integers(0, max_pos, t))
    if draw(st.booleans()) and t:  # poison some positions
        pos[:: max(t // 2, 1)] = torch.tensor([max_pos, -1])[torch.arange(len(pos[:: max(t // 2, 1)])) % 2]
    pos = pos.to(draw(st.sampled_from([torch.int32, torch.int64])))
    opts = dict(rot_offset=rot_offset, is_neox=draw(st.booleans()), inverse=draw(st.booleans()))
    desc = f"{dtype} T={t} hq={hq} hk={hk} d={d} rot={rot} {layout} {opts} max_pos={max_pos}"
    return q, k, pos, rope_cos_sin_cache(max_pos, rot), opts, desc


@pytest.mark.parametrize("device", DEVICES)
@given(case=rope_cases(), inplace=st.booleans())
def test_rope_bytes(device, case, inplace):
    q, k, pos, cs, opts, desc = case
    k_or_none = k if k.shape[1] else None
    want = ops.rope(q, k_or_none, pos, cs, backend="torch", **opts)
    dq, dk = q.to(device), k.to(device)
    if inplace:
        buf = torch.cat([dq, dk], 1)  # keep a strided view into one buffer, as in a fused qkv tensor
        gq, gk = buf[:, : q.shape[1]], buf[:, q.shape[1]:]
        ops.rope_(gq, gk if k_or_none is not None else None, pos.to(device), cs.to(device), backend="triton", **opts)
    else:
        gq, gk = ops.rope(dq, dk if k_or_none is not None else None, pos.to(device), cs.to(device),
                          backend="triton", **opts)
        assert gq.is_contiguous()
    assert_same_floats(gq, want.q, f"q [{desc}, inplace={inplace}]")
    if k_or_none is not None:
        assert_same_floats(gk, want.k, f"k [{desc}, inplace={inplace}]")
    else:
        assert not inplace or gk.numel() == 0


# ------------------------------------------------------------------------------------------ pinned


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_pairing_styles_pinned(backend):
    """A quarter turn (cos 0, sin 1) maps each pair (a, b) to (-b, a): shows which dims pair up."""
    cs = torch.tensor([[0.0, 0.0, 1.0, 1.0]])  # rot 4: cos = (0, 0), sin = (1, 1)
    x = torch.arange(1.0, 7.0).reshape(1, 1, 6)  # head 6, rotary slice [1, 5)
    pos = torch.zeros(1, dtype=torch.int64)
    neox = ops.rope(x, None, pos, cs, rot_offset=1, is_neox=True, backend=backend).q
    gptj = ops.rope(x, None, pos, cs, rot_offset=1, is_neox=False, backend=backend).q
    inv = ops.rope(x, None, pos, cs, rot_offset=1, is_neox=False, inverse=True, backend=backend).q
    assert neox.flatten().tolist() == [1, -4, -5, 2, 3, 6]  # pairs (2,4), (3,5)
    assert gptj.flatten().tolist() == [1, -3, 2, -5, 4, 6]  # pairs (2,3), (4,5)
    assert inv.flatten().tolist() == [1, 3, -2, 5, -4, 6]  # a quarter turn back


def test_inverse_undoes_forward():
    q = make_values(64, 128, "normal", 5).reshape(16, 4, 128)
    cs = rope_cos_sin_cache(1000, 64)
    pos = torch.randint(0, 1000, (16,))
    fwd = ops.rope(q, None, pos, cs, rot_offset=64, is_neox=False, backend="triton").q
    back = ops.rope(fwd, None, pos, cs, rot_offset=64, is_neox=False, inverse=True, backend="triton").q
    assert (back - q).abs().max() < 1e-5
    assert (fwd - q).abs().max() > 0.1


def test_cos_sin_cache_formula():
    cs = rope_cos_sin_cache(50, 8, base=500.0)
    p, i = 37, 3
    ang = p * 500.0 ** (-2 * i / 8)
    assert cs[p, i].item() == pytest.approx(math.cos(ang), abs=1e-7)
    assert cs[p, 4 + i].item() == pytest.approx(math.sin(ang), abs=1e-7)
    assert cs.dtype == torch.float32 and cs.shape == (50, 8)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_out_of_range_positions_poison(backend, monkeypatch):
    q = make_values(3, 32, "normal", 1).reshape(3, 1, 32)
    cs = rope_cos_sin_cache(10, 16)
    out = ops.rope(q, None, torch.tensor([9, 10, -1]), cs, rot_offset=8, backend=backend).q
    assert torch.isfinite(out[0]).all()
    assert torch.isnan(out[1:, :, 8:24]).all()  # rotary slice poisoned, nothing read out of bounds
    assert torch.equal(out[1:, :, :8], q[1:, :, :8]) and torch.equal(out[1:, :, 24:], q[1:, :, 24:])
    monkeypatch.setenv("LOWBIT_CHECK_INDICES", "1")
    with pytest.raises(LowbitInputError, match=r"lowbit\.rope: argument 'positions'.*\[-1, 10\]"):
        ops.rope(q, None, torch.tensor([9, 10, -1]), cs, rot_offset=8, backend=backend)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_inputs(backend):
    cs = rope_cos_sin_cache(8, 16)
    for t, hq, hk in [(0, 4, 1), (3, 0, 0), (2, 2, 0)]:
        q, k = torch.randn(t, hq, 32), torch.randn(t, hk, 32)
        out = ops.rope(q, k, torch.zeros(t, dtype=torch.int64), cs, backend=backend)
        assert out.q.shape == q.shape and out.k.shape == k.shape
        ops.rope_(q, k, torch.zeros(t, dtype=torch.int64), cs, backend=backend)


@pytest.mark.parametrize(("kwargs", "arg", "msg"), [
    (dict(q=torch.randn(2, 2, 16).half(), k=torch.randn(2, 1, 16)), "k", "differs from q"),
    (dict(q=torch.randn(2, 16)), "q", "tokens, heads, head_dim"),
    (dict(q=torch.randn(2, 2, 32)[..., ::2]), "q", "contiguous"),
    (dict(q=torch.randn(2, 2, 16).int()), "q", "dtype int32"),
    (dict(positions=torch.zeros(2)), "positions", "dtype float32"),
    (dict(positions=torch.zeros(3, dtype=torch.int64)), "positions", "expected shape"),
    (dict(cos_sin_cache=torch.randn(8, 16).double()), "cos_sin_cache", "float64"),
    (dict(cos_sin_cache=torch.randn(8, 7)), "cos_sin_cache", "rot even"),
    (dict(cos_sin_cache=torch.randn(16, 8).t()), "cos_sin_cache", "contiguous"),
    (dict(rot_offset=10), "rot_offset", "does not fit"),
])
def test_errors_name_op_and_argument(kwargs, arg, msg):
    args = dict(q=torch.randn(2, 2, 16), k=torch.randn(2, 1, 16), positions=torch.zeros(2, dtype=torch.int64),
                cos_sin_cache=rope_cos_sin_cache(8, 8), rot_offset=0)
    args.update(kwargs)
    with pytest.raises(LowbitInputError, match=rf"lowbit\.rope: argument '{arg}'.*{msg}"):
        ops.rope(args["q"], args["k"], args["positions"], args["cos_sin_cache"], rot_offset=args["rot_offset"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck(backend):
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)
    args = (torch.tensor([0, 4, 7]), rope_cos_sin_cache(8, 16), 16, False, True, backend)
    torch.library.opcheck(torch.ops.lowbit.rope.default, (q, k, *args))
    torch.library.opcheck(torch.ops.lowbit.rope_.default, (q.clone(), k.clone(), *args))
    torch.library.opcheck(torch.ops.lowbit.rope_.default, (q.clone(), None, *args))


def test_torch_compile_fullgraph():
    cs = rope_cos_sin_cache(16, 16)

    def f(qkv, pos):
        q, k = qkv[:, :2], qkv[:, 2:]
        ops.rope_(q, k, pos, cs, is_neox=False, backend="triton")
        return ops.rope(qkv, None, pos, cs, inverse=True, is_neox=False, backend="triton").q

    qkv, pos = torch.randn(4, 3, 32), torch.tensor([1, 2, 3, 15])
    got_buf, want_buf = qkv.clone(), qkv.clone()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(got_buf, pos)
    want = f(want_buf, pos)
    assert torch.equal(got, want) and torch.equal(got_buf, want_buf)
    assert (got - qkv).abs().max() < 1e-5  # forward then inverse


# ------------------------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_gpu_large_bytes_and_auto_dispatch():
    t, hq, hk, d = 8192, 32, 8, 128
    qkv = torch.randn(t, hq + 2 * hk, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    cs = rope_cos_sin_cache(8192, d, device="cuda")
    assert ops.backend_for("rope", qkv[:, :hq], qkv[:, hq:hq + hk], pos, cs, 0, True, False) == "triton"
    for neox in (True, False):
        got = ops.rope(qkv[:, :hq], qkv[:, hq:hq + hk], pos, cs, is_neox=neox)
        want = ops.rope(qkv[:, :hq].cpu(), qkv[:, hq:hq + hk].cpu(), pos.cpu(), cs.cpu(), is_neox=neox,
                        backend="torch")
        assert_same_floats(got.q, want.q, f"q neox={neox}")
        assert_same_floats(got.k, want.k, f"k neox={neox}")


@pytest.mark.gpu
def test_gpu_cuda_graph_and_inductor():
    q = torch.randn(16, 16, 512, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (16,), device="cuda")
    cs = rope_cos_sin_cache(4096, 64, device="cuda")
    want = ops.rope(q, None, pos, cs, rot_offset=448, is_neox=False, inverse=True).q
    buf = q.clone()
    ops.rope_(buf, None, pos, cs, rot_offset=448, is_neox=False, inverse=True)  # warm up / compile
    buf.copy_(q)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops.rope_(buf, None, pos, cs, rot_offset=448, is_neox=False, inverse=True)
    buf.copy_(q)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, want)
    fn = torch.compile(lambda x, p: ops.rope(x, None, p, cs, rot_offset=448, is_neox=False, inverse=True).q,
                       fullgraph=True)
    assert torch.equal(fn(q, pos), want)


@pytest.mark.parametrize("cfg", [
    dict(block_t=2, block_hq=4, block_hk=2, num_warps=4, cs_rows=False),  # (cos, sin) in the tile layout
    dict(block_t=2, block_hq=4, block_hk=2, num_warps=4, cs_rows=True, evict_first=True),
    dict(block_t=4, block_hq=2, block_hk=1, num_warps=4, cs_rows=False, issue_first=False),
])
@pytest.mark.parametrize("neox", [True, False])
def test_rope_configs_bytes(cfg, neox):
    """Every RopeConfig code path (a tile sweep's candidates) gives the reference's bytes, in place and out of place,
    bad positions included."""
    from dispatch.reference import rope as ref
    from triton_ops import rope as tr

    g = torch.Generator().manual_seed(3)
    t, hq, hk, d = 11, 8, 2, 64
    q = torch.randn(t, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(t, hk, d, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 40, (t,), generator=g)
    pos[3], pos[7] = 40, -1
    cs = rope_cos_sin_cache(40, d)
    c = tr.RopeConfig(**cfg)
    want_q, want_k = ref.rope(q, k, pos, cs, 0, neox, True)
    got_q, got_k = tr.rope(q, k, pos, cs, 0, neox, True, c)
    assert_same_floats(got_q, want_q, "q")
    assert_same_floats(got_k, want_k, "k")
    q2, k2 = q.clone(), k.clone()
    tr.rope_(q2, k2, pos, cs, 0, neox, True, c)
    assert_same_floats(q2, want_q, "q in place")
    assert_same_floats(k2, want_k, "k in place")
    # DeepSeek-V4 shape: q only, the last 16 of 64 dims rotated in place (GPT-J words when not neox)
    q3 = q.clone()
    cs16 = rope_cos_sin_cache(40, 16)
    want3 = q.clone()
    ref.rope_(want3, None, pos, cs16, d - 16, neox, True)
    tr.rope_(q3, None, pos, cs16, d - 16, neox, True, c)
    assert_same_floats(q3, want3, "q last-16 in place")
