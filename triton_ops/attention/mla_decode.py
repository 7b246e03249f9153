"""DeepSeek MLA decode attention over a paged latent cache, dense or sparse (Triton). Contract:
dispatch/reference/attention.py:mla_decode.

MLA decode is MQA: every query head reads the same latent row per token (D = NoPE + 64 RoPE columns; the key is
the whole row, the value its first v_dim columns). Shapes: q (B, Sq, H, D) bf16 with Sq in 1..8; kv_cache in one
of three layouts (triton_ops.contract.kv_cache, docs/kv_cache.md draws the bytes):
  "bf16"  (num_blocks, block_size, (1,) D) bf16;
  "v32"   DeepSeek V3.2, 656 B per token: 512 E4M3 | 4 fp32 scales (one per 128) | 64 bf16 RoPE (D = 576);
  "v4"    DeepSeek V4, per block: block_size x (448 E4M3 | 64 bf16 RoPE), then block_size x (7 E8M0 | 1 pad)
          (D = 512);
block_table (B, max_blocks) int32, seqused_k (B,) int32, and for the sparse variant indices (B, Sq, topk) int32:
the key positions each query attends to (entries < 0 or >= seqused_k are unused).

* One program owns BLOCK_M query rows that share their keys, as the M dim of its tl.dot tiles: dense, rows are
  the packed (query, head) pairs r = s * H + h of one sequence; sparse, the heads of one (sequence, query), whose
  index list is its own. GPU tiles (mla_config): on sm_90 ("wgmma") BLOCK_M = 64-128 with the value columns split
  between V_SPLIT = 2 programs (each computes the whole QK^T and P V over its half: a 128 x 256 fp32
  accumulator), so with H = 128 two programs, adjacent in launch order, read a sequence's keys; elsewhere
  ("mma") BLOCK_M = 32 with all value columns, so four programs read them.
* Per key tile: the latent rows are dequantized in registers (E4M3 code x tile scale, exact in bf16 since the
  scales are powers of two; RoPE bf16 as stored), QK^T is two dots (NoPE part, RoPE part; three with V_SPLIT 2:
  the own NoPE half, the other half, RoPE), the running softmax is online (base 2), and PV reuses the dequantized
  own NoPE columns as V (plus the RoPE tile when v_dim > NoPE width, with V_SPLIT 1 only).
* Split-KV: grid (row blocks, B or B x Sq, num_splits), num_splits a host int from static sizes only, never from
  seqused_k (one launch serves any lengths; a CUDA graph replays with new lengths in place). Split s covers key
  positions [s x kps, (s + 1) x kps) of the table's capacity (dense) or of the index list (sparse); partial
  outputs (fp32) and LSEs go through decode.py's split reduction (merge.py's LSE rule).
* window_left >= 0 (V4's sliding-window layers): a query at position p sees keys p - window_left .. p only
  (mask.key_range skips the tiles before the window; sparse: index entries outside it are unused).
* Masking: page ids outside [0, num_blocks), positions >= seqused_k or the table's capacity, index entries < 0:
  masked keys, never dereferenced.
* Interpreter: its tl.dot on bf16 operands is wrong, so there (DOT_F32) the dots run on fp32 copies of the same
  bf16 values; RoPE bits are widened on the bits (its bf16 -> fp32 cast mangles subnormals).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out, e4m3_decode_fast
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2
from triton_ops.attention.decode import (
    LOG2E,
    MAX_Q,
    WIDE_REDUCE_ELEMS,
    _dot,
    _sm_count,
    choose_num_splits,
    reduce_splits,
    softmax_finish,
    softmax_step,
    split_buffers,
)
from triton_ops.attention.mask import key_range, visible
from triton_ops.contract.arch import arch_of, device_index
from triton_ops.contract.attention import check_mla_decode
from triton_ops.contract.kv_cache import DS_LAYOUTS, DS_ROPE
from triton_ops.kv_cache import _bf16_bits_to_f32, _ds_token_offsets

ROPE: tl.constexpr = tl.constexpr(DS_ROPE)
LAYOUT_ID = {"bf16": 0, "v32": 1, "v4": 2}


@triton.jit
def _rope_in(x, DOT_F32: tl.constexpr):
    """bf16 values -> the dot dtype (fp32 from the bits on the interpreter path, bf16 as is otherwise)."""
    if DOT_F32:
        return _bf16_bits_to_f32(x.to(tl.int16, bitcast=True))
    else:
        return x


@triton.jit
def _token_offsets(slot, block_stride, row_stride, BS, LAYOUT: tl.constexpr, D_NOPE: tl.constexpr,
                   NT: tl.constexpr):
    """(NoPE, scale, RoPE) offsets of the tokens at `slot`: bf16 layout in elements of the cache (the scale
    offset unused), FP8 layouts in bytes (_ds_token_offsets) but the RoPE offset in bf16 elements."""
    if LAYOUT == 0:
        s32 = slot.to(tl.int32)
        row = (s32 // BS).to(tl.int64) * block_stride + (s32 % BS).to(tl.int64) * row_stride
        return row, row, row + D_NOPE
    else:
        data, scale_at, rope_at = _ds_token_offsets(slot, BS, block_stride, D_NOPE, NT, LAYOUT == 2)
        return data, scale_at, rope_at >> 1


@triton.jit
def _nope_tile(kv8, kvb, kv32, data, scale_at, ok, j0, LAYOUT: tl.constexpr, D_NOPE: tl.constexpr,
               TILE: tl.constexpr, NT: tl.constexpr, NTH: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, EMULATE: tl.constexpr):
    """NoPE columns [j0 x TILE, (j0 + NTH) x TILE) of the tokens (valid where `ok`) as [BLOCK_N, NTH x TILE] in
    the dot dtype, dequantized (E4M3 code x tile scale, exact in bf16: the scales are powers of two); masked
    tokens and padded columns are 0. kvb is the bf16 cache (bf16 layout) or a bf16 view, kv8 / kv32 uint8 / fp32
    views of the FP8 layouts' bytes."""
    j = j0 + tl.arange(0, NTH)
    e = tl.arange(0, TILE)
    col = (j[:, None] * TILE + e[None, :])[None, :, :]  # [1, NTH, TILE]
    tm = ok[:, None] & (j < NT)[None, :]  # [BLOCK_N, NTH]
    if LAYOUT == 0:
        nope = tl.load(kvb + data[:, None, None] + col, mask=tm[:, :, None] & (col < D_NOPE), other=0.0)
        nope = _rope_in(nope, DOT_F32)
    else:
        codes = tl.load(kv8 + data[:, None, None] + col, mask=tm[:, :, None], other=0)
        if LAYOUT == 2:  # E8M0: 0xFF is NaN, 0 is 2^-127 (an fp32 subnormal), else the fp32 exponent field
            eb = tl.load(kv8 + scale_at[:, None] + j[None, :], mask=tm, other=127).to(tl.uint32)
            s = tl.where(eb == 0xFF, 0x7FC00000, tl.where(eb == 0, 0x00400000, eb << 23)).to(tl.float32, bitcast=True)
        else:
            s = tl.load(kv32 + (scale_at >> 2)[:, None] + j[None, :], mask=tm, other=0.0)
        nope = (e4m3_decode_fast(codes, EMULATE) * s[:, :, None]).to(DOT_DTYPE)
    return tl.reshape(nope, [BLOCK_N, NTH * TILE])


