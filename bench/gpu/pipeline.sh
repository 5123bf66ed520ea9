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
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup pipeline /tmp/dflash-pipeline-bench "$@"
bench_need_gpus 1

t0=$(date +%s)
bench_random_target_and_data
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
exit "$rc"
