#!/usr/bin/env bash
# GPU run of the drafter evaluation (issue 12): DFlash speculative decoding vs plain greedy
# decoding on one H200 with a Qwen3-8B-shaped random target (tools/make_random_target.py or
# target_bench, 16 GB bf16) and a Qwen3-8B-shaped drafter (5 layers, block 16) exported by a short
# training run on random tokens; plus the training pipeline's tokens/s with the evaluation during
# training on vs off (same config, two runs, only eval.every differs).
#   1. pipeline, eval off:  50 steps (1 target + 1 drafter rank with 2 GPUs, else colocated)
#   2. pipeline, eval on:   the same with eval.every=10 on 16 held-out prompts x 64 new tokens
#   3. eval:                64 prompts (128 tokens) x 256 new tokens, batch 16 and batch 64,
#                           tau, wall time, speedup vs plain greedy, equal-output rate (bf16)
# Writes OUT_DIR/eval_summary.txt (commands and numbers), the eval JSON reports and metrics.
#   bash bench/gpu/eval.sh BUILD_DIR OUT_DIR               (about 10 minutes)
# targets: dflash_rank target_bench
set -uo pipefail
BUILD=$(realpath "${1:?usage: eval.sh BUILD_DIR OUT_DIR}")
OUT=${2:?usage: eval.sh BUILD_DIR OUT_DIR}
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
source tools/mpi_env.sh
export NCCL_NVLS_ENABLE=0
PY=${DFLASH_PYTHON:-python3}
WORK=${DFLASH_BENCH_WORK:-/tmp/dflash-eval-bench}
mkdir -p "$WORK"
SUMMARY=$OUT/eval_summary.txt
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
echo "eval.sh: $(date -u +%FT%TZ) host $(hostname) GPUs ${ngpu:-0}" | tee "$SUMMARY"
if [ "${ngpu:-0}" -lt 1 ]; then echo "SKIP: no GPU" | tee -a "$SUMMARY"; exit 0; fi

t0=$(date +%s)
if [ ! -f "$WORK/qwen3-8b/config.json" ]; then
  if [ -x "$BUILD/bench/target_bench" ]; then
    "$BUILD/bench/target_bench" write-checkpoint "$WORK/qwen3-8b" --shards 5 2>&1 | tail -2
  else
    timeout 600 "$PY" tools/make_random_target.py --out "$WORK/qwen3-8b" --preset qwen3-8b 2>&1 | tail -2
  fi
fi
"$PY" - "$WORK" <<'PYEOF'
import json, os, sys
import numpy as np
sys.path.insert(0, "tools")
import dflash_shard
work = sys.argv[1]
rng = np.random.default_rng(0)
os.makedirs(f"{work}/data", exist_ok=True)
docs = []
for _ in range(240):  # 240 x 3072 tokens: prompt 512 (mask 0), response 2560 (mask 1)
    ids = rng.integers(0, 151643, 3072)
    docs.append((ids, np.r_[np.zeros(512, np.int64), np.ones(2560, np.int64)]))
dflash_shard.write_shard(f"{work}/data/random-00000.dfshard", docs, 151936)
held = np.random.default_rng(1)  # other seed: held out
for name, n in (("prompts64", 64), ("prompts16", 16)):
    with open(f"{work}/{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "input_ids": held.integers(0, 151643, 128).tolist()}) + "\n")
PYEOF
echo "setup: $(( $(date +%s) - t0 )) s (random target, data, prompts)" | tee -a "$SUMMARY"

common=(target.model_dir="$WORK/qwen3-8b" "data.shards=[$WORK/data]" train.max_steps=50 log.interval=10
        checkpoint.state_every=0 checkpoint.export_every=0 comm.timeout_s=600)
if [ "$ngpu" -ge 2 ]; then launch=(mpirun -np 2 "$BUILD/trainer/dflash_rank"); layout=()
else launch=("$BUILD/trainer/dflash_rank"); layout=(layout.colocated=true); fi
rc=0
for mode in off on; do
  extra=(run.dir="$WORK/run_$mode")
  [ $mode = on ] && extra+=(eval.every=10 "eval.prompts=$WORK/prompts16.jsonl" eval.max_new_tokens=64 eval.batch_size=16)
  rm -rf "$WORK/run_$mode"
  cmd=("${launch[@]}" --config configs/debug-2gpu.yaml "${layout[@]}" "${common[@]}" "${extra[@]}")
  echo "pipeline eval $mode: ${cmd[*]}" | tee -a "$SUMMARY"
  timeout 1200 "${cmd[@]}" 2>&1 | tee "$OUT/eval_pipeline_$mode.log" | grep -E "step|eval|error|done"; r=${PIPESTATUS[0]}
  echo "exit: $r" | tee -a "$SUMMARY"; [ $r -ne 0 ] && rc=$r
  cp "$WORK/run_$mode/metrics.jsonl" "$OUT/eval_pipeline_${mode}_metrics.jsonl" 2>/dev/null
  [ -f "$WORK/run_$mode/eval.jsonl" ] && cp "$WORK/run_$mode/eval.jsonl" "$OUT/eval_pipeline_on_evals.jsonl"
done
"$PY" - "$OUT" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys
out = sys.argv[1]
def rows(mode):
    try:
        return [json.loads(l) for l in open(f"{out}/eval_pipeline_{mode}_metrics.jsonl")]
    except OSError:
        return []
res = {}
for mode in ("off", "on"):
    r = [x for x in rows(mode) if x["step"] > 10]  # after the first interval (start-up)
    if r:
        res[mode] = sum(x["drafter_tok_s"] for x in r) / len(r)
        print(f"pipeline eval {mode}: drafter tok/s {res[mode]:.0f} (mean of {len(r)} intervals after step 10); "
              f"last line tau_est {r[-1].get('tau_est')} tau {r[-1].get('tau')}@{r[-1].get('tau_step')} "
              f"eval_s {r[-1].get('eval_s')}")
if len(res) == 2:
    print(f"pipeline: eval on / off = {res['on'] / res['off']:.4f} (issue 12 asks for a difference below 5%)")
PYEOF

[ -d "$WORK/run_off/exports/final" ] || { echo "no drafter export from the eval-off run" | tee -a "$SUMMARY"; exit 1; }
for bs in 16 64; do
  cmd=("$BUILD/trainer/dflash_rank" eval --config configs/debug-2gpu.yaml target.model_dir="$WORK/qwen3-8b"
       eval.drafter_dir="$WORK/run_off/exports/final" "eval.prompts=$WORK/prompts64.jsonl" eval.max_new_tokens=256
       eval.batch_size=$bs eval.device=cuda:0 eval.out="$OUT/eval_b$bs.json" run.dir="$WORK/eval_b$bs")
  echo "eval batch $bs: ${cmd[*]}" | tee -a "$SUMMARY"
  timeout 1500 "${cmd[@]}" 2>&1 | tee "$OUT/eval_b$bs.log" | grep -E "eval|error"; r=${PIPESTATUS[0]}
  echo "exit: $r" | tee -a "$SUMMARY"; [ $r -ne 0 ] && rc=$r
  grep -E "eval: (64 prompts|accepted|speculative)" "$OUT/eval_b$bs.log" | tee -a "$SUMMARY"
done
exit $rc
