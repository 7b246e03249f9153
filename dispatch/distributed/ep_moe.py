"""Expert-parallel MoE layer over torch.distributed: each rank holds a contiguous slice of the experts, tokens travel
to the ranks that hold their experts and the expert outputs travel back (docs/ep.md).

Transport: `torch.distributed.all_to_all_single` on the group (NCCL on GPUs, gloo on CPU: gloo implements the
uneven-split form for CPU tensors, so both backends run the same code). Every message is one uint8 row per token:
the hidden row (bf16 bytes, or FP8 E4M3 codes followed by their fp32 1x128 scales) then the token's k local expert
ids + 1 (0 = "no expert on this rank", so a zero padding row means nothing), then (combine="rank") its k fp32
router weights.

Combine (`combine=`): "entry" (default, exact): the receiving rank returns each (token, slot) entry's unweighted
expert output row, and the source rank combines them with `moe_combine` (fp32, slot order, one rounding): the
formula `moe_layer` evaluates on one rank, so the EP output has the single-rank bytes whenever the expert GEMMs give
each row the same bytes; the combine carries one row per entry. "rank": the receiving rank sums its slots of each
token in fp32 (slot order) and returns one fp32 row per (token, rank); the source rank adds them in rank order and
rounds once: half the combine bytes at top-8 over two ranks, and the fp32 sum order changes from slot order to
(rank, slot) order (bound in docs/ep.md).

Stage timing: `stage_hook(name)` is called after each stage's work is issued (PREFILL_STAGES / DECODE_STAGES, in
order); a caller's timer records an event there. The layer keeps no state of its own.

Prefill (`ep_moe_prefill`): exact-size buffers; one host sync reads the exchanged counts. Decode (`ep_moe_decode`):
a fixed capacity of tokens per (source, destination) rank pair, equal splits, the masked layout, no host sync; tokens
past the capacity are dropped and counted (`EPDecodeOutput.dropped`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from triton_ops.contract import checks as C

from ..ops.moe import moe_combine, moe_gather
from ..ops.moe_layer import moe_layer
from ..ops.quant import fp8_group_dequantize, fp8_group_quantize

FP8_GROUP = 128  # DeepSeek 1x128 activation groups: the FP8 GEMMs' own activation format
I32 = torch.int32
COMBINES = ("entry", "rank")
# Stages in issue order; stage_hook(name) runs after each one's work is issued.
PREFILL_STAGES = ("route", "count_exchange", "pack", "dispatch", "experts", "combine", "final_combine")
DECODE_STAGES = ("route", "pack", "dispatch", "experts", "combine", "final_combine")
StageHook = Callable[[str], None]


@dataclass(frozen=True)
class ExpertPlacement:
    """Global experts split evenly and contiguously: rank r holds [r * local_experts, (r + 1) * local_experts)."""
    num_experts: int  # global expert count (the router's E)
    world_size: int
    rank: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world_size


def placement(num_experts: int, group: dist.ProcessGroup | None = None, *, op: str = "ep_moe") -> ExpertPlacement:
    """This rank's placement in `group` (default: the world); experts must split evenly over the ranks."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts <= 0 or num_experts % world:
        C.fail(op, "num_experts", f"{num_experts} experts do not split evenly over {world} ranks")
    return ExpertPlacement(num_experts, world, rank)


class ExchangeSizes(NamedTuple):
    """Rows of one rank's prefill exchanges, per peer rank in rank order (host ints, read after the count
    exchange). Dispatch sends tokens_send[r] rows to r and receives tokens_recv[r]; the combine runs the inverse:
    entries (combine="entry") or tokens (combine="rank")."""
    tokens_send: list[int]
    tokens_recv: list[int]
    entries_send: list[int]
    entries_recv: list[int]


