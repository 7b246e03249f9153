"""Results history: append-only long-format JSONL records, run metadata, and the regression comparison.

One line per (op, case, provider, timing) per run. GPU runs append to `perf/results/<device-slug>.jsonl`
(committed: the history the dashboard plots); CPU runs go to `perf/out/<slug>.jsonl` (gitignored), so
interpreter and wall-clock numbers are never mistaken for GPU numbers.

Record fields (schema 1): schema, run_id, timestamp, git_commit, git_dirty, device, device_slug, arch,
versions{torch, triton, cutlass_dsl, liger, flashmla (commit of the peer library), python},
roofline{copy_gbps, bf16_tflops, fp8_tflops, how},
op, case, bucket, params, provider, kind, note, timing ("events" | "cuda-graph" | "cpu-wallclock"), status
("ok" | "wrong" | "error" | "skipped"), error, verified, median_us, p20_us, p80_us, samples,
calls_per_sample, bytes_moved, flops, gbps, tflops, roofline_frac, bound, vs{provider: ratio}, repro, quick,
auto (the backend `backend="auto"` chose for the case's inputs on this device: "triton" | "cute" | "torch"; absent in
records written before the runner recorded it).

Two more kinds of record share the run metadata and the timing fields (median_us, p20_us, p80_us, samples, status,
error, timing, vs) and get sections of their own on the dashboard, never an op section:

* `kind: "model"` (op "model:<model>", e.g. "model:llama"): one step of a whole model. case: the shape ("decode b=16
  ctx=1024", "prefill 4x2048"); bucket: "decode" (one new token per sequence against a cache) or "prefill";
  params{model, layers, batch, tokens, context}; provider: "lowbit" (the model patched with lowbit's ops, its step
  in one CUDA graph), another patched variant ("lowbit-bf16-cache": DeepSeek-V3.2 on bf16 latent pages instead of
  its FP8 rows; "lowbit-eager": the patched prefill without the graph) or the stack it replaces, timed in the same
  process ("eager", "compile", "compile-graphs": torch.compile's reduce-overhead mode); tokens_per_s.
* `kind: "multi-gpu"` (op e.g. "ep_moe_layer", "all_to_all"): one step over several GPUs of one host. params{
  world_size, ...}; world_size; provider: "lowbit" or the library it is held against ("nccl": torch.distributed over
  NCCL); gbps for transfers (bytes each rank sends and receives / median time).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "perf" / "results"
CPU_OUT_DIR = REPO / "perf" / "out"
SCHEMA = 1
# The lowbit torch backend is the pure-torch reference (the dispatch table's test oracle and CPU backend): measured
# beside the kernels, never shipped as a GPU choice, so never gated as a regression.
REFERENCE_BACKENDS = ("lowbit:torch",)
MODEL_KIND, MULTI_GPU_KIND = "model", "multi-gpu"


def shipped(provider: str) -> bool:
    """A lowbit backend a user gets on a GPU: auto's picks and the forced rows (triton, cute)."""
    return provider.startswith("lowbit:") and provider not in REFERENCE_BACKENDS


def section_of(r: dict) -> str:
    """Which part of the dashboard a record belongs to: "model", "multi-gpu" or "op"."""
    if r.get("kind") == MODEL_KIND or str(r.get("op", "")).startswith("model:"):
        return MODEL_KIND
    if r.get("kind") == MULTI_GPU_KIND:
        return MULTI_GPU_KIND
    return "op"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {platform.machine()} ({os.cpu_count()} cores)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return slug(device_name(device))
    return f"cpu-{slug(platform.machine())}"


def default_out(device: torch.device) -> Path:
    d = RESULTS_DIR if device.type == "cuda" else CPU_OUT_DIR
    return d / f"{device_slug(device)}.jsonl"


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except Exception:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def measured_commit() -> str | None:
    """The commit a run measured: LOWBIT_GIT_COMMIT (a copy of the tree without .git), else HEAD."""
    return os.environ.get("LOWBIT_GIT_COMMIT") or _git("rev-parse", "HEAD")


def _flashmla_commit() -> str | None:
    from perf.peers import flashmla_version

    return flashmla_version()


def run_metadata(device: torch.device, roof, quick: bool) -> dict:
    """What every record of this run shares. LOWBIT_GIT_COMMIT overrides the commit (a copy without .git)."""
    import triton

    commit = measured_commit()
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    arch = "cpu"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    return dict(
        schema=SCHEMA,
        run_id=uuid.uuid4().hex[:12],
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        git_commit=commit,
        git_dirty=bool(dirty) if dirty is not None else None,
        device=device_name(device),
        device_slug=device_slug(device),
        arch=arch,
        versions=dict(torch=torch.__version__, triton=triton.__version__, cutlass_dsl=_version("nvidia-cutlass-dsl"),
                      liger=_version("liger-kernel"), flashmla=_flashmla_commit(), python=platform.python_version()),
        roofline=dataclasses.asdict(roof),
        quick=quick,
        interpret=os.environ.get("TRITON_INTERPRET") == "1",
    )


def repro_command(rec: dict) -> str:
    parts = ["python", "-m", "perf", "run", "--ops", rec["op"], "--case", rec["case"], "--providers", rec["provider"]]
    if rec.get("quick"):
        parts.append("--quick")
    cmd = " ".join(shlex.quote(p) for p in parts)
    return ("TRITON_INTERPRET=1 " + cmd) if rec.get("interpret") else cmd


def append(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":"), sort_keys=False) + "\n")


def load(paths: list[Path]) -> list[dict]:
    """Records from JSONL files or directories of them (in file order; bad lines are an error)."""
    out: list[dict] = []
    for p in paths:
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
        for f in files:
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise SystemExit(f"{f}:{n}: not a JSON record: {exc}") from exc
    return out


