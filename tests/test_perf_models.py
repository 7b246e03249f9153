"""perf/models.py end to end at tiny dims on the CPU (`--smoke`): every shape has its eager and lowbit records with
times and speedups, the op-family split and the memory record are written (Llama; DeepSeek-V3.2 with its two latent
cache layouts, the indexer's selection recorded and active, and its dashboard records one per provider and case);
kernel names map to their families."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transformers")

from perf import import_runs, models  # noqa: E402


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


def test_smoke_run_prefill_only_and_written_per_model(tmp_path, monkeypatch):
    out = tmp_path / "models.json"
    monkeypatch.setattr(sys, "argv", ["perf.models", "--out", str(out), "--models", "llama,qwen3_moe", "--smoke",
                                      "--batches", ""])
    written = []
    run_model = models.run_model

    def run_and_look(name, *args):  # the file holds every model finished before this one
        written.append(json.loads(out.read_text())["memory"].keys() if out.exists() else set())
        return run_model(name, *args)

    monkeypatch.setattr(models, "run_model", run_and_look)
    models.main()
    result = json.loads(out.read_text())
    assert {r["shape"] for r in result["records"]} == {"prefill 2x16"}
    assert {r["model"] for r in result["records"]} == {"llama", "qwen3_moe"}
    assert [set(w) for w in written] == [set(), {"llama"}]
    assert result["meta"]["sizes"]["batches"] == []


def test_smoke_run_deepseek_v32(tmp_path, monkeypatch):
    out = tmp_path / "models.json"
    monkeypatch.setattr(sys, "argv", ["perf.models", "--out", str(out), "--models", "deepseek_v32", "--smoke",
                                      "--no-compile"])
    models.main()
    result = json.loads(out.read_text())
    records = result["records"]
    assert {r["shape"] for r in records} == {"prefill 2x16", "decode b1 ctx32", "decode b2 ctx32"}
    for shape in ("decode b1 ctx32", "decode b2 ctx32"):
        variants = {r["variant"]: r for r in records if r["shape"] == shape}
        assert set(variants) == {"eager", "lowbit", "lowbit-bf16-cache"}
        assert all(r["ms"] > 0 for r in variants.values())
        assert variants["eager"]["cache"] == "StaticCache"
        assert variants["lowbit"]["cache"] == "LowbitMlaCache v32 + eager"
        assert variants["lowbit-bf16-cache"]["cache"] == "LowbitMlaCache bf16 + eager"
        for r in variants.values():  # top-8 of the 33 positions: the sparse selection decides
            assert (r["index_topk"], r["keys_scored"]) == (8, 33)
        for name in ("lowbit", "lowbit-bf16-cache"):
            assert variants[name]["speedup_vs_best"] == variants["eager"]["ms"] / variants[name]["ms"]
    prefill = {r["variant"]: r for r in records if r["shape"] == "prefill 2x16"}
    assert set(prefill) == {"eager", "lowbit", "lowbit-eager"}
    assert prefill["lowbit"]["replaced"]["DeepseekV32Attention"] == 2
    assert set(result["op_families_us"]["deepseek_v32"]) == {"prefill 2x16", "decode b2 ctx32 (eager step)"}
    assert 0 < result["memory"]["deepseek_v32"]["estimate_gb"]
    dashboard = import_runs.model_records(result)
    assert len(dashboard) == len(records)
    assert len({(r["op"], r["case"], r["provider"]) for r in dashboard}) == len(records)
    assert {r["op"] for r in dashboard} == {"model:deepseek_v32"}


@pytest.mark.parametrize("name, fam", [
    ("_decode_kernel", "attention"), ("_paged_write_kernel", "attention"), ("_moe_gemm_kernel", "moe"),
    ("_fp4_prepacked_kernel", "moe"),
    ("_mla_fp8_kernel", "attention"), ("_index_scores_kernel", "indexer"), ("_align_count_kernel", "moe"),
    ("_rms_norm_kernel", "norm"), ("_rope_kernel", "rope"),
    ("_swiglu_kernel", "swiglu"), ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"), ("void at::native::elementwise_kernel", "other"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4", "gemm"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "indexer"),
    ("void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, float, long>", "indexer")])
def test_kernel_families(name, fam):
    assert models.family(name) == fam


def test_ep_records_import_the_exchange_three_ways():
    """An a2a_stage line of `perf.ep_moe` becomes NCCL's bare call, the settled stage and the in-flow stage of one
    case, each with its own time and GB/s; a --smoke line is refused."""
    line = dict(bench="a2a_stage", layer="ep_prefill", stage="dispatch", tokens=4096, format="bf16", combine="entry",
                row_bytes=14368, stage_us=340.0, stage_gbs=345.0, bytes_per_rank=117300352.0, nccl_us=296.0,
                nccl_gbs=396.0, ratio=296.0 / 340.0, in_flow_us=383.0, in_flow_ratio=296.0 / 383.0,
                device="NVIDIA H200", world=2, smoke=False, versions={"torch": "2.11"}, git_commit="abc1234",
                date="2026-11-29T13:25:00+00:00")
    recs = import_runs.ep_records([line])
    assert [(r["provider"], r["median_us"]) for r in recs] == [("nccl", 296.0), ("lowbit", 340.0),
                                                               ("lowbit-in-flow", 383.0)]
    assert len({r["case"] for r in recs}) == 1 and recs[2]["gbps"] == pytest.approx(117300352.0 / 383.0 / 1e3)
    assert {r["device_slug"] for r in recs} == {"nvidia-h200-x2"}
    with pytest.raises(SystemExit, match="smoke"):
        import_runs.ep_records([{**line, "smoke": True}])
