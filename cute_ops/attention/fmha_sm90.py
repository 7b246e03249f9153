"""Hopper (sm_90a) forward attention in CuTeDSL: TMA loads, warpgroup MMA (WGMMA), online softmax in registers.

Ran on an H100 and an H200 (HARDWARE_STATUS below): every config FOR_CALL builds, GPU tests and timings against FA4
((192, 128): the H200 only).
The kernel class is in _fmha_sm90_kernel.py (imported by `build` only: it imports nvidia-cutlass-dsl).

Contract: dispatch/reference/attention.py (varlen q/k/v, GQA, causal + window bottom-right, sinks, natural-log
LSE); arguments as in launch.py. Head dims (Dqk, Dv) = (64, 64), (128, 128) or DeepSeek MLA prefill's (192, 128)
(HEAD_DIMS), bf16 or fp16. Q, K and S = Q K^T take Dqk (192: three 64-column 128-byte swizzle atoms, one TMA box
each); V, O += P V, out and lse take Dv. SMEM at (192, 128), tile_m 128: Q 48 KiB + 2 x (K 48 + V 32) KiB =
208 KiB of the 227 KiB; the persistent grid's second Q buffer (+48 KiB) and the O staging tile (+32 KiB) do not
fit, so these calls run one CTA per tile with register O stores (FmhaSm90Config rejects what does not fit).

One CTA per (query tile of tile_m = 128 or 192 rows, query head), or a persistent grid (below); 1 + tile_m / 64
warpgroups (registers split by setmaxnreg: 24 / 240 / 240 with two consumers, 24 / 160 / 160 / 160 with three):

    warpgroup 0   producer   warp 0 issues the TMA loads: Q once, then K_j and V_j (TILE_N keys) through a
                             KV_STAGES ring each (its other three warps only lower their register limit and leave)
    warpgroups 1+ consumers  each owns 64 query rows (the M mode of the tiled MMA is tile_m / 64 x m64): per key tile
                             S = Q K_j^T (SS WGMMA, fp32 in registers), mask (edge tiles only), online softmax
                             (mask.py / softmax.py, rows reduced over the 4 threads of a quad), P to 16-bit in
                             registers, O *= a, O += P V_j (RS WGMMA: A = P from registers, B = V^T from SMEM);
                             then out = O / l stored row-predicated from registers, and lse.

Schedule: FA3's inter-warpgroup ping-pong, always: the consumer warpgroups take turns on the tensor core through
named barriers (a ring 0 -> 1 (-> 2) -> 0), one's softmax running while the others' PV_{j-1} + QK_j execute; with
`overlap` (FA3's intra-warpgroup overlap, a config field) QK_j and PV_{j-1} are issued together, the softmax of tile
j under PV_{j-1} (bf16 only in practice: with fp16 ptxas serializes the WGMMAs).

Persistent grid (`persistent` = the SM count; for_call's FOR_CALL table turns it on for sliding-window calls, where
a query tile visits only 2-3 key tiles and the per-tile prologue / epilogue dominated, and for hd128): grid = one
CTA per SM, each walking the PACKED tile order with stride grid (scheduler.persistent_tiles is its host
model). The roles loop over the same tile
sequence on their own: the producer warp issues the next tile's Q (a 2-stage Q ring; consumers free a buffer once
the tile's last QK is done) and K / V as soon as the rings have room, so they are in SMEM when the consumers start
it; the pipeline states and the ping-pong token carry over (warpgroup 0 pre-passes its first turn once per CTA), so
one warpgroup's epilogue runs under the other's first GEMMs of the next tile.

O epilogue (`o_tma`, on in every FOR_CALL row but (192, 128)'s): per consumer warpgroup, out = O / l to 16-bit,
stmatrix into the warpgroup's (64, Dv) SMEM slice, one TMA store, waited for (bulk read) only before the slice's
next use, so on the persistent grid the store drains under the next tile; slices ending inside a sequence other
than the last keep the register stores. Timings in FOR_CALL's comment.

Key tiles run from n_lo upwards (mask.tile_range); a tile is masked only when it is not inside every row's visible
interval. Varlen: TMA boxes start at the sequence's first row; rows past the sequence are read (the next
sequence's rows, or zeros past the tensor), masked to -inf for keys and never stored for queries (they must be
finite, as in FA4 and the sm100 kernel).
"""

