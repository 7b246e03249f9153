"""Varlen tile scheduling from cu_seqlens_q: which (batch, query tile, query head) a CTA works on.

One CTA per tile (PACKED), and a persistent form of it (the sm90 kernel's `persistent` field):

* PACKED grid = (packed_grid_size(total_q, B, Hq, tile_m),), no CTA beyond the last real tile but the bound's
         slack: sum_b ceil(sq_b / tile_m) <= (total_q + B * (tile_m - 1)) // tile_m, so the host needs only
         total_q (= q.shape[0]) and B, never a copy of cu_seqlens. A CTA maps its linear index to a tile by a
         warp-wide scan of cu_seqlens_q: lane i of a 32-batch chunk counts sequence base+i's tiles
         (ceil(sq / tile_m) * Hq), an inclusive shuffle-up scan and a ballot find the first sequence whose running
         total passes the index. Within a sequence, heads vary fastest (query heads of one KV head share K/V
         tiles in L2) and, with reverse_m (causal), the last query tile -- the one with the most keys -- goes
         first.

* PERSISTENT grid = (number of SMs,); CTA c walks PACKED work items c, c + grid, c + 2 grid, ... (each mapped by
         the same scan) until one lies past the last tile: a static round-robin over the PACKED order, so with
         reverse_m the longest tiles of a sequence are dealt out first.

`packed_tile` (host) runs the same chunked algorithm on a list, so the CPU tests check the device arithmetic
(bijection with the real tiles, the bound, the order) without a GPU; `persistent_tiles` is the persistent walk.
"""

from __future__ import annotations

WARP = 32

try:
    import cutlass
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None


def num_m_blocks(sq: int, tile_m: int) -> int:
    return max(sq, 0) // tile_m + (1 if max(sq, 0) % tile_m else 0)


def packed_grid_size(total_q: int, batch: int, heads: int, tile_m: int) -> int:
    """Upper bound on the number of (tile, head) work items, from host-known sizes only."""
    return (max(total_q, 0) + batch * (tile_m - 1)) // tile_m * heads


def real_tiles(cu_seqlens_q: list[int], heads: int, tile_m: int) -> set[tuple[int, int, int]]:
    """Every (b, m_block, h) some CTA must handle."""
    out = set()
    for b in range(len(cu_seqlens_q) - 1):
        for m in range(num_m_blocks(cu_seqlens_q[b + 1] - cu_seqlens_q[b], tile_m)):
            out.update((b, m, h) for h in range(heads))
    return out


def packed_tile(cu_seqlens_q: list[int], tile_idx: int, heads: int, tile_m: int,
                reverse_m: bool = False) -> tuple[int, int, int] | None:
    """(b, m_block, h) of linear work item tile_idx, or None past the last one: the device algorithm, lane by
    lane (32-sequence chunks, inclusive scan, first lane whose running total exceeds tile_idx)."""
    batch = len(cu_seqlens_q) - 1
    base, before = 0, 0
    while base < batch:
        counts = []
        for lane in range(WARP):
            b = base + lane
            counts.append(num_m_blocks(cu_seqlens_q[b + 1] - cu_seqlens_q[b], tile_m) * heads if b < batch else 0)
        incl = [sum(counts[:i + 1]) for i in range(WARP)]
        hits = [lane for lane in range(WARP) if before + incl[lane] > tile_idx]
        if hits:
            first = hits[0]
            local = tile_idx - before - (incl[first] - counts[first])
            n_m = counts[first] // heads
            m, h = divmod(local, heads)
            return base + first, (n_m - 1 - m) if reverse_m else m, h
        before += incl[-1]
        base += WARP
    return None


def persistent_tiles(cu_seqlens_q: list[int], cta: int, grid: int, heads: int, tile_m: int,
                     reverse_m: bool = False) -> list[tuple[int, int, int]]:
    """The (b, m_block, h) tiles persistent CTA `cta` of `grid` handles, in order (the device loop)."""
    out, idx = [], cta
    while (tile := packed_tile(cu_seqlens_q, idx, heads, tile_m, reverse_m)) is not None:
        out.append(tile)
        idx += grid
    return out


