#!/usr/bin/env bash
# The embedded default, end to end on a fresh machine (the README's first command):
#   1. tools/setup.sh: system packages, .venv, build (idempotent)
#   2. the demo target (tools/make_tiny_target.py) and its self-generated data
#      (tools/make_demo_data.py) under runs/demo/, if missing
#   3. mpirun -np 4 build/trainer/dflash_rank --config configs/demo.yaml: 2 target + 2 drafter
#      ranks on CPU; the loss falls, tau rises (tau_est: the training estimate; tau: real
#      speculative decoding of held-out prompts every 25 steps, docs/eval.md), an export lands in
#      runs/demo/exports/final
#
#   tools/demo.sh [section.key=value ...] [--resume]
# A new run replaces the previous run's checkpoints, exports and metrics (not the model or data);
# with --resume it continues from the latest complete state instead.
set -euo pipefail
cd "$(dirname "$0")/.."
# only the trainer binary is needed here (tools/test.sh builds everything)
DFLASH_BUILD_TARGETS=${DFLASH_BUILD_TARGETS:-dflash_rank} tools/setup.sh
PY=${DFLASH_PYTHON:-$PWD/${DFLASH_VENV:-.venv}/bin/python}
BUILD=${DFLASH_BUILD_DIR:-build}
RUN=runs/demo
say() { echo "[demo] $*" >&2; }

if [ ! -f $RUN/target/config.json ]; then
  say "creating the demo target model in $RUN/target"
  "$PY" tools/make_tiny_target.py --out $RUN/target
fi
if [ ! -f $RUN/data/prepare_info.json ]; then
  say "generating the demo data with the target itself in $RUN/data (about a minute)"
  "$PY" tools/make_demo_data.py --model $RUN/target --out $RUN/data
fi
if [ ! -f $RUN/prompts.jsonl ]; then
  say "writing held-out eval prompts to $RUN/prompts.jsonl (real tau during training, docs/eval.md)"
  "$PY" tools/make_demo_data.py --model $RUN/target --out $RUN/data --prompts-out $RUN/prompts.jsonl
fi
resume=0
for a in "$@"; do [ "$a" = --resume ] && resume=1; done
if [ $resume = 0 ]; then rm -rf $RUN/checkpoints $RUN/exports $RUN/metrics.jsonl $RUN/eval $RUN/eval.jsonl $RUN/run.json; fi

source tools/mpi_env.sh
say "training: mpirun -np 4 $BUILD/trainer/dflash_rank --config configs/demo.yaml eval.every=25 $*"
exec mpirun -np 4 "$BUILD/trainer/dflash_rank" --config configs/demo.yaml eval.every=25 "$@"
