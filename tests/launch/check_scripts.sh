#!/usr/bin/env bash
# Every launcher script parses (bash -n) and passes shellcheck: launch/*.sh, launch/*.sbatch and
# the test cluster script tests/comm/local_slurm.sh. ctest: launch_scripts_lint.
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
[ "$fail" = 0 ] && echo "checked ${#files[@]} scripts: bash -n and shellcheck clean"
exit "$fail"
