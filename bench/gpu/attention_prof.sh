#!/usr/bin/env bash
# Nsight Compute profile of the three attention kernel stages (forward, dQ pass, dK/dV pass) on
# one shape, one launch each: speed of light, compute and memory workload, warp stalls.
#   bash bench/gpu/attention_prof.sh BUILD_DIR OUT_DIR [train|long]
#   (or bash bench/gpu/run_all.sh attention_prof; not part of run_all's default set)
#   DFLASH_PROF_SHAPE=train|long (default long), DFLASH_PROF_KERNELS="attn_fwd attn_bwd_dq attn_bwd_dkv"
#   (the default: all three)
# targets: attention_bench
set -uo pipefail
BUILD=${1:?usage: attention_prof.sh BUILD_DIR OUT_DIR [shape]}
OUT=${2:?usage: attention_prof.sh BUILD_DIR OUT_DIR [shape]}
SHAPE=${3:-${DFLASH_PROF_SHAPE:-long}}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
rc=0
for k in ${DFLASH_PROF_KERNELS:-attn_fwd attn_bwd_dq attn_bwd_dkv}; do
  timeout 120 "$NCU" --clock-control none --kernel-name "regex:${k}_.*kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    "$BUILD/bench/attention_bench" --only "$SHAPE" --no-sdpa --iters 1 > "$OUT/ncu_${SHAPE}_${k}.txt" 2>&1 || rc=1
  grep -E "Duration|Throughput|Pipe|pct|Registers|Achieved Occupancy|Stall|Warp Cycles|Issued|Eligible|L2 Hit|Bank" "$OUT/ncu_${SHAPE}_${k}.txt" | head -60
done
exit $rc
