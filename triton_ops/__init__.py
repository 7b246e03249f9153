"""Triton kernels. Import is cheap (no GPU query); kernels compile on first call."""
