"""Quantization primitives: Triton bytes == reference bytes on drawn inputs, plus pinned format cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch import ops
from dispatch.reference import formats as fmt
from dispatch.reference import quant as ref
from tests.helpers import DEVICES, assert_same_bytes, float_inputs, make_values


def _run_both(fn, x, device, **kw):
    """(backend under test on `device`, reference on CPU) results of the same call."""
    got = fn(x.to(device), backend="triton", **kw)
    want = fn(x.cpu(), backend="torch", **kw)
    return got, want


def _gs_arg(x, mode, device):
    if mode == "computed":
        return None
    amax = x.float().abs().amax() if x.numel() else torch.tensor(1.0)
    scale = ops.nvfp4_global_scale_from_amax(amax)
    # "loose": a given scale smaller than amax/2688, so block scales saturate at 448 (clamp path)
    return (scale * (0.25 if mode == "loose" else 1.0)).to(device)


# ------------------------------------------------------------------------------ property: bytes equal


@pytest.mark.parametrize("device", DEVICES)
@given(case=float_inputs(block=64), gs_mode=st.sampled_from(["computed", "given", "loose"]),
       layout=st.sampled_from(["linear", "swizzled"]))
def test_nvfp4_quantize_bytes(device, case, gs_mode, layout):
    x, desc = case
    gs = _gs_arg(x, gs_mode, device)
    got = ops.nvfp4_quantize(x.to(device), gs, scale_layout=layout, backend="triton")
    want = ops.nvfp4_quantize(x.cpu(), None if gs is None else gs.cpu(), scale_layout=layout, backend="torch")
    for name in ("codes", "scales", "global_scale"):
        assert_same_bytes(getattr(got, name), getattr(want, name), f"{name} [{desc}, {gs_mode}, {layout}]")
    deq = ops.nvfp4_dequantize(*got, scale_layout=layout, out_dtype=x.dtype, backend="triton")
    deq_ref = ops.nvfp4_dequantize(*want, scale_layout=layout, out_dtype=x.dtype, backend="torch")
    assert_same_bytes(deq, deq_ref, f"dequantized [{desc}]")


@pytest.mark.parametrize("device", DEVICES)
@given(case=float_inputs(block=32), rounding=st.sampled_from(["floor", "rceil"]),
       layout=st.sampled_from(["linear", "swizzled"]))
def test_mxfp4_quantize_bytes(device, case, rounding, layout):
    x, desc = case
    got, want = _run_both(ops.mxfp4_quantize, x, device, rounding=rounding, scale_layout=layout)
    assert_same_bytes(got.codes, want.codes, f"codes [{desc}, {rounding}, {layout}]")
    assert_same_bytes(got.scales, want.scales, f"scales [{desc}, {rounding}, {layout}]")
    deq = ops.mxfp4_dequantize(*got, scale_layout=layout, out_dtype=x.dtype, backend="triton")
    deq_ref = ops.mxfp4_dequantize(*want, scale_layout=layout, out_dtype=x.dtype, backend="torch")
    assert_same_bytes(deq, deq_ref, f"dequantized [{desc}]")


@pytest.mark.parametrize("device", DEVICES)
@given(case=float_inputs(block=128), group=st.sampled_from([32, 64, 128]), ue8m0=st.booleans(),
       column_major=st.booleans())
def test_fp8_group_quantize_bytes(device, case, group, ue8m0, column_major):
    x, desc = case
    kw = dict(ue8m0=ue8m0, column_major_scales=column_major)
    got = ops.fp8_group_quantize(x.to(device), group, backend="triton", **kw)
    want = ops.fp8_group_quantize(x.cpu(), group, backend="torch", **kw)
    assert_same_bytes(got.codes, want.codes, f"codes [{desc}, g{group}, ue8m0={ue8m0}]")
    assert_same_bytes(got.scales, want.scales, f"scales [{desc}]")
    assert got.scales.stride() == want.scales.stride()
    deq = ops.fp8_group_dequantize(*got, group, out_dtype=x.dtype, backend="triton")
    deq_ref = ops.fp8_group_dequantize(*want, group, out_dtype=x.dtype, backend="torch")
    assert_same_bytes(deq, deq_ref, f"dequantized [{desc}]")


# ----------------------------------------------------------- the reference against the format itself

E4M3_ALL = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
E4M3_FINITE = E4M3_ALL[~torch.isnan(E4M3_ALL)]


def _nearest_even(v: torch.Tensor, grid: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Brute force: index into grid of the nearest value, ties to the even code. float64."""
    d = (v[:, None] - grid[None, :]).abs()
    best = d.min(1, keepdim=True).values
    tied = d == best
    even = tied & (codes[None, :] % 2 == 0)
    pick = torch.where(even.any(1, keepdim=True), even, tied)
    return pick.float().argmax(1)


