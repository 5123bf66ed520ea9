# shellcheck shell=bash
# The set-up shared by the bench/gpu/<area>.sh scripts that take BUILD_DIR OUT_DIR and keep a
# summary (eval.sh, pipeline.sh, startup.sh). Sourced, never run: it lives below bench/gpu/ so that
# run_all.sh (which runs every bench/gpu/*.sh) does not take it for an area.
#   source "$(dirname "$0")/lib/common.sh"
#   bench_setup NAME WORK_DEFAULT "$@"   BUILD, OUT (absolute; OUT created), ROOT (the checkout; the
#       working directory from then on), PY ($DFLASH_PYTHON or python3), WORK ($DFLASH_BENCH_WORK or
#       WORK_DEFAULT, created), SUMMARY (OUT/NAME_summary.txt, started with a header line), ngpu
#       (nvidia-smi's count); loopback MPI settings (tools/mpi_env.sh), NVLink multicast off.
#   bench_need_gpus N [WHY]                with fewer than N GPUs: "SKIP: WHY" in the summary, exit 0
#   bench_random_target_and_data           WORK/qwen3-8b (Qwen3-8B-shaped random bf16 target) unless
#       there already, and WORK/data/random-00000.dfshard (240 random documents of 3072 tokens)
#   bench_long_data                        WORK/data-long/long-00000.dfshard: 8 random documents of
#       40000 tokens (prompt 4000, mask 0), the long shape 1 x 40000 of issue 15; sets LONG_RUN, the
#       dflash_rank arguments of a 3-step colocated run on it (the random target, 2048 anchors)
#   gpu_watch_start NAME / gpu_watch_stop NAME   nvidia-smi samples every GPU's SM clock, power and
#       clock-event reasons every 50 ms into OUT/gpu_NAME.csv between the two; stop prints (and adds
#       to SUMMARY) one line per GPU from bench/gpu_watch.py: the clock and whether it was power-capped
#   bench_steady_s METRICS_JSONL           the mean interval_s of a run's steps 2.. (the steps after
#       the first), printed as seconds; nothing if there are none

bench_setup() {
  local name=$1 work_default=$2; shift 2
  BUILD=$(realpath "${1:?usage: $name.sh BUILD_DIR OUT_DIR}")
  OUT=${2:?usage: $name.sh BUILD_DIR OUT_DIR}
  mkdir -p "$OUT"; OUT=$(realpath "$OUT")
  ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)
  cd "$ROOT" || exit 1
  # shellcheck source=/dev/null
  source tools/mpi_env.sh
  export NCCL_NVLS_ENABLE=0
  PY=${DFLASH_PYTHON:-python3}
  WORK=${DFLASH_BENCH_WORK:-$work_default}
  mkdir -p "$WORK"
  SUMMARY=$OUT/${name}_summary.txt
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  echo "$name.sh: $(date -u +%FT%TZ) host $(hostname) GPUs ${ngpu:-0}" | tee "$SUMMARY"
}

bench_need_gpus() {
  if [ "${ngpu:-0}" -lt "$1" ]; then echo "SKIP: ${2:-no GPU}" | tee -a "$SUMMARY"; exit 0; fi
}

bench_random_target_and_data() {
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
}

bench_long_data() {
  "$PY" - "$WORK/data-long" <<'PYEOF'
import os, sys
import numpy as np
sys.path.insert(0, "tools")
import dflash_shard
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = np.random.default_rng(1)
docs = [(rng.integers(0, 151643, 40000), np.r_[np.zeros(4000, np.int64), np.ones(36000, np.int64)]) for _ in range(8)]
dflash_shard.write_shard(os.path.join(out, "long-00000.dfshard"), docs, 151936)
PYEOF
  # shellcheck disable=SC2034  # used by the sourcing script
  LONG_RUN=(--config configs/debug-2gpu.yaml layout.colocated=true target.model_dir="$WORK/qwen3-8b"
            "data.shards=[$WORK/data-long]" train.max_steps=3 log.interval=1 checkpoint.state_every=0
            checkpoint.export_every=0 comm.timeout_s=600 data.batch_tokens=40000 data.max_seq_len=40000
            drafter.num_anchors=2048)
}

bench_steady_s() {
  "$PY" - "$1" <<'PYEOF' 2>/dev/null
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
s = [r["interval_s"] for r in rows if r.get("step", 0) >= 2 and r.get("interval_s")]
if s:
    print(f"{sum(s) / len(s):.3f}")
PYEOF
}

gpu_watch_start() {
  GPU_WATCH_PID=
  command -v nvidia-smi > /dev/null || return 0
  nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_throttle_reasons.active \
    --format=csv,noheader,nounits -lms 50 > "$OUT/gpu_$1.csv" 2> /dev/null &
  GPU_WATCH_PID=$!
}

gpu_watch_stop() {
  [ -n "${GPU_WATCH_PID:-}" ] || return 0
  kill "$GPU_WATCH_PID" 2> /dev/null
  wait "$GPU_WATCH_PID" 2> /dev/null
  GPU_WATCH_PID=
  "$PY" bench/gpu_watch.py "$OUT/gpu_$1.csv" --label "$1" | tee -a "$SUMMARY"
}
