#!/usr/bin/env bash
# GPU run of the drafter evaluation (issue 12): DFlash speculative decoding vs plain greedy
# decoding on one H200 with a Qwen3-8B-shaped random target (tools/make_random_target.py or
# target_bench, 16 GB bf16) and a Qwen3-8B-shaped drafter (5 layers, block 16) exported by a short
# training run on random tokens; plus the training pipeline's tokens/s with the evaluation during
# training on vs off (same config, two runs, only eval.every and eval.prompts differ).
#   1. pipeline, eval off:  STEPS steps (1 target + 1 drafter rank with 2 GPUs, else colocated)
#   2. pipeline, eval on:   the same with eval.every=EVERY on held-out prompts (by default the first
#                           16 x 128 new tokens, one batch: see TRAIN_PROMPTS below). eval.every has
#                           no default (0: off), so the bench states the one it uses and prints
#                           what each eval costs and the interval that keeps that cost under 5% of
#                           the training time.
#      Tokens/s of a run = all training tokens / (training wall time + the final eval), the evals
#      in between included (metrics.jsonl: tokens of an interval = drafter_tok_s x its seconds).
#   3. eval:                64 prompts (128 tokens) x 256 new tokens, batch 16 and batch 64,
#                           tau, wall time, speedup vs plain greedy, equal-output rate (bf16),
#                           on each engine of DFLASH_EVAL_ENGINES (default "cache fixed")
# Writes OUT_DIR/eval_summary.txt (commands and numbers), the eval JSON reports and metrics.
#   bash bench/gpu/eval.sh BUILD_DIR OUT_DIR     (about 11 minutes; DFLASH_EVAL_STANDALONE=0: about 8)
#   DFLASH_EVAL_STEPS (default 200), DFLASH_EVAL_EVERY (default 100): the pipeline runs' length and
#   eval interval; DFLASH_EVAL_TRAIN_PROMPTS (16; 0: all) and DFLASH_EVAL_TRAIN_NEW (128): the size
#   of the eval during training; DFLASH_EVAL_STANDALONE=0: skip step 3.
# targets: dflash_rank target_bench
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup eval /tmp/dflash-eval-bench "$@"
bench_need_gpus 1

t0=$(date +%s)
bench_random_target_and_data
"$PY" - "$WORK" <<'PYEOF'
import json, sys
import numpy as np
work = sys.argv[1]
held = np.random.default_rng(1)  # another seed than the documents': held out
for name, n in (("prompts64", 64), ("prompts16", 16)):
    with open(f"{work}/{name}.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"id": i, "input_ids": held.integers(0, 151643, 128).tolist()}) + "\n")
PYEOF
echo "setup: $(( $(date +%s) - t0 )) s (random target, data, prompts)" | tee -a "$SUMMARY"

STEPS=${DFLASH_EVAL_STEPS:-200}
EVERY=${DFLASH_EVAL_EVERY:-100}
# The eval during training: the first TRAIN_PROMPTS held-out prompts x TRAIN_NEW new tokens (one
# batch of 16; 0: the product's defaults, all 64 prompts x 256 tokens, an estimated ~36 s per eval with a
# random target whose drafter never agrees, which no interval of a bench-length run amortises).
TRAIN_PROMPTS=${DFLASH_EVAL_TRAIN_PROMPTS:-16}
TRAIN_NEW=${DFLASH_EVAL_TRAIN_NEW:-128}
common=(target.model_dir="$WORK/qwen3-8b" "data.shards=[$WORK/data]" "train.max_steps=$STEPS" log.interval=5
        checkpoint.state_every=0 checkpoint.export_every=0 comm.timeout_s=600)
if [ "$ngpu" -ge 2 ]; then launch=(mpirun -np 2 "$BUILD/trainer/dflash_rank"); layout=(); lname="1 target + 1 drafter rank"
else launch=("$BUILD/trainer/dflash_rank"); layout=(layout.colocated=true); lname="colocated (1 GPU)"; fi
echo "pipeline: $lname, $STEPS steps; eval on: eval.every=$EVERY, held-out prompts: $([ "$TRAIN_PROMPTS" -gt 0 ] &&
     echo "the first $TRAIN_PROMPTS x $TRAIN_NEW new tokens" || echo "all 64 x 256 new tokens (the defaults)"), eval.batch_size 16" |
  tee -a "$SUMMARY"
