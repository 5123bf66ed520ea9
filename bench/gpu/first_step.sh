#!/usr/bin/env bash
# Where the long shape's first step goes (one H200, about 3 minutes): test_device (the warm-up
# under the load, core/device.h), then the colocated run of speed.sh
# 3c (Qwen3-8B-shaped random target, 1 x 40000-token documents, 2048 anchors, 3 steps), run
#   1. as is (its "first step done" line, and steady steps 2..3 from metrics.jsonl);
#   2. with the caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF);
#   3. with step 1 profiled (log.profile_start=1): its idle device gaps with the host operators that
#      left them and its CUDA runtime calls summed by name (bench/trace_gaps.py --calls).
#   bash bench/gpu/first_step.sh BUILD_DIR OUT_DIR     (bash bench/gpu/run_all.sh first_step)
# targets: dflash_rank target_bench test_device
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup first_step /tmp/dflash-pipeline-bench "$@"
bench_need_gpus 1
rc=0
timeout 60 "$BUILD/tests/unit/test_device" > "$OUT/test_device.txt" 2>&1 || { rc=1; echo "FAILED: test_device"; }
grep -E '^\[ *(PASSED|FAILED|SKIPPED) ' "$OUT/test_device.txt" | tee -a "$SUMMARY"
bench_random_target_and_data
bench_long_data
case_run() {  # NAME ENV... -- extra args
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  rm -rf "$WORK/run-first-$name"
  CUDA_VISIBLE_DEVICES=0 env "${envs[@]}" timeout 200 "$BUILD/trainer/dflash_rank" "${LONG_RUN[@]}" "$@" \
    run.dir="$WORK/run-first-$name" > "$OUT/first_$name.log" 2>&1 || rc=1
  echo "## $name: $(grep -h "first step done" "$OUT/first_$name.log" | sed 's/.*first step done/first step done/') | steady step $(bench_steady_s "$WORK/run-first-$name/metrics.jsonl") s" | tee -a "$SUMMARY"
  grep -hE "error|Error" "$OUT/first_$name.log" | head -5
}
case_run default --
case_run expandable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --
case_run profiled -- log.profile_start=1 log.profile_steps=1
T="$WORK/run-first-profiled/profile/rank0.trace.json"
if [ -f "$T" ]; then
  cp "$T" "$OUT/first_step.trace.json"
  "$PY" bench/trace_gaps.py "$T" --top 12 --calls 12 2>&1 | tee -a "$SUMMARY"
  gzip -f "$OUT/first_step.trace.json"
fi
exit $rc
