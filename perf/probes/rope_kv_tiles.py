"""GPU probe (sessions 4-5, issue 5): RoPE and KV-cache write kernels, the default config vs candidate configs
(bare launcher calls with explicit configs) at the benchmark shapes (perf/cases/rope_kv.py, T=16384). The
pre-session-4 kernels were timed against these in the first run (perf/results/probes/*rope-kv-tiles-458345a*);
old-vs-new now comes from the results history. Bare launcher calls, CUDA-graph replay over input copies
(perf.runner.time_passes; the big cases exceed L2 per call), a torch copy measured in the same process for the
fraction (perf.runner.measure_roofline). The KV gathers have their own probe (perf/probes/kv_gather_tiles.py).

Run: PYTHONPATH=$PWD python perf/probes/rope_kv_tiles.py [--out OUT.json] [--only rope,ds,write]
Every variant's bytes are checked against the reference on a small shape (bad positions / slots included) first.
Prints one line per variant: us, GB/s, fraction of copy, speedup vs "default". Pick a config only if it wins by > 3%.
Session 5 candidates: cs_rows ((cos, sin) per token, broadcast; now the rope default, "s4 default (cs tile)" is the
old tile load) and evict_first hints. (Call 2 of session 5 also timed a persistent software-pipelined rope kernel:
5-9% slower, removed; perf/NOTES.md.)
60 samples (CUDA-graph passes) per line; read with perf/probes/strided_roof.py (the pattern's own ceiling).
"""

# ruff: noqa: B023  (every lambda below is called within its loop iteration)
from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from dispatch.reference import kv_cache as kref
from dispatch.reference import rope as rref
from perf.runner import measure_roofline, time_passes
from triton_ops import kv_cache as kv
from triton_ops import rope as rp
from triton_ops.kv_cache import DsConfig, WriteConfig
from triton_ops.rope import RopeConfig

DEV = torch.device("cuda")
L2_BYTES = 192 << 20
ROWS: list[dict] = []
T = 16384
VERIFY_T = (37, 300)  # small shapes every variant is byte-checked on

# RoPE: (name, cfg); None = the current default heuristic (rope_config; session 5: cs_rows on)
ROPE_NEOX = [("default", None),
             ("s4 default (cs tile)", RopeConfig(1, 64, 8, 4)),
             ("1t 16q+2k 4w cs", RopeConfig(1, 16, 2, 4, cs_rows=True))]
ROPE_NEOX32 = [("default", None),
               ("s4 default (cs tile)", RopeConfig(1, 32, 8, 4)),
               ("1t 32q+8k cs evict", RopeConfig(1, 32, 8, 4, cs_rows=True, evict_first=True))]
ROPE_DSV4 = [("default", None),
             ("s4 default (cs tile)", RopeConfig(2, 64, 1, 4)),
             ("1t 64h 4w cs", RopeConfig(1, 64, 1, 4, cs_rows=True)),
             ("4t 64h 8w cs", RopeConfig(4, 64, 1, 8, cs_rows=True)),
             ("2t 64h 4w cs evict", RopeConfig(2, 64, 1, 4, cs_rows=True, evict_first=True)),
             ("1t 64h 2w cs", RopeConfig(1, 64, 1, 2, cs_rows=True))]
DS_FUSED = [("default", None),
            ("4t 16h 4w cs", DsConfig(4, 16, 4, cs_rows=True)),
            ("4t 16h 4w evict", DsConfig(4, 16, 4, evict_first=True)),
            ("8t 16h 8w", DsConfig(8, 16, 8)),
            ("2t 32h 4w", DsConfig(2, 32, 4))]
DS_WRITE = [("default", None),  # session 5: q branch compiled out (HAS_Q); s4 kernel: 13.4 (v32) / 13.8 (v4) us
            ("8t 4w", DsConfig(8, 16, 4)),
            ("16t 4w", DsConfig(16, 16, 4)),
            ("16t 8w", DsConfig(16, 16, 8)),
            ("2t 2w", DsConfig(2, 16, 2))]
PAGED = [("default", None),
         ("16t 8h 8w", WriteConfig(16, 8, 8)),
         ("32t 8h 8w", WriteConfig(32, 8, 8)),
         ("2t 8h 2w", WriteConfig(2, 8, 2))]
BUDGET = 10.0  # time_passes caps samples at GPU_SAMPLES[1] = 60 (>= 50 medians per line)


def copy_gbps() -> float:
    return measure_roofline(DEV).copy_gbps


