#!/usr/bin/env bash
# The per-shape cuBLASLt GEMMs (trainer/model/gemm.h) on one GPU (about 2 minutes): their GPU test
# (against float64 beside at::mm), the target's capture forward and the drafter's full step with
# them (the default) and with DFLASH_GEMM_TUNE=0 (at::mm everywhere) in the same run, then one
# profiled drafter step with its Chrome trace and the gaps the GPU waited in it
# (bench/trace_gaps.py). DFLASH_GEMM_BENCH=1 first prints gemm_bench's table (at::mm beside every
# algorithm cuBLASLt's heuristic offers, per shape of the target and the drafter).
#   bash bench/gpu/gemm.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh gemm)
# targets: test_gemm_gpu gemm_bench target_bench drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
rc=0
echo "## test_gemm_gpu"
timeout 120 "$BUILD/tests/model/test_gemm_gpu" > "$OUT/test_gemm_gpu.txt" 2>&1 || { rc=1; echo "FAILED: test_gemm_gpu"; }
grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) |^\[.*error|Failure|Expected|Which is' "$OUT/test_gemm_gpu.txt" | head -40
if [ "${DFLASH_GEMM_BENCH:-0}" = 1 ]; then
  echo "## GEMMs: at::mm vs the cuBLASLt heuristic's algorithms (target at 8 x 2048 tokens, drafter at 4 x 3072)"
  timeout 240 "$BUILD/bench/gemm_bench" --set all --tokens 16384 --iters 10 --algos 16 > "$OUT/gemm.txt" 2>&1 || rc=1
  cat "$OUT/gemm.txt"
fi
fwd() {  # NAME ENV...: the target's capture forward
  local name=$1; shift
  echo "## target capture forward, $name"
  env "$@" timeout 120 "$BUILD/bench/target_bench" forward --shapes 8x2048,4x4096 --iters 6 \
    --json "$OUT/forward_$name.json" > "$OUT/forward_$name.txt" 2>&1 || rc=1
  grep -E "^(shape|[0-9]+x[0-9]+ |gemm|matmul)" "$OUT/forward_$name.txt"
}
fwd at_mm DFLASH_GEMM_TUNE=0
fwd tuned DFLASH_GEMM_TUNE=auto
step() {  # NAME ENV... -- drafter_bench args
  local name=$1; shift
  echo "## drafter step, $name"
  env "$@" > "$OUT/$name.txt" 2>&1 || rc=1
  grep -h "^| [0-9]\|^optimizer:\|^gemm\|failed" "$OUT/$name.txt"
  sed -n '/^profile of one step/,/^| top kernels/p' "$OUT/$name.txt"
}
B="$BUILD/bench/drafter_bench"
echo "| S | B | attention / loss | fwd ms | bwd ms | opt ms | step ms | draft pos/s | target tok/s | TFLOP/s | MFU | peak GiB |"
step step_at_mm DFLASH_GEMM_TUNE=0 timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer \
  --iters 5 --warmup 2
step step_tuned timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --iters 5 --warmup 2 \
  --profile --profile-trace "$OUT/step_4x3072.trace.json"
python3 bench/trace_gaps.py "$OUT/step_4x3072.trace.json" --top 12 || rc=1
gzip -f "$OUT/step_4x3072.trace.json"
step long_tuned timeout 120 "$B" --seq 40000 --rows 1 --anchors 2048 --attention kernel --optimizer --iters 3 --warmup 1
exit $rc