# ------------------------------------------------------------------------------------------ device side


if cutlass is not None:
    import cutlass.cute as cute
    from cutlass import Int32

    @cute.jit
    def packed_tile_device(cu_seqlens_q: cute.Tensor, num_batch: Int32, tile_idx: Int32, heads: Int32,
                           tile_m: cutlass.Constexpr[int], reverse_m: cutlass.Constexpr[bool]):
        """(b, m_block, h, valid) of work item tile_idx; every lane of the calling warp must call it (it
        shuffles and votes). Warp-uniform result."""
        lane = cute.arch.lane_idx()
        before = Int32(0)
        b_found = Int32(-1)
        local = Int32(0)
        n_m_found = Int32(0)
        # A counted loop over 32-sequence chunks (ceil(B / 32) trips, uniform), selects instead of branches.
        for chunk in cutlass.range((num_batch + WARP - 1) // WARP, unroll=1):
            b = chunk * WARP + lane
            n_m = Int32(0)
            if b < num_batch:
                sq = cutlass.max(cu_seqlens_q[b + 1] - cu_seqlens_q[b], Int32(0))
                n_m = (sq + (tile_m - 1)) // tile_m
            cnt = n_m * heads
            incl = cnt
            for k in cutlass.range_constexpr(5):
                t = cute.arch.shuffle_sync_up(incl, 1 << k)
                incl = incl + (t if lane >= (1 << k) else Int32(0))
            hit = cute.arch.vote_ballot_sync(before + incl > tile_idx)
            first = cute.arch.popc((hit & (Int32(0) - hit)) - 1)  # lowest set bit (32 when none: unused)
            src = first & (WARP - 1)
            excl_first = cute.arch.shuffle_sync(incl - cnt, src)
            n_m_first = cute.arch.shuffle_sync(n_m, src)
            total = cute.arch.shuffle_sync(incl, WARP - 1)
            now = (b_found < 0) & (hit != 0)
            local = (tile_idx - before - excl_first) if now else local
            n_m_found = n_m_first if now else n_m_found
            before = (before + total) if (b_found < 0) & (hit == 0) else before
            b_found = (chunk * WARP + first) if now else b_found
        m_block = local // heads
        h = local - m_block * heads
        if cutlass.const_expr(reverse_m):
            m_block = n_m_found - 1 - m_block
        return b_found, m_block, h, b_found >= 0

    @cute.jit
    def cta_tile(cu_seqlens_q: cute.Tensor, num_batch: Int32, heads: Int32, tile_m: cutlass.Constexpr[int],
                 reverse_m: cutlass.Constexpr[bool]):
        """(b, m_block, h, valid) of the calling CTA, PACKED (every lane of the calling warp takes part)."""
        bx, _, _ = cute.arch.block_idx()
        return packed_tile_device(cu_seqlens_q, num_batch, bx, heads, tile_m, reverse_m)

    def launch_grid(total_q, num_batch, heads, tile_m: int):
        """The PACKED grid from traced host values (total_q = q.shape[0], B = len(cu_seqlens_q) - 1)."""
        return ((total_q + num_batch * (tile_m - 1)) // tile_m * heads, 1, 1)

    def sequence_tiles(spec, cu_seqlens_q, cu_seqlens_k, b, m_block, left, right, tile_m: int, tile_n: int):
        """(q_start, sq, k_start, sk, n_lo, n_tiles, full_lo, full_hi): sequence b's rows and the key tiles query
        tile m_block visits (mask.tile_range), from traced device values."""
        from .mask import tile_range

        q_start = cu_seqlens_q[b]
        sq = cu_seqlens_q[b + 1] - q_start
        k_start = cu_seqlens_k[b]
        sk = cu_seqlens_k[b + 1] - k_start
        return (q_start, sq, k_start, sk, *tile_range(spec, m_block, sq, sk, left, right, tile_m, tile_n))
