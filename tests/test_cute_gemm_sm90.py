"""cute_ops/gemm sm_90a grouped GEMM (grouped_sm90.py: its config, rule and moe_gemm backends; _grouped_sm90_kernel.py).

CPU: the bounded group scheduler (Python model, and the device class's own seek / coords source run on Python
ints), the group-bounds kernel's model (and the kernel compiled), the launchers against the reference through a
torch model of the kernel's contract, configs, the disk cache round trip, and (nvidia-cutlass-dsl) the kernel
compiled for sm_90a with its SASS / PTX checked: WGMMA, TMA loads, the in-kernel descriptor rewrite and its proxy
fences.
GPU (`-m gpu`, sm_90): the group-bounds kernel vs its model, the backends vs dispatch/reference/moe_gemm.py, routing
changes without a recompile, CUDA-graph replays with new group sizes, the dispatch row.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from cute_ops.gemm import scheduler as sch
from dispatch.reference import moe_gemm as ref
from tests.helpers import assert_close

try:
    import cutlass.cute as cute
except Exception:  # noqa: BLE001 - optional dependency: the DSL tests skip with the reason
    cute = None

needs_dsl = pytest.mark.skipif(cute is None, reason="nvidia-cutlass-dsl not installed: pip install 'lowbit[cute]'")


def _random_bounds(rng, groups, gap):
    """Groups as (starts, counts): any sizes (0 included), unaligned starts, optional holes between groups."""
    starts, counts, row = [], [], 0
    for _ in range(groups):
        row += rng.choice([0, gap])
        starts.append(row)
        counts.append(rng.choice([0, 0, 1, 5, 63, 64, 65, 127, 128, 129, 300]))
        row += counts[-1]
    return starts, counts


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("grid", [1, 5, 132])
def test_bounded_scheduler_walk_covers_every_tile_once(seed, grid):
    rng = random.Random(100 + seed)
    groups = rng.choice([1, 3, 32, 256])
    starts, counts = _random_bounds(rng, groups, rng.choice([0, 7, 16]))
    block_m, n_tiles = rng.choice([64, 128]), rng.choice([1, 2, 7])
    want = [(g, mt, nt) for g in range(groups) for nt in range(n_tiles) for mt in range(-(-counts[g] // block_m))]
    walked = {}
    for cta in range(grid):
        for i, tile in enumerate(sch.cta_tiles_bounded(cta, grid, starts, counts, block_m, n_tiles)):
            walked[cta + i * grid] = tile
    assert sorted(walked) == list(range(len(want)))
    for t, (g, mt, nt) in enumerate(want):  # the documented order: groups, then column tiles, row tile fastest
        tile = walked[t]
        assert (tile.group, tile.m_tile, tile.n_tile) == (g, mt, nt)
        assert tile.row_start == starts[g] + mt * block_m < tile.row_end == starts[g] + counts[g]


def test_bounded_scheduler_equals_offsets_form():
    offs = [0, 200, 200, 328, 1000]
    starts, counts = sch.bounds_of_offsets(offs)
    for grid in (1, 4, 132):
        for cta in range(grid):
            assert sch.cta_tiles(cta, grid, offs, 128, 3) == sch.cta_tiles_bounded(cta, grid, starts, counts, 128, 3)


@needs_dsl  # the device class is defined only with the DSL
@pytest.mark.parametrize("seed", range(4))
def test_bounded_scheduler_device_code_matches_model(seed, monkeypatch):
    """BoundedTileScheduler's own seek / coords (the code the kernel traces) run on Python ints and lists, with
    cutlass.min / Int32 replaced by their integer meaning, walk exactly the model's tiles. `seek` is re-made from
    its source text without the @cute.jit decorator (the DSL rewrites the decorated function once it has traced
    it, e.g. after a kernel compile earlier in the process)."""
    import inspect
    import textwrap
    import types

    monkeypatch.setattr(sch, "cutlass", types.SimpleNamespace(min=min, Int32=int))
    src = textwrap.dedent(inspect.getsource(sch.GroupedTileScheduler.seek))
    namespace: dict = {}
    exec(src[src.index("def seek"):], vars(sch).copy(), namespace)  # noqa: S102 - the module's own source
    seek = namespace["seek"]
    rng = random.Random(seed)
    starts, counts = _random_bounds(rng, rng.choice([1, 5, 64]), rng.choice([0, 9]))
    block_m, n_tiles, grid = rng.choice([64, 128]), rng.choice([1, 3]), rng.choice([1, 7, 132])
    dev = sch.BoundedTileScheduler(starts, counts, len(counts), block_m, n_tiles)
    for cta in range(grid):
        got, t = [], cta
        g, base = seek(dev, t, 0, 0)
        while g < dev.num_groups:
            m_tile, n_tile, row_start, row_end = dev.coords(t, g, base)
            got.append(sch.GroupTile(g, m_tile, n_tile, row_start, row_end))
            t += grid
            g, base = seek(dev, t, g, base)
        assert got == sch.cta_tiles_bounded(cta, grid, starts, counts, block_m, n_tiles), cta


def _bounds_layout(seed):
    """(m_indices as a list, E): moe_align-like padded runs with an out-of-range id, a split expert, or anything."""
    rng = random.Random(seed)
    e = rng.choice([1, 4, 9, 300])
    if seed % 4 == 1:  # moe_align-like: experts in order, padded with -1, an out-of-range id at the end
        ids = []
        for x in range(e):
            c = rng.choice([0, 1, 7, 40])
            ids += [x] * c + [-1] * (-c % 8)
        ids += [e + 2, -1]
    elif seed % 4 == 3:  # one expert's run, then the same expert again after others (a split span)
        ids = [0] * 30 + [e - 1] * 5 + [-1] * 3 + [0] * 2
    else:  # anything: interleaved experts and junk ids, more rows than the kernel's threads
        ids = [rng.randrange(-2, e + 2) for _ in range(rng.choice([1, 50, 300, 5000]))]
    return ids, e


def bounds_model(cfg):
    """Python model of group_bounds' kernel (its contract), run on CPU tensors: contiguous, each expert's first row
    and the rows up to its last (none: start max(rows - 1, 0), count 0); masked, g * max_m and the clamped count;
    the workspace zeroed."""
    def run(src, starts, counts, workspace, max_m):
        if workspace is not None:
            workspace.zero_()
        ids = src.tolist()
        for g in range(starts.numel()):
            if cfg.layout == "masked":
                starts[g], counts[g] = g * max_m, min(max(ids[g], 0), max_m)
                continue
            own = [r for r, v in enumerate(ids) if v == g]
            starts[g] = own[0] if own else max(len(ids) - 1, 0)
            counts[g] = own[-1] - own[0] + 1 if own else 0

    return run


@needs_dsl
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_group_bounds_kernel_compiles(arch):
    """The bounds kernel for both layouts, with and without the workspace: atomics only at run edges (RED min / max),
    two CTA barriers, reads of the final values through atomics."""
    from cute_ops.gemm import group_bounds as gb

    d = gb.dump(gb.BoundsConfig("contiguous", True, arch))
    assert d.count("REDG.E.MIN.S32") >= 1 and d.count("REDG.E.MAX.S32") >= 1, d.opcodes
    assert d.count("BAR.SYNC") == 2 and d.count("ATOMG.E.ADD") == 2
    m = gb.dump(gb.BoundsConfig("masked", False, arch))
    assert m.count("BAR.SYNC") == 0 and m.count("REDG") == 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(8))
def test_gpu_group_bounds_match_model(seed):
    """group_bounds.layout_groups on the GPU equals the model: contiguous layouts of every kind (padding,
    out-of-range ids, interleaved and split runs, up to 5000 rows over 1024 threads), masked counts (negative,
    above max_m), the workspace zeroed from garbage."""
    _sm90_gpu()
    from cute_ops.gemm.group_bounds import BoundsConfig, layout_groups

    ids, e = _bounds_layout(seed)
    w = torch.empty(e, 8, 16, device="cuda")
    mi = torch.tensor(ids, dtype=torch.int64 if seed % 2 else torch.int32)
    a = torch.empty(len(ids), 16, device="cuda")
    _, got_ids, starts, counts, ws = layout_groups(a, w, mi.cuda(), None, workspace_words=37 + seed)
    want_s, want_c = torch.empty(e, dtype=torch.int32), torch.empty(e, dtype=torch.int32)
    bounds_model(BoundsConfig("contiguous", True, "sm_90a"))(mi, want_s, want_c, None, 0)
    assert got_ids.dtype == torch.int32 and got_ids.cpu().tolist() == ids
    assert starts.cpu().tolist() == want_s.tolist() and counts.cpu().tolist() == want_c.tolist()
    assert ws.numel() == 37 + seed and not ws.any()
    rng = random.Random(seed)
    max_m = rng.choice([1, 16, 100])
    mm = torch.tensor([rng.randrange(-3, 2 * max_m) for _ in range(e)], dtype=torch.int32)
    _, _, starts, counts, ws = layout_groups(torch.empty(e, max_m, 16, device="cuda"), w, None, mm.cuda())
    assert ws is None and starts.cpu().tolist() == [g * max_m for g in range(e)]
    assert counts.cpu().tolist() == mm.clamp(0, max_m).tolist()


@pytest.mark.gpu
def test_gpu_group_bounds_of_no_rows():
    _sm90_gpu()
    from cute_ops.gemm.group_bounds import layout_groups

    _, _, starts, counts, ws = layout_groups(torch.empty(0, 16, device="cuda"), torch.empty(3, 8, 16, device="cuda"),
                                             torch.empty(0, dtype=torch.int32, device="cuda"), None, 5)
    assert starts.tolist() == counts.tolist() == [0, 0, 0] and not ws.any()


def test_sm90_backend_refusals_and_auto_skip(monkeypatch):
    from cute_ops.gemm import grouped_sm90

    a, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    assert "CUDA" in grouped_sm90.supports_moe_gemm_bf16(a, w, torch.zeros(4, dtype=torch.int32), None)
    monkeypatch.delenv(grouped_sm90.UNVERIFIED_ENV, raising=False)
    assert "under 128 rows per expert (decode) the Triton" in grouped_sm90.auto_skip_bf16(a, w, None, None, None)
    assert "decode" in grouped_sm90.auto_skip_fp8(a, None, w, None, None, None)  # 2 rows per expert
    big = torch.zeros(2 * 128, 64, dtype=torch.bfloat16)
    assert grouped_sm90.auto_skip_fp8(big, None, w, None, None, None) is None
    assert grouped_sm90.auto_skip_bf16(big, w, None, None, None) is None  # 128 rows per expert: cute, any K
    under = torch.zeros(2 * 127, 64, dtype=torch.bfloat16)
    assert grouped_sm90.auto_skip_bf16(under, w, None, None, None) is not None
    monkeypatch.setenv(grouped_sm90.UNVERIFIED_ENV, "1")
    assert grouped_sm90.auto_skip_bf16(a, w, None, None, None) is None


@needs_dsl
def test_sm90_config_rules():
    from cute_ops.gemm.grouped_sm90 import can_implement, pick_config, stage_bytes

    assert can_implement("bf16", 4096, 7168, 256) is None
    assert "multiple of 8" in can_implement("bf16", 4096, 7170, 8)
    assert "dtype" in can_implement("fp4", 512, 512, 8)
    assert can_implement("fp8", 512, 512, 8) is None
    assert "multiple of 128" in can_implement("fp8", 512, 320, 8)
    assert "one weight scale per tile" in can_implement("fp8", 512, 512, 8, tile_n=64)
    assert pick_config("fp8", 4096, 7168, 32, "contiguous", False, 256).tile_n == 128
    decode = pick_config("bf16", 4096, 7168, 256, "masked", False, 16)
    assert (decode.tile_m, decode.tile_n, decode.threads) == (64, 128, 256)
    prefill = pick_config("bf16", 4096, 7168, 32, "contiguous", True, 256)
    assert (prefill.tile_m, prefill.tile_n, prefill.threads) == (128, 256, 384)
    # the smem epilogue's 64 KB staging tile beside the ring: 3 stages (4 with the direct epilogue)
    assert prefill.stages * stage_bytes(128, 256) + 128 * 256 * 2 <= 232448 - 1024 and prefill.stages == 3
    assert prefill.desc_slots == prefill.stages + 1  # a slot is rewritten only after `stages` newer loads
    with pytest.raises(ValueError):
        pick_config("bf16", 512, 512, 4, "ragged", False, 16)
    assert pick_config("bf16", 512, 512, 4, "masked", False, 16, tile_m=128, tile_n=256, stages=2).stages == 2
    with pytest.raises(ValueError, match="stages"):
        pick_config("bf16", 512, 512, 4, "masked", False, 16, tile_m=128, tile_n=256, stages=5)


@needs_dsl
def test_launcher_fp8_prefill_tile():
    """grouped_sm90.config_for: contiguous FP8 prefill with N a multiple of 256 takes the 128 x 256 wave tile with the
    smem epilogue; N not a multiple of 256, decode sizes, the masked layout and any tiles override keep the rule's."""
    from cute_ops.gemm import grouped_sm90

    def cfg(rows, n, layout="contiguous", tiles=None, k=7168, e=32):
        a = torch.empty(rows, k, dtype=torch.uint8, device="meta")
        if layout == "masked":
            a = torch.empty(e, rows, k, dtype=torch.uint8, device="meta")
        w = torch.empty(e, n, k, dtype=torch.uint8, device="meta")
        return grouped_sm90.config_for("fp8", a, w, layout, False, "sm_90a", 132, tiles)

    wide = cfg(32 * 256, 4096)
    assert (wide.tile_m, wide.tile_n, wide.epilogue, wide.promote_run, wide.wide) == (128, 256, "smem", 0, True)
    assert cfg(32 * 256, 7168, k=2048).tile_n == 256
    assert cfg(32 * 256, 4224).tile_n == 128  # N not a multiple of 256
    assert cfg(32 * 64, 4096).tile_n == 128  # decode sizes
    assert cfg(32 * 128, 4096).tile_n == 128  # 128 rows per group: 128 x 128 was faster
    assert cfg(256, 4096, layout="masked").tile_n == 128  # capacity, not rows
    assert cfg(32 * 256, 4096, tiles=dict(stages=4)).tile_n == 128  # an override replaces the choice


