"""What the bare-launcher GPU probes share: byte comparison, a do_bench timer, the copy roof they report against and
the variant records they print and write."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton


def probe_start() -> tuple[str | None, torch.device]:
    """What every variant probe begins with: its --out path (JSON, optional), the CUDA device, seed 0."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    out = ap.parse_args().out
    torch.manual_seed(0)
    return out, torch.device("cuda")


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


class VariantTimer:
    """Times probe variants against a copy roof measured at construction: one printed line and one record
    (the caller's fields, then us, gbps, copy_frac) per variant; `write` saves them as the probe's --out JSON."""

    def __init__(self, dev: torch.device, rep: int = 200):
        self.copy_gbps = copy_gbps(dev)
        self.rep = rep
        self.records: list[dict] = []

    def time(self, label: str, fn, nbytes: int, **fields) -> float:
        us = bench_us(fn, rep=self.rep)
        gbps = nbytes / (us * 1e-6) / 1e9
        self.records.append(dict(fields, us=us, gbps=gbps, copy_frac=gbps / self.copy_gbps))
        print(f"{label} {us:8.1f} us {gbps:7.0f} GB/s {gbps / self.copy_gbps:.3f} of copy")
        return us

    def write(self, path: str | None, verify_ok: bool) -> None:
        if path:
            env = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
            Path(path).write_text(json.dumps(dict(env=env, verify_ok=verify_ok, copy_gbps=self.copy_gbps,
                                                  records=self.records), indent=1))
