"""Host-side pieces shared by the attention kernels: compile key hash, fake compile arguments, input checks.

Both kernels (fmha_sm90, fmha_sm100) take the same argument list, in this order:

    (q, k, v, o, lse | None, cu_seqlens_q, cu_seqlens_k, sinks | None, softmax_scale, window_left, window_right,
     stream)

q/k (tokens, heads, Dqk), v/o (tokens, heads, Dv) with D contiguous and 16-byte aligned token/head strides (TMA),
lse (total_q, Hq) fp32, cu_seqlens int32 (B + 1,), sinks (Hq,) fp32. Token counts, head counts and B are symbolic:
one compiled object serves every batch. The (Dqk, Dv) pairs a kernel builds are its config's HEAD_DIMS.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from pathlib import Path

DTYPES = ("bf16", "fp16")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one compiled attention kernel (the compile key); sequence lengths, batch, head
    counts and the window sizes are runtime values. Each kernel subclasses it with its arch rule and name."""

    dtype: str  # bf16 | fp16: q, k, v and o
    head_dim: int  # Dqk: q and k (and the softmax scale's default)
    head_dim_v: int | None = None  # Dv: v and o; None: Dv = Dqk (set so by __post_init__)
    causal: bool = False
    has_window_left: bool = False  # window_left >= 0 (its value is a runtime argument)
    has_window_right: bool = False
    has_sink: bool = False
    has_lse: bool = True
    arch: str = ""

    HEAD_DIMS = ((64, 64), (128, 128))  # the (Dqk, Dv) pairs the kernel builds
    NAME = ""  # the kernel's name in the compile key
    ARCH_PREFIX = ""  # the arch must start with it
    ARCH_WHY = ""  # the error for another arch

    def __post_init__(self):
        if self.head_dim_v is None:  # the frozen dataclass's one derived default
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not in {DTYPES}")
        if (self.head_dim, self.head_dim_v) not in self.HEAD_DIMS:
            raise ValueError(f"(head_dim, head_dim_v) ({self.head_dim}, {self.head_dim_v}) not in {self.HEAD_DIMS}")
        if not self.arch.startswith(self.ARCH_PREFIX):
            raise ValueError(f"{self.ARCH_WHY}, not {self.arch}")

    @property
    def mask(self):
        from .mask import MaskSpec

        return MaskSpec(self.causal, self.has_window_left, self.has_window_right)

    def key(self) -> tuple:
        return (self.NAME, source_hash(), *dataclasses.astuple(self))

    @classmethod
    def for_call(cls, q, v, causal: bool, window_left: int, window_right: int, sinks, arch: str):
        """The config of an `attention_prefill` call (lse always computed)."""
        import torch

        return cls({torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype], q.shape[-1], v.shape[-1],
                   causal=bool(causal), has_window_left=window_left >= 0, has_window_right=window_right >= 0,
                   has_sink=sinks is not None, has_lse=True, arch=arch)


@functools.cache
def source_hash() -> str:
    """cute_ops/_compile.fingerprint() covers the on-disk cache; the in-memory key hashes this package too."""
    h = hashlib.sha256()
    for src in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:16]


def default_softmax_scale(head_dim: int) -> float:
    """1 / sqrt(Dqk): the scale of q . k (the qk head dim, not v's)."""
    return 1.0 / math.sqrt(head_dim)


def fake_args(dtype: str, head_dim: int, head_dim_v: int, has_lse: bool, has_sink: bool):
    """Symbolic compile-time arguments in the kernels' order (see the module docstring): q, k with head_dim
    columns, v, o with head_dim_v."""
    import cutlass
    import cutlass.cute as cute

    dt = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
    total_q, total_k, hq, hkv, nb1 = (cute.sym_int() for _ in range(5))

    def tokens(rows, heads, d):  # (tokens, heads, D): D contiguous, token/head strides in 16-byte units
        return cute.runtime.make_fake_tensor(dt, (rows, heads, d), stride=(cute.sym_int64(divisibility=8),
                                                                           cute.sym_int64(divisibility=8), 1),
                                             assumed_align=16)

    q, k = tokens(total_q, hq, head_dim), tokens(total_k, hkv, head_dim)
    v, o = tokens(total_k, hkv, head_dim_v), tokens(total_q, hq, head_dim_v)
    lse = (cute.runtime.make_fake_tensor(cutlass.Float32, (total_q, hq), stride=(cute.sym_int64(), 1),
                                         assumed_align=4) if has_lse else None)
    cu_q = cute.runtime.make_fake_tensor(cutlass.Int32, (nb1,), stride=(1,), assumed_align=4)
    cu_k = cute.runtime.make_fake_tensor(cutlass.Int32, (nb1,), stride=(1,), assumed_align=4)
    sinks = (cute.runtime.make_fake_tensor(cutlass.Float32, (hq,), stride=(1,), assumed_align=4)
             if has_sink else None)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, v, o, lse, cu_q, cu_k, sinks, cutlass.Float32(1.0), cutlass.Int32(-1), cutlass.Int32(-1), stream)


