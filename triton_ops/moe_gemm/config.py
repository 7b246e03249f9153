"""Tile configs of the MoE grouped GEMMs: a frozen dataclass and the analytical rule that picks one.

The rule looks only at shapes (never at routing data, which would need a host sync): the expected rows per
expert (contiguous layout: capacity / E; masked layout: max_m), N, K, the weight kind and the device's arch.
It has not been tuned on hardware yet; `config=` on every entry overrides it (benchmark sweeps).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from triton_ops._launch import next_pow2
from triton_ops.contract.arch import arch_of
from triton_ops.contract.formats import MXFP4_BLOCK
from triton_ops.contract.moe_gemm import FP8_BLOCK

KINDS = ("bf16", "fp8", "mxfp4", "w4a8", "w4a4", "nvfp4")
# Kinds whose K step is exactly one 1x128 activation scale group.
_K128_KINDS = ("fp8", "w4a8")

# archs with ~100 KB of shared memory per SM (consumer parts): one pipeline stage fewer on big tiles
_SMALL_SMEM_ARCHS = ("sm_86", "sm_89", "sm_120", "sm_121")  # ~100 KB of shared memory per SM
# the MXFP4 decode tile's register cap: the folded loop compiles to 171-176 registers (ptxas sm_90, Triton 3.6), two
# CTAs per SM; at 168, three (as the two-multiply tile it replaced), with no spills
DECODE_FOLD_REGISTERS = 168
FOLD_MODES = ("off", "tile", "loop")


@dataclasses.dataclass(frozen=True)
class MoeGemmConfig:
    block_m: int  # rows per program; a tile whose rows span several experts runs one K loop per expert present
    block_n: int  # output columns per program
    block_k: int  # K per step (fp8: exactly 128, one activation and one weight scale per step; mxfp4: 32 * j;
                  # nvfp4: any, a power of two >= 16 is a whole number of 16-wide scale blocks)
    group_m: int  # M tiles per swizzle group: the programs of one group walk the same weight N tile (L2 reuse)
    num_warps: int  # warps per program (GPU only)
    num_stages: int  # software-pipeline depth of the K loop (GPU only)
    # The prepacked FP4 kernel's prefill options (pick_prepacked_config_for_arch sets them)
    scale_words: bool = False  # prepacked FP4 only: the scale bytes loaded in the shape (and thread mapping) of the
                               # value words, no layout conversion of the scales (prepacked.py: _weight_tile)
    fold_scale: str = "off"  # prepacked MXFP4 only: the K loop with one multiply per pair (the bit trick's bias
                             # folded into the scale) where every scale byte is <= 128, else two (no host sync).
                             # "tile": each program checks its rows' scale bytes first and runs one of the loops;
                             # "loop": the folded loop (factors +inf past 128), a tile with a non-finite sum redone
    a_tma: bool = False  # prepacked FP4 only: the tokens by TMA (a tensor descriptor; a layout that allows one)
    expert_slots: int = 1  # prepacked FP4, contiguous layout only: programs per tile, slot s running the K loop of
                           # the s-th expert present in the tile (the last slot those from there on), so the experts
                           # of a decode tile that spans several run in parallel instead of one after another
    max_registers: int = 0  # prepacked FP4 only (GPU): registers per thread the compiler may use (Triton's maxnreg;
                            # 0: its own choice), so that a tile just past a CTA-count boundary keeps the CTAs

    def refusal(self, kind: str) -> str | None:
        """Why this config cannot run weight kind `kind` (None: it can)."""
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                return f"{name}={v} is not a power of two >= 16 (tl.dot)"
        if kind in _K128_KINDS and self.block_k != FP8_BLOCK:
            return f"{kind} needs block_k={FP8_BLOCK} (one activation scale per K step), got {self.block_k}"
        if kind in ("mxfp4", "w4a4") and self.block_k % MXFP4_BLOCK:
            return f"{kind} needs block_k a multiple of {MXFP4_BLOCK}, got {self.block_k}"
        if self.group_m < 1:
            return f"group_m={self.group_m} < 1"
        if self.expert_slots != 1:
            return f"expert_slots={self.expert_slots}: more than one slot is the prepacked FP4 kernel's option"
        if self.fold_scale != "off":
            return f"fold_scale={self.fold_scale!r}: the folded conversion is the prepacked MXFP4 kernel's option"
        if self.max_registers:
            return f"max_registers={self.max_registers}: a register cap is the prepacked FP4 kernel's option"
        return None


def rows_per_expert(rows: int, num_experts: int, masked: bool) -> int:
    """Expected rows of one expert: max_m (masked: the buffer bound, the counts are data) or the contiguous
    capacity spread over the experts."""
    return rows if masked else -(-rows // max(num_experts, 1))


def pick_config(kind: str, m_per_expert: int, n: int, k: int, device: torch.device) -> MoeGemmConfig:
    """The config for `kind` ("bf16", "fp8", "mxfp4") at m_per_expert rows per expert on `device`.
    Contiguous layout: align with moe_align's block_m a multiple of the config's block_m, so every tile holds one
    expert (other alignments are correct, but a tile spanning experts runs one K loop per expert)."""
    return pick_config_for_arch(kind, m_per_expert, n, k, arch_of(device))


@functools.lru_cache(maxsize=4096)  # eager hot path; the answer depends on sizes and arch only
def pick_config_for_arch(kind: str, m: int, n: int, k: int, arch: str) -> MoeGemmConfig:
    """Decode (<= 32 rows per expert): BLOCK_M 16 / 32 so little of each tile is padding, and BLOCK_N 64 so a
    handful of rows still spreads over N/64 programs per expert; BLOCK_K 128 (16-byte-plus loads of the
    weight stream, which is all the traffic there). Mid (<= 64): 64x128. Prefill: 128x128 with BLOCK_K 64
    (bf16, mxfp4, nvfp4: 32 KB of operands per stage) or 128 (fp8: 32 KB too), 8 warps (two consumer warpgroups on
    Hopper), 3 stages (96 KB of shared memory; 2 on ~100 KB parts). GROUP_M 8 on prefill: the 8 M tiles of a
    group (mostly one expert) reuse each weight tile from L2.
    Interpreter: its cost is per program and per op, so the largest tiles that keep numpy arrays small."""
    bk_min = MXFP4_BLOCK if kind in ("mxfp4", "w4a4") else 16
    if arch == "cpu":
        bm = min(64, max(16, next_pow2(m)))
        bn = min(256, max(16, next_pow2(n)))
        bk = FP8_BLOCK if kind in _K128_KINDS else min(128, max(bk_min, next_pow2(k)))
        return MoeGemmConfig(bm, bn, bk, group_m=1, num_warps=4, num_stages=1)
    if m <= 32:
        return MoeGemmConfig(16 if m <= 16 else 32, 64, 128, group_m=1, num_warps=4, num_stages=4)
    if m <= 64:
        return MoeGemmConfig(64, 128, 64 if kind == "bf16" else 128, group_m=4, num_warps=4, num_stages=3)
    stages = 2 if arch in _SMALL_SMEM_ARCHS else 3
    if kind == "bf16" and arch not in _SMALL_SMEM_ARCHS:
        # 5 stages (160 KB of shared memory): a deeper ring keeps the 16-bit MMA fed at prefill, faster than 3 on
        # DeepSeek's GEMM1 / GEMM2; 128x256 x 4 stages was about as fast but needs 255 registers and spills to the
        # stack (docs/moe_gemm.md, Measured and alternatives measured).
        return MoeGemmConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=5)
    # fp8 / w4a8: one activation scale per K step; w4a4: 128 FP4 values are 64 bytes a row, as bf16's 64 are 128
    bk = 64 if kind in ("bf16", "mxfp4", "nvfp4") else 128
    return MoeGemmConfig(128, 128, bk, group_m=8, num_warps=8, num_stages=stages)


def pick_prepacked_config(m_per_expert: int, n: int, k: int, device: torch.device, fmt: str = "mxfp4",
                          swiglu: bool = False, masked: bool = False) -> MoeGemmConfig:
    """The config of the prepacked FP4 kernel (prepacked.py; swap-AB: block_m = tokens, block_n = weight rows) for
    `fmt` ("mxfp4" / "nvfp4") weights over the contiguous or the masked layout; n: the weight rows (GEMM1 + SwiGLU:
    2I, its tile the plain GEMM's, holding the gate and up rows of block_n // 2 output columns in one
    accumulator)."""
    cfg = pick_prepacked_config_for_arch(m_per_expert, n, k, arch_of(device), fmt, masked)
    return prepacked_swiglu_config(cfg) if swiglu else cfg


def prepacked_swiglu_config(cfg: MoeGemmConfig) -> MoeGemmConfig:
    """GEMM1 + SwiGLU on prepacked weights: the plain tile, with 4 pipeline stages instead of 3 at the 128-token
    prefill tile, faster at GPT-OSS prefill shapes for both formats (docs/moe_gemm.md, alternatives measured)."""
    if cfg.block_m == 128 and cfg.num_stages == 3:
        return dataclasses.replace(cfg, num_stages=4)
    return cfg


@functools.lru_cache(maxsize=4096)
def pick_prepacked_config_for_arch(m: int, n: int, k: int, arch: str, fmt: str = "mxfp4",
                                   masked: bool = False) -> MoeGemmConfig:
    """Decode (<= 32 tokens per expert): the tokens rounded up to 16 / 32 (the MMA's N side), 128 weight rows (two
    64-row warpgroup-MMA blocks of one warpgroup), 4 warps, 128 K per step, 4 stages. MXFP4 at <= 16 tokens: the
    folded loop checked by its sums (fold_scale "loop": 438 SASS instructions per 128-K step against the
    two-multiply loop's 526) under a 168-register cap (3 CTAs per SM; uncapped it takes 171-176, 2 CTAs): 1.08-1.10x
    the two-multiply tile at GPT-OSS-20b / 120b GEMM1 and GEMM2 decode on the H200; the per-tile pre-pass ("tile")
    compiles to 207 registers there and was slower (0.63-0.85x triton_kernels). 32-token tiles, 64 and 256 weight
    rows, 256-K steps, 8 warps and the other scale options were slower (docs/moe_gemm.md, alternatives measured).
    Contiguous layout with fewer expected rows per expert than the tile holds: one expert slot per expert a tile is
    expected to hold (up to 4), so a 16-token tile of two 8-row experts runs them in two programs (1.05x MXFP4, 1.04x
    NVFP4 at GPT-OSS-20b GEMM1 decode on the H200; 2-4 slots alike there, no change at 16 rows per expert; GEMM2 (N =
    2880, half the programs) 0.97x one slot, within the spread between runs).
    Mid (<= 64): 64 tokens x 128 rows, 8 warps (two warpgroups of 64 weight rows; 4 warps spill, ptxas sm_90).
    Prefill: 128 tokens x 128 weight rows, 8 warps (each warpgroup a 64 x 128 fp32 accumulator), 128 K, 3 stages
    (~115 KB of shared memory; 2 on ~100 KB parts): at least as fast as 4 stages; 256-token tiles spill (ptxas,
    sm_90, Triton 3.6) and the tokens-on-M orientation (the weight tile as the shared-memory B operand) was slower
    (docs/moe_gemm.md, alternatives measured). The contiguous layout should be aligned to block_m.
    Prefill loads the tokens by TMA (a_tma, where the layout allows a descriptor); MXFP4 also loads the scale bytes
    in the value words' shape (scale_words) and runs the folded conversion (one multiply per pair) in every tile
    whose scale bytes are all <= 128 (fold_scale): per 128-K step 302 SASS instructions per thread against
    372 (ptxas sm_90, Triton 3.6), equal bytes; both formats faster than the plain tile with these options, while
    scale_words + fold without TMA, and scale_words for NVFP4, were not (docs/moe_gemm.md, Measured and
    alternatives measured).
    Interpreter: one 128-K chunk per step, tiles no larger than the problem."""
    if arch == "cpu":
        bt = 16 if m <= 16 else 32 if m <= 32 else 64
        return MoeGemmConfig(bt, min(128, max(16, next_pow2(n))), 128, group_m=1, num_warps=4, num_stages=1)
    if m <= 32:
        block_t = 16 if m <= 16 else 32
        slots = 1 if masked else min(4, block_t // max(m, 1))
        if m <= 16 and fmt == "mxfp4":
            return MoeGemmConfig(block_t, 128, 128, group_m=1, num_warps=4, num_stages=4, expert_slots=slots,
                                 fold_scale="loop", max_registers=DECODE_FOLD_REGISTERS)
        return MoeGemmConfig(block_t, 128, 128, group_m=1, num_warps=4, num_stages=4, expert_slots=slots)
    if m <= 64:
        return MoeGemmConfig(64, 128, 128, group_m=1, num_warps=8, num_stages=2 if arch in _SMALL_SMEM_ARCHS else 4)
    return MoeGemmConfig(128, 128, 128, group_m=1, num_warps=8, num_stages=2 if arch in _SMALL_SMEM_ARCHS else 3,
                         scale_words=fmt == "mxfp4", fold_scale="tile" if fmt == "mxfp4" else "off", a_tma=True)


_FUSED_SMEM_BUDGET = 200 * 1024  # operand pipeline bytes of a fused GEMM1 tile (an H100 CTA may use 227 KB)


def pick_swiglu_gemm_config(kind: str, m_per_expert: int, i: int, k: int, device: torch.device,
                            min_block_n: int) -> MoeGemmConfig:
    """The config of GEMM1 + SwiGLU for `kind` at m_per_expert rows per expert and I = i on `device`."""
    return pick_swiglu_gemm_config_for_arch(kind, m_per_expert, i, k, arch_of(device), min_block_n)


@functools.lru_cache(maxsize=4096)
def pick_swiglu_gemm_config_for_arch(kind: str, m: int, i: int, k: int, arch: str, min_block_n: int) -> MoeGemmConfig:
    """GEMM1 + SwiGLU: a tile holds BLOCK_N output columns, i.e. two [BLOCK_M, BLOCK_N] accumulators (gate and up).
    The GEMM rule at N = I, with the prefill tile halved to 128 x 64 (x 2 accumulators: the MMA work and registers
    of the plain 128 x 128 tile); min_block_n: the output format's smallest column tile (a whole FP8 group)."""
    cfg = pick_config_for_arch(kind, m, i, k, arch)
    if cfg.block_m < 128 or arch == "cpu":
        return dataclasses.replace(cfg, block_n=max(cfg.block_n, min_block_n))
    block_n = max(64, min_block_n)
    # FP8 weights with a 128-wide output tile: 64 rows (ptxas, sm_90, Triton 3.6: 128 x 128 x 2 accumulators spill
    # ~2 KB per thread, 64 x 128 ~0.45 KB; picked by the spill count, not by timing)
    block_m = 64 if kind == "fp8" and block_n >= 128 else cfg.block_m
    # pipeline stages within ~200 KB of shared memory: per stage the activation tile and two weight tiles
    a_bytes = 1 if kind in ("fp8", "w4a8") else 2
    w_bytes = {"bf16": 2, "fp8": 1}.get(kind, 0.5)
    per_stage = block_m * cfg.block_k * a_bytes + 2 * block_n * cfg.block_k * w_bytes
    stages = max(2, min(cfg.num_stages, int(_FUSED_SMEM_BUDGET // per_stage)))
    return dataclasses.replace(cfg, block_m=block_m, block_n=block_n, num_stages=stages)
