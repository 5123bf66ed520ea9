#!/usr/bin/env bash
# Every test that runs on a GPU, in one area (about 4 minutes): the test binaries and the Python
# test that skip without CUDA in CI (tests/*: test_attention, the drafter's, the optimizer's,
# the Gated DeltaNet kernels', the device warm-up's, and test_target_gpu.py against transformers).
# One line per test, its failures printed; the area fails if any test fails.
#   bash bench/gpu/tests.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh tests)
# targets: test_attention test_drafter_gpu test_ce_gpu test_drafter_kernels_gpu test_optim_gpu test_deltanet_gpu test_device target_tool target_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
for t in attention/test_attention drafter/test_drafter_gpu drafter/test_ce_gpu drafter/test_drafter_kernels_gpu \
         optim/test_optim_gpu model/test_deltanet_gpu unit/test_device; do
  n=$(basename "$t")
  t0=$(date +%s)
  if timeout 240 "$BUILD/tests/$t" > "$OUT/$n.txt" 2>&1; then r=passed; else r=FAILED; rc=1; fi
  echo "$n: $r ($(grep -c '^\[       OK' "$OUT/$n.txt") ok, $(grep -c '^\[  SKIPPED' "$OUT/$n.txt") skipped, $(( $(date +%s) - t0 )) s)"
  [ $r = passed ] || grep -E '^\[  FAILED|Failure|Expected|Which is|error' "$OUT/$n.txt" | head -20
done
t0=$(date +%s)
if DFLASH_BUILD_DIR="$BUILD" timeout 300 python3 -m pytest -q -rA tests/model/test_target_gpu.py > "$OUT/test_target_gpu.txt" 2>&1
then r=passed; else r=FAILED; rc=1; fi
echo "test_target_gpu.py: $r ($(grep -c '^PASSED' "$OUT/test_target_gpu.txt") passed, $(( $(date +%s) - t0 )) s)"
[ $r = passed ] || grep -E '^E |^FAILED' "$OUT/test_target_gpu.txt" | head -20
# the q/k norm + RoPE kernel's one-element path (the paired one is the default where it fits)
if DFLASH_QK_ROPE_UNPAIRED=1 DFLASH_BUILD_DIR="$BUILD" timeout 120 python3 -m pytest -q -rA -k tiny_fp32 \
     tests/model/test_target_gpu.py > "$OUT/test_target_gpu_unpaired.txt" 2>&1
then r=passed; else r=FAILED; rc=1; fi
echo "test_target_gpu.py -k tiny_fp32, DFLASH_QK_ROPE_UNPAIRED=1: $r ($(grep -c '^PASSED' "$OUT/test_target_gpu_unpaired.txt") passed)"
[ $r = passed ] || grep -E '^E |^FAILED' "$OUT/test_target_gpu_unpaired.txt" | head -20
exit $rc
