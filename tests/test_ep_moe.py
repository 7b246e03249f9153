"""The expert-parallel MoE layer (dispatch/distributed/ep_moe.py): two ranks spawned with torch.multiprocessing over
gloo on the CPU (the GPU variant: NCCL, DeepSeek-V3 dims), each rank's output against the single-rank moe_layer on
the same tokens with all experts."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

H, I, E, K = 256, 128, 8, 2  # CPU dims: hidden, inner, global experts (4 per rank), top-k
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args, world=WORLD):
    mp.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def _entry(rank, world, port, fn, args):
    import torch.distributed as dist

    if not torch.cuda.is_available() or fn is not _gpu_worker:
        os.environ["TRITON_INTERPRET"] = "1"  # the CPU ranks run the Triton kernels under the interpreter
        backend = "gloo"
    else:
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in units of the last place between two bf16 tensors (the bit patterns as ordered ints)."""
    def ordered(x):
        b = x.contiguous().view(torch.int16).int()
        return torch.where(b < 0, -(b & 0x7FFF), b)
    return int((ordered(got) - ordered(want)).abs().max()) if got.numel() else 0


def _experts(g, coarse, e=E, h=H, i=I):
    if coarse:  # a grid where every GEMM sum is exact: the bytes cannot depend on the kernels' tile shapes
        w1 = torch.randint(-8, 9, (e, 2 * i, h), generator=g) / 64
        w2 = torch.randint(-8, 9, (e, h, i), generator=g) / 64
    else:
        w1, w2 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5, torch.randn(e, h, i, generator=g) / i ** 0.5
    return w1.bfloat16(), w2.bfloat16()


def _tokens(g, t, coarse, skew, h=H, e=E, k=K):
    """(hidden, ids, weights); skew: experts of the last rank drawn 4x as often (that rank receives ~4x)."""
    x = torch.randint(-4, 5, (t, h), generator=g) / 4 if coarse else torch.randn(t, h, generator=g)
    p = torch.ones(e)
    p[e - e // WORLD:] = 4.0 if skew else 1.0
    ids = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(t)] or [torch.empty(0, k).long()])
    ids = ids.to(torch.int32).reshape(t, k)
    return x.bfloat16(), ids, torch.rand(t, k, generator=g)


def _local(w, rank, world):
    n = w.shape[0] // world
    return w[rank * n:(rank + 1) * n].contiguous()


def _rank_experts(seed, coarse, rank, world):
    """(w1, w2, this rank's w1, w2): every rank draws the same experts from `seed` and keeps its share."""
    w1, w2 = _experts(torch.Generator().manual_seed(seed), coarse)
    return w1, w2, _local(w1, rank, world), _local(w2, rank, world)


def _prefill_worker(rank, world):
    from dispatch.distributed import ep_moe_prefill
    from dispatch.ops import moe_layer

    g = torch.Generator().manual_seed(0)  # the same experts on every rank
    for coarse in (True, False):
        w1, w2 = _experts(g, coarse)
        cases = {  # name: tokens on rank 0, tokens on rank 1, skew
            "skewed": (24, 6, True), "rank 1 empty": (12, 0, False), "rank 0 empty": (0, 9, True)}
        for name, (t0, t1, skew) in cases.items():
            gr = torch.Generator().manual_seed(100 + rank)
            x, ids, w = _tokens(gr, (t0, t1)[rank], coarse, skew)
            if name == "skewed" and ids.shape[0]:
                ids[0] = -1  # a token routed to no expert
                ids[1, 1] = E + 3  # an id out of range: no expert anywhere
                ids[2] = torch.tensor([rank * 4, rank * 4 + 1])  # only on this rank's own experts
            got = ep_moe_prefill(x, ids, w, _local(w1, rank, world), _local(w2, rank, world), num_experts=E,
                                 backend="triton")
            want = moe_layer(x, ids, w, w1, w2, backend="triton")
            label = f"rank {rank} {name} coarse={coarse}"
            if coarse:
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), label
            else:
                assert _ulps_apart(got, want) <= 1, label


