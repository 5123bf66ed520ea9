#!/usr/bin/env bash
# qwen3_moe and qwen3_5 targets on one H200: capture-forward speed of dflash (random bf16 weights
# at Qwen3-30B-A3B and Qwen3.5-9B shapes, only the layers the capture runs: 46 / 30) beside
# transformers' eager forward of the same truncated model, measured in the same run; MoE expert
# backends compared (grouped GEMM vs one GEMM per expert). Bar: dflash >= 1.2x transformers eager.
#   bash bench/gpu/target_family.sh BUILD_DIR OUT_DIR      (about 6 minutes; tables printed last)
# targets: target_family_bench test_deltanet_gpu
set -uo pipefail
BUILD=$1
OUT=$2
cd "$(dirname "$0")/../.." || exit 2
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SHAPES=${DFLASH_FAMILY_SHAPES:-8x2048,4x4096}   # DFLASH_FAMILY_CONFIGS: a subset of the two configs
rc=0
CONFIGS=${DFLASH_FAMILY_CONFIGS:-qwen3-30b-a3b qwen3.5-9b}
echo "--- GPU test: the fused Gated DeltaNet kernels and the recurrent rule against the ATen path (tests/model/test_deltanet_gpu)"
timeout 120 "$BUILD/tests/model/test_deltanet_gpu" > "$OUT/test_deltanet_gpu.txt" 2>&1 || rc=1
grep -E "^dk|^recurrent kernel|OK|FAILED|Failure|Expected" "$OUT/test_deltanet_gpu.txt"
for cfg in $CONFIGS; do
  echo "--- dflash $cfg ($SHAPES)"
  prof=(); [ $cfg = qwen3.5-9b ] && prof=(--profile)
  timeout 200 "$BUILD/bench/target_family_bench" --config $cfg --shapes $SHAPES --iters 5 "${prof[@]}" \
    --json "$OUT/dflash_$cfg.json" > "$OUT/dflash_$cfg.txt" 2>&1 || rc=1
  cat "$OUT/dflash_$cfg.txt"
  if [ $cfg = qwen3-30b-a3b ]; then
    echo "--- dflash $cfg, experts as one GEMM per expert (DFLASH_TARGET_MOE=loop)"
    DFLASH_TARGET_MOE=loop timeout 200 "$BUILD/bench/target_family_bench" --config $cfg --shapes 8x2048 --iters 3 \
      > "$OUT/dflash_${cfg}_loop.txt" 2>&1; tail -2 "$OUT/dflash_${cfg}_loop.txt"
  fi
  variants=()
  if [ $cfg = qwen3.5-9b ]; then
    # The rule's other settings (trainer/model/target_deltanet.h; the default on CUDA is the
    # recurrent kernel with the fused data movement), each a row of the table below beside
    # transformers: the chunked form fused and unfused (the default before 2026-12-01), the
    # recurrent kernel unfused, chunks of 128.
    # (DFLASH_TARGET_DELTANET=trsm, the oracle, measured 770.5 ms at 0bdb040: bench/RESULTS.md.)
    for v in "chunked:DFLASH_TARGET_DELTANET=inverse DFLASH_TARGET_DELTANET_FUSED=0" \
             "chunked+fused:DFLASH_TARGET_DELTANET=inverse" \
             "recurrent-unfused:DFLASH_TARGET_DELTANET_FUSED=0" \
             "chunk128:DFLASH_TARGET_DELTANET=inverse DFLASH_TARGET_DELTANET_CHUNK=128"; do
      label=${v%%:*}; envs=${v#*:}
      echo "--- dflash $cfg, $label ($envs)"
      prof=(); [ "$label" = chunked ] && prof=(--profile)
      # shellcheck disable=SC2086  # envs: several VAR=value words
      env $envs timeout 200 "$BUILD/bench/target_family_bench" --config $cfg --shapes 8x2048 --iters 3 "${prof[@]}" \
        --json "$OUT/dflash_${cfg}_$label.json" > "$OUT/dflash_${cfg}_$label.txt" 2>&1
      if [ ${#prof[@]} -gt 0 ]; then sed -n '/profile/,$p' "$OUT/dflash_${cfg}_$label.txt"; else tail -2 "$OUT/dflash_${cfg}_$label.txt"; fi
      variants+=(--dflash-json "$label=$OUT/dflash_${cfg}_$label.json")
    done
  fi
  echo "--- transformers $cfg"
  timeout 300 python3 bench/target_family_bench_hf.py --config $cfg --shapes $SHAPES --iters 5 \
    --json "$OUT/hf_$cfg.json" --dflash-json "$OUT/dflash_$cfg.json" "${variants[@]}" > "$OUT/hf_$cfg.txt" 2>&1 || rc=1
done
echo "--- tables"
for cfg in $CONFIGS; do
  sed -n '/^qwen3/,$p' "$OUT/hf_$cfg.txt" 2>/dev/null || tail -5 "$OUT/hf_$cfg.txt"
done
exit $rc
