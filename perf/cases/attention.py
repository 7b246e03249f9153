"""Benchmark cases for attention: varlen prefill, chunked (paged) prefill, paged decode with split-KV, LSE merge.

Shapes (bf16 activations; docs/attention.md):
* prefill (`attention_prefill`, bucket "prefill"): Llama-like hd 128 with 32 query / 8 KV heads, causal and not, B x
  S = 1 x 16384 and 8 x 2048; GPT-OSS hd 64 with 64 / 8 heads and sinks, window (127, 0) (its sliding_window = 128
  keys: the query's own and the 127 before it) and full causal, 2 x 8192; DeepSeek MLA prefill (MHA, qk 192 / v 128)
  with 16 heads at 1 x 8192 (the real model has 128 heads: 16 keep the suite short, the per-head work is the same);
  varlen lengths [8192, 4096, 1024, 512, 128, 17] hd 128 causal. The lowbit call is `ops.attention_prefill` (varlen)
  on packed (B*S, H, D) tensors with prebuilt cu_seqlens.
* chunked prefill (`attention_prefill_paged`): 4 sequences of 8192 cached keys whose last 1024 are the new queries,
  hd 128 32 / 8, page 64, causal. On sm_90 the runner times each backend of the table: `lowbit:triton` (the plain
  paged kernel) and `lowbit:cute` (the gathered path: pages copied to contiguous K / V, then the cute forward).
* decode (`attention_decode`, bucket "decode", one query per sequence, page 64, every sequence at the full context):
  Llama hd 128 32 / 8 at B x context 1 x 8192, 16 x 8192, 64 x 8192, 256 x 1024, 1 x 131072 (bf16 cache), and
  16 x 8192 with an FP8 E4M3 cache (per-tensor fp32 scales); GPT-OSS hd 64 64 / 8 with sinks, full and window
  (127, 0), 16 x 8192. Block tables are random permutations of the cache's blocks; with a window, the table entries
  of pages wholly before every query's window name one shared filler block (their keys are masked anyway, as a
  serving engine reuses the pages a window has left), so the cache holds only the pages a kernel reads and the
  runner's L2 rotation makes enough copies of those (one 268 MB cache would keep the 4.5 MB window in L2).
* `merge_attn_states`: T = 16384, H = 32, D = 128 bf16 (bytes-bound).
* `mla_decode` (DeepSeek MLA, H = 128, bf16 / V3.2 / V4 latent caches, dense and top-k sparse) and
  `mla_index_scores` (DeepSeek-V3.2's indexer scores, H = 64, D = 128, a causal 4 x 2048 prompt):
  perf/cases/attention_mla.py.
Each op also has a "quick" case (tiny shapes for the CPU interpreter: GQA, sinks, windows, sq < sk, FP8 cache,
an out-of-range page id, -inf LSE rows).

FLOP model (flops_dtype "bf16"): only the (query, key) pairs the mask lets through, counted exactly per sequence
from the reference rule (`visible_pairs`, bottom-right aligned causal / window): 2 * pairs * Hq * (Dqk + Dv)
(= 4 * pairs * H * D when Dqk = Dv). Decode counts the same way (it is bytes-bound; flops are informative).
Bytes models (read + written once):
* prefill: q, k, v read once, out (q's dtype) and the fp32 LSE written once (the kernels always write it);
* chunked prefill: q, the K/V of each sequence's seqused_k keys (Hkv heads), the block-table entries, out + LSE;
* decode: the K/V bytes a kernel must read, sum over sequences of (keys some query may see) * Hkv * (D + Dv) *
  cache element size (a window reads only its keys), + q, out, LSE and the block-table entries of those keys; FP8
  caches count 1 byte per element (the scales are 8 bytes);
* merge: out_a, out_b (T*H*D elements each) and lse_a, lse_b (fp32) read; out and lse written.

Checks: the normalized max error max|out - ref| / max|ref| <= 2e-2 (bf16 output), no NaN, and for the merge the LSE
(-inf exactly where the reference has it, abs error <= 1e-2 elsewhere). What the reference is:
* quick cases: the contract itself (dispatch/reference/attention.py: fp64, every row checked);
* full cases: `eager_varlen` / `eager_decode` below, a torch eager implementation of the same contract in fp32
  (logits chunked over query rows so 16k sequences fit: at most CHUNK_ELEMS logits at a time; decode gathers the
  pages through the block table and masks by seqused_k on the device): every output row is checked, against fp32
  rather than fp64 math (errors ~1e-6, far below the 2e-2 bar). It is also the "torch" provider (eager attention
  as HF-style torch code computes it: materialized logits, softmax, PV). torch.compile of it is not timed except
  on the merge (compile_reference=False: its Python chunk loops would unroll into a long compile).
* The lowbit "torch" backend (the fp64 contract reference) is refused on full cases (BackendError -> "skipped"):
  its per-sequence fp64 logits need ~70 GB at 16k and its Python loop over sequences takes seconds per call at
  decode sizes; it runs in --quick.

Peers (timed, not checked), each tried once on the first inputs made on a GPU; a peer that raises there is removed
from the case with the reason printed (`_probe_peers`):
* `sdpa-cudnn`, `sdpa-flash`: torch SDPA under `sdpa_kernel(CUDNN_ATTENTION | FLASH_ATTENTION)` on the batched
  (B, H, S, D) view of the same tensors (no copy) - prefill cases without sinks / windows / varlen; decode on a
  dense (B, Hkv, ctx, D) cache holding the same values as the paged one (FP8 case: the dequantized values in bf16,
  i.e. 2x the bytes of the FP8 cache), Sq = 1. GQA: `enable_gqa=True`; where a backend refuses it, K/V are
  expanded with repeat_interleave once at make time (outside the timed call; FLOPs unchanged, more bytes read).
* `fa4`: FlashAttention-4 (`flash_attn.cute`, flash-attn-4 4.0.0b36): `flash_attn_func` on the batched view,
  `flash_attn_varlen_func` for varlen, and with `page_table` + `seqused_k` for the paged cases (bf16 caches only);
  sinks via `learnable_sink`, windows via `window_size`. Its sm_90 path has no split-KV: decode runs unsplit.
"""