def test_prefill_matches_single_rank_layer():
    """Skewed routing (rank 1 receives ~4x), tokens with no expert / an out-of-range id / only local experts, a
    rank with zero tokens: exact bytes on a grid where GEMM sums are exact, within one bf16 ulp on random values."""
    _spawn(_prefill_worker)


def _slot_rows(x, ids, w1, w2, backend="triton"):
    """Each slot's unweighted expert row (T, k, H) fp32 from the single-rank layer (zeros where no expert)."""
    from dispatch.ops import moe_layer

    t, k = ids.shape
    ones = torch.ones(t * k, 1, device=x.device)
    rows = moe_layer(x.repeat_interleave(k, 0), ids.reshape(t * k, 1), ones, w1, w2, backend=backend)
    return rows.float().view(t, k, -1)


def _within_reordered_sum_bound(got, want, x, ids, w, w1, w2, backend="triton") -> float:
    """Largest |got - want| past 2 (k - 1) 2^-24 sum_j |w_j v_j| + one bf16 ulp at |want| (<= 0: within)."""
    k = ids.shape[1]
    terms = (w.unsqueeze(2) * _slot_rows(x, ids, w1, w2, backend)).abs().sum(1)
    ulp = want.float().abs().clamp(min=2.0 ** -126) * 2.0 ** -7  # 8-bit significand
    return float(((got.float() - want.float()).abs() - (2 * (k - 1) * 2.0 ** -24 * terms + ulp)).max())


def _rank_combine_exact_worker(rank, world):
    from dispatch.distributed import ep_moe_decode, ep_moe_prefill
    from dispatch.ops import moe_layer

    w1, w2, lw1, lw2 = _rank_experts(3, False, rank, world)
    x, ids, w = _tokens(torch.Generator().manual_seed(400 + rank), 12, False, skew=True)
    ids[0] = -1
    ids[1, 1] = E + 3
    got = ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=E, combine="rank", backend="triton")
    assert _ulps_apart(got, moe_layer(x, ids, w, w1, w2, backend="triton")) == 0, f"rank {rank}: top-2"
    dec = ep_moe_decode(x, ids, w, lw1, lw2, num_experts=E, capacity=12, combine="rank", backend="triton")
    assert dec.dropped.tolist() == [0, 0]
    assert _ulps_apart(dec.out, got) == 0, f"rank {rank}: decode != prefill (per-rank combine)"


def test_rank_combine_top2_is_exact():
    """combine="rank" at top-2: (0 + w0 v0) + w1 v1 in either order, so the single-rank bytes (on random values,
    no exact-sum grid needed); decode gives prefill's bytes."""
    _spawn(_rank_combine_exact_worker)


def _rank_combine_bound_worker(rank, world):
    from dispatch.distributed import ep_moe_prefill
    from dispatch.ops import moe_layer

    w1, w2, lw1, lw2 = _rank_experts(3, False, rank, world)
    k = 4
    x, ids, w = _tokens(torch.Generator().manual_seed(500 + rank), 16, False, skew=True, k=k)
    ids[1] = torch.arange(k) + rank * (E // world)  # only this rank's experts: the slot order itself
    ids[2, 0] = -1
    got = ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=E, combine="rank", backend="triton")
    want = moe_layer(x, ids, w, w1, w2, backend="triton")
    assert torch.equal(got[1].view(torch.int16), want[1].view(torch.int16)), f"rank {rank}: one rank's experts"
    excess = _within_reordered_sum_bound(got, want, x, ids, w, w1, w2)
    assert excess <= 0, f"rank {rank}: per-rank combine past its bound by {excess}"


@pytest.mark.slow  # 20 s on two CPU ranks; the GPU test checks the same bound at DeepSeek-V3 dims
def test_rank_combine_top4_within_reordered_sum_bound():
    """combine="rank" at top-4: the fp32 sum runs per rank, then over ranks: within 2 (k - 1) 2^-24 sum_j
    |w_j v_j| + one bf16 ulp of the single-rank layer (docs/ep.md); a token whose experts all sit on one rank keeps
    the exact bytes."""
    _spawn(_rank_combine_bound_worker)


