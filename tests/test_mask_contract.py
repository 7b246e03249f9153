"""One visible-key rule, three languages: each kernel family's masking, evaluated the way its kernels apply it, against
the contract `dispatch.reference.attention.visible_keys` (bottom-right causal, windows (left, right), -1 unbounded;
sinks do not change which keys are visible).

For every (sq, sk, causal, left, right) case and tile shape, a kernel's effective rule is: the key tiles its loop
visits for a query tile, each either mask-free (every key visible to every row) or element-masked. The set of
(row, key) pairs that rule keeps must equal the contract's, and no key at or past sk may be kept.

* Triton (triton_ops/attention/mask.py): `key_range`, `full_key_range` and `visible` in a Triton kernel that walks
  the tiles as the prefill kernels do (the interpreter on a CPU).
* CuTe (cute_ops/attention/mask.py): `tile_range`, `row_key_bounds` and the element mask `apply_row_bounds` traced
  by @cute.jit and run on the host (Int32 arithmetic, as in the kernels).
* Gluon MLA (triton_ops/attention/mla_sm90.py): Gluon kernels do not run on a CPU, so the kernel's own Python
  functions `_key_span`, `_start` and `_mask_tile` (and the Triton `key_range` they call) are executed with torch
  standing in for `gl` / `tl`: the formulas are the kernel's source, not a copy. It has no sliding window (its
  entry refuses one) and packs H heads per query row.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch
import triton
import triton.language as tl

from cute_ops import unavailable_reason
from dispatch.reference.attention import visible_keys
from triton_ops.attention.mask import full_key_range, key_range, visible

WINDOWS = [(-1, -1), (0, -1), (3, -1), (-1, 0), (-1, 2), (2, 1), (0, 0)]
LENGTHS = [(1, 1), (1, 9), (5, 5), (13, 4), (6, 23), (24, 24), (7, 0), (16, 31)]  # (sq, sk)
CASES = [(sq, sk, causal, left, right) for (sq, sk), causal, (left, right)
         in itertools.product(LENGTHS, (False, True), WINDOWS)]
PAD = 16  # columns past sk kept in the outputs: a kernel rule that keeps a key >= sk shows up there


def _check(kept: torch.Tensor, sq: int, sk: int, causal: bool, window: tuple[int, int], what: str):
    """kept: bool [sq, sk + PAD] of one case."""
    want = visible_keys(sq, sk, causal, window)
    assert not kept[:, sk:].any(), f"{what}: keys past sk={sk} kept (sq={sq}, causal={causal}, window={window})"
    diff = (kept[:, :sk] != want).nonzero().tolist()
    assert not diff, f"{what}: (row, key) {diff[:6]} differ (sq={sq}, sk={sk}, causal={causal}, window={window})"


# ---------------------------------------------------------------------------------------------------- Triton


@triton.jit
def _triton_kept(out_ptr, sq, sk, out_cols, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                 WINDOW_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tile pid: visit the key tiles of key_range, element-mask those not inside full_key_range, store 1
    where a key is kept (rows past sq are never stored, as in the kernels)."""
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    q_pos = rows + sk - sq
    q_last = tl.minimum(m0 + BLOCK_M, sq) - 1
    lo, hi = key_range(m0 + sk - sq, q_last + sk - sq, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    f_lo, f_hi = full_key_range(m0 + sk - sq, q_last + sk - sq, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        if (n0 >= f_lo) & (n0 + BLOCK_N <= f_hi):  # a mask-free tile
            kept = (cols[None, :] >= 0) & (rows[:, None] >= 0)
        else:
            kept = visible(q_pos[:, None], cols[None, :], sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
        ok = kept & (rows[:, None] < sq) & (cols[None, :] < out_cols)
        tl.store(out_ptr + rows[:, None] * out_cols + cols[None, :], kept.to(tl.int8), mask=ok)


@pytest.mark.parametrize("block", [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_triton_mask_rule_matches_the_contract(block, causal, window):
    for sq, sk, c, left, right in CASES:
        if (c, (left, right)) != (causal, window):
            continue
        out = torch.zeros(sq, sk + PAD, dtype=torch.int8)
        _triton_kept[(triton.cdiv(sq, block[0]),)](out, sq, sk, sk + PAD, causal, left, right, BLOCK_M=block[0],
                                                  BLOCK_N=block[1])
        _check(out.bool(), sq, sk, causal, window, f"triton {block}")


# ------------------------------------------------------------------------------------------------------ CuTe


def _cute_kept(spec, cases, tile_m: int, tile_n: int) -> torch.Tensor:
    """bool [cases, max sq, max sk + PAD]: per case, the keys the CuTe kernels' tile loop keeps for each row."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    from cute_ops.attention import mask as M

    @cute.jit
    def run(inp, out, n):  # inp rows: (sq, sk, left, right)
        coords = cute.make_identity_tensor((1, tile_n))
        for c in cutlass.range(n):
            sq, sk, left, right = inp[c, 0], inp[c, 1], inp[c, 2], inp[c, 3]
            for m in cutlass.range((sq + tile_m - 1) // tile_m):
                n_lo, n_count, full_lo, full_hi = M.tile_range(spec, m, sq, sk, left, right, tile_m, tile_n)
                for r in cutlass.range(tile_m):
                    row = m * tile_m + r
                    if row < sq:
                        lo, hi = M.row_key_bounds(spec, row + sk - sq, sk, left, right)
                        for j in cutlass.range(n_count):
                            kb = n_lo + j
                            scores = cute.make_rmem_tensor(cute.make_layout((1, tile_n)), cutlass.Float32)
                            scores.fill(0.0)
                            if (kb < full_lo) | (kb >= full_hi):  # an edge tile
                                M.apply_row_bounds(scores, coords, kb * tile_n, lo, hi)
                            for i in cutlass.range_constexpr(tile_n):
                                if scores[i] == cutlass.Float32(0.0):
                                    out[c, row, kb * tile_n + i] = cutlass.Int32(1)

    inp = torch.tensor(cases, dtype=torch.int32)
    width = max(sk for _, sk, _, _ in cases) + PAD
    out = torch.zeros(len(cases), max(sq for sq, _, _, _ in cases), width, dtype=torch.int32)
    run(from_dlpack(inp), from_dlpack(out), cutlass.Int32(len(cases)))
    return out.bool()


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"cute backend: {unavailable_reason()}")
@pytest.mark.filterwarnings("ignore:This static loop has")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("has_left,has_right", [(False, False), (True, False), (False, True), (True, True)])
def test_cute_mask_rule_matches_the_contract(causal, has_left, has_right):
    from cute_ops.attention.mask import MaskSpec

    spec = MaskSpec(causal, has_left, has_right)
    cases = [(sq, sk, left, right) for sq, sk, c, left, right in CASES
             if c == causal and (left >= 0, right >= 0) == (has_left, has_right)]
    for tile_m, tile_n in ((4, 4), (6, 5)):  # the formulas take any tile size
        kept = _cute_kept(spec, cases, tile_m, tile_n)
        for (sq, sk, left, right), got in zip(cases, kept, strict=True):
            assert not got[sq:].any()
            _check(got[:sq], sq, sk, causal, (left, right), f"cute {tile_m} x {tile_n}")


# ----------------------------------------------------------------------------------------------- Gluon MLA


class _Scores(torch.Tensor):
    """A tile of logits with the `.type.layout` attribute the Gluon code reads."""

    type = types.SimpleNamespace(layout=None)


def _either(tensor_fn, scalar_fn):
    def fn(a, b):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return tensor_fn(torch.as_tensor(a), torch.as_tensor(b))
        return scalar_fn(a, b)
    return fn


def _where(cond, a, b):
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, torch.as_tensor(a), torch.as_tensor(b))
    return a if cond else b


_LANG = types.SimpleNamespace(
    minimum=_either(torch.minimum, min), maximum=_either(torch.maximum, max), where=_where,
    load=lambda p: int(p[0]), expand_dims=lambda x, axis: x.unsqueeze(axis),
    arange=lambda lo, hi, layout=None: torch.arange(lo, hi),
    full=lambda shape, value, dtype, layout=None: torch.full(shape, value),
    zeros=lambda shape, dtype, layout=None: torch.zeros(shape), float32=torch.float32,
    SliceLayout=lambda *a, **k: None, NVMMADistributedLayout=lambda *a, **k: None)


def _on_host(jit_fn, **names):
    """The Python function behind a Gluon / Triton jit function, with torch standing in for gl / tl."""
    fn = jit_fn.fn
    plain = {k: v.value if isinstance(v, tl.constexpr) else v for k, v in fn.__globals__.items()}  # BLOCK_M, PAGE
    return types.FunctionType(fn.__code__, {**plain, "gl": _LANG, "tl": _LANG, **names}, fn.__name__)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_gluon_mla_mask_rule_matches_the_contract(causal, heads):
    from triton_ops.attention import mla_sm90 as G

    key_span = _on_host(G._key_span, key_range=_on_host(key_range))
    start, mask_tile = _on_host(G._start), _on_host(G._mask_tile)
    page, block_m = G.PAGE.value, G.BLOCK_M.value
    for sq, sk in itertools.product((1, 2, 3), (0, 1, 5, 63, 64, 65, 150)):
        kept = torch.zeros(sq * heads, sk + page + PAD, dtype=torch.bool)
        for r0 in range(0, sq * heads, block_m):
            seq = torch.tensor([sk])
            sk_, lo, hi, p0, n = key_span(seq, 0, 0, r0, 1 << 20, 1 << 20, sq, heads, causal)
            rows, q_pos, _, _, _ = start(r0, sk_, sq, heads)
            for t in range(int(n)):
                k0 = (int(p0) + t) * page
                s = mask_tile(torch.zeros(block_m, page).as_subclass(_Scores), k0, lo, hi, True, q_pos, causal)
                inside = rows < sq * heads
                kept[rows[inside], k0:k0 + page] = (s == 0)[inside]
        for h in range(heads):
            _check(kept[h::heads], sq, sk, causal, (-1, -1), f"gluon mla, head {h} of {heads}")
