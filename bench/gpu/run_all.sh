#!/usr/bin/env bash
# The one GPU script: configure, build only what the GPU run needs (ninja, all cores), then run
# each area's GPU tests and benchmarks (bench/gpu/<area>.sh BUILD OUT). Logs go to one tarball
# $OUT/gpu-logs.tgz (the device tool returns few files); the tables are printed last.
#
#   bash bench/gpu/run_all.sh [step ...]
#     step = an area (bench/gpu/<area>.sh), or "a|b": area a on GPU 0 and b on GPU 1 at once
#     (each "a" may itself be "a,c": run one after the other on that GPU)
#   default: every bench/gpu/*.sh but this one and the profilers (*_prof.sh), one after the other
# bench/gpu/lib/common.sh holds the set-up the areas share (sourced, so not an area: it is below lib/).
# Pass DFLASH_COMMIT=$(git rev-parse --short HEAD), computed where you commit, to record the commit: a
# copy of the tree on another machine may carry no .git, or a stale one (its HEAD is then not what
# runs; without DFLASH_COMMIT the line reads git's HEAD with "-dirty" when the tree differs from it).
# On the H200 machines LibTorch is the system python3's torch. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
FINAL_OUT=${OUT:-$PWD/gpu-out}
OUT=/tmp/dflash-gpu-logs
BUILD=${DFLASH_GPU_BUILD:-/tmp/dflash-gpu-build}
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"
trap 'tar czf "$FINAL_OUT/gpu-logs.tgz" -C "$OUT" . 2>/dev/null' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
source tools/mpi_env.sh
{
  echo "date: $(date -u +%FT%TZ)  commit: ${DFLASH_COMMIT:-$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$OUT/machine.txt"
cp "$OUT/machine.txt" "$FINAL_OUT/"

steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
  for f in bench/gpu/*.sh; do
    n=$(basename "$f" .sh); [ "$n" = run_all ] || [[ $n == *_prof ]] || steps+=("$n")
  done
fi
areas=$(printf '%s\n' "${steps[@]}" | tr '|,' '\n\n' | sort -u)

t0=$(date +%s)
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_PYTHON="$(command -v python3)" \
    -DDFLASH_CUDA_ARCHS=90a > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
fi
targets=()
for a in $areas; do
  t=$(sed -n 's/^# targets: //p' "bench/gpu/$a.sh")
  [ -n "$t" ] && read -ra more <<< "$t" && targets+=("${more[@]}")
done
echo "building: ${targets[*]:-all}"
# -k 0: a target that fails to build does not stop the others; its area then fails alone.
ninja -C "$BUILD" -k 0 -j "$(nproc)" "${targets[@]}" > "$OUT/build.log" 2>&1 ||
  { echo "BUILD ERRORS:"; grep -E 'error|FAILED' "$OUT/build.log" | head -30; }
echo "build: $(( $(date +%s) - t0 )) s"

run_area() {  # area gpu
  local a=$1 ta r
  ta=$(date +%s)
  mkdir -p "$OUT/$a"
  if [ -n "$2" ]; then CUDA_VISIBLE_DEVICES=$2 bash "bench/gpu/$a.sh" "$BUILD" "$OUT/$a" > "$OUT/$a.log" 2>&1
  else bash "bench/gpu/$a.sh" "$BUILD" "$OUT/$a" > "$OUT/$a.log" 2>&1; fi
  r=$?
  cp "$OUT/$a.log" "$FINAL_OUT/" 2>/dev/null   # each area's log comes back even if the call is cut short
  echo "=== $a: rc=$r, $(( $(date +%s) - ta )) s (at $(( $(date +%s) - t0 )) s)"
  return $r
}
run_chain() {  # "a,b" gpu
  local rc=0 a
  for a in ${1//,/ }; do run_area "$a" "$2" || rc=1; done
  return $rc
}

rc=0
for s in "${steps[@]}"; do
  if [[ $s == *"|"* ]]; then
    run_chain "${s%%|*}" 0 & p0=$!
    run_chain "${s#*|}" 1 & p1=$!
    wait $p0 || rc=1
    wait $p1 || rc=1
  else
    run_chain "$s" "" || rc=1
  fi
done
for a in $areas; do echo "##### $a"; tail -45 "$OUT/$a.log"; done
exit $rc