def message_row_bytes(hidden_size: int, top_k: int, dtype: torch.dtype, *, fp8_dispatch: bool = False,
                      combine: str = "entry") -> tuple[int, int]:
    """(dispatch row bytes, combine row bytes) of the layer's messages: dispatch = hidden bytes (or FP8 codes +
    fp32 1x128 scales) + k int32 ids (+ k fp32 weights for combine="rank"); combine = one output row in the hidden
    dtype per entry ("entry") or one fp32 partial-sum row per (token, rank) ("rank")."""
    body = hidden_size + 4 * (hidden_size // FP8_GROUP) if fp8_dispatch else hidden_size * dtype.itemsize
    per_rank = combine == "rank"
    return body + 4 * top_k * (2 if per_rank else 1), hidden_size * (4 if per_rank else dtype.itemsize)


class EPDecodeOutput(NamedTuple):
    out: Tensor  # (T, H) in hidden's dtype
    dropped: Tensor  # int32 [world]: this rank's tokens not sent to each rank (past the capacity); device tensor


def exchange_rows(recv: Tensor, send: Tensor, recv_splits: list[int] | None, send_splits: list[int] | None,
                  group: dist.ProcessGroup | None) -> Tensor:
    """The one transport: rows of `send` go to ranks in split order, `recv` gets the rows from each rank in rank
    order (None splits: equal). all_to_all_single on NCCL and gloo alike (both implement it)."""
    dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group)
    return recv