rc=0
for mode in off on; do
  extra=(run.dir="$WORK/run_$mode")
  [ $mode = on ] && extra+=("eval.every=$EVERY" "eval.prompts=$WORK/prompts64.jsonl")
  [ $mode = on ] && [ "$TRAIN_PROMPTS" -gt 0 ] && extra+=("eval.max_prompts=$TRAIN_PROMPTS" "eval.max_new_tokens=$TRAIN_NEW")
  rm -rf "$WORK/run_$mode"
  cmd=("${launch[@]}" --config configs/debug-2gpu.yaml "${layout[@]}" "${common[@]}" "${extra[@]}")
  echo "pipeline eval $mode: ${cmd[*]}" | tee -a "$SUMMARY"
  t_start=$(date +%s%N)
  timeout 1200 "${cmd[@]}" 2>&1 | tee "$OUT/eval_pipeline_$mode.log" | grep -E "step|eval|error|done"; r=${PIPESTATUS[0]}
  echo "$(( ($(date +%s%N) - t_start) / 1000000 ))" > "$OUT/eval_pipeline_${mode}_process_ms.txt"
  echo "exit: $r" | tee -a "$SUMMARY"; [ "$r" -ne 0 ] && rc=$r
  cp "$WORK/run_$mode/metrics.jsonl" "$OUT/eval_pipeline_${mode}_metrics.jsonl" 2>/dev/null
  [ -f "$WORK/run_$mode/eval.jsonl" ] && cp "$WORK/run_$mode/eval.jsonl" "$OUT/eval_pipeline_on_evals.jsonl"
done
grep -hE "eval during training:|waited .* at the rendezvous|not done in the target's spare time" \
  "$OUT/eval_pipeline_on.log" | sed 's/^/  /' | tee -a "$SUMMARY"
size=$([ "$TRAIN_PROMPTS" -gt 0 ] && echo "$TRAIN_PROMPTS prompts x $TRAIN_NEW tokens" || echo "64 prompts x 256 tokens")
"$PY" - "$OUT" "$EVERY" "$size" <<'PYEOF' | tee -a "$SUMMARY"
import json, re, sys
out, every, size = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rows(name):
    try:
        return [json.loads(l) for l in open(f"{out}/{name}")]
    except OSError:
        return []
evals = rows("eval_pipeline_on_evals.jsonl")
res = {}
for mode in ("off", "on"):
    m = rows(f"eval_pipeline_{mode}_metrics.jsonl")
    if not m:
        continue
    # tokens of an interval = drafter_tok_s x its wall seconds (elapsed_s is cumulative)
    prev, tokens = 0.0, 0.0
    for x in m:
        tokens += x["drafter_tok_s"] * (x["elapsed_s"] - prev)
        prev = x["elapsed_s"]
    last = m[-1]["step"]
    # After the last metrics line: drafter rank 0's wait at the last rendezvous (an earlier eval
    # not finished in the target's spare time) and the final eval.
    final = [e["eval_s"] for e in evals if e["step"] == last] if mode == "on" else []
    waits = []
    if mode == "on":
        for line in open(f"{out}/eval_pipeline_on.log", errors="replace"):
            mm = re.search(r"waited ([\d.]+) s at the rendezvous of step (\d+)", line)
            if mm and int(mm.group(2)) == last:
                waits.append(float(mm.group(1)))
    wall = m[-1]["elapsed_s"] + sum(final) + sum(waits)
    try:
        proc = float(open(f"{out}/eval_pipeline_{mode}_process_ms.txt").read()) / 1000
    except (OSError, ValueError):
        proc = float("nan")
    res[mode] = (tokens / wall, wall, last, tokens / proc)
    print(f"pipeline eval {mode}: {tokens:.0f} training tokens in {wall:.1f} s"
          f"{' (final eval and last rendezvous included)' if final else ''}: {tokens / wall:.0f} tok/s; "
          f"whole process {proc:.1f} s (load and start-up included); "
          f"last line tau_est {m[-1].get('tau_est')} tau {m[-1].get('tau')}@{m[-1].get('tau_step')}")
