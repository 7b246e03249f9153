"""The warp-specialized schedules of the sm_90 Gluon MLA decode kernel (mla_sm90.py: PINGPONG and its variants,
PAIR; the module docstring there describes them): a TMA partition and two compute warpgroups, `_mla_ws_kernel`.
Built on mla_sm90.py's parts (masking, softmax, epilogue, key span); mla_sm90.py launches it."""

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
    _mask_tile,
    _nz,
    _scale_rows,
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
                 empty_r, bt_row, q_row, p0, n_tiles, num_blocks, NCH: gl.constexpr, R1: gl.constexpr):
    """PINGPONG's TMA partition: Q once, then key tile t into slot s = t % 2 in three parts, each as soon as the
    warpgroups are done with that part of tile t - 2: the NoPE half h = s (warpgroup s's O columns: free when
    warpgroup s is done with the tile), the other half, the RoPE part (which held P: free when both are done)."""
    if n_tiles > 0:
        mbarrier.expect(q_bar, 2 * NCH * q_desc.block_type.nbytes + qr_desc.block_type.nbytes)
        for h in gl.static_range(2):
            for c in gl.static_range(NCH):
                _tma_load(q_desc, [q_row, h * HALF + c * (HALF // NCH)], q_bar, _chunk(q_smem.index(h), c, NCH))
        _tma_load(qr_desc, [q_row, D_NOPE], q_bar, qr_smem.index(0))
    for t in range(n_tiles):
        s = t % 2
        page = gl.load(bt_row + p0 + t)
        row = gl.where((page >= 0) & (page < num_blocks), page, num_blocks) * PAGE  # past the end: zero fill
        for k in gl.static_range(2):
            h = s * (1 - k) + (1 - s) * k  # the owner's half first
            if t >= 2:
                mbarrier.wait(empty_n.index(2 * s + h), (t // 2 - 1) & 1)
            for c in gl.static_range(NCH):  # NCH column chunks per half, each on its own barrier
                bar = full_n[c].index(2 * s + h)
                mbarrier.expect(bar, kn_desc.block_type.nbytes)
                _tma_load(kn_desc, [row, h * HALF + c * (HALF // NCH)], bar, _chunk(kn_smem.index(2 * s + h), c, NCH))
        if t >= 2:
            if R1:  # one release per warpgroup and slot: both warpgroups' (the halves' barriers)
                mbarrier.wait(empty_n.index(2 * s), (t // 2 - 1) & 1)
                mbarrier.wait(empty_n.index(2 * s + 1), (t // 2 - 1) & 1)
            else:
                mbarrier.wait(empty_r.index(s), (t // 2 - 1) & 1)
        mbarrier.expect(full_r.index(s), kr_desc.block_type.nbytes)
        _tma_load(kr_desc, [row, D_NOPE], full_r.index(s), kr_smem.index(s))


@gluon.jit
def _chunk(buf, c: gl.constexpr, NCH: gl.constexpr):
    """Column chunk c of NCH of a [rows, 256] buffer (the buffer itself when NCH = 1)."""
    if NCH == 1:
        return buf
    else:
        return buf.slice(c * (HALF // NCH), HALF // NCH, dim=1)


@gluon.jit
def _ws_other(j, o, m_i, kn_smem, kr_smem, ml_smem, sm_bar, W: gl.constexpr, R1: gl.constexpr, s_layout: gl.constexpr):
    """Wait for the owner of tile j to publish P_j (in the RoPE part of its buffer, whose S is done) and the
    running (m_j, l_j); rescale O to m_j and issue O += P_j V_j on this warpgroup's 256 columns (async)."""
    so = j % 2
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    mbarrier.wait(sm_bar.index(so), (j // 2) & 1)
    if R1:  # m and l of slot s in allocations of their own (no CTA barrier between their loads and stores)
        m_j = ml_smem[1 - W].load(row_layout)
        l_j = ml_smem[3 - W].load(row_layout)
    else:
        m_j = ml_smem[0].index(2 * so).load(row_layout)
        l_j = ml_smem[0].index(2 * so + 1).load(row_layout)
    alpha = gl.exp2(m_i - _nz(m_j))
    o = _scale_rows(o, alpha)
    o = warpgroup_mma(kr_smem.index(so), kn_smem.index(2 * so + W), o, is_async=True)
    return o, m_j, l_j


@gluon.jit
def _ws_release(o, slot, empty_n, empty_r, W: gl.constexpr, R1: gl.constexpr):
    """Wait for every MMA of warpgroup W, then release its NoPE half of buffer `slot` and its share of the RoPE
    part (one arrival each for the four warps; R1: the half's arrival alone, which the producer also waits for
    before the RoPE part: one arrival, and one barrier fewer, per release)."""
    o = warpgroup_mma_wait(0, deps=(o, ))
    _ws_free(slot, empty_n, empty_r, W, R1)
    return o


@gluon.jit
def _ws_free(slot, empty_n, empty_r, W: gl.constexpr, R1: gl.constexpr):
    """`_ws_release` after the caller's own wait for the MMAs that read buffer `slot`."""
    _cta_barrier()
    mbarrier.arrive(empty_n.index(2 * slot + W))
    if not R1:  # (R1: the producer takes the half's arrival for the RoPE part too)
        mbarrier.arrive(empty_r.index(slot))


@gluon.jit
def _ws_issue_s(t, W: gl.constexpr, NCH: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, p0, sk,
                s_layout: gl.constexpr):
    """Warpgroup W's own tile t (slot W): issue S_t = Q K_t^T part by part as the parts land (the own NoPE half
    first, chunk by chunk, then the RoPE part); the sequence's last page first has its rows past sk zeroed (before
    any P V reads them). Returns S's token (async)."""
    k0 = (p0 + t) * PAGE
    ph = (t // 2) & 1
    if k0 + PAGE > sk:  # the sequence's last page: its rows past sk are zeroed before any P V
        for c in gl.static_range(2 * NCH):
            mbarrier.wait(full_n[c % NCH].index(2 * W + c // NCH), ph)
        _zero_rows_from(kn_smem.index(2 * W), sk - k0, 4)
        _zero_rows_from(kn_smem.index(2 * W + 1), sk - k0, 4)
    # Q's buffer index (t >> 30 = 0) is opaque to the compiler: the Q descriptors are rebuilt per tile instead
    # of being hoisted out of the loop (36 64-bit values: spills)
    qz = t >> 30
    s = gl.zeros([BLOCK_M, PAGE], gl.float32, s_layout)
    for k in gl.static_range(2 * NCH):  # the own half first, chunk by chunk as the chunks land
        hk = (W + k // NCH) % 2
        mbarrier.wait(full_n[k % NCH].index(2 * W + hk), ph)
        s = warpgroup_mma(_chunk(q_smem.index(hk + qz), k % NCH, NCH),
                          _chunk(kn_smem.index(2 * W + hk), k % NCH, NCH).permute((1, 0)), s, use_acc=k > 0,
                          is_async=True)
    mbarrier.wait(full_r.index(W), ph)
    return warpgroup_mma(qr_smem.index(qz), kr_smem.index(W).permute((1, 0)), s, is_async=True)


@gluon.jit
def _ws_pair(j, OTHER: gl.constexpr, HAS_OWN: gl.constexpr, W: gl.constexpr, PV_FIRST: gl.constexpr,
             NCH: gl.constexpr, R1: gl.constexpr, o, m_i, l_i,
             q_smem, qr_smem, kn_smem, kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0,
             num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr):
    """Warpgroup W's share of tiles j (the other warpgroup's) and j + 1 (its own, slot W: HAS_OWN). Issue
    S_{j+1} = Q K_{j+1}^T part by part as the parts land; consume P_j (`_ws_other`); the softmax of tile j + 1,
    chained on (m_j, l_j); publish P_{j+1} and (m_{j+1}, l_{j+1}) and issue O += P_{j+1} V_{j+1}. OTHER = 0: no
    tile j (warpgroup 0's tile 0). The P V of tile j runs under the softmax of tile j + 1; PV_FIRST: P V of tile
    j runs (and tile j is released) before the wait for tile j + 1's load, so a late load never holds up the
    release that the refill of tile j + 2 waits for (the softmax then runs beside the other warpgroup's MMAs
    only). Every MMA retires inside the call (nothing in flight across a back edge)."""
    if OTHER and PV_FIRST:
        o, m_i, l_i = _ws_other(j, o, m_i, kn_smem, kr_smem, ml_smem, sm_bar, W, R1, s_layout)
        o = _ws_release(o, j % 2, empty_n, empty_r, W, R1)
    if HAS_OWN:
        t = j + 1
        k0 = (p0 + t) * PAGE
        s = _ws_issue_s(t, W, NCH, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, p0, sk, s_layout)
    if OTHER and not PV_FIRST:
        o, m_i, l_i = _ws_other(j, o, m_i, kn_smem, kr_smem, ml_smem, sm_bar, W, R1, s_layout)
    if HAS_OWN:
        page = gl.load(bt_row + p0 + t)
        s = warpgroup_mma_wait(0 + (OTHER and not PV_FIRST), deps=(s, ))  # S done; P_j V_j may still run
        p, m_i, l_i, alpha = _softmax_tile(s, k0, lo, hi, (page >= 0) & (page < num_blocks), q_pos, m_i, l_i,
                                           qk_scale, CAUSAL)
    if OTHER and not PV_FIRST:
        o = _ws_release(o, j % 2, empty_n, empty_r, W, R1)
    if HAS_OWN:
        o = _scale_rows(o, alpha)
        kr_smem.index(W).store(p.to(gl.bfloat16))
        if R1:
            ml_smem[W].store(m_i)
            ml_smem[2 + W].store(l_i)
        else:
            ml_smem[0].index(2 * W).store(m_i)
            ml_smem[0].index(2 * W + 1).store(l_i)
        fence_async_shared()
        _cta_barrier()  # P_{j+1} and (m, l) complete: publish them
        mbarrier.arrive(sm_bar.index(W))
        o = warpgroup_mma(kr_smem.index(W), kn_smem.index(2 * W + W), o, is_async=True)
        o = _ws_release(o, W, empty_n, empty_r, W, R1)
    return o, m_i, l_i


@gluon.jit
def _ws_start(r0, sk, SQ: gl.constexpr, H: gl.constexpr):
    """A compute warpgroup's start: (its rows r0.., their query positions, m = -inf, l = 0, O = 0 (64 x 256)) in
    the wgmma layouts of one warpgroup (S 64 x 64, O 64 x 256); m's layout is a slice of S's."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, PAGE, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows = r0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.full([BLOCK_M], 0.0, gl.float32, row_layout)
    return rows, sk - SQ + rows // H, m_i, l_i, gl.zeros([BLOCK_M, HALF], gl.float32, o_layout)


@gluon.jit
def _ws_compute(W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, sm_bar,
                empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0, b, split, qk_scale, out_ptr,
                lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr, H: gl.constexpr,
                CAUSAL: gl.constexpr, FINAL: gl.constexpr, PV_FIRST: gl.constexpr, NCH: gl.constexpr,
                R1: gl.constexpr):
    """Compute warpgroup W of PINGPONG: the S and softmax of tiles t = W (mod 2), O columns [256 W, 256 W + 256)
    of every tile, then its half of the epilogue."""
    rows, q_pos, m_i, l_i, o = _ws_start(r0, sk, SQ, H)
    s_layout: gl.constexpr = m_i.type.layout.parent
    o_layout: gl.constexpr = o.type.layout
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        if W == 0:  # tile 0: warpgroup 0's, no other tile before it
            o, m_i, l_i = _ws_pair(-1, False, True, W, PV_FIRST, NCH, R1, o, m_i, l_i, q_smem, qr_smem, kn_smem,
                                   kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks,
                                   lo, hi, sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
        # pairs (j, j + 1), j the other warpgroup's tile: j = 1, 3, ... (warpgroup 0), 0, 2, ... (1)
        n_pairs = (n_tiles - 1 + W) // 2
        for i in range(n_pairs):
            o, m_i, l_i = _ws_pair(2 * i + 1 - W, True, True, W, PV_FIRST, NCH, R1, o, m_i, l_i, q_smem, qr_smem,
                                   kn_smem, kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0,
                                   num_blocks, lo, hi, sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
        j_last = 2 * n_pairs + 1 - W
        if j_last == n_tiles - 1:  # the last tile is the other warpgroup's: its P V alone
            o, m_i, l_i = _ws_pair(j_last, True, False, W, PV_FIRST, NCH, R1, o, m_i, l_i, q_smem, qr_smem, kn_smem,
                                   kr_smem, ml_smem, full_n, full_r, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks,
                                   lo, hi, sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
    # Epilogue: this warpgroup's 256 columns; warpgroup 0 writes the LSE.
    _store_out(o, m_i, l_i, rows, W * HALF, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
               l_sp, SQ, H, FINAL, W == 0)


@gluon.jit
def _pair_step(a, HAS_B: gl.constexpr, W: gl.constexpr, RP: gl.constexpr, o, m_i, l_i, q_smem, qr_smem, kn_smem,
               kr_smem, ml_smem, full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks, lo, hi, sk,
               q_pos, qk_scale, CAUSAL: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr):
    """PAIR: warpgroup W's share of the tile pair (a, a + 1) (HAS_B: tile a + 1 exists; warpgroup 1 owns it).
    m_i: the running max before the pair (O and l are at it); returns (O, m, l) at the pair's max. Only the row
    max crosses between the softmaxes: warpgroup 0 publishes m_a = max(m_i, rowmax S_a) as soon as it has it,
    warpgroup 1 folds it into m_b, publishes m_b; warpgroup 0 then rescales its P_a (exponentials already taken
    against m_a) to m_b before publishing it, so both P of the pair are at m_b. l: each warpgroup sums its own
    tiles only (reconciled at the end).
    RP = 0: each warpgroup rescales O once per pair and issues P_a V_a, P_b V_b back to back (P from shared
    memory). RP = 1 (FlashMLA's order): the owner's own P V takes P from registers as soon as its exponentials are
    taken: warpgroup 0's P_a V_a (against m_a, O rescaled to m_a) runs while warpgroup 1 is in its softmax, then O
    is rescaled to m_b; warpgroup 1 issues P_b V_b before it waits for P_a."""
    ph = (a // 2) & 1  # both slots' phase in this pair
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    if W == 0 or HAS_B:
        t = a + W
        k0 = (p0 + t) * PAGE
        s = _ws_issue_s(t, W, 1, q_smem, qr_smem, kn_smem, kr_smem, full_n, full_r, p0, sk, s_layout)
        page = gl.load(bt_row + p0 + t)
        s = warpgroup_mma_wait(0, deps=(s, ))
        s = _mask_tile(s, k0, lo, hi, (page >= 0) & (page < num_blocks), q_pos, CAUSAL)
        m_own = gl.max(s, 1) * qk_scale
        if W == 0:
            m_a = gl.maximum(m_i, m_own)
            ml_smem[0].store(m_a)
            _cta_barrier()
            mbarrier.arrive(mx_bar.index(0))  # m_a: warpgroup 1's softmax needs no more than this
            p = gl.exp2(s * qk_scale - gl.expand_dims(_nz(m_a), 1))
            rs = gl.sum(p, 1)
            if RP:  # P_a V_a from registers against m_a, under warpgroup 1's softmax
                alpha = gl.exp2(m_i - _nz(m_a))
                l_i = l_i * alpha + rs
                o = _scale_rows(o, alpha)
                p_reg = gl.convert_layout(p.to(gl.bfloat16), p_layout)
                o = warpgroup_mma(p_reg, kn_smem.index(0), o, is_async=True)
            if HAS_B:
                mbarrier.wait(mx_bar.index(1), ph)
                m_new = ml_smem[1].load(row_layout)
                c = gl.exp2(m_a - _nz(m_new))  # P_a from m_a to the pair's max
                p = p * gl.expand_dims(c, 1)
                if RP:
                    l_i = l_i * c
                else:
                    rs = rs * c
            else:
                m_new = m_a
        else:
            mbarrier.wait(mx_bar.index(0), ph)
            m_new = gl.maximum(ml_smem[0].load(row_layout), m_own)
            ml_smem[1].store(m_new)
            _cta_barrier()
            mbarrier.arrive(mx_bar.index(1))
            p = gl.exp2(s * qk_scale - gl.expand_dims(_nz(m_new), 1))
            rs = gl.sum(p, 1)
        if not (RP and W == 0):
            alpha = gl.exp2(m_i - _nz(m_new))
            l_i = l_i * alpha + rs
        p16 = p.to(gl.bfloat16)
        kr_smem.index(W).store(p16)  # P over the RoPE part of the own tile (its S is done)
        fence_async_shared()
        _cta_barrier()
        mbarrier.arrive(sm_bar.index(W))
    else:  # warpgroup 1, a lone last tile a: O and l to m_a
        mbarrier.wait(mx_bar.index(0), ph)
        m_new = ml_smem[0].load(row_layout)
        alpha = gl.exp2(m_i - _nz(m_new))
        l_i = l_i * alpha
    if RP and W == 0:  # P_a V_a (issued above) done: slot 0 released, O from m_a to m_b, then P_b V_b
        o, p_reg = warpgroup_mma_wait(0, deps=(o, p_reg))
        _ws_free(0, empty_n, empty_r, W, False)
        if HAS_B:
            o = _scale_rows(o, c)
            mbarrier.wait(sm_bar.index(1), ph)
            o = warpgroup_mma(kr_smem.index(1), kn_smem.index(2), o, is_async=True)
            o = _ws_release(o, 1, empty_n, empty_r, W, False)
    elif RP and HAS_B:  # warpgroup 1: its own P_b V_b from registers first, then P_a V_a
        o = _scale_rows(o, alpha)
        p_reg = gl.convert_layout(p16, p_layout)
        o = warpgroup_mma(p_reg, kn_smem.index(3), o, is_async=True)
        mbarrier.wait(sm_bar.index(0), ph)
        o = warpgroup_mma(kr_smem.index(0), kn_smem.index(1), o, is_async=True)
        p_reg = warpgroup_mma_wait(1, deps=(p_reg, ))  # P_b V_b done: slot 1 released
        _ws_free(1, empty_n, empty_r, W, False)
        o = _ws_release(o, 0, empty_n, empty_r, W, False)
    else:  # P_a V_a, then P_b V_b on this warpgroup's 256 columns, back to back; each slot released once its MMA
        # is done
        o = _scale_rows(o, alpha)
        if W == 1:
            mbarrier.wait(sm_bar.index(0), ph)
        o = warpgroup_mma(kr_smem.index(0), kn_smem.index(W), o, is_async=True)
        if HAS_B:
            if W == 0:
                mbarrier.wait(sm_bar.index(1), ph)
            o = warpgroup_mma(kr_smem.index(1), kn_smem.index(2 + W), o, is_async=True)
            # P_a V_a done (O itself stays untouched while P_b V_b runs): slot 0 is free for tile a + 2
            m_new = warpgroup_mma_wait(1, deps=(m_new, ))
            _ws_free(0, empty_n, empty_r, W, False)
            o = _ws_release(o, 1, empty_n, empty_r, W, False)
        else:
            o = _ws_release(o, 0, empty_n, empty_r, W, False)
    return o, m_new, l_i


@gluon.jit
def _pair_compute(W: gl.constexpr, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r, mx_bar, sm_bar,
                  fin_bar, empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0, b, split, qk_scale,
                  out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ: gl.constexpr,
                  H: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr, RP: gl.constexpr):
    """Compute warpgroup W of PAIR: S and softmax of tiles t = W (mod 2), O columns [256 W, 256 W + 256) of every
    tile (`_pair_step` per tile pair; RP there), then l summed over both warpgroups and its half of the epilogue."""
    rows, q_pos, m_i, l_i, o = _ws_start(r0, sk, SQ, H)
    s_layout: gl.constexpr = m_i.type.layout.parent
    o_layout: gl.constexpr = o.type.layout
    if n_tiles > 0:
        mbarrier.wait(q_bar, 0)
        for i in range(n_tiles // 2):
            o, m_i, l_i = _pair_step(2 * i, True, W, RP, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, ml_smem,
                                     full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks, lo, hi,
                                     sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
        if n_tiles % 2 == 1:
            o, m_i, l_i = _pair_step(n_tiles - 1, False, W, RP, o, m_i, l_i, q_smem, qr_smem, kn_smem, kr_smem, ml_smem,
                                     full_n, full_r, mx_bar, sm_bar, empty_n, empty_r, bt_row, p0, num_blocks, lo, hi,
                                     sk, q_pos, qk_scale, CAUSAL, s_layout, o_layout)
        # both l at the final max: the row sum is theirs added
        ml_smem[2 + W].store(l_i)
        _cta_barrier()
        mbarrier.arrive(fin_bar)
        mbarrier.wait(fin_bar, 0)
        l_i = l_i + ml_smem[3 - W].load(m_i.type.layout)
    _store_out(o, m_i, l_i, rows, W * HALF, b, split, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh,
               l_sp, SQ, H, FINAL, W == 0)


@gluon.jit(do_not_specialize=["num_blocks", "pages_per_split"])
def _mla_ws_kernel(q_desc, qr_desc, kn_desc, kr_desc, bt_ptr, seq_ptr, out_ptr, lse_ptr, qk_scale, num_blocks,
                   pages_per_split, max_pages, bt_sb, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
                   SQ: gl.constexpr, H: gl.constexpr, CAUSAL: gl.constexpr, FINAL: gl.constexpr,
                   PV_FIRST: gl.constexpr, NCH: gl.constexpr, R1: gl.constexpr, PAIR: gl.constexpr,
                   num_warps: gl.constexpr):
    """PINGPONG / PAIR: the TMA loads (this partition, 4 warps) and the two compute warpgroups (worker
    partitions)."""
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
    if R1 or PAIR:  # (m of slot 0, m of slot 1, l of slot 0, l of slot 1 (PAIR: the final l of warpgroup 0, 1)),
        # each its own allocation
        ml_smem = (gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
                   gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
                   gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout),
                   gl.allocate_shared_memory(gl.float32, [BLOCK_M], ml_layout))
    else:  # m, l of slot 0, m, l of slot 1
        ml_smem = (gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], ml_layout), )
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # full barriers: chunk c of NoPE half h of slot s at full_n[c].index(2 s + h), one allocation per chunk (the
    # barrier pass separates two waits on one allocation by a CTA barrier, none between allocations)
    full_n = (gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),
              gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),
              gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()),
              gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout()))
    empty_n = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    full_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty_r = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    sm_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for c in gl.static_range(NCH):
        for i in gl.static_range(4):
            mbarrier.init(full_n[c].index(i), count=1)
    for i in gl.static_range(4):
        mbarrier.init(empty_n.index(i), count=1)  # NoPE half h: only warpgroup h reads it after the owner's S
    for i in gl.static_range(2):
        mbarrier.init(full_r.index(i), count=1)
        mbarrier.init(empty_r.index(i), count=2)  # the RoPE part holds P, read by both warpgroups
        mbarrier.init(sm_bar.index(i), count=1)
    if PAIR:  # the row max of slot s published; both warpgroups' final l written
        mx_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        fin_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(mx_bar.index(0), count=1)
        mbarrier.init(mx_bar.index(1), count=1)
        mbarrier.init(fin_bar, count=2)
    bt_row = bt_ptr + b.to(gl.int64) * bt_sb
    q_row = (b * SQ * H + r0).to(gl.int32)
    # (The argument tuples are written out: a tuple assigned to a variable turns its constexprs into tensors.)
    if PAIR:
        gl.warp_specialize([(_ws_producer, (q_desc, qr_desc, kn_desc, kr_desc, q_smem, qr_smem, kn_smem, kr_smem,
                                            q_bar, full_n, full_r, empty_n, empty_r, bt_row, q_row, p0, n_tiles,
                                            num_blocks, 1, False)),
                            (_pair_compute, (0, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r,
                                             mx_bar, sm_bar, fin_bar, empty_n, empty_r, bt_row, p0, n_tiles,
                                             num_blocks, lo, hi, sk, r0, b, split, qk_scale, out_ptr, lse_ptr, o_sb,
                                             o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ, H, CAUSAL, FINAL,
                                             PAIR == 2)),
                            (_pair_compute, (1, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r,
                                             mx_bar, sm_bar, fin_bar, empty_n, empty_r, bt_row, p0, n_tiles,
                                             num_blocks, lo, hi, sk, r0, b, split, qk_scale, out_ptr, lse_ptr, o_sb,
                                             o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp, SQ, H, CAUSAL, FINAL,
                                             PAIR == 2))],
                           [4, 4], [WS_REGS, WS_REGS])
    else:
        gl.warp_specialize([(_ws_producer, (q_desc, qr_desc, kn_desc, kr_desc, q_smem, qr_smem, kn_smem, kr_smem,
                                            q_bar, full_n, full_r, empty_n, empty_r, bt_row, q_row, p0, n_tiles,
                                            num_blocks, NCH, R1)),
                            (_ws_compute, (0, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r,
                                           sm_bar, empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0,
                                           b, split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss,
                                           l_sh, l_sp, SQ, H, CAUSAL, FINAL, PV_FIRST, NCH, R1)),
                            (_ws_compute, (1, q_smem, qr_smem, kn_smem, kr_smem, ml_smem, q_bar, full_n, full_r,
                                           sm_bar, empty_n, empty_r, bt_row, p0, n_tiles, num_blocks, lo, hi, sk, r0,
                                           b, split, qk_scale, out_ptr, lse_ptr, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss,
                                           l_sh, l_sp, SQ, H, CAUSAL, FINAL, PV_FIRST, NCH, R1))],
                           [4, 4], [WS_REGS, WS_REGS])


