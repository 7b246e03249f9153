"""The 128x4 block-scale layout (cuBLASLt / CUTLASS / tcgen05 "scale factor atom"), once, in two forms.

One atom holds the scales of 128 rows x 4 scale blocks (k-blocks) in 512 bytes:

    byte(row, kb) = (row % 32) * 16 + ((row % 128) // 32) * 4 + kb % 4

and atoms tile K-block-major: atom (row // 128, kb // 4) starts at ((row // 128) * S4 / 4 + kb // 4) * 512, with
S4 = round_up(kblocks, 4). That is `dispatch.reference.quant.swizzle_scales_128x4` (the contract); lowbit's
quantizers write it with `scale_layout="swizzled"`, and a tcgen05 block-scaled MMA reads it with no reshuffle.

* `swizzled_offset` (pure torch, no DSL): (row, k-block) -> byte offset. CPU-tested equal, bit for bit, to the
  reference swizzle (tests/test_cute_gemm.py).
* `ATOM_SHAPE` / `ATOM_STRIDE`: the atom as a CuTe layout over (row, k-block) coordinates, as plain tuples;
  `crd2idx` evaluates such a layout in Python (the test checks it against `swizzled_offset` too).
* `scale_atom_layout(sf_vec)` / `scale_tensor_layout(shape_mkl, sf_vec)` (need the DSL, called inside
  `@cute.jit`): the same atom over *element* coordinates (row, k), stride 0 across the sf_vec elements one scale
  covers, tiled to a whole [rows, K, L] operand. The kernel builds its SFA / SFB tensors (and their TMA
  descriptors) from these, so the kernel and the tested layout are one definition.
"""

from __future__ import annotations

import torch

ATOM_ROWS = 128  # rows per atom (= UMMA M of one CTA)
ATOM_KBLOCKS = 4  # scale blocks per atom along K
ATOM_BYTES = ATOM_ROWS * ATOM_KBLOCKS
# (row, kblock) -> byte within one atom: row = r0 + 32 * r1 (r0 < 32, r1 < 4), kblock = k0 < 4
ATOM_SHAPE = ((32, 4), ATOM_KBLOCKS)
ATOM_STRIDE = ((16, 4), 1)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def swizzled_shape(rows: int, kblocks: int) -> tuple[int, int]:
    """The [rows, kblocks] container `swizzle_scales_128x4` returns (read it flat)."""
    return round_up(rows, ATOM_ROWS), round_up(kblocks, ATOM_KBLOCKS)


def swizzled_offset(row: torch.Tensor, kblock: torch.Tensor, kblocks: int) -> torch.Tensor:
    """Byte offset of scale (row, kblock) in the 128x4 layout of a [*, kblocks] scale matrix (int64, broadcasts)."""
    row, kblock = torch.as_tensor(row, dtype=torch.int64), torch.as_tensor(kblock, dtype=torch.int64)
    s4 = round_up(kblocks, ATOM_KBLOCKS)
    atom = (row // ATOM_ROWS) * (s4 // ATOM_KBLOCKS) + kblock // ATOM_KBLOCKS
    return atom * ATOM_BYTES + (row % 32) * 16 + ((row % ATOM_ROWS) // 32) * 4 + kblock % ATOM_KBLOCKS


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """[rows, kblocks] -> the swizzled container, by scattering through `swizzled_offset` (zero padding)."""
    rows, kblocks = scales.shape
    mp, sp = swizzled_shape(rows, kblocks)
    out = torch.zeros(mp * sp, dtype=scales.dtype, device=scales.device)
    r = torch.arange(rows, device=scales.device)[:, None]
    k = torch.arange(kblocks, device=scales.device)[None, :]
    out[swizzled_offset(r, k, kblocks).reshape(-1)] = scales.reshape(-1)
    return out.view(mp, sp)


def crd2idx(coord, shape, stride) -> int:
    """CuTe's coordinate -> index map for nested int tuples (a flat int coordinate is split colexicographically)."""
    if isinstance(shape, int):
        return int(coord) * stride
    if isinstance(coord, int):  # split an integer coordinate over the sub-modes, first mode fastest
        parts = []
        for s in shape:
            n = _size(s)
            parts.append(coord % n)
            coord //= n
        coord = tuple(parts)
    return sum(crd2idx(c, s, d) for c, s, d in zip(coord, shape, stride, strict=True))


def _size(shape) -> int:
    if isinstance(shape, int):
        return shape
    n = 1
    for s in shape:
        n *= _size(s)
    return n


# ------------------------------------------------------------------------------------- CuTe (device side)


def scale_atom_layout(sf_vec: int):
    """The atom over element coordinates ((32, 4), (sf_vec, 4)) : ((16, 4), (0, 1)): rows as ATOM_SHAPE[0], and
    each k-block widened to the sf_vec elements it scales (stride 0). Call inside @cute.jit."""
    import cutlass.cute as cute

    (r0, r1), kb = ATOM_SHAPE
    (s0, s1), skb = ATOM_STRIDE
    return cute.make_layout(((r0, r1), (sf_vec, kb)), stride=((s0, s1), (0, skb)))


def scale_tensor_layout(shape_mkl, sf_vec: int):
    """The scale layout of a whole K-major [rows, K, L] operand, over its element coordinates: atoms K-block-major
    (order (2, 1, 3): K tiles fastest, then rows, then L), each L slice = one `swizzle_scales_128x4` matrix.
    rows must be a multiple of 128 and K of 4 * sf_vec (the swizzled container's padding). Call inside @cute.jit."""
    import cutlass.cute as cute

    return cute.tile_to_shape(scale_atom_layout(sf_vec), shape_mkl, (2, 1, 3))
