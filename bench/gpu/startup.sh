#!/usr/bin/env bash
# GPU check of the start-up of a training run without MPI (issue 11): 2 ranks (1 target + 1
# drafter, NCCL) started torchrun-style (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, one
# process per GPU, no mpirun) on the demo's tiny target and random documents.
#   1. success: 10 steps; the start-up agreement and the NCCL rendezvous share one c10d store
#      (comm/store.h startup_store), so this is the path the CPU tests cannot take;
#   2. failure: rank 1 gets a target.model_dir that does not exist: both ranks exit 2 within
#      comm.startup_timeout_s, rank 0 naming rank 1 and the missing file.
# Writes OUT_DIR/startup_summary.txt (PASS/FAIL per case) and the logs.
#   bash bench/gpu/startup.sh BUILD_DIR OUT_DIR                    (under a minute)
# targets: dflash_rank
set -uo pipefail
BUILD=$(realpath "${1:?usage: startup.sh BUILD_DIR OUT_DIR}")
OUT=${2:?usage: startup.sh BUILD_DIR OUT_DIR}
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
export NCCL_NVLS_ENABLE=0
PY=${DFLASH_PYTHON:-python3}
WORK=${DFLASH_BENCH_WORK:-/tmp/dflash-startup-bench}
rm -rf "$WORK"; mkdir -p "$WORK"
SUMMARY=$OUT/startup_summary.txt
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "startup.sh: $(date -u +%FT%TZ) host $(hostname) GPUs ${ngpu:-0}" | tee "$SUMMARY"
if [ "${ngpu:-0}" -lt 2 ]; then echo "SKIP: needs 2 GPUs" | tee -a "$SUMMARY"; exit 0; fi

"$PY" - "$WORK" <<'PYEOF'
import os, sys
import numpy as np
sys.path.insert(0, "tools")
import dflash_shard, make_tiny_target
work = sys.argv[1]
make_tiny_target.make(os.path.join(work, "target"), seed=0)
rng = np.random.default_rng(0)
docs = [(rng.integers(1, 500, 48).tolist(), [0] * 8 + [1] * 40) for _ in range(64)]
dflash_shard.write_shard(os.path.join(work, "data.dfshard"), docs, 512)
PYEOF

# run NAME [key=value for rank 1 ...]: both ranks torchrun-style; waits for both
run() {
  local name=$1; shift
  local port=$(( 20000 + RANDOM % 20000 )) t0=$(date +%s) pids=()
  for r in 0 1; do
    local extra=(); [ "$r" = 1 ] && extra=("$@")
    env RANK=$r LOCAL_RANK=$r WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      timeout 300 "$BUILD/trainer/dflash_rank" --config configs/demo.yaml comm.backend=nccl \
      layout.target_ranks=1 layout.drafter_ranks=1 target.model_dir="$WORK/target" \
      "data.shards=[$WORK/data.dfshard]" data.batch_tokens=384 train.max_steps=10 log.interval=5 \
      log.console_rank=-1 run.dir="$WORK/run-$name" comm.startup_timeout_s=60 "${extra[@]}" \
      > "$OUT/startup_${name}_rank$r.log" 2>&1 &
    pids+=($!)
  done
  RC0=0; RC1=0
  wait "${pids[0]}" || RC0=$?
  wait "${pids[1]}" || RC1=$?
  SECS=$(( $(date +%s) - t0 ))
}

run ok
if [ "$RC0" = 0 ] && [ "$RC1" = 0 ] && grep -q "training done: 10 steps" "$OUT/startup_ok_rank1.log"; then
  echo "PASS success: both ranks 0, 10 steps in ${SECS} s (agreement + NCCL over one store)" | tee -a "$SUMMARY"
else
  echo "FAIL success: exit codes $RC0 $RC1" | tee -a "$SUMMARY"; tail -5 "$OUT"/startup_ok_rank*.log | tee -a "$SUMMARY"
fi

run bad target.model_dir="$WORK/no-such-model"
if [ "$RC0" = 2 ] && [ "$RC1" = 2 ] && [ "$SECS" -lt 60 ] &&
   grep -q "rank 1 (drafter 0) could not start: .*no-such-model" "$OUT/startup_bad_rank0.log" &&
   grep -q "error: .*no-such-model" "$OUT/startup_bad_rank1.log"; then
  echo "PASS failure: both ranks exit 2 in ${SECS} s, rank 0 names rank 1 and the file" | tee -a "$SUMMARY"
else
  echo "FAIL failure: exit codes $RC0 $RC1 after ${SECS} s" | tee -a "$SUMMARY"; tail -3 "$OUT"/startup_bad_rank*.log | tee -a "$SUMMARY"
fi
! grep -q FAIL "$SUMMARY"