import dataclasses
import typing

from . import launch

SMEM_BYTES = 227 * 1024  # the most dynamic shared memory one sm_90 CTA may use
# setmaxnreg limits per consumer warpgroup count (producer, consumers): 65536 registers per SM, one CTA of
# 128 * (1 + consumers) threads; 3 consumers: 24 * 128 + 160 * 384 <= 65536 (168 would not fit)
REGS = {2: (24, 240), 3: (24, 160)}
TILE_N = 128  # keys per K/V tile (WGMMA N of S = Q K^T, TMA box rows) unless a rule sets FmhaSm90Config.tile_n
TILE_NS = (128, 176)
KV_STAGES = 2  # K/V ring depth; SMEM at D=128: Q 32 KiB + 2 x (K 32 + V 32) KiB; (192, 128): 48 + 2 x (48 + 32)


@dataclasses.dataclass(frozen=True)
class FmhaSm90Config(launch.AttentionConfig):
    """The compile key (launch.AttentionConfig) for sm_90a."""

    arch: str = "sm_90a"
    NAME = "fmha_sm90"
    ARCH_PREFIX = "sm_90"
    ARCH_WHY = "WGMMA kernel needs sm_90a"
    # DeepSeek MLA prefill's (qk 192, v 128) beside Dqk = Dv (head_dim is Dqk: Q, K and S = Q K^T; head_dim_v is
    # Dv: V, O += P V, out)
    HEAD_DIMS = (*launch.AttentionConfig.HEAD_DIMS, (192, 128))
    # FA3's intra-warpgroup overlap: QK_{j} issued together with PV_{j-1}, the softmax of tile j under PV_{j-1}.
    overlap: bool = False
    # Query rows per CTA: 64 per consumer warpgroup, 128 (two) or 192 (three; FA3 / FA4 use 192 x 128 at hd64,
    # where a key tile carries half the MMA work per softmax element of hd128 and a third warpgroup's softmax can
    # hide under the other two's GEMMs).
    tile_m: int = 128
    # Persistent grid of this many CTAs (the SM count; 0: one CTA per tile). Each CTA walks the PACKED tile order
    # with stride `persistent` (a static schedule); Q gets a 2-stage ring, so the producer loads the next tile's Q
    # and first K / V tiles while the consumers still work on this one, and the pipelines' phases and the
    # ping-pong turn carry over from tile to tile: the next tile's loads and one warpgroup's first GEMMs overlap
    # the other's epilogue. For short key ranges (a 128-key window: 2-3 key tiles per query tile), where the
    # per-tile prologue / epilogue is not hidden: H200 GPT-OSS window 0.80x FA4 against 0.65x with one CTA per
    # tile (docs/attention.md).
    persistent: int = 0
    # O epilogue through SMEM: each consumer warpgroup writes its 64 x Dv slice of out = O / l into its own SMEM
    # buffer (stmatrix) and one warp issues a TMA store (UTMASTG) of it, waited for (bulk read done) only before
    # the warpgroup's next epilogue reuses the buffer, so the store drains while the next tile's GEMMs run. Slices
    # that end inside a sequence other than the last are stored from registers as without it (a TMA box would
    # write into the next sequence's rows). SMEM: + tile_m x Dv 16-bit. Every FOR_CALL rule but (192, 128)'s turns
    # it on.
    o_tma: bool = False
    # Keys per K / V tile (the WGMMA N of S = Q K^T, the K step of O += P V, the TMA box rows): 128, or FA3's 176 at
    # hd128 (more MMA work per softmax pass and per pipeline turn; LONG_QUERY_RULE). Key counts that are not a
    # multiple of it end in a masked partial tile, as with 128.
    tile_n: int = TILE_N

    def __post_init__(self):
        super().__post_init__()
        if self.tile_m not in (128, 192):
            raise ValueError(f"tile_m {self.tile_m} not in (128, 192) (64 rows per consumer warpgroup)")
        if self.tile_n not in TILE_NS:
            raise ValueError(f"tile_n {self.tile_n} not in {TILE_NS}")
        if self.persistent < 0:
            raise ValueError(f"persistent {self.persistent}: a CTA count >= 0")
        # ptxas spills at 160 registers with hd128 (nvidia-cutlass-dsl 4.8.1, sm_90a): S (TILE_N / 2 fp32 per
        # thread) and O (head_dim_v / 2) live together. Compiled: hd64 137 registers, with the overlap 157.
        if self.tile_m == 192 and self.head_dim > 64:
            raise ValueError(f"tile_m 192 (160 registers) with head_dim {self.head_dim}: spills (needs head_dim 64)")
        # with the persistent grid the tile loop's state adds registers: 192 x 128 with overlap spills (35 STL)
        if self.tile_m == 192 and self.overlap and self.persistent:
            raise ValueError("tile_m 192 with overlap on the persistent grid spills (160 registers)")
        if self.smem_bytes() > SMEM_BYTES:  # (192, 128): Q 48 KiB + 2 x (K 48 + V 32) KiB leaves no room for more
            raise ValueError(f"SMEM {self.smem_bytes()} bytes > {SMEM_BYTES} (head dims ({self.head_dim}, "
                             f"{self.head_dim_v}), tile_m {self.tile_m}, persistent (2 Q stages) "
                             f"{bool(self.persistent)}, o_tma {self.o_tma})")

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def q_stages(self) -> int:
        """Q buffers: 2 with the persistent grid (the next tile's Q loads during this one), else 1."""
        return 2 if self.persistent else 1

    def smem_bytes(self) -> int:
        """Dynamic SMEM of the kernel's SharedStorage: the mbarriers (padded to the 1024-byte alignment of the
        swizzled tiles), q_stages of Q and KV_STAGES of K (Dqk columns), KV_STAGES of V and the O staging tile
        with o_tma (Dv columns), 16-bit."""
        qk_rows = self.q_stages * self.tile_m + KV_STAGES * self.tile_n
        v_rows = self.o_tma * self.tile_m + KV_STAGES * self.tile_n
        return 1024 + 2 * (self.head_dim * qk_rows + self.head_dim_v * v_rows)

    @classmethod
    def for_call(cls, q, v, causal: bool, window_left: int, window_right: int, sinks, arch: str,
                 max_seqlen_q: int = 0):
        """The shared rule, then FOR_CALL's row for (qk head dim, sliding window, causal), or LONG_QUERY_RULE's
        where it has one, for bf16 calls with max_seqlen_q >= LONG_QUERY_ROWS: tile_m, the overlap (bf16 only:
        with fp16 ptxas serializes its WGMMAs), the persistent grid (one CTA per SM) and the O epilogue."""
        cfg = super().for_call(q, v, causal, window_left, window_right, sinks, arch)
        key = (cfg.head_dim, window_left >= 0, bool(causal))
        long_query = max_seqlen_q >= LONG_QUERY_ROWS and cfg.dtype == "bf16"  # measured in bf16, the overlap's
        row = LONG_QUERY_RULE.get(key, FOR_CALL[key]) if long_query else FOR_CALL[key]
        return dataclasses.replace(cfg, tile_m=row.tile_m, overlap=row.overlap and cfg.dtype == "bf16",
                                   persistent=_sm_count(q) if row.persistent else 0, o_tma=row.o_tma,
                                   tile_n=row.tile_n)