def build(kernel, cfg: AttentionConfig, extra_options: str = ""):
    """cute.compile `kernel` (an instance for `cfg`) for cfg.arch with TVM-FFI (uncached; `extra_options`:
    keep/dump flags for the SASS tests)."""
    import cutlass.cute as cute

    return cute.compile(kernel, *fake_args(cfg.dtype, cfg.head_dim, cfg.head_dim_v, cfg.has_lse,
                                                       cfg.has_sink),
                        options=f"--enable-tvm-ffi --gpu-arch {cfg.arch} {extra_options}".strip())


def compiled(build_fn, cfg: AttentionConfig):
    """The TVM-FFI callable `build_fn(cfg)` returns, through lowbit's compile cache (the key includes this
    package's source hash)."""
    from .. import _compile

    return _compile.get_or_compile(cfg.key(), lambda: build_fn(cfg))


def dump(build_fn, cfg: AttentionConfig):
    """PTX + SASS of `build_fn(cfg, extra_options)` (cute_ops._sass.Dump), compiled for cfg.arch on any machine."""
    from .._sass import compile_and_dump

    return compile_and_dump(lambda extra: build_fn(cfg, extra))


def check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, head_dims) -> str | None:
    """Why the kernels cannot take these tensors (None: they can), device aside: dtypes, head dims ((Dqk, Dv) in
    `head_dims`, the kernel config's HEAD_DIMS), GQA ratio, TMA layout rules, softmax_scale > 0 (the row max is
    taken before scaling), int32 cu_seqlens."""
    import torch

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if q.dtype not in names or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype} k={k.dtype} v={v.dtype}: needs bf16 or fp16, all the same"
    d = q.shape[-1]
    if k.shape[-1] != d or (d, v.shape[-1]) not in head_dims:
        return (f"head dims q={d} k={k.shape[-1]} v={v.shape[-1]}: needs k's = q's (Dqk) and (Dqk, Dv) in "
                f"{head_dims}")
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.stride(0) % 8 or t.stride(1) % 8 or t.data_ptr() % 16:
            return f"{name}: TMA needs a unit stride on D and 16-byte aligned rows, heads and base"
    if softmax_scale is not None and not softmax_scale > 0:
        return f"softmax_scale={softmax_scale}: the kernel takes the row max before scaling (needs > 0)"
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        return "cu_seqlens must be int32"
    if q.device.type != "cuda":
        return "the cute backend runs on CUDA tensors only"
    return None


def run(compiled_fn, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, window_left, window_right, sinks):
    """Allocate (out, lse) and call a compiled kernel with the shared argument list (through
    cute_ops._compile.launch: eager launch plans record it); lse is always computed."""
    import torch

    from .. import _compile

    total_q, hq, d = q.shape
    out = torch.empty(total_q, hq, v.shape[-1], dtype=q.dtype, device=q.device)  # Dv columns
    lse = torch.empty(total_q, hq, dtype=torch.float32, device=q.device)
    if total_q == 0:  # a grid of zero CTAs is a launch error
        return out, lse
    scale = default_softmax_scale(d) if softmax_scale is None else float(softmax_scale)
    sink_arg = None if sinks is None else sinks.to(torch.float32).contiguous()
    args = (q, k, v, out, lse, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), sink_arg, scale,
            int(window_left), int(window_right))
    _compile.launch(compiled_fn, *args, device=q.device)
    return out, lse


def preparable(q, cu_seqlens_q, cu_seqlens_k, sinks) -> bool:
    """Whether `prepared` can serve calls with this signature: tokens on an indexed device, contiguous cu_seqlens,
    fp32 contiguous sinks or none (what `run` would otherwise convert per call)."""
    import torch

    return (q.shape[0] > 0 and q.device.index is not None and cu_seqlens_q.is_contiguous()
            and cu_seqlens_k.is_contiguous() and (sinks is None or (sinks.dtype == torch.float32
                                                                   and sinks.is_contiguous())))


def prepared(compiled_fn, general, q, v, softmax_scale, window_left, window_right):
    """A launcher for repeated eager calls of `attention_prefill` with one call signature (dispatch/ops/_common.call
    keeps it per signature; `preparable` must hold): the compiled function, the softmax scale and the plain
    arguments are resolved once, and a call allocates out and lse and makes the TVM-FFI call (`run` without its
    per-call work). On another current device than q's (the TVM-FFI env stream is the current device's) `general`,
    the backend entry, runs instead."""
    import torch

    total_q, hq, d = q.shape
    d_v = v.shape[-1]
    scale = default_softmax_scale(d) if softmax_scale is None else float(softmax_scale)
    window_left, window_right = int(window_left), int(window_right)
    index, device, dtype = q.device.index, q.device, q.dtype
    get_device, empty, fp32 = torch._C._cuda_getDevice, torch.empty, torch.float32

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, *rest):
        if get_device() != index:
            return general(q, k, v, cu_seqlens_q, cu_seqlens_k, *rest)
        out = empty((total_q, hq, d_v), dtype=dtype, device=device)
        lse = empty((total_q, hq), dtype=fp32, device=device)
        compiled_fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, rest[-2], scale, window_left, window_right)
        return out, lse

    return prefill
