"""Benchmark cases, one module per op family. Each module defines `cases() -> list[BenchCase]`."""

FAMILIES = ("perf.cases.quant",)
