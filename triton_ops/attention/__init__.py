"""Attention kernels (Triton). Shared pieces beside the kernels that compose them:

* `mask.py`     which keys a query row may see (causal bottom-right, sliding window), as tile loop bounds
                and as an element mask; the semantics are dispatch/reference/attention.py's.
* `prefill.py`  varlen prefill forward (sinks, window, causal, GQA, paged prefix in 16-bit or FP8, LSE).
* `paged_gather.py` a paged cache's used keys into contiguous K / V (FP8 dequantized), and the composition of
                that gather with a contiguous forward (the gathered paged prefill; the cute sm_90 row uses it).
* `decode.py`   paged decode with split-KV; `merge.py` merges partial results by LSE.

Kernel modules import only `triton_ops` (never `dispatch`); registration lives in dispatch/ops/attention.py.
"""
