"""Benchmark cases, one module per op family. Each module defines `cases() -> list[BenchCase]`."""

# Order = the order a time-limited GPU run measures them in.
FAMILIES = ("perf.cases.quant", "perf.cases.norm_act", "perf.cases.rope_kv", "perf.cases.moe")
