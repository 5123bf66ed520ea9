#!/usr/bin/env bash
# A SLURM "cluster" on localhost for the identity and launcher tests (Debian 12, root, no
# systemd, no cgroups): munged + slurmctld + one slurmd per node, with their state, logs and
# sockets under one directory. Several nodes on one host: node i is "n<i>", its own slurmd
# (-N n<i>) on its own port, own spool and TmpFS directories. Processes are stopped by the PIDs recorded at start (with their /proc start
# times, so a recycled PID is never signalled), never by name.
#
#   tests/comm/local_slurm.sh start|stop|status     start prints the env file to source
#
# Environment: DFLASH_SLURM_DIR (default /tmp/dflash-slurm), DFLASH_SLURM_PORT (slurmctld
# port, default 6917; slurmd uses +1), DFLASH_SLURM_CPUS (CPUs advertised, default 8: more
# than the cores is fine with SlurmdParameters=config_overrides, so `srun -n 8` fits on 2),
# DFLASH_SLURM_NODES (default 1: node "localhost"; N > 1: nodes n1..nN, slurmd of node i on
# port +i). With N > 1 the env file also sets Open MPI to TCP over loopback: its shared-memory
# transport crashes between "nodes" that share one kernel.
# Needs slurmctld, slurmd, slurm-client, munge and libpmix-dev (tools/setup.sh installs them).
set -euo pipefail
PATH=/usr/sbin:/sbin:$PATH
DIR=${DFLASH_SLURM_DIR:-/tmp/dflash-slurm}
PORT=${DFLASH_SLURM_PORT:-6917}
CPUS=${DFLASH_SLURM_CPUS:-8}
NODES=${DFLASH_SLURM_NODES:-1}
case "$NODES" in [1-9]) ;; *) echo "[local_slurm] ERROR: DFLASH_SLURM_NODES must be 1..9" >&2; exit 2 ;; esac
node_names() { if [ "$NODES" = 1 ]; then echo localhost; else seq -f 'n%g' 1 "$NODES"; fi; }
CONF=$DIR/slurm.conf
PIDFILE=$DIR/pids

say() { echo "[local_slurm] $*" >&2; }
die() {
  say "ERROR: $*"
  for f in "$DIR"/log/*.log; do [ -s "$f" ] && { say "--- $f"; tail -n 10 "$f" >&2; }; done
  exit 1
}
start_time() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0; s=${s##*) }; echo "$s" | cut -d" " -f20; }
state() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0; s=${s##*) }; echo "${s%% *}"; }
running() { [ -n "$1" ] && [ "$(start_time "$1")" = "$2" ] && [ "$(state "$1")" != Z ]; }

remember() {  # name pidfile: wait for the daemon's pid file, record pid + start time
  local pid="" _i
  for _i in $(seq 50); do pid=$(cat "$2" 2>/dev/null || true); [ -n "$pid" ] && [ -d "/proc/$pid" ] && break; sleep 0.1; done
  if [ -z "$pid" ] || [ ! -d "/proc/$pid" ]; then die "$1 did not start (no live pid in $2)"; fi
  echo "$1 $pid $(start_time "$pid")" >> "$PIDFILE"
}

is_up() {
  [ -s "$PIDFILE" ] || return 1
  local pid st
  while read -r _ pid st; do running "$pid" "$st" || return 1; done < "$PIDFILE"
  SLURM_CONF=$CONF scontrol ping >/dev/null 2>&1
}

do_stop() {
  [ -s "$PIDFILE" ] || { say "not running"; return 0; }
  if is_up; then
    local -a jobs; mapfile -t jobs < <(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null)
    if [ ${#jobs[@]} -gt 0 ]; then SLURM_CONF=$CONF scancel "${jobs[@]}" 2>/dev/null || true; sleep 1; fi
  fi
  local _name pid st _i
  while read -r _name pid st; do   # reverse start order: slurmd, slurmctld, munged
    running "$pid" "$st" || continue
    kill -TERM "$pid" 2>/dev/null || true
    for _i in $(seq 50); do running "$pid" "$st" || break; sleep 0.1; done
    if running "$pid" "$st"; then kill -KILL "$pid" 2>/dev/null || true; fi
  done < <(tac "$PIDFILE")
  rm -f "$PIDFILE"
  say "stopped"
}

do_start() {
  if is_up; then say "already running"; echo "$DIR/env.sh"; return 0; fi
  [ -s "$PIDFILE" ] && do_stop
  for c in munged slurmctld slurmd srun sbatch scontrol; do command -v "$c" >/dev/null || die "$c is not installed"; done
  [ -e /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so ] || die "libpmix-dev is not installed (srun --mpi=pmix needs it)"
  case "$DIR" in /tmp/*|/var/tmp/*) ;; *) die "DFLASH_SLURM_DIR must be under /tmp or /var/tmp";; esac
  for p in $(seq "$PORT" $((PORT + NODES))); do [ -z "$(ss -Hltn "sport = :$p" 2>/dev/null)" ] || die "port $p is in use (set DFLASH_SLURM_PORT)"; done
  rm -rf "$DIR"
  mkdir -p "$DIR"/{state,spool,log,munge,run,tmp}
  chmod 755 "$DIR" "$DIR/run"; chmod 700 "$DIR/munge"
  : > "$PIDFILE"
  dd if=/dev/urandom of="$DIR/munge/key" bs=1024 count=1 status=none; chmod 600 "$DIR/munge/key"
  # munged's socket directory must be searchable by everyone
  munged --socket="$DIR/run/munge.sock" --key-file="$DIR/munge/key" --log-file="$DIR/log/munged.log" \
         --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/seed" || die "munged failed"
  remember munged "$DIR/run/munged.pid"
  cat > "$CONF" <<CONF
ClusterName=dflashci
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$DIR/run/munge.sock
CryptoType=crypto/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
TmpFS=$DIR/tmp/%n
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
SlurmdParameters=config_overrides
CONF
  local n i=0
  for n in $(node_names); do  # every node on 127.0.0.1, each slurmd on its own port
    i=$((i + 1))
    echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=4096 State=UNKNOWN" >> "$CONF"
    mkdir -p "$DIR/spool/$n" "$DIR/tmp/$n"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >> "$CONF"
  slurmctld -f "$CONF" || die "slurmctld failed"
  remember slurmctld "$DIR/run/slurmctld.pid"
  for n in $(node_names); do
    slurmd -f "$CONF" -N "$n" || die "slurmd -N $n failed"
    remember "slurmd-$n" "$DIR/run/slurmd-$n.pid"
  done
  local st="" want _i
  want=$(node_names | sed 's/.*/idle/' | tr '\n' ' ')
  for _i in $(seq 150); do
    st=$(SLURM_CONF=$CONF sinfo -h -N -o %t 2>/dev/null | tr '\n' ' ' || true)
    [ "$st" = "$want" ] && break
    case "$st" in *drain*|*down*)
      for n in $(node_names); do SLURM_CONF=$CONF scontrol update nodename="$n" state=resume 2>/dev/null || true; done;;
    esac
    sleep 0.2
  done
  [ "$st" = "$want" ] || die "nodes not idle after 30 s (states '$st')"
  {
    printf 'export SLURM_CONF=%s\nexport OMPI_MCA_mpi_yield_when_idle=1\n' "$CONF"
    [ "$NODES" = 1 ] || printf 'export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo\n'
  } > "$DIR/env.sh"
  say "up: source $DIR/env.sh"
  echo "$DIR/env.sh"
}

case "${1:-}" in
  start) do_start ;;
  stop) do_stop ;;
  status) if is_up; then echo running; else echo "not running"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
