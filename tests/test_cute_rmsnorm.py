"""CuTeDSL RMSNorm (+ FP8 group / NVFP4 quant) backend: compile-only SASS checks on CPU, bytes on the GPU.

CPU (CI): the kernels compile for sm_90a and sm_100a without a GPU (`--gpu-arch`), and the SASS is checked
(16-byte global loads, the E4M3 conversion, NaN-propagating max, IEEE sqrt/div in the PTX). The compile cache
is checked cold -> warm and under two concurrent processes. Skipped, with the reason, when
nvidia-cutlass-dsl is not installed.
GPU (`-m gpu`): bit-exact vs the CPU reference (and vs the triton backend), CUDA graph capture,
torch.compile(fullgraph), and the per-call host overhead printed next to a Triton launch of the same op.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from cute_ops import unavailable_reason
from tests.helpers import run_compile_script

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"cute backend: {unavailable_reason()}")


@pytest.fixture(autouse=True)
def _allow_unverified_cute(monkeypatch):
    """These tests exercise the kernel itself; the dispatch gate (cute_ops.rmsnorm.HARDWARE_STATUS) keeps it
    away from users on archs where no GPU run has shown it bit-exact (all but sm_90)."""
    monkeypatch.setenv("LOWBIT_CUTE_UNVERIFIED", "1")


def test_unverified_backend_is_refused_with_the_reason(monkeypatch):
    from cute_ops.rmsnorm import HARDWARE_STATUS, supports_rms_norm

    monkeypatch.delenv("LOWBIT_CUTE_UNVERIFIED")
    x, w = torch.randn(2, 64), torch.ones(64)
    assert supports_rms_norm(x, w, None, 1e-6, 0.0) == HARDWARE_STATUS
    assert "not bit-exact on hardware yet for this arch" in HARDWARE_STATUS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfg(mode, k, arch, *, x=torch.bfloat16, w=torch.bfloat16, residual=True, swizzle=False, group=None):
    from cute_ops.rmsnorm import pick_config

    group = group or (128 if mode == "fp8" else 16)
    return pick_config(x, w, k, mode, residual, 0.0, group, False, swizzle, arch)


# --------------------------------------------------------------------------------------- CPU: SASS


def test_sm90_bf16_sass_uses_16_byte_loads_and_ieee_math():
    from cute_ops.rmsnorm import dump

    cfg = _cfg("none", 7168, "sm_90a")
    d = dump(cfg)
    per_thread = cfg.iters
    # x and residual: one 16-byte load per vector; weight too; y and the new residual: 16-byte stores
    assert d.count("LDG.E.128") >= 3 * per_thread, d.opcodes()
    assert d.count("STG.E.128") >= 2 * per_thread, d.opcodes()
    assert d.count("LDG.E") == d.count("LDG.E.128"), f"narrow global loads: {d.opcodes()}"
    assert "sqrt.rn.f64" in d.ptx and "rcp.rn.f64" in d.ptx  # rstd = 1/sqrt(ss/K + eps) in fp64, as the reference
    assert "rsqrt.approx" not in d.ptx and "sqrt.approx" not in d.ptx
    assert "div.rn.f64" in d.ptx  # ss / K in fp64
    assert d.count("DADD") + d.count("DFMA") > 0  # fp64 sum of squares


def test_sm90_fp8_group_sass():
    from cute_ops.rmsnorm import dump

    cfg = _cfg("fp8", 7168, "sm_90a", residual=False)
    d = dump(cfg)
    assert d.count("LDG.E.128") >= 2 * cfg.iters, d.opcodes()
    assert d.count("F2FP.SATFINITE.E4M3") >= cfg.iters * cfg.vec // 2, d.opcodes()  # cvt.rn.satfinite.e4m3x2
    assert d.count("STG.E.64") >= cfg.iters, d.opcodes()  # 8 codes per thread per vector: one 8-byte store
    stores = _store_offsets(d.ptx, "st.global.v2.b32")  # ...at every vector the thread owns
    assert sorted(o for _, o in stores) == [i * cfg.threads_per_row * cfg.vec for i in range(cfg.iters)], stores
    assert d.count("FMNMX.NAN") > 0  # NaN-propagating amax (max.NaN.f32)
    assert "div.rn.f32" in d.ptx  # code = e4m3(y / s) with IEEE division, as the reference


def _store_offsets(ptx: str, op: str) -> list[tuple[str, int]]:
    """(base register, immediate byte offset) of every `op` (e.g. 'st.global.b32') in the PTX."""
    return [(b, int(o or 0)) for b, o in re.findall(rf"\t{re.escape(op)}\s+\[(%rd\d+)(?:\+(\d+))?\]", ptx)]


def test_sm90_nvfp4_code_stores_cover_every_vector():
    """Each thread stores the packed codes of every vector it owns: iters 4-byte stores, lanes tpr * 4 bytes apart.

    The first H200 run wrote iters / 2 stores, tpr * 8 bytes apart (the codes were partitioned with the
    element-indexed input copy, not a copy of the half-width byte tile), so most code bytes kept the poison."""
    from cute_ops.rmsnorm import dump

    cfg = _cfg("nvfp4", 4096, "sm_90a")  # the tile covers K exactly: no predication, one base register
    d = dump(cfg)
    half = cfg.vec // 2  # 8 bf16 elements -> 4 code bytes
    # b32 stores: the codes, plus one fp32 store of the global scale the op returns (new residual: v4; scales: b8)
    stores = _store_offsets(d.ptx, "st.global.b32")
    bases = {b for b, _ in stores}
    codes = max(bases, key=lambda b: sum(1 for s, _ in stores if s == b))
    assert len(bases) == 2 and sum(1 for s, _ in stores if s != codes) == 1, stores
    code_offsets = sorted(o for b, o in stores if b == codes)
    assert code_offsets == [i * cfg.threads_per_row * half for i in range(cfg.iters)], stores
    assert d.count("STG.E") - d.count("STG.E.128") - d.count("STG.E.U8") == cfg.iters + 1, d.opcodes()


def test_sm100_nvfp4_swizzled_sass():
    from cute_ops.rmsnorm import dump

    cfg = _cfg("nvfp4", 2880, "sm_100a", swizzle=True)  # 2880: predicated tail columns
    d = dump(cfg)
    assert "sm_100a" in d.ptx.split(".target", 1)[1][:40]
    assert d.count("LDG.E.128") >= 2 * cfg.iters, d.opcodes()
    assert d.count("F2FP.SATFINITE.E4M3") >= cfg.iters  # block scales
    assert d.count("FMNMX") + d.count("FMNMX3") > 0
    assert d.count("STG.E.U8") >= cfg.iters  # one scale byte per 16-element block (lane pairs)
    # packed codes of every vector (predicated), plus the returned global scale's one fp32 store
    assert len(_store_offsets(d.ptx, "st.global.b32")) == cfg.iters + 1


# ---------------------------------------------------------------------------------- CPU: the cache


def test_disk_cache_cold_then_warm(tmp_path, monkeypatch, capsys):
    from cute_ops import _compile
    from cute_ops.rmsnorm import compiled

    monkeypatch.setenv("LOWBIT_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOWBIT_CUTE_DISK_CACHE", "1")
    cfg = _cfg("none", 1024, "sm_90a", residual=False)
    before = (_compile.STATS.compiles, _compile.STATS.disk_loads)
    compiled(cfg)
    assert _compile.STATS.compiles == before[0] + 1
    assert _compile.object_path(cfg.key()).is_file()
    _compile.clear_memory()
    compiled(cfg)
    assert _compile.STATS.compiles == before[0] + 1  # no second compile: loaded from disk
    assert _compile.STATS.disk_loads == before[1] + 1
    compiled(cfg)  # in-memory hit
    with capsys.disabled():
        print(f"\n[cute cache] cold compile+export {_compile.STATS.compile_s[-1]:.2f}s, "
              f"warm load {_compile.STATS.load_s[-1] * 1e3:.1f}ms")


_DIRECT = """
import os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"  # before cutlass loads: the JIT engine is made for this arch
os.environ["LOWBIT_CUTE_DISK_CACHE"] = "0"
import torch, tvm_ffi
from cute_ops import _compile
from cute_ops.rmsnorm import build, compiled, pick_config
cfg = pick_config(torch.bfloat16, torch.bfloat16, 512, "none", False, 0.0, 16, False, False, "sm_90a")
wrapped = build(cfg)
fn = _compile.direct(wrapped)
print(isinstance(wrapped, tvm_ffi.Function), isinstance(fn, tvm_ffi.Function),
      isinstance(compiled(cfg), tvm_ffi.Function))
