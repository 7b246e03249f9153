"""Expert-parallel MoE layer over torch.distributed: each rank holds a contiguous slice of the experts, tokens travel
to the ranks that hold their experts and the expert outputs travel back (docs/ep.md).

Transport: `torch.distributed.all_to_all_single` on the group (NCCL on GPUs, gloo on CPU: gloo implements the
uneven-split form for CPU tensors, so both backends run the same code). Every message is one uint8 row per token:
the hidden row (bf16 bytes, or FP8 E4M3 codes followed by their fp32 1x128 scales) then the token's k local expert
ids + 1 (0 = "no expert on this rank", so a zero padding row means nothing).

Exactness: the receiving rank returns each (token, slot) entry's unweighted expert output row, and the source rank
combines them with `moe_combine` (fp32, slot order, one rounding): the formula `moe_layer` evaluates on one rank,
so the EP output has the single-rank bytes whenever the expert GEMMs give each row the same bytes. The price: the
combine carries one row per entry instead of one per (token, rank) (docs/ep.md names the alternative).

Prefill (`ep_moe_prefill`): exact-size buffers; one host sync reads the exchanged counts. Decode (`ep_moe_decode`):
a fixed capacity of tokens per (source, destination) rank pair, equal splits, the masked layout, no host sync; tokens
past the capacity are dropped and counted (`EPDecodeOutput.dropped`).
"""

from __future__ import annotations

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


def _payload(hidden: Tensor, topk_ids: Tensor, dest: Tensor, p: ExpertPlacement, fp8: bool) -> Tensor:
    """(world, T, row_bytes) uint8: per destination rank, every token's message row (hidden bytes, local ids + 1).
    FP8: the rows are quantized once, codes then scales (row-local, so the same bytes as quantizing after sending)."""
    if fp8:
        q = fp8_group_quantize(hidden, FP8_GROUP)
        body = torch.cat([q.codes.view(torch.uint8), q.scales.contiguous().view(torch.uint8)], dim=1)
    else:
        body = hidden.contiguous().view(torch.uint8)
    ranks = torch.arange(p.world_size, device=hidden.device).view(-1, 1, 1)
    local = torch.where(dest.unsqueeze(0) == ranks, topk_ids.long().unsqueeze(0) - ranks * p.local_experts + 1, 0)
    ids = local.to(I32).contiguous().view(torch.uint8)  # (world, T, 4k)
    return torch.cat([body.unsqueeze(0).expand(p.world_size, -1, -1), ids], dim=2)


