"""Peer implementations that op-family cases put beside lowbit (BenchCase.peers).

Each helper returns a callable, or None when the peer package is not installed, so a case writes

    peers = perf.peers.available(liger=perf.peers.liger_rms_norm())

and a missing package just omits the peer (the runner logs which peers it skipped and why, see
`unavailable_reasons()`). Liger's wheel is pure Python (Triton kernels), so the GPU machine gets it carried
as a wheel; on a CPU machine its kernels cannot run and the runner does not time peers there anyway.

Liger's functions are autograd Functions built for training; under `torch.no_grad()` (the runner times
with grad disabled) they run their forward kernel only. Peers are *not* verified against the reference by
the runner: their contracts differ in detail (Liger RoPE rotates the leading `rotary_dim` features in place,
DeepSeek puts RoPE in the trailing 64). A case that wants a peer checked can wrap the callable itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_REASONS: dict[str, str] = {}


def _import(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except Exception as exc:  # an optional peer: remember why, the runner prints it
        _REASONS[module] = f"{type(exc).__name__}: {exc}"
        return None


def unavailable_reasons() -> dict[str, str]:
    """module -> why it could not be imported (for the run log and the results' metadata)."""
    return dict(_REASONS)


def available(**peers: Callable | None) -> dict[str, Callable]:
    """Drop the peers whose package is missing: `available(liger=liger_rms_norm(), x=None)` -> {'liger': fn}."""
    return {name: fn for name, fn in peers.items() if fn is not None}


def liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------- Liger


def liger_rms_norm(offset: float = 0.0, casting_mode: str = "llama") -> Callable | None:
    """fn(x, weight, eps) -> y (same shape/dtype as x; x is [..., N], weight [N]). Liger's 'llama' casting
    computes the inverse RMS in fp32 and multiplies in the input dtype; 'gemma' does everything in fp32."""
    mod = _import("liger_kernel.ops.rms_norm")
    if mod is None:
        return None
    fn = mod.LigerRMSNormFunction.apply

    def liger_rms_norm_fn(x, weight, eps):
        return fn(x, weight, eps, offset, casting_mode, False)

    return liger_rms_norm_fn


def liger_silu_mul() -> Callable | None:
    """fn(gate, up) -> silu(gate) * up, in the input dtype (Liger's SwiGLU: no clamp, no alpha)."""
    mod = _import("liger_kernel.ops.swiglu")
    if mod is None:
        return None
    fn = mod.LigerSiLUMulFunction.apply

    def liger_silu_mul_fn(gate, up):
        return fn(gate, up)

    return liger_silu_mul_fn


def liger_rope() -> Callable | None:
    """fn(q, k, cos, sin, rotary_dim=None) -> (q, k), rotated IN PLACE (NeoX / rotate-half style).

    q: [T, Hq, D], k: [T, Hk, D], token-major and contiguous (the usual projection output layout);
    cos/sin: [T, R] with R = rotary_dim (HF duplicated halves) or R = rotary_dim / 2 (pass rotary_dim).
    Liger rotates features [0, rotary_dim) of each head; the rest are left as they are.
    """
    mod = _import("liger_kernel.ops.rope")
    if mod is None:
        return None
    fn = mod.rope_forward

    def liger_rope_fn(q, k, cos, sin, rotary_dim=None):
        # Liger's layout is [B, H, S, D] with S-major storage: a transpose view of our [T, H, D].
        qv = q.unsqueeze(0).transpose(1, 2)
        kv = k.unsqueeze(0).transpose(1, 2)
        q2, k2, _, _ = fn(qv, kv, cos.unsqueeze(0), sin.unsqueeze(0), None, 1, rotary_dim)
        return q2.transpose(1, 2).squeeze(0), k2.transpose(1, 2).squeeze(0)

    return liger_rope_fn


def liger_fused_add_rms_norm(offset: float = 0.0, casting_mode: str = "llama") -> Callable | None:
    """fn(x, residual, weight, eps) -> (y, new_residual): residual += x, y = rmsnorm(residual)."""
    mod = _import("liger_kernel.ops.fused_add_rms_norm")
    if mod is None:
        return None
    fn = mod.LigerFusedAddRMSNormFunction.apply

    def liger_fused_add_rms_norm_fn(x, residual, weight, eps):
        return fn(x, residual, weight, eps, offset, casting_mode, False)

    return liger_fused_add_rms_norm_fn