def _destinations(topk_ids: Tensor, p: ExpertPlacement) -> Tensor:
    """Destination rank of every (token, slot) entry, -1 for ids outside [0, E) (no expert anywhere)."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < p.num_experts)
    return torch.where(valid, ids // p.local_experts, torch.full_like(ids, -1))


def _send_rows(hidden: Tensor, topk_ids: Tensor, dest: Tensor, send_src: Tensor, p: ExpertPlacement, fp8: bool,
               weights: Tensor | None, backend: str) -> Tensor:
    """The send buffer (len(send_src), row_bytes) uint8: row i is token t's message for rank r where send_src[i] =
    r * T + t (hidden bytes, the ids local to r + 1, then the fp32 router weights when given), a zero row where
    send_src[i] >= W * T (padding). Each sent row's body is gathered from the token's one body row and its ids /
    weights are computed for the sent rows only: no (W, T, row) copy of the tokens. FP8: the rows are quantized
    once, codes then scales (row-local, so the same bytes as quantizing after sending)."""
    t, k = topk_ids.shape
    if fp8:
        q = fp8_group_quantize(hidden, FP8_GROUP)
        body = torch.cat([q.codes.view(torch.uint8), q.scales.contiguous().view(torch.uint8)], dim=1)
    else:
        body = hidden.contiguous().view(torch.uint8)
    src = send_src.long()
    rank = torch.div(src, max(t, 1), rounding_mode="floor")  # padding rows: W (or 0 when T = 0), matched by no id
    token = torch.where(src < p.world_size * t, src - rank * t, t)  # t: one past the tokens, a zero body row
    rows = moe_gather(body, token.to(I32), 1, backend=backend)
    no_expert = torch.full((1, k), -1, dtype=dest.dtype, device=dest.device)  # the padding row's destinations
    mine = torch.cat([dest, no_expert])[token] == rank.unsqueeze(1)
    ids = torch.cat([topk_ids.long(), no_expert.long()])[token]
    local = torch.where(mine, ids - rank.unsqueeze(1) * p.local_experts + 1, 0).to(I32)
    parts = [rows, local.view(torch.uint8)]
    if weights is not None:  # an entry's weight travels with its row; padding rows carry zero bytes
        w = torch.cat([weights.float(), weights.new_zeros(1, k, dtype=torch.float32)])[token]
        parts.append(w.view(torch.uint8))
    return torch.cat(parts, dim=1)


def _unpack(recv: Tensor, h: int, k: int, dtype: torch.dtype, fp8: bool,
            with_weights: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Received message rows -> (hidden (R, H) in dtype, local ids (R, k) int32 (-1 = not on this rank), the fp32
    router weights (R, k) or None)."""
    tail = 4 * k * (2 if with_weights else 1)
    ids_at = recv.shape[1] - tail
    ids = recv[:, ids_at:ids_at + 4 * k].contiguous().view(I32) - 1
    weights = recv[:, ids_at + 4 * k:].contiguous().view(torch.float32) if with_weights else None
    if fp8:
        codes = recv[:, :h].contiguous().view(torch.float8_e4m3fn)
        scales = recv[:, h:h + 4 * (h // FP8_GROUP)].contiguous().view(torch.float32)
        return fp8_group_dequantize(codes, scales, FP8_GROUP, out_dtype=dtype), ids, weights
    return recv[:, :h * dtype.itemsize].contiguous().view(dtype), ids, weights


def _scatter_rows(positions: Tensor, keep: Tensor, size: int, fill: int) -> Tensor:
    """int32 [size]: out[positions[i]] = i where keep[i], `fill` elsewhere. Dropped items land in their own spare
    slot past `size` (never two writes to one slot: deterministic without a sort)."""
    n = positions.numel()
    spare = size + torch.arange(n, device=positions.device)
    dst = torch.where(keep, positions, spare)
    out = torch.full((size + n,), fill, dtype=I32, device=positions.device)
    out.scatter_(0, dst, torch.arange(n, dtype=I32, device=positions.device))
    return out[:size]


def _rank_positions(member: Tensor) -> Tensor:
    """member (N, W) bool -> int64 (N, W): the item's index among the items of its column (rows in order).
    The scan runs along the last dimension of the (W, N) transpose: CUDA scans an outer dimension one thread per
    column, serially (N dependent loads: about 3 ms at N = 32768), the last one in parallel."""
    return (torch.cumsum(member.t().contiguous().long(), dim=1) - 1).t()


def _run_local_experts(hidden: Tensor, ids: Tensor, entry_src: Tensor, w1: Tensor, w2: Tensor, backend: str,
                       layer: dict) -> Tensor:
    """One unweighted output row per entry: entry_src holds the flat (token * k + slot) index of each entry (or a
    sentinel), each entry runs as a top-1 token with weight 1 (1.0 * row is exact in the fp32 combine)."""
    k = ids.shape[1]
    rows = moe_gather(hidden, entry_src, k, backend=backend)
    flat_ids = torch.cat([ids.reshape(-1), ids.new_full((1,), -1)])
    entry_ids = flat_ids[entry_src.long().clamp(max=ids.numel())].unsqueeze(1)
    ones = torch.ones(entry_src.shape[0], 1, dtype=torch.float32, device=hidden.device)
    return moe_layer(rows, entry_ids, ones, w1, w2, backend=backend, **layer)


def _check(op: str, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, p: ExpertPlacement,
           fp8_dispatch: bool, combine: str, layer: dict) -> None:
    for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w1", w1)):
        C.check_tensor(op, name, t)
    if hidden.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0]:
        C.fail(op, "topk_ids", f"expected hidden (T, H) and topk_ids (T, k), got {tuple(hidden.shape)} and "
                               f"{tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        C.fail(op, "topk_weights", f"shape {tuple(topk_weights.shape)} != topk_ids {tuple(topk_ids.shape)}")
    if w1.shape[0] != p.local_experts:
        C.fail(op, "w1", f"{w1.shape[0]} local experts, expected {p.num_experts} / {p.world_size} = "
                         f"{p.local_experts} (this rank's slice)")
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        C.fail(op, "hidden", f"{hidden.dtype}: the layer runs bf16 / fp16 activations")
    if fp8_dispatch and hidden.shape[1] % FP8_GROUP:
        C.fail(op, "fp8_dispatch", f"hidden size {hidden.shape[1]} is not a multiple of {FP8_GROUP}")
    if combine not in COMBINES:
        C.fail(op, "combine", f"{combine!r} is not one of {', '.join(COMBINES)}")
    for name in ("expert_map", "layout", "max_m", "shared"):
        if name in layer:
            C.fail(op, name, "set by the expert-parallel layer (pass shared to this function's own argument)")


def _no_hook(stage: str) -> None:
    """The default stage hook: nothing is timed."""


class _Routing(NamedTuple):
    dest: Tensor  # (T, k) destination rank of each entry, -1 = none
    token_to: Tensor  # (T, W) bool: the token travels to that rank
    entry_to: Tensor  # (T*k, W) bool: the entry's expert is on that rank
    counts: Tensor  # (W, 2): tokens, entries per destination


def _route(topk_ids: Tensor, p: ExpertPlacement) -> _Routing:
    dest = _destinations(topk_ids, p)
    ranks = torch.arange(p.world_size, device=topk_ids.device)
    entry_to = dest.reshape(-1, 1) == ranks
    token_to = (dest.unsqueeze(2) == ranks).any(dim=1)
    return _Routing(dest, token_to, entry_to, torch.stack([token_to.sum(0), entry_to.sum(0)], dim=1))


def _exchange_counts(counts: Tensor, world: int, group: dist.ProcessGroup | None) -> ExchangeSizes:
    recv_counts = exchange_rows(torch.empty_like(counts), counts, None, None, group)
    sizes = torch.cat([counts, recv_counts]).tolist()  # the one host sync
    sent, got = sizes[:world], sizes[world:]
    return ExchangeSizes([c[0] for c in sent], [c[0] for c in got], [c[1] for c in sent], [c[1] for c in got])


def exchange_sizes(topk_ids: Tensor, num_experts: int, group: dist.ProcessGroup | None = None) -> ExchangeSizes:
    """The row counts `ep_moe_prefill` exchanges for this routing (a collective: every rank of `group` calls it;
    one host sync). For benchmarks that replay the layer's exchanges with the same splits."""
    p = placement(num_experts, group, op="exchange_sizes")
    return _exchange_counts(_route(topk_ids, p).counts, p.world_size, group)


def _token_rows(token_to: Tensor, offsets: Tensor) -> Tensor:
    """int32 (T, W): row of token t's message for rank r in a (destination, token)-ordered buffer whose rank-r block
    starts at offsets[r]; -1 where the token does not travel to r."""
    return torch.where(token_to, offsets + _rank_positions(token_to), -1).to(I32)


def _partial_sums(out: Tensor, entry_rows: Tensor, weights: Tensor, backend: str) -> Tensor:
    """combine="rank", on the expert side: fp32 (R, H), row r = sum over r's local slots in slot order of
    weight * out[entry_rows[r, j]] (-1: the slot has no expert here)."""
    return moe_combine(out, entry_rows, weights, out_dtype=torch.float32, backend=backend)


def _sum_ranks(back: Tensor, rows: Tensor, shared: Tensor | None, dtype: torch.dtype, backend: str) -> Tensor:
    """combine="rank", on the source side: y[t] = sum over ranks in order of the token's partial row (+ shared),
    one rounding (weight 1.0 * an fp32 row is exact)."""
    ones = torch.ones(rows.shape, dtype=torch.float32, device=rows.device)
    return moe_combine(back, rows, ones, shared=shared, out_dtype=dtype, backend=backend)


def ep_moe_prefill(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, *,
                   num_experts: int, group: dist.ProcessGroup | None = None, fp8_dispatch: bool = False,
                   combine: str = "entry", shared: Tensor | None = None, backend: str = "auto",
                   stage_hook: StageHook | None = None, **layer) -> Tensor:
    """Expert-parallel moe_layer for any token count (varlen / prefill): y[t] = sum_j w[t, j] * expert(ids[t, j])(
    hidden[t]) (+ shared[t]) over the GLOBAL top-k ids, with this rank's experts w1 / w2 (its slice of
    num_experts, `ExpertPlacement`). Every rank of `group` calls it (T may differ per rank, 0 included).

    Steps (PREFILL_STAGES): route: count tokens and entries per destination rank -> count_exchange
    (all_to_all_single; the one host sync, sizing the buffers) -> pack: each token's message once per rank
    holding any of its experts (bf16 bytes, or fp8_dispatch: FP8 1x128 codes + scales, dequantized on arrival) ->
    dispatch -> experts: the local experts in the contiguous layout (`moe_layer`, `layer` = its keyword arguments:
    weights, scales, activation, fused, ...) -> combine: the inverse all_to_all (combine="entry": each entry's
    output row; "rank": each token's fp32 partial sum) -> final_combine: `moe_combine` in slot order ("entry") or
    rank order ("rank"). No atomics anywhere. stage_hook: called with each stage's name after its work is issued."""
    op = "ep_moe_prefill"
    p = placement(num_experts, group, op=op)
    _check(op, hidden, topk_ids, topk_weights, w1, p, fp8_dispatch, combine, layer)
    mark = stage_hook or _no_hook
    per_rank = combine == "rank"
    t, h = hidden.shape
    k = topk_ids.shape[1]
    route = _route(topk_ids, p)
    mark("route")
    sizes = _exchange_counts(route.counts, p.world_size, group)
    mark("count_exchange")

    # send rows in (destination, token) order: row of (t, r) = offset[r] + position of t among r's tokens
    tok_offsets = torch.cumsum(route.counts[:, 0], 0) - route.counts[:, 0]
    tok_rows = _token_rows(route.token_to, tok_offsets)  # (T, W)
    slot = tok_rows.t().reshape(-1).long()
    send_src = _scatter_rows(slot, route.token_to.t().reshape(-1), sum(sizes.tokens_send), p.world_size * t)
    send = _send_rows(hidden, topk_ids, route.dest, send_src, p, fp8_dispatch, topk_weights if per_rank else None,
                      backend)
    mark("pack")
    recv = exchange_rows(send.new_empty(sum(sizes.tokens_recv), send.shape[1]), send, sizes.tokens_recv,
                         sizes.tokens_send, group)
    mark("dispatch")

    x, ids, recv_weights = _unpack(recv, h, k, hidden.dtype, fp8_dispatch, per_rank)
    valid = (ids >= 0).reshape(-1)
    entry = torch.cumsum(valid.long(), 0) - 1  # entries numbered in (row, slot) order
    entry_src = _scatter_rows(entry, valid, sum(sizes.entries_recv), ids.numel())
    out = _run_local_experts(x, ids, entry_src, w1, w2, backend, dict(layout="contiguous", **layer))
    if per_rank:
        out = _partial_sums(out, torch.where(valid, entry, -1).to(I32).view(ids.shape), recv_weights, backend)
        mark("experts")
        back = exchange_rows(out.new_empty(sum(sizes.tokens_send), h), out, sizes.tokens_send, sizes.tokens_recv,
                             group)
        mark("combine")
        y = _sum_ranks(back, tok_rows, shared, hidden.dtype, backend)
        mark("final_combine")
        return y
    mark("experts")
    back = exchange_rows(out.new_empty(sum(sizes.entries_send), h), out, sizes.entries_send, sizes.entries_recv,
                         group)
    mark("combine")
    ent_offsets = torch.cumsum(route.counts[:, 1], 0) - route.counts[:, 1]
    dest = route.dest
    pos = (ent_offsets + _rank_positions(route.entry_to)).gather(1, dest.reshape(-1, 1).clamp(min=0)).view(t, k)
    inv_rows = torch.where(dest >= 0, pos, -1).to(I32)
    y = moe_combine(back, inv_rows, topk_weights, shared=shared, out_dtype=hidden.dtype, backend=backend)
    mark("final_combine")
    return y


def ep_moe_decode(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, *,
                  num_experts: int, capacity: int, group: dist.ProcessGroup | None = None, fp8_dispatch: bool = False,
                  combine: str = "entry", shared: Tensor | None = None, backend: str = "auto",
                  stage_hook: StageHook | None = None, **layer) -> EPDecodeOutput:
    """Expert-parallel moe_layer with static shapes (decode; CUDA-graph capturable: no host sync, no shape that
    depends on the routing). `capacity`: tokens each rank may send to each rank per call (the same on every rank);
    buffers are (world * capacity) rows, exchanged with equal splits; the local experts run in the masked layout
    with max_m = world * capacity (the most tokens one expert can receive, so nothing drops at the experts).
    combine: as `ep_moe_prefill` ("entry": world * capacity * k rows return, one per (row, slot), local or not;
    "rank": world * capacity fp32 partial-sum rows). stage_hook: as prefill's, DECODE_STAGES.

    Overflow: a token past the capacity of a destination rank is dropped there (its slots on that rank add
    nothing; its other slots still count, no renormalization) and counted in `dropped[rank]` (int32, on the
    device: read it after the step, or check `dropped.sum() == 0` when the step's output must be exact).
    Without overflow the output equals `ep_moe_prefill`'s with the same `combine`, given the same expert-row
    bytes (docs/ep.md)."""
    op = "ep_moe_decode"
    p = placement(num_experts, group, op=op)
    _check(op, hidden, topk_ids, topk_weights, w1, p, fp8_dispatch, combine, layer)
    if capacity <= 0:
        C.fail(op, "capacity", f"{capacity}: need at least one token per rank pair")
    mark = stage_hook or _no_hook
    per_rank = combine == "rank"
    t, h = hidden.shape
    k = topk_ids.shape[1]
    w, cap = p.world_size, capacity
    dev = hidden.device
    dest = _destinations(topk_ids, p)
    token_to = (dest.unsqueeze(2) == torch.arange(w, device=dev)).any(dim=1)  # (T, W)
    position = _rank_positions(token_to)  # (T, W): index among the tokens to that rank
    sent = token_to & (position < cap)
    dropped = (token_to.sum(0) - cap).clamp(min=0).to(I32)
    mark("route")

    slot = (torch.arange(w, device=dev) * cap + position).t().reshape(-1)
    send_src = _scatter_rows(slot, sent.t().reshape(-1), w * cap, w * t)  # sentinel rows: zero bytes, no ids
    send = _send_rows(hidden, topk_ids, dest, send_src, p, fp8_dispatch, topk_weights if per_rank else None, backend)
    mark("pack")
    recv = exchange_rows(torch.empty_like(send), send, None, None, group)
    mark("dispatch")

    x, ids, recv_weights = _unpack(recv, h, k, hidden.dtype, fp8_dispatch, per_rank)
    entry_src = torch.arange(ids.numel(), dtype=I32, device=dev)  # every (received row, slot); -1 ids get no row
    out = _run_local_experts(x, ids, entry_src, w1, w2, backend, dict(layout="masked", max_m=w * cap, **layer))
    if per_rank:  # (W * cap, H) fp32: one row per received row; entry i of `out` is flat (row, slot) i
        entry_rows = torch.where(ids >= 0, entry_src.view(ids.shape), -1)
        out = _partial_sums(out, entry_rows, recv_weights, backend)
        mark("experts")
        back = exchange_rows(torch.empty_like(out), out, None, None, group)
        mark("combine")
        rows = torch.where(sent, torch.arange(w, device=dev) * cap + position, -1).to(I32)
        y = _sum_ranks(back, rows, shared, hidden.dtype, backend)
        mark("final_combine")
        return EPDecodeOutput(y, dropped)
    mark("experts")
    back = exchange_rows(torch.empty_like(out), out, None, None, group)  # (W * cap * k, H): rank, row, slot
    mark("combine")
    d = dest.clamp(min=0)
    row = position.gather(1, d)  # (T, k): the token's row at its slot's rank
    inv = (d * cap + row) * k + torch.arange(k, device=dev)
    kept = (dest >= 0) & sent.gather(1, d)
    inv_rows = torch.where(kept, inv, -1).to(I32)
    y = moe_combine(back, inv_rows, topk_weights, shared=shared, out_dtype=hidden.dtype, backend=backend)
    mark("final_combine")
    return EPDecodeOutput(y, dropped)
