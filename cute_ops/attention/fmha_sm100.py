"""Blackwell (sm_100a) forward attention in CuTeDSL: tcgen05 UMMA, TMEM accumulators, TMA loads.

COMPILED AND SASS-INSPECTED ONLY, NEVER RUN: no Blackwell GPU has executed this kernel. tests/test_cute_attention.py
compiles it for sm_100a on a CPU and checks the instructions it must contain; its numerics are unverified.

Contract: dispatch/reference/attention.py (varlen q/k/v, GQA, causal + window bottom-right, sinks, natural-log
LSE). Shapes: q (total_q, Hq, D), k/v (total_k, Hkv, D), o like q, lse (total_q, Hq) fp32, cu_seqlens (B + 1,)
int32, sinks (Hq,) fp32; D = 64 or 128, bf16 or fp16, unit stride on D and 16-byte aligned rows/heads (TMA).

One CTA per (query tile of 128 rows, query head); 12 warps (three warpgroups, registers split by setmaxnreg:
softmax 200, correction 96, the rest 80 per thread):

    warps 0-3  softmax      thread t owns row t of S: LDTM S (32x32b.x32) -> mask -> online softmax (exp2) ->
                            P as packed 16-bit pairs -> STTM into TMEM; sends the rescale factor a to correction
    warps 4-7  correction   (TMEM lanes 0-127 again: warp w reaches lanes 32*(w%4)..) waits for PV_{j-1}, then,
                            only if some row of the warp has a != 1 (FA4's conditional rescale), LDTM/scale/STTM
                            O; at the end O * (1/l) -> 16-bit -> global (row-predicated), and LSE
    warp 8     MMA          one elected thread issues tcgen05.mma: S = Q K^T (SS, fp32 in TMEM), O += P V (TS:
                            P from TMEM, V from SMEM)
    warp 9     load         TMA: Q once, then K_j, V_j through separate 2-stage (D=128) / 3-stage (D=64) rings
    warps 10-11 idle        (complete the third warpgroup)

The CTA's tile comes from scheduler.py (PACKED by default) and is passed to the roles through SMEM; every role
derives the same key-tile range from mask.tile_range after its setmaxnreg.

TMEM (512 columns allocated, fp32 columns x 128 lanes): S at 0..127, O at 128..128+D, P at 256..319 (128 keys as
bf16/fp16 pairs). P has its own columns, so QK_{j+1} may overwrite S as soon as softmax has read S_j, while P_j
still waits for PV_j: the next S GEMM overlaps the softmax of this tile.

Per key tile j (n tiles; the same n in every role, from mask.tile_range):

    MMA:        QK_0; for j: [QK_{j+1}]; wait P_j, O_j ready, V_j; PV_j (accumulate j > 0); commit pv_done_j
    softmax:    wait S_j; LDTM; release S; mask (edge tiles only); max; send a_j; exp2 -> 16-bit; wait P
                free; STTM P_j
    correction: wait a_j; j > 0: wait pv_done_{j-1}, vote, rescale O; signal O_j ready
    end:        softmax sends (m, l); correction waits pv_done_{n-1}, writes O / l and lse

A query tile no row of which sees a key (n = 0) issues no load and no MMA: correction writes out = 0 and
lse = -inf (or the sink's logit). Varlen: TMA boxes start at the sequence's first row (cu_seqlens offsets);
rows past the sequence end are read (the next sequence's rows, or zeros past the tensor), masked to -inf in S
for keys and never stored for queries; a non-finite value there would still reach P V as 0 * inf (as in FA4).

Not done yet (see cute_ops/attention/__init__.py): 2-CTA MMA, two query tiles per CTA (FA4's ping-pong),
persistence, TMA store of O, exp2 emulation on FMA, paged KV, FP8, D != 64/128, backward.
"""

import dataclasses

from . import launch
from . import mask as mask_mod
from . import scheduler as sched_mod
from . import softmax as sm_mod

TILE_M = 128
TILE_N = 128
DTYPES = launch.DTYPES


@dataclasses.dataclass(frozen=True)
class FmhaSm100Config(launch.AttentionConfig):
    """The compile key (launch.AttentionConfig) for sm_100a / sm_103a."""

    arch: str = "sm_100a"
    NAME = "fmha_sm100"
    ARCH_PREFIX = "sm_10"
    ARCH_WHY = "tcgen05 needs sm_100a/sm_103a"

    @property
    def kv_stages(self) -> int:
        # SMEM: Q 128xD + stages x (K 128xD + V 128xD), 16-bit: D=128 -> 32 KiB + 2 x 64 KiB; D=64 -> 16 + 3 x 32
        return 2 if self.head_dim == 128 else 3


# ------------------------------------------------------------------------------------------ host twin