for e in evals:
    print(f"  eval at step {e['step']}: eval_s {e['eval_s']:.2f} s (spread over {e.get('eval_span_s', e['eval_s']):.2f} s), "
          f"tau {e['tau']:.3f}, {e['generated_tokens']} tokens")
if len(res) == 2:
    ratio = res["on"][0] / res["off"][0]
    print(f"pipeline: tok/s eval on / off = {ratio:.4f} at eval.every={every} "
          f"(issue 12 bar: >= 0.95; {len(evals)} evals of {size} in {res['on'][2]} steps); "
          f"whole processes: {res['on'][3] / res['off'][3]:.4f}")
    step_s = res["off"][1] / res["off"][2]
    cost = sorted(e["eval_s"] for e in evals)[len(evals) // 2] if evals else 0  # median eval cost
    if cost > 0:
        print(f"  one eval costs {cost:.1f} s = {cost / step_s:.1f} training steps of {step_s:.2f} s (eval off); "
              f"if it pauses training (colocated) the ratio is 1 / (1 + {cost / step_s:.1f} / eval.every): "
              f"{1 / (1 + cost / step_s / every):.3f} at {every}, >= 0.95 from eval.every = "
              f"{int(19 * cost / step_s) + 1}; on a target rank it runs in the spare time instead")
PYEOF

# DFLASH_EVAL_STANDALONE=0: the pipeline comparison only (the standalone eval below was measured
# at d5bc3b4, bench/RESULTS.md)
[ "${DFLASH_EVAL_STANDALONE:-1}" = 0 ] && exit "$rc"
[ -d "$WORK/run_off/exports/final" ] || { echo "no drafter export from the eval-off run" | tee -a "$SUMMARY"; exit 1; }
# Both engines of docs/eval.md "Engines" (DFLASH_EVAL_ENGINES, default "cache fixed"): the same
# prompts and drafter; each engine's speedup is against plain decoding on the same engine.
for engine in ${DFLASH_EVAL_ENGINES:-cache fixed}; do
for bs in 16 64; do
  cmd=("$BUILD/trainer/dflash_rank" eval --config configs/debug-2gpu.yaml target.model_dir="$WORK/qwen3-8b"
       eval.drafter_dir="$WORK/run_off/exports/final" "eval.prompts=$WORK/prompts64.jsonl" eval.max_new_tokens=256
       "eval.batch_size=$bs" eval.device=cuda:0 eval.out="$OUT/eval_${engine}_b$bs.json" run.dir="$WORK/eval_b$bs")
  echo "eval, $engine engine, batch $bs: DFLASH_EVAL_ENGINE=$engine ${cmd[*]}" | tee -a "$SUMMARY"
  DFLASH_EVAL_ENGINE=$engine timeout 1500 "${cmd[@]}" 2>&1 | tee "$OUT/eval_${engine}_b$bs.log" | grep -E "eval|error"
  r=${PIPESTATUS[0]}
  echo "exit: $r" | tee -a "$SUMMARY"; [ "$r" -ne 0 ] && rc=$r
  grep -E "eval: (64 prompts|accepted|speculative)" "$OUT/eval_${engine}_b$bs.log" | tee -a "$SUMMARY"
done
done
exit "$rc"
