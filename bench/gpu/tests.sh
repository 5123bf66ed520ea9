#!/usr/bin/env bash
# Every test that runs on a GPU, in one area (about 4 minutes): the test binaries and the Python
# test that skip without CUDA in CI (tests/*: test_attention, the drafter's, the optimizer's,
# the Gated DeltaNet kernels', the device warm-up's, and test_target_gpu.py against transformers).
# One line per test, its failures printed; the area fails if any test fails, or skips on a machine
# with a GPU. Without a GPU everything skips and the area passes (a check of the script itself).
#   bash bench/gpu/tests.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh tests)
# targets: test_attention test_drafter_gpu test_ce_gpu test_drafter_kernels_gpu test_optim_gpu test_deltanet_gpu test_device target_tool target_bench
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup tests /tmp/dflash-tests "$@"   # BUILD, OUT, PY; the checkout as working directory
rc=0
for t in attention/test_attention drafter/test_drafter_gpu drafter/test_ce_gpu drafter/test_drafter_kernels_gpu \
         optim/test_optim_gpu model/test_deltanet_gpu unit/test_device; do
  n=$(basename "$t")
  t0=$(date +%s)
  if timeout 240 "$BUILD/tests/$t" > "$OUT/$n.txt" 2>&1; then r=passed; else r=FAILED; rc=1; fi
  ok=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$OUT/$n.txt")
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$OUT/$n.txt")
  # on a GPU machine nothing may skip (a skip there hides a kernel that was not built or not run)
  if [ "${ngpu:-0}" -gt 0 ] && [ "${skipped:-0}" -gt 0 ]; then r="FAILED (tests skipped on a GPU machine)"; rc=1; fi
  echo "$n: $r (${ok:-0} passed, ${skipped:-0} skipped, $(( $(date +%s) - t0 )) s)"
  [ "$r" = passed ] || grep -E '^\[  FAILED|Failure|Expected|Which is|error' "$OUT/$n.txt" | head -20
done
# pytest_run LABEL LOG TIMEOUT ENV... -- PYTEST_ARGS...: one pytest run, judged as the binaries above
pytest_run() {
  local label=$1 log=$OUT/$2 limit=$3 env=() t0 r
  shift 3
  while [ "$1" != -- ]; do env+=("$1"); shift; done
  shift
  t0=$(date +%s)
  if env "${env[@]}" DFLASH_BUILD_DIR="$BUILD" timeout "$limit" "$PY" -m pytest -q -rA "$@" > "$log" 2>&1
  then r=passed; else r=FAILED; rc=1; fi
  if [ "${ngpu:-0}" -gt 0 ] && grep -q '^SKIPPED' "$log"; then r="FAILED (tests skipped on a GPU machine)"; rc=1; fi
  echo "$label: $r ($(grep -c '^PASSED' "$log") passed, $(grep -c '^SKIPPED' "$log") skipped, $(( $(date +%s) - t0 )) s)"
  [ "$r" = passed ] || grep -E '^E |^FAILED' "$log" | head -20
}
pytest_run test_target_gpu.py test_target_gpu.txt 300 -- tests/model/test_target_gpu.py
# the q/k norm + RoPE kernel's one-element path (the paired one is the default where it fits)
pytest_run "test_target_gpu.py -k tiny_fp32, DFLASH_QK_ROPE_UNPAIRED=1" test_target_gpu_unpaired.txt 120 \
  DFLASH_QK_ROPE_UNPAIRED=1 -- -k tiny_fp32 tests/model/test_target_gpu.py
exit $rc
