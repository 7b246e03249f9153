"""Online softmax in the exp2 domain, with sinks and FA4's conditional rescale (CuTeDSL + a torch twin).

State per query row: m (running max, in log2 units: x = logit * log2(e) = s * scale_log2 with s = q.k and
scale_log2 = softmax_scale * log2(e)) and l (running sum of exp2(x - m)). Per key tile:

    m_cand  = max(m, max_j x_j)
    m_safe  = 0 if m_cand == -inf else m_cand          (a row that saw nothing yet: exp2(-inf - 0) = 0, no NaN)
    a       = exp2(m - m_safe)                          (the factor O and l are rescaled by)
    if m - m_safe >= -RESCALE_THRESHOLD:               (the max grew by at most RESCALE_THRESHOLD (log2 units))
        m_cand = m_safe = m;  a = 1                     (keep the old max: no rescale of O; P <= 2^threshold)
    p_j     = exp2(x_j - m_safe);   l = l * a + sum_j p_j;   m = m_cand

O is rescaled by `a` only when some row of a warp has a != 1 (the correction warps vote), which with FA4's threshold
of 8.0 happens a few times per row instead of on every tile. Exactness: p and l are both relative to the
same m, so out = O / l and lse = (m + log2 l) * ln 2 are unchanged by the choice of m; P values up to 2^8 are
well inside bf16/fp16 (and the fp32 accumulators).

Sinks (a per-head logit `sink`, not scaled by softmax_scale, in the denominator only): start with
m = sink * log2(e) and l = 1 (the sink's exp2(m - m)), instead of m = -inf, l = 0. Finalize:
out = O / l (O = 0 and l = 0 for a row with no key and no sink: out 0), lse = (m + log2 l) * ln 2
(-inf when l = 0; the sink's logit for a row that saw only the sink).
"""

from __future__ import annotations

import math

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
RESCALE_THRESHOLD = 8.0  # log2 units, FA4's value: rescale O only when the max grew by more than 2^8

try:
    import cutlass
except ImportError:  # pragma: no cover - exercised only without nvidia-cutlass-dsl
    cutlass = None


# ------------------------------------------------------------------------------------------- host twin


class OnlineSoftmaxModel:
    """The kernel's per-row algorithm on torch fp32 tensors (rows = query rows of a tile), for CPU tests.

    `step` takes raw scores s (q.k, -inf where masked) for one key tile and returns (p, a): the probabilities
    relative to the current max and the rescale factor of everything accumulated before."""

    def __init__(self, rows: int, scale_log2: float, sink: float | None = None):
        import torch

        self.scale_log2 = scale_log2
        if sink is None:
            self.m = torch.full((rows,), -math.inf, dtype=torch.float32)
            self.l = torch.zeros(rows, dtype=torch.float32)
        else:
            self.m = torch.full((rows,), sink * LOG2E, dtype=torch.float32)
            self.l = torch.ones(rows, dtype=torch.float32)
        self.rescales = 0  # rows x tiles where a != 1 (what the correction warps would do)

    def step(self, s):
        import torch

        x = s.float() * self.scale_log2
        m_cand = torch.maximum(self.m, x.amax(dim=1)) if x.shape[1] else self.m.clone()
        m_safe = torch.where(m_cand == -math.inf, torch.zeros_like(m_cand), m_cand)
        delta = self.m - m_safe
        keep = delta >= -RESCALE_THRESHOLD
        m_cand = torch.where(keep, self.m, m_cand)
        m_safe = torch.where(keep, self.m, m_safe)
        a = torch.where(keep, torch.ones_like(delta), torch.exp2(delta))
        p = torch.exp2(x - m_safe.unsqueeze(1))
        self.l = self.l * a + p.sum(dim=1)
        self.m = m_cand
        self.rescales += int((a != 1).sum())
        return p, a

    def finalize(self):
        """(inv_l, lse): out = O * inv_l (0 where l = 0), lse natural log (-inf where l = 0)."""
        import torch

        seen = self.l > 0
        inv = torch.where(seen, 1.0 / torch.where(seen, self.l, torch.ones_like(self.l)), torch.zeros_like(self.l))
        lse = torch.where(seen, (self.m + torch.log2(torch.where(seen, self.l, torch.ones_like(self.l)))) * LN2,
                          torch.full_like(self.l, -math.inf))
        return inv, lse


# ------------------------------------------------------------------------------------------ device side


