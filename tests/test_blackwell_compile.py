"""Blackwell through Triton, compile-only (no GPU): one representative kernel of every Triton family, launched by its
own launcher (so with the constexprs, tiles, warps and stages a real call on that chip gets), compiled for sm_90a,
sm_100a, sm_103a, sm_120a and sm_121a, and its SASS checked for the instructions the family depends on (tensor-core
MMA per arch, hardware conversions, 16-byte loads, no local-memory spills, shared memory within the chip's).
Also: the hardware E2M1 conversion (triton_ops/blackwell.py) against the reference encoder and the native
block-scaled MMA Triton emits for tl.dot_scaled (the dispatch table on Blackwell: tests/test_dispatch_blackwell.py).
Results per chip: docs/blackwell.md. Nothing here runs a Blackwell GPU.

How the kernels are compiled: a fresh process per arch (conftest sets TRITON_INTERPRET=1 here, which makes every
@triton.jit an interpreter stand-in) with LOWBIT_ARCH=sm_XXX, so the launchers pick that arch's configs. Under
FakeTensorMode the launchers get fake CUDA tensors (metadata only), `JITFunction.run` is replaced by a recorder, and
each recorded launch goes through Triton's own argument binder for the target (the same specialization a launch
makes: 16-byte aligned pointers, integers divisible by 16, constexprs), then `triton.compile` for that target; the
cubin is disassembled with the nvdisasm / cuobjdump shipped in the Triton wheel. Expectations are Triton 3.9's (CI's);
older Triton is skipped (3.6, the GPU image's, cannot disassemble sm_121a and emits no QMMA/OMMA there).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import triton
import triton.language as tl

from dispatch.reference.formats import e2m1_encode
from tests.helpers import RUN_SLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_VERSION = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])
# The default run compiles for sm_100a and sm_120a, one chip of each Blackwell family; sm_103a and sm_121a compile as
# their family's sm_100a / sm_120a do (the same instructions checked), and sm_90a's kernels run in the GPU suite: the
# slow run adds all three.
ARCHS = (100, 120) + ((90, 103, 121) if RUN_SLOW else ())
SM100, SM120 = (100, 103), (120, 121)  # datacenter Blackwell (tcgen05) / consumer Blackwell (mma.sync)
# Shared memory one CTA may use (cudaDevAttrMaxSharedMemoryPerBlockOptin): H100/B200/B300 227 KB; RTX 50xx / RTX PRO
# 6000 / GB10 99 KB.
SHARED_LIMIT = {90: 232448, 100: 232448, 103: 232448, 120: 101376, 121: 101376}


# ------------------------------------------------------------------------------ probe kernels (not lowbit ops)


@triton.jit
def _native_dot_scaled_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, K, LHS: tl.constexpr, NVFP4: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c = dot_scaled(a [BM, K] in LHS, b [K, BN] e2m1): what Triton emits where both operands are narrow formats
    (lowbit's moe_gemm_mxfp4 dot_scaled=True feeds bf16 activations instead, which Triton upcasts)."""
    G: tl.constexpr = 16 if NVFP4 else 32
    PA: tl.constexpr = 2 if LHS == "e2m1" else 1
    m = tl.arange(0, BM)
    n = tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        ka = k0 // PA + tl.arange(0, BK // PA)
        kb = k0 // 2 + tl.arange(0, BK // 2)
        ks = k0 // G + tl.arange(0, BK // G)
        a = tl.load(a_ptr + m[:, None] * (K // PA) + ka[None, :])
        b = tl.load(b_ptr + kb[:, None] * BN + n[None, :])
        sa = tl.load(as_ptr + m[:, None] * (K // G) + ks[None, :])
        sb = tl.load(bs_ptr + n[:, None] * (K // G) + ks[None, :])
        acc = tl.dot_scaled(a, sa, LHS, b, sb, "e2m1", acc)
    tl.store(c_ptr + m[:, None] * BN + n[None, :], acc)


def launch_native_dot_scaled(lhs: str, nvfp4: bool, device="cuda"):
    """One launch of the probe (called under FakeTensorMode by the compile script)."""
    bm = bn = bk = 128
    k = 1024
    g = 16 if nvfp4 else 32
    sdt = torch.float8_e4m3fn if nvfp4 else torch.uint8
    a = torch.empty(bm, k // (2 if lhs == "e2m1" else 1), dtype=torch.uint8, device=device)
    b = torch.empty(k // 2, bn, dtype=torch.uint8, device=device)
    sa = torch.empty(bm, k // g, dtype=sdt, device=device)
    sb = torch.empty(bn, k // g, dtype=sdt, device=device)
    c = torch.empty(bm, bn, dtype=torch.float32, device=device)
    _native_dot_scaled_kernel[(1,)](a, sa, b, sb, c, k, LHS=lhs, NVFP4=nvfp4, BM=bm, BN=bn, BK=bk, num_warps=4,
                                    num_stages=2)


# ------------------------------------------------------------------------------ the compile script (per arch)

_COMPILE = textwrap.dedent("""
    import collections, json, os, re, subprocess, sys, tempfile
    os.environ.pop("TRITON_INTERPRET", None)  # real JITFunctions, not the interpreter's
    CC = int(sys.argv[1])
    os.environ["LOWBIT_ARCH"] = f"sm_{CC}"  # the launchers' arch_of(cuda tensor): this chip's configs
    import torch, triton
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    TARGET = GPUTarget("cuda", CC, 32)
    BACKEND = make_backend(TARGET)
    BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    LAUNCHES = []
    jit.JITFunction.run = lambda self, *args, grid, warmup, **kwargs: LAUNCHES.append((self, args, kwargs))
    # what the caching allocator gives: 256-byte aligned bases (launchers check alignment of views)
    FakeTensor.data_ptr = lambda self: (1 << 20) + self.storage_offset() * self.element_size()

    from triton_ops import blackwell, kv_cache, quant, rmsnorm, rope, swiglu
    from triton_ops.attention import decode, indexer, mla_decode, prefill
    from triton_ops.moe import align, routing
    from triton_ops.moe_gemm import fused, grouped
    from tests.test_blackwell_compile import launch_native_dot_scaled
    # decode's split rule reads the SM count: H100, B200, B300, RTX 5090, GB10
    decode._sm_count = mla_decode._sm_count = lambda index: {90: 132, 100: 148, 103: 148, 120: 170, 121: 48}[CC]

    bf, f32, i32, u8, e4m3 = torch.bfloat16, torch.float32, torch.int32, torch.uint8, torch.float8_e4m3fn
    def E(*shape, dt=bf):
        return torch.empty(*shape, dtype=dt, device="cuda")
    CASES = {  # prefill-sized calls (the steady-state configs), through each family's launcher
        "quant/nvfp4": lambda: quant.nvfp4_quantize(E(4096, 4096), None, True),
        "quant/mxfp4": lambda: quant.mxfp4_quantize(E(4096, 4096), "floor", True),
        "quant/fp8": lambda: quant.fp8_group_quantize(E(4096, 4096), 128, 1e-10, False, False),
        "rmsnorm": lambda: rmsnorm.rms_norm(E(4096, 7168), E(7168), E(4096, 7168), 1e-6, 0.0),
        "rmsnorm/nvfp4": lambda: rmsnorm.rms_norm_nvfp4(E(4096, 7168), E(7168), E(4096, 7168), 1e-6, 0.0,
                                                        E(1, dt=f32), True),
        "swiglu": lambda: swiglu.swiglu(E(4096, 5760), 1, "silu", 1.702, None, None, None, None),
        "rope": lambda: rope.rope_(E(4096, 64, 128), E(4096, 8, 128), E(4096, dt=torch.int64),
                                   E(8192, 128, dt=f32), 0, True, False),
        "kv_cache": lambda: kv_cache.paged_kv_write_fp8(E(4096, 8, 128), E(4096, dt=torch.int64),
                                                        E(1024, 16, 8, 128, dt=e4m3), E(1, dt=f32), None),
        "moe/align": lambda: align.moe_align(E(4096, 8, dt=i32), None, 256, 128),
        "moe/route": lambda: routing.moe_route(E(4096, 256, dt=f32), E(256, dt=f32), 8, "sigmoid", True, 2.5, 8, 4),
        "moe_gemm/bf16": lambda: grouped.moe_gemm_bf16(E(8192, 2048), E(32, 4096, 2048), E(8192, dt=i32), None),
        "moe_gemm/fp8": lambda: grouped.moe_gemm_fp8(E(8192, 2048, dt=e4m3), E(8192, 16, dt=f32),
                                                     E(32, 4096, 2048, dt=e4m3), E(32, 32, 16, dt=f32),
                                                     E(8192, dt=i32), None),
        "moe_gemm/mxfp4": lambda: grouped.moe_gemm_mxfp4(E(8192, 2880), E(32, 5760, 1440, dt=u8),
                                                         E(32, 5760, 90, dt=u8), E(8192, dt=i32), None),
        "moe_gemm/mxfp4_dot_scaled": lambda: grouped.moe_gemm_mxfp4(E(8192, 2880), E(32, 5760, 1440, dt=u8),
                                                                    E(32, 5760, 90, dt=u8), E(8192, dt=i32), None,
                                                                    dot_scaled=True),
        "moe_gemm/nvfp4": lambda: grouped.moe_gemm_nvfp4(E(8192, 2880), E(32, 5760, 1440, dt=u8),
                                                         E(32, 5760, 180, dt=u8), E(32, dt=f32), E(8192, dt=i32),
                                                         None),
        "moe_gemm/w4a8": lambda: grouped.moe_gemm_w4a8(E(8192, 2048, dt=e4m3), E(8192, 16, dt=f32),
                                                       E(32, 5760, 1024, dt=u8), E(32, 5760, 64, dt=u8),
                                                       E(8192, dt=i32), None),
        "moe_gemm/w4a4": lambda: grouped.moe_gemm_w4a4(E(8192, 1440, dt=u8), E(8192, 90, dt=u8),
                                                       E(32, 5760, 1440, dt=u8), E(32, 5760, 90, dt=u8),
                                                       E(8192, dt=i32), None),
        "moe_gemm/swiglu": lambda: fused.moe_gemm_swiglu(E(8192, 2048), None, E(32, 4096, 2048), None,
                                                         E(8192, dt=i32), None, "bf16", 0, "silu", 1.702, None),
        "attention/mla_decode": lambda: mla_decode.mla_decode(E(64, 1, 128, 576), E(4096, 64, 656, dt=u8),
                                                              E(64, 128, dt=i32), E(64, dt=i32), None, "v32", 512,
                                                              0.0417, True, -1, 0),
        "attention/prefill": lambda: prefill.attention_prefill(E(8192, 32, 128), E(8192, 8, 128), E(8192, 8, 128),
                                                               E(9, dt=i32), E(9, dt=i32), 1024, 1024, 0.088, True,
                                                               -1, -1, None, True),
        "attention/decode": lambda: decode.attention_decode(E(64, 1, 32, 128), E(4096, 16, 8, 128),
                                                            E(4096, 16, 8, 128), E(64, 64, dt=i32), E(64, dt=i32),
                                                            0.088, True, -1, -1, None, None, None, 0),
        "attention/decode_fp8": lambda: decode.attention_decode(E(16, 1, 32, 128), E(2048, 64, 8, 128, dt=e4m3),
                                                                E(2048, 64, 8, 128, dt=e4m3), E(16, 128, dt=i32),
                                                                E(16, dt=i32), 0.088, True, -1, -1, None, E(8, dt=f32),
                                                                E(8, dt=f32), 0),
        "attention/indexer": lambda: indexer.mla_index_scores(E(4, 2048, 64, 128), E(4, 2048, 128),
                                                              E(4, 2048, 64, dt=f32), 0.088,
                                                              E(4, 2048, 2048, dt=torch.bool)),
        "blackwell/e2m1x2_hw": lambda: blackwell.e2m1x2_pack_hw(E(1 << 20, dt=f32)),
        "probe/dot_scaled_mxfp4": lambda: launch_native_dot_scaled("e2m1", False),
        "probe/dot_scaled_nvfp4": lambda: launch_native_dot_scaled("e2m1", True),
        "probe/dot_scaled_mxfp8_mxfp4": lambda: launch_native_dot_scaled("e4m3", False),
    }

    class Ptr:  # a tensor argument as the binder sees it: dtype and address
        def __init__(self, t):
            self.dtype, self.address = t.dtype, t.data_ptr()
        def data_ptr(self):
            return self.address

    def tool(name, *args):
        return subprocess.run([os.path.join(BIN, name), *args], capture_output=True, text=True, check=True).stdout

    OPCODE = re.compile(r"/\\*[0-9a-f]{4,}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_]*(?:\\.[A-Z0-9_]+)*)")
    for case, call in CASES.items():
        LAUNCHES.clear()
        with FakeTensorMode(allow_non_fake_inputs=True):
            call()
        for kernel, args, kwargs in LAUNCHES:
            args = tuple(Ptr(a) if isinstance(a, torch.Tensor) else a for a in args)
            kwargs = {k: Ptr(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            bound, spec, opts = jit.create_function_from_signature(kernel.signature, kernel.params, BACKEND)(
                *args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(BACKEND, kwargs, bound, spec, opts)
            rec = {"case": case, "kernel": kernel.__name__}
            try:
                c = triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs, attrs), target=TARGET,
                                   options=options.__dict__)
            except Exception as e:  # e.g. ptxas refusing an instruction on this target: recorded, judged by the test
                lines = [l for l in str(e).splitlines() if "error" in l and "ptxas" in l] or [str(e)[-300:]]
                print("LOWBIT", json.dumps({**rec, "error": lines[0]}), flush=True)
                continue
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(c.asm["cubin"])
                f.flush()
                sass = tool("nvdisasm", "-c", f.name)
                usage = tool("cuobjdump", "-res-usage", f.name)
            regs, stack = (int(v) for v in re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups())
            rec.update(ops=collections.Counter(OPCODE.findall(sass)), shared=c.metadata.shared, regs=regs,
                       stack=stack, warps=options.num_warps, stages=options.num_stages)
            print("LOWBIT", json.dumps(rec), flush=True)  # (a failed compile prints its PTX)
""")


def _compile_arch(cc: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default Triton 3.9 warns about (and launches get)
    return subprocess.run([sys.executable, "-c", _COMPILE, str(cc)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def compiled() -> dict[int, dict[str, list[dict]]]:
    """cc -> case -> kernel records (one per launch of the case), compiled in parallel (one process per arch)."""
    if TRITON_VERSION < (3, 9):
        pytest.skip(f"Triton {triton.__version__}: the recorded SASS expectations are Triton 3.9's (CI's); 3.6's "
                    "nvdisasm cannot decode sm_121a")
    workers = max(1, min(len(ARCHS), os.cpu_count() or 1))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            procs = dict(zip(ARCHS, pool.map(_compile_arch, ARCHS), strict=True))
    except subprocess.TimeoutExpired:
        pytest.skip("compiling one arch took over 600 s on this host")
    out: dict[int, dict[str, list[dict]]] = {}
    for cc, proc in procs.items():
        if proc.returncode and ("ptxas" in proc.stderr or "No such file" in proc.stderr):
            pytest.skip(f"this Triton cannot compile CUDA on this host: {proc.stderr.strip().splitlines()[-1]}")
        assert proc.returncode == 0, f"sm_{cc}: {proc.stderr[-3000:]}"
        for line in proc.stdout.splitlines():
            if line.startswith("LOWBIT {"):
                rec = json.loads(line[len("LOWBIT "):])
                out.setdefault(cc, {}).setdefault(rec["case"], []).append(rec)
    return out


def _ops(records: list[dict]) -> set[str]:
    return {op for r in records for op in r.get("ops", ())}


def _has(ops: set[str], pattern: str) -> bool:
    return any(re.match(pattern, op) for op in ops)


# ------------------------------------------------------------------------------ expectations per family and chip

# case -> (archs, regexes every one of which must match an opcode of the case's kernels). Anchored at the opcode
# start; modifiers follow the dots (e.g. HMMA.16816.F32.BF16 = mma.sync m16n8k16, fp32 accumulate, bf16 operands).
_ALL = ARCHS
E4M3_ENCODE = r"F2FP\.SATFINITE\.E4M3\.F32\.PACK_AB_MERGE_C$"  # cvt.rn.satfinite.e4m3x2.f32
BF16_PACK = r"F2FP\.BF16\.F32\.PACK_AB$"  # cvt.rn.bf16x2.f32
E2M1_ENCODE = r"F2FP\.SATFINITE\.E2M1\.F32\.PACK_AB_MERGE_C$"  # cvt.rn.satfinite.e2m1x2.f32 (HW_FP4, sm_100+)
TCGEN05 = (r"UTCBAR$", r"LDTM")  # tcgen05.commit to an mbarrier; the accumulator read back from tensor memory
EXPECT: dict[str, list[tuple[tuple[int, ...], tuple[str, ...]]]] = {
    "quant/nvfp4": [(_ALL, (r"LDG\.E\.128$", E4M3_ENCODE, r"F2FP\.F16\.E4M3\.UNPACK_B$", r"MUFU\.RCP$")),
                    ((90, *SM120), (r"REDUX\.MAX\.S32$",)), (SM100, (r"CREDUX\.MAX\.S32$",)),
                    (SM100 + SM120, (E2M1_ENCODE,))],
    "quant/mxfp4": [(_ALL, (r"LDG\.E\.128$", r"SHFL\.BFLY$", r"STG\.E\.64$")), (SM100 + SM120, (E2M1_ENCODE,))],
    # fused RMSNorm -> NVFP4 (given global scale): hardware E4M3 block scales everywhere, E2M1 pairs from sm_100
    "rmsnorm/nvfp4": [(_ALL, (E4M3_ENCODE,)), (SM100 + SM120, (E2M1_ENCODE,))],
    "quant/fp8": [(_ALL, (r"LDG\.E\.128$", E4M3_ENCODE, r"STG\.E\.128$", r"SHFL\.BFLY$"))],
    # fp64 sum of squares and rsqrt by contract (docs/rmsnorm.md): DFMA + MUFU.RSQ64H on every chip
    "rmsnorm": [(_ALL, (r"LDG\.E\.128$", r"F2F\.F64\.BF16$", r"DFMA$", r"MUFU\.RSQ64H$", r"SHFL\.BFLY$", BF16_PACK))],
    "swiglu": [(_ALL, (r"LDG\.E\.128$", r"MUFU\.EX2$", r"MUFU\.RCP$", BF16_PACK, r"STG\.E\.128$"))],
    "rope": [(_ALL, (r"LDG\.E\.128$", BF16_PACK))],
    "kv_cache": [(_ALL, (E4M3_ENCODE, r"MUFU\.RCP$"))],
    "moe/align": [(_ALL, (r"ATOMS\.POPC\.INC\.32$", r"SHFL\.UP$", r"REDUX\.SUM\.S32$", r"BAR\.SYNC"))],
    "moe/route": [(_ALL, (r"MUFU\.EX2$", r"MUFU\.RCP$", r"SHFL\.BFLY$", r"LDG\.E\.128$")),
                  ((90, *SM120), (r"REDUX\.MAX\.S32$",)), (SM100, (r"CREDUX\.MAX\.F32$",))],
    # tensor cores: HGMMA = wgmma (sm_90a), UTC*MMA = tcgen05.mma (sm_100a/103a; H: 16-bit, Q: fp8, O: fp4), HMMA /
    # QMMA / OMMA = mma.sync (sm_120a/121a); all fed by cp.async (LDGSTS)
    "moe_gemm/bf16": [(_ALL, (r"LDGSTS\.E\.BYPASS\.128$",)), ((90,), (r"HGMMA\.64",)), (SM100, (r"UTCHMMA$", *TCGEN05)),
                      (SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    "moe_gemm/fp8": [(_ALL, (r"LDGSTS\.E\.BYPASS\.128$",)), ((90,), (r"QGMMA\.64",)), (SM100, (r"UTCQMMA$", *TCGEN05)),
                     (SM120, (r"QMMA\.16832\.F32\.E4M3\.E4M3$",))],
    "moe_gemm/mxfp4": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCHMMA$", *TCGEN05)),
                       (SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    # NVFP4 W4A16: e2m1 * e4m3 dequantized in registers (the E4M3 scales through the hardware e4m3 -> f16 convert),
    # then the bf16 grouped GEMM's tensor-core path
    "moe_gemm/nvfp4": [(_ALL, (r"F2FP\.F16\.E4M3\.UNPACK_B$",)), ((90,), (r"HGMMA\.64",)),
                       (SM100, (r"UTCHMMA$", *TCGEN05)), (SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    # bf16 activations x e2m1 weights: Triton upcasts the weights (hardware e2m1 -> bf16 on Blackwell) and runs the
    # 16-bit MMA; no native fp4 MMA (that needs both operands narrow: see the probes below)
    "moe_gemm/mxfp4_dot_scaled": [((90,), (r"HGMMA\.64",)),
                                  (SM100, (r"UTCHMMA$", r"F2FP\.BF16\.E2M1\.UNPACK_B$")),
                                  (SM120, (r"HMMA\.16816\.F32\.BF16$", r"F2FP\.BF16\.E2M1\.UNPACK_B$"))],
    # GEMM1 with SwiGLU in its epilogue: the bf16 grouped GEMM's tensor-core path
    "moe_gemm/swiglu": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCHMMA$", *TCGEN05)),
                        (SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    # MLA decode, FP8 latent dequantized in registers: 128 head rows per program with wgmma on sm_90a, 32 rows with
    # mma.sync on the other chips (as decode)
    "attention/mla_decode": [(_ALL, (r"MUFU\.EX2$",)), ((90,), (r"HGMMA\.64",)),
                             (SM100 + SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    # lowbit's dot_scaled FP4-weight GEMMs: the native block-scaled MMA on Blackwell where both operands are narrow
    "moe_gemm/w4a8": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCQMMA$", *TCGEN05)),
                      (SM120, (r"HMMA\.16816\.F32\.BF16$", r"F2FP\.BF16\.E4M3\.UNPACK_B$"))],
    "moe_gemm/w4a4": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCOMMA", *TCGEN05)),
                      (SM120, (r"OMMA\.SF\.16864\.F32\.E2M1\.E2M1\.E8$",))],
    "attention/prefill": [(_ALL, (r"MUFU\.EX2$", r"LDGSTS\.E\.BYPASS\.128$", BF16_PACK)), ((90,), (r"HGMMA\.64",)),
                          (SM100, (r"UTCHMMA$", *TCGEN05)), (SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    # decode: 16-64 packed rows per program, mma.sync on every chip (also Hopper)
    "attention/decode": [(_ALL, (r"HMMA\.16816\.F32\.BF16$", r"MUFU\.EX2$", r"LDGSTS\.E\.BYPASS\.128$"))],
    # FP8 cache: fp16 dots on hardware-converted codes, V converted before the operand layout (fp16 transposed
    # ldmatrix, never byte-wise shared loads: asserted below), 16-byte copies
    "attention/decode_fp8": [(_ALL, (r"HMMA\.16816\.F32$", r"F2FP\.F16\.E4M3\.UNPACK_B$", r"LDGSTS\.E\.BYPASS\.128$",
                                     r"LDSM\.16\.MT88\.4$"))],
    # V3.2 indexer scores: one 16-bit dot per head against the resident key tile (wgmma / tcgen05 / mma.sync)
    "attention/indexer": [(_ALL, (r"LDGSTS\.E\.BYPASS\.128$",)), ((90,), (r"HGMMA\.64",)), (SM100, (r"UTCHMMA$",)),
                          (SM120, (r"HMMA\.16816\.F32\.BF16$",))],
    "blackwell/e2m1x2_hw": [(SM100 + SM120, (r"F2FP\.SATFINITE\.E2M1\.F32\.PACK_AB_MERGE_C$",))],
    # tl.dot_scaled with both operands narrow: native block-scaled MMA on Blackwell (UTCOMMA / UTCQMMA =
    # tcgen05.mma.kind::mxf4(nvf4) / mxf8f6f4; OMMA.SF = mma.sync.kind::mxf4(nvf4).block_scale), upcast + 16-bit MMA
    # before
    "probe/dot_scaled_mxfp4": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCOMMA",)),
                               (SM120, (r"OMMA\.SF\.16864\.F32\.E2M1\.E2M1\.E8$",))],
    "probe/dot_scaled_nvfp4": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCOMMA\.(4X|BLOCK16)$",)),
                               (SM120, (r"OMMA\.SF\.16864\.F32\.E2M1\.E2M1\.UE4M3\.4X$",))],
    # mixed e4m3 x e2m1: native on sm_100a/103a; on sm_120a/121a Triton 3.9 upcasts both to bf16
    "probe/dot_scaled_mxfp8_mxfp4": [((90,), (r"HGMMA\.64",)), (SM100, (r"UTCQMMA$",)),
                                     (SM120, (r"HMMA\.16816\.F32\.BF16$", r"F2FP\.BF16\.E4M3\.UNPACK_B$"))],
}
# tensor-core instructions another chip's: wgmma (HGMMA/QGMMA) is sm_90a-only, tcgen05 (UTC*MMA) sm_100a/103a-only,
# block-scaled mma.sync (OMMA) sm_120a/121a-only; plain mma.sync (HMMA, QMMA) exists everywhere from sm_80 / sm_89
FOREIGN_MMA = {90: r"(UTC\w*MMA|OMMA)", 100: r"([HQ]GMMA|OMMA)", 103: r"([HQ]GMMA|OMMA)",
               120: r"([HQ]GMMA|UTC\w*MMA)", 121: r"([HQ]GMMA|UTC\w*MMA)"}

# Kernels that use local memory (STL/LDL: register spills) today, a known fact rather than a failure; every other
# compiled kernel must have none. (case, cc) -> why. Probes are not lowbit kernels and are not checked.
KNOWN_SPILLS = {
    # 128x128x128 fp8 prefill tile, 8 warps: 255 registers and 64-144 bytes of stack on every chip (likely cause: the
    # per-K-step rescale acc += dot * a_scale * w_scale holds each step's fp32 dot beside the accumulator)
    **{("moe_gemm/fp8", cc): "fp8 prefill tile: 255 registers + spills" for cc in ARCHS},
    # 2-stage bf16 prefill tile on the ~100 KB-smem chips (config.py _SMALL_SMEM_ARCHS): 255 registers, 8 bytes
    **{("moe_gemm/bf16", cc): "bf16 prefill tile, 2 stages: 255 registers + 8 bytes" for cc in (120, 121)},
    # W4A8 prefill tile on the consumer chips, where e4m3 x e2m1 has no native MMA and Triton upcasts both operands to
    # bf16 in registers: 255 registers, 512 bytes
    **{("moe_gemm/w4a8", cc): "W4A8 upcast prefill tile: 255 registers + 512 bytes" for cc in (120, 121)},
}


def _cases():
    for case, rules in EXPECT.items():
        for cc in ARCHS:
            if any(cc in archs for archs, _ in rules):
                yield pytest.param(case, cc, id=f"{case}-sm_{cc}")


@pytest.mark.parametrize("case,cc", list(_cases()))
def test_family_instructions(compiled, case, cc):
    """The instructions each family depends on, per chip (the tensor-core kind above all)."""
    records = compiled[cc].get(case)
    assert records, f"sm_{cc}: {case} was not compiled"
    errors = [r["error"] for r in records if "error" in r]
    assert not errors, f"sm_{cc} {case}: {errors}"
    ops = _ops(records)
    missing = [p for archs, patterns in EXPECT[case] if cc in archs for p in patterns if not _has(ops, p)]
    mma = sorted(op for op in ops if re.match(r"\w*MMA", op) and "HFMA" not in op)
    assert not missing, f"sm_{cc} {case}: no {missing} in the SASS (tensor-core ops: {mma})"
    foreign = [op for op in mma if re.match(FOREIGN_MMA[cc], op)]
    assert not foreign, f"sm_{cc} {case}: another chip's MMA {foreign}"
    if case == "attention/decode_fp8":
        assert not _has(ops, r"LDS\.U8$"), f"sm_{cc}: byte-wise shared loads in the FP8 decode"
    if case == "moe_gemm/mxfp4_dot_scaled":  # recorded fact: no native fp4 MMA for bf16 x e2m1
        assert not _has(ops, r"(UTCOMMA|OMMA|UTCQMMA|QMMA)"), f"sm_{cc}: {mma}"


HW_FP4_CASES = ("quant/nvfp4", "quant/mxfp4", "rmsnorm/nvfp4")


@pytest.mark.parametrize("cc", ARCHS)
@pytest.mark.parametrize("case", HW_FP4_CASES)
def test_hw_fp4_encode_only_from_sm_100(compiled, case, cc):
    """The FP4 kernels' E2M1 encode is the hardware pair convert where their launcher sets HW_FP4 (blackwell.hw_fp4:
    sm_100 and newer) and the software encode on sm_90a (HW_FP4 False: ptxas would refuse the instruction)."""
    records = compiled[cc].get(case)
    assert records and not [r for r in records if "error" in r], f"sm_{cc} {case}: {records}"
    assert _has(_ops(records), E2M1_ENCODE) == (cc >= 100), f"sm_{cc} {case}: E2M1 convert present: {cc < 100}"


@pytest.mark.slow  # needs the sm_90a compile, which the slow run adds (ARCHS)
def test_e2m1x2_hw_is_refused_before_blackwell(compiled):
    """ptxas has no E2M1 conversion for sm_90a: the helper must stay behind an arch constexpr."""
    (rec,) = compiled[90]["blackwell/e2m1x2_hw"]
    assert "cvt.e2m1x2.f32" in rec.get("error", "") and "sm_90a" in rec["error"], rec


@pytest.mark.parametrize("cc", ARCHS)
def test_no_local_memory_spills(compiled, cc):
    """No STL/LDL in the lowbit kernels, except the known ones (KNOWN_SPILLS), which must still spill (else update
    the list and docs/blackwell.md)."""
    spilling, unexpected = set(), []
    for case, records in compiled[cc].items():
        if case.startswith("probe/"):
            continue
        for r in records:
            if "ops" in r and _has(set(r["ops"]), r"(STL|LDL)"):
                spilling.add(case)
                if (case, cc) not in KNOWN_SPILLS:
                    unexpected.append(f"{case} ({r['kernel']}: {r['regs']} registers, {r['stack']} bytes stack)")
    assert not unexpected, f"sm_{cc}: local-memory spills in {unexpected}"
    known = {case for case, c in KNOWN_SPILLS if c == cc}
    assert known <= spilling, f"sm_{cc}: {sorted(known - spilling)} no longer spill: update KNOWN_SPILLS and the docs"


@pytest.mark.parametrize("cc", ARCHS)
def test_shared_memory_fits_the_chip(compiled, cc):
    """Static + pipelined shared memory of each kernel within what one CTA may use on that chip (the consumer
    parts have 99 KB: a config sized for 227 KB would fail at launch there)."""
    over = [f"{r['case']} {r['kernel']}: {r['shared']}" for rs in compiled[cc].values() for r in rs
            if r.get("shared", 0) > SHARED_LIMIT[cc]]
    assert not over, f"sm_{cc}: over {SHARED_LIMIT[cc]} bytes: {over}"


def test_every_family_compiles_for_every_arch(compiled):
    want = {case for case in EXPECT if case != "blackwell/e2m1x2_hw"}
    for cc in ARCHS:
        failed = {case for case, rs in compiled[cc].items() if any("error" in r for r in rs)}
        assert want <= set(compiled[cc]) and not (failed & want), f"sm_{cc}: missing {want - set(compiled[cc])}, " \
                                                                   f"failed {failed & want}"


# ------------------------------------------------------------------------------ E2M1 hardware conversion: rounding


def ptx_cvt_e2m1(x: torch.Tensor) -> torch.Tensor:
    """One E2M1 code (uint8, 0..15) per fp32 element as `cvt.rn.satfinite.e2m1x2.f32` defines it (PTX ISA `cvt`:
    round to nearest even; .satfinite: finite results, |x| > 6 and +-Inf -> +-6; NaN -> positive MAXNORM, 0x7, since
    E2M1 has no NaN), ported bit for bit from the host path of CUDA's __nv_cvt_double_to_fp4 (cuda_fp4.hpp, the
    software model NVIDIA ships beside the instruction): the value as fp64 bits, its exponent rebiased to E2M1's
    (bias 1) and its mantissa cut to one bit, then an RNE carry from the dropped bits; subnormal range (0.25, 1)
    shifted right with the implicit bit; |x| <= 0.25 -> 0; the sign bit kept everywhere but on NaN."""
    bits = x.to(torch.float64).view(torch.int64)
    sign = ((bits >> 63) & 1) << 3
    absx = bits & 0x7FFF_FFFF_FFFF_FFFF
    exp = ((bits >> 52) & 0x7FF) - 1023 + 1
    mant = (bits >> 51) & 1
    half = 1 << 50  # half an E2M1 ulp, at fp64 mantissa position
    rnd = bits & (2 * half - 1)
    normal = ((exp << 1) | mant) + ((rnd > half) | ((rnd == half) & (mant == 1))).long()
    shift = (1 - exp).clamp(0, 3)  # 1 or 2 in the subnormal range (others are discarded)
    sub = (mant | 2) >> shift
    rnd_sub = (bits | (1 << 52)) & ((half << (shift + 1)) - 1)
    half_sub = half << shift
    sub = sub + ((rnd_sub > half_sub) | ((rnd_sub == half_sub) & (sub & 1 == 1))).long()
    f64 = lambda v: torch.tensor(v, dtype=torch.float64).view(torch.int64)  # noqa: E731
    code = torch.where(absx >= f64(1.0), normal, sub)
    code = torch.where(absx <= f64(0.25), 0, code)
    code = torch.where(absx > f64(6.0), 7, code)
    sign = torch.where(absx > f64(float("inf")), 0, sign)  # NaN
    return (code | sign).to(torch.uint8)


def ptx_e2m1x2(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The pair byte of `cvt.rn.satfinite.e2m1x2.f32 d, a, b` (d[7:4] = cvt(a), d[3:0] = cvt(b)) as e2m1x2_hw issues
    it: a = hi, b = lo, so element 2i lands in the low nibble as in every lowbit FP4 layout."""
    return (ptx_cvt_e2m1(hi) << 4) | ptx_cvt_e2m1(lo)


def _representative_fp32() -> torch.Tensor:
    """Every bf16 bit pattern as fp32 (2^16 values: both signs, every exponent, zeros, subnormals, Inf, NaNs, and
    every E2M1 grid point and rounding tie exactly), plus the fp32 neighbours of each tie and grid point."""
    every_bf16 = (torch.arange(1 << 16, dtype=torch.int32) << 16).view(torch.float32)
    points = torch.tensor([0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    near = torch.cat([torch.nextafter(points, torch.tensor(0.0)), torch.nextafter(points, torch.tensor(8.0))])
    near = torch.cat([near, -near, torch.tensor([float.fromhex("0x1p-149"), -0.0, 3.4028234663852886e38])])
    return torch.cat([every_bf16, near])


def test_e2m1x2_hw_rounding_equals_the_reference_except_nan():
    """The instruction's documented conversion (modelled on the CPU) gives the reference encoder's codes on every
    representative fp32 input; the one difference is NaN (instruction: 0x7 = +6, reference: 0x0)."""
    from triton_ops.blackwell import HW_E2M1_NAN_CODE

    x = _representative_fp32()
    got, want = ptx_cvt_e2m1(x), e2m1_encode(x)
    nan = torch.isnan(x)
    assert nan.sum() == 2 * 127  # bf16 NaN payloads of both signs
    bad = (got != want) & ~nan
    assert not bad.any(), f"{int(bad.sum())} differ, e.g. {x[bad][:8].tolist()}: {got[bad][:8]} vs {want[bad][:8]}"
    assert (got[nan] == HW_E2M1_NAN_CODE).all() and (want[nan] == 0).all()
    # pair order: element 2i in the low nibble, as the reference packs
    lo, hi = x[: x.numel() // 2 * 2].view(-1, 2).unbind(1)
    ok = ~(torch.isnan(lo) | torch.isnan(hi))
    assert torch.equal(ptx_e2m1x2(lo, hi)[ok], (e2m1_encode(lo) | (e2m1_encode(hi) << 4))[ok])


def test_ptx_model_spot_values():
    """Hand-checked codes: ties to even, saturation, signed zero, NaN."""
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6.5, float("inf"), -0.1, -0.0, -7.0,
                      float("nan"), -float("nan")])
    assert ptx_cvt_e2m1(x).tolist() == [0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 8, 15, 7, 7]


# ------------------------------------------------------------------------------ HW_FP4: the kernels' bytes by the model
# On sm_100+ the FP4 kernels encode with the pair convert (HW_FP4, _formats.fp4_encode_pairs / fp4_encode_exact): the
# fast path feeds it q = x * inv where the block is good and +0.0 where it is bad (inv NaN), the exact path (zero, tiny
# or NaN NVFP4 global scale) q with NaN replaced by +0.0. No Blackwell GPU has run it; these tests apply the model of
# the instruction to exactly those values and compare with the reference encoder (e2m1_encode + pack_nibbles).


def _adversarial(dtype: torch.dtype) -> torch.Tensor:
    """[4, 128] rows of 16-element blocks (2 per MXFP4 block) that hit every input class with a scale of 1 (block
    amax 6: NVFP4 with global scale 1, MXFP4 floor and rceil): every E2M1 tie and grid point of both signs, +-0,
    values below the smallest code, fp32 neighbours of ties, +-Inf blocks (NVFP4: a saturated 448 scale and Inf
    inputs; MXFP4: bad blocks), NaN blocks (bad blocks), fp32 subnormals and random finite values."""
    inf, nan = float("inf"), float("nan")
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    grid = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    near = torch.tensor(ties)
    up, down = torch.nextafter(near, torch.tensor(9.0)).tolist(), torch.nextafter(near, torch.tensor(0.0)).tolist()
    blocks = [
        [6.0, *ties, *[-t for t in ties], -6.0],
        [*grid, *[-g for g in grid], 0.0, -0.0],
        [6.0, *up, *[-d for d in down], -0.0],
        [6.0, 0.0, -0.0, 1e-30, -1e-30, 0.2, -0.2, 0.26, -0.26, 5.9, -5.9, 6.0, -6.0, 0.1, -0.1, 0.7],
        [inf, 1.0, -1.0, 0.0, -0.0, 6.0, -6.0, 1e30, -1e30, 2.5, -2.5, 3.0, 0.25, -0.25, 1e-3, -1e-3],
        [-inf, inf, 1.0, -2.0, 0.0, -0.0, 3.0, -3.0, 0.5, -0.5, 5.0, -5.0, 1.75, -1.75, 6.0, -6.0],
        [nan, 1.0, -1.0, 0.0, -0.0, 6.0, -6.0, inf, -inf, 2.5, -2.5, 3.0, 0.25, -0.25, 1e-3, -1e-3],
        [-nan, *ties, *grid, -0.0],
        [1e-40, -1e-40, 6.0, *up[:6], *[-u for u in up[:7]]],
        [6.0, 3e38, -3e38, 1e-38, -1e-38, 1e-45, -1e-45, 0.0, *down, -0.0],
    ]
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([v for b in blocks for v in b], dtype=torch.float32)
    assert rows.numel() == 160
    rnd = torch.randn(512 - 160, generator=g) * torch.exp2(torch.randint(-8, 8, (512 - 160,), generator=g))
    return torch.cat([rows, rnd]).reshape(4, 128).to(dtype)


def _kernel_scaled_values(x: torch.Tensor, fmt: str, arg) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(q = x * inv [rows, blocks, block] in fp32, inv [rows, blocks], fast) as the FP4 quantize kernel forms them
    (the block-scale rules are the reference's, byte-equal to the kernels' by tests/test_quant.py); fast: the
    kernel's fast path (always for MXFP4; NVFP4 where |1 / effective gs| < 2^100)."""
    from dispatch.reference import quant as ref
    from dispatch.reference.formats import bits_float, div_rn, reciprocal_rn
    from dispatch.reference.formats import e4m3_encode as ref_e4m3
    from triton_ops.contract.formats import NVFP4_MIN_GLOBAL_SCALE

    block = 16 if fmt == "nvfp4" else 32
    xb = x.float().reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1)
    if fmt == "nvfp4":
        gs = ref.nvfp4_global_scale(x) if arg is None else arg.reshape(()).float()
        tiny = gs.abs() < NVFP4_MIN_GLOBAL_SCALE
        s = torch.where(tiny, torch.zeros_like(amax), div_rn(div_rn(amax, 6.0), gs))
        s32 = ref_e4m3(s).float()
        inv = torch.where(s32 == 0, torch.zeros_like(s32), torch.div(reciprocal_rn(gs), s32))
        gs_eff = torch.where(tiny, torch.zeros_like(gs), gs)
        fast = bool((div_rn(torch.ones(()), gs_eff).abs() < 2.0**100).item())
    else:
        e = ref.mxfp4_scale_exponent(amax, arg)
        finite = torch.isfinite(amax)
        inv = torch.where(finite, bits_float((127 - e) << 23), torch.full_like(amax, float("nan")))
        fast = True
    return xb * inv[..., None], inv, fast


NVFP4_GS = {"computed": None, "one": 1.0, "saturating": 0.01, "zero": 0.0, "tiny": 1e-40, "min_plus": 2.0**-117.5,
            "nan": float("nan"), "negative": -1.0}
FP4_CALLS = [("nvfp4", name) for name in NVFP4_GS] + [("mxfp4", "floor"), ("mxfp4", "rceil")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt,mode", FP4_CALLS)
def test_hw_fp4_bytes_equal_the_reference_by_the_ptx_model(fmt, mode, dtype):
    """The pair convert (modelled) on the values each HW_FP4 path feeds it gives the reference's code bytes on every
    input class: finite, ties, +-0, +-Inf (saturated to +-6 with the sign, or a bad MXFP4 block), NaN (bad blocks:
    0x00), saturating scales, zero / tiny / NaN global scales (the exact path). Without the select, the instruction
    would write 0x7 in bad blocks (checked, so the select is what makes the bytes equal)."""
    from dispatch.reference import quant as ref

    x = _adversarial(dtype)
    if fmt == "nvfp4":
        gs = None if NVFP4_GS[mode] is None else torch.tensor(NVFP4_GS[mode])
        want = ref.nvfp4_quantize(x, gs, False)[0]
        arg = gs
    else:
        want = ref.mxfp4_quantize(x, mode, False)[0]
        arg = mode
    q, inv, fast = _kernel_scaled_values(x, fmt, arg)
    ok = (inv == inv)[..., None]
    if fast:
        # the fast path's precondition (the kernel's comment): q is NaN only in bad blocks
        assert not (torch.isnan(q) & ok).any()
        v = torch.where(ok, q, 0.0)
    else:
        v = torch.where(q == q, q, 0.0)
    v = v.reshape(x.shape[0], -1)
    got = ptx_e2m1x2(v[:, 0::2], v[:, 1::2])
    assert torch.equal(got, want), (got != want).nonzero()[:8]
    qf = q.reshape(x.shape[0], -1)
    raw = ptx_e2m1x2(qf[:, 0::2], qf[:, 1::2])
    if torch.isnan(q).any():
        assert not torch.equal(raw, want)  # the NaN lanes are why the HW path selects +0.0 first


@triton.jit
def _ptx_cvt_e2m1_tl(x):
    """ptx_cvt_e2m1 in Triton ops on fp32 bits (the fp64 model's bit positions minus 29, exponent bias 127): the
    instruction's stand-in under the interpreter, which cannot run inline PTX."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 31) & 1) << 3
    absx = bits & 0x7FFFFFFF
    exp = ((bits >> 23) & 0xFF) - 126
    mant = (bits >> 22) & 1
    rnd = bits & 0x3FFFFF
    normal = ((exp << 1) | mant) + ((rnd > 0x200000) | ((rnd == 0x200000) & (mant == 1))).to(tl.int32)
    shift = tl.minimum(tl.maximum(1 - exp, 0), 3)
    sub = (mant | 2) >> shift
    rnd_sub = (bits | 0x800000) & ((0x200000 << (shift + 1)) - 1)
    half_sub = 0x200000 << shift
    sub = sub + ((rnd_sub > half_sub) | ((rnd_sub == half_sub) & ((sub & 1) == 1))).to(tl.int32)
    code = tl.where(absx >= 0x3F800000, normal, sub)
    code = tl.where(absx <= 0x3E800000, 0, code)
    code = tl.where(absx > 0x40C00000, 7, code)
    sign = tl.where(absx > 0x7F800000, 0, sign)
    return code | sign


@triton.jit
def _e2m1x2_model_tl(lo, hi):
    """blackwell.e2m1x2_hw by the model: (code(hi) << 4) | code(lo) as uint8."""
    return ((_ptx_cvt_e2m1_tl(hi) << 4) | _ptx_cvt_e2m1_tl(lo)).to(tl.uint8)


@triton.jit
def _e2m1x2_model_kernel(x_ptr, out_ptr, n_pairs, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_pairs
    lo = tl.load(x_ptr + 2 * offs, mask=mask, other=0.0)
    hi = tl.load(x_ptr + 2 * offs + 1, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _e2m1x2_model_tl(lo, hi), mask=mask)


@pytest.fixture
def hw_fp4_interpreted(monkeypatch):
    """The launchers set HW_FP4 on host tensors and the kernels' e2m1x2_hw is the Triton port of the model (checked
    against the torch model first), so the interpreter runs the HW_FP4 code of every FP4 kernel."""
    import triton_ops._formats as formats
    from triton_ops import quant, rmsnorm, swiglu

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the interpreter (host tensors)")
    x = _representative_fp32()
    x = x[: x.numel() // 2 * 2].contiguous()
    out = torch.empty(x.numel() // 2, dtype=torch.uint8)
    _e2m1x2_model_kernel[(triton.cdiv(out.numel(), 8192),)](x, out, out.numel(), BLOCK=8192)
    lo, hi = x.view(-1, 2).unbind(1)
    assert torch.equal(out, ptx_e2m1x2(lo, hi))
    for mod in (quant, rmsnorm, swiglu):
        monkeypatch.setattr(mod, "hw_fp4", lambda device: True)

    def use(model):
        monkeypatch.setattr(formats, "e2m1x2_hw", model)
    use(_e2m1x2_model_tl)
    return use


@triton.jit
def _constant_byte(lo, hi):
    return (lo * 0.0).to(tl.int32).to(tl.uint8) | 0x5A


def test_hw_fp4_kernels_interpreted_equal_the_reference(hw_fp4_interpreted):
    """The quantize kernels with HW_FP4 = True (the instruction by its model) give the reference's bytes on the
    adversarial rows, for every NVFP4 global-scale class (fast and exact paths) and both MXFP4 roundings; a constant
    stand-in shows the HW_FP4 branch is the one that ran."""
    from dispatch.reference import quant as ref
    from triton_ops import quant

    for dtype in (torch.bfloat16, torch.float32):
        x = _adversarial(dtype)
        for mode, g in NVFP4_GS.items():
            gs = None if g is None else torch.tensor(g)
            got = quant.nvfp4_quantize(x, gs, False)
            want = ref.nvfp4_quantize(x, gs, False)
            assert torch.equal(got[0], want[0]), f"{dtype} nvfp4 {mode}"
            assert torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8)), f"{dtype} nvfp4 {mode}"
        for rounding in ("floor", "rceil"):
            got = quant.mxfp4_quantize(x, rounding, True)
            want = ref.mxfp4_quantize(x, rounding, True)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"{dtype} mxfp4 {rounding}"
    hw_fp4_interpreted(_constant_byte)
    x = _adversarial(torch.bfloat16)
    assert (quant.nvfp4_quantize(x, torch.tensor(1.0), False)[0] == 0x5A).all()  # fast path
    assert (quant.nvfp4_quantize(x, torch.tensor(0.0), False)[0] == 0x5A).all()  # exact path
    assert (quant.mxfp4_quantize(x, "floor", False)[0] == 0x5A).all()


def test_hw_fp4_fused_kernels_interpreted_equal_the_software_path(hw_fp4_interpreted, monkeypatch):
    """RMSNorm and SwiGLU with FP4 outputs: HW_FP4 = True (model) gives the software path's bytes (which
    tests/test_rmsnorm.py and tests/test_swiglu.py hold equal to the reference)."""
    from triton_ops import rmsnorm, swiglu

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 256, generator=g) * 3).to(torch.bfloat16)
    x[1, 7] = float("inf")
    x[2, 40] = float("nan")
    x[3, :32] = 0.0
    w = (torch.rand(256, generator=g) + 0.5).to(torch.bfloat16)
    res = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    xs = (torch.randn(4, 512, generator=g) * 4).to(torch.bfloat16)
    xs[0, 3] = float("nan")
    calls = {
        "rms_norm_nvfp4": lambda: rmsnorm.rms_norm_nvfp4(x, w, res, 1e-6, 0.0, torch.tensor(0.05), True),
        "rms_norm_nvfp4 computed": lambda: rmsnorm.rms_norm_nvfp4(x, w, None, 1e-6, 0.0, None, False),
        "rms_norm_nvfp4 zero gs": lambda: rmsnorm.rms_norm_nvfp4(x, w, None, 1e-6, 0.0, torch.tensor(0.0), False),
        "rms_norm_mxfp4": lambda: rmsnorm.rms_norm_mxfp4(x, w, res, 1e-6, 0.0, "rceil", False),
        "swiglu_mxfp4": lambda: swiglu.swiglu_mxfp4(xs, 1, "silu", 1.702, None, None, None, None, "floor", False),
        "swiglu_nvfp4": lambda: swiglu.swiglu_nvfp4(xs, 1, "silu", 1.702, None, None, None, None,
                                                    torch.tensor(0.02), False),
    }
    hw = {name: call() for name, call in calls.items()}
    for mod in (rmsnorm, swiglu):
        monkeypatch.setattr(mod, "hw_fp4", lambda device: False)
    for name, call in calls.items():
        sw = call()
        for a, b in zip(hw[name], sw, strict=True):
            assert (a is None and b is None) or torch.equal(a.reshape(-1).view(torch.uint8),
                                                            b.reshape(-1).view(torch.uint8)), name
    for mod in (rmsnorm, swiglu):  # and the HW_FP4 branch is the one that ran
        monkeypatch.setattr(mod, "hw_fp4", lambda device: True)
    hw_fp4_interpreted(_constant_byte)
    for name in ("rms_norm_nvfp4", "rms_norm_nvfp4 zero gs", "rms_norm_mxfp4", "swiglu_mxfp4", "swiglu_nvfp4"):
        assert (calls[name]()[0] == 0x5A).all(), name


@pytest.mark.gpu
def test_e2m1x2_hw_on_blackwell_matches_the_model():
    """On a Blackwell GPU (none has run this yet): the instruction's bytes against the model, NaNs included."""
    from triton_ops.blackwell import HW_E2M1_ARCHS, e2m1x2_pack_hw
    from triton_ops.contract.arch import resolve_arch

    if resolve_arch() not in HW_E2M1_ARCHS:
        pytest.skip(f"{resolve_arch()} has no cvt.e2m1x2 (Blackwell only)")
    x = _representative_fp32()
    x = x[: x.numel() // 2 * 2]
    got = e2m1x2_pack_hw(x.cuda()).cpu()
    lo, hi = x.view(-1, 2).unbind(1)
    assert torch.equal(got, ptx_e2m1x2(lo, hi))
