#!/usr/bin/env bash
# The GPU checks lowbit owes, in named stages, sized for 10-minute device calls.
#   env facts -> GPU tests (-m gpu) -> compute-sanitizer memcheck -> self-check -> Nsight Compute -> eager host
#   cost -> benchmarks.
# Writes JSON/logs under $OUT (at most 8 files come back) and prints a short table last.
#
# Usage (on the GPU machine, repo root):  [FAMILY=attention] bash perf/gpu_check.sh [tests|sanitize|selfcheck|ncu|eager|bench|all]...
#   FAMILY     one op family (quant, rmsnorm, swiglu, rope, kv_cache, moe, moe_gemm, attention, ...): the stages run
#              only its tests (tests/test_<family>*.py), its self-check/sanitizer ops and its benchmark cases.
#              Unset: everything (the whole `tests` stage fits one call cold on an H100 with the default "gpu"
#              hypothesis profile; HYPOTHESIS_PROFILE=gpu-exhaustive is the long opt-in).
# Compile cache: Triton's cache dir is restored from .carry/triton-cache.tgz when carried, and returned as
#   $OUT/triton-cache.tgz (if under 16 MiB) so the next call starts warm: copy it to .carry/ and carry it.
# Optional: .whl/ (carried) holds extra wheels (peers), installed to /tmp/site first; .carry/env.sh (carried)
#   puts CuTeDSL on the path.
# Knobs (env): TEST_TIME, TEST_ARGS, SANITIZE_TIME, SANITIZE_OPS, BENCH_TIME, BENCH_ARGS, NCU_OPS, NCU_TIME,
#              HYPOTHESIS_PROFILE (default gpu), LOWBIT_GIT_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lowbit-out}
mkdir -p "$OUT"
start_s=$(date +%s)
# The GPU copy of the tree has no .git: pass the measured commit in LOWBIT_GIT_COMMIT (results records carry it).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(all)
want() { for s in "${stages[@]}"; do if [ "$s" = all ] || [ "$s" = "$1" ]; then return 0; fi; done; return 1; }
summary="$OUT/summary.txt"; : > "$summary"
note() { echo "$*" | tee -a "$summary"; }

family_ops() {  # the table's op names of $FAMILY (its dispatch/ops/<family>.py registrations)
  python3 -c "import dispatch.table as t, dispatch.ops as o, sys; import importlib; \
m = importlib.import_module('dispatch.ops.$FAMILY'); \
print(' '.join(op for op in t.TABLE if hasattr(m, op) or hasattr(m, '_' + op)))"
}
if [ -n "${FAMILY:-}" ]; then
  TEST_ARGS=${TEST_ARGS:-$(ls tests/test_"$FAMILY"*.py | tr '\n' ' ')}
  FAMILY_OPS=$(family_ops)
  SANITIZE_OPS=${SANITIZE_OPS:-$FAMILY_OPS}
  BENCH_ARGS=${BENCH_ARGS:---ops $FAMILY_OPS}
fi

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# shellcheck disable=SC1091
[ -f .carry/env.sh ] && source .carry/env.sh
mkdir -p "$TRITON_CACHE_DIR"
[ -f .carry/triton-cache.tgz ] && tar -xzf .carry/triton-cache.tgz -C "$TRITON_CACHE_DIR" 2>/dev/null

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
                      driver=driver, family=os.environ.get("FAMILY") or "all",
                      date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")),
                 indent=1))
PY
note "env: $(python3 -c "import json; d = json.load(open('$OUT/env.json')); print(d['device'], 'torch', d['torch'], 'triton', d['triton'], 'cutlass-dsl', d['cutlass_dsl'], 'family', d['family'])")"

if want tests; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  # Cold, the suite is bound by compiling kernels (Triton, CuTeDSL) on the host's cores, not by the GPU: pytest-xdist
  # (on the GPU image) spreads it over TEST_WORKERS processes sharing the one GPU and the on-disk compile caches.
  workers=()
  python3 -c "import xdist" 2>/dev/null && workers=(-n "${TEST_WORKERS:-12}" --dist worksteal)
  timeout -s INT -k 30 "${TEST_TIME:-480}" python3 -m pytest ${TEST_ARGS:-tests} -m gpu --run-slow -q --disable-warnings --maxfail=30 --no-header -rfE \
      "${workers[@]}" --durations=40 --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - t0 ))
  note "gpu tests (rc=$rc, $wall s, profile $HYPOTHESIS_PROFILE, ${#workers[@]} xdist args): $(grep -E '(passed|failed|error)' "$OUT/pytest.log" | tail -n 1)"
  [ -s "$OUT/pytest.xml" ] && python3 -m perf.test_summary "$OUT/pytest.xml" --wall "$wall" --env "$OUT/env.json" \
      --out "$OUT/gpu-tests.json" | tee -a "$summary"
