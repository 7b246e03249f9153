"""MoE routing plumbing ops: router, hash router, align (contiguous / masked), gather, combine.

Every output shape depends on input shapes and integer arguments only (never on routing data), so each op
is CUDA-graph capturable and traces under torch.compile; data-dependent sizes (per-expert counts, padded
total) come back as device tensors. Contract: dispatch/reference/moe.py; layouts: docs/moe.md.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from triton_ops.contract import checks as C
from triton_ops.contract.formats import contiguous_capacity

from ..reference.moe import SCORINGS
from ._common import call, lowbit_op
from ._fake import is_fake
from .rope import debug_checks, host_values

Scoring = Literal["softmax", "sigmoid", "sqrt_softplus"]
ID_DTYPES = (torch.int32, torch.int64)
I32 = torch.int32


# ---------------------------------------------------------------------------------------------- checks


def _check_logits(op, logits):
    C.check_dtype(op, "logits", logits, C.FLOAT_INPUTS)
    if logits.dim() != 2:
        C.fail(op, "logits", f"expected [T, E], got shape {tuple(logits.shape)}")


def _check_scoring(op, scoring, routed_scaling):
    if scoring not in SCORINGS:
        C.fail(op, "scoring", f"{scoring!r} is not one of {', '.join(SCORINGS)}")
    if not isinstance(routed_scaling, float) or routed_scaling != routed_scaling:
        C.fail(op, "routed_scaling", f"expected a finite float, got {routed_scaling!r}")


def _check_route(logits, bias, top_k, scoring, renormalize, routed_scaling, num_groups, topk_groups):
    op = "moe_route"
    C.check_tensor(op, "logits", logits)
    C.check_tensor(op, "bias", bias, optional=True)
    C.check_no_grad(op, logits=logits, bias=bias)
    _check_logits(op, logits)
    _check_scoring(op, scoring, routed_scaling)
    e = logits.shape[1]
    if not 1 <= top_k <= e:
        C.fail(op, "top_k", f"must be in [1, E={e}], got {top_k}")
    if bias is not None:
        C.check_dtype(op, "bias", bias, C.FLOAT_INPUTS)
        C.check_same_device(op, "logits", logits, "bias", bias)
        if tuple(bias.shape) != (e,):
            C.fail(op, "bias", f"expected shape ({e},), got {tuple(bias.shape)}")
    if num_groups < 1 or e % num_groups:
        C.fail(op, "num_groups", f"must be >= 1 and divide E={e}, got {num_groups}")
    if num_groups > 1:
        if not 1 <= topk_groups <= num_groups:
            C.fail(op, "topk_groups", f"must be in [1, num_groups={num_groups}], got {topk_groups}")
        if top_k > topk_groups * (e // num_groups):
            C.fail(op, "top_k", f"{top_k} > topk_groups * group size = {topk_groups * (e // num_groups)}")
        if bias is not None and e // num_groups < 2:
            C.fail(op, "num_groups", "groups scored by their top-2 (bias given) need at least 2 experts each")


def _check_hash_route(logits, token_ids, table, scoring, renormalize, routed_scaling):
    """Also range-checks token ids and table entries where that needs no device sync (host tensors) or
    LOWBIT_CHECK_INDICES=1 asks for it; never fake ones (the fake impl runs the same checks)."""
    op = "moe_hash_route"
    C.check_tensor(op, "logits", logits)
    C.check_tensor(op, "token_ids", token_ids)
    C.check_tensor(op, "table", table)
    C.check_no_grad(op, logits=logits)
    _check_logits(op, logits)
    _check_scoring(op, scoring, routed_scaling)
    C.check_dtype(op, "token_ids", token_ids, ID_DTYPES)
    C.check_dtype(op, "table", table, ID_DTYPES)
    C.check_same_device(op, "logits", logits, "token_ids", token_ids)
    C.check_same_device(op, "logits", logits, "table", table)
    if tuple(token_ids.shape) != (logits.shape[0],):
        C.fail(op, "token_ids", f"expected shape ({logits.shape[0]},), got {tuple(token_ids.shape)}")
    if table.dim() != 2 or table.shape[1] < 1:
        C.fail(op, "table", f"expected [vocab, k] with k >= 1, got shape {tuple(table.shape)}")
    if not (is_fake(token_ids) or is_fake(table)) and (token_ids.device.type == "cpu" or debug_checks()):
        C.check_index_range(op, "token_ids", token_ids, 0, table.shape[0], "rows of table")
        C.check_index_range(op, "table", table, 0, logits.shape[1], "expert ids, E = logits.shape[1]")


def _check_ids(op, topk_ids, expert_map, num_experts):
    C.check_tensor(op, "topk_ids", topk_ids)
    C.check_tensor(op, "expert_map", expert_map, optional=True)
    C.check_dtype(op, "topk_ids", topk_ids, ID_DTYPES)
    if topk_ids.dim() != 2:
        C.fail(op, "topk_ids", f"expected [T, k], got shape {tuple(topk_ids.shape)}")
    if num_experts < 1:
        C.fail(op, "num_experts", f"must be >= 1, got {num_experts}")
    if expert_map is not None:
        C.check_dtype(op, "expert_map", expert_map, ID_DTYPES)
        C.check_same_device(op, "topk_ids", topk_ids, "expert_map", expert_map)
        if expert_map.dim() != 1:
            C.fail(op, "expert_map", f"expected [E_global], got shape {tuple(expert_map.shape)}")


def _check_align(topk_ids, expert_map, num_experts, block_m):
    _check_ids("moe_align", topk_ids, expert_map, num_experts)
    if block_m < 1:
        C.fail("moe_align", "block_m", f"must be >= 1, got {block_m}")


def _check_masked(topk_ids, expert_map, num_experts, max_m):
    _check_ids("moe_masked_layout", topk_ids, expert_map, num_experts)
    if max_m < 1:
        C.fail("moe_masked_layout", "max_m", f"must be >= 1, got {max_m}")


def _check_gather(x, src_rows, top_k, op="moe_gather"):
    C.check_tensor(op, "x", x)
    C.check_tensor(op, "src_rows", src_rows)
    C.check_no_grad(op, x=x)
    if x.dim() != 2:
        C.fail(op, "x", f"expected [T, K], got shape {tuple(x.shape)}")
    C.check_dtype(op, "src_rows", src_rows, (torch.int32,))
    C.check_same_device(op, "x", x, "src_rows", src_rows)
    if top_k < 1:
        C.fail(op, "top_k", f"must be >= 1, got {top_k}")


def _check_combine(expert_out, inv_rows, weights, shared, out_dtype):
    op = "moe_combine"
    C.check_tensor(op, "expert_out", expert_out)
    C.check_tensor(op, "inv_rows", inv_rows)
    C.check_tensor(op, "weights", weights)
    C.check_tensor(op, "shared", shared, optional=True)
    C.check_no_grad(op, expert_out=expert_out, weights=weights, shared=shared)
    C.check_dtype(op, "expert_out", expert_out, C.FLOAT_INPUTS)
    C.check_min_dims(op, "expert_out", expert_out, 2)
    C.check_dtype(op, "inv_rows", inv_rows, (torch.int32,))
    if inv_rows.dim() != 2:
        C.fail(op, "inv_rows", f"expected [T, k], got shape {tuple(inv_rows.shape)}")
    C.check_dtype(op, "weights", weights, C.FLOAT_INPUTS)
    if weights.shape != inv_rows.shape:
        C.fail(op, "weights", f"shape {tuple(weights.shape)} != inv_rows shape {tuple(inv_rows.shape)}")
    for name, t in (("inv_rows", inv_rows), ("weights", weights)):
        C.check_same_device(op, "expert_out", expert_out, name, t)
    n = expert_out.shape[-1]
    if shared is not None:
        C.check_dtype(op, "shared", shared, C.FLOAT_INPUTS)
        C.check_same_device(op, "expert_out", expert_out, "shared", shared)
        if tuple(shared.shape) != (inv_rows.shape[0], n):
            C.fail(op, "shared", f"expected shape ({inv_rows.shape[0]}, {n}), got {tuple(shared.shape)}")
    if out_dtype not in C.FLOAT_INPUTS:
        C.fail(op, "out_dtype", f"{out_dtype} is not one of bfloat16, float16, float32")
    # out-of-range rows are masked (defined); the debug env flags them (fake tensors have no values to check)
    if debug_checks() and not is_fake(inv_rows):
        rows = expert_out.numel() // n if n else 0
        C.check_index_range(op, "inv_rows", inv_rows, -1, rows, f"-1 or a row of expert_out read flat as [{rows}, "
                                                                 f"{n}] (LOWBIT_CHECK_INDICES=1 check)")


# ---------------------------------------------------------------------------------------------- router


@lowbit_op("moe_route", mutates_args=(), check=_check_route)
def _moe_route(logits: Tensor, bias: Tensor | None, top_k: int, scoring: str, renormalize: bool,
               routed_scaling: float, num_groups: int, topk_groups: int, backend: str) -> tuple[Tensor, Tensor]:
    t = logits.shape[0]
    return logits.new_empty(t, top_k, dtype=I32), logits.new_empty(t, top_k, dtype=torch.float32)


@lowbit_op("moe_hash_route", mutates_args=(), check=_check_hash_route)
def _moe_hash_route(logits: Tensor, token_ids: Tensor, table: Tensor, scoring: str, renormalize: bool,
                    routed_scaling: float, backend: str) -> tuple[Tensor, Tensor]:
    t, k = logits.shape[0], table.shape[1]
    return logits.new_empty(t, k, dtype=I32), logits.new_empty(t, k, dtype=torch.float32)


class Routing(NamedTuple):
    topk_ids: Tensor  # int32 [T, k], descending selection key, ties -> lowest expert index
    topk_weights: Tensor  # fp32 [T, k], unbiased scores (renormalized) * routed_scaling


def moe_route(logits: Tensor, top_k: int, *, scoring: Scoring = "softmax", bias: Tensor | None = None,
              renormalize: bool = False, routed_scaling: float = 1.0, num_groups: int = 1, topk_groups: int = 1,
              backend: str = "auto") -> Routing:
    """Top-k expert selection from router logits [T, E] (fp32 math). See dispatch/reference/moe.py.

    Presets: GPT-OSS softmax+renormalize (= softmax over the top-k logits); DeepSeek-V3 sigmoid + bias +
    groups 8/4 + renormalize + routed_scaling 2.5; DeepSeek-V4 sqrt_softplus + bias + renormalize.
    Inference only: with grad mode on, inputs that require grad are refused (LowbitInputError).
    """
    return Routing(*call("moe_route", logits, bias, top_k, scoring, renormalize, float(routed_scaling),
                                               num_groups, topk_groups, backend))


def moe_hash_route(logits: Tensor, token_ids: Tensor, table: Tensor, *, scoring: Scoring = "sqrt_softplus",
                   renormalize: bool = True, routed_scaling: float = 1.0, backend: str = "auto") -> Routing:
    """Hash routing: ids = table[token_ids] (int [vocab, k]); weights = scores of those experts (renormalized
    over the token's k slots, then times routed_scaling).

    Out-of-range values (token id outside [0, vocab), table entry outside [0, E), E = logits.shape[1]) are
    masked, never read past: every slot of such a token, and each such table slot, gets expert id -1 and
    weight 0, and is left out of the renormalizing sum (a token with no valid slot gets all-zero weights).
    Checking them would need a device sync, so on the GPU the masking is the behaviour; host (CPU) tensors,
    and any tensors under LOWBIT_CHECK_INDICES=1, are checked instead: LowbitInputError naming the argument.
    Inference only: with grad mode on, logits that require grad are refused."""
    if host_values(logits, token_ids, table):  # free to check on the host: on every call, not only checked ones
        _check_hash_route(logits, token_ids, table, scoring, renormalize, routed_scaling)
    return Routing(*call("moe_hash_route", logits, token_ids, table, scoring, renormalize,
                                                    float(routed_scaling), backend))


# ---------------------------------------------------------------------------------------------- align


@lowbit_op("moe_align", mutates_args=(), check=_check_align)
def _moe_align(topk_ids: Tensor, expert_map: Tensor | None, num_experts: int, block_m: int,
               backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    t, k = topk_ids.shape
    cap = contiguous_capacity(t * k, num_experts, block_m)
    new = lambda *s: topk_ids.new_empty(*s, dtype=I32)  # noqa: E731
    return new(cap), new(cap // block_m), new(cap), new(1), new(num_experts + 1), new(num_experts), new(t, k)


class ContiguousLayout(NamedTuple):
    sorted_token_ids: Tensor  # int32 [P]: entry t*k+j per row, sentinel T*k on padding (vLLM)
    expert_ids: Tensor  # int32 [P/block_m]: expert of each M block, -1 past the padded total (vLLM)
    m_indices: Tensor  # int32 [P]: expert of each row, -1 on padding rows (DeepGEMM m-grouped contiguous)
    num_tokens_post_padded: Tensor  # int32 [1]: padded total (rows beyond are padding)
    expert_offsets: Tensor  # int32 [E+1]: padded start row of each expert; [E] = padded total
    expert_counts: Tensor  # int32 [E]: real rows per expert
    inv_rows: Tensor  # int32 [T, k]: row of entry (t, j), -1 when its expert is not local


def moe_align(topk_ids: Tensor, num_experts: int, block_m: int, *, expert_map: Tensor | None = None,
              backend: str = "auto") -> ContiguousLayout:
    """Contiguous grouped-GEMM layout: rows sorted by (expert, token, slot), each expert padded to block_m.
    P = round_up(T*k + min(E, T*k) * (block_m - 1), block_m) (static). expert_map: [E_global] global ->
    local id, -1 = not on this rank; num_experts is the local count. See docs/moe.md.
    topk_ids and expert_map may be int32 or int64 (compared at full width: no truncation); an id (or mapped
    id) outside [0, num_experts) has no local expert: its entry gets no row and inv_rows -1."""
    return ContiguousLayout(*call("moe_align", topk_ids, expert_map, num_experts, block_m, backend))


@lowbit_op("moe_masked_layout", mutates_args=(), check=_check_masked)
def _moe_masked_layout(topk_ids: Tensor, expert_map: Tensor | None, num_experts: int, max_m: int,
                       backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    new = lambda *s: topk_ids.new_empty(*s, dtype=I32)  # noqa: E731
    return new(num_experts, max_m), new(num_experts), new(num_experts), new(*topk_ids.shape)


class MaskedLayout(NamedTuple):
    src_rows: Tensor  # int32 [E, max_m]: entry t*k+j per row, sentinel T*k past masked_m[e]
    masked_m: Tensor  # int32 [E]: rows used per expert, min(count, max_m) (DeepGEMM masked_m)
    expert_counts: Tensor  # int32 [E]: true counts; > masked_m means entries were dropped
    inv_rows: Tensor  # int32 [T, k]: flat row e*max_m + i of entry (t, j), -1 if not local or dropped


def moe_masked_layout(topk_ids: Tensor, num_experts: int, max_m: int, *, expert_map: Tensor | None = None,
                      backend: str = "auto") -> MaskedLayout:
    """Masked grouped-GEMM layout [E, max_m, K] (decode, CUDA graphs). See docs/moe.md. Ids as in
    moe_align (int32 or int64; out of range -> no row, inv_rows -1)."""
    return MaskedLayout(*call("moe_masked_layout", topk_ids, expert_map, num_experts, max_m, backend))


# ------------------------------------------------------------------------------------------ gather/combine


@lowbit_op("moe_gather", mutates_args=(), check=_check_gather)
def _moe_gather(x: Tensor, src_rows: Tensor, top_k: int, backend: str) -> Tensor:
    return x.new_empty(*src_rows.shape, x.shape[1])


def moe_gather(x: Tensor, src_rows: Tensor, top_k: int, *, backend: str = "auto") -> Tensor:
    """out[r] = x[src_rows[r] // top_k] (any dtype, bytes copied), zero rows where src_rows[r] is not in
    [0, T*top_k). Pass sorted_token_ids (contiguous) or src_rows (masked; out is [E, max_m, K]).
    Inference only: with grad mode on, an x that requires grad is refused (LowbitInputError)."""
    return call("moe_gather", x, src_rows, top_k, backend)


class GatheredFP8(NamedTuple):
    codes: Tensor  # float8_e4m3fn [*src_rows.shape, K]; zero on padding rows
    scales: Tensor  # fp32 [*src_rows.shape, K/group_size]; zero on padding rows


def moe_gather_fp8(x: Tensor, src_rows: Tensor, top_k: int, group_size: int = 128, *, ue8m0: bool = False,
                   backend: str = "auto") -> GatheredFP8:
    """Gather + FP8 per-token-group quantize. Quantization is row-local, so this quantizes the T token rows
    once (lowbit.fp8_group_quantize) and gathers codes and scales: the same bytes as quantizing the gathered
    rows, with k times less quantize work. Scales are row-major (transpose for DeepGEMM's MN-major)."""
    from .quant import fp8_group_quantize
    _check_gather(x, src_rows, top_k, op="moe_gather_fp8")  # errors name this op, not the ones it calls
    q = fp8_group_quantize(x, group_size, ue8m0=ue8m0, backend=backend)
    return GatheredFP8(moe_gather(q.codes, src_rows, top_k, backend=backend),
                       moe_gather(q.scales, src_rows, top_k, backend=backend))


@lowbit_op("moe_combine", mutates_args=(), check=_check_combine)
def _moe_combine(expert_out: Tensor, inv_rows: Tensor, weights: Tensor, shared: Tensor | None,
                 out_dtype: torch.dtype, backend: str) -> Tensor:
    return expert_out.new_empty(inv_rows.shape[0], expert_out.shape[-1], dtype=out_dtype)


def moe_combine(expert_out: Tensor, inv_rows: Tensor, weights: Tensor, *, shared: Tensor | None = None,
                out_dtype: torch.dtype | None = None, backend: str = "auto") -> Tensor:
    """y[t] = sum_j weights[t,j] * expert_out[inv_rows[t,j]] (+ shared[t]); fp32, slot order, no atomics.
    expert_out: [P, N] (contiguous layout) or [E, max_m, N] (masked), read flat as R = P or E * max_m rows.
    out_dtype defaults to expert_out's.

    A slot whose row is outside [0, R) contributes nothing (masked: never read, its weight is not used): -1 is
    the layouts' "no local expert / dropped" marker, and any other out-of-range value is treated the same way
    on every backend (R = 0, an empty expert_out, gives y = shared or zeros). LOWBIT_CHECK_INDICES=1 raises
    for values outside [-1, R) instead (a host sync). Inference only: with grad mode on, inputs that require
    grad are refused."""
    C.check_tensor("moe_combine", "expert_out", expert_out)  # read below (out_dtype), before the op's checks
    return call("moe_combine", expert_out, inv_rows, weights, shared,
                                        out_dtype or expert_out.dtype, backend)


# ------------------------------------------------------------------------------------------ self-check


def self_check_cases() -> list:
    from ..reference import moe as ref
    from ..selfcheck import Case, exact

    def _g(seed=0):
        return torch.Generator(device="cpu").manual_seed(seed)

    def route_args(scoring, bias, groups):
        def make(dev, small):
            t = 8 if small else 64
            x = torch.randn(t, 256, generator=_g())
            b = torch.randn(256, generator=_g(1)) if bias else None
            return (x.to(dev), None if b is None else b.to(dev), 8, scoring, True, 2.5, groups, min(groups, 4))
        return make

    def close_weights(out, want):
        ok_ids, msg = exact(out[0], want[0])
        if not ok_ids:
            return False, "ids: " + msg
        err = float((out[1] - want[1]).abs().max()) if out[1].numel() else 0.0
        return err <= 1e-5 * max(1.0, float(want[1].abs().max())), f"ids exact, w err {err:.1e}"

    def hash_args(dev, small):
        t = 8 if small else 64
        table = torch.randint(0, 256, (1024, 8), generator=_g(), dtype=torch.int32)
        tok = torch.randint(0, 1024, (t,), generator=_g(1))
        return (torch.randn(t, 256, generator=_g(2)).to(dev), tok.to(dev), table.to(dev), "sqrt_softplus",
                True, 1.0)

    def ids(dev, small, t=None):
        t = t or (4 if small else 64)
        return torch.randint(0, 256, (t, 8), generator=_g(), dtype=torch.int32).to(dev)

    def align(dev, small):
        return (ids(dev, small), None, 256, 128)

    def align_ep(dev, small):
        emap = torch.full((256,), -1, dtype=torch.int32)
        emap[64:128] = torch.arange(64, dtype=torch.int32)
        return (ids(dev, small), emap.to(dev), 64, 64)

    def masked(dev, small):
        return (ids(dev, small), None, 256, 8)

    def gather(dev, small):
        i = ids(dev, small)
        lay = ref.moe_align(i.cpu(), None, 256, 16)
        x = torch.randn(i.shape[0], 256 if small else 7168, generator=_g()).to(torch.bfloat16)
        return (x.to(dev), lay[0].to(dev), 8)

    def combine(dev, small):
        i = ids(dev, small)
        lay = ref.moe_masked_layout(i.cpu(), None, 256, 8)
        n = 256 if small else 7168
        eo = torch.randn(256, 8, n, generator=_g()).to(torch.bfloat16)
        w = torch.rand(i.shape, generator=_g(1))
        return (eo.to(dev), lay[3].to(dev), w.to(dev), None, torch.bfloat16)

    def close_bf16(out, want):
        err = float((out.float() - want.float()).abs().max()) if out.numel() else 0.0
        return err <= 2 ** -7 * max(1.0, float(want.float().abs().max())), f"max err {err:.1e}"

    return [
        Case("moe_route", route_args("softmax", False, 1), close_weights, "softmax renorm (GPT-OSS)"),
        Case("moe_route", route_args("sigmoid", True, 8), close_weights, "sigmoid bias groups 8/4 (DSv3)"),
        Case("moe_route", route_args("sqrt_softplus", True, 1), close_weights, "sqrt_softplus bias (DSv4)"),
        Case("moe_hash_route", hash_args, close_weights, "sqrt_softplus hash table"),
        Case("moe_align", align, label="E=256 block_m=128"),
        Case("moe_align", align_ep, label="EP map 64 of 256, block_m=64"),
        Case("moe_masked_layout", masked, label="E=256 max_m=8"),
        Case("moe_gather", gather, label="bf16 contiguous rows"),
        Case("moe_combine", combine, close_bf16, "masked layout bf16"),
    ]
