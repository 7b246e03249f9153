"""lowbit benchmarks: cases per op family (perf/cases/), the runner, results history and dashboard."""
