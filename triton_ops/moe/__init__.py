"""MoE plumbing kernels (Triton): `routing.py` (router top-k, hash routing) and `align.py` (contiguous and masked
expert layouts, gather, combine). The expert GEMMs are their own family: triton_ops/moe_gemm/."""
