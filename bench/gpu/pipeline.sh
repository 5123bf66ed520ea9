#!/usr/bin/env bash
# GPU run of the training pipeline (issue 5): 1 target rank + 1 drafter rank (2 GPUs, NCCL) with a
# Qwen3-8B-shaped random target (tools/make_random_target.py, 16 GB bf16) and the real drafter
# shapes of configs/debug-2gpu.yaml (5 layers, block 16, 512 anchors per document), 50 steps on
# random token documents of 3072 tokens. With one GPU it runs the colocated mode instead.
# Prints the metrics lines (tokens/s per role, wait times, MFU, memory) and writes
# OUT_DIR/pipeline_summary.txt with the command and the last metrics line.
#   bash bench/gpu/pipeline.sh BUILD_DIR OUT_DIR          (about 2-3 minutes with target_bench)
# targets: dflash_rank target_bench
set -uo pipefail
BUILD=$(realpath "${1:?usage: pipeline.sh BUILD_DIR OUT_DIR}")
OUT=${2:?usage: pipeline.sh BUILD_DIR OUT_DIR}
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
source tools/mpi_env.sh
export NCCL_NVLS_ENABLE=0
PY=${DFLASH_PYTHON:-python3}
WORK=${DFLASH_BENCH_WORK:-/tmp/dflash-pipeline-bench}
mkdir -p "$WORK"
SUMMARY=$OUT/pipeline_summary.txt
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "pipeline.sh: $(date -u +%FT%TZ) host $(hostname) GPUs ${ngpu:-0}" | tee "$SUMMARY"
if [ "${ngpu:-0}" -lt 1 ]; then echo "SKIP: no GPU" | tee -a "$SUMMARY"; exit 0; fi

t0=$(date +%s)
# The random target: target_bench writes it fastest (C++, 5 shards); the Python tool otherwise.
if [ ! -f "$WORK/qwen3-8b/config.json" ]; then
  if [ -x "$BUILD/bench/target_bench" ]; then
    "$BUILD/bench/target_bench" write-checkpoint "$WORK/qwen3-8b" --shards 5 2>&1 | tail -2
  else
    timeout 600 "$PY" tools/make_random_target.py --out "$WORK/qwen3-8b" --preset qwen3-8b 2>&1 | tail -2
  fi
fi
"$PY" - "$WORK/data" <<'PYEOF'
import os, sys
import numpy as np
sys.path.insert(0, "tools")
import dflash_shard
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(0)
docs = []
for _ in range(240):  # 240 x 3072 tokens: prompt 512 (mask 0), response 2560 (mask 1)
    ids = rng.integers(0, 151643, 3072)
    docs.append((ids, np.r_[np.zeros(512, np.int64), np.ones(2560, np.int64)]))
dflash_shard.write_shard(os.path.join(out, "random-00000.dfshard"), docs, 151936)
PYEOF
echo "setup: $(( $(date +%s) - t0 )) s (random target + data)" | tee -a "$SUMMARY"

common=(target.model_dir="$WORK/qwen3-8b" "data.shards=[$WORK/data]" train.max_steps=50 log.interval=10
        run.dir="$WORK/run" checkpoint.state_every=0 checkpoint.export_every=0 comm.timeout_s=600)
rm -rf "$WORK/run"
if [ "$ngpu" -ge 2 ]; then
  cmd=(mpirun -np 2 "$BUILD/trainer/dflash_rank" --config configs/debug-2gpu.yaml "${common[@]}")
else
  cmd=("$BUILD/trainer/dflash_rank" --config configs/debug-2gpu.yaml layout.colocated=true "${common[@]}")
fi
echo "command: ${cmd[*]}" | tee -a "$SUMMARY"
timeout 900 "${cmd[@]}" 2>&1 | tee "$OUT/pipeline_run.log" | grep -E "step|plan|loaded|ready|error|done" ; rc=${PIPESTATUS[0]}
echo "exit: $rc" | tee -a "$SUMMARY"
grep -E "^\[dflash r[0-9]+/[0-9]+ (drafter|colocated)\] step 50/" "$OUT/pipeline_run.log" | tail -1 | tee -a "$SUMMARY"
[ -f "$WORK/run/metrics.jsonl" ] && cp "$WORK/run/metrics.jsonl" "$OUT/pipeline_metrics.jsonl"
exit $rc
