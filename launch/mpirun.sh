#!/usr/bin/env bash
# dflash under OpenMPI's mpirun, on one node or several (a hostfile). Identity comes from MPI
# itself (rank, size, and the local rank from MPI_COMM_TYPE_SHARED); each rank takes GPU
# local_rank % visible GPUs (docs/comm.md). Exit codes: docs/launch.md.
#
#   launch/mpirun.sh [CONFIG.yaml] [key=value ...] [--resume | --comm-check N | --whoami]
#
# Environment:
#   NP            number of ranks (default 8 = 5 target + 3 drafter ranks of configs/qwen3-8b.yaml)
#   HOSTFILE      a hostfile ("node1 slots=8" per line) for several nodes; mpirun starts the
#                 remote ranks over ssh (or MPIRUN_ARGS="--mca plm_rsh_agent SCRIPT")
#   MPIRUN_ARGS   extra mpirun options (word-split), e.g. "--mca btl_tcp_if_include ib0"
#   DFLASH_BIN    default build/trainer/dflash_rank (the same path on every node)
# Signals: SIGTERM and SIGINT (scancel, a time limit, Ctrl-C) and SIGUSR1 to this script become a
# SIGUSR1 to mpirun, which forwards it to every rank: they stop after the same step, write a state
# and exit 4 (docs/launch.md, preemption); a second SIGTERM/SIGINT ends mpirun at once (no state).
# (Raw mpirun ends its ranks within a second on SIGTERM/SIGINT, before they can write a state.)
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/qwen3-8b.yaml}; shift || true
BIN=${DFLASH_BIN:-build/trainer/dflash_rank}
NP=${NP:-8}
[ -x "$BIN" ] || { echo "launch: $BIN not found; build it first (tools/setup.sh or ninja -C build dflash_rank)" >&2; exit 2; }
[ -f "$CONFIG" ] || { echo "launch: config file '$CONFIG' not found" >&2; exit 2; }
[ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
hosts=()
if [ -n "${HOSTFILE:-}" ]; then
  [ -f "$HOSTFILE" ] || { echo "launch: HOSTFILE '$HOSTFILE' not found" >&2; exit 2; }
  hosts=(--hostfile "$HOSTFILE")
fi

# A rank that has finished (MPI_Finalize, exit 0) waits at most 2 s for mpirun's acknowledgement
# (a PMIx constant); on a loaded node mpirun can be slower, and then reports a successful run as a
# rank "exiting improperly" and exits 1. A rank that fails still exits non-zero (or on a signal) and
# is reported as before (docs/comm.md).
export OMPI_MCA_orte_allowed_exit_without_sync=${OMPI_MCA_orte_allowed_exit_without_sync:-1}

# NCCL settings (GPU runs; -x passes them to the ranks on every node):
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}    # NVLink multicast off (the H200 hosts hang with it)
# export NCCL_SOCKET_IFNAME=ib0,eth0              # several nodes: the interface of the bootstrap
# export NCCL_IB_HCA=mlx5                         # several nodes: the InfiniBand adapters to use
# export NCCL_DEBUG=WARN                          # INFO prints rings/trees and transports at start
# Several nodes over TCP (no InfiniBand): also MPIRUN_ARGS="--mca btl self,tcp --mca btl_tcp_if_include eth0"

# --bind-to none: each rank drives one GPU with its own threads. mpirun runs in the background of
# this shell so that the signals above reach the trap (a background job ignores the terminal's
# SIGINT; the ranks are in process groups of their own).
# shellcheck disable=SC2086
mpirun -np "$NP" "${hosts[@]}" --bind-to none -x NCCL_NVLS_ENABLE ${MPIRUN_ARGS:-} \
  "$BIN" --config "$CONFIG" "$@" &
pid=$!
stops=0
# shellcheck disable=SC2317  # called from the traps
on_stop() {
  stops=$((stops + 1))
  if [ "$stops" = 1 ]; then
    echo "launch: $1: every rank writes a state after its current step and exits 4 (send it again to end at once)" >&2
    kill -USR1 "$pid" 2>/dev/null || true
  else
    kill -TERM "$pid" 2>/dev/null || true
  fi
}
trap 'on_stop SIGTERM' TERM
trap 'on_stop SIGINT' INT
trap 'kill -USR1 "$pid" 2>/dev/null || true' USR1
rc=0
while :; do
  rc=0; wait "$pid" || rc=$?
  kill -0 "$pid" 2>/dev/null || break  # a trapped signal interrupts wait: mpirun still runs
done
exit "$rc"
