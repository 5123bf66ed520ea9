#!/usr/bin/env bash
# Target model on one H200: capture-forward speed (dflash, per-op breakdown, transformers eager
# and compiled), checkpoint load time vs file read time, GPU correctness against transformers.
#   bash bench/gpu/target.sh BUILD_DIR OUT_DIR      (about 2.5 minutes; tables printed last)
# targets: target_bench target_tool
set -uo pipefail
BUILD=$1
OUT=$2
cd "$(dirname "$0")/../.." || exit 1
mkdir -p "$OUT"
CKPT=${DFLASH_TARGET_CKPT_DIR:-/tmp/dflash-qwen3-8b-random}
BUDGET=${DFLASH_TARGET_BUDGET_S:-145}   # whole script, seconds
export PYTHONUNBUFFERED=1
rc=0
t0=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - t0) )); }
# step NAME CAP: prints the step; sets T to min(CAP, time left), 0 if none is left.
step() {
  T=$(left); [ "$T" -gt "$2" ] && T=$2
  echo "--- $1 (at $(( $(date +%s) - t0 )) s, up to ${T} s)"
  [ "$T" -gt 5 ] || { echo "skipped: out of time"; T=0; }
}

step "dflash capture forward (8x2048, 4x4096) + per-op breakdown" 35
[ $T -gt 0 ] && { timeout $T "$BUILD/bench/target_bench" forward --iters 5 --json "$OUT/dflash_forward.json" \
  > "$OUT/dflash_forward.txt" 2>&1 || rc=1; tail -25 "$OUT/dflash_forward.txt"; }

step "attention backends (flash vs cuDNN candidate; an experiment, never fails the script)" 15
[ $T -gt 0 ] && { timeout $T "$BUILD/bench/target_bench" attention --shapes 8x2048 --iters 5 \
  > "$OUT/attention.txt" 2>&1; cat "$OUT/attention.txt"; }

step "write a Qwen3-8B-sized checkpoint (random bf16, 5 shards)" 40
rm -rf "$CKPT"
[ $T -gt 0 ] && { timeout $T "$BUILD/bench/target_bench" write-checkpoint "$CKPT" --shards 5 2>&1 | tee "$OUT/write.txt"; }

step "load time vs read time (files in the page cache)" 20
[ $T -gt 0 ] && { timeout $T "$BUILD/bench/target_bench" load "$CKPT" --cache warm --json "$OUT/load.json" \
  2>&1 | tee "$OUT/load.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1; }

step "GPU correctness vs transformers (Qwen3-8B bf16; tiny fp32 incl. generation)" 60
[ $T -gt 0 ] && { DFLASH_BUILD_DIR="$BUILD" DFLASH_TARGET_GPU_CKPT="$CKPT" timeout $T \
  python3 -m pytest -q -s -p no:cacheprovider tests/model/test_target_gpu.py > "$OUT/gpu_test.txt" 2>&1 || rc=1; }
rm -rf "$CKPT"

step "transformers reference (eager both shapes, torch.compile 8x2048)" 100
[ $T -gt 0 ] && { timeout $T python3 bench/target_bench_hf.py --iters 5 --json "$OUT/hf_forward.json" \
  --dflash-json "$OUT/dflash_forward.json" > "$OUT/hf_forward.txt" 2>&1 || rc=1; }

echo "--- tables (at $(( $(date +%s) - t0 )) s)"
echo "== GPU correctness (fro = ||a-b||/||b||, maxn = max|a-b|/max|b|, per captured layer)"
grep -E "^ *(layer|[0-9]+ )" "$OUT/gpu_test.txt" | head -8
grep -E "passed|failed|rror" "$OUT/gpu_test.txt" | tail -3
echo "== attention backends"
tail -2 "$OUT/attention.txt" 2>/dev/null
echo "== load (Qwen3-8B-sized, 5 shards)"
tail -2 "$OUT/load.txt" 2>/dev/null
echo "== capture forward (Qwen3-8B shapes, ids 1,9,17,25,33 -> 34 layers run)"
if grep -q "^implementation" "$OUT/hf_forward.txt" 2>/dev/null; then
  # the last combined table (the script prints one after eager and one after compile)
  awk '/^MFU below/{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}' "$OUT/hf_forward.txt" | grep -v -i warn
else
  tail -5 "$OUT/hf_forward.txt" 2>/dev/null
  grep -A3 "^shape" "$OUT/dflash_forward.txt"
fi
exit $rc
