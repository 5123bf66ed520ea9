#!/usr/bin/env bash
# The drafter's GPU run: GPU tests (bf16 CUDA vs fp32 CPU, dropped rows) and the training-step
# benchmark with Qwen3-8B drafter shapes (bench/drafter_bench.cpp). About 3-4 minutes.
#   bash bench/gpu/drafter.sh BUILD_DIR OUT_DIR
# targets: drafter_bench test_drafter_gpu
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
rc=0
timeout 120 "$BUILD/tests/drafter/test_drafter_gpu" 2>&1 | tee "$OUT/test_drafter_gpu.txt" | tail -15 || rc=1
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
timeout 200 "$BUILD/bench/drafter_bench" --full 2>&1 | tee "$OUT/drafter_bench.txt" || rc=1
exit $rc
