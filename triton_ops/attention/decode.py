"""Paged GQA decode attention with split-KV (Triton). Contract: dispatch/reference/attention.py (the varlen
reference run on the keys gathered through the block table, FP8 values dequantized as code * scale).

Shapes: q (B, Sq, Hq, D) with Sq in 1..8 (speculative tokens); k_cache (num_blocks, block_size, Hkv, D) and
v_cache (.., Hkv, Dv) in q's dtype or FP8 E4M3 (float8_e4m3fn or uint8 codes, value = code * scale with a
per-tensor or per-KV-head fp32 scale); block_table (B, max_blocks) int32; seqused_k (B,) int32 key counts.
Query s of sequence b sits at key position seqused_k[b] - Sq + s (bottom-right aligned, triton_ops.attention.mask).

* GQA packing: a program owns one KV head and all Sq x Hq/Hkv query rows that read it, as the M dim of its
  tl.dot tiles (padded to 16), so each key and value byte is read once per split.
* Split-KV: grid (B, Hkv x row blocks, num_splits). `num_splits` is a host int chosen from static sizes only
  (`choose_num_splits`), never from seqused_k, so one compiled launch serves any lengths and a CUDA graph
  replays with new lengths written in place. Split s covers keys [s x kps, (s + 1) x kps) of the table's
  capacity max_blocks x block_size (kps a multiple of the key tile); it writes an fp32 partial output and its
  LSE (-inf when it saw no key), and `_split_reduce_kernel` merges them by LSE (merge.py's rule). With one
  split the kernel writes the final output directly.
* Sinks (GPT-OSS: a per-head logit in the softmax denominator, no value) start the running softmax of split 0
  only (running max = sink, sum = 1), so the merge counts them exactly once; with no key at all the result
  is out 0, lse = sink.
* Block-table entries outside [0, num_blocks) are never dereferenced: their keys are masked (they join
  neither the softmax nor the output, like keys outside the window). Keys at positions >= max_blocks x
  block_size (seqused_k larger than the table) are masked the same way, and unused table entries past
  seqused_k are never read.
* FP8: codes are exact in bf16/fp16, so the dots take the codes and the scales multiply the fp32 results (k
  scale into the logit scale, v scale into the final normalization). On the GPU the dots run in fp16 (the
  hardware converts a pair of E4M3 codes to fp16 in one instruction; to bf16 it takes three): q is converted to
  fp16 after an exact power-of-two rescale of the tile (largest magnitude in [2^14, 2^15]) and P is rounded to fp16.
  V's codes are converted in the layout they are loaded in and reach the dot's operand layout as fp16 (16-byte
  shared stores, transposed ldmatrix); converted after that move, a transposed 8-bit operand is read byte by byte.
* Page tiles: where the key tile divides the page size, a tile reads one block-table entry and its K / V rows
  are one base address plus loop-invariant offsets (else one table entry and one 64-bit address per key).
* Interpreter: its tl.dot on bf16 operands is wrong (huge values), so there (DOT_F32) the dots run on fp32
  copies of the same 16-bit operands, with fp32 IEEE products.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out, e4m3_decode
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2
from triton_ops.attention.mask import key_range, visible
from triton_ops.attention.merge import lse_weights, weighted_sum
from triton_ops.contract.arch import arch_at_least, arch_of, device_index
from triton_ops.contract.arch import sm_count as _sm_count  # module attribute: compile scripts stub it
from triton_ops.contract.attention import FP8_KV, check_attention_decode

LOG2E = 1.4426950408889634
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)
MAX_Q = 8  # speculative tokens per sequence; longer query runs belong to the prefill kernel
MAX_HEAD_DIM = 256


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with an fp32 result; a, b already in the dot dtype (fp32 on the interpreter path)."""
    if DOT_F32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _e4m3_to_f16_opaque(x):
    """uint8 E4M3 codes -> fp16 (hardware, 4 codes per instruction pair), as an impure inline asm: the dot-operand
    layout conversion then stays after it (fp16 through shared memory, 16-byte stores and transposed ldmatrix)
    instead of being hoisted above the convert onto the 8-bit codes (byte-wise shared loads for a transposed V)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _tile_ptrs(ptr, row, slot, hkv, s_b, s_o, s_h, tile, cols, PAGE_TILE: tl.constexpr):
    """[BLOCK_N, D_P] element pointers of a key or value tile: row (page id, int64) and slot are scalars for a page
    tile (one base address plus the loop-invariant `tile` offsets), else per-key vectors (a table entry per key)."""
    if PAGE_TILE:
        return ptr + (row * s_b + slot * s_o + hkv * s_h) + tile
    else:
        return ptr + (row * s_b + slot * s_o + hkv * s_h)[:, None] + cols[None, :]


@triton.jit
def _load_kv(ptrs, m, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr, OPAQUE_CVT: tl.constexpr):
    """Key or value tile at ptrs, 0 where ~m. FP8 codes come back as their exact values (unscaled) in DOT_DTYPE;
    OPAQUE_CVT: through `_e4m3_to_f16_opaque` (fp16 dots only)."""
    x = tl.load(ptrs, mask=m, other=0)
    if FP8:
        if EMULATE:
            return e4m3_decode(x).to(DOT_DTYPE)
        elif OPAQUE_CVT:
            return _e4m3_to_f16_opaque(x)
        else:  # one hardware convert per pair of codes (e4m3x2 -> f16x2 when DOT_DTYPE is fp16)
            return x.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    else:
        return x.to(DOT_DTYPE)


@triton.jit
def softmax_step(qk, m_i, l_i):
    """One key tile of the online softmax in base 2: qk [M, N] logits (log2 units, -inf where masked), running
    max m_i and sum l_i [M] -> (p [M, N], alpha [M] to rescale the accumulator by, new max, new sum). A row with
    nothing seen yet (max -inf) gets p = 0 and alpha = 1, never NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def softmax_finish(m_i, l_i):
    """(1 / sum, natural-log LSE) of the running softmax; 0 and -inf for a row that saw no key."""
    seen = l_i > 0
    norm = tl.where(seen, 1.0 / tl.where(seen, l_i, 1.0), 0.0)
    return norm, tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, sink_ptr, ks_ptr, vs_ptr, out_ptr, lse_ptr,
                   qk_scale, num_blocks, max_ctx, keys_per_split,
                   q_sb, q_ss, q_sh, k_sb, k_so, k_sh, v_sb, v_so, v_sh, bt_sb, ks_sh, vs_sh,
                   o_sb, o_ss, o_sh, o_sp, l_sb, l_ss, l_sh, l_sp,
                   SQ: tl.constexpr, GROUP: tl.constexpr, M_BLOCKS: tl.constexpr, BS: tl.constexpr,
                   D: tl.constexpr, DV: tl.constexpr, D_P: tl.constexpr, DV_P: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr,
                   WINDOW_RIGHT: tl.constexpr, HAS_SINK: tl.constexpr, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr,
                   OUT_DTYPE: tl.constexpr, FINAL: tl.constexpr, DOT_F32: tl.constexpr, EMULATE: tl.constexpr,
                   Q_TO_F16: tl.constexpr, PAGE_TILE: tl.constexpr, V_OPAQUE_CVT: tl.constexpr):
    # grid (B, Hkv * M_BLOCKS, num_splits). Packed row r = s * GROUP + g is query s, head hkv * GROUP + g.
    # Logits are kept in base 2 (qk_scale carries log2(e)), so the running softmax uses exp2.
    b = tl.program_id(0).to(tl.int64)
    hkv = tl.program_id(1) // M_BLOCKS
    mb = tl.program_id(1) % M_BLOCKS
    split = tl.program_id(2)
    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < SQ * GROUP
    s = r // GROUP
    h = hkv * GROUP + r % GROUP
    sk = tl.load(seq_ptr + b)
    q_pos = sk - SQ + s

    d = tl.arange(0, D_P)
    dv = tl.arange(0, DV_P)
    q = tl.load(q_ptr + b * q_sb + (s * q_ss + h * q_sh)[:, None] + d[None, :],
                mask=rmask[:, None] & (d < D)[None, :], other=0.0)
    scale = qk_scale
    if FP8:
        scale = scale * tl.load(ks_ptr + hkv * ks_sh)
    if Q_TO_F16:
        # bf16 q for fp16 dots (FP8 caches): q is divided by the power of two that puts its largest magnitude in
        # [2^14, 2^15] (exact), so every element fp16 holds exactly (fp16 has more mantissa bits than bf16) unless
        # it is 2^29 times smaller than the largest; the logit scale takes the factor back
        qf = q.to(tl.float32)
        qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
        qfac = tl.where(qmax > 0.0, tl.exp2(tl.ceil(tl.log2(qmax * (1.0 / 32768.0)))), 1.0)
        q = (qf / qfac).to(DOT_DTYPE)
        scale = scale * qfac
    else:
        q = q.to(DOT_DTYPE)

    # keys any row of this block may see, cut to this split's slice and to the table's capacity
    s_lo = (mb * BLOCK_M) // GROUP
    s_hi = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // GROUP, SQ - 1)
    lo, hi = key_range(sk - SQ + s_lo, sk - SQ + s_hi, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    k0 = split * keys_per_split
    lo = tl.maximum(lo, k0)
    hi = tl.minimum(tl.minimum(hi, k0 + keys_per_split), max_ctx)
    start = (lo // BLOCK_N) * BLOCK_N  # >= k0: split slices are whole key tiles

    if HAS_SINK:  # split 0 starts from the sink: max = sink, sum = e^0
        sink = tl.load(sink_ptr + h, mask=rmask, other=0.0) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, float("-inf"))
        l_i = tl.where(split == 0, tl.full([BLOCK_M], 1.0, tl.float32), 0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
    bt_row = bt_ptr + b * bt_sb
    kv_rows = tl.arange(0, BLOCK_N)
    k_tile = (kv_rows * k_so)[:, None] + d[None, :]  # PAGE_TILE: a tile's offsets from its first key (loop-invariant)
    v_tile = (kv_rows * v_so)[:, None] + dv[None, :]
    for n0 in tl.range(start, hi, BLOCK_N):
        j = n0 + kv_rows
        inb = j < hi
        if PAGE_TILE:  # BLOCK_N divides the page size: one table entry per tile, one base address
            page = tl.load(bt_row + n0 // BS)
            pok = (page >= 0) & (page < num_blocks)  # a bad page: its keys masked, never dereferenced
            kok = inb & (tl.zeros([BLOCK_N], tl.int32) + pok.to(tl.int32) != 0)
            row = tl.where(pok, page, 0).to(tl.int64)
            slot = n0 % BS
        else:  # a table entry per key
            page = tl.load(bt_row + j // BS, mask=inb, other=-1)
            kok = inb & (page >= 0) & (page < num_blocks)  # bad pages: masked keys, never dereferenced
            row = page.to(tl.int64)
            slot = (j % BS).to(tl.int64)
        kt = _load_kv(_tile_ptrs(k_ptr, row, slot, hkv, k_sb, k_so, k_sh, k_tile, d, PAGE_TILE),
                      kok[:, None] & (d < D)[None, :], FP8, DOT_DTYPE, EMULATE, False)
        qk = _dot(q, tl.trans(kt), DOT_F32) * scale
        ok = visible(q_pos[:, None], j[None, :], sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT) & kok[None, :]
        p, alpha, m_new, l_i = softmax_step(tl.where(ok, qk, float("-inf")), m_i, l_i)
        vt = _load_kv(_tile_ptrs(v_ptr, row, slot, hkv, v_sb, v_so, v_sh, v_tile, dv, PAGE_TILE),
                      kok[:, None] & (dv < DV)[None, :], FP8, DOT_DTYPE, EMULATE, V_OPAQUE_CVT)
        if FP8 and not DOT_F32:  # fp16 dots: P rounded once to fp16
            p16 = p.to(DOT_DTYPE)
        else:  # P in the value dtype, as the tensor-core dot takes it
            p16 = cast_out(p, OUT_DTYPE, EMULATE).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + _dot(p16, vt, DOT_F32)
        m_i = m_new

    norm, lse = softmax_finish(m_i, l_i)
    if FP8:
        norm = norm * tl.load(vs_ptr + hkv * vs_sh)
    o = acc * norm[:, None]
    orow = b * o_sb + s * o_ss + h * o_sh + split * o_sp
    om = rmask[:, None] & (dv < DV)[None, :]
    if FINAL:
        tl.store(out_ptr + orow[:, None] + dv[None, :], cast_out(o, OUT_DTYPE, EMULATE), mask=om)
    else:  # fp32 partials for the split reduction
        tl.store(out_ptr + orow[:, None] + dv[None, :], o, mask=om)
    tl.store(lse_ptr + b * l_sb + s * l_ss + h * l_sh + split * l_sp, lse, mask=rmask)


@triton.jit
def _split_reduce_kernel(po_ptr, pl_ptr, out_ptr, lse_ptr, R, S, DV, BLOCK_R: tl.constexpr, S_P: tl.constexpr,
                         BLOCK_D: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    # grid (row blocks, Dv blocks); partials (R, S, DV) and (R, S) contiguous, R = B * Sq * Hq.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    sp = tl.arange(0, S_P)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = r < R
    lm = rmask[:, None] & (sp < S)[None, :]
    w, lse = lse_weights(tl.load(pl_ptr + (r * S)[:, None] + sp[None, :], mask=lm, other=float("-inf")))
    off = ((r * S)[:, None] + sp[None, :])[:, :, None] * DV + d[None, None, :]
    o = weighted_sum(w, tl.load(po_ptr + off, mask=lm[:, :, None] & (d < DV)[None, None, :], other=0.0))
    tl.store(out_ptr + (r * DV)[:, None] + d[None, :], cast_out(o, OUT_DTYPE, EMULATE),
             mask=rmask[:, None] & (d < DV)[None, :])
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + r, lse, mask=rmask)


# -------------------------------------------------------------------------------------------- launcher


def _launch(q, k_cache, v_cache, block_table, seqused_k, softmax_scale, causal, window_left, window_right, sinks,
            k_scale, v_scale, cfg: DecodeConfig):
    bsz, sq, hq, d = q.shape
    num_blocks, bs, hkv, dv = v_cache.shape
    group = hq // hkv
    dev = q.device
    fp8 = k_cache.dtype in FP8_KV
    kc = k_cache.view(torch.uint8) if fp8 else k_cache
    vc = v_cache.view(torch.uint8) if fp8 else v_cache
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(bsz, sq, hq, dv, dtype=q.dtype, device=dev)
    lse = torch.empty(bsz, sq, hq, dtype=torch.float32, device=dev)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    splits = cfg.num_splits
    o_buf, l_buf, o_sp, l_sp = split_buffers(out, lse, splits)
    max_ctx = block_table.shape[1] * bs
    kps = cfg.block_n * max(1, cdiv(cdiv(max_ctx, splits), cfg.block_n))
    m_blocks = cdiv(sq * group, cfg.block_m)
    dot_f32 = dev.type == "cpu"
    # FP8 caches: fp16 dots on the GPU (codes convert to fp16 in one instruction per pair, not through fp32)
    dot_dtype = tl.float32 if dot_f32 else (tl.float16 if fp8 else TL_DTYPE[q.dtype])
    q_to_f16 = dot_dtype == tl.float16 and q.dtype == torch.bfloat16
    # one table entry per key tile where the tile divides the page (and a page's offsets fit int32)
    page_tile = bs % cfg.block_n == 0 and bs * max(kc.stride(1), vc.stride(1)) < 2**31
    f16_codes = fp8 and dot_dtype == tl.float16  # FP8 codes converted to fp16 on the GPU
    if sinks is not None and sinks.stride(0) != 1:
        sinks = sinks.contiguous()
    ks = k_scale if fp8 else q
    vs = v_scale if fp8 else q
    launch(_decode_kernel, (bsz, hkv * m_blocks, splits),
        q, kc, vc, block_table, seqused_k, sinks if sinks is not None else q, ks, vs, o_buf, l_buf,
        float(softmax_scale) * LOG2E, num_blocks, max_ctx, kps,
        q.stride(0), q.stride(1), q.stride(2), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), block_table.stride(0),
        ks.stride(0) if fp8 and ks.numel() > 1 else 0, vs.stride(0) if fp8 and vs.numel() > 1 else 0,
        o_buf.stride(0), o_buf.stride(1), o_buf.stride(2), o_sp, l_buf.stride(0), l_buf.stride(1),
        l_buf.stride(2), l_sp,
        SQ=sq, GROUP=group, M_BLOCKS=m_blocks, BS=bs, D=d, DV=dv, D_P=max(16, next_pow2(d)),
        DV_P=max(16, next_pow2(dv)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal),
        WINDOW_LEFT=int(window_left), WINDOW_RIGHT=int(window_right), HAS_SINK=sinks is not None, FP8=fp8,
        DOT_DTYPE=dot_dtype, OUT_DTYPE=TL_DTYPE[q.dtype], FINAL=splits == 1, DOT_F32=dot_f32,
        EMULATE=emulate_formats(dev), Q_TO_F16=q_to_f16, PAGE_TILE=page_tile,
        V_OPAQUE_CVT=cfg.v_f16_smem and f16_codes,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    reduce_splits(o_buf, l_buf, out, lse, cfg.reduce_elems)
    return out, lse


def split_buffers(out, lse, splits: int):
    """(partial out, partial lse, their split strides) for out (B, Sq, H, Dv) and lse (B, Sq, H): out and lse
    themselves (stride 0) with one split, else fp32 (B, Sq, H, splits, Dv) / (B, Sq, H, splits) buffers, sized
    from static shapes only (CUDA-graph safe)."""
    if splits == 1:
        return out, lse, 0, 0
    o_buf = torch.empty(*out.shape[:3], splits, out.shape[3], dtype=torch.float32, device=out.device)
    l_buf = torch.empty(*lse.shape, splits, dtype=torch.float32, device=out.device)
    return o_buf, l_buf, o_buf.stride(3), l_buf.stride(3)


# partial-output elements per program of the split reduction for 512-wide values (MLA): one row per program up to
# 4 splits (S_P x 512), half a row at 8: two rows per program are slower at MLA's row counts (docs/attention.md,
# alternatives measured).
WIDE_REDUCE_ELEMS = 2048


def reduce_splits(o_buf, l_buf, out, lse, reduce_elems: int) -> None:
    """Merge the split partials of `split_buffers` into out and lse by LSE (nothing to do with one split)."""
    if o_buf is out:
        return
    rows, splits, dv = lse.numel(), l_buf.shape[-1], out.shape[-1]
    s_p = next_pow2(splits)
    block_d = min(next_pow2(dv), max(16, reduce_elems // s_p))
    block_r = max(1, min(next_pow2(rows), reduce_elems // (s_p * block_d)))
    launch(_split_reduce_kernel, (cdiv(rows, block_r), cdiv(dv, block_d)),
        o_buf, l_buf, out, lse, rows, splits, dv, BLOCK_R=block_r, S_P=s_p, BLOCK_D=block_d,
        OUT_DTYPE=TL_DTYPE[out.dtype], EMULATE=emulate_formats(out.device), num_warps=4)


# ---------------------------------------------------------------------------------------------- config


TARGET_PROGRAMS_PER_SM = 2  # a decode program streams one KV head's keys; ~2 resident per SM keep HBM busy
# FP8 caches with one 16-row tile (up to 16 packed rows: GQA <= 16 at Sq = 1): 2 warps. The 4-warp tile waits on
# shared memory for 4.0 of its 9.0 cycles per instruction (Nsight Compute, H200): the tile's keys split across more
# warps send its row max and sum and P's operand layout through shared memory, and an FP8 tile has half a 16-bit
# tile's bytes to hide that behind. 2 warps read 1.10x / 1.11x faster than 4 at Llama 16 x 8k / 64 x 8k on the
# H200, 1 warp 1.08x / 1.06x (docs/attention.md).
FP8_ONE_TILE_WARPS = 2
MIN_SPLIT_KEYS = 256  # below this a split's keys no longer pay for its share of the partials and the merge
MAX_SPLITS = 64


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    num_splits: int  # key slices per (sequence, KV head): the grid's third axis; 1 writes the output directly
    block_n: int  # keys per loop step (a power of two >= 16)
    block_m: int  # packed (query, head) rows per program: a power of two >= 16 (the tl.dot minimum)
    num_warps: int
    num_stages: int
    reduce_elems: int  # partial-output elements per program of the split reduction
    # FP8 caches on the GPU: V's codes converted to fp16 in the layout they are loaded in, then to the dot's operand
    # layout through shared memory as fp16 (else the codes go to the operand layout first: byte-wise shared loads).
    # K keeps the codes-first order: its fp16 round trip through shared memory is slower (docs/attention.md,
    # alternatives measured).
    v_f16_smem: bool = False


def choose_num_splits(programs: int, max_ctx: int, sm_count: int | None,
                      per_sm: int = TARGET_PROGRAMS_PER_SM) -> int:
    """The split rule, from static sizes only: programs = B x Hkv x row blocks, max_ctx = max_blocks x
    block_size, sm_count None on the interpreter (which pays per program: no splits). Split until the grid
    holds ~per_sm programs per SM, keeping >= MIN_SPLIT_KEYS keys of capacity per split and at most MAX_SPLITS
    splits."""
    if sm_count is None or programs <= 0:
        return 1
    want = max(1, (per_sm * sm_count) // programs)
    return max(1, min(want, max_ctx // MIN_SPLIT_KEYS, MAX_SPLITS))


def decode_config(batch: int, sq: int, hq: int, hkv: int, max_ctx: int, d: int, device: torch.device,
                  num_splits: int = 0, fp8: bool = False) -> DecodeConfig:
    """num_splits 0: `choose_num_splits`. GPU: 64-key tiles (32 at head dim > 128), up to 64 packed rows per
    program, 4 warps (8 for the largest tiles). Interpreter: larger tiles (cost per program and per op).
    The key tile shrinks toward the per-split slice so that small contexts still get distinct splits.
    Page tiles (one table entry per key tile, where the tile divides the page: the launcher checks) everywhere:
    on a 16-bit cache they cost registers but save a table lookup and a 64-bit address per key, which is faster at
    every timed shape (docs/attention.md, alternatives measured).
    FP8 caches on the GPU (sm_89+, the e4m3x2 -> f16x2 convert): V converted to fp16 before its operand layout
    (`v_f16_smem`), 3 pipeline stages (the next tile's copies stay in flight while one is computed: a program's
    FP8 tiles are half a 16-bit tile's bytes), and twice the programs per SM from the split rule, for the same
    bytes in flight per SM as a 16-bit cache."""
    cpu = device.type == "cpu"
    fp8_gpu = fp8 and not cpu and arch_at_least(arch_of(device), "sm_89")
    rows = sq * (hq // max(hkv, 1))
    block_m = max(16, min(next_pow2(rows), 128 if cpu else 64))
    if num_splits <= 0:
        sm = None if cpu else _sm_count(device_index(device))
        per_sm = TARGET_PROGRAMS_PER_SM * (2 if fp8_gpu else 1)
        num_splits = choose_num_splits(batch * hkv * cdiv(rows, block_m), max_ctx, sm, per_sm)
    block_n = 128 if cpu else (64 if d <= 128 else 32)
    per_split = cdiv(max(max_ctx, 1), num_splits)
    block_n = max(16, min(block_n, 1 << (per_split.bit_length() - 1)))
    big = block_m * max(d, 64) >= 8192
    warps = 8 if big and not cpu else (FP8_ONE_TILE_WARPS if fp8_gpu and block_m == 16 else 4)
    return DecodeConfig(num_splits, block_n, block_m, warps, _pipeline_stages(device, fp8_gpu, d, num_splits),
                        32768 if cpu else 4096, v_f16_smem=fp8_gpu)


def _pipeline_stages(device: torch.device, fp8_gpu: bool, d: int, num_splits: int) -> int:
    """Key/value tiles in flight per program. FP8 caches: 3. 16-bit caches on sm_90 at head dim <= 128: 4 when one
    program streams a whole context (one split), 3 with splits (more programs resident per SM share the shared
    memory): measured across GQA 32/8 and 64/8, 1-256 sequences of 1k-128k keys, where 2 stages read the cache
    10-25% slower (docs/attention.md, decode). Elsewhere 2 (the stage bytes of chips with less shared memory)."""
    if fp8_gpu:
        return 3
    if device.type == "cuda" and d <= 128 and arch_of(device) == "sm_90":
        return 4 if num_splits == 1 else 3
    return 2


def config_for_call(q, k_cache, v_cache, block_table, num_splits: int = 0) -> DecodeConfig:
    """`decode_config` from a call's tensors (the table's capacity is the context every split rule reads)."""
    bsz, sq, hq, d = q.shape
    max_ctx = block_table.shape[1] * k_cache.shape[1]
    return decode_config(bsz, sq, hq, k_cache.shape[2], max_ctx, max(d, v_cache.shape[-1]), q.device, num_splits,
                         k_cache.dtype in FP8_KV)


# ---------------------------------------------------------------------------------------------- checks


def supports_attention_decode(q, k_cache, v_cache, block_table, seqused_k, *rest) -> str | None:
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"q dtype {q.dtype} is not bf16 or fp16"
    if k_cache.dtype not in FP8_KV + (q.dtype,) or v_cache.dtype != k_cache.dtype:
        return f"caches {k_cache.dtype}/{v_cache.dtype}: expected both {q.dtype} or both FP8 E4M3"
    if q.shape[1] > MAX_Q:
        return f"{q.shape[1]} queries per sequence > {MAX_Q} (the prefill kernel handles longer runs)"
    if max(q.shape[-1], v_cache.shape[-1]) > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v_cache.shape[-1])} > {MAX_HEAD_DIM}"
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        return "the caches' head dim is not contiguous"
    return None


# ----------------------------------------------------------------------------------------------- entry


def attention_decode(q, k_cache, v_cache, block_table, seqused_k, softmax_scale: float, causal: bool,
                     window_left: int, window_right: int, sinks, k_scale, v_scale, num_splits: int,
                     cfg: DecodeConfig | None = None):
    """(out (B, Sq, Hq, Dv) in q's dtype, lse (B, Sq, Hq) fp32); see the module docstring. num_splits <= 0
    picks the split count with `choose_num_splits`; cfg overrides the whole configuration."""
    check_attention_decode(q, k_cache, v_cache, block_table, seqused_k, softmax_scale, causal, window_left,
                           window_right, sinks, k_scale, v_scale, num_splits)
    cfg = cfg or config_for_call(q, k_cache, v_cache, block_table, num_splits)
    return _launch(q, k_cache, v_cache, block_table, seqused_k, softmax_scale, causal, window_left, window_right,
                   sinks, k_scale, v_scale, cfg)