def _fp8_worker(rank, world):
    from dispatch.distributed import ep_moe_prefill
    from dispatch.ops import fp8_group_dequantize, fp8_group_quantize, moe_layer

    w1, w2, lw1, lw2 = _rank_experts(1, False, rank, world)
    x, ids, w = _tokens(torch.Generator().manual_seed(200 + rank), 16, False, skew=True)
    got = ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=E, fp8_dispatch=True, backend="triton")
    # FP8 dispatch = the layer on the dequantized 1x128 codes (dequantized on arrival, then the same chain)
    q = fp8_group_quantize(x, 128, backend="torch")
    x8 = fp8_group_dequantize(q.codes, q.scales, 128, out_dtype=torch.bfloat16, backend="torch")
    assert _ulps_apart(got, moe_layer(x8, ids, w, w1, w2, backend="triton")) <= 1
    # against bf16 dispatch: E4M3's relative step 2^-3 at most on each element, ~2^-5 rms through two GEMMs
    exact = moe_layer(x, ids, w, w1, w2, backend="triton").float()
    err = float((got.float() - exact).norm() / exact.norm())
    assert err < 0.05, f"rank {rank}: FP8 dispatch normalized error {err:.3f}"


@pytest.mark.slow  # two more spawned ranks under the interpreter; FP8 1x128 quantization is tested on its own
def test_fp8_dispatch_equals_the_layer_on_dequantized_tokens():
    _spawn(_fp8_worker)


