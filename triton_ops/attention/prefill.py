"""Varlen prefill attention forward (Triton): packed sequences, GQA/MQA, causal and sliding windows (bottom-right
aligned), attention sinks, head dims up to 256 (not necessarily powers of two), LSE output, and an optional paged
KV source (chunked prefill over a cached prefix) in 16-bit or FP8 E4M3 with per-tensor scales.

Contract: dispatch/reference/attention.py (`attention_varlen`; paged = `gather_paged` then the same).

Shape of the work: one program owns BLOCK_M query rows of one (sequence, query head) and streams that head's
keys in BLOCK_N tiles with an online softmax in the log2 domain (log2(e) folded into the logit scale, so every
exponential is one exp2). Only the key tiles some row may see are visited (`mask.key_range`); tiles that every
row sees entirely (`mask.full_key_range`) skip the element mask, so causal and window masking cost a select on
the diagonal / window-edge tiles only. A sink initialises the running max and sum (m = sink, l = 1): no extra
pass, no extra column. Rows with no visible key end with l = 0 and give out 0, lse -inf (or the sink's logit).

Robustness: cu_seqlens are clamped to the tensors' row counts in the kernel, so non-monotonic or too-large
values never read or write out of bounds (they give garbage for those sequences, not a fault). In the paged
source, a block-table entry outside [0, num_blocks) (or a key past the table's width) reads as masked keys.
Rows of q outside every cu_seqlens_q range, or past max_seqlen_q, are not written.

Interpreter (TRITON_INTERPRET=1): its tl.dot multiplies bf16 tiles as raw uint16 bits, its bf16 -> fp32 cast
garbles subnormals, its fp32 -> bf16 cast truncates and its E4M3 decode reads the NaN code 0x7F as 480, so the
interpreter path widens every operand to fp32 from its bits (exact), runs fp32 dots and rounds the output with
integer RNE (`EMULATE`, also the E4M3 decode before sm_89); the GPU path feeds the tensor cores 16-bit operands
with fp32 accumulation (fp32 inputs: IEEE dot, no tensor cores).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from triton_ops._formats import cast_out, e4m3_decode
from triton_ops._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2, prepare
from triton_ops.attention.mask import full_key_range, key_range, visible
from triton_ops.contract.arch import arch_at_least, arch_of
from triton_ops.contract.attention import FP8_KV, check_attention_prefill, check_attention_prefill_paged

OP = "attention_prefill"
OP_PAGED = "attention_prefill_paged"
# constexpr: a jit function may read a module global only when it is one
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MAX_HEAD_DIM = 256  # wider: the fp32 accumulator and the q / K / V tiles outgrow one program's registers and smem
MAX_BATCH = 65535  # sequences per launch: the batch is the grid's second axis


@triton.jit
def _load_operand(ptrs, mask, FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """Masked load (0 where masked) of a q / k / v tile as a dot operand of type DOT_DTYPE.
    FP8: the pointers are to E4M3 bytes; E4M3 values are exact in fp16 / bf16 / fp32, so decoding loses nothing
    (EMULATE: decoded arithmetically, for the interpreter and GPUs without the E4M3 conversion).
    bf16 into an fp32 dot (the interpreter) is widened from its bits: exact, where the interpreter's cast is not."""
    if FP8:
        byte = tl.load(ptrs, mask=mask, other=0)
        if EMULATE:
            return e4m3_decode(byte).to(DOT_DTYPE)
        else:
            return byte.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    elif DOT_DTYPE == tl.float32 and ptrs.dtype.element_ty == tl.bfloat16:
        b = tl.load(ptrs.to(tl.pointer_type(tl.uint16), bitcast=True), mask=mask, other=0)
        return (b.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptrs, mask=mask, other=0.0).to(DOT_DTYPE)


