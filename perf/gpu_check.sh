#!/usr/bin/env bash
# Every GPU check lowbit owes, in ONE device call (device time is scarce):
#   env facts -> GPU tests (-m gpu) -> compute-sanitizer on a few cases -> self-check -> probes -> Nsight Compute
#   on chosen cases -> benchmarks.
# Writes JSON/logs under $OUT (at most 8 files come back) and prints a short table last.
# Usage (device tool, repo root):  bash perf/gpu_check.sh [tests|sanitize|selfcheck|probes|ncu|bench|all]...
# Optional: .whl/ (carried) holds extra wheels (e.g. liger-kernel), installed to /tmp/site first;
#           .carry/env.sh (carried) puts CuTeDSL on the path.
# Knobs (env): TEST_TIME, TEST_ARGS (default: tests), SANITIZE_TIME, SANITIZERS ("memcheck racecheck"), SANITIZE_OPS, BENCH_TIME, BENCH_ARGS,
#              HYPOTHESIS_PROFILE (default gpu), LOWBIT_GIT_COMMIT.
# A full run takes longer than one 10-minute device call: split it, e.g. `tests sanitize selfcheck`, then `bench`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lowbit-out}
mkdir -p "$OUT"
# The GPU copy of the tree has no .git: pass the measured commit in LOWBIT_GIT_COMMIT (results records carry it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(all)
want() { for s in "${stages[@]}"; do if [ "$s" = all ] || [ "$s" = "$1" ]; then return 0; fi; done; return 1; }
summary="$OUT/summary.txt"; : > "$summary"
note() { echo "$*" | tee -a "$summary"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# shellcheck disable=SC1091
[ -f .carry/env.sh ] && source .carry/env.sh

python3 - > "$OUT/env.json" <<'PY'
import datetime, json, subprocess
import torch, triton
try:
    import cutlass
    dsl = getattr(cutlass, "__version__", "installed")
except Exception:
    dsl = None
import os
commit = os.environ.get("LOWBIT_GIT_COMMIT") or subprocess.run(
    ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or None
driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                        capture_output=True, text=True).stdout.strip()
print(json.dumps(dict(device=torch.cuda.get_device_name(), capability=torch.cuda.get_device_capability(),
                      torch=torch.__version__, triton=triton.__version__, cutlass_dsl=dsl, commit=commit,
                      driver=driver, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
                 indent=1))
PY
note "env: $(python3 -c "import json; d = json.load(open('$OUT/env.json')); print(d['device'], 'torch', d['torch'], 'triton', d['triton'], 'cutlass-dsl', d['cutlass_dsl'])")"

if want tests; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIME:-420}" python3 -m pytest ${TEST_ARGS:-tests} -m gpu -q -p no:warnings --maxfail=30 --no-header -rfE \
      --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
  note "gpu tests (rc=$?): $(tail -n 1 "$OUT/pytest.log")"
fi

if want sanitize; then
  # memcheck + racecheck over every Triton kernel family at the self-check's small shapes.
  : > "$OUT/sanitizer.log"
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    # --report-api-errors no: count device memory/race errors only. The CuTeDSL runtime probes driver entry points
    # with cuGetProcAddress and some probes fail by design (34 "errors" on an otherwise clean run, session 6).
    LOWBIT_SELFCHECK_SMALL=1 timeout "${SANITIZE_TIME:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --report-api-errors no \
      python3 -m dispatch check ${SANITIZE_OPS:+--ops $SANITIZE_OPS} >> "$OUT/sanitizer.log" 2>&1
    note "compute-sanitizer $tool (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 1)"
  done
fi

if want selfcheck; then
  python3 -m dispatch check --json "$OUT/selfcheck.json" > "$OUT/selfcheck.log" 2>&1
  note "self-check (rc=$?): $(tail -n 1 "$OUT/selfcheck.log")"
fi

if want probes; then
  # PROBES: probe scripts under perf/probes to run (default: the host-overhead split); each writes one JSON.
  for probe in ${PROBES:-host_overhead}; do
    timeout 120 python3 "perf/probes/$probe.py" --json "$OUT/probe-$probe.json" > "$OUT/probe-$probe.log" 2>&1
    note "probe $probe (rc=$?)"; tail -n 20 "$OUT/probe-$probe.log"
  done
fi

if want ncu; then
  # Nsight Compute on chosen benchmark cases (perf/probes/ncu_cases.py; NCU_ONLY: substrings of "op|label" to keep):
  # per-pipe instruction shares, issue-slot use, DRAM throughput and warp stall reasons, summarized per kernel.
  # --clock-control none: the device's clocks are left as found (the device tool's METHOD.md).
  metrics='regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum'
  # shellcheck disable=SC2086
  timeout "${NCU_TIME:-240}" ncu --clock-control none --profile-from-start off --nvtx --print-nvtx-rename kernel \
      --csv --metrics "$metrics" python3 perf/probes/ncu_cases.py ${NCU_ONLY:+--only $NCU_ONLY} \
      > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  note "ncu (rc=$?)"
  python3 perf/probes/ncu_summary.py "$OUT/ncu.csv" > "$OUT/ncu-summary.txt" 2>&1 && cat "$OUT/ncu-summary.txt"
fi

if want bench; then
  # BENCH_ARGS: extra `python -m perf run` arguments (e.g. --ops ...); BENCH_TIME: seconds before no new case starts.
  # shellcheck disable=SC2086
  timeout $(( ${BENCH_TIME:-420} + 120 )) python3 -m perf run --time-limit "${BENCH_TIME:-420}" \
      --out "$OUT/bench.jsonl" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  note "benchmarks (rc=$?): $(wc -l < "$OUT/bench.jsonl" 2>/dev/null) records"
  tail -n 40 "$OUT/bench.log"
fi
echo; echo "==== summary ===="; cat "$summary"
if [ -f "$OUT/selfcheck.log" ]; then tail -n 14 "$OUT/selfcheck.log"; fi
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" 2>/dev/null | head -30
# The device tool returns at most 8 files: keep env/summary/bench records as they are, pack the rest.
if [ -z "${GPU_CHECK_NO_PACK:-}" ]; then
  (cd "$OUT" && find . -type f ! -name logs.tgz ! -name .packlist ! -name env.json ! -name summary.txt ! -name bench.jsonl \
      -print > .packlist && tar -czf logs.tgz -T .packlist && xargs rm -f < .packlist; rm -f .packlist)
fi
exit 0