@triton.jit
def _mla_kernel(q_ptr, kv8, kvb, kv32, bt_ptr, seq_ptr, idx_ptr, out_ptr, lse_ptr,
                qk_scale, num_blocks, max_ctx, keys_per_split, block_stride, row_stride,
                q_sb, q_ss, q_sh, bt_sb, i_sb, i_ss, o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
                SQ: tl.constexpr, H: tl.constexpr, M_BLOCKS: tl.constexpr, BS: tl.constexpr, LAYOUT: tl.constexpr,
                D_NOPE: tl.constexpr, TILE: tl.constexpr, NT: tl.constexpr, NTH: tl.constexpr, DV: tl.constexpr,
                V_SPLIT: tl.constexpr, DV_NOPE: tl.constexpr, V_ROPE: tl.constexpr, SPARSE: tl.constexpr,
                TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOW_LEFT: tl.constexpr,
                DOT_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, FINAL: tl.constexpr, DOT_F32: tl.constexpr,
                EMULATE: tl.constexpr):
    # The NoPE columns (V_SPLIT x NTH tiles of TILE: V4's 448 pad to 512) split into V_SPLIT column chunks; a
    # program owns one (its value / output columns): chunk tiles [c_own, c_own + NTH), the other chunk's
    # [c_oth, c_oth + NTH) only enter QK^T. DV_NOPE = min(DV, D_NOPE) value columns from the NoPE part; V_ROPE:
    # DV > D_NOPE, the value also takes RoPE columns (acc_r; launched with V_SPLIT = 1 only).
    DH: tl.constexpr = NTH * TILE
    if V_SPLIT == 1:
        mb = tl.program_id(0)
        c_own = 0
    else:  # the fastest grid axis: a sequence's row blocks and column chunks run side by side (L2 reuse)
        mb = tl.program_id(0) // V_SPLIT
        c_own = (tl.program_id(0) % V_SPLIT) * NTH
    c_oth = NTH - c_own
    split = tl.program_id(2)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    if SPARSE:  # one (sequence, query) per program: rows are heads
        b = (tl.program_id(1) // SQ).to(tl.int64)
        s = tl.zeros([BLOCK_M], tl.int32) + tl.program_id(1) % SQ
        h = r
        rmask = r < H
    else:  # rows are the packed (query, head) pairs of one sequence
        b = tl.program_id(1).to(tl.int64)
        s = r // H
        h = r % H
        rmask = r < SQ * H
    sk = tl.load(seq_ptr + b)
    q_pos = sk - SQ + s
    dn = c_own * TILE + tl.arange(0, DH)  # this program's NoPE / value columns
    dr = tl.arange(0, ROPE)
    qrow = q_ptr + b * q_sb + s * q_ss + h * q_sh
    qn = _rope_in(tl.load(qrow[:, None] + dn[None, :], mask=rmask[:, None] & (dn < D_NOPE)[None, :], other=0.0),
                  DOT_F32)
    qr = _rope_in(tl.load(qrow[:, None] + D_NOPE + dr[None, :], mask=rmask[:, None], other=0.0), DOT_F32)
    if V_SPLIT == 2:
        do = c_oth * TILE + tl.arange(0, DH)
        qo = _rope_in(tl.load(qrow[:, None] + do[None, :], mask=rmask[:, None] & (do < D_NOPE)[None, :],
                              other=0.0), DOT_F32)

    k0 = split * keys_per_split
    if SPARSE:
        lo = k0
        hi = tl.minimum(k0 + keys_per_split, TOPK)
        s0 = tl.program_id(1) % SQ
        i_row = idx_ptr + b * i_sb + s0 * i_ss
        n_valid = tl.minimum(sk, max_ctx)
        pos_hi = sk - SQ + s0  # the query's own position (causal, window)
    else:
        s_lo = (mb * BLOCK_M) // H
        s_hi = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // H, SQ - 1)
        lo, hi = key_range(sk - SQ + s_lo, sk - SQ + s_hi, sk, CAUSAL, WINDOW_LEFT, -1)
        lo = tl.maximum(lo, k0)
        hi = tl.minimum(tl.minimum(hi, k0 + keys_per_split), max_ctx)
    start = (lo // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DH], tl.float32)
    acc_r = tl.zeros([BLOCK_M, ROPE], tl.float32)
    bt_row = bt_ptr + b * bt_sb
    for n0 in tl.range(start, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        inb = (t >= lo) & (t < hi)
        if SPARSE:
            pos = tl.load(i_row + t, mask=inb, other=-1)
            inb = inb & (pos >= 0) & (pos < n_valid)
            if CAUSAL:
                inb = inb & (pos <= pos_hi)
            if WINDOW_LEFT >= 0:
                inb = inb & (pos >= pos_hi - WINDOW_LEFT)
        else:
            pos = t
        page = tl.load(bt_row + pos // BS, mask=inb, other=-1)
        kok = inb & (page >= 0) & (page < num_blocks)  # bad pages: masked keys, never dereferenced
        slot = tl.where(kok, page.to(tl.int64) * BS + pos % BS, 0)
        data, scale_at, rope_at = _token_offsets(slot, block_stride, row_stride, BS, LAYOUT, D_NOPE, NT)
        kn = _nope_tile(kv8, kvb, kv32, data, scale_at, kok, c_own, LAYOUT, D_NOPE, TILE, NT, NTH, BLOCK_N,
                        DOT_DTYPE, DOT_F32, EMULATE)
        kr = _rope_in(tl.load(kvb + rope_at[:, None] + dr[None, :], mask=kok[:, None], other=0.0), DOT_F32)
        qk = _dot(qn, tl.trans(kn), DOT_F32)
        if V_SPLIT == 2:
            ko = _nope_tile(kv8, kvb, kv32, data, scale_at, kok, c_oth, LAYOUT, D_NOPE, TILE, NT, NTH, BLOCK_N,
                            DOT_DTYPE, DOT_F32, EMULATE)
            qk += _dot(qo, tl.trans(ko), DOT_F32)
        qk = (qk + _dot(qr, tl.trans(kr), DOT_F32)) * qk_scale
        if SPARSE:
            ok = kok[None, :] & rmask[:, None]
        else:
            ok = visible(q_pos[:, None], t[None, :], sk, CAUSAL, WINDOW_LEFT, -1) & kok[None, :]
        p, alpha, m_new, l_i = softmax_step(tl.where(ok, qk, float("-inf")), m_i, l_i)
        p16 = cast_out(p, OUT_DTYPE, EMULATE).to(DOT_DTYPE)  # P in bf16, as the tensor-core dot takes it
        acc = acc * alpha[:, None] + _dot(p16, kn, DOT_F32)
        if V_ROPE:
            acc_r = acc_r * alpha[:, None] + _dot(p16, kr, DOT_F32)
        m_i = m_new

    norm, lse = softmax_finish(m_i, l_i)
    orow = out_ptr + b * o_sb + s * o_ss + h * o_sh + split * o_sp
    om = rmask[:, None] & (dn < DV_NOPE)[None, :]
    o = acc * norm[:, None]
    if FINAL:
        o = cast_out(o, OUT_DTYPE, EMULATE)
    tl.store(orow[:, None] + dn[None, :], o, mask=om)
    if V_ROPE:
        o_r = acc_r * norm[:, None]
        if FINAL:
            o_r = cast_out(o_r, OUT_DTYPE, EMULATE)
        tl.store(orow[:, None] + D_NOPE + dr[None, :], o_r, mask=rmask[:, None] & (dr < DV - D_NOPE)[None, :])
    lmask = rmask
    if V_SPLIT == 2:  # both chunks hold the same LSE (up to the order of the QK^T sums): the first writes it
        lmask = lmask & (tl.zeros_like(r) + c_own == 0)
    tl.store(lse_ptr + b * l_sb + s * l_ss + h * l_sh + split * l_sp, lse, mask=lmask)


# ---------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    num_splits: int  # key slices per program row block: the grid's third axis; 1 writes the output directly
    block_n: int  # keys per loop step (a power of two >= 16)
    block_m: int  # query rows per program (a power of two >= 16, the tl.dot minimum)
    num_warps: int
    num_stages: int
    reduce_elems: int  # partial-output elements per program of the split reduction
    v_split: int = 1  # programs per row block, each owning 1 / v_split of the value (output) columns


def mla_config(batch: int, sq: int, h: int, keys: int, sparse: bool, device: torch.device,
               num_splits: int = 0, tiles: str = "auto") -> MlaConfig:
    """keys: the table's capacity (dense) or topk (sparse). tiles: "wgmma", "mma" or "auto" (the GPU default).
    "wgmma" (auto on sm_90 with >= 64 rows per sequence, or per (sequence, query) sparse): the 512 value columns
    split between two programs (v_split 2), 4 warps per 64 rows; tl.dot with M >= 64 and operands in shared
    memory lowers to wgmma. 128 rows x 32 keys, 3 stages: sm_90 compiles (Triton 3.6 and 3.9) 226-255
    registers, no spills, 205-222 KB shared memory (Q alone is 128 x 576 bf16); with H = 128 the two column
    halves' programs read each key tile (adjacent in launch order), each computing the whole QK^T. 64 rows x
    16 keys, 2 stages (32 keys spill a few bytes). 64 keys per step, or 64 rows x 512 columns in one program,
    spill. "mma" (the former GPU tiles; auto elsewhere): 32 rows
    x 16 keys at 8 warps, mma.sync, 164-209 registers without spills; with H = 128 four programs read each key
    tile. Interpreter (auto): up to 128 rows x 64 keys, one column chunk (it pays per program and per op).
    num_splits 0: decode.choose_num_splits over all programs."""
    if tiles not in ("auto", "wgmma", "mma"):
        raise ValueError(f"lowbit.mla_decode: tiles {tiles!r}: expected 'auto', 'wgmma' or 'mma'")
    cpu = device.type == "cpu"
    rows = h if sparse else sq * h
    if tiles == "auto":
        tiles = "wgmma" if not cpu and rows >= 64 and arch_of(device) == "sm_90" else "mma"
    if tiles == "wgmma":
        block_m, v_split = max(16, min(next_pow2(rows), 128)), 2
        num_warps = max(4, block_m // 16)
    else:
        block_m, v_split = max(16, min(next_pow2(rows), 128 if cpu else 32)), 1
        num_warps = 4 if cpu or block_m < 32 else 8
    if num_splits <= 0:
        sm = None if cpu else _sm_count(device_index(device))
        programs = batch * (sq if sparse else 1) * cdiv(rows, block_m) * v_split
        num_splits = choose_num_splits(programs, keys, sm)
    per_split = cdiv(max(keys, 1), num_splits)
    cap = 64 if cpu else 32 if tiles == "wgmma" and block_m >= 128 else 16
    block_n = max(16, min(cap, 1 << (per_split.bit_length() - 1)))
    stages = 3 if tiles == "wgmma" and block_m >= 128 else 2
    return MlaConfig(num_splits, block_n, block_m, num_warps, stages, 32768 if cpu else WIDE_REDUCE_ELEMS, v_split)


# ---------------------------------------------------------------------------------------------- launcher


def _cache_views(kv_cache, layout):
    """(uint8, bf16, fp32 views of the cache, block stride, token stride): strides in bytes for the FP8 layouts,
    in bf16 elements for the bf16 layout (whose uint8 / fp32 views are unused: the bf16 cache itself)."""
    if layout == "bf16":
        return kv_cache, kv_cache, kv_cache, kv_cache.stride(0), kv_cache.stride(1)
    c8 = kv_cache.view(torch.uint8)
    c32 = c8.view(torch.float32) if layout == "v32" else c8
    return c8, c8.view(torch.bfloat16), c32, c8.stride(0), c8.stride(1)


def _launch(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal, window_left,
            cfg: MlaConfig):
    bsz, sq, h, d = q.shape
    dev = q.device
    out = torch.empty(bsz, sq, h, v_dim, dtype=q.dtype, device=dev)
    lse = torch.empty(bsz, sq, h, dtype=torch.float32, device=dev)
    if out.numel() == 0:
        return out, lse
    num_blocks, bs = kv_cache.shape[:2]
    if num_blocks * bs >= 2**31:
        raise ValueError("lowbit.mla_decode: argument 'kv_cache': the kernel splits slots in 32 bits (< 2^31 slots)")
    d_nope = d - DS_ROPE
    if cfg.v_split not in (1, 2):
        raise ValueError(f"lowbit.mla_decode: MlaConfig.v_split {cfg.v_split}: expected 1 or 2")
    v_split = cfg.v_split if v_dim <= d_nope else 1  # a value past the NoPE part (acc_r): one column chunk
    if layout == "bf16":
        dn = next_pow2(d_nope)
        v_split = max(1, min(v_split, dn // 16))
        tile = dn // v_split
        nt, nt_p = cdiv(d_nope, tile), v_split
    else:
        L = DS_LAYOUTS[layout]
        tile, nt, nt_p = L.tile, L.num_tiles, next_pow2(L.num_tiles)
    sparse = indices is not None
    topk = indices.shape[2] if sparse else 0
    splits = cfg.num_splits
    o_buf, l_buf, o_sp, l_sp = split_buffers(out, lse, splits)
    max_ctx = block_table.shape[1] * bs
    keys = topk if sparse else max_ctx
    kps = cfg.block_n * max(1, cdiv(cdiv(keys, splits), cfg.block_n))
    rows = h if sparse else sq * h
    m_blocks = cdiv(rows, cfg.block_m)
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv8, kvb, kv32, block_stride, row_stride = _cache_views(kv_cache, layout)
    idx = indices if sparse else seqused_k
    launch(_mla_kernel, (m_blocks * v_split, bsz * sq if sparse else bsz, splits),
        q, kv8, kvb, kv32, block_table, seqused_k, idx, o_buf, l_buf,
        float(softmax_scale) * LOG2E, num_blocks, max_ctx, kps, block_stride, row_stride,
        q.stride(0), q.stride(1), q.stride(2), block_table.stride(0),
        idx.stride(0) if sparse else 0, idx.stride(1) if sparse else 0,
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), o_sp, l_buf.stride(0), l_buf.stride(1),
        l_buf.stride(2), l_sp,
        SQ=sq, H=h, M_BLOCKS=m_blocks, BS=bs, LAYOUT=LAYOUT_ID[layout], D_NOPE=d_nope, TILE=tile, NT=nt,
        NTH=nt_p // v_split, DV=v_dim, V_SPLIT=v_split, DV_NOPE=min(v_dim, d_nope), V_ROPE=v_dim > d_nope,
        SPARSE=sparse, TOPK=topk,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal), WINDOW_LEFT=int(window_left),
        DOT_DTYPE=tl.float32 if dev.type == "cpu" else tl.bfloat16, OUT_DTYPE=TL_DTYPE[q.dtype], FINAL=splits == 1,
        DOT_F32=dev.type == "cpu", EMULATE=emulate_formats(dev),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    reduce_splits(o_buf, l_buf, out, lse, cfg.reduce_elems)
    return out, lse


# ---------------------------------------------------------------------------------------------- checks


def supports_mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, *rest) -> str | None:
    if q.shape[1] > MAX_Q:
        return f"{q.shape[1]} queries per sequence > {MAX_Q}"
    if layout == "bf16" and next_pow2(q.shape[-1] - DS_ROPE) > 512:
        return f"NoPE width {q.shape[-1] - DS_ROPE} > 512"
    return None


# ----------------------------------------------------------------------------------------------- entry


def mla_decode(q, kv_cache, block_table, seqused_k, indices, layout: str, v_dim: int, softmax_scale: float,
               causal: bool, window_left: int, num_splits: int, cfg: MlaConfig | None = None):
    """(out (B, Sq, H, v_dim) bf16, lse (B, Sq, H) fp32); see the module docstring. num_splits <= 0 picks the
    split count from static sizes; cfg overrides the whole configuration (mla_config(..., tiles="mma") gives
    the former 32-row mma.sync tiles)."""
    check_mla_decode(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal,
                     window_left, num_splits)
    bsz, sq, h, _ = q.shape
    sparse = indices is not None
    keys = indices.shape[2] if sparse else block_table.shape[1] * kv_cache.shape[1]
    # a value past the NoPE part (V4's whole-row value) keeps one column chunk: the mma tiles
    tiles = "mma" if v_dim > q.shape[-1] - DS_ROPE else "auto"
    cfg = cfg or mla_config(bsz, sq, h, keys, sparse, q.device, num_splits, tiles)
    return _launch(q, kv_cache, block_table, seqused_k, indices, layout, v_dim, softmax_scale, causal, window_left,
                   cfg)
