#!/usr/bin/env bash
# A/B of attention-kernel variants where they matter (issue 15), about 6 minutes on one H200:
#   1. test_attention (every kernel test, the variant tests included);
#   2. attention_bench --variants at both shapes: each stage's variants as raw launches;
#   3. the target's capture forward (8 x 2048, 1 x 40000) and the drafter's full step (1 x 40000)
#      with each forward variant of DFLASH_KAB_FWD (default "4 5");
#   4. Nsight Compute on the forward variants and the dK/dV pass (long shape): tensor pipe and
#      shared-memory throughput, warp stalls;
#   5. bench/micro/red_bench.cu: fp32 global reductions (red.global.add) against plain stores in the
#      pattern a dK/dV pass would add dQ partials with.
#   bash bench/gpu/kernel_ab.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh kernel_ab)
# targets: test_attention attention_bench target_bench drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
VARS=${DFLASH_KAB_FWD:-4 5}
rc=0
echo "## test_attention"
timeout 120 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention.txt" 2>&1 || { rc=1; echo "FAILED: test_attention"; }
grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is' "$OUT/test_attention.txt" | head -50

echo "## micro: fp32 reductions"
if nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/micro/red_bench.cu -o /tmp/red_bench > "$OUT/red_build.txt" 2>&1; then
  timeout 60 /tmp/red_bench 2>&1 | tee "$OUT/red_bench.txt" || rc=1
else cat "$OUT/red_build.txt"; rc=1; fi

echo "## attention_bench --variants"
for s in long train; do
  timeout 90 "$BUILD/bench/attention_bench" --only $s --no-sdpa --variants --iters 7 > "$OUT/variants_$s.txt" 2>&1 || rc=1
  grep -E "variant|pass|fwd\+bwd|^\| $s" "$OUT/variants_$s.txt"
done

echo "## target capture forward and drafter step, forward variants: $VARS"
for v in $VARS; do
  DFLASH_ATTN_FWD_VARIANT=$v timeout 120 "$BUILD/bench/target_bench" forward --shapes 8x2048,1x40000 --iters 4 \
    > "$OUT/target_v$v.txt" 2>&1 || rc=1
  echo "target, fwd variant $v:"; grep "^|" "$OUT/target_v$v.txt" | head -6
done
for v in $VARS; do
  DFLASH_ATTN_FWD_VARIANT=$v timeout 120 "$BUILD/bench/drafter_bench" --seq 40000 --rows 1 --anchors 2048 --attention kernel \
    --optimizer --iters 3 --warmup 1 > "$OUT/drafter_long_v$v.txt" 2>&1 || rc=1
  echo "drafter, fwd variant $v:"; grep -h "^| [0-9]" "$OUT/drafter_long_v$v.txt"
done

echo "## ncu (long shape)"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$NCU" ]; then
  prof() {  # NAME KERNEL_REGEX ENV...
    local name=$1 k=$2; shift 2
    env "$@" timeout 120 "$NCU" --clock-control none --kernel-name "regex:$k" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
      "$BUILD/bench/attention_bench" --only long --no-sdpa --iters 1 > "$OUT/ncu_$name.txt" 2>&1 || rc=1
    echo "--- $name"
    grep -E "Duration|SM Busy|Throughput|Issue Slots|Eligible|Shared|Bank|Stall (Long|Short|Wait|Barrier|MIO|Math|Not Sel|Dispatch)|Pipe" "$OUT/ncu_$name.txt" | head -40
  }
  for v in $VARS; do prof fwd_v$v "attn_fwd_wgmma.*" DFLASH_ATTN_FWD_VARIANT=$v; done
  prof dkv "attn_bwd_dkv_wgmma.*"
else echo "no ncu"; fi
exit $rc
