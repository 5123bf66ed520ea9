#!/usr/bin/env bash
# The training pipeline on a 2-GPU machine: 1 target rank + 1 drafter rank, a Qwen3-8B-shaped
# target with random bf16 weights, real drafter shapes (configs/debug-2gpu.yaml), synthetic
# shards of 3072-token samples, 50 optimizer steps. The metrics lines (tokens/s per role, wait
# times, MFU, memory) and the time to the first step are printed last.
#   bash bench/gpu/pipeline.sh BUILD_DIR OUT_DIR        (about 2 minutes)
# targets: dflash_rank target_bench
set -uo pipefail
BUILD=${1:?BUILD_DIR}
OUT=${2:?OUT_DIR}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
CKPT=${DFLASH_PIPELINE_CKPT:-/tmp/dflash-pipeline-qwen3-8b}
DATA=/tmp/dflash-pipeline-data
RUN=/tmp/dflash-pipeline-run
t0=$(date +%s)
step() { echo "--- $1 ($(( $(date +%s) - t0 )) s)"; }

step "random Qwen3-8B-shaped target"
[ -f "$CKPT/config.json" ] || "$BUILD/bench/target_bench" write-checkpoint "$CKPT" --shards 5 > "$OUT/write.txt" 2>&1 ||
  { tail -5 "$OUT/write.txt"; exit 1; }

step "synthetic shards: 320 samples of 3072 tokens (prompt 1024 unsupervised, 2048 supervised)"
rm -rf "$DATA"; mkdir -p "$DATA"
python3 - "$DATA" <<'PY' || exit 1
import sys, numpy as np
sys.path.insert(0, "tools")
from dflash_shard import write_shard
rng = np.random.default_rng(0)
docs = []
for _ in range(320):
    ids = rng.integers(0, 151643, size=3072)
    mask = np.zeros(3072, dtype=np.uint8); mask[1024:] = 1
    docs.append((ids, mask))
write_shard(sys.argv[1] + "/synthetic-000.dfshard", docs, vocab_size=151936)
PY

step "mpirun -np 2: 1 target + 1 drafter, 50 steps"
rm -rf "$RUN"
cmd=(mpirun -np 2 --bind-to none "$BUILD/trainer/dflash_rank" --config configs/debug-2gpu.yaml
     target.model_dir="$CKPT" "data.shards=[$DATA]" run.dir="$RUN" train.max_steps=50 log.interval=5
     checkpoint.export_every=50 checkpoint.state_every=1000)
echo "${cmd[*]}"
timeout 240 "${cmd[@]}" 2>&1 | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
cp "$RUN/metrics.jsonl" "$OUT/" 2>/dev/null
ls -la "$RUN" "$RUN"/* 2>/dev/null | head -20
step "done rc=$rc"
exit $rc
