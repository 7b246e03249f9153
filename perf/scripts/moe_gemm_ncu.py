"""One bf16 MoE grouped GEMM shape under Nsight Compute: the Triton and CuTe backends and `torch._grouped_mm` on
the same operands (contiguous layout, every expert the same row count). Run under ncu, e.g.

    ncu --csv --page details --section SpeedOfLight ... python perf/scripts/moe_gemm_ncu.py --n 7168 --k 2048
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dispatch import ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    e, rows, n, k = args.experts, args.rows, args.n, args.k
    a = torch.randn(e * rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
    m_indices = torch.arange(e, device="cuda", dtype=torch.int32).repeat_interleave(rows)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * rows
    for _ in range(2):
        torch._grouped_mm(a, w.transpose(1, 2), offs, out_dtype=torch.bfloat16)
        ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="triton")
        ops.moe_gemm_bf16(a, w, m_indices=m_indices, backend="cute")
    torch.cuda.synchronize()
    print(f"GEMM {e} x {rows} rows, N {n}, K {k}: weights {e * n * k * 2 / 1e6:.0f} MB", flush=True)


if __name__ == "__main__":
    main()
