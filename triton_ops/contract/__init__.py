"""The neutral contract every lowbit layer shares: number-format constants and layout math, input checks that
name the op and argument, and arch helpers. It imports torch and the standard library only, nothing of lowbit's:
`dispatch` (public API, table, references) -> kernels (`triton_ops`, `cute_ops`) -> this package.

It lives under `triton_ops/` because the wheel ships three packages (`dispatch`, `triton_ops`, `cute_ops`);
importing `triton_ops.contract` imports neither Triton nor any kernel (tests/test_imports.py asserts it).
"""
