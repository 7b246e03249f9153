"""What the bare-launcher GPU probes share: byte comparison, a do_bench timer and the copy roof they report against."""

from __future__ import annotations

import torch
import triton


def bytes_equal(a, b) -> bool:
    """Same shape and bytes (any dtypes: both are compared as raw uint8 on the host)."""
    a = a.reshape(-1).contiguous().view(torch.uint8).cpu()
    b = b.reshape(-1).contiguous().view(torch.uint8).cpu()
    return a.shape == b.shape and torch.equal(a, b)


def outputs_equal(got, want, label: str) -> bool:
    """Every output of `got` byte-equal to the same position of `want` (None only against None); prints
    "VERIFY FAIL <label>" otherwise."""
    good = all((a is None and b is None) or (a is not None and b is not None and bytes_equal(a, b))
               for a, b in zip(got, want, strict=True))
    if not good:
        print(f"VERIFY FAIL {label}")
    return good


def bench_us(fn, rep: int = 200) -> float:
    """Median microseconds per call (triton.testing.do_bench; probes' inputs are far larger than L2)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e3


def copy_gbps(dev: torch.device) -> float:
    """A torch device copy of 512 MiB (read + write), measured here and now: the probes' roof."""
    big = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    gbps = 2 * big.numel() / (bench_us(lambda: dst.copy_(big)) * 1e-6) / 1e9
    print(f"copy roof {gbps:.0f} GB/s")
    return gbps
