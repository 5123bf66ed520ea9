#!/usr/bin/env bash
# The GEMMs of the target forward and of the drafter step on one GPU (about 1 minute): at::mm (what
# the models run: cuBLAS's own choice) beside every algorithm cuBLASLt's heuristic offers for each
# shape (bench/gemm_bench.cpp), then one profiled drafter step at the recipe shape with its Chrome
# trace and the gaps the GPU waited in it (bench/trace_gaps.py).
#   bash bench/gpu/gemm.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh gemm)
# targets: gemm_bench drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
echo "## GEMMs: at::mm vs the cuBLASLt heuristic's algorithms (target at 8 x 2048 tokens, drafter at 4 x 3072)"
timeout 240 "$BUILD/bench/gemm_bench" --set all --tokens 16384 --iters 10 --algos 16 > "$OUT/gemm.txt" 2>&1 || rc=1
cat "$OUT/gemm.txt"
echo "## drafter step 4 x 3072, profiled, and its idle gaps"
timeout 100 "$BUILD/bench/drafter_bench" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --iters 5 \
  --warmup 2 --profile --profile-trace "$OUT/step_4x3072.trace.json" > "$OUT/step.txt" 2>&1 || rc=1
grep -h "^| [0-9]\|^optimizer:\|failed" "$OUT/step.txt"
sed -n '/^profile of one step/,/^| top kernels/p' "$OUT/step.txt"
python3 bench/trace_gaps.py "$OUT/step_4x3072.trace.json" --top 30 || rc=1
gzip -f "$OUT/step_4x3072.trace.json"
exit $rc