def emulate(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale: float, causal: bool = False,
            window: tuple[int, int] = (-1, -1), sinks=None, tile_m: int = TILE_M, tile_n: int = TILE_N):
    """The kernel's algorithm on the host, tile by tile, from the same shared pieces (scheduler, mask,
    softmax): (out like q, lse (total_q, Hq) fp32, stats). What the CPU tests compare with the contract; it models
    the data flow (which work items, which key tiles, which elements masked, P rounded to q.dtype before P V,
    O rescaled only when a != 1, rows past the sequence computed but not stored, TMA boxes reading the next
    sequence's rows or zeros past the tensor), not the hardware. Outputs start as NaN: a row no work item
    writes stays NaN."""
    import torch

    total_q, hq, d = q.shape
    total_k, hkv = k.shape[:2]
    group = hq // hkv
    spec = mask_mod.MaskSpec.of(causal, *window)
    left, right = window
    scale_log2 = softmax_scale * sm_mod.LOG2E
    cu_q, cu_k = [int(x) for x in cu_seqlens_q.tolist()], [int(x) for x in cu_seqlens_k.tolist()]
    batch = len(cu_q) - 1
    out = torch.full((total_q, hq, v.shape[2]), float("nan"), dtype=q.dtype)
    lse = torch.full((total_q, hq), float("nan"), dtype=torch.float32)
    stats = {"work_items": 0, "key_tiles": 0, "masked_tiles": 0, "rescaled_rows": 0}

    def box(t, start, rows, head):  # a TMA box: rows past the tensor read as zeros
        idx = torch.arange(start, start + rows)
        ok = idx < t.shape[0]
        return torch.where(ok[:, None], t[idx.clamp(max=max(t.shape[0] - 1, 0)), head].float(),
                           torch.zeros(()))

    items = (sched_mod.packed_tile(cu_q, i, hq, tile_m, spec.bounded_right)
             for i in range(sched_mod.packed_grid_size(total_q, batch, hq, tile_m)))
    for item in items:
        if item is None:
            continue
        b, m_block, h = item
        stats["work_items"] += 1
        q0, sq, k0, sk = cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b]
        n_lo, n_tiles, full_lo, full_hi = mask_mod.tile_range(spec, m_block, sq, sk, left, right, tile_m, tile_n)
        qt = box(q, q0 + m_block * tile_m, tile_m, h).to(q.dtype).float()
        rows = torch.arange(tile_m)
        bounds = [mask_mod.row_key_bounds(spec, m_block * tile_m + r + sk - sq, sk, left, right) for r in range(tile_m)]
        sm = sm_mod.OnlineSoftmaxModel(tile_m, scale_log2, None if sinks is None else float(sinks[h]))
        o = torch.zeros(tile_m, v.shape[2])
        for j in range(n_tiles):
            kb = n_lo + j
            stats["key_tiles"] += 1
            kt = box(k, k0 + kb * tile_n, tile_n, h // group)
            vt = box(v, k0 + kb * tile_n, tile_n, h // group)
            s = qt @ kt.T
            if not (full_lo <= kb < full_hi):
                stats["masked_tiles"] += 1
                cols = torch.arange(tile_n) + kb * tile_n
                lo = torch.tensor([bd[0] for bd in bounds])[:, None]
                hi = torch.tensor([bd[1] for bd in bounds])[:, None]
                s = s.masked_fill((cols[None, :] < lo) | (cols[None, :] >= hi), float("-inf"))
            p, a = sm.step(s)
            if j > 0:
                stats["rescaled_rows"] += int((a != 1).sum())
                o = o * a[:, None]
            o = (o if j > 0 else torch.zeros_like(o)) + p.to(q.dtype).float() @ vt
        inv_l, row_lse = sm.finalize()
        keep = rows + m_block * tile_m < sq
        dst = q0 + m_block * tile_m + rows[keep]
        out[dst, h] = (o * inv_l[:, None])[keep].to(q.dtype)
        lse[dst, h] = row_lse[keep]
    return out, lse, stats


# ------------------------------------------------------------------------------------------ compile


def build(cfg: FmhaSm100Config, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options`: keep/dump flags for the SASS tests)."""
    from ._fmha_sm100_kernel import FmhaSm100  # imports nvidia-cutlass-dsl

    return launch.build(FmhaSm100(cfg), cfg, extra_options)


def compiled(cfg: FmhaSm100Config):
    """The TVM-FFI callable for `cfg`, through lowbit's compile cache. Never launched by lowbit's dispatch: the
    kernel has not run on Blackwell hardware."""
    return launch.compiled(build, cfg)


def dump(cfg: FmhaSm100Config):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    return launch.dump(build, cfg)


# ------------------------------------------------------------------------- entry (for the lead: not registered)

HARDWARE_STATUS = ("cute_ops.attention.fmha_sm100 has never run on a Blackwell GPU (compiled and SASS-checked on a "
                   "CPU only); it is not offered by dispatch")


def supports_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_left, window_right, sinks, return_lse) -> str | None:
    """Why `attention_prefill` below cannot take these arguments (None: it can), same signature as the triton
    backend's check. Shape and layout rules first, the device last (so CPU tests reach the rest)."""
    why = launch.check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, FmhaSm100Config.HEAD_DIMS)
    if why is not None:
        return why
    from .._compile import target_arch

    arch = target_arch(q.device.index)
    if not arch.startswith("sm_10"):
        return f"tcgen05 kernel: needs sm_100a/sm_103a, device is {arch}"
    return HARDWARE_STATUS


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float | None, causal: bool, window_left: int, window_right: int, sinks,
                      return_lse: bool):
    """(out (total_q, Hq, D) in q's dtype, lse (total_q, Hq) fp32), the triton backend's signature and contract.
    NEVER EXECUTED: written against the compiled kernel's argument list, not run on any GPU. lse is always
    computed (one fp32 per row and head)."""
    from .._compile import target_arch

    cfg = FmhaSm100Config.for_call(q, v, causal, window_left, window_right, sinks, target_arch(q.device.index))
    fn = compiled(cfg) if q.shape[0] else None
    return launch.run(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, sinks)


default_softmax_scale = launch.default_softmax_scale
