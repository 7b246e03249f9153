"""The dispatch table and its mechanism: arch resolution, auto choice, forcing, errors, logging, CLI."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

import dispatch
from dispatch import BackendError, ops, registry, use_backend
from dispatch.ops._common import backend_for
from dispatch.registry import Entry, parse_backend_env, select
from dispatch.table import TABLE
from triton_ops.contract.arch import arch_of, normalize_arch, resolve_arch
from triton_ops.contract.checks import LowbitInputError


def test_normalize_arch():
    assert normalize_arch("sm_90a") == "sm_90"
    assert normalize_arch("SM100") == "sm_100"
    assert normalize_arch("100a") == "sm_100"
    assert normalize_arch("cpu") == "cpu"
    with pytest.raises(ValueError, match="LOWBIT_ARCH"):
        normalize_arch("hopper")


def test_arch_override(monkeypatch):
    monkeypatch.setenv("LOWBIT_ARCH", "sm_100a")
    assert resolve_arch() == "sm_100"
    assert arch_of(torch.device("cpu")) == "cpu"  # host tensors are always the cpu arch


def test_every_op_is_a_torch_op_with_a_reference():
    for op, entries in TABLE.items():
        assert hasattr(torch.ops.lowbit, op), op
        assert any(e.backend == "torch" for e in entries), f"{op} has no torch reference entry"
        for e in entries:
            assert e.op == op and e.backend in registry.BACKENDS
            e.resolve_impl()  # every impl path imports


def test_auto_on_cpu_picks_reference_and_logs_skips(caplog):
    x = torch.randn(4, 64)
    with caplog.at_level(logging.DEBUG, logger="lowbit.dispatch"):
        assert backend_for("nvfp4_quantize", x, None, False) == "torch"
    assert "skipped triton" in caplog.text or "chose torch" in caplog.text


def test_forced_backend_and_scopes(monkeypatch):
    x = torch.randn(4, 64)
    assert backend_for("nvfp4_quantize", x, None, False, backend="triton") == "triton"  # interpreter is on
    with use_backend("torch"):
        assert backend_for("nvfp4_quantize", x, None, False) == "torch"
        with use_backend("triton", ops="nvfp4_quantize"):
            assert backend_for("nvfp4_quantize", x, None, False) == "triton"
            assert backend_for("mxfp4_quantize", x, "floor", False) == "torch"
    monkeypatch.setenv("LOWBIT_BACKEND", "mxfp4_quantize=triton")
    assert backend_for("mxfp4_quantize", x, "floor", False) == "triton"
    assert backend_for("nvfp4_quantize", x, None, False) == "torch"
    # an explicit argument beats the env
    assert backend_for("mxfp4_quantize", x, "floor", False, backend="torch") == "torch"


def test_parse_backend_env():
    assert parse_backend_env("torch") == {None: "torch"}
    assert parse_backend_env("rope=triton, *=torch") == {"rope": "triton", None: "torch"}
    with pytest.raises(ValueError, match="unknown backend"):
        parse_backend_env("rope=cuda")


def test_typo_in_op_names_is_an_error_listing_known_ops(monkeypatch):
    """A misspelt op in LOWBIT_BACKEND or use_backend(ops=...) used to force nothing, silently."""
    with pytest.raises(ValueError, match=r"unknown op 'rms_nrom'; known ops: .*rms_norm"):
        parse_backend_env("rms_nrom=torch")
    with pytest.raises(ValueError, match=r"use_backend.*unknown op 'rms_nrom'; known ops: .*rms_norm"):
        with use_backend("triton", ops="rms_nrom"):
            pass
    with pytest.raises(ValueError, match="unknown op 'rms_nrom'"):
        with use_backend("triton", ops=("rms_norm", "rms_nrom")):
            pass
    x = torch.randn(2, 16)
    monkeypatch.setenv("LOWBIT_BACKEND", "rms_nrom=torch")
    with pytest.raises(ValueError, match=r"LOWBIT_BACKEND=rms_nrom=torch: unknown op 'rms_nrom'"):
        ops.rms_norm(x, torch.ones(16))
    monkeypatch.setenv("LOWBIT_BACKEND", "rms_norm=torch")  # the right spelling still works
    assert backend_for("rms_norm", x, torch.ones(16), None, 1e-6, 0.0) == "torch"


def test_cli_bad_arch_is_one_line_and_exit_2(capsys, monkeypatch):
    from dispatch.__main__ import main
    from triton_ops.contract.arch import KNOWN_ARCHS

    assert main(["--arch", "foo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "'foo'" in err and ", ".join(KNOWN_ARCHS) in err
    assert main(["--arch", "sm_75"]) == 2  # parses, but the table has nothing for it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lowbit has no kernels for sm_75; supported: " + ", ".join(KNOWN_ARCHS) in err
    monkeypatch.setenv("LOWBIT_ARCH", "hopper")
    assert main([]) == 2 and "LOWBIT_ARCH='hopper'" in capsys.readouterr().err


def test_unknown_arch_says_what_lowbit_supports(monkeypatch):
    """A GPU the table has no rows for (e.g. sm_75) gets one clear BackendError, not a list of 'arch not in'."""
    from dispatch.ops import _common
    from triton_ops.contract.arch import KNOWN_ARCHS

    monkeypatch.setattr(_common, "_FAST", {})  # a remembered choice for this signature would skip select()
    monkeypatch.setattr(registry, "arch_of", lambda device: "sm_75")
    with pytest.raises(BackendError, match=r"lowbit\.rms_norm: lowbit has no kernels for sm_75; supported: "
                                           + ", ".join(KNOWN_ARCHS)):
        ops.rms_norm(torch.randn(2, 16), torch.ones(16))


def test_forced_unsupported_backend_lists_candidates(monkeypatch):
    x = torch.randn(4, 96)
    with pytest.raises(BackendError) as err:
        ops.fp8_group_quantize(x, 48, backend="triton")  # group 48: not a power of two
    msg = str(err.value)
    assert "lowbit.fp8_group_quantize" in msg and "group_size=48" in msg and "triton" in msg
    with pytest.raises(BackendError, match="cute"):
        ops.nvfp4_quantize(x, backend="cute")
    assert ops.fp8_group_quantize(x, 48).scales.shape == (4, 2)  # auto falls through to the reference
    monkeypatch.delenv("TRITON_INTERPRET")
    registry._import_failure.cache_clear()
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        ops.nvfp4_quantize(x, backend="triton")


def test_auto_skips_unsupported_entry(caplog):
    """A preferred entry whose predicate refuses is skipped (logged with its reason); the next one runs."""
    fast = Entry("fp8_group_quantize", "triton", ("cpu",), "triton_ops.quant:fp8_group_quantize", 50,
                 "test", "triton_ops.quant:supports_fp8_group_quantize")
    slow = Entry("fp8_group_quantize", "torch", ("cpu",), "dispatch.reference.quant:fp8_group_quantize", 1, "ref")
    args = (torch.randn(2, 96), 96, 1e-10, False, False)
    with caplog.at_level(logging.DEBUG, logger="lowbit.dispatch"):
        assert select([fast, slow], "fp8_group_quantize", "auto", args, {}).backend == "torch"
    assert "group_size=96 is not a power of two" in caplog.text
    assert select([fast, slow], "fp8_group_quantize", "auto", (args[0][:, :64], 64, *args[2:]), {}) is fast


def test_select_prefers_priority_and_errors_on_unknown():
    lo = Entry("t", "torch", ("cpu",), "dispatch.reference.quant:nvfp4_quantize", 1, "low")
    hi = Entry("t", "triton", ("cpu",), "triton_ops.quant:nvfp4_quantize", 5, "high")
    x = torch.randn(2, 16)
    assert select([lo, hi], "t", "auto", (x,), {}).backend == "triton"
    with pytest.raises(ValueError, match="unknown backend"):
        select([lo, hi], "t", "gpu", (x,), {})


def test_bad_inputs_name_op_and_argument():
    cases = [
        (lambda: ops.nvfp4_quantize(torch.randn(4, 20)), "nvfp4_quantize", "'x'", "multiple of 16"),
        (lambda: ops.nvfp4_quantize(torch.randint(0, 3, (4, 32))), "nvfp4_quantize", "'x'", "dtype"),
        (lambda: ops.nvfp4_quantize(torch.randn(4, 32), torch.tensor([1.0, 2.0])), "nvfp4_quantize",
         "'global_scale'", "one-element"),
        (lambda: ops.nvfp4_quantize(torch.randn(4, 32), scale_layout="tiled"), "nvfp4_quantize",
         "'scale_layout'", "linear"),
        (lambda: ops.nvfp4_quantize(torch.randn(32, 4).t()), "nvfp4_quantize", "'x'", "contiguous"),
        (lambda: ops.nvfp4_quantize(torch.randn(4, 6, 64)[:, ::2, :32].transpose(0, 1)), "nvfp4_quantize",
         "'x'", "collapse"),
        (lambda: ops.mxfp4_quantize(torch.randn(4, 48)), "mxfp4_quantize", "'x'", "multiple of 32"),
        (lambda: ops.mxfp4_quantize(torch.randn(4, 64), rounding="even"), "mxfp4_quantize", "'rounding'", "floor"),
        (lambda: ops.fp8_group_quantize(torch.randn(4, 64), 128), "fp8_group_quantize", "'x'", "group_size=128"),
        (lambda: ops.fp8_group_quantize(torch.randn(4, 128), eps=0.0), "fp8_group_quantize", "'eps'", "> 0"),
        (lambda: ops.fp8_group_dequantize(torch.zeros(4, 128, dtype=torch.float8_e4m3fn), torch.ones(4, 2)),
         "fp8_group_dequantize", "'scales'", "expected shape"),
        (lambda: ops.nvfp4_dequantize(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2),
                                      torch.tensor(1.0)), "nvfp4_dequantize", "'scales'", "dtype"),
    ]
    for fn, op, arg, text in cases:
        with pytest.raises(LowbitInputError) as err:
            fn()
        msg = str(err.value)
        assert f"lowbit.{op}" in msg and arg in msg and text in msg, msg


def test_cli_prints_table():
    out = subprocess.run([sys.executable, "-m", "dispatch", "--arch", "sm_90a"], capture_output=True, text=True,
                         check=True).stdout
    assert "table for sm_90" in out
    for op in TABLE:
        assert op in out
    assert "AUTO" in out


def test_package_exports():
    assert dispatch.ops is ops and callable(dispatch.use_backend)


def test_public_wrappers_route_through_the_op_under_dispatch_modes():
    """Eager public calls skip the dispatcher's Python layers, but with a dispatch mode active (FakeTensorMode,
    as torch.compile and export use) they must still reach the registered op and its fake impl."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(4, 64)
        q = ops.nvfp4_quantize(x, scale_layout="swizzled")
        f8 = ops.fp8_group_quantize(x, 64, column_major_scales=True)
    assert q.codes.shape == (4, 32) and q.scales.shape == (128, 4)
    assert f8.scales.stride() == (1, 4)