def key(r: dict) -> tuple:
    return (r.get("device_slug"), r["op"], r["case"], r["provider"], r.get("timing"))


def latest(records: list[dict]) -> dict[tuple, dict]:
    """The newest record per key (by timestamp, then file order)."""
    best: dict[tuple, dict] = {}
    for i, r in enumerate(records):
        k = key(r)
        if k not in best or (r.get("timestamp", ""), i) >= (best[k].get("timestamp", ""), best[k]["_i"]):
            best[k] = dict(r, _i=i)
    return best


def runs(records: list[dict]) -> list[dict]:
    """One summary per run_id, oldest first: run_id, timestamp, git_commit, device_slug."""
    seen: dict[str, dict] = {}
    for r in records:
        rid = r.get("run_id")
        if rid and rid not in seen:
            seen[rid] = {k: r.get(k) for k in ("run_id", "timestamp", "git_commit", "device_slug", "device",
                                               "roofline", "versions", "quick")}
    return sorted(seen.values(), key=lambda s: s.get("timestamp") or "")


# ------------------------------------------------------------------------------------------------ compare


@dataclasses.dataclass
class Change:
    key: tuple
    base_us: float | None
    new_us: float | None
    ratio: float | None  # new / base median time (> 1: slower)
    verdict: str  # "slower" | "faster" | "same" | "broken" | "fixed" | "new" | "gone"
    detail: str = ""

    @property
    def label(self) -> str:
        dev, op, case, prov, timing = self.key
        return f"{op} [{case}] {prov} ({timing}, {dev})"


def compare(base: list[dict], new: list[dict], threshold: float = 0.05, noise_floor_us: float = 0.5,
            providers: str = "lowbit") -> list[Change]:
    """Per-key comparison of the newest records. A case is `slower` when its median grew by more than
    `threshold` (relative) AND by more than `noise_floor_us` (absolute: sub-microsecond wobble of a 3 us
    decode kernel is not a regression), and `broken` when it was ok and is now wrong/error.
    `providers`: "lowbit" (only lowbit:* backends, the default gate), "shipped" (those but the reference backend:
    the dashboard's rule), "all", or a comma list of names."""
    def want(prov: str) -> bool:
        if providers == "all":
            return True
        if providers == "lowbit":
            return prov.startswith("lowbit:")
        if providers == "shipped":
            return shipped(prov)
        return prov in providers.split(",")

    b, n = latest(base), latest(new)
    out: list[Change] = []
    for k in sorted(set(b) | set(n), key=lambda t: tuple(str(x) for x in t)):
        if not want(k[3]):
            continue
        out.append(change(k, b.get(k), n.get(k), threshold, noise_floor_us))
    return out


def change(k: tuple, rb: dict | None, rn: dict | None, threshold: float, noise_floor_us: float) -> Change:
    """The verdict for one key from its base and new record (either may be missing); rule: `compare`."""
    if rb is None:
        return Change(k, None, rn.get("median_us"), None, "new")
    if rn is None:
        return Change(k, rb.get("median_us"), None, None, "gone")
    ok_b, ok_n = rb.get("status") == "ok", rn.get("status") == "ok"
    if ok_b and not ok_n:
        return Change(k, rb["median_us"], None, None, "broken", f"{rn.get('status')}: {rn.get('error')}")
    if not ok_b:
        return Change(k, None, rn.get("median_us"), None, "fixed" if ok_n else "same")
    bu, nu = rb["median_us"], rn["median_us"]
    ratio = nu / bu if bu > 0 else float("inf")
    if ratio > 1 + threshold and nu - bu > noise_floor_us:
        verdict = "slower"
    elif ratio < 1 / (1 + threshold) and bu - nu > noise_floor_us:
        verdict = "faster"
    else:
        verdict = "same"
    detail = f"p20-p80 base {rb.get('p20_us', 0):.2f}-{rb.get('p80_us', 0):.2f} new " \
             f"{rn.get('p20_us', 0):.2f}-{rn.get('p80_us', 0):.2f} us"
    return Change(k, bu, nu, ratio, verdict, detail)


def print_compare(changes: list[Change], threshold: float, file=None) -> int:
    """Print the table; return the exit code: 1 if anything is slower or broken, 2 if nothing matched."""
    file = file or sys.stdout
    matched = [c for c in changes if c.verdict not in ("new", "gone")]
    w = max((len(c.label) for c in changes), default=10)
    print(f"{'case':<{w}}  {'base us':>10}  {'new us':>10}  {'new/base':>8}  verdict", file=file)
    for c in changes:
        fb = f"{c.base_us:10.2f}" if c.base_us is not None else f"{'-':>10}"
        fn = f"{c.new_us:10.2f}" if c.new_us is not None else f"{'-':>10}"
        fr = f"{c.ratio:8.3f}" if c.ratio is not None else f"{'-':>8}"
        mark = "  <-- REGRESSION" if c.verdict in ("slower", "broken") else ""
        print(f"{c.label:<{w}}  {fb}  {fn}  {fr}  {c.verdict}{mark}", file=file)
    bad = [c for c in changes if c.verdict in ("slower", "broken")]
    if not matched:
        print("perf compare: no case is present in both files (different devices or ops?)", file=file)
        return 2
    if bad:
        print(f"perf compare: {len(bad)} regression(s) past {threshold:.0%}:", file=file)
        for c in bad:
            print(f"  {c.label}: {c.verdict}" + (f" x{c.ratio:.3f}" if c.ratio else f" ({c.detail})"), file=file)
        return 1
    print(f"perf compare: {len(matched)} case(s) compared, none slower than {threshold:.0%} past the noise floor",
          file=file)
    return 0