try:  # the wrapper's positional list (no stream): 11 parameters
    fn(torch.empty(16, 512, dtype=torch.bfloat16))
except TypeError as exc:
    print("Expects 11 parameters" in str(exc))
"""


def test_fresh_compile_is_cached_as_the_plain_function():
    """`_compile.direct`: a fresh compile is cached as the plain TVM-FFI function (what a disk-cache load gives),
    with the wrapper's arity."""
    out = run_compile_script(_DIRECT, 300).split()
    assert out == ["False", "True", "True", "True"], out


def test_direct_keeps_other_callables():
    """Objects without a TVM-FFI function underneath, or wrappers that convert pointer arguments, are kept."""
    from cute_ops import _compile

    def plain(*a):
        return a

    assert _compile.direct(plain) is plain

    class PointerArgs:  # a wrapper that converts pointer arguments: kept
        execution_args = type("A", (), {"has_pointer_address_arg_specs": True})()

        def __tvm_ffi_object__(self):
            raise AssertionError("not unwrapped")

    w = PointerArgs()
    assert _compile.direct(w) is w


_WORKER = """
import json, sys, torch
sys.path.insert(0, {root!r})
from cute_ops import _compile
from cute_ops.rmsnorm import compiled, pick_config
compiled(pick_config(torch.bfloat16, torch.bfloat16, 512, "none", False, 0.0, 16, False, False, "sm_90a"))
print(json.dumps({{"compiles": _compile.STATS.compiles, "loads": _compile.STATS.disk_loads}}))
"""


