"""Attention kernels (Triton). Shared pieces beside the kernels that compose them:

* `mask.py`     which keys a query row may see (causal bottom-right, sliding window), as tile loop bounds
                and as an element mask; the semantics are dispatch/reference/attention.py's.
* `prefill.py`  varlen prefill forward (sinks, window, causal, GQA, paged prefix in 16-bit or FP8, LSE).
* `decode.py`   paged decode with split-KV; `merge.py` merges partial results by LSE.

Kernel modules import only `triton_ops` (never `dispatch`); registration lives in dispatch/ops/attention.py.
"""
