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

FlashMLA (deepseek-ai/FlashMLA) has no wheel for the GPU image; its sm90 decode kernels are built into a plain
shared library with a C ABI (`flashmla_library_path()`, loaded with ctypes, CUDA runtime linked statically) and
`flashmla_mla_decode` wraps it for the `mla_decode` cases; that peer verifies itself in its probe.

OpenAI's triton_kernels (`triton_kernels_moe_mxfp4`) is Python source exported from the triton repository at the
installed triton's release tag (`_triton_kernels_on_path`); it is the GPT-OSS MXFP4 MoE GEMM peer.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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


# ---------------------------------------------------------------------------------------------------- FlashMLA

FLASHMLA_ENV = "LOWBIT_FLASHMLA_LIB"
_FLASHMLA_KEY = "flashmla (libflashmla_lowbit.so)"
_FLASHMLA: dict[str, Any] = {}
_P, _I, _LL, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_float
_FLASHMLA_SIGS = {
    "flashmla_abi_version": ([], _I),
    "flashmla_last_error": ([], ctypes.c_char_p),
    "flashmla_sched_meta_ints": ([], _I),
    "flashmla_dense_num_sm_parts": ([_I, _I, _I, _I], _I),
    "flashmla_sparse_num_sm_parts": ([_I, _I, _I], _I),
    "flashmla_get_metadata": ([_I, _I, _I, _P, _P, _P, _I, _P], _I),
    "flashmla_decode_bf16": ([_P] * 6 + [_I] * 9 + [_LL] * 3 + [_F, _I, _P, _P, _I, _P, _P, _P], _I),
    "flashmla_decode_sparse_fp8": ([_P] * 5 + [_I] * 8 + [_LL] * 2 + [_F, _P, _P, _I, _P, _P, _P], _I),
}


def flashmla_library_path() -> Path:
    """$LOWBIT_FLASHMLA_LIB, else <repo>/.whl/flashmla/libflashmla_lowbit.so: FlashMLA's sm90 decode kernels
    (deepseek-ai/FlashMLA, commit in the COMMIT file beside it) behind a C ABI, CUDA runtime linked statically."""
    env = os.environ.get(FLASHMLA_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1] / ".whl" / "flashmla" / "libflashmla_lowbit.so"


def flashmla_version() -> str | None:
    """The FlashMLA commit the library was built from (its COMMIT file), None without the library."""
    commit = flashmla_library_path().with_name("COMMIT")
    return commit.read_text().strip() if commit.is_file() else None


def _flashmla_lib() -> Any | None:
    if "lib" in _FLASHMLA:
        return _FLASHMLA["lib"]
    path, lib = flashmla_library_path(), None
    if not path.is_file():
        _REASONS[_FLASHMLA_KEY] = f"{path} not found"
    else:
        try:
            lib = ctypes.CDLL(str(path))
            for name, (args, res) in _FLASHMLA_SIGS.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            if lib.flashmla_abi_version() != 1 or lib.flashmla_sched_meta_ints() != 8:
                raise OSError("unexpected ABI version / scheduler-metadata size")
        except (OSError, AttributeError) as exc:
            _REASONS[_FLASHMLA_KEY] = f"{type(exc).__name__}: {exc}"
            lib = None
    _FLASHMLA["lib"] = lib
    return lib