fi

if want sanitize; then
  # memcheck over the ops' self-check cases at small shapes.
  : > "$OUT/sanitizer.log"
  for tool in ${SANITIZERS:-memcheck}; do
    # --report-api-errors no: count device memory errors only (the CuTeDSL runtime probes driver entry points
    # with cuGetProcAddress; some of those probes fail by design).
    LOWBIT_SELFCHECK_SMALL=1 timeout "${SANITIZE_TIME:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      --report-api-errors no \
      python3 -m dispatch check ${SANITIZE_OPS:+--ops $SANITIZE_OPS} >> "$OUT/sanitizer.log" 2>&1
    note "compute-sanitizer $tool (rc=$?): $(grep -E 'ERROR SUMMARY' "$OUT/sanitizer.log" | tail -n 1)"
  done
fi

if want selfcheck; then
  # shellcheck disable=SC2086
  python3 -m dispatch check --json "$OUT/selfcheck.json" ${FAMILY_OPS:+--ops $FAMILY_OPS} > "$OUT/selfcheck.log" 2>&1
  note "self-check (rc=$?): $(tail -n 1 "$OUT/selfcheck.log")"
fi

if want ncu && [ -n "${NCU_OPS:-}" ]; then
  # Nsight Compute over the benchmark cases of NCU_OPS (quick shapes): pipe shares, issue-slot use, DRAM
  # throughput and warp stalls per kernel. --clock-control none: the device's clocks are left as found.
  metrics='regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__issue_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum'
  # shellcheck disable=SC2086
  timeout "${NCU_TIME:-240}" ncu --clock-control none --csv --metrics "$metrics" --launch-count 40 \
      python3 -m perf run --no-save --ops $NCU_OPS ${NCU_ARGS:-} > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  note "ncu (rc=$?): $(wc -l < "$OUT/ncu.csv") lines"
fi

if want eager; then
  # Host cost per eager call of every op at a tiny shape vs torch's F.rms_norm (perf/eager.py), with a cProfile
  # breakdown of EAGER_PROFILE ops; the whole-suite run also compares the fused ops with torch eager / Liger at
  # decode shapes (--decode).
  # shellcheck disable=SC2086
  timeout "${EAGER_TIME:-240}" python3 -m perf.eager --out "$OUT/eager.json" ${FAMILY_OPS:+--ops $(echo $FAMILY_OPS | tr ' ' ',')} \
      --profile "${EAGER_PROFILE:-rms_norm,swiglu_mxfp4,fp8_group_quantize}" $([ -z "${FAMILY:-}" ] && echo --decode) > "$OUT/eager.log" 2>&1
  note "eager (rc=$?): $(grep -c 'lowbit\|triton\|cute\|torch' "$OUT/eager.log") lines"
  head -60 "$OUT/eager.log"
fi

if want bench; then
  # BENCH_ARGS: extra `python -m perf run` arguments (e.g. --ops ...); BENCH_TIME: seconds before no new case starts.
  # shellcheck disable=SC2086
  timeout $(( ${BENCH_TIME:-420} + 120 )) python3 -m perf run --time-limit "${BENCH_TIME:-420}" \
      --out "$OUT/bench.jsonl" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  note "benchmarks (rc=$?): $(wc -l < "$OUT/bench.jsonl" 2>/dev/null) records"
  tail -n 40 "$OUT/bench.log"
fi
note "total: $(( $(date +%s) - start_s )) s"
echo; echo "==== summary ===="; cat "$summary"
if [ -f "$OUT/selfcheck.log" ]; then tail -n 14 "$OUT/selfcheck.log"; fi
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" 2>/dev/null | head -30
grep -A16 "slowest" "$OUT/pytest.log" 2>/dev/null | head -18
# The compile cache for the next run (one file, kept only when under 16 MiB so it can be carried back).
(cd "$TRITON_CACHE_DIR" && tar -czf "$OUT/triton-cache.tgz" . 2>/dev/null)
[ "$(stat -c %s "$OUT/triton-cache.tgz" 2>/dev/null || echo 0)" -gt 16000000 ] && rm -f "$OUT/triton-cache.tgz"
# Few output files: keep env/summary/bench records/cache as they are, pack the rest into logs.tgz.
if [ -z "${GPU_CHECK_NO_PACK:-}" ]; then
  (cd "$OUT" && find . -type f ! -name logs.tgz ! -name .packlist ! -name env.json ! -name summary.txt \
      ! -name bench.jsonl ! -name eager.json ! -name triton-cache.tgz -print > .packlist && tar -czf logs.tgz -T .packlist \
      && xargs rm -f < .packlist; rm -f .packlist)
fi
exit 0
