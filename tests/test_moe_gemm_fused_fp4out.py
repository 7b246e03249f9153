"""MoE GEMM1 + SwiGLU with an MXFP4 / NVFP4 output (triton_ops/moe_gemm/fused.py: moe_gemm_swiglu_mxfp4 / _nvfp4).

The contract is the unfused chain moe_gemm_<kind> -> swiglu_mxfp4 / swiglu_nvfp4. With operands whose every partial
sum is exact in fp32 (tests/test_moe_gemm_fused.py:_exact_operands) the fused bytes must equal the chain of our own
kernels byte for byte: codes, linear or 128x4-swizzled scales (padding rows and columns of the container included)
and the returned global scale. Layouts hold a padding row, an out-of-range expert id and an expert with no rows;
rows the kernel must not read hold NaN. Random operands are compared with the reference (dequantized, at the GEMM
tolerance)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.reference import moe_gemm as ref
from dispatch.reference import quant as rq
from dispatch.reference.moe import moe_align
from tests.helpers import DEVICES, assert_close, assert_same_bytes, examples, run_compile_script
from tests.test_moe_gemm_fused import FUSED_KINDS, _chain_gemm, _exact_operands, _random_operands, _weights
from triton_ops import swiglu as tsw
from triton_ops.contract.checks import LowbitInputError
from triton_ops.moe_gemm import fused, grouped
from triton_ops.moe_gemm.config import MoeGemmConfig

# ---------------------------------------------------------------------------------------------- operands


def _layout(g, e, masked, rows, device):
    """(ids kwargs, dead rows, lead shape): contiguous rows from moe_align (padding rows) over experts 0 .. e-2
    only (expert e-1 has none) with an out-of-range id on a real row; or masked counts 0, partial, over max_m."""
    if masked:
        counts = torch.tensor([[0, rows // 2, rows + 3][x % 3] for x in range(e)], dtype=torch.int32)
        dead = torch.arange(rows)[None, :] >= counts.clamp(0, rows)[:, None]
        return dict(m_indices=None, masked_m=counts.to(device)), dead.to(device), (e, rows)
    ids = torch.randint(0, max(e - 1, 1), (max(rows * e // 2, 2), 2), generator=g, dtype=torch.int32)
    m_indices = moe_align(ids, None, e, 8)[2].clone()
    m_indices[1] = e + 2  # an out-of-range id on a real row: padding
    assert bool((m_indices < 0).any()), "the layout has no padding row"
    dead = (m_indices < 0) | (m_indices >= e)
    return dict(m_indices=m_indices.to(device), masked_m=None), dead.to(device), (m_indices.numel(),)


def _global_scale(mode, e, device):
    """NVFP4 output global scale: one per expert (contiguous, or a strided view of the same values), one for all
    rows, or None (computed)."""
    if mode in ("expert", "expert-strided"):
        gs = (torch.tensor([0.02, 0.5, 3.0, 0.125])[:e] * (1 + torch.arange(e) // 4)).to(device)
        if mode == "expert":
            return gs
        spread = torch.full((2 * e,), 7.0, device=device)
        spread[::2] = gs
        return spread[::2]
    return torch.tensor(0.25, device=device) if mode == "scalar" else None


def _fused(quant, a, a_s, w, w_s, w_g, ids, wk, act, rounding, gs, swizzle, config=None):
    if quant == "mxfp4":
        return fused.moe_gemm_swiglu_mxfp4(a, a_s, w, w_s, **ids, weights=wk, **act, rounding=rounding,
                                           swizzle=swizzle, w_global=w_g, config=config)
    return fused.moe_gemm_swiglu_nvfp4(a, a_s, w, w_s, **ids, weights=wk, **act, global_scale=gs, swizzle=swizzle,
                                       w_global=w_g, config=config)


def _bytes_equal_chain(kind, quant, masked, swizzle, interleave, activation, limit, mode, e=3, i=128, k=128, rows=12,
                       seed=0, device="cpu", config=None):
    """mode: MXFP4 rounding ("floor" / "rceil") or NVFP4 global scale ("expert" / "scalar" / "computed")."""
    g = torch.Generator().manual_seed(seed)
    ids, dead, lead = _layout(g, e, masked, rows, device)
    a, a_s, w, w_s, w_g = _exact_operands(kind, g, lead, dead, e, 2 * i, k, device)
    act = dict(interleave=interleave, activation=activation, alpha=1.702, limit=limit)
    h = _chain_gemm(kind, a, a_s, w, w_s, w_g, ids)
    chain = (h, *act.values(), ids["m_indices"], ids["masked_m"], None)
    gs = _global_scale(mode, e, device) if quant == "nvfp4" else None
    got = _fused(quant, a, a_s, w, w_s, w_g, ids, _weights(kind), act, mode, gs, swizzle, config)
    want = (tsw.swiglu_mxfp4(*chain, mode, swizzle) if quant == "mxfp4" else tsw.swiglu_nvfp4(*chain, gs, swizzle))
    desc = f"{kind} {quant} masked={masked} swizzle={swizzle} il={interleave} {activation} {limit} {mode} {lead}"
    assert len(got) == len(want), desc
    for what, x, y in zip(("codes", "scales", "global scale")[:len(got)], got, want, strict=True):
        assert_same_bytes(x, y, f"{what} {desc}")
    flat = got[0].reshape(-1, got[0].shape[-1])
    assert bool((flat[dead.reshape(-1)] == 0).all()), f"uncomputed rows hold nonzero codes: {desc}"
    return got


# ---------------------------------------------------------------------------------------------- bytes = chain

# (kind, quant, masked, swizzle, interleave, activation, limit, rounding / global-scale mode): every weight kind
# with both outputs, both layouts and scale layouts, interleave 0 / 1 / 8, silu and GPT-OSS, every rounding and
# global-scale form
CASES = [
    ("bf16", "mxfp4", False, False, 0, "silu", None, "floor"),
    ("bf16", "nvfp4", True, True, 1, "gptoss", 7.0, "expert"),
    ("fp16", "nvfp4", False, True, 0, "silu", None, "scalar"),
    ("fp8", "mxfp4", True, True, 1, "gptoss", 7.0, "rceil"),
    ("fp8", "nvfp4", False, False, 0, "silu", 0.75, "scalar"),
    ("mxfp4", "mxfp4", False, True, 1, "gptoss", 7.0, "floor"),
    ("mxfp4", "nvfp4", True, False, 0, "silu", None, "computed"),
    ("w4a8", "mxfp4", True, False, 8, "silu", None, "rceil"),
    ("w4a8", "nvfp4", False, True, 1, "gptoss", 7.0, "expert"),
    ("nvfp4", "mxfp4", False, False, 0, "gptoss", None, "floor"),
    ("nvfp4", "nvfp4", True, True, 0, "silu", None, "expert"),
    ("nvfp4", "nvfp4", False, False, 1, "gptoss", 7.0, "computed"),
]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_bytes_equal_the_unfused_chain(case):
    _bytes_equal_chain(*case)


def test_strided_global_scale_is_read_as_given():
    """A per-expert global scale given as a strided view gives the bytes of the same values contiguous (the fused op
    and the chain's swiglu_nvfp4 both read it at its strides)."""
    for masked in (False, True):
        strided = _bytes_equal_chain("bf16", "nvfp4", masked, False, 0, "silu", None, "expert-strided")
        contiguous = _bytes_equal_chain("bf16", "nvfp4", masked, False, 0, "silu", None, "expert")
        for what, x, y in zip(("codes", "scales", "global scale"), strided, contiguous, strict=True):
            assert_same_bytes(x, y, f"{what} masked={masked}: strided vs contiguous global scale")


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4"])
def test_tile_spanning_experts_swizzled(quant):
    """32-row tiles over moe_align's 8-row alignment: several experts, padding and the bad id in one tile (one pass
    per expert, each storing only its rows' scales in the swizzled container), I = 192 (a partial column tile:
    scale columns padded to 4), rows not a multiple of 128 (the container's padding rows)."""
    cfg = MoeGemmConfig(32, 128, 128, group_m=2, num_warps=4, num_stages=1)
    mode = "floor" if quant == "mxfp4" else "expert"
    _bytes_equal_chain("bf16", quant, False, True, 8, "gptoss", 7.0, mode, e=4, i=192, rows=10, seed=5, config=cfg)
    _bytes_equal_chain("bf16", quant, False, False, 0, "silu", None, mode, e=4, i=192, rows=10, seed=6, config=cfg)


@st.composite
def problems(draw):
    kind = draw(st.sampled_from(["bf16", "fp16", *FUSED_KINDS[1:]]))
    quant = draw(st.sampled_from(["mxfp4", "nvfp4"]))
    mode = draw(st.sampled_from(["floor", "rceil"] if quant == "mxfp4" else ["expert", "scalar", "computed"]))
    i = draw(st.sampled_from([64, 128, 192] if quant == "mxfp4" else [48, 64, 128]))
    interleave = draw(st.sampled_from([g for g in (0, 1, 8, 16) if i % max(g, 1) == 0]))
    return (kind, quant, draw(st.booleans()), draw(st.booleans()), interleave,
            draw(st.sampled_from(["silu", "gptoss"])), draw(st.sampled_from([None, 7.0, 0.75])), mode,
            draw(st.integers(1, 4)), i, draw(st.sampled_from([128, 256])), draw(st.sampled_from([1, 5, 17])),
            draw(st.integers(0, 2**31 - 1)))


@settings(max_examples=examples(12), deadline=None)
@given(p=problems())
def test_bytes_equal_the_unfused_chain_property(p):
    _bytes_equal_chain(*p)


def test_outputs_are_what_gemm2_reads():
    """MXFP4 linear codes / scales are moe_gemm_w4a4's activations (the Triton GEMM2 on them equals the reference
    GEMM on their dequantized values); the swizzled scales are the 128x4 container of the linear ones (what
    moe_gemm_blockscaled takes, as mxfp4_quantize(scale_layout="swizzled") writes it), the codes the same."""
    g = torch.Generator().manual_seed(9)
    e, i, k, n = 3, 128, 128, 64
    ids, dead, lead = _layout(g, e, False, 12, "cpu")
    a, _, w, w_s, _ = _exact_operands("mxfp4", g, lead, dead, e, 2 * i, k, "cpu")
    act = dict(interleave=1, activation="gptoss", alpha=1.702, limit=7.0)
    codes, scales = _fused("mxfp4", a, None, w, w_s, None, ids, "mxfp4", act, "floor", None, False)
    w2 = torch.randint(0, 256, (e, n, i // 2), generator=g, dtype=torch.uint8)
    w2_s = torch.randint(124, 128, (e, n, i // 32), generator=g, dtype=torch.uint8)
    y = grouped.moe_gemm_w4a4(codes, scales, w2, w2_s, **ids)
    a2 = rq.mxfp4_dequantize(codes, scales, False, torch.float32).bfloat16()  # E2M1 x 2^e: exact in bf16 here
    assert_close(y, ref.moe_gemm_mxfp4(a2, w2, w2_s, ids["m_indices"], None), "w4a4 GEMM2 on the output")
    codes_sw, scales_sw = _fused("mxfp4", a, None, w, w_s, None, ids, "mxfp4", act, "floor", None, True)
    assert_same_bytes(codes_sw, codes, "codes (swizzled call)")
    assert_same_bytes(scales_sw, rq.swizzle_scales_128x4(scales), "swizzled scales")


# ---------------------------------------------------------------------------------------------- vs reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_random_operands_match_the_reference(kind, masked, device):
    """Random operands: the dequantized FP4 outputs against the reference chain's at the GEMM tolerance (a GEMM
    ulp may move a value across an E2M1 step: the FP4 quantum, relative to the block amax)."""
    g = torch.Generator().manual_seed(11)
    e, i, k = 3, 128, 256
    ids, dead, lead = _layout(g, e, masked, 12, device)
    a, a_s, w, w_s, w_g = _random_operands(kind, g, lead, dead, e, 2 * i, k, device)
    act = dict(interleave=1, activation="gptoss", alpha=1.702, limit=7.0)
    cpu = lambda t: None if t is None else t.cpu()
    base = (*map(cpu, (a, a_s, w, w_s, ids["m_indices"], ids["masked_m"])), kind, *act.values())
    gs = _global_scale("expert", e, device)
    for quant, swizzle in (("mxfp4", False), ("nvfp4", True)):
        got = _fused(quant, a, a_s, w, w_s, w_g, ids, kind, act, "floor", gs, swizzle)
        if quant == "mxfp4":
            want = ref.moe_gemm_swiglu_mxfp4(*base, "floor", swizzle, cpu(w_g))
            deq = [rq.mxfp4_dequantize(c.cpu(), s.cpu(), swizzle, torch.float32) for c, s in (got, want)]
        else:
            want = ref.moe_gemm_swiglu_nvfp4(*base, cpu(gs), swizzle, cpu(w_g))
            assert_same_bytes(got[2].cpu(), want[2], "global scale")
            deq = [nv_dequantize(c.cpu(), s.cpu(), gs.cpu(), ids, lead, swizzle) for c, s, _ in (got, want)]
        amax = deq[1].abs().amax().item()
        err = (deq[0] - deq[1]).abs().max().item()
        assert err <= 0.25 * amax, f"{kind} {quant} masked={masked}: max error {err} (amax {amax})"
        assert bool((deq[0].reshape(-1, i)[dead.reshape(-1).cpu()] == 0).all()), "uncomputed rows are not zero"


def nv_dequantize(codes, scales, gs, ids, lead, swizzle):
    """NVFP4 output with one global scale per expert, dequantized row by row with its expert's scale."""
    y = rq.nvfp4_dequantize(codes, scales, torch.tensor(1.0), swizzle, torch.float32).reshape(-1, codes.shape[-1] * 2)
    if ids["masked_m"] is not None:
        e = torch.arange(lead[0])[:, None].expand(lead).reshape(-1)
    else:
        e = ids["m_indices"].cpu().long().clamp(0, gs.numel() - 1)
    return y * gs[e][:, None]


# ---------------------------------------------------------------------------------------------- dispatch


def test_dispatch_ops_and_opcheck():
    """The registered ops (Triton row under the interpreter against the torch row: exact operands, same bytes),
    the typed results, and torch.library.opcheck of both schemas."""
    from dispatch import ops
    g = torch.Generator().manual_seed(3)
    ids, dead, lead = _layout(g, 2, False, 8, "cpu")
    a, _, w, *_ = _exact_operands("bf16", g, lead, dead, 2, 256, 128, "cpu")
    mi = ids["m_indices"]
    kw = dict(m_indices=mi, interleave=1, activation="gptoss", limit=7.0)
    q = ops.moe_gemm_swiglu_mxfp4(a, w, **kw, rounding="rceil", scale_layout="swizzled", backend="triton")
    r = ops.moe_gemm_swiglu_mxfp4(a, w, **kw, rounding="rceil", scale_layout="swizzled", backend="torch")
    assert q.scales.shape == (128, 4)
    assert_same_bytes(q.codes, r.codes, "mxfp4 codes")
    assert_same_bytes(q.scales, r.scales, "mxfp4 scales")
    gs = torch.tensor([0.5, 0.25])
    q = ops.moe_gemm_swiglu_nvfp4(a, w, **kw, global_scale=gs, backend="triton")
    r = ops.moe_gemm_swiglu_nvfp4(a, w, **kw, global_scale=gs, backend="torch")
    for x, y, what in zip(q, r, ("codes", "scales", "global scale"), strict=True):
        assert_same_bytes(x, y, f"nvfp4 {what}")
    args = (a, None, w, None, mi, None, "bf16", 1, "gptoss", 1.702, 7.0)
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_swiglu_mxfp4.default, (*args, "floor", True, None, "triton"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.lowbit.moe_gemm_swiglu_nvfp4.default, (*args, gs, False, None, "triton"),
                          test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs_are_named():
    a = torch.randn(4, 128).bfloat16()
    w = torch.randn(2, 96, 128).bfloat16()  # I = 48: not a whole number of MXFP4 blocks
    mi = torch.zeros(4, dtype=torch.int32)
    kw = dict(m_indices=mi, masked_m=None, weights="bf16", interleave=0, activation="silu", alpha=1.702, limit=None)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_mxfp4: argument 'w': I = 48 is not a multiple of "
                                               r"the MXFP4 block 32"):
        fused.moe_gemm_swiglu_mxfp4(a, None, w, None, **kw, rounding="floor", swizzle=False)
    w = torch.randn(2, 256, 128).bfloat16()
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_mxfp4: argument 'rounding'"):
        fused.moe_gemm_swiglu_mxfp4(a, None, w, None, **kw, rounding="even", swizzle=False)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_nvfp4: argument 'w': I = 40 is not a multiple of "
                                               r"the NVFP4 block 16"):
        fused.moe_gemm_swiglu_nvfp4(a, None, w[:, :80], None, **kw, global_scale=None, swizzle=False)
    nv = lambda gs: fused.moe_gemm_swiglu_nvfp4(a, None, w, None, **kw, global_scale=gs, swizzle=False)
    arg = r"moe_gemm_swiglu_nvfp4: argument 'global_scale'"
    with pytest.raises(LowbitInputError, match=rf"{arg}: expected a scalar or one scale per expert \(2,\), got "
                                               rf"shape \(1, 2\)"):
        nv(torch.ones(1, 2))
    with pytest.raises(LowbitInputError, match=rf"{arg}: expected a scalar or one scale per expert \(2,\), got "
                                               rf"shape \(2, 1\)"):
        nv(torch.ones(2, 1))
    with pytest.raises(LowbitInputError, match=rf"{arg}: dtype bfloat16"):
        nv(torch.ones(2).bfloat16())
    with pytest.raises(LowbitInputError, match=rf"{arg}: expected a torch.Tensor"):
        nv(0.5)
    with pytest.raises(LowbitInputError, match=r"moe_gemm_swiglu_nvfp4: argument 'interleave'"):
        fused.moe_gemm_swiglu_nvfp4(a, None, w, None, **{**kw, "interleave": 3}, global_scale=None, swizzle=False)


def test_empty_layouts():
    w = torch.randn(2, 256, 128).bfloat16()
    a = torch.randn(0, 128).bfloat16()
    args = (a, None, w, None, torch.zeros(0, dtype=torch.int32), None, "bf16", 0, "silu", 1.7, None)
    c, s = fused.moe_gemm_swiglu_mxfp4(*args, "floor", False)
    assert c.shape == (0, 64) and s.shape == (0, 4)
    c, s, gs = fused.moe_gemm_swiglu_nvfp4(*args, torch.tensor([1.0, 2.0]), True)
    assert c.shape == (0, 64) and s.shape == (0, 8) and gs.shape == (2,)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("quant,swizzle,mode", [("mxfp4", False, "floor"), ("mxfp4", True, "rceil"),
                                                ("nvfp4", True, "expert"), ("nvfp4", False, "computed")])
@pytest.mark.parametrize("masked", [False, True], ids=["contiguous", "masked"])
@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_gpu_bytes_equal_the_chain(kind, masked, quant, swizzle, mode):
    """GPT-OSS's I = 2880 (a partial 128-column tile, 90 / 180 scale columns) at decode (16 rows per expert) and
    prefill-like (256) tiles, K = 1024, exact operands, 4 experts (one with no rows)."""
    for rows, il in ((16, 0), (256, 1)):
        _bytes_equal_chain(kind, quant, masked, swizzle, il, "silu" if il == 0 else "gptoss", None if il == 0 else 7.0,
                           mode, e=4, i=2880, k=1024, rows=rows, seed=1, device="cuda")


# ---------------------------------------------------------------------------------------------- compile-only

_COMPILE = """
import os, re, subprocess, tempfile
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton_ops.moe_gemm import fused as F, grouped as G
from triton_ops.moe_gemm.config import pick_swiglu_gemm_config_for_arch
from triton_ops.quant_epilogue import FMT_MX, FMT_NV, min_block

kern = F._moe_gemm_swiglu_kernel
names = [p.name for p in kern.params]
for kind, fmt in (("mxfp4", FMT_MX), ("bf16", FMT_NV)):
    cfg = pick_swiglu_gemm_config_for_arch(kind, 4096 * 4 // 128, 2880, 2880, "sm_90", min_block(fmt, 128))
    ptrs = dict(a_ptr="*bf16", as_ptr="*fp32", w_ptr="*u8" if kind == "mxfp4" else "*bf16", ws_ptr="*u8",
                ids_ptr="*i32", out_ptr="*u8", scale_ptr="*u8", gs_ptr="*fp32")
    sig = {p.name: "i32" for p in kern.params if not p.is_constexpr}
    sig.update(ptrs)
    sig.update({n: "fp32" for n in ("alpha", "limit", "fp8_eps")})
    consts = dict(KIND=G.KIND_CODE[kind], MASKED=False, INTERLEAVE=1, GPTOSS=True, CLAMP=True, DIV_RN=False, FMT=fmt,
                  GROUP=128, UE8M0=False, MX_RCEIL=False, SWIZZLE=True, HW_FP4=False, EMULATE=False, F32_DOT=False,
                  OUT_DTYPE=tl.bfloat16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  GROUP_M=cfg.group_m)
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = [*ptrs, "K", "I", "stride_am", "stride_we", "stride_wn", "stride_om"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    c = triton.compile(triton.compiler.ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg.num_warps,
                                                                      num_stages=cfg.num_stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups()
    print("LOWBIT", kind, int(fmt), triton.__version__, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages, regs,
          stack, c.metadata.shared, c.asm["ptx"].count("wgmma.mma_async"), flush=True)
"""


@pytest.mark.slow  # sm_90 SASS properties of a kernel the GPU suite runs: the slow run
def test_sm90_compile_prefill_no_spills():
    """The GPT-OSS-120b prefill tile (4096 tokens x top-4 over 128 experts, I = K = 2880) of MXFP4 weights with an
    MXFP4 output and bf16 weights with an NVFP4 output, swizzled scales, compiled for sm_90 by Triton 3.6
    (/opt/triton36, else the installed Triton when it is 3.6): wgmma, no local-memory stack (register spills),
    shared memory within an H100's."""
    import os

    import triton
    path = os.environ.get("LOWBIT_TRITON36_PATH", "/opt/triton36")
    if os.path.isdir(path):
        script = f"import sys; sys.path.insert(0, {path!r})\n" + _COMPILE
    elif triton.__version__.startswith("3.6"):
        script = _COMPILE
    else:
        pytest.skip(f"no Triton 3.6 (LOWBIT_TRITON36_PATH) and the installed Triton is {triton.__version__}")
    out = run_compile_script(script, 900)
    recs = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("LOWBIT ")]
    assert len(recs) == 2, out
    for kind, fmt, version, bm, bn, bk, stages, regs, stack, shared, wgmma in recs:
        what = f"{kind} fmt={fmt} {bm}x{bn}x{bk}x{stages} (Triton {version}): {regs} registers"
        assert version.startswith("3.6"), what
        assert int(wgmma) > 0, f"{what}: no wgmma"
        assert int(stack) == 0, f"{what}: {stack} B of local-memory stack (spills)"
        assert int(shared) <= 232448, f"{what}: {shared} B of shared memory"