class CallRule(typing.NamedTuple):
    tile_m: int = 128
    overlap: bool = False  # bf16 only
    persistent: bool = False  # one CTA per SM
    o_tma: bool = False
    tile_n: int = TILE_N


# for_call's rule per (qk head dim (HEAD_DIMS pairs each with one v head dim), sliding window (window_left >= 0),
# causal): the fastest variant on the H200 prefill case set beside FA4 in one process (CUDA events;
# docs/attention.md names the record):
#   hd64 no window: FA3 / FA4's 192-row tile with overlap and the O TMA store: GPT-OSS causal + sinks 2 x 8192 0.912x
#     FA4 (0.868x with register stores; the persistent grid does not fit 192 x 128 + overlap in 160 registers).
#   windows: the persistent grid + O TMA store: GPT-OSS hd64 64 / 8 window (128, 0) + sinks 2 x 8192 0.961x FA4
#     against 0.799x persistent alone, 0.644x one CTA per tile (192 rows 0.846x, with overlap 0.918x).
#   hd128: the persistent grid + O TMA store with the overlap: Llama 32 / 8 causal 4 x 4096 0.954x FA4 (0.945x
#     without the overlap), non-causal 8 x 2048 0.922x (0.918x) (CUDA graph, tile sweep); without the overlap,
#     CUDA events: causal 8 x 2048 1.004x (0.884x one CTA per tile), 2 x 8192 0.932x, varlen 0.836x. hd128 with a
#     window takes the hd64 window rule.
#   hd128 from LONG_QUERY_ROWS queries (LONG_QUERY_RULE): FA3's 176-key tile, one CTA per tile, register O stores,
#     no overlap: 1 x 16384 causal 0.923-0.929x FA4, non-causal 0.892-0.905x (three runs), against 0.904-0.907x /
#     0.882-0.891x with 128-key tiles and the overlap, 0.896-0.898x / 0.896x for the 176-key tile with the overlap
#     (ptxas adds a warpgroup arrive before 22 of its 38 WGMMAs), and the persistent grid's 0.895-0.897x /
#     0.862-0.863x; at 4 x 4096 causal and 8 x 2048 the 176-key tile is 0.86-0.90x, below FOR_CALL's rows
#     (tile sweep, `perf/scripts/attention_sm90_tile_sweep.py`).
#   (192, 128): FA3's design for it, 128 x 128 with overlap (bf16): DeepSeek 16 heads 1 x 8192 causal 0.93x FA4
#     (events; 0.90x CUDA graph), 1.37x the Gluon kernel auto took before (H200); one CTA per tile and register O
#     stores, as the 2-stage Q ring and the O staging tile do not fit in SMEM beside Q and the K / V ring. The
#     overlap compiles without spills there (S and O are 64 fp32 each per thread, as at hd128): 192 of 240
#     registers causal, 216 with window + sinks.
FOR_CALL = {
    (64, False, False): CallRule(tile_m=192, overlap=True, o_tma=True),  # as causal
    (64, False, True): CallRule(tile_m=192, overlap=True, o_tma=True),
    (64, True, False): CallRule(persistent=True, o_tma=True),  # as causal
    (64, True, True): CallRule(persistent=True, o_tma=True),
    (128, False, False): CallRule(overlap=True, persistent=True, o_tma=True),
    (128, False, True): CallRule(overlap=True, persistent=True, o_tma=True),
    (128, True, False): CallRule(persistent=True, o_tma=True),  # as hd64
    (128, True, True): CallRule(persistent=True, o_tma=True),  # as hd64
    (192, False, False): CallRule(overlap=True),
    (192, False, True): CallRule(overlap=True),
    (192, True, False): CallRule(overlap=True),
    (192, True, True): CallRule(overlap=True),
}