def test_e2m1_encode_matches_brute_force():
    mags = torch.tensor(fmt.E2M1_VALUES[:8], dtype=torch.float64)
    v = torch.cat([torch.linspace(0, 7, 7001, dtype=torch.float64),
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)])
    want = _nearest_even(v.clamp(max=6.0), mags, torch.arange(8))
    got = fmt.e2m1_encode(v.float()).long()
    assert torch.equal(got, want)
    assert torch.equal(fmt.e2m1_encode(-v.float()).long() & 7, want)


def test_e4m3_encode_matches_brute_force():
    g = torch.Generator().manual_seed(1)
    v = torch.cat([torch.rand(20000, generator=g, dtype=torch.float64) * 460,
                   torch.rand(20000, generator=g, dtype=torch.float64) * 2.0**-5,
                   (E4M3_FINITE[E4M3_FINITE >= 0][:-1] + E4M3_FINITE[E4M3_FINITE >= 0][1:]) / 2])  # midpoints
    v = v.float().double()  # the encoder sees fp32 values
    pos = E4M3_FINITE[E4M3_FINITE >= 0].unique()
    want = pos[_nearest_even(v.clamp(max=448), pos, torch.arange(len(pos)))]
    got = fmt.e4m3_encode(v.float()).double()
    assert torch.equal(got, want)


def test_triton_e4m3_emulation_matches_reference():
    """The interpreter path's integer E4M3 rounding (also used for scales on GPU) against torch's cast."""
    x = torch.cat([make_values(64, 128, d, i) * 10.0 ** (i % 7 - 3) for i, d in
                   enumerate(["normal", "heavy_tail", "subnormal", "mixed_scale"])])
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 464.0, -1e9, 2.0**-10])
    got = ops.fp8_group_quantize(x, 128, backend="triton")
    want = ops.fp8_group_quantize(x, 128, backend="torch")
    assert_same_bytes(got.codes, want.codes, "codes")


# --------------------------------------------------------------------------------- pinned format cases


