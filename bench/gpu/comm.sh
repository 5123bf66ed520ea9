#!/usr/bin/env bash
# GPU part of the comm layer (issue 2): the NCCL versions of the p2p / all-reduce / schedule
# tests and the comm benchmark, under `mpirun -np 2` with one GPU per rank. About 1 minute;
# with one GPU only the one-rank NCCL runs of test_comm_mpi and test_grad_reduce (the asynchronous
# all-reduce and the drafter's hook-driven buckets on a real stream; the two-rank cases skip);
# steps that would start after 70 s are skipped (the whole GPU run has a fixed budget).
# targets: test_comm_mpi test_grad_reduce dflash_rank comm_bench
#
#   bash bench/gpu/comm.sh BUILD_DIR OUT_DIR
#
# Writes OUT_DIR/comm_*.log, OUT_DIR/comm_bench.txt (the table) and OUT_DIR/comm_summary.txt
# (one PASS/FAIL/SKIP line per step). Exit status: 0 when every step passed or was skipped.
set -uo pipefail
BUILD=$(realpath "${1:?usage: comm.sh BUILD_DIR OUT_DIR}")
OUT=${2:?usage: comm.sh BUILD_DIR OUT_DIR}
mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=/dev/null
source "$ROOT/tools/mpi_env.sh"
export NCCL_NVLS_ENABLE=0   # NVLink multicast stays off on these hosts
SUMMARY=$OUT/comm_summary.txt
: > "$SUMMARY"
fails=0
note() { echo "$*" | tee -a "$SUMMARY"; }

# GPUs this process may use: CUDA_VISIBLE_DEVICES when set (nvidia-smi ignores it), else all
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
note "comm.sh: $(date -u +%FT%TZ) host $(hostname) GPUs $ngpu; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
if [ "${ngpu:-0}" -eq 1 ]; then
  for t in comm/test_comm_mpi roles/test_grad_reduce; do
    n=$(basename "$t")
    if DFLASH_TEST_BACKEND=nccl timeout 60 mpirun -np 1 "$BUILD/tests/$t" --gtest_color=no > "$OUT/comm_${n}_np1.log" 2>&1; then
      note "PASS $n, one rank on NCCL ($(grep -E '^\[  (PASSED|SKIPPED) ' "$OUT/comm_${n}_np1.log" | tr '\n' ' '))"
    else
      note "FAIL $n, one rank on NCCL:"; tail -n 25 "$OUT/comm_${n}_np1.log" | sed 's/^/    /' | tee -a "$SUMMARY"
      fails=$((fails + 1))
    fi
  done
fi
if [ "${ngpu:-0}" -lt 2 ]; then
  note "SKIP the two-rank steps: NCCL needs 2 visible GPUs for 2 ranks (it refuses two ranks on one GPU); run comm.sh as its own step of run_all.sh, not in a GPU pair"
  note "comm.sh: $fails failure(s)"
  [ $fails = 0 ]; exit
fi

T_START=$(date +%s)
step() {  # name expect(0|nonzero) timeout_s command...
  local name=$1 expect=$2 limit=$3; shift 3
  if [ $(( $(date +%s) - T_START )) -gt 70 ]; then note "SKIP $name (time budget of comm.sh spent)"; return 0; fi
  local log=$OUT/comm_$name.log t0 rc
  t0=$(date +%s.%N)
  timeout "$limit" "$@" > "$log" 2>&1; rc=$?
  local secs; secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
  if { [ "$expect" = 0 ] && [ $rc = 0 ]; } || { [ "$expect" = nonzero ] && [ $rc != 0 ] && [ $rc != 124 ]; }; then
    note "PASS $name (rc=$rc, ${secs}s)"
  else
    note "FAIL $name (rc=$rc, expected $expect, ${secs}s): tail of $log:"; tail -n 25 "$log" | sed 's/^/    /' | tee -a "$SUMMARY"
    fails=$((fails + 1))
  fi
  return 0
}

R=$BUILD/trainer/dflash_rank
# 1. p2p (all dtypes, 0 B..256 MB, out-of-order waits), sub-group all-reduce, misuse, timeout
step nccl_tests 0 45 env DFLASH_TEST_BACKEND=nccl mpirun -np 2 "$BUILD/tests/comm/test_comm_mpi"
# 1b. the drafter's bucketed gradient all-reduce from autograd hooks against one all-reduce, bit for bit
step nccl_grad_reduce 0 45 env DFLASH_TEST_BACKEND=nccl mpirun -np 2 "$BUILD/tests/roles/test_grad_reduce"
# 2. the schedule (1 target -> 1 drafter), 200 batches verified bit-exactly, all-reduce each round
step nccl_comm_check 0 25 mpirun -np 2 "$R" --comm-check 200 comm.backend=nccl
grep -h "comm-check OK" "$OUT/comm_nccl_comm_check.log" 2>/dev/null | tee -a "$SUMMARY"
# 3. benchmark: p2p latency / streaming bandwidth 1 MB..1 GB, all-reduce bus bandwidth
step bench 0 35 mpirun -np 2 "$BUILD/bench/comm_bench" --backend nccl --min-mb 1 --max-mb 1024 --iters 20
cp "$OUT/comm_bench.log" "$OUT/comm_bench.txt" 2>/dev/null
cat "$OUT/comm_bench.txt" >> "$SUMMARY" 2>/dev/null
# 4. faults over NCCL: a rank that throws, a rank that hangs (our 5 s deadline must fire)
step nccl_fault_throw nonzero 20 env DFLASH_TEST_FAIL_AT=1:40:throw mpirun -np 2 "$R" --comm-check 200 comm.backend=nccl comm.timeout_s=5
step nccl_fault_hang nonzero 20 env DFLASH_TEST_FAIL_AT=1:40:hang mpirun -np 2 "$R" --comm-check 200 comm.backend=nccl comm.timeout_s=5
# (which batch the target waits on depends on how much NCCL buffers: 40 or a little later)
if [ -f "$OUT/comm_nccl_fault_hang.log" ]; then
  if grep -Eq "(timed out after [5-9].[0-9] s in|watchdog:) send with rank 1 \(drafter 0\), batch [0-9]+" "$OUT/comm_nccl_fault_hang.log"; then
    note "PASS nccl_fault_hang names peer and batch"
  else
    note "FAIL nccl_fault_hang: no 'timed out ... in send with rank 1 (drafter 0), batch N' line"; fails=$((fails + 1))
  fi
fi
note "comm.sh: $fails failure(s)"
[ $fails = 0 ]
