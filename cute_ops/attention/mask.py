"""Which keys a query row sees: key ranges per query tile, per row, and the element mask (CuTeDSL + host twins).

Semantics: dispatch/reference/attention.py (`visible_keys`) and triton_ops/attention/mask.py, unchanged. Positions
are bottom-right aligned: query row i of a sequence with sq queries and sk keys sits at key position
q = i + sk - sq, and key j is visible when

    0 <= j < sk,   causal: j <= q,   window left (>= 0): j >= q - left,   window right (>= 0): j <= q + right

(-1 = unbounded; causal is the same as right = 0; both may be given, the tighter bound wins). For one row the
visible keys are therefore one interval [lo, hi) (`row_key_bounds`), which is how the kernel masks: one lower and
one upper column bound per thread (a thread owns one row of S in TMEM), two compares and a select per element.

One formula, two callers. The functions below are plain arithmetic on their arguments, written once: on the
host they run on Python ints (the twins the CPU tests check against the reference); inside a CuTeDSL kernel
they run on Int32 values while the kernel is traced (`cutlass.max`/`cutlass.min` accept both). Which bounds
exist (causal / left / right) is static (a Python bool: the kernel is compiled per combination); the window
sizes themselves are runtime values. Every integer division is of a non-negative value, so floor and
truncating division agree (device Int32 division truncates).
"""

from __future__ import annotations

import dataclasses

try:  # the kernel side needs the DSL; the host twins do not
    import cutlass

    _max, _min = cutlass.max, cutlass.min
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None
    _max, _min = max, min


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """Which bounds are compiled in. The window sizes are runtime arguments (ignored when the flag is off)."""

    causal: bool = False
    has_left: bool = False  # window_left >= 0
    has_right: bool = False  # window_right >= 0

    @staticmethod
    def of(causal: bool, window_left: int, window_right: int) -> MaskSpec:
        return MaskSpec(bool(causal), window_left >= 0, window_right >= 0)

    @property
    def bounded_right(self) -> bool:
        return self.causal or self.has_right


# ------------------------------------------------------------------------------------- shared formulas


def key_range(spec: MaskSpec, q_pos_lo, q_pos_hi, sk, left, right):
    """[lo, hi) of the keys that any query at key positions q_pos_lo..q_pos_hi (inclusive) may see; hi >= lo."""
    lo = 0
    hi = sk
    if spec.has_left:
        lo = _max(q_pos_lo - left, 0)
    if spec.causal:
        hi = _min(q_pos_hi + 1, hi)
    if spec.has_right:
        hi = _min(q_pos_hi + right + 1, hi)
    hi = _max(hi, lo)
    return lo, hi


def full_key_range(spec: MaskSpec, q_pos_lo, q_pos_hi, sk, left, right):
    """[lo, hi) of the keys that every query at q_pos_lo..q_pos_hi sees (hi <= lo: none). Left bound from the
    last query, right bounds from the first."""
    lo = 0
    hi = sk
    if spec.has_left:
        lo = _max(q_pos_hi - left, 0)
    if spec.causal:
        hi = _min(q_pos_lo + 1, hi)
    if spec.has_right:
        hi = _min(q_pos_lo + right + 1, hi)
    return lo, hi


def row_key_bounds(spec: MaskSpec, q_pos, sk, left, right):
    """[lo, hi) of the keys one query at key position q_pos sees (hi <= lo: none)."""
    return full_key_range(spec, q_pos, q_pos, sk, left, right)


