#!/usr/bin/env bash
# The drafter's GPU run (one GPU, at most 1.5 minutes): GPU tests (bf16 CUDA vs fp32 CPU,
# dropped rows give zeros without NaN), then the training-step benchmark with Qwen3-8B drafter
# shapes (bench/drafter_bench.cpp), most important case first, cut by a time budget.
#   bash bench/gpu/drafter.sh BUILD_DIR OUT_DIR
# targets: drafter_bench test_drafter_gpu
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
rc=0
timeout 20 "$BUILD/tests/drafter/test_drafter_gpu" > "$OUT/test_drafter_gpu.txt" 2>&1 || rc=1
tail -12 "$OUT/test_drafter_gpu.txt"
timeout 65 "$BUILD/bench/drafter_bench" --full --iters 3 --warmup 1 --budget-s 45 2>&1 | tee "$OUT/drafter_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
exit $rc
