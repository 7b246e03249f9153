"""Benchmark cases for the MoE expert grouped GEMMs: `moe_gemm_bf16`, `moe_gemm_fp8` (W8A8, DeepGEMM block scales),
`moe_gemm_mxfp4` (W4A16, GPT-OSS), `moe_gemm_nvfp4` (NVFP4 W4A16), over the contiguous (`m_indices`) and masked
(`masked_m`) layouts (docs/moe_gemm.md).

Shapes (balanced routing: every expert gets the same number of rows, so the peers' offsets describe the same work):
* DeepSeek-V3 experts (hidden 7168, intermediate 2048): GEMM1 N = 4096 (gate + up), K = 7168; GEMM2 N = 7168,
  K = 2048; bf16 and FP8 (1x128 activation / 128x128 weight scales), each:
  - prefill-like: 32 experts x 256 rows, contiguous layout (M = 8192). 32 of the model's 256 experts (an EP = 8
    shard) bound the memory: the runner holds ~3 copies of the inputs, and 256 bf16 GEMM1 experts are 15 GB each;
    bf16 also at 512 rows per expert, where auto's rule moves from the Triton kernel to the CuTe one;
  - decode: all 256 experts x 16 rows, masked layout (E, max_m = 16, K) with masked_m = 16 (a 512-token batch at
    top-8): weight streaming, 15 / 7.5 GB of GEMM1 weights in bf16 / FP8 per call.
* GPT-OSS-120b GEMM1 (hidden 2880, intermediate 2880): N = 5760, K = 2880, MXFP4 W4A16, NVFP4 W4A16 (K = 180 x 16)
  and bf16, contiguous layout: decode 128 experts x 16 rows, prefill-like 32 experts x 256 rows.
* GPT-OSS-20b GEMM1 (the same expert dims, 32 experts, top-4), prepacked MXFP4 / NVFP4: decode 64 tokens (8 rows
  per expert), prefill 4096 tokens (512 rows per expert), contiguous.
* GPT-OSS GEMM2 (N = 2880, K = 2880), prepacked MXFP4: 120b decode 128 x 16 and prefill 32 x 256, 20b decode 32 x 8
  and prefill 32 x 512, contiguous.
Fused epilogues (`fused_cases`, below): GEMM1 + SwiGLU (+ FP8 1x128) and GEMM2 + combine against the unfused
chain of separate ops, at DeepSeek-V3 / GPT-OSS decode (64 tokens) and prefill (4096 tokens) routings.
Each op also has a "quick" case (tiny shapes for the CPU interpreter) with padding rows (id -1), an out-of-range
expert id (never read: a zero row by contract), an expert without rows, and a masked count of 0.

The full cases build their layouts directly (rows grouped by expert, each expert's rows a multiple of 16): the same
rows `moe_align` gives for balanced routing with block_m 16 / 128, minus its static-capacity tail of padding rows,
so the timed work is the real rows only (the kernels skip padding tiles but still write their zero rows).

FLOP model: 2 * (real rows) * N * K; flops_dtype "fp8" for the FP8 cases (held against the fp8 `_scaled_mm`
roof), "bf16" otherwise (MXFP4 / NVFP4 weights are dequantized to bf16 operands). Bytes model (read + written once): the
weights of every expert that has rows (bf16 2 B, E4M3 1 B + fp32 128x128 block scales, MXFP4 0.5 B + one E8M0 byte
per 32, NVFP4 0.5 B + one E4M3 byte per 16 + an fp32 global per expert), the real activation rows (+ fp32 1x128
scales for FP8), every output row of the layout (bf16; padding rows are written as zeros), and the index vector
(m_indices, or masked_m).

Checks: normalized max error max|out - ref| / max|ref| <= 2e-2, no NaN, same shape. The reference:
* quick cases: the contract, dispatch/reference/moe_gemm.py (padding rows and masked counts included);
* full cases: `lean_reference`, the contract's math (per expert: dequantize to fp32, one fp32 matmul, one rounding)
  one expert at a time, so no fp32 copy of all the weights is ever materialized (the contract's
  `fp8_block_dequantize` of 256 GEMM1 experts alone is 30 GB). It is also the timed "torch" provider; torch.compile
  of it is not timed (a Python loop over up to 256 experts). The lowbit "torch" backend (the contract) is refused on
  full cases (BackendError -> "skipped": whole-tensor fp32 dequantization) and runs in --quick.

lowbit providers: every backend of the op's table rows that can run here, each checked against the reference first:
`lowbit:triton` everywhere, and on sm_90 `lowbit:cute` for the bf16 and FP8 cases (the CuTeDSL WGMMA grouped
GEMM, cute_ops/gemm/grouped_sm90.py; auto does not pick it yet, the runner forces each backend), so those cases
time it beside the Triton kernel and `torch._grouped_mm` / `torch._scaled_grouped_mm` in the same process.

Peers (timed, not checked; each tried once on the first inputs made on a GPU, removed with the reason printed if it
raises):
* bf16: `torch._grouped_mm(a, w.transpose(1, 2), offs, out_dtype=bf16)` (contiguous: 2-D a, int32 cumulative row
  offsets; masked: 3-D a, no offsets), and on the prefill shapes `mm-dense`: one `torch.mm` (M, K) x (K, N) of the
  same FLOPs against one expert's weights (the compute roof in practice, not the same bytes);
* fp8: `torch._scaled_grouped_mm` with row-wise fp32 scales (scale_a per row, scale_b per (expert, column): a
  coarser scaling than the 1x128 / 128x128 blocks of the lowbit op), and on the prefill shapes `scaled_mm-dense`:
  one row-wise `torch._scaled_mm` of the same FLOPs;
* mxfp4 and nvfp4: `torch._grouped_mm` on bf16 weights of the same shape (4x the weight bytes: the bar a W4A16
  kernel must beat by reading fewer bytes); for mxfp4 also `triton-dot_scaled`: the lowbit Triton kernel with
  `dot_scaled=True` (dispatch/variants.py: tl.dot_scaled on E2M1 + E8M0 instead of the in-register dequantization
  the dispatcher runs; NVFP4 has no such variant: Triton 3.6 cannot lower NVFP4 scales in tl.dot_scaled on sm_90).
* mxfp4, contiguous layout: `triton_kernels`, OpenAI's `matmul_ogs` (the GPT-OSS MoE kernel, perf/peers.py) on the
  same MXFP4 bytes, swizzled into its layout for the GPU and with its ragged routing metadata built once per input
  set in make (not timed, as an engine prepacks at load).
"""

