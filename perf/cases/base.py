"""The contract between op families and the benchmark runner.

An op family describes *what* to measure (inputs, the lowbit call, the reference, peers, bytes and flops);
the runner (perf/runner.py) decides *how* (CUDA-event timing, L2-rotating input copies, CUDA-graph replay
for decode cases, verification before timing, roofline fractions, JSONL records).

What the runner does with a case: make(device) once, `reference` and every lowbit backend on *clones* of
those inputs (so ops that write into their inputs see the same state), `check(lowbit_out, reference_out)`
(an AssertionError marks the backend "wrong" and it is not timed), then times each provider on up to ~1000
independently made copies (L2 rotation; `max_copies` caps it). Peers are timed but not checked (their
contracts differ in detail; wrap one yourself to check it). Helpers for Liger peers: perf/peers.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

Inputs = dict[str, Any]  # whatever make() returns; passed to every callable below


@dataclasses.dataclass(frozen=True)
class BenchCase:
    op: str  # dispatch table op name, e.g. "nvfp4_quantize"
    label: str  # short and unique within the op, e.g. "M=8192 K=8192 bf16 given-gs"
    bucket: str  # "decode" (M <= 64 tokens) or "prefill" (throughput, M >= 4096)
    params: dict  # the case parameters as data (M, K, dtype, ...) for the results record
    make: Callable[[torch.device], Inputs]  # fresh random inputs on the device (never zeros)
    lowbit: Callable[[Inputs, str], Any]  # (inputs, backend) -> output, through the public op
    reference: Callable[[Inputs], Any]  # torch eager reference: a peer, and torch.compile'd as another
    check: Callable[[Any, Any], None]  # (lowbit output, reference output) -> raises if wrong
    bytes_moved: int  # bytes read + written once (the roofline count)
    flops: int = 0  # useful floating-point operations, where the op has a matmul-like cost
    peers: dict[str, Callable[[Inputs], Any]] = dataclasses.field(default_factory=dict)  # e.g. {"liger": fn}
    compile_reference: bool = True  # also time torch.compile(reference)
    # Optional fields (added by the perf layer; all defaulted, so existing cases need no change):
    tier: str = "full"  # "full": full runs (and, if the op has no "quick" case, its smallest case in --quick);
    #                     "quick": only in --quick runs (tiny shapes for the CPU interpreter / CI); "both"
    flops_dtype: str = "bf16"  # which measured compute roof `flops` is held against: "bf16" or "fp8"
    max_copies: int | None = None  # cap on L2-rotation copies of make()'s inputs (None: runner decides)
    graph: bool | None = None  # also time lowbit providers under CUDA-graph replay (None: yes)
