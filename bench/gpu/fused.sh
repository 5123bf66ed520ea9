#!/usr/bin/env bash
# The drafter step's fused kernels on one GPU (about 2 minutes): their GPU tests (the q/k norm +
# RoPE, RoPE and SwiGLU kernels, the fused cross-entropy, AdamW's kernels against ATen's fused
# AdamW, the attention kernel with a whole drafter step, the bf16 CUDA step against fp32 on the
# CPU), then the full step (forward / backward / AdamW) at the recipe shape with the fused kernels
# (the default; its profile by kind of work and its Chrome trace) and without them
# (DFLASH_DRAFTER_FUSED=0 DFLASH_CE_FUSED=0: the ATen chains, profiled), and at the long shape
# 1 x 40000; the recipe shape once with bf16 logits (DFLASH_CE_LOGITS=bf16) and once with ATen's
# fused AdamW (DFLASH_OPTIM_FUSED=aten: the A/B of AdamW's kernels, opt ms), and the default once more
# (the run-to-run spread); the profiled step's idle gaps (bench/trace_gaps.py).
#   bash bench/gpu/fused.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh fused)
# targets: test_drafter_kernels_gpu test_ce_gpu test_optim_gpu test_attention test_drafter_gpu drafter_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
for t in drafter/test_drafter_kernels_gpu drafter/test_ce_gpu optim/test_optim_gpu attention/test_attention drafter/test_drafter_gpu; do
  n=$(basename "$t")
  timeout 60 "$BUILD/tests/$t" > "$OUT/$n.txt" 2>&1 || { rc=1; echo "FAILED: $n"; }
  grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|error' "$OUT/$n.txt" | head -40
done
step() {  # NAME ENV... -- drafter_bench args
  local name=$1; shift
  echo "## $name"
  env "$@" > "$OUT/$name.txt" 2>&1 || rc=1
  grep -h "^| [0-9]\|^steady\|^optimizer:\|failed" "$OUT/$name.txt"
  sed -n '/^profile of one step/,/^| top kernels/p' "$OUT/$name.txt"
}
B="$BUILD/bench/drafter_bench"
echo "| S | B | attention / loss | fwd ms | bwd ms | opt ms | step ms | draft pos/s | target tok/s | TFLOP/s | MFU | peak GiB |"
step fused_4x3072 timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --iters 5 --warmup 2 --profile \
  --profile-trace "$OUT/fused_4x3072.trace.json"
python3 bench/trace_gaps.py "$OUT/fused_4x3072.trace.json" --top 8 || rc=1
gzip -f "$OUT/fused_4x3072.trace.json"
step unfused_4x3072 DFLASH_DRAFTER_FUSED=0 DFLASH_CE_FUSED=0 timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 \
  --attention kernel --optimizer --iters 5 --warmup 2 --profile
step bf16_logits_4x3072 DFLASH_CE_LOGITS=bf16 timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel \
  --optimizer --iters 5 --warmup 2
step aten_adamw_4x3072 DFLASH_OPTIM_FUSED=aten timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel \
  --optimizer --iters 5 --warmup 2
step fused_4x3072_again timeout 100 "$B" --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --iters 5 \
  --warmup 2
step fused_1x40000 timeout 120 "$B" --seq 40000 --rows 1 --anchors 2048 --attention kernel --optimizer --iters 3 --warmup 1
exit $rc