from __future__ import annotations

import torch

from dispatch import ops, variants
from dispatch.reference import moe_gemm as ref
from dispatch.registry import BackendError
from perf import peers as P
from perf.cases.base import BenchCase
from triton_ops.contract.formats import MXFP4_BLOCK, NVFP4_BLOCK
from triton_ops.contract.moe_gemm import FP8_BLOCK

TOL = 2e-2
BF16 = torch.bfloat16
FP8 = torch.float8_e4m3fn
FULL_TORCH_BACKEND = ("full-size case: the contract reference (dispatch/reference/moe_gemm.py) dequantizes every "
                      "expert's weights to fp32 at once (30 GB for 256 FP8 GEMM1 experts); it runs in --quick, and "
                      "the per-expert 'torch' provider is the torch number here")

DSV3 = {"gemm1": (4096, 7168), "gemm2": (7168, 2048)}  # (N, K) per DeepSeek-V3 expert GEMM
GPT_OSS_GEMM1 = (5760, 2880)
GPT_OSS_GEMM2 = (2880, 2880)


# ---------------------------------------------------------------------------------------------------- models


def weight_bytes(kind: str, experts: int, n: int, k: int) -> int:
    if kind == "bf16":
        return experts * n * k * 2
    if kind == "fp8":
        return experts * n * k + experts * -(-n // FP8_BLOCK) * (k // FP8_BLOCK) * 4
    if kind == "nvfp4":
        return experts * n * k // 2 + experts * n * (k // NVFP4_BLOCK) + experts * 4
    return experts * n * k // 2 + experts * n * (k // MXFP4_BLOCK)  # mxfp4, w4a8, w4a4: MXFP4 weights


def _act_bytes(kind: str, rows: int, k: int) -> int:
    if kind in ("fp8", "w4a8"):
        return rows * k + rows * (k // FP8_BLOCK) * 4
    if kind == "w4a4":
        return rows * k // 2 + rows * (k // MXFP4_BLOCK)
    return rows * k * 2


def moe_gemm_bytes(kind: str, counts: list[int], out_rows: int, n: int, k: int, index_elems: int) -> int:
    """Weights of the experts with rows + real activation rows (+ FP8 scales) + every output row + the indices."""
    real = sum(counts)
    experts = sum(1 for c in counts if c > 0)
    return weight_bytes(kind, experts, n, k) + _act_bytes(kind, real, k) + out_rows * n * 2 + index_elems * 4


def moe_gemm_flops(counts: list[int], n: int, k: int) -> int:
    return 2 * sum(counts) * n * k


# --------------------------------------------------------------------------------------------------- inputs


def _fp8_codes(shape, device, std: float = 2.0, chunk: int = 1 << 26) -> torch.Tensor:
    """E4M3 codes of N(0, std) values, made `chunk` elements at a time (no full-size fp32 temporary)."""
    out = torch.empty(shape, dtype=FP8, device=device)
    flat = out.view(-1)
    for s in range(0, flat.numel(), chunk):
        m = min(chunk, flat.numel() - s)
        flat[s:s + m] = (torch.randn(m, device=device) * std).clamp_(-448, 448).to(FP8)
    return out


def _weights(kind: str, e: int, n: int, k: int, device) -> dict:
    if kind == "bf16":
        return {"w": torch.randn(e, n, k, device=device, dtype=BF16).mul_(k ** -0.5)}
    if kind == "fp8":
        return {"w": _fp8_codes((e, n, k), device),
                "w_scale": torch.rand(e, -(-n // FP8_BLOCK), k // FP8_BLOCK, device=device).add_(0.5).mul_(k ** -0.5)}
    if kind == "nvfp4":  # any code byte; E4M3 scales 2^-4 .. 2^0 (bytes 0x20-0x38, no NaN), a global per expert
        return {"w": torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device),
                "w_scale": torch.randint(0x20, 0x39, (e, n, k // NVFP4_BLOCK), dtype=torch.uint8, device=device),
                "w_global": torch.rand(e, device=device).add_(0.5)}
    # mxfp4: any byte is a valid pair of E2M1 codes; E8M0 exponents around 2^-5 .. 2^0 (no NaN byte 0xFF)
    return {"w": torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device),
            "w_scale": torch.randint(122, 128, (e, n, k // MXFP4_BLOCK), dtype=torch.uint8, device=device)}


def _activations(kind: str, lead: tuple, k: int, device) -> dict:
    if kind == "w4a4":
        return {"a": torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, device=device),
                "a_scale": torch.randint(122, 130, (*lead, k // MXFP4_BLOCK), dtype=torch.uint8, device=device)}
    if kind in ("fp8", "w4a8"):
        return {"a": _fp8_codes((*lead, k), device),
                "a_scale": torch.rand(*lead, k // FP8_BLOCK, device=device).add_(0.5)}
    return {"a": torch.randn(*lead, k, device=device, dtype=BF16)}


def contiguous_ids(counts: list[int], pad_to: int, extra: dict[int, int] | None = None) -> list[int]:
    """m_indices of a contiguous layout: expert e's counts[e] rows, then -1 up to a multiple of pad_to; `extra`
    {row: id} overwrites padding rows (e.g. an out-of-range id)."""
    ids: list[int] = []
    for e, c in enumerate(counts):
        if c:
            ids += [e] * c + [-1] * (-c % pad_to)
    for row, v in (extra or {}).items():
        ids[row] = v
    return ids


# ---------------------------------------------------------------------------------------------- references


def _a32(kind: str, i: dict, rows) -> torch.Tensor:
    a = i["a"][rows]
    if kind in ("fp8", "w4a8"):
        return a.float() * i["a_scale"][rows].float().repeat_interleave(FP8_BLOCK, dim=-1)
    if kind == "w4a4":
        return ref.mxfp4_weight_dequantize(a[None], i["a_scale"][rows][None])[0]
    return a.float()


def _w32(kind: str, i: dict, e: int) -> torch.Tensor:
    if kind == "bf16":
        return i["w"][e].float()
    if kind == "fp8":
        return ref.fp8_block_dequantize(i["w"][e:e + 1], i["w_scale"][e:e + 1])[0]
    if kind == "nvfp4":
        return ref.nvfp4_weight_dequantize(i["w"][e:e + 1], i["w_scale"][e:e + 1], i["w_global"][e:e + 1])[0]
    return ref.mxfp4_weight_dequantize(i["w"][e:e + 1], i["w_scale"][e:e + 1])[0]


def lean_reference(kind: str, counts: list[int], masked: bool):
    """The contract's math one expert at a time, for layouts whose expert e owns rows known here: contiguous,
    experts in order, counts[e] rows each, no padding; masked, rows 0..counts[e]-1 of slab e."""

    def reference(i):
        a, w = i["a"], i["w"]
        dtype = a.dtype if kind in ("bf16", "nvfp4") else BF16
        out = torch.zeros(*a.shape[:-1], w.shape[1], dtype=dtype, device=a.device)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows = (e, slice(0, c)) if masked else slice(start, start + c)
            start += c
            out[rows] = (_a32(kind, i, rows) @ _w32(kind, i, e).T).to(out.dtype)
        return out

    return reference


def check(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if torch.isnan(got).any():
        raise AssertionError(f"{int(torch.isnan(got).sum())} NaN in the output")
    g, w = got.float(), want.float()
    err = float((g - w).abs().max()) / max(float(w.abs().max()), 1e-6) if w.numel() else 0.0
    if err > TOL:
        raise AssertionError(f"normalized max error {err:.3e} > {TOL}")


# --------------------------------------------------------------------------------------------------- peers


def _why(exc: BaseException) -> str:
    msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return msg if len(msg) < 240 else msg[:237] + "..."


def _probe_peers(peers: dict, state: dict, inputs: dict, device: torch.device, where: str) -> None:
    """Once per case, on its first inputs made on a GPU: run every peer; one that raises (an API or arch this torch
    lacks) is removed from the case (the runner builds its providers from `case.peers` after make), with the
    reason printed."""
    if device.type != "cuda" or state.get("probed"):
        return
    state["probed"] = True
    for name, fn in list(peers.items()):
        try:
            with torch.no_grad():
                fn(inputs)
            torch.cuda.synchronize(device)
        except Exception as exc:
            peers.pop(name)
            print(f"perf: {where}: peer {name} skipped: {_why(exc)}")


def _peers(kind: str, masked: bool, dense: bool, decode: bool = False) -> dict:
    peers: dict = {}
    if kind in ("bf16", "mxfp4", "nvfp4", "w4a8", "w4a4"):
        wname = "w" if kind == "bf16" else "w_peer"
        aname = "a_peer" if kind in ("w4a8", "w4a4") else "a"
        if masked:
            peers["torch._grouped_mm"] = lambda i: torch._grouped_mm(i[aname], i[wname].transpose(1, 2),
                                                                     out_dtype=BF16)
        else:
            peers["torch._grouped_mm"] = lambda i: torch._grouped_mm(i[aname], i[wname].transpose(1, 2),
                                                                     offs=i["offs"], out_dtype=BF16)
        if dense and kind == "bf16":
            peers["mm-dense"] = lambda i: torch.mm(i["a"], i["w"][0].t())
    if kind == "fp8":
        if masked:
            peers["torch._scaled_grouped_mm"] = lambda i: torch._scaled_grouped_mm(
                i["a"], i["w"].transpose(1, 2), i["sa_row"], i["sb_row"], out_dtype=BF16)
        else:
            peers["torch._scaled_grouped_mm"] = lambda i: torch._scaled_grouped_mm(
                i["a"], i["w"].transpose(1, 2), i["sa_row"], i["sb_row"], offs=i["offs"], out_dtype=BF16)
        if dense:
            peers["scaled_mm-dense"] = lambda i: torch._scaled_mm(
                i["a"], i["w"][0].t(), scale_a=i["sa_row"].view(-1, 1), scale_b=i["sb_row"][0].view(1, -1),
                out_dtype=BF16)
    if kind == "mxfp4":
        peers["triton-dot_scaled"] = lambda i: variants.moe_gemm_mxfp4_dot_scaled(
            i["a"], i["w"], i["w_scale"], i.get("m_indices"), i.get("masked_m"))
        # warps of the swizzled scale layout, which the kernel launches with: 4 at decode (vLLM's default for
        # small batches), 8 otherwise (triton_kernels' own tests)
        if not masked and (prepare := P.triton_kernels_moe_mxfp4(num_warps=4 if decode else 8)) is not None:
            peers["triton_kernels"] = lambda i: i["triton_kernels"](i["a"])
            peers["triton_kernels"].prepare = prepare
    return peers


def _prepare_peers(peers: dict, i: dict, device: torch.device, where: str) -> None:
    """Prepacking of the peers that carry a `prepare` (triton_kernels: swizzled weights, routing metadata), once
    per made input set on a GPU, outside the timing; a failure removes the peer with the reason printed."""
    for name, fn in list(peers.items()):
        prepare = getattr(fn, "prepare", None)
        if prepare is None:
            continue
        if device.type != "cuda":
            peers.pop(name)
            continue
        try:
            i[name] = prepare(i["w"], i["w_scale"], i["m_indices"])
        except Exception as exc:
            peers.pop(name)
            print(f"perf: {where}: peer {name} skipped: {_why(exc)}")


# ---------------------------------------------------------------------------------------------------- cases


def _call(kind: str, prepacked: bool = False):
    def call(i, b):
        lay = dict(m_indices=i.get("m_indices"), masked_m=i.get("masked_m"))
        if prepacked:
            return ops.moe_gemm_fp4_prepacked(i["a"], i["w_values"], i["w_scales"], fmt=kind,
                                              w_global=i.get("w_global"), **lay, backend=b)
        if kind == "bf16":
            return ops.moe_gemm_bf16(i["a"], i["w"], **lay, backend=b)
        if kind == "fp8":
            return ops.moe_gemm_fp8(i["a"], i["a_scale"], i["w"], i["w_scale"], **lay, backend=b)
        if kind == "w4a8":
            return ops.moe_gemm_w4a8(i["a"], i["a_scale"], i["w"], i["w_scale"], **lay, backend=b)
        if kind == "w4a4":
            return ops.moe_gemm_w4a4(i["a"], i["a_scale"], i["w"], i["w_scale"], **lay, backend=b)
        if kind == "nvfp4":
            return ops.moe_gemm_nvfp4(i["a"], i["w"], i["w_scale"], i["w_global"], **lay, backend=b)
        return ops.moe_gemm_mxfp4(i["a"], i["w"], i["w_scale"], **lay, backend=b)
    return call


def _contract(kind: str):
    def reference(i):
        lay = (i.get("m_indices"), i.get("masked_m"))
        if kind == "bf16":
            return ref.moe_gemm_bf16(i["a"], i["w"], *lay)
        if kind == "fp8":
            return ref.moe_gemm_fp8(i["a"], i["a_scale"], i["w"], i["w_scale"], *lay)
        if kind in ("w4a8", "w4a4"):
            return getattr(ref, f"moe_gemm_{kind}")(i["a"], i["a_scale"], i["w"], i["w_scale"], *lay)
        if kind == "nvfp4":
            return ref.moe_gemm_nvfp4(i["a"], i["w"], i["w_scale"], i["w_global"], *lay)
        return ref.moe_gemm_mxfp4(i["a"], i["w"], i["w_scale"], *lay)
    return reference


def _case(model: str, gemm: str, kind: str, e: int, n: int, k: int, *, counts: list[int] | None = None,
          rows: int = 0, masked: bool = False, max_m: int = 0, ids: list[int] | None = None,
          tier: str = "full", prepacked: bool = False) -> BenchCase:
    """Full cases: `rows` rows for each of the e experts (contiguous: grouped in expert order; masked: max_m = rows,
    masked_m = rows). Quick cases: `counts` per expert with the contiguous `ids` (m_indices, padding -1) or
    masked max_m. prepacked (mxfp4 / nvfp4): the same weights through `moe_gemm_fp4_prepack` (in make, outside the
    timing) and `moe_gemm_fp4_prepacked`; bytes count the layout's K padding (K rounded up to 128)."""
    full = tier == "full"
    counts = counts if counts is not None else [rows] * e
    bucket = "decode" if max(counts) <= 64 else "prefill"
    if masked:
        max_m = max_m or max(counts)
        lead: tuple = (e, max_m)
        out_rows, index_elems = e * max_m, e
    else:
        ids = ids if ids is not None else contiguous_ids(counts, 1)
        lead = (len(ids),)
        out_rows, index_elems = len(ids), len(ids)
    peers = _peers(kind, masked, dense=full and bucket == "prefill", decode=bucket == "decode") if full else {}
    state: dict = {}
    op = "moe_gemm_fp4_prepacked" if prepacked else f"moe_gemm_{kind}"
    where = f"{op} [{model} {gemm}]"

    def make(device):
        i = {**_activations(kind, lead, k, device), **_weights(kind, e, n, k, device)}
        if masked:
            i["masked_m"] = torch.tensor(counts, dtype=torch.int32, device=device)
        else:
            i["m_indices"] = torch.tensor(ids, dtype=torch.int32, device=device)
            if full:  # torch._grouped_mm offsets: cumulative row ends per expert (the layout has no padding)
                i["offs"] = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        if "torch._scaled_grouped_mm" in peers or "scaled_mm-dense" in peers:  # row-wise scales of the FP8 peers
            i["sa_row"] = torch.rand(*lead, device=device).add_(0.5)
            i["sb_row"] = torch.rand(e, n, device=device).add_(0.5).mul_(k ** -0.5)
        if kind != "bf16" and "torch._grouped_mm" in peers:  # bf16 operands of the same shape for the bf16 peer
            i["w_peer"] = torch.randn(e, n, k, device=device, dtype=BF16).mul_(k ** -0.5)
            if kind in ("w4a8", "w4a4"):
                i["a_peer"] = torch.randn(*lead, k, device=device, dtype=BF16)
        if prepacked:
            i["w_values"], i["w_scales"] = ops.moe_gemm_fp4_prepack(i["w"], i["w_scale"], kind)
        _prepare_peers(peers, i, device, where)
        _probe_peers(peers, state, i, device, where)
        return i

    call = _call(kind, prepacked)

    def lowbit(i, b):
        if full and b == "torch":
            raise BackendError(FULL_TORCH_BACKEND)
        return call(i, b)

    layout = f"masked max_m={max_m}" if masked else "contiguous"
    per = f"{rows} rows/expert" if full else f"rows={counts}"
    label = f"{model} {gemm} E={e} {per} N={n} K={k} {kind}{' prepacked' if prepacked else ''} {layout}"
    params = dict(model=model, gemm=gemm, E=e, rows_per_expert=rows if full else counts, M=sum(counts), N=n, K=k,
                  kind=kind, layout="masked" if masked else "contiguous", max_m=max_m if masked else None,
                  **({"weights_layout": "prepacked"} if prepacked else {}))
    experts = sum(1 for c in counts if c > 0)
    pad = weight_bytes(kind, experts, n, -(-k // 128) * 128) - weight_bytes(kind, experts, n, k) if prepacked else 0
    return BenchCase(op, label, bucket, params, make, lowbit,
                     lean_reference(kind, counts, masked) if full else _contract(kind), check,
                     bytes_moved=moe_gemm_bytes(kind, counts, out_rows, n, k, index_elems) + pad,
                     flops=moe_gemm_flops(counts, n, k), peers=peers, compile_reference=False, tier=tier,
                     flops_dtype="fp8" if kind in ("fp8", "w4a8") else "bf16")


def _quick_cases() -> list[BenchCase]:
    """Tiny shapes for the CPU interpreter (CI), against the contract: padding rows, an out-of-range expert id, an
    expert without rows, a masked count of 0."""
    bf16_ids = contiguous_ids([3, 0, 5, 2], 8, extra={5: 9})  # row 5: padding with id 9 >= E (never read)
    mx_ids = contiguous_ids([2, 4, 0], 4) + [-1] * 4  # + a trailing all-padding block
    return [
        _case("quick", "gemm", "bf16", 4, 32, 64, counts=[3, 0, 5, 2], ids=bf16_ids, tier="quick"),
        _case("quick", "gemm", "fp8", 3, 32, 128, counts=[2, 0, 3], masked=True, max_m=4, tier="quick"),
        _case("quick", "gemm", "mxfp4", 3, 32, 64, counts=[2, 4, 0], ids=mx_ids, tier="quick"),
        _case("quick", "gemm", "w4a8", 3, 32, 128, counts=[2, 4, 0], ids=mx_ids, tier="quick"),
        _case("quick", "gemm", "w4a4", 3, 32, 64, counts=[2, 0, 3], masked=True, max_m=4, tier="quick"),
        _case("quick", "gemm", "nvfp4", 3, 32, 48, counts=[2, 4, 0], ids=mx_ids, tier="quick"),  # K = 3 x 16
        _case("quick", "gemm", "mxfp4", 3, 32, 160, counts=[2, 4, 0], ids=mx_ids, tier="quick", prepacked=True),
        _case("quick", "gemm", "nvfp4", 3, 32, 48, counts=[2, 0, 3], masked=True, max_m=4, tier="quick",
              prepacked=True),
    ]


# ------------------------------------------------------------------ fused epilogues against the unfused chain
#
# GEMM1 + SwiGLU (+ FP8 1x128 / MXFP4 quantization) as one op (`moe_gemm_swiglu[_fp8_group|_mxfp4]`) against the
# chain moe_gemm_<kind> -> swiglu[_fp8_group|_mxfp4] (peer "unfused-chain", same layout and arguments), and GEMM2 into
# token order + combine (`moe_gemm_combine`) against moe_gemm_<kind> -> moe_combine. Layouts come from the routing ops
# on a balanced routing (token t's slot j -> expert (t * k + j) mod E_global): decode 64 tokens (DeepSeek-V3 top-8 over
# 256 experts, GPT-OSS top-4 over 128: 2 rows per expert), prefill 4096 tokens (DeepSeek-V3 on an EP = 8 shard: 32
# local experts x 128 rows; GPT-OSS-120b all 128 experts x 128 rows). Bytes: the fused op's (weights of the experts
# with rows, the layout's activation rows, its output once); the chain moves the (rows, 2I) / (rows, N) intermediate
# twice more. Checks: against the per-expert contract math (lean, on the device), normalized error <= 2e-2 (FP8
# outputs: of the dequantized values, <= 3e-2; MXFP4 outputs: <= 1% of the code and scale bytes differ).

DSV3_I = 2048
GPT_OSS_I = 2880


def _routing(tokens: int, top_k: int, e_global: int, device) -> torch.Tensor:
    t = torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)[None, :]
    return (t % e_global).to(torch.int32)


def _layout_inputs(tokens, top_k, e_global, e_local, masked, max_m, device) -> dict:
    """Layout tensors of a balanced routing: m_indices / masked_m, src_rows, inv_rows, topk_weights, lead shape."""
    ids = _routing(tokens, top_k, e_global, device)
    emap = None
    if e_local < e_global:  # expert parallel: global experts [0, e_local) live here
        g = torch.arange(e_global, device=device, dtype=torch.int32)
        emap = torch.where(g < e_local, g, -1)
    rows_per = tokens * top_k // e_global
    if masked:
        lay = ops.moe_masked_layout(ids, e_local, max_m, expert_map=emap)
        i = {"masked_m": lay.masked_m, "src_rows": lay.src_rows}
    else:
        lay = ops.moe_align(ids, e_local, 16 if rows_per <= 32 else 128, expert_map=emap)
        i = {"m_indices": lay.m_indices, "src_rows": lay.sorted_token_ids}
    i["inv_rows"] = lay.inv_rows
    i["topk_weights"] = torch.rand(tokens, top_k, device=device)
    i["lead"] = tuple(i["src_rows"].shape)
    return i


def lean_layout_gemm(kind: str, i: dict, w_key: str = "w", ws_key: str = "w_scale") -> torch.Tensor:
    """The contract's GEMM one expert at a time over any layout (m_indices rows of each expert / masked counts)."""
    a, w = i["a"], i[w_key]
    j = {**i, "w": w, "w_scale": i.get(ws_key)}
    out = torch.zeros(*a.shape[:-1], w.shape[1], dtype=a.dtype if kind == "bf16" else BF16, device=a.device)
    for e in range(w.shape[0]):
        if "masked_m" in i:
            c = int(i["masked_m"][e].clamp(0, a.shape[1]))
            rows = (e, slice(0, c))
            if not c:
                continue
        else:
            rows = (i["m_indices"] == e).nonzero().squeeze(1)
            if not rows.numel():
                continue
        out[rows] = (_a32(kind, j, rows) @ _w32(kind, j, e).T).to(out.dtype)
    return out


def _check_fp8_out(got, want) -> None:
    """FP8 1x128 outputs, dequantized: the GEMM's tolerance plus one E4M3 step of each element. The kernel and the
    reference sum K in different orders, so a value near a rounding boundary may take the neighbouring code: up to
    2^-3 of the value (the step at the bottom of a binade), more than TOL of the tensor's max near the max."""
    from dispatch.reference.quant import fp8_group_dequantize

    g = fp8_group_dequantize(got[0], got[1], FP8_BLOCK, torch.float32)
    w = fp8_group_dequantize(want[0], want[1], FP8_BLOCK, torch.float32)
    if g.shape != w.shape:
        raise AssertionError(f"shape {tuple(g.shape)} != reference {tuple(w.shape)}")
    if torch.isnan(g).any():
        raise AssertionError(f"{int(torch.isnan(g).sum())} NaN in the output")
    bound = 2.0 ** -3 * w.abs() + TOL * max(float(w.abs().max()), 1e-6) if w.numel() else w
    over = (g - w).abs() > bound
    if bool(over.any()):
        raise AssertionError(f"{int(over.sum())} of {w.numel()} values off by more than one E4M3 step + {TOL} of "
                             f"the max (worst {float(((g - w).abs() - bound).max()):.3e} over)")


def _check_mxfp4_out(got, want) -> None:
    """MXFP4 outputs (linear scales): the kernel and the reference sum K in different orders, so a rounded gate/up
    value near a rounding boundary may move one E2M1 code (or a block scale); at most 1% of the bytes may differ."""
    for what, g, w in zip(("codes", "scales"), got, want, strict=True):
        if g.shape != w.shape:
            raise AssertionError(f"{what}: shape {tuple(g.shape)} != reference {tuple(w.shape)}")
        bad = int((g.view(torch.uint8) != w.view(torch.uint8).to(g.device)).sum())
        if bad > max(1, g.numel() // 100):
            raise AssertionError(f"{what}: {bad} of {g.numel()} bytes differ from the reference")


def _routed_make(kind, tokens, top_k, e_global, e_local, masked, max_m, n, k):
    def make(device):
        i = _layout_inputs(tokens, top_k, e_global, e_local, masked, max_m, device)
        i.update(_activations(kind, i["lead"], k, device))
        i.update(_weights(kind, e_local, n, k, device))
        return i
    return make


def _lay(i: dict) -> dict:
    return dict(m_indices=i.get("m_indices"), masked_m=i.get("masked_m"))


def _routed_sizes(kind, tokens, top_k, e_global, e_local, k):
    """(local rows, experts with rows, bucket, activation bytes) of a balanced routing."""
    rows = tokens * top_k * e_local // e_global
    return rows, min(e_local, rows), "decode" if tokens <= 64 else "prefill", _act_bytes(kind, rows, k)


def _swiglu_case(model: str, kind: str, out: str, tokens: int, top_k: int, e_global: int, e_local: int,
                 i_dim: int, k: int, act: dict, masked: bool = False, max_m: int = 16, tier: str = "full") -> BenchCase:
    """out: "bf16" (the GEMM's dtype), "fp8" (1x128 groups) or "mxfp4" (linear scales: GEMM2 W4A4's activations)."""
    from dispatch.reference import swiglu as sw_ref

    op = {"bf16": "moe_gemm_swiglu", "fp8": "moe_gemm_swiglu_fp8_group", "mxfp4": "moe_gemm_swiglu_mxfp4"}[out]
    n = 2 * i_dim
    quant = dict(group_size=FP8_BLOCK) if out == "fp8" else {}

    make = _routed_make(kind, tokens, top_k, e_global, e_local, masked, max_m, n, k)

    def fused(i, b):
        fn = getattr(ops, op)
        return fn(i["a"], i["w"], a_scale=i.get("a_scale"), w_scale=i.get("w_scale"), weights=kind, **_lay(i), **act,
                  **quant, backend=b, w_global=i.get("w_global"))

    def chain(i):
        h = _call(kind)(i, "auto")
        layout = dict(expert_ids=i.get("m_indices"), masked_m=i.get("masked_m"))
        if out == "fp8":
            return ops.swiglu_fp8_group(h, **act, **layout, group_size=FP8_BLOCK)
        if out == "mxfp4":
            return ops.swiglu_mxfp4(h, **act, **layout)
        return ops.swiglu(h, **act, **layout)

    def reference(i):
        h = lean_layout_gemm(kind, i)
        lay_ = (act["interleave"], act["activation"], act["alpha"], act["limit"], i.get("m_indices"),
                i.get("masked_m"))
        if out == "fp8":
            return sw_ref.swiglu_fp8_group(h, *lay_, None, FP8_BLOCK, 1e-10, False, False)
        if out == "mxfp4":
            return sw_ref.swiglu_mxfp4(h, *lay_, None, "floor", False)
        return sw_ref.swiglu(h, *lay_)

    def lowbit(i, b):
        if b == "torch" and tier == "full":
            raise BackendError(FULL_TORCH_BACKEND)
        return fused(i, b)

    rows, experts, bucket, act_b = _routed_sizes(kind, tokens, top_k, e_global, e_local, k)
    out_b = {"bf16": rows * i_dim * 2, "fp8": rows * i_dim + rows * (i_dim // FP8_BLOCK) * 4,
             "mxfp4": rows * i_dim // 2 + rows * (i_dim // 32)}[out]
    label = (f"{model} gemm1+swiglu{'' if out == 'bf16' else '+' + out} {tokens} tokens top-{top_k} E={e_local}"
             f"{'/' + str(e_global) if e_local < e_global else ''} I={i_dim} K={k} {kind} "
             f"{'masked' if masked else 'contiguous'}")
    params = dict(model=model, stage="gemm1+swiglu", tokens=tokens, top_k=top_k, E=e_local, E_global=e_global,
                  I=i_dim, K=k, kind=kind, out=out,
                  layout="masked" if masked else "contiguous")
    checks = {"bf16": check, "fp8": _check_fp8_out, "mxfp4": _check_mxfp4_out}
    return BenchCase(op, label, bucket, params, make, lowbit, reference, checks[out],
                     bytes_moved=weight_bytes(kind, experts, n, k) + act_b + out_b, flops=2 * rows * n * k,
                     peers={"unfused-chain": chain}, compile_reference=False, tier=tier,
                     flops_dtype="fp8" if kind in ("fp8", "w4a8") else "bf16")


def _combine_case(model: str, kind: str, tokens: int, top_k: int, e_global: int, e_local: int, n: int, k: int,
                  masked: bool = False, max_m: int = 16, tier: str = "full") -> BenchCase:
    from dispatch.reference.moe import moe_combine as combine_ref

    make = _routed_make(kind, tokens, top_k, e_global, e_local, masked, max_m, n, k)

    def lowbit(i, b):
        if b == "torch" and tier == "full":
            raise BackendError(FULL_TORCH_BACKEND)
        return ops.moe_gemm_combine(i["a"], i["w"], i["src_rows"], i["inv_rows"], i["topk_weights"],
                                    a_scale=i.get("a_scale"), w_scale=i.get("w_scale"), weights=kind, **_lay(i),
                                    backend=b, w_global=i.get("w_global"))

    def chain(i):
        return ops.moe_combine(_call(kind)(i, "auto"), i["inv_rows"], i["topk_weights"])

    def reference(i):
        return combine_ref(lean_layout_gemm(kind, i), i["inv_rows"], i["topk_weights"], None, BF16)

    rows, experts, bucket, act_b = _routed_sizes(kind, tokens, top_k, e_global, e_local, k)
    label = (f"{model} gemm2+combine {tokens} tokens top-{top_k} E={e_local}"
             f"{'/' + str(e_global) if e_local < e_global else ''} N={n} K={k} {kind} "
             f"{'masked' if masked else 'contiguous'}")
    params = dict(model=model, stage="gemm2+combine", tokens=tokens, top_k=top_k, E=e_local, E_global=e_global,
                  N=n, K=k, kind=kind, layout="masked" if masked else "contiguous")
    # bytes: weights, activation rows, the scattered rows written and read back once, the (T, N) output
    return BenchCase("moe_gemm_combine", label, bucket, params, make, lowbit, reference, check,
                     bytes_moved=weight_bytes(kind, experts, n, k) + act_b + 2 * rows * n * 2 + tokens * n * 2,
                     flops=2 * rows * n * k, peers={"unfused-chain": chain}, compile_reference=False, tier=tier,
                     flops_dtype="fp8" if kind in ("fp8", "w4a8") else "bf16")


def fused_cases() -> list[BenchCase]:
    silu = dict(interleave=0, activation="silu", alpha=1.702, limit=None)
    gptoss = dict(interleave=1, activation="gptoss", alpha=1.702, limit=7.0)
    h_dsv3, h_oss = DSV3["gemm1"][1], GPT_OSS_GEMM1[1]
    return [
        _swiglu_case("dsv3", "fp8", "fp8", 64, 8, 256, 256, DSV3_I, h_dsv3, silu, masked=True),
        _swiglu_case("dsv3", "fp8", "fp8", 4096, 8, 256, 32, DSV3_I, h_dsv3, silu),
        _swiglu_case("dsv3", "bf16", "bf16", 64, 8, 256, 256, DSV3_I, h_dsv3, silu, masked=True),
        _swiglu_case("gpt-oss-120b", "mxfp4", "bf16", 64, 4, 128, 128, GPT_OSS_I, h_oss, gptoss),
        _swiglu_case("gpt-oss-120b", "mxfp4", "bf16", 4096, 4, 128, 128, GPT_OSS_I, h_oss, gptoss),
        _swiglu_case("gpt-oss-120b", "mxfp4", "mxfp4", 4096, 4, 128, 128, GPT_OSS_I, h_oss, gptoss),
        _swiglu_case("gpt-oss-120b", "nvfp4", "bf16", 64, 4, 128, 128, GPT_OSS_I, h_oss, gptoss),
        _swiglu_case("gpt-oss-120b", "nvfp4", "bf16", 4096, 4, 128, 128, GPT_OSS_I, h_oss, gptoss),
        _combine_case("dsv3", "fp8", 64, 8, 256, 256, h_dsv3, DSV3_I, masked=True),
        _combine_case("dsv3", "fp8", 4096, 8, 256, 32, h_dsv3, DSV3_I),
        _combine_case("gpt-oss-120b", "mxfp4", 4096, 4, 128, 128, h_oss, GPT_OSS_I),
        _combine_case("gpt-oss-120b", "nvfp4", 4096, 4, 128, 128, h_oss, GPT_OSS_I),
        # tiny shapes for the CPU interpreter (CI): masked, contiguous with padding, expert parallel
        _swiglu_case("quick", "fp8", "fp8", 8, 2, 4, 4, 128, 128, silu, masked=True, max_m=8, tier="quick"),
        _swiglu_case("quick", "mxfp4", "bf16", 8, 2, 4, 4, 64, 64, gptoss, tier="quick"),
        _swiglu_case("quick", "mxfp4", "mxfp4", 8, 2, 4, 4, 64, 64, gptoss, tier="quick"),
        _combine_case("quick", "fp8", 8, 2, 4, 2, 64, 128, tier="quick"),
        _swiglu_case("quick", "nvfp4", "bf16", 8, 2, 4, 4, 64, 64, gptoss, tier="quick"),
        _combine_case("quick", "nvfp4", 8, 2, 4, 2, 64, 64, tier="quick"),
    ]


def cases() -> list[BenchCase]:
    out = fused_cases()
    for kind in ("bf16", "fp8"):
        for gemm, (n, k) in DSV3.items():
            out.append(_case("dsv3", gemm, kind, 32, n, k, rows=256))
            out.append(_case("dsv3", gemm, kind, 256, n, k, rows=16, masked=True))
            # under the cute rows' thresholds (cute_ops.gemm.grouped_sm90:auto_skip_bf16 / auto_skip_fp8: 256 / 128)
            out.append(_case("dsv3", gemm, kind, 32, n, k, rows=128))
            out.append(_case("dsv3", gemm, kind, 32, n, k, rows=512))  # FP8's bar against dense starts here
    n, k = GPT_OSS_GEMM1
    for kind in ("mxfp4", "bf16", "w4a4", "nvfp4"):
        out.append(_case("gpt-oss-120b", "gemm1", kind, 128, n, k, rows=16))
        out.append(_case("gpt-oss-120b", "gemm1", kind, 32, n, k, rows=256))
    for kind in ("mxfp4", "nvfp4"):  # prepacked weights (the swap-AB kernel): decode (both layouts for MXFP4), prefill
        out.append(_case("gpt-oss-120b", "gemm1", kind, 128, n, k, rows=16, prepacked=True))
        out.append(_case("gpt-oss-120b", "gemm1", kind, 32, n, k, rows=256, prepacked=True))
    out.append(_case("gpt-oss-120b", "gemm1", "mxfp4", 128, n, k, rows=16, masked=True, prepacked=True))
    for kind in ("mxfp4", "nvfp4"):  # GPT-OSS-20b: all 32 experts, top-4 of 64 / 4096 tokens
        out.append(_case("gpt-oss-20b", "gemm1", kind, 32, n, k, rows=8, prepacked=True))
        out.append(_case("gpt-oss-20b", "gemm1", kind, 32, n, k, rows=512, prepacked=True))
    n, k = GPT_OSS_GEMM2
    for model, experts, rows in (("gpt-oss-120b", 128, 16), ("gpt-oss-120b", 32, 256), ("gpt-oss-20b", 32, 8),
                                 ("gpt-oss-20b", 32, 512)):
        out.append(_case(model, "gemm2", "mxfp4", experts, n, k, rows=rows, prepacked=True))
    n, k = DSV3["gemm1"]  # W4A8 needs K % 128 (1x128 activation scales): DeepSeek dims
    out.append(_case("dsv3", "gemm1", "w4a8", 256, n, k, rows=16, masked=True))
    out.append(_case("dsv3", "gemm1", "w4a8", 32, n, k, rows=256))
    return out + _quick_cases()
