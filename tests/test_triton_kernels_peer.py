"""The triton_kernels peer's adapter (perf/peers.py): our MXFP4 bytes viewed as triton_kernels' (E, K, N) operand,
the ragged row counts taken from m_indices, and (GPU) its matmul_ogs output against the per-expert reference.

The decoding checks import triton_kernels from $LOWBIT_TRITON_KERNELS or .whl/triton_kernels_src (docs/perf.md) and
are skipped without it."""

from __future__ import annotations

import pytest
import torch

from dispatch.reference import moe_gemm as ref
from perf import peers
from perf.cases.moe_gemm import contiguous_ids, lean_reference


def _mxfp4(e, n, k, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(122, 128, (e, n, k // 32), dtype=torch.uint8, generator=g)
    return w.to(device), s.to(device)


def _triton_kernels():
    if peers.triton_kernels_moe_mxfp4() is None:
        pytest.skip(f"triton_kernels not importable: {peers.unavailable_reasons().get('triton_kernels.matmul_ogs')}")
    import triton_kernels.numerics_details.mxfp as mxfp
    import triton_kernels.tensor as tk
    from triton_kernels.tensor_details import layout

    return tk, layout, mxfp


def test_slice_sizes_of_a_contiguous_layout():
    ids = torch.tensor(contiguous_ids([3, 0, 2, 1], 1), dtype=torch.int32)
    assert peers.contiguous_slice_sizes(ids, 5).tolist() == [3, 0, 2, 1, 0]
    assert peers.contiguous_slice_sizes(ids, 5).dtype == torch.int32
    with pytest.raises(ValueError, match="padding"):
        peers.contiguous_slice_sizes(torch.tensor(contiguous_ids([3, 2], 4), dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="padding"):
        peers.contiguous_slice_sizes(ids, 3)  # id 3 >= experts
    with pytest.raises(ValueError, match="ascending"):
        peers.contiguous_slice_sizes(torch.tensor([0, 1, 0], dtype=torch.int32), 2)


def test_kn_views_share_the_bytes_and_check_shapes():
    w, s = _mxfp4(3, 16, 64)
    wv, sv = peers.mxfp4_kn_views(w, s)
    assert wv.shape == (3, 32, 16) and sv.shape == (3, 2, 16)
    assert wv.stride(-2) == 1 and wv.data_ptr() == w.data_ptr() and sv.data_ptr() == s.data_ptr()
    with pytest.raises(ValueError):
        peers.mxfp4_kn_views(w, s[..., :1])
    with pytest.raises(ValueError):
        peers.mxfp4_kn_views(w.view(torch.int8), s)


@pytest.mark.parametrize("e,n,k", [(2, 64, 128), (3, 40, 192)])  # (3, 40, 192): both swizzles pad
def test_kn_views_decode_as_our_weights_in_triton_kernels(e, n, k):
    """triton_kernels' own torch decoder (upcast_from_mxfp_torch along K of (E, K, N)) reads our views as our
    reference dequantizes our tensors (low nibble = even element, scale per 32 along K), and its Hopper value /
    scale swizzles of the views (the layouts the peer converts to on sm_90) invert back to the same bytes."""
    tk, layout, mxfp = _triton_kernels()
    w, s = _mxfp4(e, n, k)
    wv, sv = peers.mxfp4_kn_views(w, s)
    want = ref.mxfp4_weight_dequantize(w, s).transpose(1, 2)
    got = mxfp.upcast_from_mxfp_torch(wv, sv, torch.float32, axis=1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    w_tk = tk.convert_layout(tk.wrap_torch_tensor(wv, dtype=tk.FP4), layout.HopperMXValueLayout, mx_axis=1)
    s_tk = tk.convert_layout(tk.wrap_torch_tensor(sv), layout.HopperMXScaleLayout, mx_axis=1, num_warps=8)
    assert w_tk.shape == [e, k, n] and s_tk.shape == [e, k // 32, n]
    w_back = w_tk.storage.layout.unswizzle_data(w_tk.storage.data)
    s_back = s_tk.storage.layout.unswizzle_data(s_tk.storage.data)
    assert torch.equal(w_back[:, : k // 2, :n], wv) and torch.equal(s_back[:, : k // 32, :n], sv)


@pytest.mark.gpu
@pytest.mark.parametrize("e,rows,n,k", [(8, 32, 512, 1024), (128, 16, 5760, 2880), (4, 100, 256, 2880)])
def test_gpu_triton_kernels_matches_reference(e, rows, n, k):
    prepare = peers.triton_kernels_moe_mxfp4()
    if prepare is None:
        pytest.skip(f"triton_kernels not importable: {peers.unavailable_reasons()}")
    counts = [rows] * e
    w, s = _mxfp4(e, n, k, "cuda")
    ids = torch.tensor(contiguous_ids(counts, 1), dtype=torch.int32, device="cuda")
    a = torch.randn(len(ids), k, device="cuda", dtype=torch.bfloat16)
    fn = prepare(w, s, ids)
    got = fn(a)
    want = lean_reference("mxfp4", counts, False)({"a": a, "w": w, "w_scale": s})
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert err <= 2e-2, err