from __future__ import annotations

import functools
import math

import torch

from dispatch import ops
from dispatch.reference import attention as ref
from dispatch.registry import BackendError
from perf.cases.base import BenchCase

TOL = 2e-2  # normalized max error of a bf16 output
LSE_TOL = 1e-2
PAGE = 64
CHUNK_ELEMS = 1 << 27  # logits (fp32) per step of the eager reference: 512 MB
BF16 = torch.bfloat16
FULL_TORCH_BACKEND = ("full-size case: the fp64 contract reference (dispatch/reference/attention.py) is the test "
                      "oracle, too big / slow here (fp64 logits per sequence, a Python loop over sequences); it runs "
                      "in --quick, and the eager fp32 'torch' provider is the torch number here")


# ------------------------------------------------------------------------------------------------ counting


def _bounds(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """(left, right) of the visible band, -1 = unbounded; causal is right = 0 (the tighter bound wins)."""
    left, right = int(window[0]), int(window[1])
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _row_ranges(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of one sequence, the first and last visible key (int64, CPU; empty when last < first)."""
    left, right = _bounds(causal, window)
    p = torch.arange(sq, dtype=torch.int64) + (sk - sq)  # bottom-right aligned key position of each row
    lo = (p - left).clamp(min=0) if left >= 0 else torch.zeros_like(p)
    hi = (p + right).clamp(max=sk - 1) if right >= 0 else torch.full_like(p, sk - 1)
    return lo, hi


def visible_pairs(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> int:
    """(query, key) pairs of one sequence the mask lets through: `ref.visible_keys(...).sum()` in closed form."""
    if sq <= 0 or sk <= 0:
        return 0
    lo, hi = _row_ranges(sq, sk, causal, window)
    return int((hi - lo + 1).clamp(min=0).sum())


def visible_keys_read(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> int:
    """Keys of one sequence that at least one query row may see (what a kernel that skips invisible tiles must
    read): `ref.visible_keys(...).any(0).sum()`. The rows' bands are contiguous and move right with the row."""
    if sq <= 0 or sk <= 0:
        return 0
    lo, hi = _row_ranges(sq, sk, causal, window)
    ok = hi >= lo
    if not bool(ok.any()):
        return 0
    return int(hi[ok].max() - lo[ok].min() + 1)


def attention_flops(lens_q, lens_k, hq: int, dqk: int, dv: int, causal: bool, window) -> int:
    pairs = sum(visible_pairs(sq, sk, causal, window) for sq, sk in zip(lens_q, lens_k, strict=True))
    return 2 * pairs * hq * (dqk + dv)


def prefill_bytes(lens_q, lens_k, hq: int, hkv: int, dqk: int, dv: int, elem: int = 2) -> int:
    tq, tk = sum(lens_q), sum(lens_k)
    return tq * hq * dqk * elem + tk * hkv * (dqk + dv) * elem + tq * hq * dv * elem + tq * hq * 4


def paged_kv_bytes(keys: list[int], hkv: int, dqk: int, dv: int, kv_elem: int, page: int) -> int:
    """K/V of `keys[b]` keys per sequence, + the 4-byte block-table entries of their pages."""
    return sum(n * hkv * (dqk + dv) * kv_elem + -(-n // page) * 4 for n in keys)


def decode_bytes(lens: list[int], sq: int, hq: int, hkv: int, d: int, dv: int, kv_elem: int, causal: bool,
                 window, page: int = PAGE) -> int:
    """K/V of the keys some query of each sequence may see (+ their table entries), q and out (bf16), lse (fp32),
    seqused_k."""
    keys = [visible_keys_read(sq, n, causal, window) for n in lens]
    return paged_kv_bytes(keys, hkv, d, dv, kv_elem, page) + len(lens) * (sq * hq * (2 * d + 2 * dv + 4) + 4)


def merge_bytes(t: int, h: int, d: int, elem: int = 2) -> int:
    return 3 * t * h * d * elem + 3 * t * h * 4


# --------------------------------------------------------------------------------------------------- checks


def _normalized_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if torch.isnan(got).any():
        raise AssertionError(f"{int(torch.isnan(got).sum())} NaN in the output")
    if want.numel() == 0:
        return 0.0
    g, w = got.float(), want.float()
    return float((g - w).abs().max()) / max(float(w.abs().max()), 1e-6)


def check_out(got: torch.Tensor, want: torch.Tensor) -> None:
    err = _normalized_error(got, want)
    if err > TOL:
        raise AssertionError(f"normalized max error {err:.3e} > {TOL}")


def check_merge(got, want) -> None:
    check_out(got[0], want[0])
    lse, want_lse = got[1], want[1]
    ninf = torch.isneginf(want_lse)
    if not torch.equal(torch.isneginf(lse), ninf):
        raise AssertionError("lse is -inf at other rows than the reference's")
    if (~ninf).any():
        err = float((lse[~ninf] - want_lse[~ninf]).abs().max())
        if not err <= LSE_TOL:
            raise AssertionError(f"lse abs error {err:.3e} > {LSE_TOL}")


# -------------------------------------------------------------------------------------- eager references


def _scale(softmax_scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def eager_varlen(q, k, v, lens_q, lens_k, softmax_scale=None, causal=False, window=(-1, -1), sinks=None,
                 chunk_elems: int = CHUNK_ELEMS):
    """The contract of dispatch/reference/attention.py `attention_varlen` (out only) in fp32 torch eager, for
    sizes the fp64 reference cannot hold: packed q (Tq, Hq, Dqk), k (Tk, Hkv, Dqk), v (Tk, Hkv, Dv); the
    sequence lengths as Python ints (static case parameters: no host sync). Query rows go in chunks of at most
    `chunk_elems` logits; each chunk multiplies only the key range its rows may see, masks the band edges, puts
    the sink logit in the softmax denominator, and rounds its output rows once to q's dtype."""
    tq, hq, dqk = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    g = hq // hkv
    scale = _scale(softmax_scale, dqk)
    left, right = _bounds(causal, window)
    out = q.new_zeros(tq, hq, dv)
    sink = None if sinks is None else sinks.float().view(hkv, g, 1, 1)
    q0 = k0 = 0
    for sq, sk in zip(lens_q, lens_k, strict=True):
        kf = k[k0:k0 + sk].float().permute(1, 2, 0)  # (hkv, dqk, sk)
        vf = v[k0:k0 + sk].float().permute(1, 0, 2)  # (hkv, sk, dv)
        rows = max(1, chunk_elems // max(1, hq * sk))
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            n = r1 - r0
            first, last = r0 + sk - sq, r1 - 1 + sk - sq  # key positions of the chunk's first / last row
            lo = max(0, first - left) if left >= 0 else 0
            hi = min(sk, last + right + 1) if right >= 0 else sk
            hi = max(hi, lo)
            qc = q[q0 + r0:q0 + r1].float().view(n, hkv, g, dqk).permute(1, 2, 0, 3).reshape(hkv, g * n, dqk)
            s = torch.bmm(qc, kf[:, :, lo:hi]).mul_(scale).view(hkv, g, n, hi - lo)
            pos = torch.arange(first, last + 1, device=q.device).view(n, 1)
            j = torch.arange(lo, hi, device=q.device).view(1, -1)
            ok = torch.ones(n, hi - lo, dtype=torch.bool, device=q.device)
            if left >= 0:
                ok &= j >= pos - left
            if right >= 0:
                ok &= j <= pos + right
            s.masked_fill_(~ok, -math.inf)
            if sink is not None:
                s = torch.cat([s, sink.expand(hkv, g, n, 1)], dim=-1)
            p = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row that sees nothing (and no sink): out 0
            if sink is not None:
                p = p[..., :-1]
            o = torch.matmul(p, vf[:, lo:hi].unsqueeze(1))  # (hkv, g, n, dv)
            out[q0 + r0:q0 + r1] = o.permute(2, 0, 1, 3).reshape(n, hq, dv).to(out.dtype)
        q0 += sq
        k0 += sk
    return out


def _gather_pages(cache, block_table, scale):
    """(B, max_blocks * block_size, H, D) fp32 values of every page the table names (all ids in range here)."""
    b, nb = block_table.shape
    x = cache[block_table.long()]  # (B, max_blocks, block_size, H, D)
    if x.dtype == torch.uint8:
        x = x.view(torch.float8_e4m3fn)
    x = x.float()
    if scale is not None:
        x = x * scale.float().reshape(-1)[0] if scale.numel() == 1 else x * scale.float().view(1, 1, 1, -1, 1)
    return x.view(b, nb * cache.shape[1], *cache.shape[2:])


def eager_decode(q, k_cache, v_cache, block_table, seqused_k, softmax_scale=None, causal=True, window=(-1, -1),
                 sinks=None, k_scale=None, v_scale=None):
    """The contract of `attention_decode` (out only) in fp32 torch eager, vectorized over the batch: every page of
    the table gathered, keys at positions >= seqused_k[b] masked on the device (no host sync), sinks in the
    softmax denominator. Block-table ids must be in range (the benchmark tables are permutations)."""
    bsz, sq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    g = hq // hkv
    scale = _scale(softmax_scale, d)
    kk = _gather_pages(k_cache, block_table, k_scale).permute(0, 2, 3, 1)  # (B, hkv, d, L)
    vv = _gather_pages(v_cache, block_table, v_scale).permute(0, 2, 1, 3)  # (B, hkv, L, dv)
    length = kk.shape[-1]
    qq = q.float().view(bsz, sq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bsz, hkv, g * sq, d)
    s = torch.matmul(qq, kk).mul_(scale).view(bsz, hkv, g, sq, length)
    used = seqused_k.long().view(bsz, 1, 1)
    pos = used - sq + torch.arange(sq, device=q.device).view(1, sq, 1)  # key position of each query
    j = torch.arange(length, device=q.device).view(1, 1, length)
    ok = (j < used) & (j >= 0)  # (B, 1, L) -> (B, sq, L) below
    left, right = _bounds(causal, window)
    if left >= 0:
        ok = ok & (j >= pos - left)
    if right >= 0:
        ok = ok & (j <= pos + right)
    ok = ok.expand(bsz, sq, length)
    s.masked_fill_(~ok.view(bsz, 1, 1, sq, length), -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, hkv, g, 1, 1).expand(bsz, hkv, g, sq, 1)], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num_(0.0)
    if sinks is not None:
        p = p[..., :-1]
    o = torch.matmul(p.reshape(bsz, hkv, g * sq, length), vv).view(bsz, hkv, g, sq, dv)
    return o.permute(0, 3, 1, 2, 4).reshape(bsz, sq, hq, dv).to(q.dtype)


# ----------------------------------------------------------------------------------------------------- peers


@functools.cache
def _fa4():
    """flash_attn.cute (flash-attn-4), imported on first use on a GPU (never while building the case list)."""
    from flash_attn import cute

    return cute


def _fa4_window(window) -> tuple[int | None, int | None]:
    return tuple(None if int(w) < 0 else int(w) for w in window)


def _first(res):
    return res[0] if isinstance(res, (tuple, list)) else res


class _Sdpa:
    """torch SDPA under one backend on (B, H, S, D) views `views(inputs)` of a case's tensors. GQA through
    enable_gqa; if the backend refuses it, `probe` switches to K/V expanded once per input set (`prepare`, at
    make time, outside the timed call)."""

    def __init__(self, backend: str, views, causal: bool, scale: float, group: int):
        self.backend, self.views, self.causal, self.scale, self.group = backend, views, causal, scale, group
        self.expand = False

    def prepare(self, i: dict) -> None:
        if self.expand and "kv_rep" not in i:
            _, k, v = self.views(i)
            i["kv_rep"] = (k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1))

    def __call__(self, i):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q, k, v = self.views(i)
        if self.expand:
            k, v = i["kv_rep"]
        with sdpa_kernel(getattr(SDPBackend, self.backend)):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=self.causal, scale=self.scale, enable_gqa=self.group > 1 and not self.expand)

    def probe(self, i: dict) -> str | None:
        """None if this peer runs on these inputs (possibly after switching to expanded K/V), else why not."""
        try:
            self(i)
            return None
        except Exception as exc:
            if self.group == 1:
                return _why(exc)
            first = _why(exc)
        self.expand = True
        self.prepare(i)
        try:
            self(i)
            print(f"perf: peer sdpa ({self.backend}) refuses enable_gqa ({first[:120]}); K/V expanded "
                  f"{self.group}x with repeat_interleave at make time instead")
            return None
        except Exception as exc:
            self.expand = False
            i.pop("kv_rep", None)
            return f"{first}; with expanded K/V: {_why(exc)}"


def _why(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return msg if len(msg) < 240 else msg[:237] + "..."


def _probe_peers(peers: dict, state: dict, inputs: dict, device: torch.device, where: str) -> None:
    """Once per case, on its first inputs made on a GPU: run every peer; one that raises is removed from the case
    (the runner builds its providers from `case.peers` after make) and the reason printed. Later makes only
    prepare the kept peers' extra inputs."""
    if device.type != "cuda":
        return
    if state.get("probed"):
        for fn in peers.values():
            if hasattr(fn, "prepare"):
                fn.prepare(inputs)
        return
    state["probed"] = True
    for name, fn in list(peers.items()):
        try:
            with torch.no_grad():
                if hasattr(fn, "probe"):
                    reason = fn.probe(inputs)
                else:
                    fn(inputs)
                    reason = None
                torch.cuda.synchronize(device)
        except Exception as exc:
            reason = _why(exc)
        if reason:
            peers.pop(name)
            print(f"perf: {where}: peer {name} skipped: {reason}")


def _guard_torch_backend(call, full: bool):
    def lowbit(i, backend):
        if full and backend == "torch":
            raise BackendError(FULL_TORCH_BACKEND)
        return call(i, backend)
    return lowbit


# ---------------------------------------------------------------------------------------------------- prefill


def _cu(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _prefill_case(model: str, lens_q: list[int], lens_k: list[int], hq: int, hkv: int, dqk: int, dv: int,
                  causal: bool, window=(-1, -1), sinks: bool = False, batched: bool = True,
                  tier: str = "full") -> BenchCase:
    """batched: equal lengths (B x S), so SDPA / flash_attn_func peers apply on (B, S, H, D) views."""
    full = tier == "full"
    bsz = len(lens_q)
    tq, tk = sum(lens_q), sum(lens_k)
    max_q, max_k = max(lens_q), max(lens_k)
    scale = 1.0 / math.sqrt(dqk)
    window = (int(window[0]), int(window[1]))
    peers: dict = {}
    state: dict = {}
    where = f"attention_prefill [{model}]"
    if full:
        if batched and not sinks and window == (-1, -1):
            s = lens_q[0]
            views = lambda i: tuple(i[n].view(bsz, s, *i[n].shape[1:]).transpose(1, 2) for n in "qkv")  # noqa: E731
            peers["sdpa-cudnn"] = _Sdpa("CUDNN_ATTENTION", views, causal, scale, hq // hkv)
            peers["sdpa-flash"] = _Sdpa("FLASH_ATTENTION", views, causal, scale, hq // hkv)
        fa_kw = dict(softmax_scale=scale, causal=causal, window_size=_fa4_window(window))
        if batched:
            s = lens_q[0]
            peers["fa4"] = lambda i: _first(_fa4().flash_attn_func(
                *(i[n].view(bsz, s, *i[n].shape[1:]) for n in "qkv"), learnable_sink=i["sinks"], **fa_kw))
        else:
            peers["fa4"] = lambda i: _first(_fa4().flash_attn_varlen_func(
                i["q"], i["k"], i["v"], cu_seqlens_q=i["cu_q"], cu_seqlens_k=i["cu_k"], max_seqlen_q=max_q,
                max_seqlen_k=max_k, learnable_sink=i["sinks"], **fa_kw))

    def make(device):
        i = {"q": torch.randn(tq, hq, dqk, device=device, dtype=BF16),
             "k": torch.randn(tk, hkv, dqk, device=device, dtype=BF16),
             "v": torch.randn(tk, hkv, dv, device=device, dtype=BF16),
             "cu_q": _cu(lens_q, device), "cu_k": _cu(lens_k, device),
             "sinks": torch.randn(hq, device=device) if sinks else None}
        _probe_peers(peers, state, i, device, where)
        return i

    def call(i, b):
        return ops.attention_prefill(i["q"], i["k"], i["v"], i["cu_q"], i["cu_k"], max_q, max_k, causal=causal,
                                    window=window, sinks=i["sinks"], backend=b)

    if full:
        reference = lambda i: eager_varlen(i["q"], i["k"], i["v"], lens_q, lens_k, None, causal, window,  # noqa: E731
                                           i["sinks"])
    else:
        reference = lambda i: ref.attention_varlen(i["q"], i["k"], i["v"], i["cu_q"], i["cu_k"], None,  # noqa: E731
                                                   causal, window, i["sinks"])[0]
    shape = f"B={bsz} S={max_q}" if batched else f"varlen {lens_q}" if lens_q == lens_k else \
        f"varlen q={lens_q} k={lens_k}"
    mask = ("causal" if causal else "full") + (f" window={window[0]},{window[1]}" if window != (-1, -1) else "")
    label = f"{model} {shape} H={hq}/{hkv} hd={dqk}" + (f"/{dv}" if dv != dqk else "") + f" {mask}" + \
        (" sinks" if sinks else "") + " bf16"
    seq = dict(S=max_q) if batched else dict(lens_q=lens_q, lens_k=lens_k)
    params = dict(model=model, B=bsz, **seq, Hq=hq, Hkv=hkv, Dqk=dqk, Dv=dv, causal=causal, window=list(window),
                  sinks=sinks, dtype="bf16")
    flops = attention_flops(lens_q, lens_k, hq, dqk, dv, causal, window)
    assert flops > 0 or not full  # a full case that does no work would be a modelling error
    return BenchCase("attention_prefill", label, "prefill", params, make, _guard_torch_backend(call, full),
                     reference, check_out, bytes_moved=prefill_bytes(lens_q, lens_k, hq, hkv, dqk, dv), flops=flops,
                     peers=peers, compile_reference=False, tier=tier, flops_dtype="bf16")


# ---------------------------------------------------------------------------------------- paged caches


def _paged_kv(bsz: int, hkv: int, cap: int, d: int, page: int, fp8: bool, device, spare: int = 3,
              bad_page: tuple[int, int] | None = None, first_live: list[int] | None = None) -> dict:
    """Random K / V for `cap` positions per sequence: dense (B, Hkv, cap rounded up to pages, D), and the same values
    in paged caches (num_blocks, page, Hkv, D) through one random block permutation shared by K and V (+ `spare`
    blocks no table names; blocks hold finite filler bytes where no page was written). FP8: E4M3 codes with
    per-tensor fp32 scales (value = code * scale).
    first_live[b]: the first key of sequence b any query may see (a window); the table entries of pages wholly before
    it all name ONE shared filler block (their keys are masked anyway), so the caches hold only the pages a kernel
    reads and the runner's L2 rotation sizes its copies by them. bad_page (b, col): that table entry is set out of
    range (num_blocks + 5), so its keys are masked by contract."""
    nb = -(-cap // page)
    kd = torch.randn(bsz, hkv, nb * page, d, device=device, dtype=BF16)
    vd = torch.randn(bsz, hkv, nb * page, d, device=device, dtype=BF16)
    ks = vs = None
    if fp8:
        ks, vs = torch.full((1,), 0.05, device=device), torch.full((1,), 0.04, device=device)
        kd, vd = _fp8(kd.float() * 8), _fp8(vd.float() * 8)
    first_page = torch.tensor([(f // page) for f in (first_live or [0] * bsz)], device=device)
    live = torch.arange(nb, device=device).view(1, nb) >= first_page.view(bsz, 1)  # (B, nb) pages that are read
    n_live = int(live.sum())
    shared = int((~live).any())
    num_blocks = n_live + shared + spare
    perm = torch.randperm(num_blocks, device=device)
    table = torch.full((bsz, nb), int(perm[n_live]) if shared else 0, dtype=torch.int32, device=device)
    table[live] = perm[:n_live].to(torch.int32)
    if bad_page is not None:
        table[bad_page] = num_blocks + 5
    caches = []
    for dense in (kd, vd):
        cache = dense.new_empty(num_blocks, page, hkv, d)
        cache.view(torch.uint8).fill_(0x3C)  # 1.0 in E4M3, ~1.1e-2 in bf16: finite filler
        pages = dense.view(bsz, hkv, nb, page, d).permute(0, 2, 3, 1, 4)  # (B, nb, page, Hkv, D)
        cache[perm[:n_live]] = pages[live]
        caches.append(cache)
    return {"k_cache": caches[0], "v_cache": caches[1], "table": table, "k_scale": ks, "v_scale": vs,
            "k_dense": kd, "v_dense": vd}


def first_visible_key(sq: int, sk: int, causal: bool, window: tuple[int, int]) -> int:
    """The first key of one sequence that some query row may see (sk when none is visible)."""
    if sq <= 0 or sk <= 0:
        return max(sk, 0)
    lo, hi = _row_ranges(sq, sk, causal, window)
    ok = hi >= lo
    return int(lo[ok].min()) if bool(ok.any()) else sk


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn)


def _decode_case(model: str, bsz: int, ctx: int, hq: int, hkv: int, d: int, kv: str = "bf16", sinks: bool = False,
                 window=(-1, -1), sq: int = 1, page: int = PAGE, tier: str = "full",
                 bad_page: tuple[int, int] | None = None, lens: list[int] | None = None) -> BenchCase:
    """Every sequence at `ctx` keys (lens: per-sequence lengths instead, quick cases). kv: "bf16" | "fp8" (E4M3,
    per-tensor fp32 scales)."""
    full = tier == "full"
    fp8 = kv == "fp8"
    window = (int(window[0]), int(window[1]))
    lens = lens or [ctx] * bsz
    cap = max(lens)
    scale = 1.0 / math.sqrt(d)
    peers: dict = {}
    state: dict = {}
    where = f"attention_decode [{model} B={bsz} ctx={ctx}]"
    if full:
        if not sinks and window == (-1, -1) and sq == 1 and set(lens) == {cap} and cap % page == 0:
            views = lambda i: (i["q"].transpose(1, 2), i["k_dense"], i["v_dense"])  # noqa: E731
            peers["sdpa-cudnn"] = _Sdpa("CUDNN_ATTENTION", views, False, scale, hq // hkv)
            peers["sdpa-flash"] = _Sdpa("FLASH_ATTENTION", views, False, scale, hq // hkv)
        if not fp8:
            peers["fa4"] = lambda i: _first(_fa4().flash_attn_varlen_func(
                i["q"], i["k_cache"], i["v_cache"], seqused_k=i["seqused"], page_table=i["table"],
                softmax_scale=scale, causal=True, window_size=_fa4_window(window), learnable_sink=i["sinks"]))

    def make(device):
        i = _paged_kv(bsz, hkv, cap, d, page, fp8, device, bad_page=bad_page,
                      first_live=[first_visible_key(sq, n, True, window) for n in lens])
        kd, vd = i.pop("k_dense"), i.pop("v_dense")
        if "sdpa-cudnn" in peers or "sdpa-flash" in peers:  # dense (B, Hkv, ctx, D) bf16 holding the same values
            i["k_dense"] = (kd.float() * i["k_scale"]).to(BF16) if fp8 else kd
            i["v_dense"] = (vd.float() * i["v_scale"]).to(BF16) if fp8 else vd
        del kd, vd
        i.update(q=torch.randn(bsz, sq, hq, d, device=device, dtype=BF16),
                 seqused=torch.tensor(lens, dtype=torch.int32, device=device),
                 sinks=torch.randn(hq, device=device) if sinks else None)
        _probe_peers(peers, state, i, device, where)
        return i

    def call(i, b):
        return ops.attention_decode(i["q"], i["k_cache"], i["v_cache"], i["table"], i["seqused"], causal=True,
                                    window=window, sinks=i["sinks"], k_scale=i["k_scale"], v_scale=i["v_scale"],
                                    backend=b)

    if full:
        reference = lambda i: eager_decode(i["q"], i["k_cache"], i["v_cache"], i["table"], i["seqused"],  # noqa: E731
                                           None, True, window, i["sinks"], i["k_scale"], i["v_scale"])
    else:
        reference = lambda i: ref.attention_decode(  # noqa: E731
            i["q"], i["k_cache"], i["v_cache"], i["table"], i["seqused"], None, True, window[0], window[1],
            i["sinks"], i["k_scale"], i["v_scale"], 0)[0]
    mask = "full" if window == (-1, -1) else f"window={window[0]},{window[1]}"
    ctx_label = f"ctx={ctx}" if len(set(lens)) == 1 else f"ctx={lens}"
    label = f"{model} B={bsz} {ctx_label} Sq={sq} H={hq}/{hkv} hd={d} {mask}" + (" sinks" if sinks else "") + \
        f" {kv} cache page={page}"
    params = dict(model=model, B=bsz, ctx=ctx, Sq=sq, Hq=hq, Hkv=hkv, D=d, window=list(window), sinks=sinks,
                  kv_dtype=kv, page=page, dtype="bf16")
    kv_elem = 1 if fp8 else 2
    nbytes = decode_bytes(lens, sq, hq, hkv, d, d, kv_elem, True, window, page)
    flops = attention_flops([sq] * bsz, lens, hq, d, d, True, window)
    return BenchCase("attention_decode", label, "decode", params, make, _guard_torch_backend(call, full), reference,
                     check_out, bytes_moved=nbytes, flops=flops, peers=peers, compile_reference=False, tier=tier,
                     flops_dtype="bf16")


def _paged_prefill_case(model: str, used: list[int], new: list[int], hq: int, hkv: int, d: int, causal: bool = True,
                        window=(-1, -1), sinks: bool = False, page: int = PAGE, tier: str = "full") -> BenchCase:
    """Chunked prefill over a bf16 paged cache: sequence b has used[b] keys; its new[b] queries are the last ones."""
    full = tier == "full"
    window = (int(window[0]), int(window[1]))
    bsz, cap, max_new = len(used), max(used), max(new)
    scale = 1.0 / math.sqrt(d)
    peers: dict = {}
    state: dict = {}
    if full:
        peers["fa4"] = lambda i: _first(_fa4().flash_attn_varlen_func(
            i["q"], i["k_cache"], i["v_cache"], cu_seqlens_q=i["cu_q"], max_seqlen_q=max_new,
            seqused_k=i["seqused"], page_table=i["table"], softmax_scale=scale, causal=causal,
            window_size=_fa4_window(window), learnable_sink=i["sinks"]))

    def make(device):
        i = _paged_kv(bsz, hkv, cap, d, page, False, device, spare=2)
        del i["k_dense"], i["v_dense"]
        i.update(q=torch.randn(sum(new), hq, d, device=device, dtype=BF16), cu_q=_cu(new, device),
                 seqused=torch.tensor(used, dtype=torch.int32, device=device),
                 sinks=torch.randn(hq, device=device) if sinks else None)
        _probe_peers(peers, state, i, device, f"attention_prefill_paged [{model}]")
        return i

    def call(i, b):
        return ops.attention_prefill_paged(i["q"], i["k_cache"], i["v_cache"], i["cu_q"], i["table"], i["seqused"],
                                           max_new, causal=causal, window=window, sinks=i["sinks"], backend=b)

    def eager(i):  # the keys each sequence uses, gathered through its block table, then the varlen eager reference
        k = _gather_pages(i["k_cache"], i["table"], None)
        v = _gather_pages(i["v_cache"], i["table"], None)
        kp = torch.cat([k[b, :n] for b, n in enumerate(used)])
        vp = torch.cat([v[b, :n] for b, n in enumerate(used)])
        return eager_varlen(i["q"], kp, vp, new, used, None, causal, window, i["sinks"])

    if full:
        reference = eager
    else:
        reference = lambda i: ref.attention_prefill_paged(  # noqa: E731
            i["q"], i["k_cache"], i["v_cache"], i["cu_q"], i["table"], i["seqused"], max_new, None, causal,
            window[0], window[1], i["sinks"], None, None)[0]
    mask = ("causal" if causal else "full") + (f" window={window[0]},{window[1]}" if window != (-1, -1) else "")
    label = f"{model} B={bsz} cached={_runs(used)} new={_runs(new)} H={hq}/{hkv} hd={d} {mask}" + \
        (" sinks" if sinks else "") + f" bf16 cache page={page}"
    params = dict(model=model, B=bsz, seqused_k=used, new=new, Hq=hq, Hkv=hkv, D=d, causal=causal,
                  window=list(window), sinks=sinks, kv_dtype="bf16", page=page, dtype="bf16")
    keys = [visible_keys_read(nq, nk, causal, window) for nq, nk in zip(new, used, strict=True)]
    tq = sum(new)
    nbytes = paged_kv_bytes(keys, hkv, d, d, 2, page) + tq * hq * (4 * d + 4) + (bsz + 1) * 4 + bsz * 4
    return BenchCase("attention_prefill_paged", label, "prefill", params, make, _guard_torch_backend(call, full),
                     reference, check_out, bytes_moved=nbytes,
                     flops=attention_flops(new, used, hq, d, d, causal, window), peers=peers, compile_reference=False,
                     tier=tier, flops_dtype="bf16")


def _runs(xs: list[int]) -> str:
    """[8192, 8192] -> '8192x2'; mixed lists as they are."""
    return f"{xs[0]}x{len(xs)}" if len(set(xs)) == 1 and len(xs) > 1 else str(xs[0] if len(xs) == 1 else xs)


# ------------------------------------------------------------------------------------------------------ merge


def _merge_case(t: int, h: int, d: int, tier: str = "full") -> BenchCase:
    def make(device):
        lse_a = torch.randn(t, h, device=device) * 3
        lse_b = torch.randn(t, h, device=device) * 3
        lse_a[0] = -math.inf  # a part without keys adds nothing
        lse_a[1, : h // 2] = -math.inf
        lse_b[1, : h // 2] = -math.inf  # both empty: out 0, lse -inf
        return {"a": torch.randn(t, h, d, device=device, dtype=BF16), "la": lse_a,
                "b": torch.randn(t, h, d, device=device, dtype=BF16), "lb": lse_b}

    return BenchCase(
        "merge_attn_states", f"T={t} H={h} D={d} bf16", "prefill" if t > 64 else "decode",
        dict(T=t, H=h, D=d, dtype="bf16"), make,
        lambda i, b: tuple(ops.merge_attn_states(i["a"], i["la"], i["b"], i["lb"], backend=b)),
        lambda i: ref.merge_attn_states(i["a"], i["la"], i["b"], i["lb"]), check_merge,
        bytes_moved=merge_bytes(t, h, d), tier=tier)


# ------------------------------------------------------------------------------------------------------ cases


LLAMA = dict(hq=32, hkv=8, dqk=128, dv=128)
GPT_OSS = dict(hq=64, hkv=8, dqk=64, dv=64)
DECODE_LLAMA = ((1, 8192), (16, 8192), (64, 8192), (256, 1024), (1, 131072))  # (B, context)
VARLEN = [8192, 4096, 1024, 512, 128, 17]


def _quick_cases() -> list[BenchCase]:
    """Tiny shapes for the CPU interpreter (CI), checked against the fp64 contract: every op once."""
    return [
        _prefill_case("quick", [3, 19], [9, 19], 4, 2, 32, 32, True, (6, 0), sinks=True, batched=False,
                      tier="quick"),
        _paged_prefill_case("quick", [20, 37], [4, 6], 4, 2, 32, window=(8, 0), sinks=True, page=16, tier="quick"),
        _decode_case("quick", 2, 47, 4, 2, 32, kv="fp8", sinks=True, sq=2, page=16, tier="quick", bad_page=(1, 1),
                     lens=[30, 47]),
        _merge_case(8, 4, 32, tier="quick"),
    ]


def cases() -> list[BenchCase]:
    c = LLAMA
    out = [
        _prefill_case("llama", [16384], [16384], c["hq"], c["hkv"], c["dqk"], c["dv"], True),
        _prefill_case("llama", [16384], [16384], c["hq"], c["hkv"], c["dqk"], c["dv"], False),
        _prefill_case("llama", [2048] * 8, [2048] * 8, c["hq"], c["hkv"], c["dqk"], c["dv"], True),
        # hd128 causal at 4k and 8k: the CuTeDSL sm_90 kernel (backend "cute") beside FA4 and the Gluon kernel
        _prefill_case("llama", [4096] * 4, [4096] * 4, c["hq"], c["hkv"], c["dqk"], c["dv"], True),
        _prefill_case("llama", [8192] * 2, [8192] * 2, c["hq"], c["hkv"], c["dqk"], c["dv"], True),
        _prefill_case("llama", [2048] * 8, [2048] * 8, c["hq"], c["hkv"], c["dqk"], c["dv"], False),
        _prefill_case("gpt-oss", [8192] * 2, [8192] * 2, 64, 8, 64, 64, True, (127, 0), sinks=True),
        _prefill_case("gpt-oss", [8192] * 2, [8192] * 2, 64, 8, 64, 64, True, sinks=True),
        _prefill_case("dsv3-mla", [8192], [8192], 16, 16, 192, 128, True),
        _prefill_case("llama", VARLEN, VARLEN, c["hq"], c["hkv"], c["dqk"], c["dv"], True, batched=False),
        _paged_prefill_case("llama", [8192] * 4, [1024] * 4, c["hq"], c["hkv"], c["dqk"]),
    ]
    out += [_decode_case("llama", b, ctx, c["hq"], c["hkv"], c["dqk"]) for b, ctx in DECODE_LLAMA]
    out += [
        _decode_case("llama", 16, 8192, c["hq"], c["hkv"], c["dqk"], kv="fp8"),
        _decode_case("gpt-oss", 16, 8192, 64, 8, 64, sinks=True),
        _decode_case("gpt-oss", 16, 8192, 64, 8, 64, sinks=True, window=(127, 0)),
        _merge_case(16384, 32, 128),
    ]
    from perf.cases.attention_mla import mla_cases  # (it imports helpers from this module)

    return out + _quick_cases() + mla_cases()