def test_disk_cache_two_processes_compile_once(tmp_path):
    env = dict(os.environ, LOWBIT_CUTE_CACHE_DIR=str(tmp_path), LOWBIT_CUTE_DISK_CACHE="1")
    code = _WORKER.format(root=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["compiles"] for o in outs) == [0, 1], outs  # the loser of the lock race loads the object
    assert sorted(o["loads"] for o in outs) == [0, 1], outs
    assert len(list(tmp_path.rglob("*.o"))) == 1


def test_fingerprint_tracks_sources_and_versions():
    import cutlass

    from cute_ops import _compile

    fp = _compile.fingerprint()
    assert len(fp) == 24 and cutlass.__version__  # a hash of cute_ops/*.py + cutlass/tvm-ffi/python versions
    assert _compile.object_path(("k", 1)).parent.name == fp


def test_table_rows_and_cpu_refusal():
    from dispatch.registry import select
    from dispatch.table import TABLE

    for op in ("rms_norm", "rms_norm_fp8_group", "rms_norm_nvfp4"):
        cute = {arch: e for e in TABLE[op] if e.backend == "cute" for arch in e.archs}
        assert {"sm_90", "sm_100"} <= set(cute)
        triton_gpu = max(e.priority for e in TABLE[op] if e.backend == "triton")
        # sm_90: the committed H200 benchmarks show it bit-exact and >= Triton; sm_100: never run on hardware.
        assert cute["sm_90"].priority > triton_gpu > cute["sm_100"].priority
    x = torch.randn(4, 64)
    with pytest.raises(Exception, match="arch cpu not in sm_90"):  # (each cute row names its archs)
        select(TABLE["rms_norm"], "rms_norm", "cute", (x, torch.ones(64), None, 1e-6, 0.0), {})


