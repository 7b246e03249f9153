"""Static persistent tile scheduler over groups (MoE experts) of a contiguous grouped GEMM.

Problem: out[rows of group g, :] = A[rows of group g, :] @ B[g].T for G groups whose rows are contiguous in A / out:
group g owns rows [offsets[g], offsets[g + 1]) (`moe_align`'s `expert_offsets`, a device int32 tensor [G + 1]).
The extents are data, so the tile count is only known on the device: every CTA walks the same deterministic order
and needs no host sync, no atomics, no per-tile metadata tensor.

Linear tile order (the one definition, shared by the Python model below and the device code):
  groups in order; inside group g (m_tiles(g) = ceil(rows_g / block_m) row tiles, n_tiles column tiles), the
  row tile is fastest: local index = n_tile * m_tiles(g) + m_tile. Concurrently running CTAs (consecutive
  indices) then read the same B[g] column tile (the big MoE operand) once from DRAM and the rest from L2.
Persistent walk: CTA c of a grid of P handles tiles c, c + P, c + 2P, ... It keeps a cursor (group g, index base
of g's first tile) that only moves forward, so finding the group of each next tile costs O(groups skipped), and a
whole CTA's walk costs O(G + its tiles) loads of `offsets`.

Row bounds: a tile covers rows [offsets[g] + m_tile * block_m, +block_m) clipped at row_end = offsets[g + 1]; the
epilogue predicates its stores on row < row_end (rows past it belong to the next group).

Bounded form (the sm_90 and sm_100 grouped GEMMs): group g owns rows [starts[g], starts[g] + counts[g]) (two device
int32 tensors [G]; groups need not be adjacent, ordered or aligned: the masked layout's groups start at g * max_m, the
contiguous layout's where the expert's rows begin). Same linear order and walk, with rows_g = counts[g]; the
offsets form is the special case starts = offsets[:-1], counts = offsets[1:] - offsets[:-1]. The sm_100 block-scaled
kernel addresses a tile by its row tile row_start / block_m, so it needs every starts[g] to be a multiple of block_m
(128, or its swap-AB token tile; its scale atoms are 128 rows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

try:  # the device twins need the DSL; the Python model does not
    import cutlass
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None


@dataclasses.dataclass(frozen=True)
class GroupTile:
    group: int
    m_tile: int  # row tile inside the group
    n_tile: int  # column tile
    row_start: int  # first row of the tile in A / out
    row_end: int  # one past the last row the tile may write (the group's end)


def group_m_tiles(offsets: Sequence[int], block_m: int) -> list[int]:
    """Row tiles per group: ceil(rows_g / block_m) (0 for an empty group)."""
    return [-(-(offsets[g + 1] - offsets[g]) // block_m) for g in range(len(offsets) - 1)]


def total_tiles(offsets: Sequence[int], block_m: int, n_tiles: int) -> int:
    return sum(group_m_tiles(offsets, block_m)) * n_tiles


def tile_of(t: int, offsets: Sequence[int], block_m: int, n_tiles: int) -> GroupTile | None:
    """The tile with linear index t (None past the last tile), by a scan from group 0."""
    starts, counts = bounds_of_offsets(offsets)
    return _walk(t, 0, 0, starts, counts, block_m, n_tiles)[0]


def cta_tiles(cta: int, grid: int, offsets: Sequence[int], block_m: int, n_tiles: int) -> list[GroupTile]:
    """The tiles persistent CTA `cta` of `grid` handles, in order, with the forward-only cursor of the device code."""
    return cta_tiles_bounded(cta, grid, *bounds_of_offsets(offsets), block_m, n_tiles)


def bounds_of_offsets(offsets: Sequence[int]) -> tuple[list[int], list[int]]:
    """(starts, counts) of the offsets form."""
    return list(offsets[:-1]), [offsets[g + 1] - offsets[g] for g in range(len(offsets) - 1)]


def cta_tiles_bounded(cta: int, grid: int, starts: Sequence[int], counts: Sequence[int], block_m: int,
                      n_tiles: int) -> list[GroupTile]:
    """cta_tiles for groups given as (starts, counts): the walk of BoundedTileScheduler."""
    out, g, base, t = [], 0, 0, cta
    while True:
        tile, g, base = _walk(t, g, base, starts, counts, block_m, n_tiles)
        if tile is None:
            return out
        out.append(tile)
        t += grid


def _walk(t, g, base, starts, counts, block_m, n_tiles):
    """Move the cursor (g, base) forward to the group holding tile t; mirrors GroupedTileScheduler.seek/coords."""
    groups = len(counts)
    while g < groups and t >= base + -(-counts[g] // block_m) * n_tiles:
        base += -(-counts[g] // block_m) * n_tiles
        g += 1
    if g >= groups:
        return None, g, base
    m_tiles = -(-counts[g] // block_m)
    local = t - base
    m_tile, n_tile = local % m_tiles, local // m_tiles
    row_start = starts[g] + m_tile * block_m
    return GroupTile(g, m_tile, n_tile, row_start, starts[g] + counts[g]), g, base


# ----------------------------------------------------------------------------------------------- device


if cutlass is not None:
    import cutlass.cute as cute

    class GroupedTileScheduler:
        """Device twin of the model above; construct and call inside a @cute.kernel.

        offsets: int32 gmem tensor [num_groups + 1]; num_groups, block_m, n_tiles static. State is three Int32
        values the caller carries through its persistent loop: t (linear tile), g (group cursor), base (index of g's
        first tile); `g == num_groups` means done:

            t = Int32(bidx); g, base = sched.seek(t, Int32(0), Int32(0))
            while g < sched.num_groups:
                m_tile_global, n_tile, row_start, row_end = sched.coords(t, g, base)
                ...
                t += grid
                g, base = sched.seek(t, g, base)
        """

        def __init__(self, offsets, num_groups: int, block_m: int, n_tiles: int):
            self.offsets = offsets
            self.num_groups = num_groups
            self.block_m = block_m
            self.n_tiles = n_tiles

        # Loop-carried through the caller's dynamic `while` (it calls methods on it): the DSL rebuilds it from these
        def __extract_mlir_values__(self):
            return cutlass.extract_mlir_values(self.offsets)

        def __new_from_mlir_values__(self, values):
            offsets = cutlass.new_from_mlir_values(self.offsets, values)
            return GroupedTileScheduler(offsets, self.num_groups, self.block_m, self.n_tiles)

        def _rows(self, g):
            return self.offsets[g + 1] - self.offsets[g]

        def _group_tiles(self, g):
            return (self._rows(g) + (self.block_m - 1)) // self.block_m * self.n_tiles

        def _in_later_group(self, t, g, base):
            # g is clamped for the load only: once g == num_groups the first term is false anyway
            gc = cutlass.min(g, cutlass.Int32(self.num_groups - 1))
            return (g < self.num_groups) & (t >= base + self._group_tiles(gc))

        @cute.jit
        def seek(self, t, g, base):
            """Advance the cursor (g, base) until g holds tile t, or g == num_groups (t is past the last tile)."""
            more = self._in_later_group(t, g, base)
            while more:
                base = base + self._group_tiles(g)
                g = g + 1
                more = self._in_later_group(t, g, base)
            return g, base

        def coords(self, t, g, base):
            """(row tile of A/out counted from row 0 = row_start // block_m, column tile, row_start, row_end) of
            tile t, which lies in group g (whose first tile is `base`). Needs offsets[g] % block_m == 0 for the
            first value to be the tile index of row_start."""
            m_tiles = (self._rows(g) + (self.block_m - 1)) // self.block_m
            local = t - base
            m_tile = local % m_tiles
            n_tile = local // m_tiles
            row_start = self.offsets[g] + m_tile * self.block_m
            return row_start // self.block_m, n_tile, row_start, self.offsets[g + 1]


    class BoundedTileScheduler(GroupedTileScheduler):
        """GroupedTileScheduler over groups given as (starts, counts): int32 gmem tensors [num_groups], counts >= 0.
        Same walk (`seek`); `coords` returns the row tile counted inside the group (the kernel's per-group TMA
        descriptor starts at the group's first row), the column tile, row_start and row_end = starts[g] + counts[g]."""

        def __init__(self, starts, counts, num_groups: int, block_m: int, n_tiles: int):
            super().__init__(None, num_groups, block_m, n_tiles)
            self.starts = starts
            self.counts = counts

        def __extract_mlir_values__(self):
            return cutlass.extract_mlir_values(self.starts) + cutlass.extract_mlir_values(self.counts)

        def __new_from_mlir_values__(self, values):
            n = len(cutlass.extract_mlir_values(self.starts))
            starts = cutlass.new_from_mlir_values(self.starts, values[:n])
            counts = cutlass.new_from_mlir_values(self.counts, values[n:])
            return BoundedTileScheduler(starts, counts, self.num_groups, self.block_m, self.n_tiles)

        def _rows(self, g):
            return self.counts[g]

        def coords(self, t, g, base):
            rows = self.counts[g]
            start = self.starts[g]
            m_tiles = (rows + (self.block_m - 1)) // self.block_m
            local = t - base
            m_tile = local % m_tiles
            n_tile = local // m_tiles
            return m_tile, n_tile, start + m_tile * self.block_m, start + rows
