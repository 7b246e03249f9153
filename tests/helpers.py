"""Helpers shared by the op test files: devices, value strategies, byte comparison, tolerances."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from dispatch.selfcheck import logical_bytes

ON_GPU = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]
# Under the interpreter the Triton backend is the one to test; on a GPU, auto must pick it too.
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DISTRIBUTIONS = ("normal", "heavy_tail", "subnormal", "zero_blocks", "mixed_scale", "ties")


# `--run-slow` (tests/conftest.py sets LOWBIT_SLOW=1 for it) or LOWBIT_SLOW=1: the long property runs.
RUN_SLOW = os.environ.get("LOWBIT_SLOW") == "1"
CI_EXAMPLES = 8


def examples(long: int) -> int:
    """A property test's example count: `long` on a GPU and in the slow runs; at most CI_EXAMPLES in the default
    CPU run, where every example runs the Triton interpreter."""
    return long if RUN_SLOW or ON_GPU else min(long, CI_EXAMPLES)


def _host_bf16_reason() -> str | None:
    """Why CuTe device code cannot run on this host, or None. LLVM lowers an f32 -> bf16 conversion on x86 to a
    call of libgcc's `__truncsfbf2`, which libgcc exports from GCC 13 on; GCC 12's (Debian 12) lacks it, so the
    host-executed CuTe functions that round to bf16 fail to link in the JIT there."""
    try:
        libgcc = ctypes.CDLL("libgcc_s.so.1")
    except OSError as e:
        return f"libgcc_s.so.1 not loadable ({e})"
    if not hasattr(libgcc, "__truncsfbf2"):
        return "host libgcc lacks __truncsfbf2 (GCC < 13): CuTe code that rounds to bf16 cannot run on this host"
    return None


HOST_BF16_REASON = _host_bf16_reason()
needs_host_bf16 = pytest.mark.skipif(HOST_BF16_REASON is not None, reason=str(HOST_BF16_REASON))


def make_values(rows: int, k: int, dist: str, seed: int, block: int = 16) -> torch.Tensor:
    """fp32 [rows, k] drawn from a named distribution (never all zeros unless the dist says so)."""
    g = np.random.default_rng(seed)
    if dist == "normal":
        x = g.standard_normal((rows, k))
    elif dist == "heavy_tail":  # student-t with 1.5 dof: rare huge outliers inside ordinary blocks
        x = g.standard_t(1.5, (rows, k)) * 3
    elif dist == "subnormal":  # values near and below the fp16/bf16/e4m3 subnormal ranges
        x = g.standard_normal((rows, k)) * 10.0 ** g.uniform(-42, -3, (rows, 1))
    elif dist == "zero_blocks":  # some whole blocks zero, some single nonzero elements
        x = g.standard_normal((rows, k))
        nb = k // block
        zero = g.random((rows, nb)) < 0.4
        x = x.reshape(rows, nb, block)
        x[zero] = 0.0
        x = x.reshape(rows, k)
    elif dist == "mixed_scale":  # every row at its own magnitude, 1e-6 .. 1e4
        x = g.standard_normal((rows, k)) * 10.0 ** g.uniform(-6, 4, (rows, 1))
    elif dist == "ties":  # exact E2M1 / E4M3 midpoints and grid values after scaling
        grid = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 3.0, 4.0, 0.0, 7.0])
        x = g.choice(grid, (rows, k)) * g.choice([-1.0, 1.0], (rows, k))
        x[:, ::block] = 6.0  # pin the block amax so the scale is exact and midpoints stay midpoints
    else:
        raise ValueError(dist)
    return torch.from_numpy(x.astype(np.float32))


@st.composite
def float_inputs(draw, *, block: int, max_rows: int = 40, k_choices=(1, 2, 3, 4, 5, 8, 13), strided=True):
    """(x, description): x on CPU in a drawn float dtype, shape [*lead, K], possibly a strided view."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    k = block * draw(st.sampled_from(k_choices))
    lead = draw(st.sampled_from([(), (0,), (1,), (3,), (2, 5), (max_rows,), (2, 3, 4)]))
    rows = int(np.prod(lead)) if lead else 1
    dist = draw(st.sampled_from(DISTRIBUTIONS))
    seed = draw(st.integers(0, 2**31 - 1))
    layout = draw(st.sampled_from(["contiguous", "row_slice", "row_step"] if strided else ["contiguous"]))
    vals = make_values(rows, k, dist, seed, block)
    if layout == "row_slice":  # x = wide[:, :k] of a wider buffer
        wide = make_values(rows, k + 2 * block, "normal", seed + 1, block)
        wide[:, :k] = vals
        x = wide.to(dtype)[:, :k]
    elif layout == "row_step":  # every other row of a taller buffer
        tall = make_values(2 * rows, k, "normal", seed + 1, block)
        tall[::2] = vals
        x = tall.to(dtype)[::2]
    else:
        x = vals.to(dtype)
    x = x.reshape(*lead, k) if lead else x.reshape(k)
    return x, f"{dtype} {tuple(x.shape)} {dist} {layout}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Logical-order bytes on the CPU (NaN payloads canonicalized: dispatch.selfcheck.logical_bytes)."""
    return logical_bytes(t).cpu()


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    a, b = as_bytes(got), as_bytes(want)
    bad = (a != b).nonzero()
    if len(bad):
        i = int(bad[0])
        raise AssertionError(f"{what}: {len(bad)}/{a.numel()} bytes differ; first at flat byte {i}: "
                             f"got {int(a[i]):#04x}, want {int(b[i]):#04x}")


