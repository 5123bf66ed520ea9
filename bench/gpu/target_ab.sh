#!/usr/bin/env bash
# Target capture forward (Qwen3-8B shapes, random bf16) with and without one environment setting,
# alternated twice in the same run, each with its per-op breakdown of one layer: the A/B of a
# change that keeps its old path behind a switch.
#   DFLASH_AB_ENV="NAME=VALUE" bash bench/gpu/target_ab.sh BUILD_DIR OUT_DIR   (about 1.5 minutes)
#   default setting: DFLASH_QK_ROPE_UNPAIRED=1 (the q/k norm + RoPE kernel one element per access)
# targets: target_bench
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup target_ab /tmp/dflash-target-ab "$@"   # BUILD, OUT, PY; the checkout as working directory
AB=${DFLASH_AB_ENV:-DFLASH_QK_ROPE_UNPAIRED=1}
rc=0
for round in 1 2; do
  for side in A B; do
    if [ $side = A ]; then envs=(); label=default; else envs=("$AB"); label="$AB"; fi
    echo "--- capture forward, $label (round $round)"
    env "${envs[@]}" timeout 90 "$BUILD/bench/target_bench" forward --shapes 8x2048,4x4096 --iters 7 \
      > "$OUT/forward_${side}_r$round.txt" 2>&1 || rc=1
    grep -A3 "^shape " "$OUT/forward_${side}_r$round.txt"
    [ $round = 1 ] && sed -n '/^breakdown/,$p' "$OUT/forward_${side}_r$round.txt"
  done
done
exit $rc
