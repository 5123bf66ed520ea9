#!/usr/bin/env bash
# Where the fused backward's fixed point (DFLASH_ATTN_FUSED_DET=1) loses its ~3.5 ms against the fp32 adds (=0) at
# the long shape (attention/kernel/NOTES.md v19), three ways in one call of about 5 minutes:
#   1. attention_bench (long, kernel, fused backward) DET=1 / DET=0 alternating twice, nvidia-smi sampling the SM
#      clock and power beside each (bench/gpu_watch.py): is the difference time at the same clock, or clock?
#   2. Nsight Compute on the fused pass alone, DET=1 and 0, clocks locked to base (--clock-control base): the
#      cycles, instructions and pipe shares at one clock, so that the power cap cannot move them;
#   3. bench/patches/fused_trace.patch applied to a copy of the tree, built with -DDFLASH_FUSED_TRACE in its own
#      folder: per phase of the item loop, the cycles of each warpgroup, DET=1 and 0.
# DFLASH_FDP_PARTS="1 2 3" (the default) picks the parts.
#   bash bench/gpu/fused_det_prof.sh BUILD_DIR OUT_DIR     (bash bench/gpu/run_all.sh fused_det_prof; not in the
#   default set: *_prof)
# targets: attention_bench
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup fused_det_prof /tmp/dflash-fused-det-prof "$@"
bench_need_gpus 1
rc=0
export DFLASH_ATTN_DKV_VARIANT=7 DFLASH_ATTN_FUSED_TMA=1
PARTS=" ${DFLASH_FDP_PARTS:-1 2 3} "   # which of 1. 2. 3. to run
part() { [[ "$PARTS" == *" $1 "* ]]; }

if part 1; then
echo "## 1. attention_bench long (fused backward), ms, and the clock beside it" | tee -a "$SUMMARY"
for rep in 1 2; do
  for det in 1 0; do
    n=det${det}_$rep
    gpu_watch_start "$n"
    DFLASH_ATTN_FUSED_DET=$det timeout 90 "$BUILD/bench/attention_bench" --only long --no-sdpa --iters 20 \
      > "$OUT/attention_$n.txt" 2>&1 || rc=1
    gpu_watch_stop "$n"
    { echo "--- $n"; grep -E "^\| long \| kernel" "$OUT/attention_$n.txt"; } | tee -a "$SUMMARY"
  done
done
fi

if part 2; then
echo "## 2. ncu, fused pass alone, clocks locked to base" | tee -a "$SUMMARY"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -z "$NCU" ]; then
  echo "SKIP: no ncu" | tee -a "$SUMMARY"
else
  for det in 1 0; do
    DFLASH_ATTN_FUSED_DET=$det timeout 150 "$NCU" --clock-control base --kernel-name "regex:attn_bwd_fused.*kernel" \
      --launch-skip 1 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section InstructionStats --section WarpStateStats --section SchedulerStats \
      "$BUILD/bench/attention_bench" --only long --no-sdpa --iters 1 > "$OUT/ncu_det$det.txt" 2>&1 || rc=1
    { echo "--- DET=$det"
      grep -E "Duration|Elapsed Cycles|SM Frequency|Executed Ipc|Issue Slots Busy|Executed Instructions |Pipe|Eligible Warps|No Eligible|Warp Cycles Per Issued|Compute \(SM\) Throughput|Memory Throughput" \
        "$OUT/ncu_det$det.txt" | head -30; } | tee -a "$SUMMARY"
  done
fi
fi

part 3 || exit $rc
echo "## 3. trace (bench/patches/fused_trace.patch), cycles per phase" | tee -a "$SUMMARY"
SRC=/tmp/dflash-trace-src
TB=/tmp/dflash-trace-build
rm -rf "$SRC"; mkdir -p "$SRC"
tar --exclude=./.git --exclude=./build --exclude=./.venv -cf - . | tar -xf - -C "$SRC"
if (cd "$SRC" && patch -p1 --quiet < bench/patches/fused_trace.patch); then
  t0=$(date +%s)
  { cmake -S "$SRC" -B "$TB" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_PYTHON="$(command -v "$PY")" -DDFLASH_CUDA_ARCHS=90a \
      -DCMAKE_CUDA_FLAGS=-DDFLASH_FUSED_TRACE && ninja -C "$TB" -j "$(nproc)" attention_bench; } > "$OUT/trace_build.log" 2>&1 \
    || { rc=1; tail -20 "$OUT/trace_build.log"; }
  echo "trace build: $(( $(date +%s) - t0 )) s" | tee -a "$SUMMARY"
  for det in 1 0 1 0; do
    echo "--- DET=$det" | tee -a "$SUMMARY"
    DFLASH_ATTN_FUSED_DET=$det timeout 90 "$TB/bench/attention_bench" --only long --no-sdpa --iters 1 \
      > "$OUT/trace_det$det.txt" 2>&1 || rc=1
    grep -A14 "^fused trace" "$OUT/trace_det$det.txt" | tail -15 | tee -a "$SUMMARY"  # the last launch's
  done
else
  echo "FAILED: bench/patches/fused_trace.patch does not apply" | tee -a "$SUMMARY"; rc=1
fi
exit $rc
