#!/usr/bin/env bash
# The persistent forward (variant 14) against the grid forward (13) (issue 15), about 4 minutes on
# one GPU: test_attention under each (14 must equal 13 bitwise: KernelForwardPersistent and the
# causal tests), the target's packed causal attention alone over document lengths 512..16384, the
# capture forward at 8 x 2048 and 4 x 3072 with its per-op breakdown, and the drafter's attention
# (attention_bench, both shapes); every timing alternated 13, 14, 13, 14 on the same GPU.
#   bash bench/gpu/persist_ab.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh persist_ab)
# targets: test_attention attention_bench target_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
echo "## test_attention"
for v in 13 14; do
  DFLASH_ATTN_FWD_VARIANT=$v timeout 120 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention_$v.txt" 2>&1 ||
    { rc=1; echo "FAILED: test_attention (forward $v)"; }
  echo "--- forward $v: $(grep -E '^\[ *(PASSED|FAILED) ' "$OUT/test_attention_$v.txt" | tr '\n' ' ')"
  grep -E '^\[ *FAILED |Failure|Expected|Which is|differs|max diff' "$OUT/test_attention_$v.txt" | head -20
done
for r in 1 2; do
  for v in 13 14; do
    echo "## round $r, forward $v"
    DFLASH_ATTN_FWD_VARIANT=$v timeout 120 "$BUILD/bench/target_bench" attention \
      --shapes 32x512,16x1024,8x2048,4x4096,2x8192,1x16384 --iters 8 > "$OUT/attention_${v}_$r.txt" 2>&1 || rc=1
    grep -E "^ *[0-9]+x[0-9]+|shape|dflash" "$OUT/attention_${v}_$r.txt" | head -12
    DFLASH_ATTN_FWD_VARIANT=$v timeout 90 "$BUILD/bench/target_bench" forward --shapes 8x2048,4x3072 --iters 5 \
      > "$OUT/forward_${v}_$r.txt" 2>&1 || rc=1
    grep -E "^(shape|[0-9]+x[0-9]+) |attention" "$OUT/forward_${v}_$r.txt" | head -8
    DFLASH_ATTN_FWD_VARIANT=$v timeout 60 "$BUILD/bench/attention_bench" --no-sdpa --iters 10 \
      > "$OUT/drafter_attention_${v}_$r.txt" 2>&1 || rc=1
    grep -E "^\| (long|train) \| kernel" "$OUT/drafter_attention_${v}_$r.txt"
  done
done
exit $rc
