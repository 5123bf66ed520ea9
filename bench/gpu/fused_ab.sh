#!/usr/bin/env bash
# The fused backward's modes against each other and the split backward (issue 15), about 4 minutes on
# one GPU: the fused-backward tests (every mode against the split backward and fp32), then the
# attention alone (attention_bench, both shapes, fwd+bwd) and the drafter's full step (1 x 40000 and
# 4 x 3072) under each configuration, alternated twice on the same GPU.
# A configuration is NAME=VAR=VALUE[,VAR=VALUE...]; DFLASH_FAB_CONFIGS holds them, space-separated
# (default: the split backward, the fused one with TMA loads, the fused one with decoupled warpgroups in
# each of its orders, DFLASH_ATTN_FUSED_TMA=2, 3, 4). The drafter step runs the long shape only for
# the fused configurations (DFLASH_FAB_STEP="NAME ...": only those; DFLASH_FAB_TRAIN=1: the recipe shape
# too); DFLASH_FAB_ROUNDS (default 2) rounds of attention_bench.
#   bash bench/gpu/fused_ab.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh fused_ab)
# targets: test_attention attention_bench drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
F=DFLASH_ATTN_DKV_VARIANT=7,DFLASH_ATTN_FUSED_TMA
CONFIGS=${DFLASH_FAB_CONFIGS:-split=DFLASH_ATTN_DKV_VARIANT=3 fused=$F=1 dec2=$F=2 dec3=$F=3 dec4=$F=4}
cfg_env() { echo "${1#*=}" | tr ',' ' '; }  # NAME=A=1,B=2 -> "A=1 B=2"
cfg_name() { echo "${1%%=*}"; }
rc=0
echo "## test_attention (KernelFused*, KernelBackward*)"
timeout 120 "$BUILD/tests/attention/test_attention" --gtest_filter='KernelFused*:KernelBackward*' > "$OUT/test_fused.txt" 2>&1
trc=$?
if [ $trc -ne 0 ]; then
  rc=1; echo "FAILED: test_attention (rc $trc)"
  # a hang (timeout's 124) would hang every benchmark of a decoupled mode too: those are dropped
  # shellcheck disable=SC2086
  [ $trc = 124 ] && CONFIGS=$(printf '%s\n' $CONFIGS | grep -v 'FUSED_TMA=[234]' | tr '\n' ' ') && echo "timed out: running $CONFIGS"
fi
grep -E '^\[ *(OK|FAILED|PASSED) |Failure|Expected|Which is|fused backward .*dQ:' "$OUT/test_fused.txt" | head -60
for r in $(seq 1 "${DFLASH_FAB_ROUNDS:-2}"); do
  echo "## round $r: attention_bench (fwd+bwd, ms)"
  for c in $CONFIGS; do
    n=$(cfg_name "$c")
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 90 "$BUILD/bench/attention_bench" --no-sdpa --iters 10 > "$OUT/attention_${n}_$r.txt" 2>&1 || rc=1
    echo "--- $n"; grep -E "^\| (long|train) \| kernel" "$OUT/attention_${n}_$r.txt"
  done
done
echo "## drafter full step"
for c in $CONFIGS; do
  n=$(cfg_name "$c")
  [ "$n" = split ] && continue
  [ -n "${DFLASH_FAB_STEP:-}" ] && [[ " $DFLASH_FAB_STEP " != *" $n "* ]] && continue
  # shellcheck disable=SC2046
  env $(cfg_env "$c") timeout 120 "$BUILD/bench/drafter_bench" --seq 40000 --rows 1 --anchors 2048 --attention kernel \
    --optimizer --iters 3 --warmup 1 > "$OUT/drafter_long_$n.txt" 2>&1 || rc=1
  if [ "${DFLASH_FAB_TRAIN:-0}" = 1 ]; then
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/bench/drafter_bench" --seq 3072 --rows 4 --anchors 512 --attention kernel \
      --optimizer --iters 5 --warmup 2 > "$OUT/drafter_train_$n.txt" 2>&1 || rc=1
  fi
  echo "--- $n:"; grep -h "^| [0-9]" "$OUT"/drafter_*_"$n".txt
done
exit $rc
