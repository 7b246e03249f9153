"""MoE expert grouped GEMMs (Triton), out[m, n] = sum_k a[m, k] * w[e(m), n, k], for the contiguous
(`m_indices`) and masked (`masked_m`) layouts of docs/moe.md.

* `grouped.py`  the kernel (one body; weight kind bf16/fp16, FP8 W8A8 block-scaled or MXFP4 W4A16, and the
                layout are constexprs), its launcher, input checks, `supports_*` predicates and the entries
                `moe_gemm_bf16`, `moe_gemm_fp8`, `moe_gemm_mxfp4` (optional fused top-k row weights).
* `dequant.py`  in-register operand preparation: E4M3 bytes and MXFP4 (E2M1 pairs + E8M0 scales) to MMA
                operands, and the tl.dot wrapper that works around the interpreter's bf16 dot.
* `config.py`   `MoeGemmConfig` (frozen tile config) and the analytical rule that picks one from the shapes.

Kernel modules import only torch, triton and `triton_ops` (never `dispatch`). The contract is
dispatch/reference/moe_gemm.py.
"""
