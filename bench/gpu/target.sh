#!/usr/bin/env bash
# Target model on one H200: GPU correctness against transformers, capture-forward speed
# (dflash vs transformers eager and compiled), checkpoint load time vs file read time.
#   bash bench/gpu/target.sh BUILD_DIR OUT_DIR      (about 4 minutes)
# targets: target_bench target_tool
set -uo pipefail
BUILD=$1
OUT=$2
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
CKPT=${DFLASH_TARGET_CKPT_DIR:-/tmp/dflash-qwen3-8b-random}
export PYTHONUNBUFFERED=1
rc=0
t0=$(date +%s)
step() { echo "--- $1 ($(( $(date +%s) - t0 )) s)"; }

step "dflash capture forward"
"$BUILD/bench/target_bench" forward --json "$OUT/dflash_forward.json" 2>&1 | tee "$OUT/dflash_forward.txt" || rc=1

step "dflash capture forward with cuDNN attention (candidate backend)"
DFLASH_TARGET_ATTENTION=cudnn timeout 90 "$BUILD/bench/target_bench" forward --shapes 8x2048 --iters 4 \
  2>&1 | tee "$OUT/dflash_forward_cudnn.txt"

step "write a Qwen3-8B-sized checkpoint (random bf16, 5 shards)"
rm -rf "$CKPT"
"$BUILD/bench/target_bench" write-checkpoint "$CKPT" --shards 5 2>&1 | tee "$OUT/write.txt" || rc=1

step "load time vs read time"
"$BUILD/bench/target_bench" load "$CKPT" --json "$OUT/load.json" 2>&1 | tee "$OUT/load.txt" || rc=1

step "GPU correctness vs transformers"
DFLASH_BUILD_DIR="$BUILD" DFLASH_TARGET_GPU_CKPT="$CKPT" timeout 200 \
  python3 -m pytest -q -s tests/model/test_target_gpu.py 2>&1 | tee "$OUT/gpu_test.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

step "transformers reference (eager, torch.compile)"
timeout 200 python3 bench/target_bench_hf.py --json "$OUT/hf_forward.json" \
  --dflash-json "$OUT/dflash_forward.json" 2>&1 | tee "$OUT/hf_forward.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
rm -rf "$CKPT"

step "tables"
echo "== GPU correctness (rel err = max|a-b|/max|b| per captured layer)"
grep -E "^ *(layer|[0-9]+ )" "$OUT/gpu_test.txt" | head -8
grep -E "passed|failed|error" "$OUT/gpu_test.txt" | tail -2
echo "== dflash per-op breakdown (flash) and the cuDNN candidate"
sed -n '/^breakdown/,$p' "$OUT/dflash_forward.txt"
grep -E "^8x2048" "$OUT/dflash_forward_cudnn.txt" | sed 's/^/cudnn backend: /'
echo "== load (Qwen3-8B-sized, 5 shards)"
tail -3 "$OUT/load.txt"
echo "== capture forward (Qwen3-8B shapes, ids 1,9,17,25,33 -> 34 layers run)"
sed -n '/^implementation/,$p' "$OUT/hf_forward.txt"
[ -s "$OUT/hf_forward.txt" ] || tail -4 "$OUT/dflash_forward.txt"
exit $rc
