"""Benchmark cases, one module per op family (named as the family is everywhere: triton_ops/<family>,
dispatch/ops/<family>.py, docs/<family>.md). Each module defines `cases() -> list[BenchCase]`."""

# Order = the order a time-limited GPU run measures them in.
FAMILIES = ("perf.cases.quant", "perf.cases.rmsnorm", "perf.cases.swiglu", "perf.cases.rope", "perf.cases.kv_cache",
            "perf.cases.moe", "perf.cases.moe_gemm", "perf.cases.attention")
