#!/usr/bin/env bash
# Builds libflashmla_lowbit.so, the FlashMLA benchmark peer (perf/peers.py loads it with ctypes): FlashMLA's sm_90a
# decode kernels (dense bf16 split-KV, sparse FP8 V3.2 and MODEL1 at 128 heads, the scheduler metadata and the
# split combine) behind the plain C ABI of flashmla_capi.cu, CUDA runtime linked statically, no torch.
#
#   perf/peers_src/build_flashmla.sh FLASHMLA_DIR CUTLASS_DIR OUT_DIR
#
# FLASHMLA_DIR: a checkout of deepseek-ai/FlashMLA (its csrc/ is read; its commit goes to OUT_DIR/COMMIT, or set
# FLASHMLA_COMMIT when the directory is not a git checkout). CUTLASS_DIR: NVIDIA/cutlass at the commit FlashMLA's
# csrc/cutlass submodule pins (only include/ is read). OUT_DIR gets libflashmla_lowbit.so and COMMIT; the objects
# go to OUT_DIR/obj. JOBS (default: the number of CPUs) kernel sources compile at once; NVCC overrides the compiler.
set -euo pipefail

if [[ $# -ne 3 ]]; then
    echo "usage: $0 FLASHMLA_DIR CUTLASS_DIR OUT_DIR" >&2
    exit 2
fi
FLASHMLA=$(cd "$1" && pwd)
CUTLASS=$(cd "$2" && pwd)
OUT=$3
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NVCC=${NVCC:-nvcc}
JOBS=${JOBS:-$(nproc)}
CSRC=$FLASHMLA/csrc

for need in "$CSRC/params.h" "$CSRC/sm90/decode/sparse_fp8/splitkv_mla.cuh" "$CUTLASS/include/cute/tensor.hpp"; do
    [[ -f $need ]] || { echo "missing $need (wrong FlashMLA or CUTLASS directory?)" >&2; exit 2; }
done
if [[ -n ${FLASHMLA_COMMIT:-} ]]; then
    COMMIT=$FLASHMLA_COMMIT
else
    COMMIT=$(git -C "$FLASHMLA" rev-parse HEAD) || {
        echo "$FLASHMLA is not a git checkout: set FLASHMLA_COMMIT to the commit its sources are from" >&2; exit 2; }
fi

mkdir -p "$OUT/obj"
# FlashMLA's own nvcc flags (its setup.py) for the sm_90a target; fp16 instantiations left out (bf16 only here).
FLAGS=(-arch=sm_90a -O3 -std=c++20 -DNDEBUG -D_USE_MATH_DEFINES -DFLASH_MLA_DISABLE_FP16
       -Wno-deprecated-declarations --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math
       --ptxas-options=--register-usage-level=10 -Xcompiler -fPIC
       -I"$CSRC" -I"$CSRC/kerutils/include" -I"$CSRC/sm90" -I"$CUTLASS/include")
# FlashMLA's sources, one object each, with its exit(1) host checks replaced by exceptions.
KERNELS=(smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu
         smxx/decode/combine/combine.cu
         sm90/decode/dense/instantiations/bf16.cu
         sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu
         sm90/decode/sparse_fp8/instantiations/model1_persistent_h128.cu)

# The compile flags, kept in a stamp file that is rewritten only when they change: an object newer than its source,
# the checks header and the stamp is reused.
STAMP=$OUT/obj/compile-flags
printf '%s\n' "$NVCC" "${FLAGS[@]}" >"$STAMP.new"
if cmp -s "$STAMP.new" "$STAMP"; then rm "$STAMP.new"; else mv "$STAMP.new" "$STAMP"; fi

compile() {  # source object
    local log=$2.log
    if [[ $2 -nt $1 && $2 -nt $HERE/flashmla_host_checks.h && $2 -nt $STAMP ]]; then
        echo "up to date $2"
        return 0
    fi
    rm -f "$2"
    if "$NVCC" "${FLAGS[@]}" -include "$HERE/flashmla_host_checks.h" -c "$1" -o "$2" >"$log" 2>&1; then
        echo "compiled $1"
    else
        cat "$log" >&2
        echo "FAILED $1 (log $log)" >&2
    fi
}

OBJS=("$OUT/obj/flashmla_capi.o")
SRCS=("$HERE/flashmla_capi.cu")
for src in "${KERNELS[@]}"; do
    OBJS+=("$OUT/obj/$(basename "${src%.cu}").o")
    SRCS+=("$CSRC/$src")
done
for i in "${!SRCS[@]}"; do
    while [[ $(jobs -rp | wc -l) -ge $JOBS ]]; do wait -n || true; done
    compile "${SRCS[$i]}" "${OBJS[$i]}" &
done
wait
for obj in "${OBJS[@]}"; do
    [[ -f $obj ]] || { echo "compilation failed: $obj missing" >&2; exit 1; }
done

# --exclude-libs: the static CUDA runtime's symbols stay inside the library (not exported), so its calls cannot bind
# to another CUDA runtime already loaded in the process (torch's libcudart) and that one is not shadowed either.
"$NVCC" -arch=sm_90a --shared -cudart static -Xcompiler -fPIC -Xlinker -z,defs -Xlinker --exclude-libs,ALL \
    -o "$OUT/libflashmla_lowbit.so" "${OBJS[@]}"
echo "$COMMIT" >"$OUT/COMMIT"
echo "built $OUT/libflashmla_lowbit.so (FlashMLA $COMMIT)"
