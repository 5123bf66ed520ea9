#!/usr/bin/env bash
# Where the long shape's first step goes (one H200, about 3 minutes): test_device (the warm-up
# under the load, core/device.h), then the colocated run of speed.sh
# 3c (Qwen3-8B-shaped random target, 1 x 40000-token documents, 2048 anchors, 3 steps), run
#   1. as is (its "first step done" line, and steady steps 2..3 from metrics.jsonl);
#   2. with the caching allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF);
#   3. with step 1 profiled (log.profile_start=1): the CUDA runtime calls of the first step summed
#      by name (cudaMalloc, module loading, synchronisations), and its idle device gaps
#      (bench/trace_gaps.py) with the host operators that left them.
#   bash bench/gpu/first_step.sh BUILD_DIR OUT_DIR     (bash bench/gpu/run_all.sh first_step)
# targets: dflash_rank target_bench test_device
set -uo pipefail
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
bench_setup first_step /tmp/dflash-pipeline-bench "$@"
bench_need_gpus 1
rc=0
timeout 60 "$BUILD/tests/unit/test_device" > "$OUT/test_device.txt" 2>&1 || { rc=1; echo "FAILED: test_device"; }
grep -E '^\[ *(PASSED|FAILED|SKIPPED) ' "$OUT/test_device.txt" | tee -a "$SUMMARY"
bench_random_target_and_data
bench_long_data
args=(--config configs/debug-2gpu.yaml layout.colocated=true target.model_dir="$WORK/qwen3-8b"
      "data.shards=[$WORK/data-long]" train.max_steps=3 log.interval=1 checkpoint.state_every=0
      checkpoint.export_every=0 comm.timeout_s=600 data.batch_tokens=40000 data.max_seq_len=40000
      drafter.num_anchors=2048)
steady() {  # metrics.jsonl -> mean interval_s of steps 2..3
  "$PY" -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; s=[x["interval_s"] for x in r if x.get("step",0)>=2 and x.get("interval_s")]; print(f"steady step {sum(s)/len(s):.3f} s" if s else "no steady steps")' "$1" 2>/dev/null
}
case_run() {  # NAME ENV... -- extra args
  local name=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  rm -rf "$WORK/run-first-$name"
  CUDA_VISIBLE_DEVICES=0 env "${envs[@]}" timeout 200 "$BUILD/trainer/dflash_rank" "${args[@]}" "$@" \
    run.dir="$WORK/run-first-$name" > "$OUT/first_$name.log" 2>&1 || rc=1
  echo "## $name: $(grep -h "first step done" "$OUT/first_$name.log" | sed 's/.*first step done/first step done/') | $(steady "$WORK/run-first-$name/metrics.jsonl")" | tee -a "$SUMMARY"
  grep -hE "error|Error" "$OUT/first_$name.log" | head -5
}
case_run default -- 
case_run expandable PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True --
case_run profiled -- log.profile_start=1 log.profile_steps=1
T="$WORK/run-first-profiled/profile/rank0.trace.json"
if [ -f "$T" ]; then
  cp "$T" "$OUT/first_step.trace.json"
  "$PY" - "$T" <<'PYEOF' | tee -a "$SUMMARY"
import json, sys, collections
ev = json.load(open(sys.argv[1]))
ev = ev.get("traceEvents", ev) if isinstance(ev, dict) else ev
x = [e for e in ev if e.get("ph") == "X"]
k = [e for e in x if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
if k:
    t0 = min(e["ts"] for e in k); t1 = max(e["ts"] + e["dur"] for e in k)
    busy = sum(e["dur"] for e in k)
    print(f"first step (profiled): device span {(t1 - t0) / 1e3:.1f} ms, kernels {busy / 1e3:.1f} ms busy, {len(k)} device ops")
by = collections.defaultdict(lambda: [0, 0.0])
for e in x:
    if e.get("cat") in ("cuda_runtime", "cuda_driver"):
        by[e["name"]][0] += 1; by[e["name"]][1] += e["dur"]
print("CUDA runtime/driver calls of the window, by total time:")
for n, (c, d) in sorted(by.items(), key=lambda i: -i[1][1])[:12]:
    print(f"  {n:<40} {c:>6} calls {d / 1e3:9.1f} ms")
PYEOF
  "$PY" bench/trace_gaps.py "$T" --top 12 2>&1 | tee -a "$SUMMARY"
  gzip -f "$OUT/first_step.trace.json"
fi
exit $rc
