#!/usr/bin/env bash
# Local debug runs on one machine without MPI: N dflash_rank processes with a torchrun-style
# environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT); rank 0
# serves the c10d TCP store and the ranks meet there (docs/comm.md, "Rendezvous").
#
#   launch/local.sh [-n N] [CONFIG.yaml] [key=value ...] [--whoami | --comm-check N | --resume]
#
#   -n N    number of ranks (default: 2 with at least 2 visible GPUs, else 1). N = 1 runs one
#           colocated process (both roles in turn, layout.colocated=true); N = 2 is 1 target +
#           1 drafter rank over NCCL (layout.target_ranks=1 layout.drafter_ranks=1). Other N:
#           the layout comes from the config and the command line.
#   CONFIG  "" or absent: the built-in defaults.
#
# What it does for you:
#   - every line a rank prints is prefixed with "[local rN] " (stdout stays stdout, stderr stderr);
#   - SIGINT, SIGTERM and SIGUSR1 sent to this script are forwarded to every rank (a second
#     Ctrl-C is forwarded again, which forces the ranks out);
#   - when a rank ends with a code other than 0 or 4 (4 = preempted: state written, docs/launch.md),
#     the others get SIGTERM (and SIGCONT, so that a stopped rank ends too), then SIGKILL after
#     DFLASH_LOCAL_GRACE_S (default 10) seconds; the script exits with the code of the rank that
#     failed first (128+N when it was killed by signal N). Otherwise it exits with the highest
#     code of the ranks (0 when all succeeded).
#
# Environment: DFLASH_BIN (default build/trainer/dflash_rank), MASTER_ADDR (default 127.0.0.1),
# MASTER_PORT (default: a free port), DFLASH_LOCAL_GRACE_S. NCCL: see the comments below.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
say() { echo "[local] $*" >&2; }

NP=""
if [ "${1:-}" = "-n" ]; then NP=${2:-}; shift 2 || true; fi
case "$NP" in ""|[1-9]|[1-9][0-9]) ;; *) say "error: -n needs a rank count (1..99), got '$NP'"; exit 2 ;; esac
CONFIG=${1:-}; shift || true
BIN=${DFLASH_BIN:-build/trainer/dflash_rank}
GRACE=${DFLASH_LOCAL_GRACE_S:-10}
[ -x "$BIN" ] || { say "error: $BIN not found; build it first (tools/setup.sh)"; exit 2; }
[ -z "$CONFIG" ] || [ -f "$CONFIG" ] || { say "error: config file '$CONFIG' not found"; exit 2; }

if [ -z "$NP" ]; then
  # GPUs this process may use: CUDA_VISIBLE_DEVICES when set (nvidia-smi ignores it), else all
  if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
    ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
  else
    ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [ "${ngpu:-0}" -ge 2 ]; then NP=2; else NP=1; fi
fi

args=()
[ -n "$CONFIG" ] && args+=(--config "$CONFIG")
case "$NP" in
  1) args+=(layout.colocated=true) ;;
  2) args+=(layout.target_ranks=1 layout.drafter_ranks=1 layout.colocated=false) ;;
esac

# NCCL on one host (only read on GPUs):
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # NVLink multicast off (H200 hosts: see docs/launch.md)
# export NCCL_DEBUG=WARN                          # INFO prints the chosen transports (P2P/NVLink, SHM)
# export NCCL_P2P_DISABLE=1                       # debug only: force the SHM path between GPUs

free_port() {  # a port in 20000..32767 that no TCP socket uses (below Linux's ephemeral range, so
  local p _i  # that no outgoing connection takes it between this check and rank 0's bind)
  for _i in $(seq 50); do
    p=$((20000 + RANDOM % 12768))
    [ -z "$(ss -Htan "sport = :$p" 2>/dev/null)" ] && { echo "$p"; return; }
  done
  echo 29500
}
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
export MASTER_PORT=${MASTER_PORT:-$(free_port)}
say "$NP rank(s), torchrun-style environment, store on $MASTER_ADDR:$MASTER_PORT: $BIN ${args[*]} $*"

pids=()
for ((r = 0; r < NP; r++)); do
  # process substitution: $! stays the rank's own PID; sed -u keeps lines whole and in order
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$NP LOCAL_WORLD_SIZE=$NP \
    "$BIN" "${args[@]}" "$@" \
    > >(sed -u "s/^/[local r$r] /") 2> >(sed -u "s/^/[local r$r] /" >&2) < /dev/null &
  pids+=($!)
done

# shellcheck disable=SC2317  # called by the traps below
forward() {
  say "forwarding SIG$1 to ${#pids[@]} rank(s)"
  local p
  for p in "${pids[@]}"; do kill -s "$1" "$p" 2>/dev/null || true; done
}
trap 'forward INT' INT
trap 'forward TERM' TERM
trap 'forward USR1' USR1

alive() { local p; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
rank_of() { local i; for i in "${!pids[@]}"; do [ "${pids[$i]}" = "$1" ] && { echo "$i"; return; }; done; echo "?"; }

first_fail=""; worst=0
live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
  done_pid=""
  wait -n -p done_pid "${live[@]}" 2>/dev/null  # (bash's own "Killed" notice: we say it below)
  rc=$?
  if [ -z "${done_pid:-}" ]; then  # a trapped signal interrupted the wait (wait -p unsets it first)
    if [ "$rc" = 127 ]; then  # no such child left to wait for: drop the ranks that are gone
      rest=(); for p in "${live[@]}"; do kill -0 "$p" 2>/dev/null && rest+=("$p"); done
      live=("${rest[@]}")
    fi
    continue
  fi
  rest=(); for p in "${live[@]}"; do [ "$p" != "$done_pid" ] && rest+=("$p"); done
  live=("${rest[@]}")
  r=$(rank_of "$done_pid")
  [ "$rc" -gt "$worst" ] && worst=$rc
  if [ "$rc" != 0 ] && [ "$rc" != 4 ] && [ -z "$first_fail" ]; then
    first_fail=$rc
    if alive; then
      say "rank $r exited with code $rc; stopping the other rank(s) (SIGTERM, SIGKILL after $GRACE s)"
      # SIGCONT after SIGTERM (as systemd does): a stopped rank handles its SIGTERM now instead
      # of waiting for the SIGKILL
      for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; kill -CONT "$p" 2>/dev/null || true; done
      ( sleep "$GRACE"; for p in "${pids[@]}"; do kill -KILL "$p" 2>/dev/null || true; done ) &
      killer=$!
    else
      say "rank $r exited with code $rc"
    fi
  fi
done
[ -n "${killer:-}" ] && kill "$killer" 2>/dev/null
wait 2>/dev/null  # the output filters
if [ -n "$first_fail" ]; then exit "$first_fail"; fi
exit "$worst"