def assert_graph_replay_matches_eager(fn, what: str = "graph replay") -> None:
    """Capture `fn` (a lowbit call) in a CUDA graph, replay it, and require the same bytes as an eager call, for
    every tensor in its (possibly nested) output; a None output (e.g. no new residual) must be None in both."""
    eager = fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(eager), strict=True):
        if a is None or b is None:
            assert a is None and b is None, what
            continue
        assert_same_bytes(a, b, what)


# Float outputs that are not bit-reproducible (accumulations in another order: attention, GEMMs, softmax sums) are
# compared by one rule everywhere: the normalized error max|got - want| / max(max|want|, tiny) against the
# reference evaluated in fp32/fp64, with a tolerance per output dtype (a few units of its rounding error, times
# the accumulation depth's growth for fp32). Non-finite reference values must be matched exactly.
NORMALIZED_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def normalized_error(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    finite = torch.isfinite(w)
    if not finite.any():
        return 0.0
    scale = max(float(w[finite].abs().max()), 1e-30)
    return float((g[finite] - w[finite]).abs().max()) / scale


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, dtype: torch.dtype | None = None,
                 factor: float = 1.0) -> None:
    """got ~ want by the normalized error, within NORMALIZED_TOLERANCE[dtype or got.dtype] * factor; positions
    where want is NaN/+-Inf must hold the same value in got."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    special = ~torch.isfinite(w)
    if special.any():
        same = (g[special] == w[special]) | (torch.isnan(g[special]) & torch.isnan(w[special]))
        assert bool(same.all()), f"{what}: non-finite reference values not matched at {int((~same).sum())} places"
    assert bool(torch.isfinite(g[~special]).all()), f"{what}: non-finite values where the reference is finite"
    tol = NORMALIZED_TOLERANCE[dtype or got.dtype] * factor
    err = normalized_error(g, w)
    assert err <= tol, f"{what}: normalized error {err:.3g} > {tol:.3g}"


# Per-element tolerances, for fp32 outputs that are each a separately meaningful value (router weights: one wrong
# weight among thousands would hide inside a normalized error).
ELEMENTWISE_TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-12)}


def assert_close_elementwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """got ~ want element by element within ELEMENTWISE_TOLERANCE[want.dtype]; NaN where want is NaN."""
    torch.testing.assert_close(got.detach().cpu(), want.detach().cpu(), **ELEMENTWISE_TOLERANCE[want.dtype],
                               equal_nan=True, msg=lambda m: f"{what}: {m}")


LSE_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-3}  # absolute, natural log


def assert_attention_close(out, lse, want_out, want_lse, what: str) -> None:
    """Attention results: out by `assert_close` (normalized error, the output dtype's tolerance) and no NaN; lse -inf
    exactly where the reference's is, elsewhere within LSE_TOLERANCE of the output dtype (absolute)."""
    out, lse = out.detach().cpu(), lse.detach().cpu()
    assert out.dtype == want_out.dtype, f"{what}: out dtype {out.dtype} != {want_out.dtype}"
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32, f"{what}: lse {lse.shape}/{lse.dtype}"
    assert not torch.isnan(out).any(), f"{what}: NaN in out ({int(torch.isnan(out).sum())} elements)"
    assert_close(out, want_out.cpu(), what)
    ninf = torch.isneginf(want_lse.cpu())
    assert torch.equal(torch.isneginf(lse), ninf), \
        f"{what}: lse -inf at {torch.isneginf(lse).nonzero().tolist()}, reference at {ninf.nonzero().tolist()}"
    if (~ninf).any():
        err = float((lse[~ninf] - want_lse.cpu()[~ninf]).abs().max())
        assert err <= LSE_TOLERANCE[out.dtype], f"{what}: lse abs error {err:.3e} > {LSE_TOLERANCE[out.dtype]}"


def run_compile_script(script: str, timeout: int) -> str:
    """Run a GPU-compile script (Python source) in a fresh process without TRITON_INTERPRET (the interpreter's
    kernels cannot be compiled) from the repository root; its stdout. Skips the test where this host's Triton
    cannot compile CUDA or the compile outlasts `timeout` seconds."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.skip(f"compiling for the GPU took over {timeout} s on this host")
    if proc.returncode and ("ptxas" in proc.stderr or "No such file" in proc.stderr):
        pytest.skip(f"this Triton cannot compile CUDA on this host: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def random_block_table(g, batch: int, max_blocks: int, num_blocks: int, lens, block_size: int,
                       bad_entries=()) -> torch.Tensor:
    """int32 (batch, max_blocks) block table of a paged-cache test: each sequence owns a random permutation of
    the cache's blocks for its used pages; the unused tail holds garbage ids (-1, num_blocks, +-2^30) that must
    never be read. bad_entries: (b, block index, id) written in afterwards (g: a numpy Generator)."""
    bt = torch.from_numpy(g.permutation(num_blocks)[: batch * max_blocks].reshape(batch, max_blocks).astype(np.int32))
    for b, n in enumerate(lens):
        used = -(-n // block_size)
        bt[b, used:] = torch.from_numpy(g.choice([-1, num_blocks, 2**30, -(2**30)], max_blocks - used).astype(np.int32))
    for b, i, page in bad_entries:
        bt[b, i] = page
    return bt


def fp4_grouped_operands(fmt: str, m: int, g: int, n: int, k: int, seed: int = 0):
    """Grouped FP4 GEMM operands quantized by the reference quantizers with 128x4-swizzled scales: a [m, K/2],
    its scales, b [g, n, K/2], per-group scales (uint8 bytes), and the fp32 dequantizations (deq_a, [deq_b per
    group]); x ~ 3 N(0, 1), w ~ N(0, 1)."""
    from dispatch.reference import quant

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * 3
    w = torch.randn(g, n, k, generator=gen)
    if fmt == "nvfp4":
        gs = torch.tensor(1.0)
        a, sfa, _ = quant.nvfp4_quantize(x, gs, swizzle=True)
        bq = [quant.nvfp4_quantize(w[e], gs, swizzle=True) for e in range(g)]
        deq_a = quant.nvfp4_dequantize(a, sfa, gs, True, torch.float32)
        deq_b = [quant.nvfp4_dequantize(c, s, gs, True, torch.float32) for c, s, _ in bq]
    else:
        a, sfa = quant.mxfp4_quantize(x, "floor", swizzle=True)
        bq = [quant.mxfp4_quantize(w[e], "floor", swizzle=True) for e in range(g)]
        deq_a = quant.mxfp4_dequantize(a, sfa, True, torch.float32)
        deq_b = [quant.mxfp4_dequantize(c, s, True, torch.float32) for c, s in bq]
    b = torch.stack([q[0] for q in bq])
    sfb = torch.stack([q[1].view(torch.uint8) for q in bq])
    return a, sfa.view(torch.uint8), b, sfb, deq_a, deq_b


def sass_stats(cubin: bytes) -> dict | None:
    """Counts from the SASS of a Hopper cubin (None without cuobjdump / nvdisasm): HGMMA (and per shape, and with
    the A operand in registers), UTMALDG,
    SYNCS (mbarrier), BAR.SYNC, STL / LDL (spills), `wait0` (WARPGROUP.DEPBAR.LE gsb0, 0x0: one per HGMMA when
    ptxas serializes wgmma) and `ex2_between_waits`: the MUFU.EX2 count between each `wait for S` (DEPBAR.LE gsb0,
    0x1) and the next wgmma wait (the softmax overlapping an MMA)."""
    import collections
    import os
    import re
    import tempfile
    from pathlib import Path

    from cute_ops._sass import disassemble, find_tool

    if not (find_tool("cuobjdump") or find_tool("nvdisasm")):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        text = disassemble(Path(f.name))
    finally:
        os.unlink(f.name)
    op = r"^\s*(?:/\*[0-9a-f]+\*/)?\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)"
    ins = [m.group(1) for m in re.finditer(op, text, re.M)]
    windows, inside = [], None
    for line in text.splitlines():
        if "DEPBAR.LE" in line and "gsb0" in line:
            if inside is not None:
                windows.append(inside)
            inside = 0 if "0x1" in line else None
        elif inside is not None and "MUFU.EX2" in line:
            inside += 1
    shapes = collections.Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", text))
    return {"HGMMA": text.count("HGMMA."), "HGMMA_shapes": dict(shapes), "UTMALDG": text.count("UTMALDG"),
            "HGMMA_regA": len(re.findall(r"HGMMA\.\S+\s+R\d+,\s+R\d+", text)),  # A operand from registers
            "SYNCS": text.count("SYNCS."), "BAR": text.count("BAR.SYNC"), "wait0": text.count("DEPBAR.LE gsb0, 0x0"),
            "STL": sum(i.startswith("STL") for i in ins), "LDL": sum(i.startswith("LDL") for i in ins),
            "ex2_between_waits": windows}
