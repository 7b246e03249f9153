"""CuTeDSL attention: a tcgen05 forward for Blackwell (sm_100a), a WGMMA forward for Hopper (sm_90a), and the
pieces both are built from.

The Hopper kernel (`fmha_sm90.py` and its kernel class in `_fmha_sm90_kernel.py`, with `wgmma.py` for its WGMMA
layouts and `launch.py` for the host pieces both kernels share: argument list, fake compile arguments, input
checks, the call) ran on an H100 and an H200; dispatch ranks it first for `attention_prefill` on sm_90, see that
module and docs/cute.md. The rest of this docstring is about the Blackwell kernel.

Each kernel is two modules: `fmha_smXX.py` (config, rule, entry, compile; importable without nvidia-cutlass-dsl)
and `_fmha_smXX_kernel.py` (the module-level kernel class; imports cutlass at the top, imported by `build` only).

STATUS: COMPILED AND SASS-INSPECTED ON A CPU, NEVER RUN ON BLACKWELL HARDWARE. No Blackwell GPU has executed
this kernel; its numerics are unverified on hardware. It is not in the dispatch table (dispatch/table.py) and
nothing in lowbit calls it. What is verified, on a CPU (tests/test_cute_attention.py):
  * the kernel compiles for sm_100a (nvidia-cutlass-dsl 4.8.1, `--gpu-arch sm_100a`) and its SASS holds the
    instructions below, with no local memory;
  * parts of the device code itself run on the host CPU (a @cute.jit function that launches no kernel executes
    there): the traced mask formulas, the element mask with the coordinates of a thread's TMEM-load slice, the
    softmax step helpers (portable forms), and the TMEM partition facts the per-thread code relies on;
  * the host twins (`emulate`: the same mask, scheduler and softmax code on torch tensors, tile by tile) match
    dispatch/reference/attention.py on drawn varlen cases.
Not exercised anywhere: the device scheduler's warp scan, TMA, UMMA, TMEM loads/stores, the mbarrier protocol
between the roles, and the output stores.

What lives where (FA4's layout: shared semantics once, kernels compose them):

* `mask.py`       which keys a query row sees (lowbit's contract: bottom-right causal, window (left, right),
                  -1 unbounded): key range per query tile, mask-free tile range, one [lo, hi) interval per row.
                  The formulas are plain arithmetic run both on the host (twins, tested against
                  `visible_keys` and triton_ops/attention/mask.py) and inside the kernel while it is traced;
                  `apply_row_bounds` is the device element mask (two signed compares and a select per score).
* `softmax.py`    online softmax in the exp2 domain: sink init (m = sink * log2 e, l = 1), FA4's conditional
                  rescale (keep the old max unless it grew by more than RESCALE_THRESHOLD = 8 in log2 units;
                  O is rescaled only when some row of a warp needs it), finalize to out = O / l and natural-log
                  lse. `OnlineSoftmaxModel` is the torch twin; device helpers use packed FFMA2/FADD2 and
                  MUFU.EX2, and convert P to 16-bit 32 columns at a time (keeps the softmax warps spill-free).
* `scheduler.py`  varlen tile scheduling from cu_seqlens_q: PACKED (a 1-D grid bounded by
                  (total_q + B * 127) // 128 * Hq from host-known sizes; a warp-wide shuffle scan over cu_seqlens
                  maps the CTA index to (batch, m-tile, head), heads fastest, last m-tile first for causal).
                  `packed_tile` is the host model of the same algorithm.
* `fmha_sm100.py` the host side (`FmhaSm100Config`, `build`, `dump`, `compiled` through lowbit's compile cache),
                  `emulate` (the whole algorithm tile by tile on the host), and an entry pair with the triton
                  backend's signatures for the lead to register after a hardware run: `supports_attention_prefill`
                  (returns HARDWARE_STATUS on a capable GPU: it is not offered yet) and `attention_prefill` (written
                  against the kernel's argument list, never executed). One CTA per (128-row query tile, query
                  head), 12 warps:
                  softmax WG (LDTM S from TMEM -> mask -> exp2 -> STTM P into TMEM), correction WG (conditional
                  O rescale in TMEM, then O / l -> 16-bit -> STG.E.128 row-predicated, and lse), an MMA warp
                  (tcgen05.mma: S = Q K^T SS, O += P V TS with P from TMEM), a TMA load warp; mbarrier pipelines
                  between them (see that module's docstring for the per-tile protocol and TMEM map). The kernel
                  class is in `_fmha_sm100_kernel.py`.

Supported (compiled): bf16 and fp16; head_dim 64 and 128 (Dqk = Dv); fp32 accumulation and LSE; causal,
sliding window (left and/or right; sizes are runtime arguments, the flags are compile-time), causal + window,
attention sinks, GQA/MQA (Hq % Hkv == 0, KV head h // (Hq / Hkv)), varlen batches through cu_seqlens (sequences
with no queries, with no keys, with sk < sq, rows that see no key: out 0, lse -inf or the sink). Requires: unit
stride on D, 16-byte aligned token/head strides and base pointers (TMA), softmax_scale > 0 (the row max is taken
before scaling), and a non-empty launch (total_q > 0: the caller skips empty batches). Rows just past a sequence
are read by the TMA boxes (the next sequence's rows, or zeros past the tensor) and masked or never stored; they
must be finite (as in FA4).

SASS checked (tests/test_cute_attention.py, sm_100a, cuobjdump from the Triton wheel), bf16 D=128 counts from
nvidia-cutlass-dsl 4.8.1: UTCHMMA 24 (the SASS name of tcgen05.mma.cta_group::1.kind::f16: D/16 at each of the
two S = Q K^T call sites, 128/16 for O += P V, whose A operand is read from TMEM), LDTM.x32 12 (4 for S, D/32 each
for the rescale and the epilogue), STTM.x32 6 (2 for P, D/32 for the rescale), UTCBAR 9 (tcgen05.commit),
UTMALDG.3D 6 (Q, K, V: two 64-column boxes each at D=128), USETMAXREG 5 (DEALLOC to 80/96, TRY_ALLOC to 200),
MUFU.EX2 129, FFMA2 64, F2FP.BF16.F32.PACK_AB 128, STG.E.128 32, VOTE.ANY (the rescale vote), no STL/LDL at all.
D=64: UTCHMMA 16, LDTM 8, STTM 4, UTMALDG 3.

A CuTeDSL pitfall (4.8.1, shown by running the mask on the host): inside
`cutlass.range(..., unroll_full=True)`, an unsigned compare of a value derived from an identity-tensor coordinate
at the loop index came out signed; the sm90 kernel's WGMMA accumulator coordinates showed the same even under
range_constexpr, so mask.apply_row_bounds now uses two signed compares; tests pin both.
Also: the DSL evaluates kernel annotations, so _fmha_sm100_kernel.py has no `from __future__ import annotations`; MMA
objects whose ACCUMULATE field is set in one role's branch must not be reused by later branches (the MMA warp
builds its own); values kept in registers across setmaxnreg were spilled by ptxas (the tile coordinates go through
SMEM instead).

Not done (in the order that matters for speed): two query tiles per CTA ping-ponging two softmax warpgroups
(FA4's main overlap: with one tile, the tensor core idles while softmax runs), a persistent scheduler, TMA store
of O through SMEM (O goes out in row-per-thread 16-byte stores), 2-CTA UMMA (M = 256), the bitmask (R2P) element mask,
exp2 emulation on the FMA pipe, split-KV, paged KV, FP8 Q/K/V, head dims other than 64/128 and Dqk != Dv,
the backward pass, and a registration in dispatch (after a hardware run).
"""

from __future__ import annotations