def test_unavailable_reason_without_the_dsl():
    code = (f"import sys; sys.modules['cutlass'] = None; sys.path.insert(0, {ROOT!r}); "
            "from cute_ops import unavailable_reason as u; print(u())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "nvidia-cutlass-dsl not importable" in out and "pip install" in out


# ------------------------------------------------------------------------------------------- GPU


def _gpu_inputs(m, k, dtype=torch.bfloat16, w_dtype=None, seed=0, residual=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    w = (torch.randn(k, generator=g) * 0.5 + 1).to(w_dtype or dtype)
    r = (torch.randn(m, k, generator=g)).to(dtype) if residual else None
    return x, w, r


def _same(got, want, what):
    from tests.helpers import assert_same_bytes

    assert_same_bytes(got.cpu(), want.cpu(), what)


SHAPES = [(1, 4096), (7, 2880), (64, 7168), (300, 2880), (513, 1024)]


def _fp8_group(k):
    """128 where it divides K; 64 for GPT-OSS's 2880 (= 22.5 x 128: the op rightly refuses group 128 there)."""
    return 128 if k % 128 == 0 else 64


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("variant", ["plain", "residual", "fp32_weight_offset", "fp16"])
def test_gpu_rms_norm_bit_exact(m, k, variant):
    from dispatch import ops

    dtype = torch.float16 if variant == "fp16" else torch.bfloat16
    w_dtype = torch.float32 if variant == "fp32_weight_offset" else None
    off = 1.0 if variant == "fp32_weight_offset" else 0.0
    x, w, r = _gpu_inputs(m, k, dtype, w_dtype, residual=variant == "residual")
    want = ops.rms_norm(x, w, 1e-6, residual=r, weight_offset=off, backend="torch")
    got = ops.rms_norm(x.cuda(), w.cuda(), 1e-6, residual=None if r is None else r.cuda(), weight_offset=off,
                       backend="cute")
    _same(got.out, want.out, "y")
    if r is not None:
        _same(got.residual, want.residual, "new residual")


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("ue8m0,column_major", [(False, False), (True, True)])
def test_gpu_rms_norm_fp8_group_bit_exact(m, k, ue8m0, column_major):
    from dispatch import ops

    x, w, r = _gpu_inputs(m, k, seed=1)
    kw = dict(residual=r, ue8m0=ue8m0, column_major_scales=column_major, group_size=_fp8_group(k))
    want = ops.rms_norm_fp8_group(x, w, 1e-6, backend="torch", **kw)
    kw["residual"] = r.cuda()
    got = ops.rms_norm_fp8_group(x.cuda(), w.cuda(), 1e-6, backend="cute", **kw)
    _same(got.quantized.codes, want.quantized.codes, "codes")
    _same(got.quantized.scales, want.quantized.scales, "scales")
    _same(got.residual, want.residual, "new residual")


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_gpu_rms_norm_nvfp4_bit_exact(m, k, layout):
    from dispatch import ops

    x, w, r = _gpu_inputs(m, k, seed=2)
    y = ops.rms_norm(x, w, 1e-6, residual=r, backend="torch").out
    gs = ops.nvfp4_global_scale_from_amax(y.float().abs().amax())
    want = ops.rms_norm_nvfp4(x, w, 1e-6, residual=r, global_scale=gs, scale_layout=layout, backend="torch")
    got = ops.rms_norm_nvfp4(x.cuda(), w.cuda(), 1e-6, residual=r.cuda(), global_scale=gs.cuda(),
                             scale_layout=layout, backend="cute")
    _same(got.quantized.codes, want.quantized.codes, "codes")
    _same(got.quantized.scales.view(torch.uint8), want.quantized.scales.view(torch.uint8), "scales")
    _same(got.residual, want.residual, "new residual")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_rms_norm_nvfp4_nan_block_zero_row(dtype):
    """A NaN weight column makes one NaN per row: that block's scale is 0x7F and ALL its codes are 0 (the
    reference's inverse scale is NaN there); a zero row. fp32 x also runs the 4-element-vector path."""
    from dispatch import ops

    x, w, _ = _gpu_inputs(6, 1024, dtype, seed=6, residual=False)
    x[1] = 0
    w[37] = float("nan")
    y = ops.rms_norm(x, w, 1e-6, backend="torch").out
    gs = ops.nvfp4_global_scale_from_amax(y.float().abs().nan_to_num(0.0).amax())
    for layout in ("linear", "swizzled"):
        want = ops.rms_norm_nvfp4(x, w, 1e-6, global_scale=gs, scale_layout=layout, backend="torch")
        got = ops.rms_norm_nvfp4(x.cuda(), w.cuda(), 1e-6, global_scale=gs.cuda(), scale_layout=layout,
                                 backend="cute")
        _same(got.quantized.codes, want.quantized.codes, f"{layout} codes")
        _same(got.quantized.scales.view(torch.uint8), want.quantized.scales.view(torch.uint8), f"{layout} scales")
    assert int(want.quantized.codes[:, 16:24].view(torch.uint8).abs().sum()) == 0  # the NaN block (cols 32-47)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["none", "fp8", "nvfp4"])
def test_gpu_negative_zero_weight(mode):
    """-0.0 + weight_offset 0.0 = +0.0 (the reference always adds the offset): the first kernel skipped a zero
    offset's add and wrote -0.0 in those columns."""
    from dispatch import ops

    x, w, _ = _gpu_inputs(5, 1024, seed=7, residual=False)
    w[::3] = -0.0
    if mode == "none":
        _same(ops.rms_norm(x.cuda(), w.cuda(), 1e-6, backend="cute").out, ops.rms_norm(x, w, 1e-6, backend="torch").out,
              "y")
        return
    if mode == "fp8":
        want = ops.rms_norm_fp8_group(x, w, 1e-6, backend="torch").quantized
        got = ops.rms_norm_fp8_group(x.cuda(), w.cuda(), 1e-6, backend="cute").quantized
    else:
        gs = torch.tensor(0.01)
        want = ops.rms_norm_nvfp4(x, w, 1e-6, global_scale=gs, backend="torch").quantized
        got = ops.rms_norm_nvfp4(x.cuda(), w.cuda(), 1e-6, global_scale=gs.cuda(), backend="cute").quantized
    _same(got.codes.view(torch.uint8), want.codes.view(torch.uint8), "codes")
    _same(got.scales.view(torch.uint8), want.scales.view(torch.uint8), "scales")


@pytest.mark.gpu
def test_gpu_nan_and_zero_rows():
    from dispatch import ops

    x, w, _ = _gpu_inputs(4, 1024, residual=False)
    x[1] = 0
    x[2, 5] = float("nan")
    want = ops.rms_norm_fp8_group(x, w, 1e-6, backend="torch")
    got = ops.rms_norm_fp8_group(x.cuda(), w.cuda(), 1e-6, backend="cute")
    _same(got.quantized.codes, want.quantized.codes, "codes")
    _same(got.quantized.scales, want.quantized.scales, "scales")


@pytest.mark.gpu
def test_gpu_matches_triton_backend():
    from dispatch import ops

    x, w, r = _gpu_inputs(128, 7168, seed=3)
    x, w, r = x.cuda(), w.cuda(), r.cuda()
    a = ops.rms_norm_fp8_group(x, w, 1e-6, residual=r, backend="cute")
    b = ops.rms_norm_fp8_group(x, w, 1e-6, residual=r, backend="triton")
    _same(a.quantized.codes, b.quantized.codes, "codes cute vs triton")
    _same(a.quantized.scales, b.quantized.scales, "scales cute vs triton")


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rms_norm", "rms_norm_fp8_group", "rms_norm_fp8_group column-major",
                                "rms_norm_nvfp4 linear", "rms_norm_nvfp4 swizzled"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_repeated_calls_take_the_prepared_launcher(op, with_residual, monkeypatch):
    """Calls 2.. with one signature run the launcher cute_ops.rmsnorm prepared on call 1 (dispatch/ops/_common.py
    `specialize`) where the native replay is off (the Python path; tests/test_native_replay_cute.py covers the
    native one): it must give the reference's bytes on new values, write fresh outputs each call, and leave the
    residual None without one."""
    from dispatch import native_replay, ops
    from dispatch.ops import _common

    monkeypatch.setenv(native_replay.NATIVE_ENV, "0")

    name, _, layout = op.partition(" ")
    fn = getattr(ops, name)
    kw = (dict(column_major_scales=True) if layout == "column-major"
          else dict(global_scale=torch.tensor(0.02), scale_layout=layout) if layout else {})
    outs = []
    for seed in range(3):
        x, w, r = _gpu_inputs(16, 7168, seed=10 + seed, residual=with_residual)
        want = fn(x, w, 1e-6, residual=r, backend="torch", **kw)
        gkw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
        got = fn(x.cuda(), w.cuda(), 1e-6, residual=None if r is None else r.cuda(), backend="cute", **gkw)
        if name == "rms_norm":
            pairs = [(got.out, want.out, "y")]
        else:
            pairs = [(g, v, f) for f, g, v in zip(got.quantized._fields, got.quantized, want.quantized, strict=True)]
        for a, b, what in pairs:
            _same(a, b, f"call {seed} {what}")
            if layout == "column-major":  # the MN-major storage, as the general path returns it
                assert a.stride() == b.stride(), f"call {seed} {what}: strides {a.stride()} != {b.stride()}"
        if with_residual:
            _same(got.residual, want.residual, f"call {seed} new residual")
        else:
            assert got.residual is None
        outs.append(pairs[0][0])
    assert len({o.data_ptr() for o in outs}) == 3  # fresh outputs, never a reused buffer
    prepared = [f for (n, _), f in _common._FAST.items() if n == name]
    assert any(getattr(f, "__name__", "") == "launch" for f in prepared), "the prepared launcher was not kept"


@pytest.mark.gpu
def test_gpu_new_batch_size_does_not_recompile():
    from cute_ops import _compile
    from dispatch import ops

    x, w, _ = _gpu_inputs(1, 4096, residual=False)
    ops.rms_norm(x.cuda(), w.cuda(), backend="cute")
    n = _compile.STATS.compiles + _compile.STATS.disk_loads
    for m in (2, 3, 17, 1000):
        ops.rms_norm(torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16), w.cuda(), backend="cute")
    assert _compile.STATS.compiles + _compile.STATS.disk_loads == n


@pytest.mark.gpu
def test_gpu_cuda_graph_capture():
    from dispatch import ops

    x, w, r = (t.cuda() for t in _gpu_inputs(16, 4096, seed=4))
    ops.rms_norm(x, w, residual=r, backend="cute")  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            out = ops.rms_norm(x, w, residual=r, backend="cute")
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    want = ops.rms_norm(x.cpu(), w.cpu(), residual=r.cpu(), backend="torch")
    _same(out.out, want.out, "graph replay y")


@pytest.mark.gpu
def test_gpu_torch_compile_fullgraph():
    from dispatch import ops

    x, w, r = _gpu_inputs(32, 2880, seed=5)
    g = _fp8_group(2880)

    @torch.compile(fullgraph=True)
    def f(x, w, r):
        return ops.rms_norm_fp8_group(x * 1, w, 1e-6, residual=r, group_size=g, backend="cute")

    got = f(x.cuda(), w.cuda(), r.cuda())
    want = ops.rms_norm_fp8_group(x, w, 1e-6, residual=r, group_size=g, backend="torch")
    _same(got.quantized.codes, want.quantized.codes, "compiled codes")
    _same(got.quantized.scales, want.quantized.scales, "compiled scales")
    _same(got.residual, want.residual, "compiled new residual")


@pytest.mark.gpu
def test_gpu_call_overhead_report(capsys):
    """Host cost per eager call (M=1 decode; printed, not asserted): raw TVM-FFI callable, the cute backend
    entry, the public op with backend='cute', and the same for triton."""
    from cute_ops import _compile, rmsnorm
    from dispatch import ops

    x, w, _ = (t.cuda() if t is not None else None for t in _gpu_inputs(1, 4096, residual=False))
    cfg = rmsnorm.pick_config(x.dtype, w.dtype, 4096, "none", False, 0.0, 16, False, False,
                              _compile.target_arch())
    fn = rmsnorm.compiled(cfg)
    y = torch.empty_like(x)

    import triton_ops.rmsnorm as tr
    from perf.runner import host_us_per_call as per_call

    rows = {
        "cute raw TVM-FFI call": per_call(lambda: fn(x, w, None, None, y, None, None, None, None, 1e-6, 1e-10)),
        "cute backend entry": per_call(lambda: rmsnorm.rms_norm(x, w, None, 1e-6, 0.0)),
        "triton backend entry": per_call(lambda: tr.rms_norm(x, w, None, 1e-6, 0.0)),
        "ops.rms_norm backend=cute": per_call(lambda: ops.rms_norm(x, w, backend="cute")),
        "ops.rms_norm auto": per_call(lambda: ops.rms_norm(x, w)),
        "ops.rms_norm backend=triton": per_call(lambda: ops.rms_norm(x, w, backend="triton")),
    }
    with capsys.disabled():
        print("\n[cute call overhead, us/call, M=1 K=4096 bf16]")
        for name, us in rows.items():
            print(f"  {name:32s} {us:7.2f}")
        print(f"  cache: {_compile.STATS}")