def n_sets(per_call: int) -> int:
    return max(2, min(64, L2_BYTES // max(per_call, 1) + 1))


def report(op, shape, name, us, nbytes, copy, base):
    gbps = nbytes / us / 1e3
    ROWS.append(dict(op=op, shape=shape, variant=name, us=us, gbps=gbps, of_copy=gbps / copy,
                     vs_default=(base / us) if base else 1.0))
    print(f"{op:22s} {shape:28s} {name:20s} {us:8.2f} us {gbps:6.0f} GB/s {gbps / copy:5.3f} of copy"
          f"  x{(base / us) if base else 1.0:5.3f} vs default", flush=True)


def same_floats(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a.float(), 7.0),
                                                                       torch.nan_to_num(b.float(), 7.0))


# ------------------------------------------------------------------------------------------------ RoPE

def rope_call(name, cfg, q, k, pos, cs, off, neox, inverse, inplace):
    if inplace:
        rp.rope_(q, k, pos, cs, off, neox, inverse, cfg)
        return q, k
    return rp.rope(q, k, pos, cs, off, neox, inverse, cfg)


def rope_inputs(t, hq, hk, d, rot, max_pos=16384):
    return dict(q=torch.randn(t, hq, d, device=DEV, dtype=torch.bfloat16),
                k=torch.randn(t, hk, d, device=DEV, dtype=torch.bfloat16),
                pos=torch.randint(0, max_pos, (t,), device=DEV), cs=rref.rope_cos_sin_cache(max_pos, rot, device=DEV))


def rope_verify(variants, hq, hk, d, rot, off, neox, inverse, inplace):
    for t in VERIFY_T:
        a = rope_inputs(t, hq, hk, d, rot, max_pos=500)
        a["pos"][::7] = 500
        a["pos"][3::11] = -1
        want_q, want_k = a["q"].clone(), a["k"].clone()
        if inplace:
            rref.rope_(want_q, want_k if hk else None, a["pos"], a["cs"], off, neox, inverse)
        else:
            want_q, want_k = rref.rope(a["q"], a["k"], a["pos"], a["cs"], off, neox, inverse)
        for name, cfg in variants:
            q, k = a["q"].clone(), a["k"].clone()
            gq, gk = rope_call(name, cfg, q, k if hk or not inplace else None, a["pos"], a["cs"], off, neox, inverse,
                               inplace)
            assert same_floats(gq, want_q) and (not hk or same_floats(gk, want_k)), f"rope {name} differs"


def rope_time(copy, variants, hq, hk, d, rot, off, neox, inverse, inplace, op, shape):
    rope_verify(variants, hq, hk, d, rot, off, neox, inverse, inplace)
    moved = 2 * T * (hq + hk) * (d if not inplace else rot) * 2 + T * (8 + rot * 4)
    sets = [rope_inputs(T, hq, hk, d, rot) for _ in range(n_sets(T * (hq + hk) * d * 4))]
    base = None
    for name, cfg in variants:
        us = time_passes(lambda a: rope_call(name, cfg, a["q"], a["k"] if hk else None, a["pos"], a["cs"], off, neox,
                                             inverse, inplace), sets, DEV, graph=True, budget_s=BUDGET).median_us
        base = base or us
        report(op, shape, name, us, moved, copy, base)
    del sets


# ------------------------------------------------------------------------------------------ DeepSeek write

def ds_inputs(t, hq, layout, bs=64):
    L = kref.DS_LAYOUTS[layout]
    nb = -(-t // bs) + 1
    return dict(kv=torch.randn(t, L.d, device=DEV, dtype=torch.bfloat16),
                q=torch.randn(t, hq, L.d, device=DEV, dtype=torch.bfloat16),
                pos=torch.randint(0, 16384, (t,), device=DEV), cs=rref.rope_cos_sin_cache(16384, 64, device=DEV),
                slots=torch.randperm(nb * bs, device=DEV)[:t], cache=kref.ds_kv_cache_empty(nb, bs, layout, DEV))


def ds_call(cfg, a, layout, fused):
    if fused:
        kv.ds_rope_quant_append(a["kv"], a["pos"], a["cs"], a["slots"], a["cache"], layout, a["q"], False, cfg)
    else:
        kv.ds_kv_write(a["kv"], a["slots"], a["cache"], layout, cfg)


def ds_time(copy, variants, layout, fused):
    L = kref.DS_LAYOUTS[layout]
    hq = 64 if fused else 0
    for t in VERIFY_T:  # verify: slot -1 and a slot past the cache included
        a = ds_inputs(t, 3 if fused else 0, layout)
        a["slots"][1] = -1
        a["slots"][5] = a["cache"].shape[0] * a["cache"].shape[1]
        want_c, want_q = a["cache"].clone(), a["q"].clone()
        if fused:
            kref.ds_rope_quant_append(a["kv"], a["pos"], a["cs"], a["slots"], want_c, layout, want_q, False)
        else:
            kref.ds_kv_write(a["kv"], a["slots"], want_c, layout)
        for name, cfg in variants:
            b = dict(a, cache=a["cache"].clone(), q=a["q"].clone())
            ds_call(cfg, b, layout, fused)
            assert torch.equal(b["cache"].view(torch.uint8), want_c.view(torch.uint8)), f"ds {layout} {name} cache"
            assert torch.equal(b["q"], want_q), f"ds {layout} {name} q"
    moved = T * L.d * 2 + T * L.token_bytes + T * 8
    if fused:
        moved += 2 * T * hq * 64 * 2 + T * (8 + 64 * 4)
    sets = [ds_inputs(T, hq, layout) for _ in range(n_sets(moved))]
    base = None
    op = "ds_rope_quant_append" if fused else "ds_kv_write"
    for name, cfg in variants:
        us = time_passes(lambda a: ds_call(cfg, a, layout, fused), sets, DEV, graph=True, budget_s=BUDGET).median_us
        base = base or us
        report(op, f"T={T} {layout}" + (" Hq=64 +q" if fused else ""), name, us, moved, copy, base)
    del sets


# ------------------------------------------------------------------------------------------ generic write

def paged_inputs(t, h=8, d=64):
    nb = -(-t // 16) + 1
    return dict(x=torch.randn(t, h, d, device=DEV, dtype=torch.bfloat16),
                slots=torch.randperm(nb * 16, device=DEV)[:t],
                cache=torch.zeros(nb, 16, h, d, device=DEV, dtype=torch.uint8), sc=torch.zeros(nb, 16, h, device=DEV))


def paged_call(cfg, a):
    kv.paged_kv_write_fp8(a["x"], a["slots"], a["cache"], None, a["sc"], cfg)


def paged_time(copy, variants):
    for t in VERIFY_T:
        a = paged_inputs(t)
        a["slots"][1] = -1
        a["slots"][5] = a["cache"].shape[0] * 16
        want_c, want_s = a["cache"].clone(), a["sc"].clone()
        kref.paged_kv_write_fp8(a["x"], a["slots"], want_c, None, want_s)
        for name, cfg in variants:
            b = dict(a, cache=a["cache"].clone(), sc=a["sc"].clone())
            paged_call(cfg, b)
            assert torch.equal(b["cache"], want_c) and torch.equal(b["sc"], want_s), f"paged {name}"
    moved = T * 8 * 64 * 3 + T * 8 * 4 + T * 8
    sets = [paged_inputs(T) for _ in range(n_sets(moved))]
    base = None
    for name, cfg in variants:
        us = time_passes(lambda a: paged_call(cfg, a), sets, DEV, graph=True, budget_s=BUDGET).median_us
        base = base or us
        report("paged_kv_write_fp8", f"T={T} H=8 D=64 dynamic", name, us, moved, copy, base)
    del sets


def main(only):
    torch.manual_seed(0)
    t0 = time.time()
    copy_gbps()  # warm-up (clocks, allocator): a cold first measurement printed 2763 GB/s in session 4
    copy = copy_gbps()
    print(f"copy 2x1 GiB bf16 (perf.runner.measure_roofline): {copy:.0f} GB/s; {torch.cuda.get_device_name()}, "
          f"triton {triton.__version__}")
    if "rope" in only:
        rope_time(copy, ROPE_NEOX, 64, 8, 128, 128, 0, True, False, False, "rope", f"T={T} Hq=64 Hk=8 D=128 NeoX")
        rope_time(copy, ROPE_NEOX32, 32, 8, 128, 128, 0, True, False, False, "rope", f"T={T} Hq=32 Hk=8 D=128 NeoX")
        rope_time(copy, ROPE_DSV4, 64, 0, 512, 64, 448, False, True, True, "rope_", f"T={T} H=64 D=512 last-64 inv")
    if "ds" in only:
        for layout in ("v32", "v4"):
            ds_time(copy, DS_FUSED, layout, True)
    if "write" in only:
        for layout in ("v32", "v4"):
            ds_time(copy, DS_WRITE, layout, False)
        paged_time(copy, PAGED)
    end = copy_gbps()
    print(f"copy re-measured at the end: {end:.0f} GB/s (fractions above use {copy:.0f}); "
          f"probe done in {time.time() - t0:.1f} s")
    return copy, end


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", default="rope,ds,write")
    args = parser.parse_args()
    copy, end = main(args.only.split(","))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           copy_gbps=copy, copy_gbps_end=end,
                           copy_note="perf.runner.measure_roofline (2x1 GiB bf16 copy), same process, after a "
                                     "warm-up measurement", rows=ROWS), f, indent=1)