def test_fp4_triton_refuses_odd_row_stride_with_leading_one():
    """Pair-word loads need even row strides; a [1, M, K] view with an odd row stride must be refused with the
    reason (auto then uses the reference), not fail inside the launcher."""
    x = torch.randn(1, 6, 33)[..., :32]
    with pytest.raises(BackendError, match="row stride 33 is odd"):
        ops.nvfp4_quantize(x, backend="triton")
    assert ops.nvfp4_quantize(x).codes.shape == (1, 6, 16)


def test_eager_fast_path_remembers_the_choice_per_signature(monkeypatch):
    """ops._common.call: a repeated eager call with the same metadata skips checks and table choice and runs
    the backend the first call chose; anything the choice can depend on is part of the signature."""
    from dispatch.ops import _common

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _common._FAST.clear()
    x = torch.randn(3, 64)
    want = ops.nvfp4_quantize(x, backend="torch")
    for _ in range(2):  # miss, then hit: same bytes
        got = ops.nvfp4_quantize(x, backend="triton")
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales)
    remembered = {k[0] for k in _common._FAST}
    assert "nvfp4_quantize" in remembered
    # a new backend request, scope or env override is a new signature: it is honoured, not served from the cache
    calls = []
    monkeypatch.setattr("dispatch.reference.quant.nvfp4_quantize",
                        lambda *a: calls.append(1) or want, raising=True)
    registry._load.cache_clear()
    with use_backend("torch", "nvfp4_quantize"):
        ops.nvfp4_quantize(x)
    monkeypatch.setenv("LOWBIT_BACKEND", "nvfp4_quantize=torch")
    ops.nvfp4_quantize(x)
    monkeypatch.delenv("LOWBIT_BACKEND")
    registry._load.cache_clear()
    assert calls == [1, 1]
    # bad input with the same shape is a different signature: checked, clear error
    with pytest.raises(LowbitInputError, match="nvfp4_quantize.*'x'"):
        ops.nvfp4_quantize(x.to(torch.int32), backend="triton")
    with pytest.raises(LowbitInputError, match="nvfp4_quantize.*'x'"):
        ops.nvfp4_quantize(torch.randn(3, 64)[:, :60], backend="triton")
    # misaligned views of the same shape and strides are a different signature (alignment is checked)
    buf = torch.randn(3 * 64 + 1)
    assert _common._signature((buf[:192].view(3, 64), "auto")) != _common._signature((buf[1:].view(3, 64), "auto"))


def test_auto_skip_is_a_preference_not_a_refusal():
    """An entry's auto_skip predicate (a measured per-shape preference) makes auto pass it over with the reason
    logged, while an explicit backend still runs it; small (decode) calls keep it."""
    from dispatch.registry import Entry, select
    from dispatch.table import DECODE_ROWS

    first = Entry("demo", "torch", ("cpu",), "dispatch.reference.quant:nvfp4_quantize", 30, "preferred at decode",
                  None, "dispatch.table:cute_nvfp4_prefill")
    second = Entry("demo", "triton", ("cpu",), "dispatch.reference.quant:nvfp4_quantize", 20, "preferred at prefill")
    big, small = torch.zeros(DECODE_ROWS + 1, 64), torch.zeros(DECODE_ROWS, 64)
    entries = [first, second]
    assert select(entries, "demo", "auto", (small,), {}) is first
    assert select(entries, "demo", "torch", (big,), {}) is first  # forced: the preference does not apply
    with pytest.raises(BackendError, match="faster at prefill"):  # auto's listing names the skip reason
        select([first], "demo", "auto", (big,), {})
