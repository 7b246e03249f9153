"""What the tile sweeps of perf/scripts share: each provider's output checked against a reference output, then
timed under a CUDA graph; a provider that fails to build or run is a result, not a stop."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import triton.testing

from ..cases.attention import _normalized_error


def graph_us(fn: Callable) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3


def checked_timings(providers: dict[str, Callable[[], torch.Tensor]], want: torch.Tensor
                    ) -> Iterator[tuple[str, dict]]:
    """(label, {"us", "err"}) per provider in order, err = normalized max error against `want`; or (label,
    {"error": repr}) where the provider raised."""
    for label, fn in providers.items():
        try:
            err = _normalized_error(fn(), want)
            us = graph_us(fn)
        except Exception as exc:  # a variant that does not build is a result, not a stop
            yield label, dict(error=repr(exc)[:300])
        else:
            yield label, dict(us=us, err=err)
