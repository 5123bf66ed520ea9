#!/usr/bin/env bash
# Every launcher script parses (bash -n) and passes shellcheck: launch/*.sh, launch/*.sbatch and
# the test cluster script tests/comm/local_slurm.sh; the GPU benchmark scripts and tools/*.sh with
# warnings and errors only. ctest: launch_scripts_lint.
#
#   tests/launch/check_scripts.sh [SOURCE_DIR]
set -uo pipefail
SRC=${1:-$(dirname "$0")/../..}
cd "$SRC" || exit 2
command -v shellcheck >/dev/null || { echo "shellcheck is not installed (tools/setup.sh installs it)" >&2; exit 1; }
shopt -s nullglob
files=(launch/*.sh launch/*.sbatch tests/comm/local_slurm.sh tests/launch/*.sh)
[ ${#files[@]} -ge 5 ] || { echo "expected the launch scripts, found: ${files[*]}" >&2; exit 1; }
fail=0
for f in "${files[@]}"; do
  bash -n "$f" || { echo "bash -n failed: $f" >&2; fail=1; }
  shellcheck -s bash "$f" || { echo "shellcheck failed: $f" >&2; fail=1; }
done
# The GPU benchmark scripts (run only on the lent GPU machines, where a broken one costs device time)
# and the tools: bash -n, and shellcheck's warnings and errors (its notes and style hints allowed).
more=(bench/gpu/*.sh bench/gpu/lib/*.sh tools/*.sh)
[ ${#more[@]} -ge 10 ] || { echo "expected the bench/gpu and tools scripts, found: ${more[*]}" >&2; exit 1; }
for f in "${more[@]}"; do
  bash -n "$f" || { echo "bash -n failed: $f" >&2; fail=1; }
  shellcheck -s bash -S warning "$f" || { echo "shellcheck failed: $f" >&2; fail=1; }
done
[ "$fail" = 0 ] && echo "checked $(( ${#files[@]} + ${#more[@]} )) scripts: bash -n and shellcheck clean"
exit "$fail"
