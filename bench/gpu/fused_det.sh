#!/usr/bin/env bash
# The fused backward's fixed-point dQ sum (DFLASH_ATTN_FUSED_DET=1, kernel/bwd_fused_sm90.cu) against its fp32
# adds in any order (0) and the split backward, about 5 minutes on one GPU:
#   1. the fused/split backward tests (KernelFusedBackward.*, KernelSplitBackward.*: dK/dV bitwise, dQ against
#      fp32, five runs of the fixed point bit-identical), then every attention test once with the default;
#   2. attention_bench (long and train shapes, kernel only) under split, fp32 adds, fixed point, alternating twice;
#   3. the drafter's full step at 1 x 40000 and 4 x 3072 under the same three, alternating twice.
# DFLASH_FD_PARTS (default "tests attention drafter") picks the parts (a device call's 10 minutes may not hold all
# three with a fresh build: run "tests attention", then "drafter" on the warm machine).
#   bash bench/gpu/fused_det.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh fused_det)
# targets: test_attention attention_bench drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
PARTS=" ${DFLASH_FD_PARTS:-tests attention drafter} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
if part tests; then
echo "## tests"
timeout 200 "$BUILD/tests/attention/test_attention" --gtest_filter='KernelFusedBackward.*:KernelSplitBackward.*' \
  > "$OUT/test_fused.txt" 2>&1 || { rc=1; echo "FAILED: fused/split backward tests"; }
grep -E '^\[ *(OK|FAILED|PASSED) |Failure|Expected|Which is|fixed point vs|differs' "$OUT/test_fused.txt" | head -60
timeout 200 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention.txt" 2>&1 || { rc=1; echo "FAILED: test_attention"; }
grep -E '^\[ *(PASSED|FAILED) |Failure' "$OUT/test_attention.txt" | head -20
fi
CONFIGS=${DFLASH_FD_CONFIGS:-"split=DFLASH_ATTN_DKV_VARIANT=3 any=DFLASH_ATTN_DKV_VARIANT=7,DFLASH_ATTN_FUSED_DET=0 fixed=DFLASH_ATTN_DKV_VARIANT=7,DFLASH_ATTN_FUSED_DET=1"}
REPS=${DFLASH_FD_REPS:-1 2}
cfg_env() { echo "${1#*=}" | tr ',' ' '; }
cfg_name() { echo "${1%%=*}"; }
part attention && echo "## attention_bench (kernel, ms)" && for rep in $REPS; do
  for c in $CONFIGS; do
    n=$(cfg_name "$c")$rep
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 90 "$BUILD/bench/attention_bench" --no-sdpa --iters 10 \
      > "$OUT/attention_$n.txt" 2>&1 || rc=1
    echo "--- $n"; grep -E "^\| (long|train) \| kernel" "$OUT/attention_$n.txt"
  done
done
part drafter && echo "## drafter full step" && for rep in $REPS; do
  for c in $CONFIGS; do
    n=$(cfg_name "$c")$rep
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/bench/drafter_bench" --seq 40000 --rows 1 --anchors 2048 --attention kernel \
      --optimizer --iters 3 --warmup 1 > "$OUT/drafter_long_$n.txt" 2>&1 || rc=1
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/bench/drafter_bench" --seq 3072 --rows 4 --anchors 512 --attention kernel \
      --optimizer --iters 5 --warmup 2 > "$OUT/drafter_train_$n.txt" 2>&1 || rc=1
    echo "--- $n"; grep -h "^| [0-9]" "$OUT/drafter_long_$n.txt" "$OUT/drafter_train_$n.txt"
  done
done
exit $rc