BACKEND_DEVICES = [pytest.param("torch", "cpu", id="torch"), pytest.param("triton", "cpu", id="triton-cpu"),
                   pytest.param("triton", "cuda", id="triton-cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
def test_nvfp4_ties_and_codes_pinned(backend, device):
    # gs = 1 and a block amax of 6 make the block scale exactly 1, so x is its own scaled value.
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, 0.1, -0.1, 4.0, -3.0, 0.0, -0.0]
    x = torch.tensor([vals], device=device)
    q = ops.nvfp4_quantize(x, torch.tensor(1.0, device=device), backend=backend)
    q = type(q)(*(t.cpu() for t in q))
    # expected codes: 6->7, .25->0, .75->2, 1.25->2, 1.75->4, 2.5->4, 3.5->6, 5->6, -.25->8, -.75->0xA,
    # .1->0, -.1->8 (sign kept), 4->6, -3->0xD, 0->0, -0->8
    want = [7, 0, 2, 2, 4, 4, 6, 6, 8, 0xA, 0, 8, 6, 0xD, 0, 8]
    assert fmt.unpack_nibbles(q.codes)[0].tolist() == want
    assert q.codes[0, 0].item() == 0x07  # element 0 low nibble, element 1 high nibble
    assert q.scales.view(torch.uint8)[0, 0].item() == 0x38  # e4m3(1.0)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_all_zero_blocks(backend):
    x = torch.zeros(4, 128)
    x[1, 40] = 3.0
    nv = ops.nvfp4_quantize(x, backend=backend, scale_layout="swizzled")
    assert nv.codes.count_nonzero() == 1 and not torch.isnan(nv.scales.float()).any()
    lin = ref.unswizzle_scales_128x4(nv.scales.view(torch.uint8), 4, 8)
    assert lin.count_nonzero() == 1 and nv.scales.view(torch.uint8).count_nonzero() == 1  # padding zero
    z = ops.nvfp4_quantize(torch.zeros(2, 32), backend=backend)
    assert z.global_scale.item() == 0 and z.codes.count_nonzero() == 0 and z.scales.float().count_nonzero() == 0
    mx = ops.mxfp4_quantize(torch.zeros(2, 64), backend=backend)
    assert mx.codes.count_nonzero() == 0 and (mx.scales == 0).all()  # E8M0 byte 0 = 2^-127
    f8 = ops.fp8_group_quantize(torch.zeros(2, 128), backend=backend)
    assert f8.codes.view(torch.uint8).count_nonzero() == 0 and (f8.scales == 1e-10 / 448).all()


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
def test_nan_inf_contract(backend, device):
    """Documented in docs/quant.md: a NaN poisons its block's scale; Inf saturates (given finite global scale)."""
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x = x.to(device)
    gs = torch.tensor(0.01, device=device)
    nv = ops.nvfp4_quantize(x, gs, backend=backend)
    nv = type(nv)(*(t.cpu() for t in nv))
    s = nv.scales.view(torch.uint8)
    assert s[0, 0] == 0x7F and (s[0, 1:] != 0x7F).all()  # NaN block scale; other blocks normal
    assert s[1, 2] == 0x7E  # Inf block: scale saturates to 448
    assert fmt.unpack_nibbles(nv.codes)[1, 40] == 7  # and the Inf element to +6
    assert fmt.unpack_nibbles(nv.codes)[0, :16].eq(0).sum() >= 1
    deq = ops.nvfp4_dequantize(*(t.to(device) for t in nv), out_dtype=torch.float32, backend=backend).cpu()
    assert torch.isnan(deq[0, :16]).all() and torch.isfinite(deq[0, 16:]).all()
    mx = type(q := ops.mxfp4_quantize(x, backend=backend))(*(t.cpu() for t in q))
    assert mx.scales[0, 0] == 0xFF and mx.scales[1, 1] == 0xFF and mx.scales[0, 1] != 0xFF
    f8 = type(q := ops.fp8_group_quantize(x, 32, backend=backend))(*(t.cpu() for t in q))
    assert torch.isnan(f8.scales[0, 0]) and torch.isinf(f8.scales[1, 1])
    assert (f8.codes.view(torch.uint8)[0, :32] == 0x7F).all()


def test_swizzle_offsets_match_formula():
    m, s = 200, 7
    lin = torch.arange(m * s, dtype=torch.int32).reshape(m, s)
    sw = ops.swizzle_scales_128x4(lin).reshape(-1)
    s4 = 8
    for r in (0, 1, 31, 32, 127, 128, 199):
        for c in range(s):
            off = (r // 128) * s4 * 128 + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
            assert sw[off] == lin[r, c]
    assert sw.numel() == 256 * 8 and (sw.reshape(256, 8)[:, :].sum() == lin.sum())
    assert torch.equal(ops.unswizzle_scales_128x4(sw.reshape(256, 8), m, s), lin)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_empty_inputs(backend):
    for shape in [(0, 64), (3, 0, 64), (0, 0)]:
        x = torch.empty(shape)
        nv = ops.nvfp4_quantize(x, backend=backend, scale_layout="swizzled")
        assert nv.codes.shape == (*shape[:-1], shape[-1] // 2) and nv.global_scale.item() == 0
        mx = ops.mxfp4_quantize(x, backend=backend)
        assert mx.scales.shape == (*shape[:-1], shape[-1] // 32)
        if shape[-1]:
            f8 = ops.fp8_group_quantize(x, 64, backend=backend, column_major_scales=True)
            assert f8.codes.shape == shape and f8.scales.shape == (*shape[:-1], 1)
            assert ops.fp8_group_dequantize(*f8, 64, backend=backend).shape == shape


def test_roundtrip_accuracy():
    """Sanity beyond bytes: dequantized values land within each format's half-step of x."""
    x = make_values(64, 512, "normal", 3)
    nv = ops.nvfp4_quantize(x)
    err = (ops.nvfp4_dequantize(*nv, out_dtype=torch.float32) - x).norm() / x.norm()
    assert err < 0.12  # E2M1 + E4M3 scale: ~9-10% RMS on Gaussian data
    f8 = ops.fp8_group_quantize(x)
    err8 = (ops.fp8_group_dequantize(*f8, out_dtype=torch.float32) - x).norm() / x.norm()
    assert err8 < 0.03


@pytest.mark.parametrize("device", DEVICES)
def test_computed_global_scale_sees_every_k_tile(device):
    """The amax pass splits K across programs when rows are few (decode): the maximum, and a NaN, in the last
    K tile must still reach the global scale."""
    x = make_values(3, 4096, "normal", 11)
    x[2, 4000] = 50.0
    got = ops.nvfp4_quantize(x.to(device), backend="triton")
    want = ops.nvfp4_quantize(x, backend="torch")
    assert got.global_scale.item() == want.global_scale.item() == pytest.approx(50.0 / 2688)
    assert_same_bytes(got.codes, want.codes, "codes")
    x[1, 4090] = float("nan")
    assert torch.isnan(ops.nvfp4_quantize(x.to(device), backend="triton").global_scale).item()


@pytest.mark.parametrize("tiles", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: the slow run
@pytest.mark.parametrize("kind,layout", [("nvfp4", "swizzled"), ("nvfp4", "linear"), ("mxfp4", "linear"),
                                         ("nvfp4", "computed")])
def test_fp4_quantize_row_tiles_per_program(monkeypatch, tiles, kind, layout):
    """Several row tiles per program (the GPU default for long batches, triton_ops.quant.fp4_tiling), forced
    on the interpreter: rows that do not fill the last program, NaN/Inf blocks and the swizzled padding rows
    still give the reference's bytes."""
    from triton_ops import quant as Q

    monkeypatch.setattr(Q, "fp4_tiling", lambda rows, k, block, swizzle, device: (Q.TileConfig(1, 4 * block, 4),
                                                                                 tiles))
    x = _near_tie_input(torch.bfloat16, rows=7, k=256)
    swz = layout == "swizzled"
    if kind == "nvfp4":
        gs = None if layout == "computed" else torch.tensor(0.0021)
        lay = "swizzled" if swz else "linear"
        got = ops.nvfp4_quantize(x, gs, scale_layout=lay, backend="triton")
        want = ops.nvfp4_quantize(x, gs, scale_layout=lay, backend="torch")
    else:
        got = ops.mxfp4_quantize(x, scale_layout=layout, backend="triton")
        want = ops.mxfp4_quantize(x, scale_layout=layout, backend="torch")
    for a, b, name in zip(got, want, got._fields, strict=True):
        assert_same_bytes(a, b, name)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2880, 7168, 8192])
def test_fp4_quantize_long_batch_default_tiling(k):
    """Long batches take several row tiles per program on the GPU (fp4_tiling): bytes equal the reference."""
    from triton_ops import quant as Q

    assert Q.fp4_tiling(4099, k, 16, False, torch.device("cuda"))[1] > 1
    x = make_values(4099, k, "mixed_scale", 3).bfloat16()
    x[7, :16] = float("nan")
    gs = torch.tensor(0.0017)
    for lay in ("linear", "swizzled"):
        for g in (gs, None):
            got = ops.nvfp4_quantize(x.cuda(), None if g is None else g.cuda(), scale_layout=lay, backend="triton")
            want = ops.nvfp4_quantize(x, g, scale_layout=lay, backend="torch")
            for a, b, name in zip(got, want, got._fields, strict=True):
                assert_same_bytes(a, b, f"nvfp4 {lay} gs={g is not None} {name}")
        got = ops.mxfp4_quantize(x.cuda(), scale_layout=lay, backend="triton")
        want = ops.mxfp4_quantize(x, scale_layout=lay, backend="torch")
        for a, b, name in zip(got, want, got._fields, strict=True):
            assert_same_bytes(a, b, f"mxfp4 {lay} {name}")


# ------------------------------------------------------------------------------ E2M1 near ties


def _near_tie_input(dtype, rows=8, k=256):
    """Values whose q = x * inv sits on, just below and just above every E2M1 midpoint and grid point (and past 6),
    in blocks scaled over a wide range, with whole NaN / Inf blocks and -0: where an encode would err first."""
    g = torch.Generator().manual_seed(5)
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 6.5, 7.0, 8.0])
    v = torch.cat([pts, pts.nextafter(torch.tensor(0.0)), pts.nextafter(torch.tensor(9.0))])
    idx = torch.randint(0, v.numel(), (rows, k), generator=g)
    sign = torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    x = v[idx] * sign * (2.0 ** torch.randint(-20, 20, (rows, 1), generator=g).float())
    x[0, :32] = float("nan")
    x[1, 32:64] = float("inf")
    x[2, 5] = float("-inf")
    x[3, 64:96] = -0.0
    x[4, 100] = 1e-40
    return x.to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp4_encode_near_ties_same_bytes(device, dtype):
    """The E2M1 encode gives the reference's bytes on near-tie inputs, for NVFP4 (given gs incl. saturating and
    tiny ones, computed gs) and MXFP4 (both roundings), both layouts."""
    from triton_ops import quant as Q4

    x = _near_tie_input(dtype)
    xd = x.to(device)
    for sw in (False, True):
        lay = "swizzled" if sw else "linear"
        for gsv in (None, 1.0, 1e-3, 0.5 ** 20, 3e-39):
            gs = None if gsv is None else torch.tensor(gsv)
            got = Q4._quantize(xd, "nvfp4_quantize", is_mx=False, swizzle=sw,
                               global_scale=None if gs is None else gs.to(device))
            want = ops.nvfp4_quantize(x, gs, scale_layout=lay, backend="torch")
            for name, g_, w_ in zip(("codes", "scales"), got, want, strict=False):
                assert_same_bytes(g_, w_, f"nvfp4 {name} [{dtype}, {lay}, gs={gsv}]")
        for r in ("floor", "rceil"):
            got = Q4._quantize(xd, "mxfp4_quantize", is_mx=True, swizzle=sw, rceil=r == "rceil")
            want = ops.mxfp4_quantize(x, rounding=r, scale_layout=lay, backend="torch")
            assert_same_bytes(got[0], want.codes, f"mxfp4 codes [{dtype}, {lay}, {r}]")
            assert_same_bytes(got[1], want.scales, f"mxfp4 scales [{dtype}, {lay}, {r}]")
