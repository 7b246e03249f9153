"""Hopper (sm_90a) Gluon prefill attention (triton_ops/attention/prefill_sm90.py).

* CPU: compile for sm_90a in a fresh process with Triton 3.6 (LOWBIT_TRITON36_PATH, or the installed Triton when it
  is 3.6.x) and check the machine code: wgmma + TMA in the PTX; HGMMA, UTMALDG, no local-memory spills in the SASS,
  and the softmax exponentials scheduled between the two wgmma waits (the overlap of the softmax with P V).
* CPU: the refusal predicate (host tensors, Triton versions, head dims, strides).
* GPU (-m gpu, an sm_90 device): against dispatch/reference/attention.py over hd 64 / 128, bf16 / fp16, causal or
  not, GQA 8:1 / 4:1 / 1:1, window (128, 0) with sinks, varlen batches with length-0 / length-1 sequences, sq < sk
  and sq > sk (rows without keys), no keys at all, strided (fused QKV) inputs. Five kernel specializations.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.helpers import assert_attention_close
from triton_ops.attention import prefill_sm90 as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------- compile-only (CPU)

_COMPILE = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernel
    import torch, triton
    from triton_ops.attention import prefill_sm90 as P
    from tests.helpers import sass_stats
    res = {"triton": triton.__version__, "configs": []}
    for d, dv, dt, causal, window, sink in ((128, 128, torch.bfloat16, True, (-1, -1), False),
                                            (64, 64, torch.float16, False, (128, 0), True),
                                            (192, 128, torch.bfloat16, True, (-1, -1), False)):
        c = P.compile_sm90(d, dv, dt, hq=8, hkv=1, causal=causal, window=window, sink=sink)
        ptx = c.asm["ptx"]
        r = {"d": d, "wgmma": ptx.count("wgmma.mma_async"), "tma": ptx.count("cp.async.bulk.tensor"),
             "ex2": ptx.count("ex2.approx"), "smem": c.metadata.shared, "sass": sass_stats(c.asm["cubin"])}
        res["configs"].append(r)
    print(json.dumps(res))
""")


