"""Integrations of the lowbit ops into model libraries (each imports its library lazily, on first use)."""
