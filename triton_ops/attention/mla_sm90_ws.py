"""The warp-specialized schedules of the sm_90 Gluon MLA decode (PINGPONG and its variants): a TMA partition and
two compute warpgroups owning alternate key tiles. The shapes, the schedules and the measurements are described in
mla_sm90.py's module docstring, which launches these kernels (`_kernel_and_consts`)."""

from __future__ import annotations

import triton.language as tl

from triton_ops.attention.mla_sm90 import (
    BLOCK_M,
    D_NOPE,
    NOPE,
    PAGE,
    ROPE_W,
    _cta_barrier,
    _key_span,
    _softmax_tile,
    _store_out,
    _tma_load,
    _zero_rows_from,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

HALF: tl.constexpr = tl.constexpr(NOPE // 2)
# Registers per thread of each compute warpgroup (setmaxnreg): 12 warps at launch hold 168 each; the TMA
# partition keeps the rest (24).
WS_REGS: tl.constexpr = tl.constexpr(240)


@gluon.jit
def _ws_producer(q_desc, qr_desc, kn_desc, kr_desc, q_smem, qr_smem, kn_smem, kr_smem, q_bar, full_n, full_r, empty_n,
                 empty_r, bt_row, q_row, p0, n_tiles, num_blocks, NCH: gl.constexpr, R1: gl.constexpr,
                 SB: gl.constexpr = False):
    """PINGPONG's TMA partition: Q once, then key tile t into slot s = t % 2 in three parts, each as soon as the
    warpgroups are done with that part of tile t - 2: the NoPE half h = s (warpgroup s's O columns: free when
    warpgroup s is done with the tile), the other half, the RoPE part (which held P: free when both are done).
    SB: the tiles two at a time (slot 0, slot 1), so that every barrier index is a constant."""
    if n_tiles > 0:
        mbarrier.expect(q_bar, 2 * NCH * q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        for h in gl.static_range(2):
            for c in gl.static_range(NCH):
                _tma_load(q_desc, [q_row, h * HALF + c * (HALF // NCH)], q_bar, _chunk(q_smem.index(h), c, NCH))
        _tma_load(qr_desc, [q_row, D_NOPE], q_bar, qr_smem.index(0))
    if SB:
        for t2 in range(0, n_tiles, 2):
            _ws_load_tile(t2, 0, 0, kn_desc, kr_desc, kn_smem, kr_smem, full_n, full_r, empty_n, empty_r, bt_row, p0,
                          num_blocks, NCH, R1, SB)
            if t2 + 1 < n_tiles:
                _ws_load_tile(t2 + 1, 1, 1, kn_desc, kr_desc, kn_smem, kr_smem, full_n, full_r, empty_n, empty_r,
                              bt_row, p0, num_blocks, NCH, R1, SB)
    else:
        for t in range(n_tiles):
            _ws_load_tile(t, 0, t % 2, kn_desc, kr_desc, kn_smem, kr_smem, full_n, full_r, empty_n, empty_r, bt_row, p0,
                          num_blocks, NCH, R1, SB)


@gluon.jit
def _ws_load_tile(t, S: gl.constexpr, s_dyn, kn_desc, kr_desc, kn_smem, kr_smem, full_n, full_r, empty_n, empty_r,
                  bt_row, p0, num_blocks, NCH: gl.constexpr, R1: gl.constexpr, SB: gl.constexpr):
    """Key tile t into slot s_dyn (= t % 2; SB: = the constant S, which indexes the barriers): the owner's NoPE half,
    the other half, the RoPE part."""
    s = s_dyn
    page = gl.load(bt_row + p0 + t)
    row = gl.where((page >= 0) & (page < num_blocks), page, num_blocks) * PAGE  # past the end: zero fill
    for k in gl.static_range(2):
        h = s * (1 - k) + (1 - s) * k  # the owner's half first
        if t >= 2:
            mbarrier.wait(_mbs(empty_n, 2 * s + h, 2 * S + S * (1 - k) + (1 - S) * k, SB), (t // 2 - 1) & 1)
        for c in gl.static_range(NCH):  # NCH column chunks per half, each on its own barrier
            bar = _mbs(full_n[c], 2 * s + h, 2 * S + S * (1 - k) + (1 - S) * k, SB)
            mbarrier.expect(bar, kn_desc.block_type.nbytes)
            _tma_load(kn_desc, [row, h * HALF + c * (HALF // NCH)], bar, _chunk(kn_smem.index(2 * s + h), c, NCH))
    if t >= 2:
        if R1:  # one release per warpgroup and slot: both warpgroups' (the halves' barriers)
            mbarrier.wait(_mbs(empty_n, 2 * s, 2 * S, SB), (t // 2 - 1) & 1)
            mbarrier.wait(_mbs(empty_n, 2 * s + 1, 2 * S + 1, SB), (t // 2 - 1) & 1)
        else:
            mbarrier.wait(_mbs(empty_r, s, S, SB), (t // 2 - 1) & 1)
    mbarrier.expect(_mbs(full_r, s, S, SB), kr_desc.block_type.nbytes)
    _tma_load(kr_desc, [row, D_NOPE], _mbs(full_r, s, S, SB), kr_smem.index(s))


@gluon.jit
def _chunk(buf, c: gl.constexpr, NCH: gl.constexpr):
    """Column chunk c of NCH of a [rows, 256] buffer (the buffer itself when NCH = 1)."""
    if NCH == 1:
        return buf
    else:
        return buf.slice(c * (HALF // NCH), HALF // NCH, dim=1)


@gluon.jit
def _mbs(bars, i, I: gl.constexpr, SB: gl.constexpr):
    """mbarrier i of a barrier group: SB, a tuple of single-barrier allocations indexed by the constant I (= i),
    else an array indexed by i."""
    if SB:
        bar = bars[I]
    else:
        bar = bars.index(i)
    return bar


@gluon.jit
def _ws_other(j, o, m_i, kn_smem, kr_smem, ml_smem, sm_bar, W: gl.constexpr, R1: gl.constexpr, SB: gl.constexpr,
              s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Wait for the owner of tile j to publish P_j (in the RoPE part of its buffer, whose S is done) and the
    running (m_j, l_j); rescale O to m_j and issue O += P_j V_j on this warpgroup's 256 columns (async)."""
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    if SB:  # j is the other warpgroup's tile: j % 2 = 1 - W, a constant
        so: gl.constexpr = 1 - W
        mbarrier.wait(sm_bar[so], (j // 2) & 1)
    else:
        so = j % 2
        mbarrier.wait(sm_bar.index(so), (j // 2) & 1)
    if R1 or SB:  # m and l of slot s in allocations of their own (no CTA barrier between their loads and stores)
        m_j = ml_smem[1 - W].load(row_layout)
        l_j = ml_smem[3 - W].load(row_layout)
    else:
        m_j = ml_smem[0].index(2 * so).load(row_layout)
        l_j = ml_smem[0].index(2 * so + 1).load(row_layout)
    alpha = gl.exp2(m_i - gl.where(m_j == float("-inf"), 0.0, m_j))
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout), assert_trivial=True), 1)
    o = warpgroup_mma(kr_smem.index(so), kn_smem.index(2 * so + W), o, is_async=True)
    return o, m_j, l_j


@gluon.jit
def _ws_release(o, slot: gl.constexpr, empty_n, empty_r, W: gl.constexpr, R1: gl.constexpr, SB: gl.constexpr,
                RA: gl.constexpr = 0, p_a=None):
    """Wait for every MMA of warpgroup W, then release its NoPE half of buffer `slot` and its share of the RoPE
    part (one arrival each for the four warps; R1: the half's arrival alone, which the producer also waits for
    before the RoPE part: one arrival, and one barrier fewer, per release)."""
    if RA:  # the register A operand (the owner's P) stays live until its MMA is done
        o, _ = warpgroup_mma_wait(0, deps=(o, p_a))
    else:
        o = warpgroup_mma_wait(0, deps=(o, ))
    _cta_barrier()
    mbarrier.arrive(_mbs(empty_n, 2 * slot + W, 2 * slot + W, SB))
    if not R1:  # (R1: the producer takes the half's arrival for the RoPE part too)
        mbarrier.arrive(_mbs(empty_r, slot, slot, SB))
    return o


@gluon.jit
def _ws_pair(j, OTHER: gl.constexpr, HAS_OWN: gl.constexpr, W: gl.constexpr, PV_FIRST: gl.constexpr,
             NCH: gl.constexpr, R1: gl.constexpr, RA: gl.constexpr, SB: gl.constexpr, o, m_i, l_i,
             q_smem, qr_smem, kn_smem, kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0,
             num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr):
    """Warpgroup W's share of tiles j (the other warpgroup's) and j + 1 (its own, slot W: HAS_OWN). Issue
    S_{j+1} = Q K_{j+1}^T part by part as the parts land; consume P_j (`_ws_other`); the softmax of tile j + 1,
    chained on (m_j, l_j); publish P_{j+1} and (m_{j+1}, l_{j+1}) and issue O += P_{j+1} V_{j+1}. OTHER = 0: no
    tile j (warpgroup 0's tile 0). The P V of tile j runs under the softmax of tile j + 1; PV_FIRST: P V of tile
    j runs (and tile j is released) before the wait for tile j + 1's load, so a late load never holds up the
    release that the refill of tile j + 2 waits for (the softmax then runs beside the other warpgroup's MMAs
    only). RA: the own P V takes P from registers (wgmma's register A operand), issued before P is published
    (RA = 1) or right after (RA = 2).
    SB: every mbarrier its own allocation (constant slot indices). Every MMA retires inside the call (nothing in
    flight across a back edge). Tile j is always in slot 1 - W, tile j + 1 in slot W."""
    SO: gl.constexpr = 1 - W
    if OTHER and PV_FIRST:
        o, m_i, l_i = _ws_other(j, o, m_i, kn_smem, kr_smem, ml_smem, sm_bar, W, R1, SB, s_layout, o_layout)
        o = _ws_release(o, SO, empty_n, empty_r, W, R1, SB)
    if HAS_OWN:
        t = j + 1
        k0 = (p0 + t) * PAGE
        ph = (t // 2) & 1
        if k0 + PAGE > sk:  # the sequence's last page: its rows past sk are zeroed before any P V
            for c in gl.static_range(2 * NCH):
                mbarrier.wait(_mbs(full_n[c % NCH], 2 * W + c // NCH, 2 * W + c // NCH, SB), ph)
            _zero_rows_from(kn_smem.index(2 * W), sk - k0, 4)
            _zero_rows_from(kn_smem.index(2 * W + 1), sk - k0, 4)
        # Q's buffer index (t >> 30 = 0) is opaque to the compiler: the Q descriptors are rebuilt per tile instead
        # of being hoisted out of the loop (36 64-bit values: spills)
        qz = t >> 30
        s = gl.zeros([BLOCK_M, PAGE], gl.float32, s_layout)
        for k in gl.static_range(2 * NCH):  # the own half first, chunk by chunk as the chunks land
            hk = (W + k // NCH) % 2
            mbarrier.wait(_mbs(full_n[k % NCH], 2 * W + (W + k // NCH) % 2, 2 * W + (W + k // NCH) % 2, SB), ph)
            s = warpgroup_mma(_chunk(q_smem.index(hk + qz), k % NCH, NCH),
                              _chunk(kn_smem.index(2 * W + hk), k % NCH, NCH).permute((1, 0)), s, use_acc=k > 0,
                              is_async=True)
        mbarrier.wait(_mbs(full_r, W, W, SB), ph)
        s = warpgroup_mma(qr_smem.index(qz), kr_smem.index(W).permute((1, 0)), s, is_async=True)
    if OTHER and not PV_FIRST:
        o, m_i, l_i = _ws_other(j, o, m_i, kn_smem, kr_smem, ml_smem, sm_bar, W, R1, SB, s_layout, o_layout)
    if HAS_OWN:
        page = gl.load(bt_row + p0 + t)
        s = warpgroup_mma_wait(0 + (OTHER and not PV_FIRST), deps=(s, ))  # S done; P_j V_j may still run
        p, m_i, l_i, alpha = _softmax_tile(s, k0, lo, hi, (page >= 0) & (page < num_blocks), q_pos, m_i, l_i,
                                           qk_scale, CAUSAL)
    if OTHER and not PV_FIRST:
        o = _ws_release(o, SO, empty_n, empty_r, W, R1, SB)
    if HAS_OWN:
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout), assert_trivial=True), 1)
        p16 = p.to(gl.bfloat16)
        if RA:  # the own P V from registers: it does not wait for P's round trip through shared memory
            p_a = gl.convert_layout(p16, gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
            if RA == 1:  # issued before P is published (RA = 2: after)
                o = warpgroup_mma(p_a, kn_smem.index(2 * W + W), o, is_async=True)
        kr_smem.index(W).store(p16)
        if R1 or SB:
            ml_smem[W].store(m_i)
            ml_smem[2 + W].store(l_i)
        else:
            ml_smem[0].index(2 * W).store(m_i)
            ml_smem[0].index(2 * W + 1).store(l_i)
        fence_async_shared()
        _cta_barrier()  # P_{j+1} and (m, l) complete: publish them
        mbarrier.arrive(_mbs(sm_bar, W, W, SB))
        if RA:
            if RA == 2:
                o = warpgroup_mma(p_a, kn_smem.index(2 * W + W), o, is_async=True)
            o = _ws_release(o, W, empty_n, empty_r, W, R1, SB, True, p_a)
        else:
            o = warpgroup_mma(kr_smem.index(W), kn_smem.index(2 * W + W), o, is_async=True)
            o = _ws_release(o, W, empty_n, empty_r, W, R1, SB)
    return o, m_i, l_i


@gluon.jit
def _ws_compute(W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, sm_bar,
                empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0, b, split, qk_scale, out_ptr,
                lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
                CAUSAL: gl.constexpr, FINAL: gl.constexpr, PV_FIRST: gl.constexpr, NCH: gl.constexpr,
                R1: gl.constexpr, RA: gl.constexpr, SB: gl.constexpr):
    """Compute warpgroup W of PINGPONG: the S and softmax of tiles t = W (mod 2), O columns [256 W, 256 W + 256)
    of every tile, then its half of the epilogue."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PAGE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = r0 + gl.arange(0, BLOCK_M, layout=row_layout)
    q_pos = sk - SQ + rows // H
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)
    o = gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        if W == 0:  # tile 0: warpgroup 0's, no other tile before it
            o, m_i, l_i = _ws_pair(-1, False, True, W, PV_FIRST, NCH, R1, RA, SB, o, m_i, l_i, q_smem, qr_smem, kn_smem,
                                   kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks,
                                   lo, hi, sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
        # pairs (j, j + 1), j the other warpgroup's tile: j = 1, 3, ... (warpgroup 0), 0, 2, ... (1)
        n_pairs = (n_tiles - 1 + W) // 2
        for i in range(n_pairs):
            o, m_i, l_i = _ws_pair(2 * i + 1 - W, True, True, W, PV_FIRST, NCH, R1, RA, SB, o, m_i, l_i, q_smem,
                                   qr_smem, kn_smem, kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row,
                                   p0, num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
        j_last = 2 * n_pairs + 1 - W
        if j_last == n_tiles - 1:  # the last tile is the other warpgroup's: its P V alone
            o, m_i, l_i = _ws_pair(j_last, True, False, W, PV_FIRST, NCH, R1, RA, SB, o, m_i, l_i, q_smem, qr_smem,
                                   kn_smem, kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0,
                                   num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
    # Epilogue: this warpgroup's 256 columns; warpgroup 0 writes the LSE.
    _store_out(o, m_i, l_i, rows, W * HALF, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
               l_sp, SQ, H, FINAL, W == 0)


@gluon.jit
def _mbar(count: gl.constexpr):
    """One initialised mbarrier in an allocation of its own."""
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=count)
    return bar


@gluon.jit
def _mbars2(count: gl.constexpr):
    return (_mbar(count), _mbar(count))


@gluon.jit
def _mbars4(count: gl.constexpr):
    return (_mbar(count), _mbar(count), _mbar(count), _mbar(count))


@gluon.jit(do_not_specialize=["num_blocks", "pages_per_split"])
def _mla_ws_kernel(q_desc, qr_desc, kn_desc, kr_desc, bt_ptr, seq_ptr, out_ptr, lse_ptr, qk_scale, num_blocks,
                   pages_per_split, max_pages, bt_sb, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
                   SQ: gl.constexpr, H: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
                   PV_FIRST: gl.constexpr, NCH: gl.constexpr, R1: gl.constexpr, RA: gl.constexpr = 0,
                   SB: gl.constexpr = False, num_warps: gl.constexpr = 4):
    """PINGPONG: the TMA loads (this partition, 4 warps) and the two compute warpgroups (worker partitions)."""
    b = gl.program_id(1)
    split = gl.program_id(2)
    r0 = gl.program_id(0) * BLOCK_M
    sk, lo, hi, p0, n_tiles = _key_span(seq_ptr, b, split, r0, pages_per_split, max_pages, SQ, H, CAUSAL)
    # Q as two 256-column halves + RoPE; key buffers: NoPE half h of slot s at index 2 s + h (warpgroup h's O
    # columns), the RoPE part (later P) of slot s. 64 + 8 + 4 x 32 + 2 x 8 KB.
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HALF], q_desc.layout)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_M, ROPE_W], qr_desc.layout)
    kn_smem = gl.allocate_shared_memory(gl.bfloat16, [4, PAGE, HALF], kn_desc.layout)
    kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, PAGE, ROPE_W], kr_desc.layout)
    ml_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    if R1 or SB:  # (m of slot 0, m of slot 1, l of slot 0, l of slot 1), each its own allocation
        ml_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
                   gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
                   gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
                   gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout))
    else:  # m, l of slot 0, m, l of slot 1
        ml_smem = (gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], ml_layout), )
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    # full barriers: chunk c of NoPE half h of slot s at full_n[c].index(2 s + h), one allocation per chunk (the
    # barrier pass separates two waits on one allocation by a CTA barrier, none between allocations); SB: every
    # barrier its own allocation (tuples indexed by constants)
    if SB:
        full_n = (_mbars4(1), _mbars4(1), _mbars4(1), _mbars4(1))
        empty_n = _mbars4(1)  # NoPE half h: only warpgroup h reads it after the owner's S
        full_r = _mbars2(1)
        empty_r = _mbars2(2)  # the RoPE part holds P, read by both warpgroups
        sm_bar = _mbars2(1)
    else:
        full_n = (gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),
                  gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),
                  gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),
                  gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()))
        empty_n = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        full_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        sm_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(NCH):
            for i in gl.static_range(4):
                mbarrier.init(full_n[c].index(i), count=1)
        for i in gl.static_range(4):
            mbarrier.init(empty_n.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(full_r.index(i), count=1)
            mbarrier.init(empty_r.index(i), count=2)
            mbarrier.init(sm_bar.index(i), count=1)
    bt_row = bt_ptr + b.to(gl.int64) * bt_sb
    q_row = (b * SQ * H + r0).to(gl.int32)
    # (The argument tuples are written out: a tuple assigned to a variable turns its constexprs into tensors.)
    gl.warp_specialize([(_ws_producer, (q_desc, qr_desc, kn_desc, kr_desc, q_smem, qr_smem, kn_smem, kr_smem, q_bar,
                                        full_n, full_r, empty_n, empty_r, bt_row, q_row, p0, n_tiles, num_blocks, NCH,
                                        R1, SB)),
                        (_ws_compute, (0, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, sm_bar,
                                       empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0, b, split,
                                       qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ,
                                       H, CAUSAL, FINAL, PV_FIRST, NCH, R1, RA, SB)),
                        (_ws_compute, (1, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, sm_bar,
                                       empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0, b, split,
                                       qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ,
                                       H, CAUSAL, FINAL, PV_FIRST, NCH, R1, RA, SB))],
                       [4, 4], [WS_REGS, WS_REGS])
