"""dispatch/variants.py, the kernel variants the benchmarks time as peers: each gives the reference's answer (the
router with forced tiles, the align's three-launch path and the prepacked FP4 kernel's forced configs on the
interpreter; tl.dot_scaled MXFP4 on a GPU) and a bad tile is a named error."""

from __future__ import annotations

import pytest
import torch

from dispatch import ops, variants
from dispatch.reference import moe as ref
from tests.helpers import assert_close, assert_same_bytes


@pytest.mark.parametrize("rows", [1, 8])
def test_route_tiled_matches_reference(rows):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 32, generator=g)
    b = torch.randn(32, generator=g) * 0.1
    args = (x, b, 4, "sigmoid", True, 2.5, 4, 2)
    ids, w = variants.moe_route_tiled(*args, rows_per_program=rows, num_warps=4)
    want_ids, want_w = ref.moe_route(*args)
    assert torch.equal(ids, want_ids), f"rows_per_program={rows}"
    assert_close(w, want_w, f"weights rows_per_program={rows}")


def test_route_tiled_names_a_bad_tile():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="moe_route_tiled: argument 'rows_per_program'"):
        variants.moe_route_tiled(x, None, 2, "softmax", True, 1.0, 1, 1, rows_per_program=3, num_warps=4)


def test_align_three_launch_matches_reference():
    g = torch.Generator().manual_seed(5)
    ids = torch.rand(9, 16, generator=g).argsort(-1)[:, :4].to(torch.int32)
    for got, want, what in ((variants.moe_align_three_launch(ids, None, 16, 8), ref.moe_align(ids, None, 16, 8),
                             "moe_align"),
                            (variants.moe_masked_layout_three_launch(ids, None, 16, 6),
                             ref.moe_masked_layout(ids, None, 16, 6), "moe_masked_layout")):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same_bytes(a, b, f"{what} output {i}")


def test_fp4_prepacked_configured_gives_the_rule_bytes():
    """The prepacked FP4 kernel with forced tiles and scale options (interpreter): the same bytes as the rule's
    config (every configuration computes the same sums in the same order per element); a bad tile is named."""
    g = torch.Generator().manual_seed(11)
    e, n, k = 3, 64, 256
    codes, scales = ops.mxfp4_quantize(torch.randn(e * n, k, generator=g) * 0.1)
    values, w_scales = ops.moe_gemm_fp4_prepack(codes.view(e, n, k // 2), scales.view(e, n, k // 32), "mxfp4")
    m_indices = torch.tensor([0, 0, 1, -1, 2, 2, 2], dtype=torch.int32)
    a = torch.randn(m_indices.numel(), k, generator=g).to(torch.bfloat16)
    want = ops.moe_gemm_fp4_prepacked(a, values, w_scales, fmt="mxfp4", m_indices=m_indices, backend="triton")
    for config in (dict(block_n=32, block_k=256), dict(fold_scale="tile", scale_words=True)):
        got = variants.moe_gemm_fp4_prepacked_configured(a, values, w_scales, None, "mxfp4", m_indices, None,
                                                         config=config)
        assert_same_bytes(got, want, f"config {config}")
    with pytest.raises(ValueError, match="moe_gemm_fp4_prepacked: config .*block_n=48"):
        variants.moe_gemm_fp4_prepacked_configured(a, values, w_scales, None, "mxfp4", m_indices, None,
                                                   config=dict(block_n=48))


@pytest.mark.gpu
def test_gpu_mxfp4_dot_scaled_matches_the_table_row():
    g = torch.Generator().manual_seed(7)
    e, n, k, rows = 4, 256, 512, 128
    codes, scales = ops.mxfp4_quantize((torch.randn(e * n, k, generator=g) * 0.05).cuda())
    w, ws = codes.view(e, n, k // 2), scales.view(e, n, k // 32)
    ids = torch.rand(rows // 2, e, generator=g).argsort(-1)[:, :2].to(torch.int32).cuda()
    m_indices = ops.moe_align(ids, e, 64).m_indices
    a = torch.randn(m_indices.numel(), k, generator=g).to(torch.bfloat16).cuda()
    got = variants.moe_gemm_mxfp4_dot_scaled(a, w, ws, m_indices, None)
    want = ops.moe_gemm_mxfp4(a, w, ws, m_indices=m_indices, backend="torch")
    live = m_indices >= 0
    assert_close(got[live], want[live], "tl.dot_scaled MXFP4 against the reference")


@pytest.mark.gpu
def test_gpu_bf16_cute_tiled_matches_the_table_row():
    # the sweep's tile overrides run the same grouped GEMM: the same bytes as the table's cute row (every epilogue
    # stores the same fp32 accumulators once)
    from cute_ops import unavailable_reason

    if unavailable_reason() is not None or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the sm_90 CuTe grouped GEMM: {unavailable_reason() or 'not an sm_90 GPU'}")
    g = torch.Generator().manual_seed(3)
    e, n, k, rows = 4, 256, 512, 512
    w = (torch.randn(e, n, k, generator=g) * k ** -0.5).to(torch.bfloat16).cuda()
    a = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda()
    m_indices = torch.arange(e, dtype=torch.int32).repeat_interleave(rows // e).cuda()
    want = ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="cute")
    for tiles in (dict(tile_n=128), dict(tile_n=256, epilogue="direct"), dict(tile_n=256, epilogue="smem")):
        got = variants.moe_gemm_bf16_cute_tiled(a, w, m_indices, None, tiles=tiles)
        assert torch.equal(got, want), tiles