def _decode_worker(rank, world):
    from dispatch.distributed import ep_moe_decode, ep_moe_prefill

    w1, w2, lw1, lw2 = _rank_experts(2, True, rank, world)
    x, ids, w = _tokens(torch.Generator().manual_seed(300 + rank), 8, True, skew=True)
    ids[0] = -1
    want = ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=E, backend="triton")
    got = ep_moe_decode(x, ids, w, lw1, lw2, num_experts=E, capacity=8, backend="triton")
    assert torch.equal(got.out.view(torch.int16), want.view(torch.int16)), f"rank {rank}: decode != prefill"
    assert got.dropped.tolist() == [0, 0]

    # overflow: capacity 2 -> tokens past the second one bound for a rank are dropped there and counted
    cap = 2
    small = ep_moe_decode(x, ids, w, lw1, lw2, num_experts=E, capacity=cap, backend="triton")
    dest = torch.where(ids >= 0, ids // (E // world), -1)
    to_rank = torch.stack([(dest == r).any(1) for r in range(world)], 1)
    assert small.dropped.tolist() == (to_rank.sum(0) - cap).clamp(min=0).tolist()
    kept = to_rank & (to_rank.long().cumsum(0) <= cap)
    keep_ids = torch.where(kept.gather(1, dest.clamp(min=0)) & (dest >= 0), ids, -1)
    ref = ep_moe_prefill(x, keep_ids, w, lw1, lw2, num_experts=E, backend="triton")
    assert torch.equal(small.out.view(torch.int16), ref.view(torch.int16)), f"rank {rank}: overflow policy"


def test_decode_equals_prefill_and_drops_past_capacity():
    """Static-shape path: equal to prefill when nothing overflows; past the capacity, the dropped tokens' slots on
    that rank add nothing (= prefill with those slots removed) and `dropped` counts them per destination."""
    _spawn(_decode_worker)


class _Dispatched(Exception):
    """Raised by the send-buffer spy in place of the dispatch exchange: carries the layer's send buffer."""

    def __init__(self, send):
        super().__init__("dispatch send buffer captured")
        self.send = send


def _old_payload(hidden, topk_ids, dest, world, local_experts, fp8, weights):
    """The former construction, kept as the reference: (W, T, row_bytes), every token's message row once per rank
    (the hidden bytes expanded W times)."""
    from dispatch.ops import fp8_group_quantize

    if fp8:
        q = fp8_group_quantize(hidden, 128)
        body = torch.cat([q.codes.view(torch.uint8), q.scales.contiguous().view(torch.uint8)], dim=1)
    else:
        body = hidden.contiguous().view(torch.uint8)
    ranks = torch.arange(world).view(-1, 1, 1)
    local = torch.where(dest.unsqueeze(0) == ranks, topk_ids.long().unsqueeze(0) - ranks * local_experts + 1, 0)
    parts = [body.unsqueeze(0).expand(world, -1, -1), local.to(torch.int32).contiguous().view(torch.uint8)]
    if weights is not None:
        parts.append(weights.float().contiguous().view(torch.uint8).unsqueeze(0).expand(world, -1, -1))
    return torch.cat(parts, dim=2)


def _old_send(payload, dest, capacity=None):
    """The reference send rows: per destination rank in order, the rows of the tokens travelling there in token
    order; with a capacity, the first `capacity` of them padded with zero rows to `capacity`."""
    blocks = []
    for r in range(payload.shape[0]):
        rows = payload[r][(dest == r).any(1)]
        if capacity is not None:
            rows = torch.cat([rows[:capacity], rows.new_zeros(max(capacity - rows.shape[0], 0), rows.shape[1])])
        blocks.append(rows)
    return torch.cat(blocks)


def _send_buffer_worker(rank, world):
    import dispatch.distributed.ep_moe as ep

    def spy(recv, send, recv_splits, send_splits, group):
        if send.dtype == torch.uint8:  # the dispatch (the count exchange is int64): stop on every rank alike
            raise _Dispatched(send.clone())
        return real(recv, send, recv_splits, send_splits, group)

    def captured(fn, *args, **kw):
        try:
            fn(*args, **kw)
        except _Dispatched as d:
            return d.send
        raise AssertionError("the layer returned without a dispatch exchange")

    n = E // world
    w1, w2 = torch.zeros(n, 2 * I, H).bfloat16(), torch.zeros(n, H, I).bfloat16()  # never run: stopped first
    real, ep.exchange_rows = ep.exchange_rows, spy
    try:
        for tokens in ((12, 12), (0, 5)):
            x, ids, w = _tokens(torch.Generator().manual_seed(600 + rank), tokens[rank], False, skew=True)
            if ids.shape[0]:
                ids[0] = -1  # no expert anywhere
                ids[1, 1] = E + 3  # out of range
                ids[2] = torch.tensor([rank * n, rank * n + 1])  # no expert on the other rank
                ids[3] = torch.tensor([(1 - rank) * n + 1, (1 - rank) * n])  # none on this rank
            dest = torch.where((ids >= 0) & (ids < E), ids.long() // n, -1)
            for fp8 in (False, True):
                for combine in ("entry", "rank"):
                    payload = _old_payload(x, ids, dest, world, n, fp8, w if combine == "rank" else None)
                    kw = dict(num_experts=E, fp8_dispatch=fp8, combine=combine, backend="triton")
                    label = f"rank {rank} T={tokens[rank]} fp8={fp8} {combine}"
                    got = captured(ep.ep_moe_prefill, x, ids, w, w1, w2, **kw)
                    assert torch.equal(got, _old_send(payload, dest)), f"{label}: prefill"
                    for cap in (3, 12):  # 3: the skewed rank overflows; 12: padding rows
                        got = captured(ep.ep_moe_decode, x, ids, w, w1, w2, capacity=cap, **kw)
                        assert torch.equal(got, _old_send(payload, dest, cap)), f"{label}: decode capacity {cap}"
    finally:
        ep.exchange_rows = real


def test_send_buffer_bytes_equal_the_per_rank_payload_construction():
    """The dispatch send buffer, built from each token's one body row, has the bytes of the former construction
    (every token's row expanded per rank, then the sent rows picked): skewed routing, tokens with no expert on a
    rank or anywhere, an out-of-range id, a rank with zero tokens; bf16 / FP8 dispatch, entry / rank combine,
    prefill and decode (overflowing and padded capacities)."""
    _spawn(_send_buffer_worker)


def _bad_inputs_worker(rank, world):
    from dispatch.distributed import ep_moe_decode, ep_moe_prefill
    from triton_ops.contract.checks import LowbitInputError

    x, ids, w = torch.zeros(2, H).bfloat16(), torch.zeros(2, K, dtype=torch.int32), torch.ones(2, K)
    w1, w2 = torch.zeros(E // world, 2 * I, H).bfloat16(), torch.zeros(E // world, H, I).bfloat16()
    with pytest.raises(LowbitInputError, match="ep_moe_prefill: argument 'num_experts'"):
        ep_moe_prefill(x, ids, w, w1, w2, num_experts=7)
    with pytest.raises(LowbitInputError, match="ep_moe_prefill: argument 'w1'"):
        ep_moe_prefill(x, ids, w, w1[:1], w2, num_experts=E)
    with pytest.raises(LowbitInputError, match="ep_moe_prefill: argument 'topk_weights'"):
        ep_moe_prefill(x, ids, w[:, :1], w1, w2, num_experts=E)
    with pytest.raises(LowbitInputError, match="ep_moe_prefill: argument 'expert_map'"):
        ep_moe_prefill(x, ids, w, w1, w2, num_experts=E, expert_map=torch.zeros(E, dtype=torch.int32))
    with pytest.raises(LowbitInputError, match="ep_moe_decode: argument 'capacity'"):
        ep_moe_decode(x, ids, w, w1, w2, num_experts=E, capacity=0)
    with pytest.raises(LowbitInputError, match="ep_moe_prefill: argument 'combine'"):
        ep_moe_prefill(x, ids, w, w1, w2, num_experts=E, combine="token")


def test_bad_arguments_are_named():
    _spawn(_bad_inputs_worker)


# ------------------------------------------------------------------------------------------------ GPU (NCCL)

DSV3 = dict(h=7168, i=2048, e=256, k=8)


def _gpu_worker(rank, world, tokens):
    from dispatch.distributed import ep_moe_decode, ep_moe_prefill
    from dispatch.ops import moe_layer

    dev = torch.device("cuda", rank)
    e, h, i = DSV3["e"], DSV3["h"], DSV3["i"]
    g = torch.Generator(device=dev).manual_seed(7)  # the same experts on every rank, drawn on the device
    w1 = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
    w2 = torch.empty(e, h, i, dtype=torch.bfloat16, device=dev)
    for n in range(e):
        w1[n] = torch.randn(2 * i, h, generator=g, device=dev) / h ** 0.5
        w2[n] = torch.randn(h, i, generator=g, device=dev) / i ** 0.5
    lw1, lw2 = _local(w1, rank, world), _local(w2, rank, world)
    x, ids, w = _tokens(torch.Generator().manual_seed(rank), tokens, False, skew=True, h=DSV3["h"], e=DSV3["e"],
                        k=DSV3["k"])
    x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
    want = moe_layer(x, ids, w, w1, w2)
    got = ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=DSV3["e"])
    assert _ulps_apart(got, want) <= 1, f"rank {rank} T={tokens}: prefill"
    dec = ep_moe_decode(x, ids, w, lw1, lw2, num_experts=DSV3["e"], capacity=tokens)
    assert dec.dropped.tolist() == [0, 0]
    assert _ulps_apart(dec.out, got) <= 1, f"rank {rank} T={tokens}: decode"
    got = ep_moe_prefill(x, ids, w, lw1, lw2, num_experts=DSV3["e"], combine="rank")
    excess = _within_reordered_sum_bound(got, want, x, ids, w, w1, w2, backend="auto")
    assert excess <= 0, f"rank {rank} T={tokens}: per-rank combine past its bound by {excess}"
    dec = ep_moe_decode(x, ids, w, lw1, lw2, num_experts=DSV3["e"], capacity=tokens, combine="rank")
    assert _ulps_apart(dec.out, got) <= 1, f"rank {rank} T={tokens}: decode, per-rank combine"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_gpu_two_ranks_deepseek_v3_dims(tokens):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for two NCCL ranks, found {torch.cuda.device_count()}")
    _spawn(_gpu_worker, tokens)
