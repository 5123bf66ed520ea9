#!/usr/bin/env bash
# Target capture forward on one stream against two (DFLASH_TARGET_STREAMS=2: the documents in two
# halves, each on its own CUDA stream, trainer/model/target.cpp capture_two_streams), alternated
# twice; the GPU correctness test against transformers under both; then the drafter step's profile
# at the recipe shape (kernel time by kind and the top kernels).
#   bash bench/gpu/target_streams.sh BUILD_DIR OUT_DIR      (about 3 minutes)
# targets: target_bench target_tool drafter_bench
set -uo pipefail
BUILD=$1
OUT=$2
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
rc=0
for round in 1 2; do
  for s in 1 2; do
    echo "--- capture forward, streams $s (round $round)"
    DFLASH_TARGET_STREAMS=$s timeout 90 "$BUILD/bench/target_bench" forward --shapes 8x2048,4x4096,4x3072 --iters 7 \
      --json "$OUT/forward_s${s}_r${round}.json" > "$OUT/forward_s${s}_r${round}.txt" 2>&1 || rc=1
    grep -A4 "^shape " "$OUT/forward_s${s}_r${round}.txt"
  done
done
echo "--- capture forward, streams 1, TORCH_BLAS_PREFER_CUBLASLT=1 (cuBLASLt for at::mm)"
TORCH_BLAS_PREFER_CUBLASLT=1 timeout 90 "$BUILD/bench/target_bench" forward --shapes 8x2048 --iters 7 \
  > "$OUT/forward_lt.txt" 2>&1 || rc=1
grep -A4 "^shape " "$OUT/forward_lt.txt"
for round in 1 2; do
  for s in 1 2; do
    echo "--- GPU correctness vs transformers, streams $s (round $round)"
    DFLASH_TARGET_STREAMS=$s DFLASH_BUILD_DIR="$BUILD" timeout 150 python3 -m pytest -q -rA tests/model/test_target_gpu.py \
      > "$OUT/test_target_gpu_s${s}_r$round.txt" 2>&1 || { rc=1; grep -E "^E |Error|assert" "$OUT/test_target_gpu_s${s}_r$round.txt" | head -20; }
    grep -E "^(PASSED|FAILED)|passed|failed" "$OUT/test_target_gpu_s${s}_r$round.txt" | tail -5
  done
done
echo "--- drafter step profile, 4 x 3072, 512 anchors"
timeout 120 "$BUILD/bench/drafter_bench" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --profile \
  > "$OUT/drafter_profile.txt" 2>&1 || rc=1
cat "$OUT/drafter_profile.txt" | tail -60
exit $rc