# Query rows (max_seqlen_q) from which LONG_QUERY_RULE's rows replace FOR_CALL's (measured at 16384, below).
LONG_QUERY_ROWS = 16384
LONG_QUERY_RULE = {
    (128, False, False): CallRule(tile_n=176),
    (128, False, True): CallRule(tile_n=176),
}


def _sm_count(q) -> int:
    """SMs of q's device (an H100 SXM's 132 for host tensors: the CPU compile tests)."""
    if not q.is_cuda:
        return 132
    from triton_ops.contract.arch import device_index, sm_count

    return sm_count(device_index(q.device))




# ------------------------------------------------------------------------------------------ compile


def build(cfg: FmhaSm90Config, extra_options: str = ""):
    """cute.compile the kernel for `cfg` (uncached; `extra_options`: keep/dump flags for the SASS tests)."""
    from ._fmha_sm90_kernel import FmhaSm90  # imports nvidia-cutlass-dsl

    return launch.build(FmhaSm90(cfg), cfg, extra_options)


def compiled(cfg: FmhaSm90Config):
    """The TVM-FFI callable for `cfg`, through lowbit's compile cache."""
    return launch.compiled(build, cfg)


def dump(cfg: FmhaSm90Config):
    """PTX + SASS of the kernel for `cfg` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    return launch.dump(build, cfg)


# ------------------------------------------------------------------------------------------ backend entry

HARDWARE_STATUS = ("runs on the H100 and the H200: the shared attention GPU tests (causal, windows, sinks, GQA, "
                   "varlen, LSE; every schedule variant) pass at head dims 64 and 128, and on the H200 at (192, 128)")
# The head dims auto takes this kernel at: the ones timed against FA4 and the Gluon kernel (docs/attention.md).
MEASURED_HEAD_DIMS = (64, 128, 192)


def supports_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                               causal, window_left, window_right, sinks, return_lse) -> str | None:
    """Why `attention_prefill` below cannot take these arguments (None: it can); the triton backend's signature."""
    why = launch.check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, FmhaSm90Config.HEAD_DIMS)
    if why is not None:
        return why
    from .._compile import target_arch

    arch = target_arch(q.device.index)
    if not arch.startswith("sm_90"):
        return f"WGMMA kernel: needs sm_90a, device is {arch}"
    return None


