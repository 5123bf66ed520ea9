#!/usr/bin/env bash
# Local debug runs on 0, 1 or 2 GPUs:
#   2 GPUs: mpirun -np 2, 1 target rank + 1 drafter rank (NCCL)
#   1 GPU or none: one process doing both roles in turn (layout.colocated=true)
#
#   launch/local.sh [CONFIG.yaml] [key=value ...]        e.g. launch/local.sh configs/debug-2gpu.yaml
#   launch/local.sh "" --comm-check 200                  the communication self-test
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-}; shift || true
BIN=${DFLASH_BIN:-build/trainer/dflash_rank}
[ -x "$BIN" ] || { echo "launch: $BIN not found; build it first (tools/setup.sh)" >&2; exit 2; }
args=()
[ -n "$CONFIG" ] && args+=(--config "$CONFIG")
# GPUs this process may use: CUDA_VISIBLE_DEVICES when set (nvidia-smi ignores it), else all
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "${ngpu:-0}" -ge 2 ]; then
  # shellcheck source=/dev/null
  source tools/mpi_env.sh
  export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
  echo "launch: $ngpu GPUs: 1 target + 1 drafter rank under mpirun" >&2
  exec mpirun -np 2 --bind-to none "$BIN" "${args[@]}" layout.target_ranks=1 layout.drafter_ranks=1 \
    layout.colocated=false "$@"
fi
echo "launch: ${ngpu:-0} GPU(s): one colocated process" >&2
exec "$BIN" "${args[@]}" layout.colocated=true "$@"
