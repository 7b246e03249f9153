"""RMSNorm (+ residual, + quantized outputs): Triton bytes == reference bytes on drawn inputs, float output
vs a float64 oracle, pinned model shapes, NaN/Inf, empty inputs, errors, opcheck, torch.compile, GPU-only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference import rmsnorm as ref
from tests.helpers import (
    DEVICES,
    FLOAT_DTYPES,
    assert_graph_replay_matches_eager,
    assert_same_bytes,
    float_inputs,
    make_values,
)
from triton_ops.contract.checks import LowbitInputError

QUANTS = ("none", "fp8_group", "mxfp4", "nvfp4")
# bound on |y - exact| / |exact|: half an ulp of the output dtype; fp32 adds its 3 intermediate roundings
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-21}
SUBNORMAL_STEP = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24, torch.float32: 2.0**-149}


def _call(quant, x, w, eps, residual, offset, backend, layout="linear", gs=None, group=64, rounding="floor",
          ue8m0=False, column_major=False):
    """(list of output tensors, new residual) of the public op for `quant`."""
    kw = dict(residual=residual, weight_offset=offset, backend=backend)
    if quant == "none":
        y, r = ops.rms_norm(x, w, eps, **kw)
        return [y], r
    if quant == "fp8_group":
        q, r = ops.rms_norm_fp8_group(x, w, eps, group_size=group, ue8m0=ue8m0, column_major_scales=column_major,
                                      **kw)
    elif quant == "mxfp4":
        q, r = ops.rms_norm_mxfp4(x, w, eps, rounding=rounding, scale_layout=layout, **kw)
    else:
        q, r = ops.rms_norm_nvfp4(x, w, eps, global_scale=gs, scale_layout=layout, **kw)
    return list(q), r


def _both(quant, x, w, eps, residual, offset, device, **kw):
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    gs = kw.pop("gs", None)
    got = _call(quant, dev(x), dev(w), eps, dev(residual), offset, "triton", gs=dev(gs), **kw)
    want = _call(quant, x.cpu(), w.cpu(), eps, None if residual is None else residual.cpu(), offset, "torch",
                 gs=None if gs is None else gs.cpu(), **kw)
    return got, want


def assert_same_floats(a, b, what):
    """Bytes equal, except that NaN == NaN whatever its sign/payload (the GPU writes canonical NaNs).
    Quantized (1-byte) outputs are compared as raw bytes: their NaN encodings are part of the contract."""
    if a.dtype in FLOAT_DTYPES:
        a, b = a.cpu(), b.cpu()
        assert torch.equal(a.isnan(), b.isnan()), f"{what}: NaN positions differ"
        a, b = torch.where(a.isnan(), 0, a), torch.where(b.isnan(), 0, b)
    assert_same_bytes(a, b, what)


def _assert_all(got, want, desc):
    (outs, r), (wouts, wr) = got, want
    for i, (a, b) in enumerate(zip(outs, wouts, strict=True)):
        assert a.stride() == b.stride() or a.numel() == 0, f"output {i} strides [{desc}]"
        assert_same_floats(a, b, f"output {i} [{desc}]")
    assert (r is None) == (wr is None)
    if r is not None:
        assert_same_bytes(r, wr, f"new residual [{desc}]")


def _oracle(x, w, eps, residual, offset):
    """float64 math on the dtype-rounded h: the exact value y rounds from."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hd = h.double()
    return hd * torch.rsqrt(hd.square().mean(-1, keepdim=True) + eps) * (w.double() + offset)


# ------------------------------------------------------------------------------ property: bytes equal


@pytest.mark.parametrize("device", DEVICES)
@given(case=float_inputs(block=64, max_rows=24), quant=st.sampled_from(QUANTS),
       has_res=st.booleans(), offset=st.sampled_from([0.0, 1.0]), layout=st.sampled_from(["linear", "swizzled"]),
       gs_mode=st.sampled_from(["computed", "given"]), flags=st.sampled_from([(False, False), (True, True)]),
       wdtype=st.sampled_from(FLOAT_DTYPES))