@needs_dsl
def test_sm90_disk_cache_round_trip(tmp_path, monkeypatch):
    """The compiled function exports to the disk cache and a fresh process-level lookup loads it back."""
    from cute_ops import _compile
    from cute_ops.gemm.grouped_sm90 import build, pick_config

    monkeypatch.setenv("LOWBIT_CUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("LOWBIT_CUTE_DISK_CACHE", "1")
    cfg = pick_config("fp8", 256, 256, 3, "masked", True, 16)
    key = cfg.key() + ("disk-cache-test",)
    compiles, loads = _compile.STATS.compiles, _compile.STATS.disk_loads
    _compile.get_or_compile(key, lambda: build(cfg))
    _compile._memory.pop(key)
    assert callable(_compile.get_or_compile(key, lambda: build(cfg)))
    assert (_compile.STATS.compiles - compiles, _compile.STATS.disk_loads - loads) == (1, 1)
    assert _compile.object_path(key).exists()


SM90_CASES = [("bf16", 4096, 7168, 256, "masked", False, 16), ("bf16", 4096, 7168, 32, "contiguous", True, 256),
              ("fp16", 2880, 2880, 32, "contiguous", False, 96), ("fp8", 4096, 7168, 256, "masked", False, 16),
              ("fp8", 7168, 2048, 32, "contiguous", True, 256)]
_SM90_DUMPS: dict = {}


def compile_dump(shape, **overrides):
    """(config, PTX + SASS dump) of the sm_90 grouped GEMM for pick_config(*shape, **overrides), compiled on CPU."""
    from cute_ops.gemm.grouped_sm90 import dump, pick_config

    cfg = pick_config(*shape, **overrides)
    return cfg, dump(cfg)


def _sm90_dump(case):
    if case not in _SM90_DUMPS:
        # FP8 prefill: the plain schedule this test describes (the rule's schedules: tests/test_cute_gemm_sm90_fp8.py)
        _SM90_DUMPS[case] = compile_dump(case, promote_run=0, epilogue_prefetch=False, epilogue="direct")
    return _SM90_DUMPS[case]


@needs_dsl
@pytest.mark.parametrize("case", SM90_CASES, ids=lambda c: "-".join(map(str, c)))
def test_sm90_grouped_gemm_sass(case):
    cfg, d = _sm90_dump(case)
    ops = d.opcodes()
    assert "sm_90a" in d.ptx.split(".target", 1)[1][:40]
    # WGMMA, fp32 accumulators, each consumer warp group its own 64 rows. bf16 / fp16: HGMMA 64 x tile_n x 16, 4
    # per 64-wide K stage, issued in the first-K-tile block and in the loop body. FP8: QGMMA 64 x 128 x 32, 4 per
    # 128-wide stage (one block scale), the first of them not accumulating (a fresh partial sum per block).
    # (Dump.opcodes stops at the lowercase 'x' of the shape: read the full names from the listing)
    mmas = re.findall(r"\b[HQ]GMMA\.[0-9x]+\.F32(?:\.BF16|\.E4M3\.E4M3)?\b", d.sass)
    if cfg.dtype == "fp8":
        assert mmas == ["QGMMA.64x128x32.F32.E4M3.E4M3"] * 4, ops
        assert len(re.findall(r"QGMMA\.\S+ R\d+, gdesc\[UR\d+\], RZ, !UPT", d.sass)) == 1
        # the per-block promotion: acc += part * (a_scale[row] * w_scale), one FFMA per accumulator element
        assert ops["FFMA"] >= cfg.tile_n * 64 // 128, ops
    else:
        hgmma = f"HGMMA.64x{cfg.tile_n}x16.F32{'.BF16' if cfg.dtype == 'bf16' else ''}"
        assert mmas == [hgmma] * 2 * 4, ops
    assert d.count("WARPGROUP.ARRIVE") > 0 and d.count("WARPGROUP.DEPBAR") > 0, ops
    # TMA: A 2-D through the rewritten per-CTA descriptor, B 3-D (the expert is a coordinate) through the kernel
    # parameter; both base descriptors prefetched
    assert ops["UTMALDG.2D"] == 1 and ops["UTMALDG.3D"] == 1, ops
    assert ops["UTMACCTL.PF"] == 2, ops
    # Device-side descriptor update. PTX: tensormap.replace of the global address, the extents and the strides
    # of the slot in global memory, then the release / acquire proxy fences. SASS: the replaces are plain
    # read-modify-write LDG / STG on the 128-byte slot; the release is a GPU-scope MEMBAR; the acquire invalidates
    # the slot in the TMA unit's descriptor cache (UTMACCTL.IV).
    assert d.ptx.count("tensormap.replace.tile.global_address.global.b1024.b64") == 1
    assert d.ptx.count("tensormap.replace.tile.global_dim.global.b1024.b32") >= 2
    assert d.ptx.count("tensormap.replace.tile.global_stride.global.b1024.b64") >= 1
    assert d.ptx.count("fence.proxy.tensormap::generic.release.gpu;") == 1
    assert d.ptx.count("fence.proxy.tensormap::generic.acquire.gpu") == 1
    assert ops["UTMACCTL.IV"] == 1 and ops["MEMBAR.ALL.GPU"] >= 1, ops
    # the slot initialization: the base descriptor copied to each of this CTA's slots (64 bytes each)
    assert d.ptx.count("st.global.v2.b64") >= 4 * cfg.desc_slots
    # warp specialization: producer registers lowered, consumers raised
    assert ops["USETMAXREG.DEALLOC.CTAPOOL"] == 1 and ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1, ops
    # epilogue: predicated 4-byte stores of column pairs from the accumulators (one per 2 accumulator elements of
    # a thread), no 2-byte stores; the per-row loads (m_indices, row weights, FP8 activation scales) once per
    # distinct row, not per element
    assert d.ptx.count("st.global.b32") == cfg.tile_n * 64 // 128 // 2
    assert d.count("STG.E.U16") == 0, ops
    assert d.count("LDG") <= 32, ops
    # no spills; no R2UR under a predicate (sm_90a raises an illegal-instruction error on one)
    assert d.count("LDL") == 0 and d.count("STL") == 0, ops
    assert not re.search(r"@!?U?P\w+\s+R2UR", d.sass)


# ------------------------------------------------------------- launcher + a torch model of the kernel (CPU)


def _kernel_model(cfg):
    """The kernel's contract (grouped_sm90 module docstring) in torch, with its preconditions asserted: what the
    launcher's layout -> groups mapping must feed it."""
    from cute_ops.gemm.grouped_sm90 import FP8_BLOCK

    def run(a, w, out, starts, counts, m_indices, row_weights, workspace, a_scale, w_scale):
        rows, (e, n, k) = a.shape[0], w.shape
        assert (cfg.n, cfg.k, cfg.num_groups) == (n, k, e) and a.shape == (rows, k) and out.shape == (rows, n)
        assert starts.dtype == counts.dtype == torch.int32 and starts.shape == counts.shape == (e,)
        assert starts.is_contiguous() and counts.is_contiguous() and a.is_contiguous() and w.is_contiguous()
        assert workspace.dtype == torch.int64 and workspace.numel() == cfg.workspace_words
        assert (m_indices is None) == (cfg.layout == "masked") and (row_weights is None) == (not cfg.row_weights)
        if cfg.dtype == "fp8":
            assert a.dtype == w.dtype == torch.uint8 and a_scale.shape == (rows, k // FP8_BLOCK)
            a32 = a.view(torch.float8_e4m3fn).float() * a_scale.repeat_interleave(FP8_BLOCK, 1)
            w32 = ref.fp8_block_dequantize(w.view(torch.float8_e4m3fn), w_scale)
        else:
            a32, w32 = a.float(), w.float()
        for g in range(e):
            s0, c = int(starts[g]), int(counts[g])
            assert c >= 0 and (c == 0 or 0 <= s0 and s0 + c <= rows), (g, s0, c)
            for r in range(s0, s0 + c):
                if m_indices is None or int(m_indices[r]) == g:
                    y = a32[r] @ w32[g].T
                    out[r] = (y * row_weights[r] if row_weights is not None else y).to(out.dtype)
        # every other row zeros (the launcher's output is uninitialized): contiguous, ids outside [0, G); masked,
        # rows past their group's count
        for r in range(rows):
            if m_indices is not None:
                owned = 0 <= int(m_indices[r]) < e
            else:
                g = r // (rows // e)
                owned = r - int(starts[g]) < int(counts[g])
            if not owned:
                out[r] = 0

    return run


def stub_cuda_launch(monkeypatch, module, model, arch: str):
    """A CuTe launcher module run on CPU tensors: its compiled kernel replaced by `model(cfg)`, the CUDA device /
    arch queries it makes stubbed."""
    import contextlib

    from cute_ops.gemm import group_bounds

    monkeypatch.setattr(module, "compiled", model)
    monkeypatch.setattr(group_bounds, "compiled", bounds_model)
    monkeypatch.setattr(module._compile, "target_arch", lambda index=None: arch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


@pytest.fixture
def modelled_kernel(monkeypatch):
    """grouped_sm90's launchers on CPU tensors, the compiled kernel replaced by _kernel_model."""
    from cute_ops.gemm import grouped_sm90

    stub_cuda_launch(monkeypatch, grouped_sm90, _kernel_model, "sm_90a")
    monkeypatch.setattr(grouped_sm90, "_sm_count", lambda index: 132)
    return grouped_sm90


@pytest.mark.parametrize("row_weights", [False, True])
def test_launcher_layouts_match_reference_on_a_kernel_model(modelled_kernel, row_weights):
    for a, w, mi, mm, rw in (
            (*_contiguous_case(5, 32, 64, [37, 0, 130, 1, 64], torch.bfloat16, 2, row_weights)[:3], None,
             _contiguous_case(5, 32, 64, [37, 0, 130, 1, 64], torch.bfloat16, 2, row_weights)[3]),
            (*_masked_case(6, 20, 24, 48, [0, 1, 17, 20, 500, -3], torch.float16, 1, row_weights)[:2], None,
             *_masked_case(6, 20, 24, 48, [0, 1, 17, 20, 500, -3], torch.float16, 1, row_weights)[2:])):
        out = modelled_kernel.moe_gemm_bf16(a, w, mi, mm, rw)
        assert not torch.isnan(out).any()  # rows of no group are 0, never a NaN input row
        _check(out, a, w, mi, mm, rw, "contiguous" if mm is None else "masked")
    g = torch.Generator().manual_seed(5)  # interleaved experts
    mi = torch.randint(-1, 4, (90,), generator=g, dtype=torch.int32)
    a, w = torch.randn(90, 32, generator=g).bfloat16(), torch.randn(4, 16, 32, generator=g).bfloat16()
    _check(modelled_kernel.moe_gemm_bf16(a, w, mi, None, None), a, w, mi, None, None, "interleaved")


@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("column_major", [False, True])
def test_launcher_fp8_matches_reference_on_a_kernel_model(modelled_kernel, layout, column_major):
    a, sa, w, ws, mi, mm, rw = _fp8_case(layout, column_major, True, n=136, k=256)
    out = modelled_kernel.moe_gemm_fp8(a, sa, w, ws, mi, mm, rw)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    assert_close(out, ref.moe_gemm_fp8(a, sa, w, ws, mi, mm, rw), f"fp8 {layout}")


# -------------------------------------------------------------------------------------- GPU (sm_90)


def _sm90_gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs an sm_90 GPU")
    pytest.importorskip("cutlass")


def _masked_case(e, max_m, n, k, counts, dtype, seed, row_weights=False):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(e, max_m, k, generator=g).to(dtype)
    masked_m = torch.tensor(counts, dtype=torch.int32)
    live = torch.arange(max_m)[None, :] < masked_m.clamp(0, max_m)[:, None]
    a[~live] = float("nan")  # rows past a count must never be read
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).to(dtype)
    rw = torch.rand(e, max_m, generator=g) + 0.5 if row_weights else None
    return a, w, masked_m, rw


def _contiguous_case(e, n, k, rows_per_expert, dtype, seed, row_weights=False, pad=8):
    """moe_align-like rows: experts in order, each padded with -1 rows to a multiple of `pad`; plus one
    out-of-range id. Padding / out-of-range rows hold NaN."""
    g = torch.Generator().manual_seed(seed)
    ids = []
    for x, r in enumerate(rows_per_expert):
        ids += [x] * r + [-1] * (-r % pad)
    ids += [e + 3, -1]
    m_indices = torch.tensor(ids, dtype=torch.int32)
    a = torch.randn(len(ids), k, generator=g).to(dtype)
    a[(m_indices < 0) | (m_indices >= e)] = float("nan")
    w = (torch.randn(e, n, k, generator=g) / k ** 0.5).to(dtype)
    rw = torch.rand(len(ids), generator=g) + 0.5 if row_weights else None
    return a, w, m_indices, rw


def _fp8_case(layout, column_major, row_weights, n=320, k=384):
    """E4M3 operands with 1x128 activation scales (row- or column-major) and 128x128 weight scales; NaN codes
    (0x7F) and NaN scales in every row that must not be read."""
    from tests.test_moe_gemm import quant_a_fp8, quant_w_fp8

    e = 5
    if layout == "masked":
        x, w32, ids, rw = _masked_case(e, 48, n, k, [0, 48, 7, 100, 1], torch.float32, 50, row_weights)
    else:
        x, w32, ids, rw = _contiguous_case(e, n, k, [33, 0, 140, 2, 64], torch.float32, 51, row_weights)
    dead = torch.isnan(x[..., 0])
    a, sa = quant_a_fp8(x.nan_to_num().reshape(-1, k), column_major)
    a, sa = a.view(*x.shape), sa.view(*x.shape[:-1], k // 128)
    a.view(torch.uint8)[dead] = 0x7F
    sa = sa.clone()
    sa[dead] = float("nan")
    w, ws = quant_w_fp8(w32)
    mi, mm = (ids, None) if layout == "contiguous" else (None, ids)
    return a, sa, w, ws, mi, mm, rw


def _check(out, a, w, m_indices, masked_m, rw, what):
    want = ref.moe_gemm_bf16(a.cpu().float().nan_to_num(), w.cpu(), None if m_indices is None else m_indices.cpu(),
                             None if masked_m is None else masked_m.cpu(),
                             None if rw is None else rw.cpu()).to(a.dtype)
    assert_close(out.cpu(), want, what)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row_weights", [False, True])
def test_gpu_sm90_masked_matches_reference(dtype, row_weights):
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    # counts: empty, partial tiles, full, > max_m (clamped), negative (0)
    a, w, mm, rw = _masked_case(6, 80, 384, 320, [0, 1, 17, 80, 500, -3], dtype, 1, row_weights)
    dev = [None if t is None else t.cuda() for t in (a, w, mm, rw)]
    out = moe_gemm_bf16(dev[0], dev[1], None, dev[2], dev[3])
    torch.cuda.synchronize()
    _check(out, a, w, None, mm, rw, "masked")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("row_weights", [False, True])
def test_gpu_sm90_contiguous_matches_reference(dtype, row_weights):
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    # unaligned group starts (pad 8 < tile_m), an empty expert, one expert over two row tiles
    a, w, mi, rw = _contiguous_case(5, 256, 192, [37, 0, 130, 1, 64], dtype, 2, row_weights)
    dev = [None if t is None else t.cuda() for t in (a, w, mi, rw)]
    out = moe_gemm_bf16(dev[0], dev[1], dev[2], None, dev[3])
    torch.cuda.synchronize()
    _check(out, a, w, mi, None, rw, "contiguous")


@pytest.mark.gpu
def test_gpu_sm90_contiguous_interleaved_ids():
    """Rows of one expert not adjacent (the layout contract's worst case): spans overlap, still exact rows. Also a
    partial last K stage (K = 200: TMA zero-fills past K) and a partial last column tile (N = 136)."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    g = torch.Generator().manual_seed(5)
    m_indices = torch.randint(-1, 4, (200,), generator=g, dtype=torch.int32)
    a = torch.randn(200, 200, generator=g).bfloat16()
    w = (torch.randn(4, 136, 200, generator=g) / 14).bfloat16()
    out = moe_gemm_bf16(a.cuda(), w.cuda(), m_indices.cuda(), None, None)
    torch.cuda.synchronize()
    _check(out, a, w, m_indices, None, None, "interleaved")


@pytest.mark.gpu
def test_gpu_sm90_routing_change_does_not_recompile():
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    check_routing_change_does_not_recompile(moe_gemm_bf16)


def check_routing_change_does_not_recompile(moe_gemm_bf16):
    """Four masked routings (one all-empty) and two contiguous row counts through one compiled kernel of the backend
    `moe_gemm_bf16` (also run by the sm_100 kernel's test)."""
    from cute_ops import _compile

    e, max_m, n, k = 8, 64, 256, 256
    first = None
    for seed, counts in enumerate(([64, 0, 3, 17, 64, 1, 40, 9], [0, 0, 0, 64, 2, 33, 0, 5], [1] * 8, [0] * 8)):
        a, w, mm, _ = _masked_case(e, max_m, n, k, counts, torch.bfloat16, 10 + seed)
        out = moe_gemm_bf16(a.cuda(), w.cuda(), None, mm.cuda(), None)
        torch.cuda.synchronize()
        _check(out, a, w, None, mm, None, f"routing {seed}")
        if first is None:
            first = _compile.STATS.compiles
        assert _compile.STATS.compiles == first, "a new routing recompiled the kernel"
    # contiguous: a different number of rows (M is symbolic) and different expert sizes
    for seed, sizes in enumerate(([5, 60, 0, 128, 7, 1, 0, 33], [200, 0, 0, 0, 0, 0, 0, 1])):
        a, w, mi, _ = _contiguous_case(e, n, k, sizes, torch.bfloat16, 20 + seed)
        out = moe_gemm_bf16(a.cuda(), w.cuda(), mi.cuda(), None, None)
        torch.cuda.synchronize()
        _check(out, a, w, mi, None, None, f"contiguous routing {seed}")
        if seed == 0:
            first = _compile.STATS.compiles
        assert _compile.STATS.compiles == first, "a new row count / routing recompiled the kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
def test_gpu_sm90_cuda_graph_replays_with_new_group_sizes(layout):
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    check_graph_replays_with_new_group_sizes(moe_gemm_bf16, layout)


def check_graph_replays_with_new_group_sizes(moe_gemm_bf16, layout):
    """One CUDA-graph capture of the backend `moe_gemm_bf16`, replayed with new group sizes written into the
    captured routing tensor (also run by the sm_100 kernel's test)."""
    e, n, k = 6, 256, 128
    if layout == "masked":
        a, w, ids, _ = _masked_case(e, 64, n, k, [64] * e, torch.bfloat16, 30)
        a = a.nan_to_num()  # every row becomes live in some replay
        routings = [torch.tensor(c, dtype=torch.int32) for c in ([3, 0, 64, 17, 1, 40], [0, 0, 0, 0, 0, 64],
                                                                  [64, 64, 64, 64, 64, 64])]
    else:
        rows = 192
        g = torch.Generator().manual_seed(31)
        a = torch.randn(rows, k, generator=g).bfloat16()
        w = (torch.randn(e, n, k, generator=g) / k ** 0.5).bfloat16()
        routings = []
        # the second routing leaves 32 padding rows (-1) that the first wrote: the kernel must zero them again
        for sizes in ([32] * e, [0, 100, 0, 50, 0, 10], [192, 0, 0, 0, 0, 0]):
            ids = torch.cat([torch.full((s,), x, dtype=torch.int32) for x, s in enumerate(sizes)])
            routings.append(torch.cat([ids, torch.full((rows - len(ids),), -1, dtype=torch.int32)]))
        ids = routings[0]
    a_d, w_d, ids_d = a.cuda(), w.cuda(), ids.cuda()

    def call():
        if layout == "masked":
            return moe_gemm_bf16(a_d, w_d, None, ids_d, None)
        return moe_gemm_bf16(a_d, w_d, ids_d, None, None)

    call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for i, r in enumerate(routings):
        ids_d.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        if layout == "masked":
            _check(out, a, w, None, r, None, f"graph replay {i}")
        else:
            _check(out, a, w, r, None, None, f"graph replay {i}")


@pytest.mark.gpu
def test_gpu_sm90_dispatch_row(monkeypatch):
    """backend='cute' runs it through the op; auto does not pick the bf16 row at decode sizes."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import UNVERIFIED_ENV

    monkeypatch.delenv(UNVERIFIED_ENV, raising=False)
    from dispatch import ops, registry
    from dispatch.table import TABLE

    a, w, mm, rw = _masked_case(4, 32, 128, 128, [5, 32, 0, 9], torch.bfloat16, 40, True)
    out = ops.moe_gemm_bf16(a.cuda(), w.cuda(), masked_m=mm.cuda(), row_weights=rw.cuda(), backend="cute")
    torch.cuda.synchronize()
    _check(out, a, w, None, mm, rw, "ops.moe_gemm_bf16(backend='cute')")
    args = (a.cuda(), w.cuda(), None, mm.cuda(), None)
    assert registry.select(TABLE["moe_gemm_bf16"], "moe_gemm_bf16", "auto", args, {}).backend != "cute"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["masked", "contiguous"])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("row_weights", [False, True])
def test_gpu_sm90_fp8_matches_reference(layout, column_major, row_weights):
    """E4M3 with 1x128 activation scales (row- or column-major) and 128x128 weight scales, bf16 out."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_fp8

    a, sa, w, ws, mi, mm, rw = _fp8_case(layout, column_major, row_weights)  # N = 320: a partial scale block
    dev = [None if t is None else t.cuda() for t in (a, sa, w, ws, mi, mm, rw)]
    out = moe_gemm_fp8(*dev)
    torch.cuda.synchronize()
    want = ref.moe_gemm_fp8(a, sa, w, ws, mi, mm, rw)
    assert_close(out.cpu(), want, f"fp8 {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [dict(tile_m=64, tile_n=64), dict(tile_m=64, tile_n=256),
                                   dict(tile_m=128, tile_n=128, stages=2), dict(tile_m=128, tile_n=256)],
                         ids=lambda t: "-".join(f"{k}{v}" for k, v in t.items()))
def test_gpu_sm90_tile_variants(tiles):
    """Every tile shape the config rule or an override can pick, both layouts (stages=2: the slot ring at its
    smallest, 3 descriptor slots, rewritten on nearly every tile)."""
    _sm90_gpu()
    from cute_ops.gemm.grouped_sm90 import moe_gemm_bf16

    a, w, mi, rw = _contiguous_case(7, 512, 256, [37, 0, 300, 1, 64, 129, 5], torch.bfloat16, 60, True)
    out = moe_gemm_bf16(a.cuda(), w.cuda(), mi.cuda(), None, rw.cuda(), tiles=tiles)
    torch.cuda.synchronize()
    _check(out, a, w, mi, None, rw, f"contiguous {tiles}")
    a, w, mm, _ = _masked_case(9, 160, 512, 256, [0, 160, 3, 64, 65, 1, 128, 129, 17], torch.bfloat16, 61)
    out = moe_gemm_bf16(a.cuda(), w.cuda(), None, mm.cuda(), None, tiles=tiles)
    torch.cuda.synchronize()
    _check(out, a, w, None, mm, None, f"masked {tiles}")
