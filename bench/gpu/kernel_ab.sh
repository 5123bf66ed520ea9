#!/usr/bin/env bash
# A/B of attention-kernel variants where they matter (issue 15), about 6 minutes on one H200:
#   1. test_attention with each configuration (every kernel test against fp32, the variant tests);
#   2. attention_bench: each stage's variants as raw launches (--variants, long shape), then the
#      end-to-end table (both shapes) with each configuration;
#   3. the target's capture forward (8 x 2048, 1 x 40000) and the drafter's full step (1 x 40000,
#      4 x 3072) with each configuration;
#   4. Nsight Compute (long shape, bench/gpu/attention_prof.sh) on the forward variants, the dQ and
#      the dK/dV pass: speed of light, memory workload, warp stalls (DFLASH_KAB_NCU=0: skipped).
# A configuration is NAME=VAR=VALUE[,VAR=VALUE...]; DFLASH_KAB_CONFIGS holds them, space-separated
# (default: "one=DFLASH_ATTN_FWD_VARIANT=5,DFLASH_ATTN_DQ_VARIANT=4 two=DFLASH_ATTN_FWD_VARIANT=7,DFLASH_ATTN_DQ_VARIANT=8"). Parts 2-4 stop
# starting after DFLASH_KAB_BUDGET_S seconds (default 420), so that a device call's limit leaves
# time to bring the logs back. DFLASH_KAB_PARTS (default "tests variants e2e models ncu") picks the
# parts; DFLASH_KAB_PROF (default "fwd_v5 fwd_v7 dq dkv"; also "fused": the fused backward, dK/dV
# variant 7) the Nsight Compute stages and DFLASH_KAB_PROF_SHAPES (default "long") their shapes.
#   bash bench/gpu/kernel_ab.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh kernel_ab)
# targets: test_attention attention_bench target_bench drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
CONFIGS=${DFLASH_KAB_CONFIGS:-one=DFLASH_ATTN_FWD_VARIANT=5,DFLASH_ATTN_DQ_VARIANT=4 two=DFLASH_ATTN_FWD_VARIANT=7,DFLASH_ATTN_DQ_VARIANT=8}
T0=$(date +%s)
in_budget() { [ $(( $(date +%s) - T0 )) -lt "${DFLASH_KAB_BUDGET_S:-420}" ] || { echo "(budget spent: $1 skipped)"; return 1; }; }
rc=0
cfg_env() { echo "${1#*=}" | tr ',' ' '; }  # NAME=A=1,B=2 -> "A=1 B=2"
cfg_name() { echo "${1%%=*}"; }
PARTS=" ${DFLASH_KAB_PARTS:-tests variants e2e models ncu} "
part() { [[ "$PARTS" == *" $1 "* ]]; }

if part tests; then
  echo "## test_attention"
  for c in $CONFIGS; do
    n=$(cfg_name "$c")
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention_$n.txt" 2>&1 ||
      { rc=1; echo "FAILED: test_attention ($n)"; }
    echo "--- $n: $(grep -E '^\[ *(PASSED|FAILED) ' "$OUT/test_attention_$n.txt" | tr '\n' ' ')"
    grep -E '^\[ *FAILED |Failure|Expected|Which is|differs' "$OUT/test_attention_$n.txt" | head -20
  done
  grep -E "larger_gqa4\] (O|dQ|dK|dV):|fused backward .*dQ:" "$OUT"/test_attention_*.txt
fi

if part variants; then
  echo "## attention_bench"
  timeout 90 "$BUILD/bench/attention_bench" --only long --no-sdpa --variants --iters 7 > "$OUT/variants_long.txt" 2>&1 || rc=1
  grep -E "variant|delta" "$OUT/variants_long.txt"
fi
# DFLASH_KAB_VARIANTS_PER_CONFIG=1: the raw per-stage launches again under each configuration (for
# knobs that act inside a variant; kernel/NOTES.md v7's exponent experiment used it)
if [ "${DFLASH_KAB_VARIANTS_PER_CONFIG:-0}" = 1 ]; then
  for c in $CONFIGS; do
    n=$(cfg_name "$c")
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 90 "$BUILD/bench/attention_bench" --only long --no-sdpa --variants --iters 7 \
      > "$OUT/variants_long_$n.txt" 2>&1 || rc=1
    echo "--- $n (raw launches)"; grep -E "variant|delta" "$OUT/variants_long_$n.txt"
  done
fi
part e2e && for c in $CONFIGS; do
  n=$(cfg_name "$c")
  in_budget "attention_bench $n" || break
  # shellcheck disable=SC2046
  env $(cfg_env "$c") timeout 90 "$BUILD/bench/attention_bench" --no-sdpa --iters 10 > "$OUT/attention_$n.txt" 2>&1 || rc=1
  echo "--- $n"; grep -E "^\| (long|train) \| kernel" "$OUT/attention_$n.txt"
done

if part models; then
  echo "## target capture forward and drafter full step"
  for c in $CONFIGS; do
    n=$(cfg_name "$c")
    in_budget "target and drafter $n" || break
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/bench/target_bench" forward --shapes 8x2048,1x40000 --iters 4 \
      > "$OUT/target_$n.txt" 2>&1 || rc=1
    echo "--- target, $n:"; grep -A3 "^shape" "$OUT/target_$n.txt" | grep -E "^(shape|[0-9]+x[0-9]+) " | head -4
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/bench/drafter_bench" --seq 40000 --rows 1 --anchors 2048 --attention kernel \
      --optimizer --iters 3 --warmup 1 > "$OUT/drafter_long_$n.txt" 2>&1 || rc=1
    # shellcheck disable=SC2046
    env $(cfg_env "$c") timeout 120 "$BUILD/bench/drafter_bench" --seq 3072 --rows 4 --anchors 512 --attention kernel \
      --optimizer --iters 5 --warmup 2 > "$OUT/drafter_train_$n.txt" 2>&1 || rc=1
    echo "--- drafter, $n:"; grep -h "^| [0-9]" "$OUT/drafter_long_$n.txt" "$OUT/drafter_train_$n.txt"
  done
fi

if [ "${DFLASH_KAB_NCU:-1}" = 1 ] && part ncu; then
  echo "## ncu"
  prof() {  # NAME KERNEL ENV...: one stage under attention_prof.sh, into OUT/ncu_NAME/
    local name=$1 k=$2 shape; shift 2
    [[ " ${DFLASH_KAB_PROF:-fwd_v5 fwd_v7 dq dkv} " == *" $name "* ]] || return 0
    for shape in ${DFLASH_KAB_PROF_SHAPES:-long}; do
      in_budget "ncu $name $shape" || return 0
      echo "--- $name ($shape)"
      env "$@" DFLASH_PROF_KERNELS="$k" bash bench/gpu/attention_prof.sh "$BUILD" "$OUT/ncu_$name" "$shape" || rc=1
    done
  }
  prof fwd_v5 attn_fwd DFLASH_ATTN_FWD_VARIANT=5
  prof fwd_v7 attn_fwd DFLASH_ATTN_FWD_VARIANT=7
  prof dq attn_bwd_dq
  prof dkv attn_bwd_dkv
  prof fused attn_bwd_fused DFLASH_ATTN_DKV_VARIANT=7
fi
exit $rc