def test_rms_norm_bytes(device, case, quant, has_res, offset, layout, gs_mode, flags, wdtype):
    x, desc = case
    n = x.shape[-1]
    w = (1 + 0.2 * make_values(1, n, "normal", n)[0]).to(wdtype)
    residual = make_values(max(1, x.numel() // n), n, "normal", 7)[: x.numel() // n].reshape(x.shape).to(x.dtype) \
        if has_res else None
    gs = None
    if quant == "nvfp4" and gs_mode == "given":
        gs = torch.tensor(0.003)
    got, want = _both(quant, x, w, 1e-6, residual, offset, device, layout=layout, gs=gs,
                      rounding="rceil" if flags[0] else "floor", ue8m0=flags[0], column_major=flags[1])
    _assert_all(got, want, f"{desc} {quant} res={has_res} off={offset} {layout} {gs_mode} {flags}")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@given(n=st.sampled_from([1, 7, 64, 200, 1000]), rows=st.integers(1, 9), has_res=st.booleans(),
       dist=st.sampled_from(["normal", "heavy_tail", "mixed_scale"]), seed=st.integers(0, 2**20))
def test_rms_norm_float_vs_fp64_oracle(dtype, n, rows, has_res, dist, seed):
    """The reference (what every backend equals bytewise) is within 1 ulp of the float64 value, any N."""
    x = make_values(rows, n, dist, seed).to(dtype)
    w = (1 + 0.2 * make_values(1, n, "normal", seed + 1)[0]).to(dtype)
    res = make_values(rows, n, "normal", seed + 2).to(dtype) if has_res else None
    y, _ = ops.rms_norm(x, w, 1e-6, residual=res, backend="torch")
    exact = _oracle(x, w, 1e-6, res, 0.0)
    tol = exact.abs() * ULP[dtype] * 1.01 + SUBNORMAL_STEP[dtype]
    assert ((y.double() - exact).abs() <= tol).all(), f"{dtype} n={n} {dist}"
    yt, _ = ops.rms_norm(x, w, 1e-6, residual=res, backend="triton")
    assert_same_bytes(yt, y, f"triton vs reference, {dtype} n={n}")


# ------------------------------------------------------------------------------------------ pinned cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [2880, 7168])
def test_rms_norm_model_dims(device, n):
    """GPT-OSS and DeepSeek-V4 hidden sizes: every output format with a residual, byte-exact."""
    x = make_values(3, n, "mixed_scale", n).bfloat16()
    res = make_values(3, n, "normal", 1).bfloat16()
    w = (1 + 0.1 * make_values(1, n, "normal", 2)[0]).bfloat16()
    for quant in QUANTS:
        for layout in ("linear", "swizzled"):
            got, want = _both(quant, x, w, 1e-6, res, 0.0, device, layout=layout, group=64 if n == 2880 else 128)
            _assert_all(got, want, f"n={n} {quant} {layout}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,block_n,chunks", [(208, 64, 4), pytest.param(256, 128, 2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("quant,layout,has_res", [("nvfp4", "swizzled", False),
                                                  pytest.param("nvfp4", "linear", True, marks=pytest.mark.slow),
                                                  ("mxfp4", "swizzled", True),
                                                  pytest.param("nvfp4", "swizzled", "gs", marks=pytest.mark.slow)])
def test_rms_norm_fp4_two_pass_kernel(device, n, block_n, chunks, quant, layout, has_res):
    """The two-pass chunked FP4 kernel (the GPU default for long batches without a residual: see
    triton_ops.rmsnorm.pick_chunked_config), forced here on small shapes: bytes equal the reference's, incl. the
    swizzled padding rows/columns past the last chunk, a residual, and (has_res == "gs") a computed global
    scale, which the kernel hands back to the one-pass kernel."""
    from triton_ops import rmsnorm as R

    if quant == "mxfp4" and n % 128:
        pytest.skip("MXFP4 chunks hold whole 4-block groups")
    x = make_values(5, n, "mixed_scale", n).bfloat16()
    x[3] = 0
    res = make_values(5, n, "normal", 1).bfloat16() if has_res is True else None
    w = (1 + 0.1 * make_values(1, n, "normal", 2)[0]).bfloat16()
    gs = None if has_res == "gs" or quant == "mxfp4" else torch.tensor(0.0021)
    cfg = R.RowConfig(1, block_n, 2, 1, chunks, reread_h=quant == "mxfp4")  # both pass-2 sources of h
    fmt = R.FMT_NV if quant == "nvfp4" else R.FMT_MX
    dev = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = R._rms_norm(dev(x), dev(w), dev(res), 1e-6, 0.5, fmt=fmt, swizzle=layout == "swizzled",
                      global_scale=dev(gs), cfg=cfg)
    want = _call(quant, x, w, 1e-6, res, 0.5, "torch", layout=layout, gs=gs)
    outs, wres = want
    for i, (a, b) in enumerate(zip(got[:len(outs)], outs, strict=True)):
        assert_same_bytes(a, b, f"output {i}")
    if res is not None:
        assert_same_bytes(got[-1], wres, "new residual")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2880, 4096, 7168])
def test_rms_norm_fp4_two_pass_default_shapes(n):
    """Long batches take the two-pass kernel by default on the GPU (with a residual: pass 2 reads h back):
    bytes equal."""
    from triton_ops import rmsnorm as R

    assert R.pick_chunked_config(4099, n, torch.device("cuda"), True).reread_h
    x = make_values(4099, n, "mixed_scale", 7).bfloat16()
    res = make_values(4099, n, "normal", 9).bfloat16()
    w = (1 + 0.1 * make_values(1, n, "normal", 8)[0]).bfloat16()
    for quant, gs in (("nvfp4", torch.tensor(0.0017)), ("mxfp4", None)):
        for layout, r in (("linear", None), ("swizzled", None), ("swizzled", res)):
            got, want = _both(quant, x, w, 1e-6, r, 0.0, "cuda", layout=layout, gs=gs)
            _assert_all(got, want, f"n={n} {quant} {layout} res={r is not None}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gs", [0.0, float("nan"), 1e-35, -0.003, float("inf")])
def test_rms_norm_nvfp4_degenerate_global_scale(device, gs):
    """Pins the fused NVFP4 epilogue's exact per-element path: a zero, tiny (|1/gs| >= 2^100) or NaN global
    scale can make single elements of y * inv NaN (0 * Inf, Inf * 0), which its per-block fast encode does not
    handle; with y holding +-Inf (huge weights), a NaN row, -0 and negatives, bytes must still match."""
    x = make_values(4, 64, "normal", 3)
    x[0, 7], x[0, 8] = 8.0, -8.0  # with w = 3e38 there: y = +-Inf
    x[1, 5] = float("nan")
    x[2, 3] = -0.0
    x = x.bfloat16()
    w = torch.ones(64, dtype=torch.bfloat16)
    w[7] = w[8] = 3e38
    for layout in ("linear", "swizzled"):
        got, want = _both("nvfp4", x, w, 1e-6, None, 0.0, device, layout=layout, gs=torch.tensor(gs))
        _assert_all(got, want, f"nvfp4 gs={gs} {layout}")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_nan_inf(device):
    """NaN anywhere in a row -> that row's y is all NaN (the sum of squares is NaN); +-Inf -> the Inf lane is
    NaN (Inf * rstd 0), the others 0. Quantized: the foundation rules for NaN blocks. Other rows unaffected."""
    x = make_values(4, 128, "normal", 3)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    x = x.bfloat16()
    w = torch.ones(128, dtype=torch.bfloat16)
    for quant in QUANTS:
        got, want = _both(quant, x, w, 1e-6, None, 0.0, device)
        _assert_all(got, want, f"nan/inf {quant}")
    y = ops.rms_norm(x.to(device), w.to(device), 1e-6, backend="triton").out.float().cpu()
    assert y[1].isnan().all() and y[2, 9].isnan() and (y[2, :9] == 0).all() and y[[0, 3]].isfinite().all()


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_negative_zero_weight(device):
    """A -0.0 weight is (-0.0 + weight_offset 0.0) = +0.0 in the contract, so those columns' zero outputs carry
    x's sign (a kernel that skips a zero offset's add flips them: other bytes)."""
    x = make_values(3, 128, "normal", 5).bfloat16()
    w = torch.ones(128, dtype=torch.bfloat16)
    w[::3] = -0.0
    for quant in QUANTS:
        got, want = _both(quant, x, w, 1e-6, None, 0.0, device)
        _assert_all(got, want, f"-0.0 weight {quant}")
    y = ops.rms_norm(x.to(device), w.to(device), 1e-6, backend="triton").out.cpu()
    assert torch.equal(torch.signbit(y[:, ::3]), torch.signbit(x[:, ::3])) and (y[:, ::3] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quant", QUANTS)
def test_rms_norm_empty(device, quant):
    x = torch.empty(0, 128, dtype=torch.bfloat16)
    w = torch.ones(128, dtype=torch.bfloat16)
    got, want = _both(quant, x, w, 1e-6, torch.empty_like(x), 0.0, device, layout="swizzled")
    _assert_all(got, want, f"empty {quant}")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_zero_row_and_eps0(device):
    """An all-zero row gives y = 0 (0 * 1/sqrt(eps)); NVFP4 computed global scale of an all-zero tensor is 0
    and the codes/scales are zero (never NaN)."""
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    got, want = _both("nvfp4", x, w, 1e-6, None, 0.0, device)
    _assert_all(got, want, "zeros nvfp4")
    assert float(got[0][2]) == 0.0 and int(got[0][0].cpu().sum()) == 0


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call,arg", [
    (lambda: ops.rms_norm_mxfp4(torch.randn(2, 48), torch.ones(48)), "x"),  # 48 % 32
    (lambda: ops.rms_norm_nvfp4(torch.randn(2, 2888), torch.ones(2888)), "x"),  # odd size for a block format
    (lambda: ops.rms_norm_fp8_group(torch.randn(2, 2880), torch.ones(2880)), "x"),  # 2880 % 128
    (lambda: ops.rms_norm(torch.randn(2, 64), torch.ones(32)), "weight"),
    (lambda: ops.rms_norm(torch.randn(2, 64), torch.ones(64), residual=torch.randn(3, 64)), "residual"),
    (lambda: ops.rms_norm(torch.randn(2, 64), torch.ones(64), residual=torch.randn(2, 64).half()), "residual"),
    (lambda: ops.rms_norm(torch.randn(2, 64), torch.ones(64), -1.0), "eps"),
    (lambda: ops.rms_norm(torch.randint(0, 3, (2, 64)), torch.ones(64)), "x"),
    (lambda: ops.rms_norm(torch.randn(4, 64).t(), torch.ones(4)), "x"),
    (lambda: ops.rms_norm_nvfp4(torch.randn(2, 64), torch.ones(64), global_scale=torch.ones(2)), "global_scale"),
    (lambda: ops.rms_norm_mxfp4(torch.randn(2, 64), torch.ones(64), rounding="up"), "rounding"),
    (lambda: ops.rms_norm_nvfp4(torch.randn(2, 64), torch.ones(64), scale_layout="tiled"), "scale_layout"),
])
def test_rms_norm_bad_input(call, arg):
    with pytest.raises(LowbitInputError, match=rf"lowbit\.rms_norm\w*: argument '{arg}'"):
        call()


# --------------------------------------------------------------------------------- torch integration


def _small():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    return x, torch.randn(64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rms_norm_opcheck(backend):
    x, w, r = _small()
    lb = torch.ops.lowbit
    torch.library.opcheck(lb.rms_norm, (x, w, r, 1e-6, 0.0, backend))
    torch.library.opcheck(lb.rms_norm_fp8_group, (x, w, None, 1e-6, 1.0, 64, 1e-10, False, True, backend))
    torch.library.opcheck(lb.rms_norm_mxfp4, (x, w, r, 1e-6, 0.0, "rceil", True, backend))
    torch.library.opcheck(lb.rms_norm_nvfp4, (x, w, None, 1e-6, 0.0, None, True, backend))


def test_rms_norm_compile_fullgraph():
    x, w, r = _small()

    def f(x, w, r):
        y, h = ops.rms_norm(x, w, 1e-6, residual=r, backend="triton")
        q, _ = ops.rms_norm_nvfp4(h, w, 1e-6, scale_layout="swizzled", backend="triton")
        return y, h, q.codes, q.scales, q.global_scale

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, r)
    for a, b in zip(got, f(x, w, r), strict=True):
        assert_same_bytes(a, b, "compiled")


def test_reference_rms_norm_quant_api():
    """The reference's public shape (other backends build against it)."""
    x, w, r = _small()
    y, h = ref.rms_norm(x, w, 1e-6, r, 1.0)
    c, s, g, h2 = ref.rms_norm_quant(x, w, 1e-6, r, 1.0, "nvfp4", global_scale=None, swizzle=False)
    assert_same_bytes(h, h2, "residual")
    from dispatch.reference.quant import nvfp4_quantize
    for a, b in zip((c, s, g), nvfp4_quantize(y, None, False), strict=True):
        assert_same_bytes(a, b, "composition")
    assert ref.rms_norm(x, w, 1e-6)[1] is None


# --------------------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
def test_rms_norm_cuda_graph():
    x, w, r = (t.cuda() for t in _small())
    fns = [lambda: ops.rms_norm_nvfp4(x, w, 1e-6, residual=r, scale_layout="swizzled"),
           lambda: ops.rms_norm_fp8_group(x, w, 1e-6, group_size=64),
           lambda: ops.rms_norm(x, w, 1e-6, residual=r)]
    for fn in fns:
        assert_graph_replay_matches_eager(fn)


@pytest.mark.gpu
def test_rms_norm_inductor():
    x, w, r = (t.cuda() for t in _small())
    f = lambda x, w, r: ops.rms_norm_mxfp4(x, w, 1e-6, residual=r).quantized.codes  # noqa: E731
    assert_same_bytes(torch.compile(f, fullgraph=True)(x, w, r), f(x, w, r), "inductor")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [16384, 32768])
def test_rms_norm_wide_rows_exact(n):
    x = make_values(64, n, "mixed_scale", 5).bfloat16()
    w = (1 + 0.1 * make_values(1, n, "normal", 6)[0]).bfloat16()
    for quant in QUANTS:
        got, want = _both(quant, x, w, 1e-6, x.flip(0), 1.0, "cuda", layout="swizzled", group=128)
        _assert_all(got, want, f"n={n} {quant}")


@pytest.mark.gpu
def test_rms_norm_64bit_offsets():
    """rows * N > 2^31: the last rows must be right (int64 row offsets)."""
    n, rows = 16384, (2**31 // 16384) + 8
    x = torch.randn(rows, n, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    q, _ = ops.rms_norm_fp8_group(x, w, 1e-6)
    want = ref.rms_norm_quant(x[-8:].cpu(), w.cpu(), 1e-6, None, 0.0, "fp8_group", group_size=128)
    assert_same_bytes(q.codes[-8:], want[0], "last rows codes")
    assert_same_bytes(q.scales[-8:], want[1], "last rows scales")
