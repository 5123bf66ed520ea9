#!/usr/bin/env bash
# 8 GPUs of one node under OpenMPI: 5 target ranks + 3 drafter ranks (the config's layout).
#
#   launch/mpirun_8gpu.sh [CONFIG.yaml] [key=value ...]
#
# Environment: DFLASH_BIN (default build/trainer/dflash_rank), NP (default 8),
# MPIRUN_ARGS (extra mpirun options, e.g. "--hostfile hosts" for several nodes).
# Identity comes from MPI itself; each rank takes GPU local_rank % visible GPUs (docs/comm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/qwen3-8b.yaml}; shift || true
BIN=${DFLASH_BIN:-build/trainer/dflash_rank}
NP=${NP:-8}
[ -x "$BIN" ] || { echo "launch: $BIN not found; build it first (tools/setup.sh or ninja -C build dflash_rank)" >&2; exit 2; }
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
# --bind-to none: each rank drives one GPU with its own threads; -x passes NCCL_* to every node
# shellcheck disable=SC2086
exec mpirun -np "$NP" --bind-to none -x NCCL_NVLS_ENABLE ${MPIRUN_ARGS:-} \
  "$BIN" --config "$CONFIG" "$@"
