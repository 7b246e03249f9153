"""Which keys a query row may see, shared by every attention kernel (semantics: dispatch/reference/attention.py).

Positions are bottom-right aligned: query row i of a sequence with sq queries and sk keys sits at key position
i + sk - sq. WINDOW_LEFT / WINDOW_RIGHT are -1 for unbounded; CAUSAL is the same as WINDOW_RIGHT = 0.
Kernels skip fully masked key tiles with `key_range` (loop bounds) and apply `visible` only on the tiles at
the edges of that range: `full_key_range` bounds the keys every query of a block sees, and tiles inside it need
no element mask.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_range(q_pos_lo, q_pos_hi, sk, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
              WINDOW_RIGHT: tl.constexpr):
    """[lo, hi) of the keys that any query at key positions q_pos_lo..q_pos_hi (inclusive) may see."""
    lo = 0
    hi = sk
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(q_pos_lo - WINDOW_LEFT, 0)
    if CAUSAL:
        hi = tl.minimum(q_pos_hi + 1, sk)
    if WINDOW_RIGHT >= 0:
        hi = tl.minimum(q_pos_hi + WINDOW_RIGHT + 1, hi)
    hi = tl.maximum(hi, lo)  # an empty range, never a negative one
    return lo, hi


@triton.jit
def full_key_range(q_pos_lo, q_pos_hi, sk, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                   WINDOW_RIGHT: tl.constexpr):
    """[lo, hi) of the keys that every query at key positions q_pos_lo..q_pos_hi (inclusive) may see; hi <= lo
    when there are none. The left bound comes from the last query, the right bounds from the first."""
    lo = 0
    hi = sk
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(q_pos_hi - WINDOW_LEFT, 0)
    if CAUSAL:
        hi = tl.minimum(q_pos_lo + 1, sk)
    if WINDOW_RIGHT >= 0:
        hi = tl.minimum(q_pos_lo + WINDOW_RIGHT + 1, hi)
    return lo, hi


@triton.jit
def visible(q_pos, k_pos, sk, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """Bool tile: key positions k_pos (broadcast [1, N]) visible from query positions q_pos ([M, 1])."""
    ok = k_pos < sk
    if CAUSAL:
        ok = ok & (k_pos <= q_pos)
    if WINDOW_LEFT >= 0:
        ok = ok & (k_pos >= q_pos - WINDOW_LEFT)
    if WINDOW_RIGHT >= 0:
        ok = ok & (k_pos <= q_pos + WINDOW_RIGHT)
    return ok
