#!/usr/bin/env bash
# GPU run of the attention kernel: its tests (test_attention), then the benchmark (kernel and
# SDPA+mask in C++, FlexAttention in Python on the same masks); the tables are printed last.
#   bash bench/gpu/attention.sh BUILD_DIR OUT_DIR        (about 1 minute on one H200; at most 2)
# targets: test_attention attention_bench
set -uo pipefail
BUILD=${1:?usage: attention.sh BUILD_DIR OUT_DIR}
OUT=${2:?usage: attention.sh BUILD_DIR OUT_DIR}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$OUT"
rc=0
timeout 30 "$BUILD/tests/attention/test_attention" 2>&1 | tee "$OUT/test_attention.log" | grep -E '^\[ *(OK|FAILED|PASSED|SKIPPED) |^loss:|Failure|error' ; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
timeout 35 "$BUILD/bench/attention_bench" --out "$OUT" --iters 5 2>&1 | tee "$OUT/attention_bench.log" | grep -v '^|' ; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
PYTHONUNBUFFERED=1 timeout 55 python3 "$SRC/bench/attention_bench_flex.py" "$OUT" --iters 5 2>&1 | tee "$OUT/attention_bench_flex.log" | tail -20 || rc=1
exit $rc