def _unpack(recv: Tensor, h: int, k: int, dtype: torch.dtype, fp8: bool) -> tuple[Tensor, Tensor]:
    """Received message rows -> (hidden (R, H) in dtype, local ids (R, k) int32, -1 = not on this rank)."""
    ids = recv[:, recv.shape[1] - 4 * k:].contiguous().view(I32) - 1
    if fp8:
        codes = recv[:, :h].contiguous().view(torch.float8_e4m3fn)
        scales = recv[:, h:h + 4 * (h // FP8_GROUP)].contiguous().view(torch.float32)
        return fp8_group_dequantize(codes, scales, FP8_GROUP, out_dtype=dtype), ids
    return recv[:, :2 * h].contiguous().view(dtype), ids


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
    """member (N, W) bool -> int64 (N, W): the item's index among the items of its column (rows in order)."""
    return torch.cumsum(member.long(), dim=0) - 1


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
           fp8_dispatch: bool, layer: dict) -> None:
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
    for name in ("expert_map", "layout", "max_m", "shared"):
        if name in layer:
            C.fail(op, name, "set by the expert-parallel layer (pass shared to this function's own argument)")


def ep_moe_prefill(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, *,
                   num_experts: int, group: dist.ProcessGroup | None = None, fp8_dispatch: bool = False,
                   shared: Tensor | None = None, backend: str = "auto", **layer) -> Tensor:
    """Expert-parallel moe_layer for any token count (varlen / prefill): y[t] = sum_j w[t, j] * expert(ids[t, j])(
    hidden[t]) (+ shared[t]) over the GLOBAL top-k ids, with this rank's experts w1 / w2 (its slice of
    num_experts, `ExpertPlacement`). Every rank of `group` calls it (T may differ per rank, 0 included).

    Steps: count tokens and entries per destination rank -> exchange the counts (all_to_all_single; the one host
    sync, sizing the buffers) -> each token travels once to each rank holding any of its experts (bf16 bytes, or
    fp8_dispatch: FP8 1x128 codes + scales, dequantized on arrival) -> the local experts run in the contiguous
    layout (`moe_layer`, `layer` = its keyword arguments: weights, scales, activation, fused, ...) -> each entry's
    output row returns by the inverse all_to_all -> `moe_combine` in slot order. No atomics anywhere."""
    op = "ep_moe_prefill"
    p = placement(num_experts, group, op=op)
    _check(op, hidden, topk_ids, topk_weights, w1, p, fp8_dispatch, layer)
    t, h = hidden.shape
    k = topk_ids.shape[1]
    dev = hidden.device
    dest = _destinations(topk_ids, p)  # (T, k)
    ranks = torch.arange(p.world_size, device=dev)
    entry_to = dest.reshape(-1, 1) == ranks  # (T*k, W)
    token_to = (dest.unsqueeze(2) == ranks).any(dim=1)  # (T, W)
    counts = torch.stack([token_to.sum(0), entry_to.sum(0)], dim=1)  # (W, 2): tokens, entries per destination
    recv_counts = exchange_rows(torch.empty_like(counts), counts, None, None, group)
    sizes = torch.cat([counts, recv_counts]).tolist()  # the one host sync
    tok_send, ent_send = [c[0] for c in sizes[:p.world_size]], [c[1] for c in sizes[:p.world_size]]
    tok_recv, ent_recv = [c[0] for c in sizes[p.world_size:]], [c[1] for c in sizes[p.world_size:]]

    # send rows in (destination, token) order: row of (t, r) = offset[r] + position of t among r's tokens
    tok_offsets = torch.cumsum(counts[:, 0], 0) - counts[:, 0]
    slot = (tok_offsets + _rank_positions(token_to)).t().reshape(-1)  # (W*T) in (r, t) order
    send_src = _scatter_rows(slot, token_to.t().reshape(-1), sum(tok_send), p.world_size * t)
    payload = _payload(hidden, topk_ids, dest, p, fp8_dispatch)
    payload = payload.reshape(p.world_size * t, payload.shape[2])  # explicit width: T may be 0
    send = moe_gather(payload, send_src, 1, backend=backend)
    recv = exchange_rows(send.new_empty(sum(tok_recv), send.shape[1]), send, tok_recv, tok_send, group)

    x, ids = _unpack(recv, h, k, hidden.dtype, fp8_dispatch)
    valid = (ids >= 0).reshape(-1)
    entry_src = _scatter_rows(torch.cumsum(valid.long(), 0) - 1, valid, sum(ent_recv), ids.numel())
    out = _run_local_experts(x, ids, entry_src, w1, w2, backend, dict(layout="contiguous", **layer))

    back = exchange_rows(out.new_empty(sum(ent_send), h), out, ent_send, ent_recv, group)
    ent_offsets = torch.cumsum(counts[:, 1], 0) - counts[:, 1]
    pos = (ent_offsets + _rank_positions(entry_to)).gather(1, dest.reshape(-1, 1).clamp(min=0)).view(t, k)
    inv_rows = torch.where(dest >= 0, pos, -1).to(I32)
    return moe_combine(back, inv_rows, topk_weights, shared=shared, out_dtype=hidden.dtype, backend=backend)


def ep_moe_decode(hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, *,
                  num_experts: int, capacity: int, group: dist.ProcessGroup | None = None, fp8_dispatch: bool = False,
                  shared: Tensor | None = None, backend: str = "auto", **layer) -> EPDecodeOutput:
    """Expert-parallel moe_layer with static shapes (decode; CUDA-graph capturable: no host sync, no shape that
    depends on the routing). `capacity`: tokens each rank may send to each rank per call (the same on every rank);
    buffers are (world * capacity) rows, exchanged with equal splits; the local experts run in the masked layout
    with max_m = world * capacity (the most tokens one expert can receive, so nothing drops at the experts).

    Overflow: a token past the capacity of a destination rank is dropped there (its slots on that rank add
    nothing; its other slots still count, no renormalization) and counted in `dropped[rank]` (int32, on the
    device: read it after the step, or check `dropped.sum() == 0` when the step's output must be exact).
    Without overflow the output equals `ep_moe_prefill`'s given the same expert-row bytes (docs/ep.md)."""
    op = "ep_moe_decode"
    p = placement(num_experts, group, op=op)
    _check(op, hidden, topk_ids, topk_weights, w1, p, fp8_dispatch, layer)
    if capacity <= 0:
        C.fail(op, "capacity", f"{capacity}: need at least one token per rank pair")
    t, h = hidden.shape
    k = topk_ids.shape[1]
    w, cap = p.world_size, capacity
    dev = hidden.device
    dest = _destinations(topk_ids, p)
    token_to = (dest.unsqueeze(2) == torch.arange(w, device=dev)).any(dim=1)  # (T, W)
    position = _rank_positions(token_to)  # (T, W): index among the tokens to that rank
    sent = token_to & (position < cap)
    dropped = (token_to.sum(0) - cap).clamp(min=0).to(I32)

    slot = (torch.arange(w, device=dev) * cap + position).t().reshape(-1)
    send_src = _scatter_rows(slot, sent.t().reshape(-1), w * cap, w * t)  # sentinel rows: zero bytes, no ids
    payload = _payload(hidden, topk_ids, dest, p, fp8_dispatch)
    payload = payload.reshape(w * t, payload.shape[2])
    send = moe_gather(payload, send_src, 1, backend=backend)
    recv = exchange_rows(torch.empty_like(send), send, None, None, group)

    x, ids = _unpack(recv, h, k, hidden.dtype, fp8_dispatch)
    entry_src = torch.arange(ids.numel(), dtype=I32, device=dev)  # every (received row, slot); -1 ids get no row
    out = _run_local_experts(x, ids, entry_src, w1, w2, backend, dict(layout="masked", max_m=w * cap, **layer))

    back = exchange_rows(torch.empty_like(out), out, None, None, group)  # (W * cap * k, H): rank, row, slot
    d = dest.clamp(min=0)
    row = position.gather(1, d)  # (T, k): the token's row at its slot's rank
    inv = (d * cap + row) * k + torch.arange(k, device=dev)
    kept = (dest >= 0) & sent.gather(1, d)
    inv_rows = torch.where(kept, inv, -1).to(I32)
    y = moe_combine(back, inv_rows, topk_weights, shared=shared, out_dtype=hidden.dtype, backend=backend)
    return EPDecodeOutput(y, dropped)
