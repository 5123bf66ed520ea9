#!/usr/bin/env bash
# Issue 13's regeneration bar on one H200 (run_all.sh area `regen`): dflash_rank regenerate on
# SmolLM2-135M-Instruct (static engine with CUDA graphs; the same eager; the cache engine) and
# transformers' generate on the same prompts at the same batch size, in the same run; prints
# "REGEN BAR: dflash / transformers = N.NNx (bar: >= 5x); graphs on/off = ...". It is
# quality.sh's `speed` stage (GGUF -> HF directory, prompts, the speed step), with the GGUF
# brought as quality.sh describes (DFLASH_GGUF: the file, or a folder/prefix of its parts).
#   DFLASH_GGUF=.gguf/ bash bench/gpu/run_all.sh regen
# Settings: those of quality.sh (Q_REGEN_BATCH 512, Q_MAX_NEW 384, Q_SPEED_PROMPTS 512, ...).
# targets: dflash_rank
set -uo pipefail
export DFLASH_BUILD=${1:-${DFLASH_BUILD:-/tmp/dflash-gpu-build}} OUT=${2:-${OUT:-$PWD/gpu-out}}
if [ -z "${DFLASH_GGUF:-}${DFLASH_QUALITY_MODEL:-}" ]; then
  echo "regen.sh: SKIP (set DFLASH_GGUF to the SmolLM2 GGUF, or to a folder of its parts, to measure the bar)"; exit 0
fi
mkdir -p "$OUT"
STAGE_BUDGET_S=${STAGE_BUDGET_S:-540} exec bash "$(dirname "$0")/quality.sh" speed
