#!/usr/bin/env bash
# A/B of the attention kernel's heads per CTA (one H200, about 3 minutes): the forward and the dQ
# pass with two query heads of one KV head per CTA sharing its K/V tiles (variant 5, the default)
# against one head per CTA (variant 4), measured in the same run:
#   1. the attention GPU tests (default variants, then the whole suite once more with 4);
#   2. attention_bench per stage and variant (raw launches) at both shapes, and end to end;
#   3. the drafter's full step at 1 x 40000 / 2048 anchors and 4 x 3072 / 512 anchors, each way;
#   4. the target capture forward at 1 x 40000 (one long document: the causal kernel's share is
#      largest) and 8 x 2048, each way.
#   bash bench/gpu/heads.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh heads)
# targets: test_attention attention_bench drafter_bench target_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
rc=0
one=(DFLASH_ATTN_FWD_VARIANT=4 DFLASH_ATTN_DQ_VARIANT=4)
echo "## attention tests (default: two heads per CTA)"
timeout 60 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention.txt" 2>&1 || { rc=1; echo FAILED; }
grep -E '^\[ *(PASSED|FAILED) |Failure|Expected|Which is' "$OUT/test_attention.txt" | head -30
echo "## attention tests (one head per CTA)"
env "${one[@]}" timeout 60 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention_one.txt" 2>&1 || { rc=1; echo FAILED; }
grep -E '^\[ *(PASSED|FAILED) |Failure|Expected|Which is' "$OUT/test_attention_one.txt" | head -30
# the errors of both ways side by side (kernel vs fp32 and SDPA vs fp32 per case)
grep -h "err\|error" "$OUT/test_attention.txt" | head -40 > "$OUT/errors_two.txt"
grep -h "err\|error" "$OUT/test_attention_one.txt" | head -40 > "$OUT/errors_one.txt"
diff -q "$OUT/errors_two.txt" "$OUT/errors_one.txt" >/dev/null && echo "errors: identical both ways" || echo "errors: differ (see errors_*.txt)"

echo "## attention_bench: stages by variant (raw launches), then end to end"
timeout 90 "$BUILD/bench/attention_bench" --iters 7 --variants --no-sdpa --out "$OUT" > "$OUT/attention_bench.txt" 2>&1 || rc=1
grep -E "variant|delta|^\|" "$OUT/attention_bench.txt"
echo "## attention_bench end to end, one head per CTA"
env "${one[@]}" timeout 60 "$BUILD/bench/attention_bench" --iters 7 --no-sdpa --out "$OUT/one" > "$OUT/attention_bench_one.txt" 2>&1 || rc=1
grep -E "^\|" "$OUT/attention_bench_one.txt"

B="$BUILD/bench/drafter_bench"
echo "## drafter full step: two heads per CTA (default), then one"
echo "| S | B | attention / loss | fwd ms | bwd ms | opt ms | step ms | draft pos/s | target tok/s | TFLOP/s | MFU | peak GiB |"
for way in two one; do
  e=(); [ $way = one ] && e=("${one[@]}")
  env "${e[@]}" timeout 120 "$B" --seq 40000 --rows 1 --anchors 2048 --attention kernel --optimizer --iters 3 --warmup 1 \
    > "$OUT/drafter_1x40000_$way.txt" 2>&1 || rc=1
  env "${e[@]}" timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --iters 5 --warmup 2 \
    > "$OUT/drafter_4x3072_$way.txt" 2>&1 || rc=1
  grep -h "^| [0-9]\|^steady" "$OUT/drafter_1x40000_$way.txt" "$OUT/drafter_4x3072_$way.txt" | sed "s/^/$way /"
done

echo "## target capture forward: two heads per CTA (default), then one"
for way in two one; do
  e=(); [ $way = one ] && e=("${one[@]}")
  env "${e[@]}" timeout 90 "$BUILD/bench/target_bench" forward --shapes 1x40000,8x2048 --iters 3 \
    > "$OUT/target_$way.txt" 2>&1 || rc=1
  grep -A3 "^shape" "$OUT/target_$way.txt" | sed "s/^/$way /"
done
exit $rc