def _triton36_env():
    """(env for a subprocess that imports Triton 3.6, or None) and why not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = os.environ.get("LOWBIT_TRITON36_PATH")
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env, None
    import triton

    if triton.__version__.startswith(P.TRITON_VERSIONS):
        env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env, None
    return None, (f"set LOWBIT_TRITON36_PATH to a Triton 3.6 install (a directory holding its `triton` package) to "
                  f"compile the sm_90 Gluon kernel; the installed Triton is {triton.__version__}")


def run_compile_json(script: str, env: dict) -> dict:
    """Run a compile script in a fresh process (env: its Triton) from the repository root; its last stdout line
    as JSON. Skips where this host cannot compile CUDA or the compile outlasts 600 s."""
    try:
        proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip("compiling the sm_90 kernel took over 600 s on this host")
    if proc.returncode and "ptxas" in proc.stderr and "No such file" in proc.stderr:
        pytest.skip(f"this Triton cannot compile CUDA on this host: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sm90_compile_uses_wgmma_and_tma():
    """Compile for sm_90a without a GPU (fresh process: Triton 3.6, no interpreter) and check the machine code."""
    env, why = _triton36_env()
    if env is None:
        pytest.skip(why)
    res = run_compile_json(_COMPILE, env)
    assert res["triton"].startswith(P.TRITON_VERSIONS), res["triton"]
    for r in res["configs"]:
        what = f"hd {r['d']}"
        assert r["wgmma"] > 0, f"{what}: no wgmma.mma_async in the PTX"
        assert r["tma"] > 0, f"{what}: no cp.async.bulk.tensor in the PTX"
        assert r["ex2"] > 0, f"{what}: no ex2.approx in the PTX"
        assert r["smem"] <= 227 * 1024, f"{what}: {r['smem']} bytes of shared memory"
        sass = r["sass"]
        if sass is None:
            continue  # no cuobjdump / nvdisasm with this Triton: PTX checks only
        assert sass["HGMMA"] > 0 and sass["UTMALDG"] > 0, f"{what}: {sass}"
        assert sass["STL"] == 0 and sass["LDL"] == 0, f"{what}: register spills {sass}"
        # Every key-loop iteration waits for S (<= 1 wgmma group pending) and then for P V (0 pending): the
        # softmax's 64 exponentials per thread (128 x 128 tile, 256 threads) must sit between the two waits (ptxas
        # may let a few slip past the second; a serialized loop has ~0 there).
        assert sass["ex2_between_waits"], f"{what}: no `wait for S` in the SASS: {sass}"
        assert min(sass["ex2_between_waits"]) >= 48, f"{what}: softmax not overlapped with P V: {sass}"


# ------------------------------------------------------------------------------------------- refusals (CPU)


def _args(q, k, v, cu_q=None, cu_k=None, scale=0.125, causal=True, window=(-1, -1), sinks=None):
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device) if cu_q is None else cu_q
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device) if cu_k is None else cu_k
    return (q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], scale, causal, window[0], window[1], sinks, True)


def test_refuses_host_tensors_and_other_tritons():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    reason = P.supports_attention_prefill_sm90(*_args(q, q, q))
    assert reason, "host tensors must be refused"
    import triton

    if not triton.__version__.startswith(P.TRITON_VERSIONS):
        assert "triton" in reason.lower(), reason


def test_config_rule():
    assert P.sm90_prefill_config(128, 128) == P.Sm90PrefillConfig(128, 128, 2, 8)
    assert P.sm90_prefill_config(64, 64) == P.Sm90PrefillConfig(128, 128, 3, 8)
    assert P.sm90_prefill_config(192, 128) == P.Sm90PrefillConfig(128, 128, 2, 8)
    with pytest.raises(ValueError):
        P.sm90_prefill_config(96, 96)


# ------------------------------------------------------------------------------------------- GPU


def _needs_sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = P.supports_attention_prefill_sm90(*_args(*(torch.zeros(4, 2, 64, dtype=torch.bfloat16,
                                                                    device="cuda"),) * 3))
    if reason:
        pytest.skip(reason)


def _cu(lengths) -> torch.Tensor:
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


def _make(lq, lk, hq, hkv, d, dtype, seed, fused=False, dv=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq, tk = sum(lq), sum(lk)
    if fused:  # q | k | v heads side by side in one row per token, as a fused QKV projection writes them
        assert tq == tk and dv is None
        buf = torch.randn(tq, hq + 2 * hkv, d, generator=g, device="cuda").to(dtype)
        return buf[:, :hq], buf[:, hq:hq + hkv], buf[:, hq + hkv:]
    q = torch.randn(tq, hq, d, generator=g, device="cuda").to(dtype)
    k = torch.randn(tk, hkv, d, generator=g, device="cuda").to(dtype)
    v = torch.randn(tk, hkv, dv or d, generator=g, device="cuda").to(dtype)
    return q, k, v


def _check(lq, lk, hq, hkv, d, dtype, causal, window=(-1, -1), sink=False, seed=0, fused=False, dv=None):
    from dispatch.reference.attention import attention_varlen

    q, k, v = _make(lq, lk, hq, hkv, d, dtype, seed, fused, dv)
    cq, ck = _cu(lq), _cu(lk)
    sinks = torch.randn(hq, device="cuda") * 2 if sink else None
    scale = 1.0 / math.sqrt(d)
    args = (q, k, v, cq, ck, max(lq), max(lk, default=0), scale, causal, window[0], window[1], sinks, True)
    assert P.supports_attention_prefill_sm90(*args) is None, P.supports_attention_prefill_sm90(*args)
    out, lse = P.attention_prefill(*args)
    torch.cuda.synchronize()
    want_out, want_lse = attention_varlen(q, k, v, cq, ck, scale, causal, window, sinks)  # fp64 on the GPU
    what = f"hd {d}/{dv or d} {dtype} causal={causal} window={window} sink={sink} gqa {hq}:{hkv} lq={lq} lk={lk}"
    assert not torch.isnan(lse).any(), f"{what}: NaN in lse"
    assert_attention_close(out, lse, want_out, want_lse, what)


LQ = [1, 700, 0, 1500, 333, 128]
LK = [1, 900, 17, 1500, 2000, 128]  # sq < sk, sq == sk, length 0 / 1, a sequence with keys but no queries


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,causal,window,sink,hq,hkv", [
    (128, torch.bfloat16, True, (-1, -1), False, 8, 1),
    (128, torch.float16, False, (-1, -1), True, 2, 2),
    (64, torch.bfloat16, False, (128, 0), True, 8, 1),
    (64, torch.float16, True, (-1, -1), False, 2, 2),
    (128, torch.bfloat16, True, (128, 0), True, 8, 2),
])
def test_gpu_matches_reference(d, dtype, causal, window, sink, hq, hkv):
    _needs_sm90()
    _check(LQ, LK, hq, hkv, d, dtype, causal, window, sink)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal,window,sink,hq,hkv", [
    (torch.bfloat16, True, (-1, -1), False, 4, 4),
    (torch.float16, False, (128, 0), True, 4, 2),
])
def test_gpu_deepseek_head_dims(dtype, causal, window, sink, hq, hkv):
    """DeepSeek MLA prefill: qk head dim 192 (128 no-rope + 64 rope), v 128; Q / K tiles as two TMA parts."""
    _needs_sm90()
    _check(LQ, LK, hq, hkv, 192, dtype, causal, window, sink, dv=128)


@pytest.mark.gpu
def test_gpu_rows_without_keys():
    """More queries than keys under causal masking: the first sq - sk rows see no key (out 0, lse -inf, or the
    sink's logit with a sink); a batch with no keys at all; a single query and key. Reuses the kernels above."""
    _needs_sm90()
    _check([300, 5, 1], [100, 0, 1], 8, 1, 128, torch.bfloat16, True)
    _check([300, 5, 1], [100, 0, 1], 8, 2, 128, torch.bfloat16, True, (128, 0), sink=True)
    _check([3, 40], [0, 0], 2, 2, 64, torch.float16, True)


@pytest.mark.gpu
def test_gpu_strided_inputs_and_repeat():
    """Views into a fused QKV buffer (row stride (Hq + 2 Hkv) * D): the TMA descriptors take the row stride; two
    calls give the same bytes."""
    _needs_sm90()
    _check([129, 640, 1], [129, 640, 1], 8, 1, 128, torch.bfloat16, True, fused=True)
    q, k, v = _make([513], [513], 2, 2, 64, torch.float16, 3)
    cu = _cu([513])
    a = P.attention_prefill(q, k, v, cu, cu, 513, 513, 0.125, True, -1, -1, None, True)
    b = P.attention_prefill(q, k, v, cu, cu, 513, 513, 0.125, True, -1, -1, None, True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_gpu_refusals():
    _needs_sm90()
    q = torch.zeros(16, 4, 128, dtype=torch.bfloat16, device="cuda")
    assert P.supports_attention_prefill_sm90(*_args(q, q, q)) is None
    w = torch.zeros(16, 4, 96, dtype=torch.bfloat16, device="cuda")
    assert "head dims" in P.supports_attention_prefill_sm90(*_args(w, w, w))
    f = q.float()
    assert "dtype" in P.supports_attention_prefill_sm90(*_args(f, f, f))
    padded = torch.zeros(16, 4, 136, dtype=torch.bfloat16, device="cuda")[:, :, :128]  # heads not packed
    assert "packed" in P.supports_attention_prefill_sm90(*_args(padded, q, q))
    k3 = torch.zeros(16, 3, 128, dtype=torch.bfloat16, device="cuda")
    assert "divide" in P.supports_attention_prefill_sm90(*_args(q, k3, k3))
    assert "softmax_scale" in P.supports_attention_prefill_sm90(*_args(q, q, q, scale=-1.0))
