"""lowbit's quantizers against torchao's references (NVFP4 two-level, MX FP4) where the conventions agree.

Conventions compared: NVFP4 with a decode-form global scale (torchao `per_tensor_amax_to_scale`, the same as
lowbit's), blocks whose scale stays >= 2^-6 (torchao clamps smaller scales up to 2^-6; lowbit keeps them);
MXFP4 with FLOOR and RCEIL exponents; the 128x4 scale swizzle (torchao `to_blocked`).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dispatch import ops
from tests.helpers import assert_same_bytes, make_values

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor", reason="torchao not installed")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
mx_utils = pytest.importorskip("torchao.prototype.mx_formats.utils")
ScaleCalculationMode = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode


def _inputs(rows, k, dtype, seed, dist):
    x = make_values(rows, k, dist, seed, block=32)
    # keep every 16-element block within ~100x of the tensor amax, so no block scale falls below 2^-6
    x[:, ::16] = x.abs().amax() * 0.5
    return x.to(dtype)


@given(rows=st.sampled_from([1, 7, 64, 130]), k=st.sampled_from([64, 128, 512]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**31 - 1),
       dist=st.sampled_from(["normal", "heavy_tail", "mixed_scale", "ties"]))
def test_nvfp4_matches_torchao(rows, k, dtype, seed, dist):
    x = _inputs(rows, k, dtype, seed, dist)
    gs = nvfp4_tensor.per_tensor_amax_to_scale(x.float().abs().amax())
    ao_scales, ao_codes = nvfp4_tensor.nvfp4_quantize(x, 16, gs)
    assert ao_scales.float().min() >= 2.0**-6, "test input left the shared convention"
    for backend in ("torch", "triton"):
        q = ops.nvfp4_quantize(x, gs, backend=backend)
        assert_same_bytes(q.codes, ao_codes.view(torch.uint8).reshape(q.codes.shape), f"codes ({backend})")
        assert_same_bytes(q.scales, ao_scales.reshape(q.scales.shape), f"scales ({backend})")
    swz = ops.nvfp4_quantize(x, gs, scale_layout="swizzled", backend="triton").scales
    ao_swz = mx_utils.to_blocked(ao_scales.reshape(rows, k // 16))
    assert_same_bytes(swz.reshape(-1), ao_swz.reshape(-1), "swizzled scales vs torchao to_blocked")


@given(rows=st.sampled_from([1, 5, 64]), k=st.sampled_from([32, 128, 256]),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**31 - 1),
       dist=st.sampled_from(["normal", "heavy_tail", "zero_blocks", "mixed_scale", "ties"]),
       mode=st.sampled_from(["floor", "rceil"]))
def test_mxfp4_matches_torchao(rows, k, dtype, seed, dist, mode):
    x = make_values(rows, k, dist, seed, block=32).to(dtype)
    ao_mode = ScaleCalculationMode.FLOOR if mode == "floor" else ScaleCalculationMode.RCEIL
    ao_scales, ao_codes = mx_tensor.to_mx(x, torch.float4_e2m1fn_x2, 32, ao_mode)
    for backend in ("torch", "triton"):
        q = ops.mxfp4_quantize(x, rounding=mode, backend=backend)
        assert_same_bytes(q.codes, ao_codes.view(torch.uint8).reshape(q.codes.shape), f"codes ({backend}, {mode})")
        assert_same_bytes(q.scales, ao_scales.view(torch.uint8).reshape(q.scales.shape), f"scales ({backend})")
