"""Hopper warpgroup-MMA pieces of the sm90 attention kernel: SMEM layouts, accumulator views, the GEMM issue.

A WGMMA accumulator fragment (per thread, m64nNk16 atom) has the layout ((2, 2, N / 8), MMA_M, MMA_N): mode 0 is
(column pair, row half (+8), 8-column block). Thread t of a warpgroup holds rows (t % 128) // 32 * 16 + (t % 32) // 4
and that + 8, and in each 8-column block the columns 2 * (t % 4) and 2 * (t % 4) + 1, so one row is spread over the
4 threads of a quad (lanes 4q .. 4q + 3): row reductions take two butterfly shuffles (xor 1, xor 2).

`acc_mn` re-views such a fragment as (rows, columns) = ((2, MMA_M), (2, N / 8, MMA_N)) without moving a register;
`acc_as_a` re-views it as the A operand fragment of a register-sourced WGMMA ((2, 2, 2), MMA_M, (N / 16, MMA_N)),
which is how P = softmax(S) feeds O += P V straight from registers (the same element order: a 16-bit copy of the
fp32 accumulator is the A fragment).
"""

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import warpgroup
    from cutlass.tensor_utils import LayoutEnum
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None


if cutlass is not None:

    def smem_layout(dtype, rows: int, cols: int, stages: int | None = None):
        """Row-major (cols contiguous) swizzled SMEM tile for WGMMA and TMA: the widest swizzle atom that divides
        `cols`, tiled over (rows, cols[, stages])."""
        atom = warpgroup.make_smem_layout_atom(sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols),
                                               dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))

    def transpose_view(t):
        """(a, b, ...) -> (b, a, ...) view of an SMEM tensor (V as the MN-major B operand of O += P V)."""
        shape = (t.shape[1], t.shape[0], *t.shape[2:])
        order = (1, 0, *range(2, cute.rank(t)))
        return cute.composition(t, cute.make_ordered_layout(shape, order=order))

    def _acc_mn_layout(layout):
        flat = cute.make_layout(layout.shape)  # compact: (2, 2, V), M, N in register order
        shape = ((flat.shape[0][1], flat.shape[1]), (flat.shape[0][0], flat.shape[0][2], flat.shape[2]))
        stride = ((flat.stride[0][1], flat.stride[1]), (flat.stride[0][0], flat.stride[0][2], flat.stride[2]))
        return cute.composition(layout, cute.make_layout(shape, stride=stride))

    def acc_mn(t):
        """(rows, columns) view of a WGMMA accumulator fragment (or of a like-shaped 16-bit copy)."""
        return cute.make_tensor(t.iterator, _acc_mn_layout(t.layout))

    def acc_as_a(t):
        """The A-operand view of an accumulator-shaped fragment: ((2, 2, 2), MMA_M, (N / 16, MMA_N))."""
        lay = cute.logical_divide(t.layout, ((None, None, 2), None, None))
        shape = ((lay.shape[0][0], lay.shape[0][1], lay.shape[0][2][0]), lay.shape[1],
                 (lay.shape[0][2][1], lay.shape[2]))
        stride = ((lay.stride[0][0], lay.stride[0][1], lay.stride[0][2][0]), lay.stride[1],
                  (lay.stride[0][2][1], lay.stride[2]))
        return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))

    @cute.jit
    def gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
             zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[bool] = True):
        """acc (+)= a b over the K blocks of the fragments, issued as one WGMMA group, and waited for unless
        `wait` is False (then the caller waits with warpgroup.wait_group(0) before touching acc or a). A fresh atom
        per call: its ACCUMULATE field is rewritten here (a shared one would carry the field across call sites)."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for k in cutlass.range_constexpr(cute.size(a.shape[2])):
            cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        if cutlass.const_expr(wait):
            warpgroup.wait_group(0)

    @cute.jit
    def quad_max(x, portable: cutlass.Constexpr[bool] = False):
        """Max over the 4 threads of a quad (the threads sharing an accumulator row). `portable`: the calling
        thread's value alone (no shuffles: host runs of the per-thread code, one thread standing for its quad)."""
        if cutlass.const_expr(not portable):
            x = cutlass.max(x, cute.arch.shuffle_sync_bfly(x, offset=2))
            x = cutlass.max(x, cute.arch.shuffle_sync_bfly(x, offset=1))
        return x

    @cute.jit
    def quad_sum(x, portable: cutlass.Constexpr[bool] = False):
        if cutlass.const_expr(not portable):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=2)
            x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
        return x
