"""MoE align (contiguous + masked layouts), gather and combine (Triton). No global atomics: every output
element has exactly one writer, so results are deterministic (tl.histogram's shared-memory integer adds are
order-independent). Contract: dispatch/reference/moe.py and docs/moe.md.

Align paths:
* small (T*k <= SMALL_ENTRIES, decode): ONE launch, no loop over the entries. Every program loads all the
  <= 1024 ids into registers (one per thread-slot) and owns EPP experts (GPU: one): ranks by one cumsum of
  (e == x) along the entries, expert starts by one tl.histogram of the entries; it writes its experts' rows,
  padding, block ids and inverse map, plus an equal share of the rows past the padded total. No program
  waits for another and the grid (E / EPP) depends on shapes only.
* large: three launches over chunks of GENERAL_CHUNK entries, grid fixed by the shapes: per-chunk expert
  counts by one tl.histogram -> per-(chunk, expert) bases by a cumsum down the chunks (programs over expert
  blocks) -> scatter (an entry's rank inside its chunk from one [CH, CH] compare of the earlier same-expert
  entries; no loop over the entries) + fill row blocks. Entry order (token, slot) is the order inside each
  expert, like the reference's stable sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_ops.contract.formats import contiguous_capacity

from .._formats import cast_out
from .._launch import TL_DTYPE, cdiv, emulate_formats, launch, next_pow2

SMALL_ENTRIES = 1024  # T*k at or below this takes the single-launch path
SINGLE_MAX_ENTRIES = 8192  # path='single' (benchmark sweeps) holds all entries in registers: bounded
SMALL_WARPS = 4
GENERAL_CHUNK = 128  # GPU entries per chunk program on the large path ([CH, CH] rank compare: 16K elements)
GENERAL_CHUNK_CPU = 1024  # interpreter: few large programs (its cost is per program)
GENERAL_WARPS = 4  # chunk >= 32 * warps: the histogram input is never replicated across threads
SCAN_EB = 16  # experts per scan program (E=256: 16 programs)
SCAN_ELEMS = 8192  # [chunks, SCAN_EB] tile of one scan step
SCAN_ELEMS_CPU = 1 << 20  # interpreter: one scan step
SCAN_WARPS = 8  # 32 tile elements per thread (4 warps spill the cumsum at 8K elements)


@triton.jit
def _local(ids_ptr, map_ptr, offs, hi, E, E_GLOBAL, HAS_MAP: tl.constexpr):
    """Local expert of entries offs (< hi), -1 when not local / out of range. Ids and map values are compared in
    their own width (int32 or int64) and narrowed only once known to be in range: an int64 id of 2^32 + 3 is
    out of range, not expert 3."""
    ok = offs < hi
    g = tl.load(ids_ptr + offs, mask=ok, other=-1)
    if HAS_MAP:
        inr = ok & (g >= 0) & (g < E_GLOBAL)
        g = tl.load(map_ptr + g, mask=inr, other=-1)
    return tl.where(ok & (g >= 0) & (g < E), g, -1).to(tl.int32)


@triton.jit
def _fill(sorted_ptr, mind_ptr, eids_ptr, pid, cap, N, E, start, counts, padded, unit,
          MASKED: tl.constexpr, NU: tl.constexpr, UNITP: tl.constexpr, BLOCK_E: tl.constexpr):
    """Units [pid*NU, +NU) as a [NU, UNITP] row tile: sentinel N on padding rows (real rows belong to the
    scatter), and for the contiguous layout m_indices per row and expert_ids per block.
    A unit is one block of `unit` = block_m rows (contiguous: every block holds one expert) or one expert's
    `unit` = max_m rows (masked), so the expert search is per unit ([NU, E]), not per row ([rows, E])."""
    ecols = tl.arange(0, BLOCK_E)
    u = pid * NU + tl.arange(0, NU)
    i = tl.arange(0, UNITP)
    rows = u[:, None] * unit + i[None, :]
    inr = (i < unit)[None, :] & (rows < cap)
    if MASKED:
        e_u = u
    else:
        ends = start + padded
        e_u = tl.sum(((ends[None, :] <= (u * unit)[:, None]) & (ecols < E)[None, :]).to(tl.int32), 1)
    hit = ecols[None, :] == e_u[:, None]
    cnt = tl.sum(tl.where(hit, counts[None, :], 0), 1)
    if MASKED:
        real = i[None, :] < tl.minimum(cnt, unit)[:, None]
        tl.store(sorted_ptr + rows, tl.full([NU, UNITP], 0, tl.int32) + N, mask=inr & ~real)
    else:
        st = tl.sum(tl.where(hit, start[None, :], 0), 1)
        real = (e_u < E)[:, None] & (rows - st[:, None] < cnt[:, None])
        tl.store(sorted_ptr + rows, tl.full([NU, UNITP], 0, tl.int32) + N, mask=inr & ~real)
        tl.store(mind_ptr + rows, tl.where(real, e_u[:, None], -1), mask=inr)
        tl.store(eids_ptr + u, tl.where(e_u < E, e_u, -1), mask=u * unit < cap)


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
                        HAS_MAP: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_E: tl.constexpr, EPP: tl.constexpr, PAD_T: tl.constexpr, TAIL_T: tl.constexpr):
    """Single launch, no loop over the entries: program p owns experts [p*EPP, p*EPP + EPP) (GPU: one) and
    holds ALL the N <= BLOCK_N entries in registers. An entry's rank inside its expert is an exclusive cumsum
    of the [EPP, BLOCK_N] match tile along the entries (entry order = order inside the expert); the contiguous
    start of an expert is the sum of the padded counts of the experts below it (one tl.histogram of the
    local entries). The program writes its experts' real rows, padding rows, block expert ids, counts /
    offsets / masked_m and the inverse map of their entries; program 0 also writes inv = -1 of non-local
    entries; the rows past the padded total (contiguous) are shared evenly by all programs. Every output
    element has one writer and no program depends on another, so the grid is data-independent (CUDA graphs).
    (The old version looped over the entries 32 at a time in ONE program: 36 barriers per 32 entries.)"""
    pid = tl.program_id(0)
    # entries through a select (lanes past N read as N, masked everywhere): not provably contiguous, so the
    # coalescing pass gives the ids load and the inv stores the same one-entry-per-thread layout as the
    # data-dependent row stores; a contiguous arange gets a 4-wide layout and Triton converts 64-bit pointer
    # tensors between the two through shared memory (sm_90 SASS at T=64: 20 -> 10 barriers)
    offs = tl.arange(0, BLOCK_N)
    offs = tl.where(offs < N, offs, N)
    e = _local(ids_ptr, map_ptr, offs, N, E, E_GLOBAL, HAS_MAP)
    ex = pid * EPP + tl.arange(0, EPP)
    own = ex < E
    hit = (e[None, :] == ex[:, None]).to(tl.int32)  # [EPP, BLOCK_N]; -1 (non-local / past N) never matches
    rank = tl.cumsum(hit, 1) - hit
    cnt = tl.sum(hit, 1)
    entry = offs[None, :] + rank * 0
    if MASKED:
        start = ex * max_m
        keep = (hit != 0) & (rank < max_m)
    else:
        ecols = tl.arange(0, BLOCK_E)
        padded = (tl.histogram(e, BLOCK_E, mask=e >= 0) + (BM - 1)) // BM * BM
        start = tl.sum(tl.where(ecols[None, :] < ex[:, None], padded[None, :], 0), 1)
        total = tl.sum(padded, 0)
        keep = hit != 0
    row = start[:, None] + rank
    tl.store(sorted_ptr + row, entry, mask=keep)
    tl.store(inv_ptr + entry, tl.where(keep, row, -1), mask=hit != 0)
    tl.store(cnt_ptr + ex, cnt, mask=own)
    if pid == 0:
        tl.store(inv_ptr + offs, tl.full([BLOCK_N], -1, tl.int32), mask=(offs < N) & (e < 0))
    if MASKED:
        kept = tl.minimum(cnt, max_m)
        tl.store(mm_ptr + ex, kept, mask=own)
        # rows [min(count, max_m), max_m) of each own expert: sentinel
        i = tl.arange(0, PAD_T)
        for i0 in range(0, max_m, PAD_T):
            rel = i0 + i[None, :] + ex[:, None] * 0
            pad = own[:, None] & (rel >= kept[:, None]) & (rel < max_m)
            tl.store(sorted_ptr + start[:, None] + rel, rel * 0 + N, mask=pad)
    else:
        tl.store(mind_ptr + row, ex[:, None] + rank * 0, mask=keep)
        tl.store(eids_ptr + row // BM, ex[:, None] + rank * 0, mask=keep & (rank % BM == 0))  # first row / block
        tl.store(off_ptr + ex, start, mask=own)
        if pid == 0:
            tl.store(off_ptr + E, total)
            tl.store(tot_ptr, total)
        # the < BM padding rows after each own expert's real rows
        rows = (start + cnt)[:, None] + tl.arange(0, PAD_T)[None, :]
        pad = own[:, None] & (rows < (start + (cnt + (BM - 1)) // BM * BM)[:, None])
        tl.store(sorted_ptr + rows, rows * 0 + N, mask=pad)
        tl.store(mind_ptr + rows, rows * 0 - 1, mask=pad)
        # rows [total, cap), an equal share per program: sentinel, m_indices -1, expert_ids -1 per block
        share = tl.cdiv(cap - total, tl.num_programs(0))
        lo = total + pid * share
        hi = tl.minimum(lo + share, cap)
        for r0 in range(lo, hi, TAIL_T):
            r = r0 + tl.arange(0, TAIL_T)
            tail = r < hi
            tl.store(sorted_ptr + r, r * 0 + N, mask=tail)
            tl.store(mind_ptr + r, r * 0 - 1, mask=tail)
            tl.store(eids_ptr + r // BM, r * 0 - 1, mask=tail & (r % BM == 0))


@triton.jit
def _chunk_entries(ids_ptr, map_ptr, pid, N, E, E_GLOBAL, HAS_MAP: tl.constexpr, CH: tl.constexpr):
    """Entries of chunk pid and their local experts (-1: not local / past N). Offsets through a select (lanes
    past N read as N, masked everywhere): not provably contiguous, so the ids load, the inv store and the
    data-dependent row stores share one layout (see _align_small_kernel)."""
    offs = pid * CH + tl.arange(0, CH)
    offs = tl.where(offs < N, offs, N)
    return offs, _local(ids_ptr, map_ptr, offs, N, E, E_GLOBAL, HAS_MAP)


@triton.jit
def _align_count_kernel(ids_ptr, map_ptr, part_ptr, N, E, E_GLOBAL,
                        HAS_MAP: tl.constexpr, BLOCK_E: tl.constexpr, CH: tl.constexpr):
    """part[c, x] = entries of chunk c with local expert x: one tl.histogram, no loop."""
    pid = tl.program_id(0)
    _, e = _chunk_entries(ids_ptr, map_ptr, pid, N, E, E_GLOBAL, HAS_MAP, CH)
    counts = tl.histogram(e, BLOCK_E, mask=e >= 0)
    tl.store(part_ptr + pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _align_scan_kernel(part_ptr, base_ptr, tot_ptr, n_chunks,
                       BLOCK_E: tl.constexpr, EB: tl.constexpr, CB: tl.constexpr):
    """Program p owns experts [p*EB, p*EB + EB): base[c, x] = sum of part[c', x] over chunks c' < c (a cumsum
    down [CB chunks, EB] tiles, CB >= all chunks at the usual sizes), tot[x] = all of them."""
    ex = tl.program_id(0) * EB + tl.arange(0, EB)
    c = tl.arange(0, CB)
    running = tl.zeros([EB], tl.int32)
    for c0 in range(0, n_chunks, CB):
        rows = c0 + c
        m = (rows < n_chunks)[:, None]
        at = rows.to(tl.int64)[:, None] * BLOCK_E + ex[None, :]
        p = tl.load(part_ptr + at, mask=m, other=0)
        tl.store(base_ptr + at, tl.cumsum(p, 0) - p + running[None, :], mask=m)
        running += tl.sum(p, 0)
    tl.store(tot_ptr + ex, running)


@triton.jit
def _align_scatter_kernel(ids_ptr, map_ptr, sorted_ptr, mind_ptr, eids_ptr, inv_ptr, base_ptr, tot_ptr,
                          cnt_ptr, mm_ptr, off_ptr, total_ptr, N, E, E_GLOBAL, cap, max_m, unit, n_chunks,
                          HAS_MAP: tl.constexpr, MASKED: tl.constexpr, BM: tl.constexpr, BLOCK_E: tl.constexpr,
                          CH: tl.constexpr, NU: tl.constexpr, UNITP: tl.constexpr):
    """Programs [0, n_chunks): chunk pid's entries; rank = base[pid, e] + same-expert entries earlier in the
    chunk (one [CH, CH] compare, summed); kept while rank < limit; row = start[e] + rank. Programs past
    n_chunks: padding / tail rows (_fill). Program 0 also writes counts / offsets / masked_m / total."""
    pid = tl.program_id(0)
    ecols = tl.arange(0, BLOCK_E)
    counts = tl.load(tot_ptr + ecols)
    start, padded = _offsets(counts, max_m, MASKED, BM, BLOCK_E)
    if pid == 0:
        _write_expert_tensors(counts, start, padded, cnt_ptr, mm_ptr, off_ptr, total_ptr, E, max_m, MASKED,
                              BLOCK_E)
    if pid < n_chunks:
        offs, e = _chunk_entries(ids_ptr, map_ptr, pid, N, E, E_GLOBAL, HAS_MAP, CH)
        ok = e >= 0
        ex = tl.where(ok, e, 0)
        i = tl.arange(0, CH)
        # [j, i]: entry j is earlier than entry i and has the same expert; summed down axis 0 (the warps' axis
        # of the default layout: per-thread adds, then one cross-warp step; summing axis 1 costs a warp
        # reduction per row)
        earlier = (e[:, None] == e[None, :]) & (i[:, None] < i[None, :])
        rank = tl.load(base_ptr + pid.to(tl.int64) * BLOCK_E + ex, mask=ok, other=0) + tl.sum(earlier.to(tl.int32), 0)
        if MASKED:
            keep = ok & (rank < max_m)
            row = ex * max_m + rank
        else:
            keep = ok
            row = tl.gather(start, ex, 0) + rank
        tl.store(sorted_ptr + row, offs, mask=keep)
        tl.store(inv_ptr + offs, tl.where(keep, row, -1), mask=offs < N)
    else:
        _fill(sorted_ptr, mind_ptr, eids_ptr, pid - n_chunks, cap, N, E, start, counts, padded, unit, MASKED,
              NU, UNITP, BLOCK_E)


def _small_config(n: int, e: int, bm: int, max_m: int, masked: bool, has_map: bool,
                  interpreter: bool) -> tuple[int, dict]:
    """(grid, flags) of the single-launch kernel. EPP experts per program: GPU one expert per program up to
    E = 256 (every program is resident at once and does a few hundred instructions per thread: the launch is
    latency-bound, so more programs cost nothing); interpreter one program for everything (its cost is per
    program and per op)."""
    epp = next_pow2(max(e, 1)) if interpreter else next_pow2(cdiv(max(e, 1), 256))
    # masked: sentinel tiles of [EPP, PAD_T] rows per loop step; contiguous: < block_m padding rows per expert
    pad_t = next_pow2(min(max_m, max(1, (1 << 18 if interpreter else 1024) // epp))) if masked else next_pow2(bm)
    # BLOCK_N >= 32 * warps: the histogram input is never replicated across threads (the ballot lowering of
    # tl.histogram counts every lane that holds an element); BLOCK_E >= 32 bins (one per lane)
    return cdiv(e, epp), dict(HAS_MAP=has_map, MASKED=masked, BM=bm, BLOCK_N=max(next_pow2(n), 32 * SMALL_WARPS),
                              BLOCK_E=max(next_pow2(e), 32), EPP=epp, PAD_T=pad_t,
                              TAIL_T=1 << 16 if interpreter else 512, num_warps=SMALL_WARPS)


def _align_general(ids, emap, sorted_ids, m_ind, eids, inv, counts, mm, offs, tot, n, e, e_global, cap, bm, max_m,
                   masked, has_map, dev):
    i32 = dict(dtype=torch.int32, device=dev)
    cpu = dev.type == "cpu"
    block_e = max(next_pow2(max(e, 1)), 32)  # >= 32 histogram bins, >= SCAN_EB
    ch = GENERAL_CHUNK_CPU if cpu else GENERAL_CHUNK
    # fill tiles: NU units (blocks of block_m rows, or experts of max_m rows) per program, [NU, UNITP] rows and
    # an [NU, BLOCK_E] expert search; GPU: <= 8K rows and <= 16K search elements. Interpreter: few large
    # programs (its cost is per program).
    unit = max_m if masked else bm
    n_units = e if masked else cap // bm
    unitp = next_pow2(unit)
    lim = (1 << 18) if cpu else (1 << 13)
    nu = max(1, min(next_pow2(max(n_units, 1)), max(1, lim // unitp), max(1, 2 * lim // block_e)))
    n_fill = cdiv(n_units, nu)
    n_chunks = max(cdiv(n, ch), 1)
    eb = SCAN_EB
    cb = min(next_pow2(n_chunks), max(1, (SCAN_ELEMS_CPU if cpu else SCAN_ELEMS) // eb))
    part = torch.empty(n_chunks, block_e, **i32)
    base = torch.empty(n_chunks, block_e, **i32)
    totals = torch.empty(block_e, **i32)
    launch(_align_count_kernel, (n_chunks,), ids, emap, part, n, e, e_global, HAS_MAP=has_map, BLOCK_E=block_e,
           CH=ch, num_warps=GENERAL_WARPS)
    launch(_align_scan_kernel, (block_e // eb,), part, base, totals, n_chunks, BLOCK_E=block_e, EB=eb, CB=cb,
           num_warps=SCAN_WARPS)
    launch(_align_scatter_kernel, (n_chunks + n_fill,), ids, emap, sorted_ids, m_ind, eids, inv, base, totals,
           counts, mm, offs, tot, n, e, e_global, cap, max_m, unit, n_chunks, HAS_MAP=has_map, MASKED=masked, BM=bm,
           BLOCK_E=block_e, CH=ch, NU=nu, UNITP=unitp, num_warps=GENERAL_WARPS)


def _align(topk_ids, expert_map, num_experts, bm, max_m, masked, path="auto"):
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
    has_map = expert_map is not None
    if path not in ("auto", "single", "general"):
        raise ValueError(f"moe_align: path must be 'auto', 'single' or 'general', got {path!r}")
    if path == "single" or (path == "auto" and n <= SMALL_ENTRIES):
        if n > SINGLE_MAX_ENTRIES:
            raise ValueError(f"moe_align: path='single' holds all T*k entries in registers: T*k={n} > "
                             f"{SINGLE_MAX_ENTRIES}")
        grid, flags = _small_config(n, e, bm, max_m, masked, has_map, dev.type == "cpu")
        launch(_align_small_kernel, (grid,), ids, emap, sorted_ids, m_ind, eids, inv, counts, mm, offs, tot, n, e,
               e_global, cap, max_m, **flags)
    else:
        _align_general(ids, emap, sorted_ids, m_ind, eids, inv, counts, mm, offs, tot, n, e, e_global, cap, bm,
                       max_m, masked, has_map, dev)
    return sorted_ids, m_ind, eids, inv.view(t, k), counts, mm, offs, tot


def moe_align(topk_ids, expert_map, num_experts, block_m, path: str = "auto"):
    """path (benchmarks only; the dispatcher uses "auto"): "single" forces the one-launch path,
    "general" the three-launch path; "auto" takes the single launch for T*k <= SMALL_ENTRIES."""
    s, m_ind, eids, inv, counts, _, offs, tot = _align(topk_ids, expert_map, num_experts, block_m, 1, False,
                                                       path)
    return s, eids, m_ind, tot, offs, counts, inv


def moe_masked_layout(topk_ids, expert_map, num_experts, max_m, path: str = "auto"):
    s, _, _, inv, counts, mm, _, _ = _align(topk_ids, expert_map, num_experts, 1, max_m, True, path)
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
    block_k = min(next_pow2(max(width, 1)), elems)
    block_r = max(1, min(next_pow2(max(rows, 1)), elems // block_k))
    return block_r, block_k, 8 if block_r * block_k >= 8192 else 4


def moe_gather(x, src_rows, top_k, tile: tuple[int, int, int] | None = None):
    """tile: (BLOCK_R, BLOCK_K, warps) override for benchmark sweeps; default _row_tile over ~16 KB per program."""
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
    br, bk, warps = tile or _row_tile(src.numel(), kdim, elems)
    grid = (cdiv(src.numel(), br), cdiv(kdim, bk))
    launch(_gather_kernel, grid, xv, src.contiguous(), ov, src.numel(), kdim, t * top_k, top_k, x.stride(0),
                         BLOCK_R=br, BLOCK_K=bk, num_warps=warps)
    return out.view(*src_rows.shape, kdim)


# ---------------------------------------------------------------------------------------------- combine


@triton.jit
def _combine_kernel(eo_ptr, inv_ptr, w_ptr, sh_ptr, out_ptr, T, N, R, stride_eo, stride_sh,
                    K: tl.constexpr, HAS_SHARED: tl.constexpr, OUT_DTYPE: tl.constexpr, EMULATE: tl.constexpr,
                    BLOCK_N: tl.constexpr, TOKEN_ORDER: tl.constexpr = False):
    """One token x BLOCK_N columns per program (grid: N tiles fastest, so the programs of a token run together).
    Row ids and weights are scalars (one broadcast load each per slot), each slot's row is one [BLOCK_N] load:
    8 columns = 16 bytes per thread per slot, and the K loads are independent so all of them can be in
    flight at once. acc = ((0 + w0*v0) + w1*v1) + ...: the reference's order; the launch disables FMA
    contraction, so the GPU rounds w*v and the sum separately like torch (bytes equal the reference).
    A slot whose row is outside [0, R) (R = rows of expert_out) is masked: not read, weight 0. TOKEN_ORDER: the
    rows are already in slot order (row t * K + j holds slot j of token t), inv_ptr only says which slots have one
    (>= 0); slots without one are masked the same way."""
    nt = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    tok = pid // nt
    cols = (pid % nt) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(K):
        r = tl.load(inv_ptr + tok * K + j)
        if TOKEN_ORDER:
            r = tl.where(r >= 0, tok * K + j, -1)
        w = tl.load(w_ptr + tok * K + j).to(tl.float32)
        inr = (r >= 0) & (r < R)
        w = tl.where(inr, w, 0.0)
        ok = cmask & ((cols * 0 + inr.to(tl.int32)) != 0)  # a vector mask (the interpreter rejects scalar & vector)
        v = tl.load(eo_ptr + r.to(tl.int64) * stride_eo + cols, mask=ok, other=0.0).to(tl.float32)
        acc += w * v
    row = tok.to(tl.int64)
    if HAS_SHARED:
        acc += tl.load(sh_ptr + row * stride_sh + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, cast_out(acc, OUT_DTYPE, EMULATE), mask=cmask)


def combine_block_n(t: int, n: int, device: torch.device) -> int:
    """Columns per program. GPU: 1024 (4 warps x 8 columns x 16 bytes per slot), down to 256 while the grid
    would be under 2 programs per SM (decode: a single token still spreads over N/256 programs).
    Interpreter: the whole row (its cost is per program)."""
    if device.type == "cpu":
        return next_pow2(n)
    bn = 1024
    while bn > 256 and t * cdiv(n, bn) < 264:
        bn //= 2
    return bn


def moe_combine(expert_out, inv_rows, weights, shared, out_dtype, block_n: int | None = None,
                token_order: bool = False):
    """out[t] = sum_j weights[t, j] * expert_out[inv_rows[t, j]] (+ shared[t]); token_order: expert_out's row
    t * k + j is slot j of token t, and inv_rows only marks the slots that have a row (>= 0)."""
    n = expert_out.shape[-1]
    t, k = inv_rows.shape
    out = torch.empty(t, n, dtype=out_dtype, device=expert_out.device)
    if out.numel() == 0:
        return out
    eo = expert_out.reshape(-1, n)
    if eo.stride(-1) != 1:
        eo = eo.contiguous()
    sh = None if shared is None else (shared if shared.stride(-1) == 1 else shared.contiguous())
    bn = block_n or combine_block_n(t, n, expert_out.device)
    grid = (t * cdiv(n, bn),)
    rows = eo.shape[0]
    if rows == 0:  # nothing to read (every slot is masked): any valid pointer, never dereferenced
        eo = out
    launch(_combine_kernel, grid, eo, inv_rows.contiguous(), weights.contiguous(), out if sh is None else sh, out, t, n,
                          rows, eo.stride(0), 0 if sh is None else sh.stride(0), K=k, HAS_SHARED=sh is not None,
                          OUT_DTYPE=TL_DTYPE[out_dtype], EMULATE=emulate_formats(expert_out.device),
                          BLOCK_N=bn, TOKEN_ORDER=token_order, num_warps=max(1, min(8, bn // 256)),
                          enable_fp_fusion=False)
    return out


def supports_align(topk_ids, expert_map, num_experts, *args) -> str | None:
    if num_experts > 1024:
        return f"num_experts={num_experts} > 1024: the per-expert one-hot tiles would not fit registers"
    return None
