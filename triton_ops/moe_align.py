"""MoE align (contiguous + masked layouts), gather and combine (Triton). No atomics anywhere: every output
element has exactly one writer, so results are deterministic. Contract: dispatch/reference/moe.py and
docs/moe_layouts.md.

Counting and ranking use one-hot tiles [CH entries, E experts] (a per-expert histogram by tl.sum, a rank by
tl.cumsum down the entries), walked CH entries at a time with a running per-expert count, so entry order
(token, slot) is the order inside each expert.

Align paths:
* small (T*k <= SMALL_ENTRIES, decode): ONE launch. Every program recounts all entries (<= 1024 ids, cheap)
  so no program waits for another; program 0 scatters the real entries and writes the per-expert tensors,
  every program fills the padding / m_indices of its own block of rows.
* large: three launches: per-chunk counts -> one program scans chunks (per-expert offsets) -> scatter
  chunks + fill row blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dispatch.reference.moe import contiguous_capacity

from ._formats import cast_out
from ._launch import TL_DTYPE, emulate_formats

SMALL_ENTRIES = 1024  # T*k at or below this takes the single-launch path
CH = tl.constexpr(32)  # entries per one-hot tile
CHUNK = 1024  # entries per program on the large path


@triton.jit
def _local(ids_ptr, map_ptr, offs, hi, E, E_GLOBAL, HAS_MAP: tl.constexpr):
    """Local expert of entries offs (< hi), -1 when not local / out of range."""
    ok = offs < hi
    g = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
    if HAS_MAP:
        inr = ok & (g >= 0) & (g < E_GLOBAL)
        g = tl.load(map_ptr + g, mask=inr, other=-1).to(tl.int32)
    return tl.where(ok & (g >= 0) & (g < E), g, -1)


@triton.jit
def _count(ids_ptr, map_ptr, lo, hi, E, E_GLOBAL, HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr):
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(lo, hi, CH):
        e = _local(ids_ptr, map_ptr, c0 + tl.arange(0, CH), hi, E, E_GLOBAL, HAS_MAP)
        counts += tl.sum((e[:, None] == ecols[None, :]).to(tl.int32), 0)
    return counts


@triton.jit
def _scatter(ids_ptr, map_ptr, sorted_ptr, inv_ptr, lo, hi, E, E_GLOBAL, base_rank, start, limit,
             HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr):
    """Entries [lo, hi): rank = base_rank[e] + (same-expert entries before it in [lo, hi)); kept while
    rank < limit; row = start[e] + rank. Writes sorted[row] = entry and inv[entry] = row or -1."""
    ecols = tl.arange(0, BLOCK_E)
    running = base_rank
    for c0 in range(lo, hi, CH):
        offs = c0 + tl.arange(0, CH)
        e = _local(ids_ptr, map_ptr, offs, hi, E, E_GLOBAL, HAS_MAP)
        onehot = (e[:, None] == ecols[None, :]).to(tl.int32)
        before = tl.cumsum(onehot, 0) - onehot + running[None, :]
        rank = tl.sum(onehot * before, 1)
        row = tl.sum(onehot * start[None, :], 1) + rank
        keep = (e >= 0) & (rank < limit)
        tl.store(sorted_ptr + row, offs, mask=keep & (offs < hi))
        tl.store(inv_ptr + offs, tl.where(keep, row, -1), mask=offs < hi)
        running += tl.sum(onehot, 0)


@triton.jit
def _fill(sorted_ptr, mind_ptr, eids_ptr, pid, cap, N, E, start, counts, padded, max_m,
          MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr, FILL_ROWS: tl.constexpr):
    """Rows [pid*FILL_ROWS, +FILL_ROWS): sentinel N on padding rows (real rows belong to the scatter),
    and for the contiguous layout m_indices per row and expert_ids per block."""
    ecols = tl.arange(0, BLOCK_E)
    rows = pid * FILL_ROWS + tl.arange(0, FILL_ROWS)
    inr = rows < cap
    if MASKED:
        e_r = rows // max_m
        cnt = tl.sum(tl.where(ecols[None, :] == e_r[:, None], counts[None, :], 0), 1)
        real = (rows % max_m) < tl.minimum(cnt, max_m)
        tl.store(sorted_ptr + rows, tl.full([FILL_ROWS], 0, tl.int32) + N, mask=inr & ~real)
    else:
        ends = start + padded
        e_r = tl.sum(((ends[None, :] <= rows[:, None]) & (ecols < E)[None, :]).to(tl.int32), 1)
        hit = ecols[None, :] == e_r[:, None]
        st = tl.sum(tl.where(hit, start[None, :], 0), 1)
        cnt = tl.sum(tl.where(hit, counts[None, :], 0), 1)
        real = (e_r < E) & (rows - st < cnt)
        tl.store(sorted_ptr + rows, tl.full([FILL_ROWS], 0, tl.int32) + N, mask=inr & ~real)
        tl.store(mind_ptr + rows, tl.where(real, e_r, -1), mask=inr)
        blk = inr & (rows % BM == 0)
        tl.store(eids_ptr + rows // BM, tl.where(e_r < E, e_r, -1), mask=blk)


@triton.jit
def _offsets(counts, max_m, MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    ecols = tl.arange(0, BLOCK_E)
    if MASKED:
        padded = counts * 0
        start = ecols * max_m
    else:
        padded = (counts + BM - 1) // BM * BM
        start = tl.cumsum(padded, 0) - padded
    return start, padded


@triton.jit
def _write_expert_tensors(counts, start, padded, cnt_ptr, mm_ptr, off_ptr, tot_ptr, E, max_m,
                          MASKED: tl.constexpr, BLOCK_E: tl.constexpr):
    ecols = tl.arange(0, BLOCK_E)
    tl.store(cnt_ptr + ecols, counts, mask=ecols < E)
    if MASKED:
        tl.store(mm_ptr + ecols, tl.minimum(counts, max_m), mask=ecols < E)
    else:
        tl.store(off_ptr + ecols, start, mask=ecols < E)
        total = tl.sum(padded, 0)
        tl.store(off_ptr + E, total)
        tl.store(tot_ptr, total)


@triton.jit
def _align_small_kernel(ids_ptr, map_ptr, sorted_ptr, mind_ptr, eids_ptr, inv_ptr, cnt_ptr, mm_ptr, off_ptr,
                        tot_ptr, N, E, E_GLOBAL, cap, max_m,
                        HAS_MAP: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr,
                        FILL_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    counts = _count(ids_ptr, map_ptr, 0, N, E, E_GLOBAL, HAS_MAP, BLOCK_E)
    start, padded = _offsets(counts, max_m, MASKED, BM, BLOCK_E)
    if pid == 0:
        _write_expert_tensors(counts, start, padded, cnt_ptr, mm_ptr, off_ptr, tot_ptr, E, max_m, MASKED, BLOCK_E)
        limit = max_m if MASKED else N + 1
        _scatter(ids_ptr, map_ptr, sorted_ptr, inv_ptr, 0, N, E, E_GLOBAL, counts * 0, start, limit,
                 HAS_MAP, BLOCK_E)
    _fill(sorted_ptr, mind_ptr, eids_ptr, pid, cap, N, E, start, counts, padded, max_m, MASKED, BM, BLOCK_E,
          FILL_ROWS)


@triton.jit
def _align_count_kernel(ids_ptr, map_ptr, part_ptr, N, E, E_GLOBAL,
                        HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK_: tl.constexpr):
    pid = tl.program_id(0)
    lo = pid * CHUNK_
    counts = _count(ids_ptr, map_ptr, lo, tl.minimum(lo + CHUNK_, N), E, E_GLOBAL, HAS_MAP, BLOCK_E)
    ecols = tl.arange(0, BLOCK_E)
    tl.store(part_ptr + pid * BLOCK_E + ecols, counts)


@triton.jit
def _align_scan_kernel(part_ptr, base_ptr, cnt_ptr, mm_ptr, off_ptr, tot_ptr, start_ptr, n_chunks, E, max_m,
                       MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr):
    ecols = tl.arange(0, BLOCK_E)
    running = tl.zeros([BLOCK_E], tl.int32)
    for c in range(n_chunks):
        tl.store(base_ptr + c * BLOCK_E + ecols, running)
        running += tl.load(part_ptr + c * BLOCK_E + ecols)
    start, padded = _offsets(running, max_m, MASKED, BM, BLOCK_E)
    _write_expert_tensors(running, start, padded, cnt_ptr, mm_ptr, off_ptr, tot_ptr, E, max_m, MASKED, BLOCK_E)
    tl.store(start_ptr + ecols, start)  # scratch copies for the scatter / fill programs
    tl.store(start_ptr + BLOCK_E + ecols, running)
    tl.store(start_ptr + 2 * BLOCK_E + ecols, padded)


@triton.jit
def _align_scatter_kernel(ids_ptr, map_ptr, sorted_ptr, mind_ptr, eids_ptr, inv_ptr, base_ptr, start_ptr,
                          N, E, E_GLOBAL, cap, max_m, n_chunks,
                          HAS_MAP: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr,
                          CHUNK_: tl.constexpr, FILL_ROWS: tl.constexpr):
    pid = tl.program_id(0)
    ecols = tl.arange(0, BLOCK_E)
    start = tl.load(start_ptr + ecols)
    if pid < n_chunks:
        lo = pid * CHUNK_
        base = tl.load(base_ptr + pid * BLOCK_E + ecols)
        limit = max_m if MASKED else N + 1
        _scatter(ids_ptr, map_ptr, sorted_ptr, inv_ptr, lo, tl.minimum(lo + CHUNK_, N), E, E_GLOBAL, base, start,
                 limit, HAS_MAP, BLOCK_E)
    else:
        counts = tl.load(start_ptr + BLOCK_E + ecols)
        padded = tl.load(start_ptr + 2 * BLOCK_E + ecols)
        _fill(sorted_ptr, mind_ptr, eids_ptr, pid - n_chunks, cap, N, E, start, counts, padded, max_m, MASKED,
              BM, BLOCK_E, FILL_ROWS)


def _align(topk_ids, expert_map, num_experts, bm, max_m, masked):
    t, k = topk_ids.shape
    n, dev = t * k, topk_ids.device
    e = num_experts
    cap = e * max_m if masked else contiguous_capacity(n, e, bm)
    i32 = dict(dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(cap, **i32)
    m_ind = torch.empty(0 if masked else cap, **i32)
    eids = torch.empty(0 if masked else cap // bm, **i32)
    inv = torch.empty(n, **i32)
    counts = torch.empty(e, **i32)
    mm = torch.empty(e if masked else 0, **i32)
    offs = torch.empty(0 if masked else e + 1, **i32)
    tot = torch.empty(0 if masked else 1, **i32)
    ids = topk_ids.contiguous()
    emap = ids if expert_map is None else expert_map.contiguous()
    e_global = 0 if expert_map is None else expert_map.numel()
    block_e = triton.next_power_of_2(max(e, 1))
    # fill tiles are [FILL_ROWS, BLOCK_E]: 16K elements over 8 warps on a GPU; under the interpreter, where
    # each program costs a recount, few large ones
    if dev.type == "cpu":
        fill_rows = max(16, min(triton.next_power_of_2(max(cap, 1)), (1 << 19) // block_e))
    else:
        fill_rows = max(16, 16384 // block_e)
    n_fill = triton.cdiv(cap, fill_rows)
    flags = dict(HAS_MAP=expert_map is not None, MASKED=masked, BM=bm, BLOCK_E=block_e, FILL_ROWS=fill_rows,
                 num_warps=8)
    if n <= SMALL_ENTRIES:
        _align_small_kernel[(max(n_fill, 1),)](ids, emap, sorted_ids, m_ind, eids, inv, counts, mm, offs, tot,
                                                n, e, e_global, cap, max_m, **flags)
    else:
        n_chunks = triton.cdiv(n, CHUNK)
        part = torch.empty(n_chunks, block_e, **i32)
        base = torch.empty(n_chunks, block_e, **i32)
        scratch = torch.empty(3, block_e, **i32)
        _align_count_kernel[(n_chunks,)](ids, emap, part, n, e, e_global, HAS_MAP=flags["HAS_MAP"],
                                         BLOCK_E=block_e, CHUNK_=CHUNK)
        _align_scan_kernel[(1,)](part, base, counts, mm, offs, tot, scratch, n_chunks, e, max_m,
                                 MASKED=masked, BM=bm, BLOCK_E=block_e)
        _align_scatter_kernel[(n_chunks + n_fill,)](ids, emap, sorted_ids, m_ind, eids, inv, base, scratch,
                                                    n, e, e_global, cap, max_m, n_chunks, CHUNK_=CHUNK, **flags)
    return sorted_ids, m_ind, eids, inv.view(t, k), counts, mm, offs, tot


def moe_align(topk_ids, expert_map, num_experts, block_m):
    s, m_ind, eids, inv, counts, _, offs, tot = _align(topk_ids, expert_map, num_experts, block_m, 1, False)
    return s, eids, m_ind, tot, offs, counts, inv


def moe_masked_layout(topk_ids, expert_map, num_experts, max_m):
    s, _, _, inv, counts, mm, _, _ = _align(topk_ids, expert_map, num_experts, 1, max_m, True)
    return s.view(num_experts, max_m), mm, counts, inv


# ---------------------------------------------------------------------------------------------- gather


@triton.jit
def _gather_kernel(x_ptr, src_ptr, out_ptr, R, K, N, TOPK, stride_x,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    src = tl.load(src_ptr + rows, mask=rows < R, other=-1)
    ok = (src >= 0) & (src < N)
    tok = tl.where(ok, src // TOPK, 0).to(tl.int64)
    cmask = (cols < K)[None, :]
    v = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :], mask=ok[:, None] & cmask, other=0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], v, mask=(rows < R)[:, None] & cmask)


def _row_tile(rows: int, width: int, elems: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_K, warps) for a [rows, width] streaming tile of about `elems` elements."""
    block_k = min(triton.next_power_of_2(max(width, 1)), elems)
    block_r = max(1, min(triton.next_power_of_2(max(rows, 1)), elems // block_k))
    return block_r, block_k, 8 if block_r * block_k >= 8192 else 4


def moe_gather(x, src_rows, top_k):
    t, kdim = x.shape
    src = src_rows.reshape(-1)
    out = torch.empty(src.numel(), kdim, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.view(*src_rows.shape, kdim)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # copy bytes as they are: fp8 and other 1-byte formats travel as uint8
    xv, ov = (x.view(torch.uint8), out.view(torch.uint8)) if x.element_size() == 1 else (x, out)
    # 16 KB per program on a GPU; whole problems per program under the interpreter (its cost is per program)
    elems = (1 << 16 if x.device.type == "cpu" else 16384) // x.element_size()
    br, bk, warps = _row_tile(src.numel(), kdim, elems)
    grid = (triton.cdiv(src.numel(), br), triton.cdiv(kdim, bk))
    _gather_kernel[grid](xv, src.contiguous(), ov, src.numel(), kdim, t * top_k, top_k, x.stride(0),
                         BLOCK_R=br, BLOCK_K=bk, num_warps=warps)
    return out.view(*src_rows.shape, kdim)


# ---------------------------------------------------------------------------------------------- combine


@triton.jit
def _combine_kernel(eo_ptr, inv_ptr, w_ptr, sh_ptr, out_ptr, T, N, stride_eo, stride_sh,
                    K: tl.constexpr, HAS_SHARED: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = toks < T
    cmask = (cols < N)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + toks * K + j, mask=tmask, other=-1)
        ok = r >= 0
        w = tl.where(ok, tl.load(w_ptr + toks * K + j, mask=tmask, other=0.0).to(tl.float32), 0.0)
        v = tl.load(eo_ptr + r.to(tl.int64)[:, None] * stride_eo + cols[None, :], mask=ok[:, None] & cmask,
                    other=0.0).to(tl.float32)
        acc += w[:, None] * v
    if HAS_SHARED:
        acc += tl.load(sh_ptr + toks.to(tl.int64)[:, None] * stride_sh + cols[None, :],
                       mask=tmask[:, None] & cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + toks.to(tl.int64)[:, None] * N + cols[None, :], cast_out(acc, OUT_DTYPE, EMULATE),
             mask=tmask[:, None] & cmask)


def moe_combine(expert_out, inv_rows, weights, shared, out_dtype):
    n = expert_out.shape[-1]
    eo = expert_out.reshape(-1, n)
    t, k = inv_rows.shape
    out = torch.empty(t, n, dtype=out_dtype, device=expert_out.device)
    if out.numel() == 0:
        return out
    if eo.stride(-1) != 1:
        eo = eo.contiguous()
    sh = None if shared is None else (shared if shared.stride(-1) == 1 else shared.contiguous())
    # GPU: N tiles of <= 1024 so a decode token (T = 1) still spreads over N/1024 programs; 4K fp32
    # accumulators per program at large T. Interpreter: large tiles (its cost is per program).
    if expert_out.device.type == "cpu":
        br, bn, warps = _row_tile(t, n, 1 << 15)
    else:
        bn = min(triton.next_power_of_2(n), 1024)
        br = max(1, min(triton.next_power_of_2(t), 4096 // bn))
        warps = 4
    grid = (triton.cdiv(t, br), triton.cdiv(n, bn))
    _combine_kernel[grid](eo, inv_rows.contiguous(), weights.contiguous(), out if sh is None else sh, out, t, n,
                          eo.stride(0), 0 if sh is None else sh.stride(0), K=k, HAS_SHARED=sh is not None,
                          OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(expert_out.device),
                          BLOCK_T=br, BLOCK_N=bn, num_warps=warps)
    return out


def supports_align(topk_ids, expert_map, num_experts, *args) -> str | None:
    if num_experts > 1024:
        return f"num_experts={num_experts} > 1024: the per-expert one-hot tiles would not fit registers"
    return None
