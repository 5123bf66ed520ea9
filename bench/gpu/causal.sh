#!/usr/bin/env bash
# The target's packed causal attention on one GPU (about 1 minute): the attention kernel's GPU
# tests (its causal mode for packed documents against fp32 and FlashAttention-2, the DFlash
# mask), the attention alone (flash, the kernel's causal mode, cuDNN) at
# the capture shapes, and the capture forward with the default backend (the kernel on Hopper) and with DFLASH_TARGET_ATTENTION=flash in the same run, each with its per-op
# breakdown.
#   bash bench/gpu/causal.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh causal)
# targets: test_attention target_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
echo "## test_attention"
timeout 120 "$BUILD/tests/attention/test_attention" > "$OUT/test_attention.txt" 2>&1 || { rc=1; echo "FAILED: test_attention"; }
grep -E '^\[ *(FAILED|PASSED|SKIPPED) |Failure|Expected|Which is|error' "$OUT/test_attention.txt" | head -40
grep -E '^\[(one_doc|tile_edges|tiny_docs|d64_unaligned|qwen3_heads)' "$OUT/test_attention.txt"
echo "## attention alone"
timeout 60 "$BUILD/bench/target_bench" attention --shapes 8x2048,4x4096,1x16384 --iters 10 > "$OUT/attention.txt" 2>&1 || rc=1
cat "$OUT/attention.txt"
fwd() {  # NAME SHAPES ENV...: the capture forward with its per-op breakdown (at the first shape)
  local name=$1 shapes=$2; shift 2
  echo "## capture forward, $name"
  env "$@" timeout 90 "$BUILD/bench/target_bench" forward --shapes "$shapes" --iters 6 \
    --json "$OUT/forward_$name.json" > "$OUT/forward_$name.txt" 2>&1 || rc=1
  grep -v "^\[" "$OUT/forward_$name.txt" | tail -22
}
fwd default 8x2048,4x4096 DFLASH_TARGET_ATTENTION=auto
fwd flash 8x2048,4x4096 DFLASH_TARGET_ATTENTION=flash
exit $rc