@triton.jit
def _kv_rows(j, sk, k0, b, kvh, bt_ptr, bt_cols, bt_stride, num_pages, k_sb, k_st, k_sh, v_sb, v_st, v_sh,
             PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets (int64) of keys j [BLOCK_N] in k and v, and which of them exist.
    Packed: row k0 + j (k0 and sk are already clamped to k's rows). Paged: slot j % PAGE_SIZE of page
    block_table[b, j // PAGE_SIZE]; a page outside [0, num_pages) or a column past the table reads page 0
    and is reported missing, so the caller masks those keys."""
    if PAGED:
        col = j // PAGE_SIZE
        in_table = (j < sk) & (col < bt_cols)
        page = tl.load(bt_ptr + b.to(tl.int64) * bt_stride + col, mask=in_table, other=0)
        ok = in_table & (page >= 0) & (page < num_pages)
        page = tl.where(ok, page, 0).to(tl.int64)
        slot = (j % PAGE_SIZE).to(tl.int64)
        return page * k_sb + slot * k_st + kvh * k_sh, page * v_sb + slot * v_st + kvh * v_sh, ok
    else:
        row = (k0 + j).to(tl.int64)
        return row * k_st + kvh * k_sh, row * v_st + kvh * v_sh, j < sk


@triton.jit
def _attend_tile(acc, m_i, l_i, q, q_pos, n, sk, k0, b, kvh, k_ptr, v_ptr, bt_ptr, bt_cols, bt_stride, num_pages,
                 k_sb, k_st, k_sh, v_sb, v_st, v_sh, qk_scale,
                 MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, FP8_KV: tl.constexpr, DQK: tl.constexpr,
                 DV: tl.constexpr, DQK_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr):
    """One key tile [n, n + BLOCK_N) folded into the running (acc, m, l); logits in log2 units.
    MASK: apply the causal / window element mask (edge tiles only). Paged tiles always mask missing pages."""
    j = n + tl.arange(0, BLOCK_N)
    k_off, v_off, ok = _kv_rows(j, sk, k0, b, kvh, bt_ptr, bt_cols, bt_stride, num_pages, k_sb, k_st, k_sh,
                                v_sb, v_st, v_sh, PAGED, PAGE_SIZE)
    dk = tl.arange(0, DQK_P)
    kt = _load_operand(k_ptr + k_off[:, None] + dk[None, :], ok[:, None] & (dk < DQK)[None, :], FP8_KV,
                       DOT_DTYPE, EMULATE)
    s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * qk_scale
    if MASK:
        s = tl.where(visible(q_pos[:, None], j[None, :], sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT), s, float("-inf"))
    if PAGED:
        s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASK or PAGED:  # a row may have seen nothing yet: subtract 0 instead of -inf (no NaN from -inf - -inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:  # every row saw a finite logit in this tile
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    dv = tl.arange(0, DV_P)
    vt = _load_operand(v_ptr + v_off[:, None] + dv[None, :], ok[:, None] & (dv < DV)[None, :], FP8_KV,
                       DOT_DTYPE, EMULATE)
    acc = tl.dot(p.to(DOT_DTYPE), vt, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attn_prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sink_ptr, cu_q_ptr, cu_k_ptr, bt_ptr, used_ptr,
                         ks_ptr, vs_ptr, flag_ptr, total_q, total_k, num_pages, bt_cols, bt_stride,
                         q_st, q_sh, k_sb, k_st, k_sh, v_sb, v_st, v_sh, o_st, o_sh, sm_scale,
                         HQ: tl.constexpr, GROUP: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
                         DQK_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                         HAS_SINK: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         FP8_KV: tl.constexpr, KV_SCALE: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         OUT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, EMULATE: tl.constexpr,
                         FLAGGED: tl.constexpr = False):
    # Grid (query blocks x HQ, batch): heads fastest, so the GROUP heads sharing a KV head run side by side and
    # their K/V tiles are L2 hits; the batch rides the second axis (65535 sequences per launch).
    pid = tl.program_id(0)
    b = tl.program_id(1)
    h = pid % HQ
    start_m = (pid // HQ) * BLOCK_M
    kvh = h // GROUP
    if FLAGGED:  # only the sequences flagged (a fixup after another kernel wrote the rest)
        if tl.load(flag_ptr + b) == 0:
            return
    # Clamp the sequence's rows into the tensors, whatever cu_seqlens say (see the module docstring).
    q0 = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b), 0), total_q)
    sq = tl.minimum(tl.maximum(tl.load(cu_q_ptr + b + 1) - q0, 0), total_q - q0)
    if start_m >= sq:
        return
    if PAGED:
        k0 = 0
        sk = tl.maximum(tl.load(used_ptr + b), 0)
    else:
        k0 = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b), 0), total_k)
        sk = tl.minimum(tl.maximum(tl.load(cu_k_ptr + b + 1) - k0, 0), total_k - k0)

    rows = start_m + tl.arange(0, BLOCK_M)
    row_ok = rows < sq
    q_pos = rows + (sk - sq)  # bottom-right alignment
    dk = tl.arange(0, DQK_P)
    q_off = (q0 + rows).to(tl.int64) * q_st + h * q_sh
    q = _load_operand(q_ptr + q_off[:, None] + dk[None, :], row_ok[:, None] & (dk < DQK)[None, :], False,
                      DOT_DTYPE, EMULATE)

    qk_scale = sm_scale * LOG2E
    if KV_SCALE:
        qk_scale = qk_scale * tl.load(ks_ptr)
    if HAS_SINK:
        sink = tl.load(sink_ptr + h) * LOG2E
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], dtype=tl.float32)

    # Key tiles: [a, b_) and [c, hi_up) are edges (element mask), [b_, c) is interior (every row sees every key).
    q_pos_lo = start_m + (sk - sq)
    q_pos_hi = tl.minimum(start_m + BLOCK_M, sq) - 1 + (sk - sq)
    lo, hi = key_range(q_pos_lo, q_pos_hi, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    f_lo, f_hi = full_key_range(q_pos_lo, q_pos_hi, sk, CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    a = (lo // BLOCK_N) * BLOCK_N
    hi_up = ((hi + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    b_ = tl.minimum(tl.maximum(((f_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, a), hi_up)
    c = tl.minimum(tl.maximum((tl.maximum(f_hi, 0) // BLOCK_N) * BLOCK_N, b_), hi_up)
    for n in range(a, b_, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n, sk, k0, b, kvh, k_ptr, v_ptr, bt_ptr, bt_cols,
                                     bt_stride, num_pages, k_sb, k_st, k_sh, v_sb, v_st, v_sh, qk_scale, True,
                                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, PAGED, PAGE_SIZE, FP8_KV, DQK, DV, DQK_P,
                                     DV_P, BLOCK_N, DOT_DTYPE, PRECISION, EMULATE)
    for n in range(b_, c, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n, sk, k0, b, kvh, k_ptr, v_ptr, bt_ptr, bt_cols,
                                     bt_stride, num_pages, k_sb, k_st, k_sh, v_sb, v_st, v_sh, qk_scale, False,
                                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, PAGED, PAGE_SIZE, FP8_KV, DQK, DV, DQK_P,
                                     DV_P, BLOCK_N, DOT_DTYPE, PRECISION, EMULATE)
    for n in range(c, hi_up, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, q_pos, n, sk, k0, b, kvh, k_ptr, v_ptr, bt_ptr, bt_cols,
                                     bt_stride, num_pages, k_sb, k_st, k_sh, v_sb, v_st, v_sh, qk_scale, True,
                                     CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, PAGED, PAGE_SIZE, FP8_KV, DQK, DV, DQK_P,
                                     DV_P, BLOCK_N, DOT_DTYPE, PRECISION, EMULATE)

    # l = 0 only where no key (and no sink) was seen: acc is 0 there too, so out = 0 and lse = -inf.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_SCALE:
        out = out * tl.load(vs_ptr)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    dv = tl.arange(0, DV_P)
    o_off = (q0 + rows).to(tl.int64) * o_st + h * o_sh
    tl.store(o_ptr + o_off[:, None] + dv[None, :], cast_out(out, OUT_DTYPE, EMULATE),
             mask=row_ok[:, None] & (dv < DV)[None, :])
    tl.store(lse_ptr + (q0 + rows).to(tl.int64) * HQ + h, lse, mask=row_ok)


# ------------------------------------------------------------------------------------------- launcher


def _launch_args(q, k, v, out, lse, sinks, cu_q, cu_k, block_table, seqused_k, k_scale, v_scale, softmax_scale,
                 causal, window_left, window_right, cfg, emulate, interpret, flags=None):
    """(positional args, constexprs) of _attn_prefill_kernel for one call; paged when block_table is given
    (k / v are then caches (num_blocks, block_size, Hkv, D)). emulate: `emulate_formats`; interpret: the
    interpreter runs it (every dot in fp32: its tl.dot reads bf16 tiles as raw uint16). Also used to compile the
    kernel without a GPU (host tensors, emulate and interpret False). flags (B,) int32: only the sequences whose
    flag is nonzero are computed (`FLAGGED`); the other rows of out / lse are left as they are."""
    paged = block_table is not None
    hq, dqk = q.shape[1], q.shape[2]
    hkv, dv = k.shape[-2], v.shape[-1]
    fp8 = k.dtype in FP8_KV
    kv_scale = k_scale is not None
    if fp8:  # the kernel reads E4M3 as bytes
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    dummy = cu_q  # any tensor of the device: pointer arguments a constexpr switch leaves unread
    if paged:
        kb, vb = (k.stride(0), k.stride(1), k.stride(2)), (v.stride(0), v.stride(1), v.stride(2))
        pages = (block_table, seqused_k, 0, k.shape[0], block_table.shape[1], block_table.stride(0))
    else:
        kb, vb = (0, k.stride(0), k.stride(1)), (0, v.stride(0), v.stride(1))
        pages = (dummy, dummy, k.shape[0], 0, 0, 0)
    args = (q, k, v, out, lse, dummy if sinks is None else sinks, cu_q, dummy if paged else cu_k, pages[0],
            pages[1], k_scale if kv_scale else dummy, v_scale if kv_scale else dummy,
            dummy if flags is None else flags, q.shape[0], pages[2],
            pages[3], pages[4], pages[5], q.stride(0), q.stride(1), *kb, *vb, out.stride(0), out.stride(1),
            1.0 / math.sqrt(dqk) if softmax_scale is None else float(softmax_scale))
    consts = dict(
        HQ=hq, GROUP=hq // hkv, DQK=dqk, DV=dv, DQK_P=max(16, next_pow2(dqk)), DV_P=max(16, next_pow2(dv)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=bool(causal), WINDOW_LEFT=int(window_left),
        WINDOW_RIGHT=int(window_right), HAS_SINK=sinks is not None, PAGED=paged,
        PAGE_SIZE=k.shape[1] if paged else 1, FP8_KV=fp8, KV_SCALE=kv_scale,
        DOT_DTYPE=tl.float32 if interpret else TL_DTYPE[q.dtype], OUT_DTYPE=TL_DTYPE[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", EMULATE=emulate, FLAGGED=flags is not None)
    return args, consts


def _launch_spec(q, k, v, cu_q, cu_k, block_table, seqused_k, k_scale, v_scale, max_seqlen_q, softmax_scale,
                 causal, window_left, window_right, sinks, cfg, flags, out, lse):
    """(kernel, grid, args, kwargs) of the launch into out / lse, None where there is nothing to compute."""
    total_q, hq = q.shape[0], q.shape[1]
    batch = cu_q.shape[0] - 1
    if total_q == 0 or hq == 0 or batch <= 0 or max_seqlen_q <= 0:
        return None
    cfg = cfg or prefill_config(q.shape[2], v.shape[-1], q.dtype, max_seqlen_q, q.device)
    if sinks is not None and sinks.dtype != torch.float32:
        sinks = sinks.float()
    args, consts = _launch_args(q, k, v, out, lse, sinks, cu_q, cu_k, block_table, seqused_k, k_scale, v_scale,
                                softmax_scale, causal, window_left, window_right, cfg, emulate_formats(q.device),
                                q.device.type == "cpu", flags)
    grid = (cdiv(max_seqlen_q, cfg.block_m) * hq, batch)
    return _attn_prefill_kernel, grid, args, dict(**consts, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                                  enable_fp_fusion=True)


def _launch(q, k, v, cu_q, cu_k, block_table, seqused_k, k_scale, v_scale, max_seqlen_q, softmax_scale, causal,
            window_left, window_right, sinks, cfg, flags=None, out_lse=None):
    """Allocates (out, lse) unless given (`out_lse`: written in place) and launches the kernel over them."""
    if out_lse is None:
        out = torch.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    else:
        out, lse = out_lse
    spec = _launch_spec(q, k, v, cu_q, cu_k, block_table, seqused_k, k_scale, v_scale, max_seqlen_q, softmax_scale,
                        causal, window_left, window_right, sinks, cfg, flags, out, lse)
    if spec is not None:
        launch(spec[0], spec[1], *spec[2], **spec[3])
    return out, lse


# ------------------------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Tiling of the prefill kernel."""

    block_m: int  # query rows per program (one sequence, one query head)
    block_n: int  # keys per inner-loop tile
    num_warps: int  # warps per program (GPU only)
    num_stages: int  # software-pipeline depth of the K/V loads (GPU only)


def prefill_config(dqk: int, dv: int, dtype: torch.dtype, max_seqlen_q: int, device: torch.device) -> PrefillConfig:
    return _prefill_config(dqk, dv, dtype, max_seqlen_q, arch_of(device))


@functools.lru_cache(maxsize=1024)  # called on every eager launch; the answer depends only on these
def _prefill_config(dqk: int, dv: int, dtype: torch.dtype, max_seqlen_q: int, arch: str) -> PrefillConfig:
    """Analytical tile choice (not yet tuned on hardware).

    Head dims <= 128 (padded width): 128 query rows x 8 warps (two warpgroups of 64-row wgmma on sm_90, 64 fp32
    accumulator registers per thread at hd 128), 64-key tiles at hd 128 / 128-key tiles at hd 64 (the logit tile
    is the other big register user), 3 stages on sm_90+ (one K + V stage of 128 x 64 bf16 = 32 KB; 3 leave room
    for q's 32 KB in 228 KB), 2 before. Wider heads (192 padded to 256, 256): 64 x 64 tiles with 4 warps (one
    warpgroup; q 32 KB, each K + V stage 64 KB), 2 stages. fp32 inputs halve the key tile (twice the bytes).
    Short queries (max_seqlen_q <= 64) take 64-row blocks so fewer rows are padding.
    Interpreter: 16 x 16 tiles, so small test sequences still have interior, edge and skipped tiles."""
    if arch == "cpu":
        return PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    width = max(next_pow2(dqk), next_pow2(dv))
    stages = 3 if arch_at_least(arch, "sm_90") else 2
    if width <= 128:
        block_m, block_n, warps = 128, (128 if width <= 64 else 64), 8
    else:
        block_m, block_n, warps, stages = 64, 64, 4, 2
    if dtype == torch.float32:
        block_n //= 2
    if max_seqlen_q <= 64 and block_m > 64:
        block_m, warps = 64, 4
    return PrefillConfig(block_m, block_n, warps, stages)


# ------------------------------------------------------------------------------------------- checks


def _shape_reason(dqk: int, dv: int, batch: int) -> str | None:
    if dqk > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        return f"head dims (qk {dqk}, v {dv}) above {MAX_HEAD_DIM} do not fit one program's registers"
    if batch > MAX_BATCH:
        return f"{batch} sequences: the grid's second axis holds at most {MAX_BATCH}"
    return None


def supports_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_left, window_right, sinks, return_lse) -> str | None:
    if q.dtype not in TL_DTYPE:
        return f"q dtype {q.dtype} is not bf16 / fp16 / fp32"
    return _shape_reason(q.shape[-1], v.shape[-1], cu_seqlens_q.shape[0] - 1)


def supports_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                                     softmax_scale, causal, window_left, window_right, sinks, k_scale,
                                     v_scale) -> str | None:
    if q.dtype not in TL_DTYPE:
        return f"q dtype {q.dtype} is not bf16 / fp16 / fp32"
    if k_cache.dtype not in (q.dtype, *FP8_KV):
        return f"cache dtype {k_cache.dtype} is neither q's dtype nor FP8 E4M3"
    return _shape_reason(q.shape[-1], v_cache.shape[-1], cu_seqlens_q.shape[0] - 1)


# ------------------------------------------------------------------------------------------- entries


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float, causal: bool, window_left: int, window_right: int,
                      sinks: torch.Tensor | None, return_lse: bool, *, cfg: PrefillConfig | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen attention (see the module docstring): (out (total_q, Hq, Dv) in q's dtype, lse (total_q, Hq)
    fp32 natural log). The lse is always computed (one fp32 per row and head), so return_lse changes nothing here;
    max_seqlen_k is not needed either (each program reads its own cu_seqlens_k). softmax_scale None: 1/sqrt(Dqk)."""
    check_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            window_left, window_right, sinks, return_lse)
    return _launch(q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, None, None, int(max_seqlen_q), softmax_scale,
                   causal, window_left, window_right, sinks, cfg)


def attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                            softmax_scale: float, causal: bool, window_left: int, window_right: int,
                            sinks: torch.Tensor | None, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                            *, cfg: PrefillConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill over a paged KV source: sequence b's keys are positions 0..seqused_k[b]-1 of k_cache / v_cache
    (num_blocks, block_size, Hkv, D) read through block_table[b]; its queries (cu_seqlens_q) are the last ones.
    FP8 caches (float8_e4m3fn or uint8 E4M3 bytes) hold value = code * scale with per-tensor fp32 scales;
    scales given with a 16-bit cache multiply it the same way. Returns (out, lse) as `attention_prefill`."""
    check_attention_prefill_paged(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q,
                                  softmax_scale, causal, window_left, window_right, sinks, k_scale, v_scale)
    return _launch(q, k_cache, v_cache, cu_seqlens_q, None, block_table, seqused_k, k_scale, v_scale,
                   int(max_seqlen_q), softmax_scale, causal, window_left, window_right, sinks, cfg)


def attention_prefill_paged_flagged(out, lse, q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k,
                                    max_seqlen_q: int, softmax_scale: float, causal: bool, window_left: int,
                                    window_right: int, sinks: torch.Tensor | None, k_scale: torch.Tensor | None,
                                    v_scale: torch.Tensor | None, flags: torch.Tensor) -> None:
    """`attention_prefill_paged` for the sequences b with flags[b] != 0 only, written into out / lse in place (the
    other rows are left as they are). The gathered paged prefill's fixup for keys a contiguous kernel cannot mask
    (paged_gather.py); the programs of unflagged sequences read one flag and exit. Inputs as checked by the op."""
    _launch(q, k_cache, v_cache, cu_seqlens_q, None, block_table, seqused_k, k_scale, v_scale, int(max_seqlen_q),
            softmax_scale, causal, window_left, window_right, sinks, None, flags, (out, lse))


def prepare_attention_prefill_paged_flagged(out, lse, q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k,
                                            max_seqlen_q: int, softmax_scale: float, causal: bool, window_left: int,
                                            window_right: int, sinks, k_scale, v_scale, flags):
    """A launcher of `attention_prefill_paged_flagged` for repeated calls with this exact signature (the plain
    arguments fixed; the tensors' dtypes, shapes, strides and alignment too): fn(out, lse, q, k_cache, v_cache,
    cu_seqlens_q, block_table, seqused_k, sinks, k_scale, v_scale, flags) launches through a compiled launcher
    (triton_ops._launch.prepare), or does nothing where the call launches nothing; None where no launcher can be
    made (a tensor argument it cannot map)."""
    spec = _launch_spec(q, k_cache, v_cache, cu_seqlens_q, None, block_table, seqused_k, k_scale, v_scale,
                        int(max_seqlen_q), softmax_scale, causal, window_left, window_right, sinks, None, flags, out,
                        lse)
    if spec is None:
        return _launches_nothing
    kernel, grid, args, kwargs = spec
    sources = (out, lse, q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, sinks, k_scale, v_scale, flags)
    return prepare(kernel, grid, sources, *args, **kwargs)


def _launches_nothing(*tensors) -> None:
    """The prepared fixup of a call whose launch grid is empty."""


__all__ = ["PrefillConfig", "attention_prefill", "attention_prefill_paged", "attention_prefill_paged_flagged",
           "prefill_config", "prepare_attention_prefill_paged_flagged",
           "supports_attention_prefill", "supports_attention_prefill_paged"]