if cutlass is not None:
    import cutlass.cute as cute
    from cutlass import Float32

    @cute.jit
    def init_stats(sink_log2: Float32 | None):
        """(m, l) at the start of a row: (-inf, 0), or (sink * log2 e, 1) with a sink."""
        m = -Float32.inf
        l = Float32(0.0)
        if cutlass.const_expr(sink_log2 is not None):
            m = sink_log2
            l = Float32(1.0)
        return m, l

    def _fmax(a, b, portable: bool):
        # FMNMX through nvvm.fmax on the GPU; arith max (which also lowers on the host CPU) when portable
        return cutlass.max(a, b) if portable else cute.arch.fmax(a, b)

    @cute.jit
    def tile_max(scores: cute.Tensor, portable: cutlass.Constexpr[bool] = False) -> Float32:
        """Max of a thread's scores (one row), two independent chains for ILP.

        `portable` (here and below): use only operations that also lower for the host CPU -- arith max instead of
        nvvm.fmax, scalar FFMA/FADD instead of the f32x2 forms, a division instead of rcp.approx -- so the CPU
        tests can run these helpers on the host. The kernel uses the default, GPU forms."""
        n = cute.size(scores)
        m0 = scores[0]
        m1 = scores[1]
        for i in cutlass.range_constexpr(2, n, 2):
            m0 = _fmax(m0, scores[i], portable)
            m1 = _fmax(m1, scores[i + 1], portable)
        return _fmax(m0, m1, portable)

    @cute.jit
    def update_max(m_old: Float32, raw_tile_max: Float32, scale_log2: Float32,
                   portable: cutlass.Constexpr[bool] = False):
        """(m_new, m_safe, a) for one row and one tile (see the module docstring)."""
        m_new = _fmax(m_old, raw_tile_max * scale_log2, portable)
        m_safe = m_new
        if m_new == -Float32.inf:
            m_safe = Float32(0.0)
        delta = m_old - m_safe
        a = cute.math.exp2(delta, fastmath=True)
        if delta >= -RESCALE_THRESHOLD:
            m_new = m_old
            m_safe = m_old
            a = Float32(1.0)
        return m_new, m_safe, a

    @cute.jit
    def exp2_convert(scores: cute.Tensor, probs: cute.Tensor, scale_log2: Float32, m_safe: Float32,
                     chunk: cutlass.Constexpr[int] = 32, portable: cutlass.Constexpr[bool] = False,
                     f32x2: cutlass.Constexpr[bool] = True) -> Float32:
        """probs[i] = exp2(scores[i] * scale_log2 - m_safe) rounded to probs' 16-bit type; returns the fp32 row
        sum. Both tensors are compact and in the same order (element i = key column i). Works `chunk` values
        at a time (FFMA2, MUFU.EX2, F2FP pack), so at most one chunk of fp32 results is live next to the scores
        still to do and the packed output: without it the 128 fp32 values and the 64 packed registers are live
        together and the softmax warps spill. `f32x2=False`: scalar FFMA/FADD (sm_90 has no packed f32x2 ops)."""
        n = cute.size(scores)
        neg_m = -m_safe
        acc0 = Float32(0.0)
        acc1 = Float32(0.0)
        for k in cutlass.range_constexpr(n // chunk):
            s_k = cute.make_tensor(scores.iterator + k * chunk, cute.make_layout(chunk))
            p_k = cute.make_tensor(probs.iterator + k * chunk, cute.make_layout(chunk))
            for i in cutlass.range_constexpr(0, chunk, 2):
                if cutlass.const_expr(portable or not f32x2):
                    x0 = s_k[i] * scale_log2 + neg_m
                    x1 = s_k[i + 1] * scale_log2 + neg_m
                else:
                    x0, x1 = cute.arch.fma_packed_f32x2((s_k[i], s_k[i + 1]), (scale_log2, scale_log2),
                                                        (neg_m, neg_m))
                s_k[i] = cute.math.exp2(x0, fastmath=True)
                s_k[i + 1] = cute.math.exp2(x1, fastmath=True)
                if cutlass.const_expr(portable or not f32x2):
                    acc0 = acc0 + s_k[i]
                    acc1 = acc1 + s_k[i + 1]
                else:
                    acc0, acc1 = cute.arch.add_packed_f32x2((acc0, acc1), (s_k[i], s_k[i + 1]))
            p_k.store(s_k.load().to(probs.element_type))
        return acc0 + acc1

    @cute.jit
    def finalize(m: Float32, l: Float32, portable: cutlass.Constexpr[bool] = False):
        """(inv_l, lse) with lse in natural log: out = O * inv_l; l = 0 (no key, no sink) gives 0 and -inf."""
        inv = Float32(0.0)
        lse = -Float32.inf
        if l > Float32(0.0):
            if cutlass.const_expr(portable):
                inv = Float32(1.0) / l
            else:
                inv = cute.arch.rcp_approx(l)
            lse = (m + cute.math.log2(l, fastmath=True)) * LN2
        return inv, lse