def flashmla_physical_indices(indices, table, seqused, page: int, causal: bool):
    """Our sparse index lists (logical positions in each sequence) -> FlashMLA's (physical cache slots,
    block * page + offset; -1 = skip): positions < 0, >= seqused_k, past the table or (causal) after the query's
    own position -> -1. indices (B, Sq, topk) int32, table (B, max_blocks) int32, seqused (B,) int32."""
    bsz, sq, _ = indices.shape
    pos = indices.long()
    limit = seqused.long().view(bsz, 1, 1).expand(bsz, sq, 1)
    if causal:
        limit = limit - sq + 1 + torch.arange(sq, device=pos.device).view(1, sq, 1)
    ok = (pos >= 0) & (pos < limit) & (pos < table.shape[1] * page)
    blk = torch.gather(table.long(), 1, (pos.clamp(0, table.shape[1] * page - 1) // page).view(bsz, -1))
    slot = blk.view_as(pos) * page + pos % page
    return torch.where(ok, slot, -1).to(torch.int32).contiguous()


class FlashMlaDecode:
    """FlashMLA `flash_mla_with_kvcache` on sm_90a, called on `mla_decode` case inputs (dict: q (B, Sq, 128, D)
    bf16, cache, table, seqused, indices). Dense: bf16 cache (NB, 64, (1,) 576), v_dim 512. Sparse: the V3.2
    (656 B) and V4/MODEL1 (584 B) FP8 caches, top-k a multiple of 64; our logical positions are turned into
    FlashMLA's physical slots at make time (`prepare`), as a serving engine does before the call. The scheduler
    metadata (`get_mla_metadata`) is also built once per input set, as FlashMLA's users reuse it across layers;
    the timed call allocates out / lse / the split accumulators and runs the split kernel + combine, as
    FlashMLA's own interface does. `probe` runs it once and, given `check(inputs, out)`, verifies the output."""

    def __init__(self, lib, layout: str, v_dim: int, scale: float, causal: bool = True, check=None):
        self.lib, self.layout, self.v_dim, self.scale = lib, layout, v_dim, scale
        self.causal, self.check = causal, check

    def _why_not(self, i: dict) -> str | None:
        q, cache, idx = i["q"], i["cache"], i["indices"]
        _, _, h, d = q.shape
        if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
            return "FlashMLA library is built for sm_90a only"
        if q.dtype != torch.bfloat16 or i["table"].dtype != torch.int32 or i["seqused"].dtype != torch.int32:
            return "FlashMLA takes bf16 q and int32 block table / lengths"
        if self.v_dim > 512:
            return f"v_dim {self.v_dim}: FlashMLA decodes 512-wide values"
        if idx is None:
            if self.layout != "bf16" or d != 576 or cache.shape[1] != 64:
                return "FlashMLA sm90 dense decode: bf16 cache, D 576, page 64 only (no dense FP8 path on sm90)"
        elif self.layout not in ("v32", "v4") or h != 128 or idx.shape[-1] % 64:
            return "FlashMLA sm90 sparse decode here: V3.2 / V4 FP8 caches, H 128, top-k a multiple of 64"
        return None

    def prepare(self, i: dict) -> None:
        if "flashmla" in i:
            return
        q, idx, lib = i["q"], i["indices"], self.lib
        bsz, sq, h, _ = q.shape
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        topk = 0 if idx is None else idx.shape[-1]
        parts = lib.flashmla_sparse_num_sm_parts(sq, h, sms) if topk else lib.flashmla_dense_num_sm_parts(sq, h, 1,
                                                                                                           sms)
        meta = torch.empty(parts, 8, dtype=torch.int32, device=q.device)
        splits = torch.empty(bsz + 1, dtype=torch.int32, device=q.device)
        seqused = i["seqused"].to(torch.int32).contiguous()
        rc = lib.flashmla_get_metadata(bsz, sq, topk, seqused.data_ptr(), meta.data_ptr(), splits.data_ptr(), parts,
                                       torch.cuda.current_stream(q.device).cuda_stream)
        self._raise(rc)
        prep = {"meta": meta, "splits": splits, "parts": parts, "seqused": seqused}
        if topk:
            prep["slots"] = flashmla_physical_indices(idx, i["table"], seqused, i["cache"].shape[1], self.causal)
        i["flashmla"] = prep

    def __call__(self, i: dict):
        return self.run(i)[0]

    def run(self, i: dict):
        """(out (B, Sq, H, v_dim) bf16, lse (B, Sq, H) fp32 natural log). FlashMLA always computes 512 value
        columns (V4: the whole 512-wide head); v_dim < 512 returns the first v_dim of them (a view)."""
        q, cache, table, prep, lib = i["q"], i["cache"], i["table"], i["flashmla"], self.lib
        bsz, sq, h, d = q.shape
        dev, dv, parts = q.device, 512, prep["parts"]  # FlashMLA's value width; a narrower v_dim is its prefix
        out = torch.empty(bsz, sq, h, dv, dtype=q.dtype, device=dev)
        lse = torch.empty(bsz, sq, h, dtype=torch.float32, device=dev)
        lse_acc = torch.empty((bsz + parts) * sq * h, dtype=torch.float32, device=dev)
        o_acc = torch.empty((bsz + parts) * sq * h * dv, dtype=torch.float32, device=dev)
        stream = torch.cuda.current_stream(dev).cuda_stream
        ws = (prep["meta"].data_ptr(), prep["splits"].data_ptr(), parts, lse_acc.data_ptr(), o_acc.data_ptr(),
              stream)
        if "slots" in prep:
            rc = lib.flashmla_decode_sparse_fp8(
                q.data_ptr(), cache.data_ptr(), prep["slots"].data_ptr(), out.data_ptr(), lse.data_ptr(), bsz, sq, h,
                d, dv, cache.shape[0], cache.shape[1], prep["slots"].shape[-1], cache.stride(0), cache.stride(1),
                self.scale, *ws)
        else:
            rc = lib.flashmla_decode_bf16(
                q.data_ptr(), cache.data_ptr(), out.data_ptr(), lse.data_ptr(), prep["seqused"].data_ptr(),
                table.data_ptr(), bsz, sq, h, 1, d, dv, cache.shape[0], cache.shape[1], table.stride(0),
                cache.stride(0), cache.stride(1), d, self.scale, int(self.causal), *ws)
        self._raise(rc)
        return out[..., : self.v_dim], lse

    def probe(self, i: dict) -> str | None:
        """None if this peer runs on these inputs (and matches `check`), else why not."""
        q, table = i["q"], i["table"]
        why = self._why_not(i)
        if why is None and not (q.is_contiguous() and table.stride(-1) == 1 and i["cache"].stride(-1) == 1):
            why = "q must be contiguous, table and cache rows unit-stride"
        if why:
            return why
        self.prepare(i)
        out = self(i)
        torch.cuda.synchronize(q.device)
        if self.check is not None:
            try:
                self.check(i, out)
            except AssertionError as exc:
                return f"output differs from the reference: {str(exc)[:200]}"
        return None

    def _raise(self, rc: int) -> None:
        if rc:
            raise RuntimeError(f"FlashMLA: {self.lib.flashmla_last_error().decode(errors='replace')}")


def flashmla_mla_decode(layout: str, v_dim: int, scale: float, causal: bool = True,
                        check=None) -> FlashMlaDecode | None:
    """The FlashMLA peer for an `mla_decode` case, or None when the library is absent or does not load (the
    reason goes to `unavailable_reasons()`). Per-shape limits are found by `probe` on the first GPU inputs."""
    lib = _flashmla_lib()
    return None if lib is None else FlashMlaDecode(lib, layout, v_dim, scale, causal, check)


# ----------------------------------------------------------------------------------------- triton_kernels
#
# OpenAI's triton_kernels (triton's python/triton_kernels, the GPT-OSS MoE kernels) is not published as a wheel:
# its source, exported at the triton release tag that matches the installed triton, lives in a directory holding
# the `triton_kernels` package, named by $LOWBIT_TRITON_KERNELS or, by default, the repository's
# .whl/triton_kernels_src (ignored by git, carried to the GPU machine with .whl).

TRITON_KERNELS_ENV = "LOWBIT_TRITON_KERNELS"
TRITON_KERNELS_DEFAULT = Path(__file__).resolve().parents[1] / ".whl" / "triton_kernels_src"


def _triton_kernels_on_path() -> None:
    root = os.environ.get(TRITON_KERNELS_ENV) or str(TRITON_KERNELS_DEFAULT)
    if os.path.isdir(os.path.join(root, "triton_kernels")) and root not in sys.path:
        sys.path.insert(0, root)


def mxfp4_kn_views(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our MXFP4 weights as triton_kernels' (E, K, N) right-hand operand, without copying a byte.

    w: (E, N, K/2) uint8, two E2M1 codes per byte along K, element 2i in the low nibble; w_scale: (E, N, K/32)
    uint8 E8M0. triton_kernels quantizes its weight along K (mx_axis=1 of (E, K, N)) and packs the same way (the
    even element in the low nibble), so the bytes stay as they are and only the axes swap: the packed weight is
    viewed (E, K/2, N) with K contiguous (stride(-2) == 1, what matmul_ogs asserts for MX weights) and the scales
    (E, K/32, N)."""
    if w.dtype != torch.uint8 or w_scale.dtype != torch.uint8 or w.ndim != 3 or w_scale.ndim != 3:
        raise ValueError(f"expected uint8 (E, N, K/2) weights and (E, N, K/32) scales, got {w.dtype} "
                         f"{tuple(w.shape)} / {w_scale.dtype} {tuple(w_scale.shape)}")
    if w_scale.shape[:2] != w.shape[:2] or w.shape[2] * 2 != w_scale.shape[2] * 32 or w.stride(2) != 1:
        raise ValueError(f"weights {tuple(w.shape)} and scales {tuple(w_scale.shape)} do not describe one "
                         "K-contiguous MXFP4 tensor (32 elements per scale)")
    return w.transpose(1, 2), w_scale.transpose(1, 2)


def contiguous_slice_sizes(m_indices: torch.Tensor, experts: int) -> torch.Tensor:
    """Rows per expert (int32, on m_indices' device) of a contiguous layout, for triton_kernels' ragged matmul,
    which takes expert e's rows at offset sum(sizes[:e]). The layout must hold only real rows grouped by expert in
    ascending order: padding rows (-1), ids >= experts or unsorted rows raise ValueError."""
    ids = m_indices.to(torch.int64)
    if ids.numel() and bool(((ids < 0) | (ids >= experts)).any()):
        raise ValueError("m_indices has padding rows (-1) or ids out of range: triton_kernels' ragged layout "
                         "has no padding rows")
    if ids.numel() > 1 and bool((ids[1:] < ids[:-1]).any()):
        raise ValueError("m_indices rows are not grouped by expert in ascending order")
    return torch.bincount(ids, minlength=experts).to(torch.int32)


def triton_kernels_moe_mxfp4(num_warps: int = 8) -> Callable | None:
    """prepare(w, w_scale, m_indices) -> fn(a) -> out (M, N) bf16, expert e's rows of a (M, K) bf16 times its
    MXFP4 weights transposed (W4A16, GPT-OSS), through triton_kernels' `matmul_ogs` on a ragged routing.

    prepare runs once per set of weights, outside the timing, as an engine prepacks at load: it swizzles the
    weights and scales into the layouts triton_kernels picks for this GPU (on sm_90 the Hopper MX value layout and
    the scale layout for `num_warps` warps, which the kernel then launches with) and builds the ragged-tensor
    metadata (row counts, offsets, block schedules) from m_indices. fn(a) is the timed call. None when the package
    cannot be imported (see `_triton_kernels_on_path`)."""
    _triton_kernels_on_path()
    mo = _import("triton_kernels.matmul_ogs")
    if mo is None:
        return None
    tk = importlib.import_module("triton_kernels.tensor")
    layout = importlib.import_module("triton_kernels.tensor_details.layout")

    def prepare(w: torch.Tensor, w_scale: torch.Tensor, m_indices: torch.Tensor) -> Callable:
        experts = w.shape[0]
        wv, sv = mxfp4_kn_views(w, w_scale)
        w_layout, w_opts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        s_layout, s_opts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
        w_tk = tk.convert_layout(tk.wrap_torch_tensor(wv, dtype=tk.FP4), w_layout, **w_opts)
        s_tk = tk.convert_layout(tk.wrap_torch_tensor(sv), s_layout, **s_opts)
        sizes = contiguous_slice_sizes(m_indices, experts)
        rows = int(sizes.sum())
        meta = tk.make_ragged_tensor_metadata(sizes, rows)
        routing = mo.RoutingData(None, meta.slice_sizes, experts, 1, meta,
                                 expected_tokens_per_expt=max(1, rows // experts))
        precision = mo.PrecisionConfig(weight_scale=s_tk, out_dtype=torch.bfloat16)

        def triton_kernels_moe_mxfp4_fn(a: torch.Tensor) -> torch.Tensor:
            return mo.matmul_ogs(a, w_tk, None, routing_data=routing, precision_config=precision)

        return triton_kernels_moe_mxfp4_fn

    return prepare
