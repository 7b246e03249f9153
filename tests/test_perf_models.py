"""perf/models.py end to end at tiny dims on the CPU (`--smoke`): every shape has its eager and lowbit records with
times and speedups, the op-family split and the memory record are written; kernel names map to their families."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transformers")

from perf import models  # noqa: E402


def test_smoke_run_writes_every_record(tmp_path, monkeypatch):
    out = tmp_path / "models.json"
    monkeypatch.setattr(sys, "argv", ["perf.models", "--out", str(out), "--models", "llama", "--smoke"])
    models.main()
    result = json.loads(out.read_text())
    shapes = {r["shape"] for r in result["records"]}
    assert shapes == {"prefill 2x16", "decode b1 ctx32", "decode b2 ctx32"}
    for shape in shapes:
        variants = {r["variant"]: r for r in result["records"] if r["shape"] == shape}
        expected = {"eager", "lowbit", "lowbit-eager"} if shape.startswith("prefill") else {"eager", "lowbit"}
        assert set(variants) == expected and all(r["ms"] > 0 for r in variants.values())
        # the patched eager prefill is not a baseline of the patched one
        assert variants["lowbit"]["speedup_vs_best"] == variants["eager"]["ms"] / variants["lowbit"]["ms"]
    assert set(result["op_families_us"]["llama"]) == {"prefill 2x16", "decode b2 ctx32 (eager step)"}
    assert result["memory"]["llama"]["decode_batches"] == [1, 2]


@pytest.mark.parametrize("name, fam", [
    ("_decode_kernel", "attention"), ("_paged_write_kernel", "attention"), ("_moe_gemm_kernel", "moe"),
    ("_align_count_kernel", "moe"), ("_rms_norm_kernel", "norm"), ("_rope_kernel", "rope"),
    ("_swiglu_kernel", "swiglu"), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"), ("void at::native::elementwise_kernel", "other")])
def test_kernel_families(name, fam):
    assert models.family(name) == fam
