#!/usr/bin/env bash
# Where the attention kernel's warps wait (issue 15): Nsight Compute's PC sampling of each stage at
# the long shape, one launch each, summed by stall reason and by SASS instruction
# (bench/ncu_stalls.py), plus test_attention under the defaults first (the kernels must be right
# before their time is read).
#   bash bench/gpu/attention_stalls.sh BUILD_DIR OUT_DIR      (bash bench/gpu/run_all.sh attention_stalls)
#   DFLASH_STALL_KERNELS="attn_fwd attn_bwd_dq attn_bwd_dkv" (the default); environment variables such as
#   DFLASH_ATTN_FWD_VARIANT pass through to the benchmark.
# targets: test_attention attention_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
cd "$(dirname "$0")/../.." || exit 1
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
rc=0
timeout 90 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention.txt" 2>&1 || { rc=1; echo "FAILED: test_attention"; }
grep -E '^\[ *(PASSED|FAILED) ' "$OUT/test_attention.txt"
grep -E "larger_gqa4\] (O|dQ|dK|dV):" "$OUT/test_attention.txt"
for k in ${DFLASH_STALL_KERNELS:-attn_fwd attn_bwd_dq attn_bwd_dkv}; do
  rep="$OUT/stall_$k"
  timeout 150 "$NCU" --clock-control none --kernel-name "regex:${k}_.*kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --import-source no -f -o "$rep" \
    "$BUILD/bench/attention_bench" --only long --no-sdpa --iters 1 > "$OUT/ncu_$k.log" 2>&1 || { rc=1; tail -5 "$OUT/ncu_$k.log"; }
  [ -f "$rep.ncu-rep" ] || continue
  "$NCU" -i "$rep.ncu-rep" --page raw --csv > "$rep.raw.csv" 2>/dev/null || rc=1
  "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>/dev/null || rc=1
  echo "=== $k"
  python3 bench/ncu_stalls.py "$rep.raw.csv" "$rep.sass.csv" | tee "$OUT/stalls_$k.txt" || rc=1
  rm -f "$rep.ncu-rep"
done
exit $rc
