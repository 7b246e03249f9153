export TRITON_CACHE_DIR=/tmp/tc LOWBIT_GIT_COMMIT=$1 HYPOTHESIS_PROFILE=gpu; source .carry/env.sh; export PYTHONPATH=$PYTHONPATH:$PWD
S="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats --section ComputeWorkloadAnalysis"
for m in "gpt-oss-20b gemm1 E=32 8" "gpt-oss-120b gemm1 E=128 16"; do
  L="$m rows/expert N=5760 K=2880 mxfp4 prepacked contiguous"; f=$(echo $m | cut -d' ' -f1)
  timeout 200 ncu --csv --page details $S --nvtx --nvtx-include "triton/" --nvtx-include "triton_kernels/" python3 -m perf.scripts.case_calls --op moe_gemm_fp4_prepacked --case "$L" --providers triton,triton_kernels --calls 1 > $OUT/ncu-$f.csv 2> $OUT/ncu-$f.err; echo "$f rc $?"
done
grep -h '"Duration"' $OUT/ncu-*.csv | cut -c1-260
