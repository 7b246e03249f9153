"""The dispatch table on Blackwell (no GPU): every Triton row covers sm_100 / sm_103 / sm_120 / sm_121, auto picks it
there, and the table marks it as never run on the chip (docs/blackwell.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_blackwell_archs_are_known_and_flagged():
    """Every Triton GPU row covers the Blackwell archs, auto takes it there, and the table marks it as never run."""
    from dispatch.describe import format_table, table_rows
    from dispatch.table import BLACKWELL_ARCHS, TABLE, TRITON_UNRUN_ON_BLACKWELL
    from triton_ops.contract.arch import KNOWN_ARCHS

    assert set(BLACKWELL_ARCHS) == {"sm_100", "sm_103", "sm_120", "sm_121"} and set(BLACKWELL_ARCHS) <= set(
        KNOWN_ARCHS)
    for arch in BLACKWELL_ARCHS:
        rows = table_rows(arch)
        text = format_table(arch)
        for op, entries in TABLE.items():
            gpu = [e for e in entries if e.backend == "triton" and e.priority > 0]
            if not gpu:
                continue
            assert any(arch in e.archs for e in gpu), f"{op}: no Triton row for {arch}"
            auto = [r for r in rows if r[0] == op and r[3] == "AUTO"]
            assert [r[1] for r in auto] == ["triton"], f"{arch} {op}: auto takes {auto}"
        n_triton = sum(1 for r in rows if r[1] == "triton" and r[3] in ("AUTO", "available"))
        assert text.count(TRITON_UNRUN_ON_BLACKWELL) == n_triton and f"hardware ({arch})" in text
    assert TRITON_UNRUN_ON_BLACKWELL not in format_table("sm_90") and "hardware" not in format_table("sm_90")


def test_cli_on_sm_121():
    out = subprocess.run([sys.executable, "-m", "dispatch", "--arch", "sm_121a"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert "table for sm_121" in out and "never run on this chip" in out


@pytest.mark.parametrize("arch", ["sm_100", "sm_103", "sm_120", "sm_121"])
def test_auto_dispatch_picks_triton_on_blackwell(monkeypatch, arch):
    """Representative calls on (fake) CUDA tensors of a Blackwell arch: no Triton row refuses them."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from dispatch.ops._common import backend_for

    monkeypatch.setenv("LOWBIT_ARCH", arch)
    monkeypatch.setattr(FakeTensor, "data_ptr", lambda self: (1 << 20) + self.storage_offset() * self.element_size())
    bf, i32, u8 = torch.bfloat16, torch.int32, torch.uint8
    with FakeTensorMode(allow_non_fake_inputs=True):
        def E(*shape, dt=bf):
            return torch.empty(*shape, dtype=dt, device="cuda")

        x, cu = E(64, 4096), E(3, dt=i32)
        calls = {
            "nvfp4_quantize": (x, None, False),
            "mxfp4_quantize": (x, "floor", True),
            "fp8_group_quantize": (x, 128, 1e-10, False, False),
            "rms_norm": (x, E(4096), None, 1e-6, 0.0),
            "rms_norm_nvfp4": (x, E(4096), x, 1e-6, 0.0, None, True),
            "swiglu": (x, 1, "silu", 1.702, None, None, None, None),
            "rope_": (E(64, 32, 128), E(64, 8, 128), E(64, dt=torch.int64), E(4096, 128, dt=torch.float32), 0, True,
                      False),
            "moe_align": (E(64, 8, dt=i32), None, 256, 128),
            "moe_gemm_bf16": (x, E(8, 1024, 4096), E(64, dt=i32), None),
            "moe_gemm_mxfp4": (x, E(8, 1024, 2048, dt=u8), E(8, 1024, 128, dt=u8), E(64, dt=i32), None),
            "attention_prefill": (E(64, 32, 128), E(64, 8, 128), E(64, 8, 128), cu, cu, 32, 32, 0.088, True, -1, -1,
                                  None, True),
            "attention_decode": (E(4, 1, 32, 128), E(64, 16, 8, 128), E(64, 16, 8, 128), E(4, 16, dt=i32),
                                 E(4, dt=i32), 0.088, True, -1, -1, None, None, None, 0),
        }
        chosen = {op: backend_for(op, *args) for op, args in calls.items()}
    assert chosen == dict.fromkeys(calls, "triton"), chosen