def tile_range(spec: MaskSpec, m_block, sq, sk, left, right, tile_m: int, tile_n: int):
    """The key tiles a query tile visits and which of them need no element mask.

    Returns (n_lo, n_count, full_lo, full_hi): key tiles n_lo .. n_lo + n_count - 1 are visited (n_count = 0 when
    no row of the tile sees a key); a visited tile n needs the element mask unless full_lo <= n < full_hi (every
    valid row sees every key of it). Rows past sq (the tail of the last query tile) are excluded from the
    bounds: their outputs are never written.
    """
    q0 = m_block * tile_m
    q_last = _min(q0 + tile_m, sq) - 1  # >= q0: a tile is only scheduled when q0 < sq
    off = sk - sq
    lo, hi = key_range(spec, q0 + off, q_last + off, sk, left, right)
    f_lo, f_hi = full_key_range(spec, q0 + off, q_last + off, sk, left, right)
    n_lo = lo // tile_n
    n_hi = (hi + tile_n - 1) // tile_n
    # every visited tile holds at least one key of [lo, hi), so the count is at most hi - lo: this min makes an
    # empty range (hi == lo, possibly mid-tile) visit nothing, without a branch (the device traces this code)
    n_count = _min(n_hi - n_lo, hi - lo)
    # a tile [n*tile_n, (n+1)*tile_n) is mask-free when it sits inside [f_lo, min(f_hi, sk)) in full
    full_lo = (f_lo + tile_n - 1) // tile_n
    full_hi = _max(f_hi, 0) // tile_n
    return n_lo, n_count, full_lo, full_hi


# ------------------------------------------------------------------------------------------- host twins


def visible_from_row_bounds(sq: int, sk: int, causal: bool, window: tuple[int, int]):
    """Bool [sq, sk] built only from `row_key_bounds` (the kernel's per-row interval); tests compare it with
    dispatch.reference.attention.visible_keys."""
    import torch

    spec = MaskSpec.of(causal, *window)
    out = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        lo, hi = row_key_bounds(spec, i + sk - sq, sk, window[0], window[1])
        if hi > lo:
            out[i, max(lo, 0):hi] = True
    return out


def visited_keys(sq: int, sk: int, causal: bool, window: tuple[int, int], tile_m: int, tile_n: int):
    """(visited bool [sq, sk], unmasked bool [sq, sk]): for each (row, key), whether the kernel's tile loop
    visits the key's tile for the row's query tile, and whether that tile is one it processes without the
    element mask. Tests check visible => visited and unmasked => visible."""
    import torch

    spec = MaskSpec.of(causal, *window)
    visited = torch.zeros(sq, sk, dtype=torch.bool)
    unmasked = torch.zeros(sq, sk, dtype=torch.bool)
    for m in range(-(-sq // tile_m)):
        n_lo, n_count, full_lo, full_hi = tile_range(spec, m, sq, sk, window[0], window[1], tile_m, tile_n)
        rows = slice(m * tile_m, min((m + 1) * tile_m, sq))
        for n in range(n_lo, n_lo + n_count):
            cols = slice(n * tile_n, min((n + 1) * tile_n, sk))
            visited[rows, cols] = True
            if full_lo <= n < full_hi:
                unmasked[rows, cols] = True
    return visited, unmasked


# ------------------------------------------------------------------------------------------ device side


if cutlass is not None:
    import cutlass.cute as cute

    @cute.jit
    def apply_row_bounds(scores: cute.Tensor, coords: cute.Tensor, col0, lo, hi):
        """scores[i] = -inf where the key column col0 + coords[i][1] lies outside [lo, hi) (coords[i] = (row, column
        in the tile), from partitioning an identity tensor like the scores; all of them on one row). Two signed
        compares and a select per score; an empty row (hi <= lo) fails one of them everywhere.

        Not the single unsigned compare `Uint32(c - lo) >= hi - lo`: with nvidia-cutlass-dsl 4.8.1 the Uint32 of a
        coordinate taken from a partitioned identity tensor keeps signed semantics (found by running this on the
        host: inside `cutlass.range(..., unroll_full=True)` with TMEM-load coordinates, and with the WGMMA
        accumulator coordinates of the sm90 kernel even under range_constexpr), so columns below lo stayed
        visible. tests/test_cute_attention.py pins both cases."""
        neg_inf = -cutlass.Float32.inf
        lo_local = lo - col0
        hi_local = hi - col0
        for i in cutlass.range_constexpr(cute.size(scores)):
            c = coords[i][1]
            if (c < lo_local) | (c >= hi_local):
                scores[i] = neg_inf