def auto_skip_untimed(q, *args, **kwargs) -> str | None:
    """auto_skip of the sm_90 cute attention_prefill row: auto takes it at the head dims where it was timed faster
    than the Gluon kernel (MEASURED_HEAD_DIMS); other head dims keep the Triton kernels until timed."""
    if q.shape[-1] in MEASURED_HEAD_DIMS:
        return None
    return f"cute_ops.attention.fmha_sm90: head dim {q.shape[-1]} not timed on a GPU yet (backend='cute' runs it)"


def attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                      softmax_scale: float | None, causal: bool, window_left: int, window_right: int, sinks,
                      return_lse: bool, *, tiles: dict | None = None):
    """(out (total_q, Hq, Dv) in q's dtype, lse (total_q, Hq) fp32): the triton backend's signature and contract.
    lse is always computed. tiles: FmhaSm90Config fields overriding for_call's rule (tile sweeps)."""
    from .._compile import target_arch

    cfg = FmhaSm90Config.for_call(q, v, causal, window_left, window_right, sinks, target_arch(q.device.index),
                                  max_seqlen_q)
    cfg = dataclasses.replace(cfg, **(tiles or {}))
    fn = compiled(cfg) if q.shape[0] else None
    return launch.run(fn, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, sinks)


def specialize_attention_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                 softmax_scale, causal: bool, window_left: int, window_right: int, sinks,
                                 return_lse: bool):
    """A launcher prepared for this exact call signature (the dispatch table's `specialize` hook;
    launch.prepared), or None where `attention_prefill` must run."""
    from .._compile import target_arch

    if not launch.preparable(q, cu_seqlens_q, cu_seqlens_k, sinks):
        return None
    fn = compiled(FmhaSm90Config.for_call(q, v, causal, window_left, window_right, sinks,
                                          target_arch(q.device.index), max_seqlen_q))
    return launch.prepared(fn, attention_prefill, q, v, softmax_scale, window_left, window_right)
