#!/usr/bin/env bash
# The one GPU script: configure, build only what the GPU run needs (ninja, all cores), then run
# each area's GPU tests and benchmarks (bench/gpu/<area>.sh BUILD OUT), logs under $OUT.
#
#   bash bench/gpu/run_all.sh [area ...]      (default: every bench/gpu/*.sh but this one)
#
# On the H200 machines LibTorch is the system python3's torch. NVLink multicast stays off.
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL_OUT=${OUT:-$PWD/gpu-out}
OUT=/tmp/dflash-gpu-logs            # the device tool returns at most 8 files: logs go in one tarball
BUILD=${DFLASH_GPU_BUILD:-/tmp/dflash-gpu-build}
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"
trap 'tar czf "$FINAL_OUT/gpu-logs.tgz" -C "$OUT" . 2>/dev/null' EXIT
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source tools/mpi_env.sh
{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || cat .git-commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$OUT/machine.txt"

areas=("$@")
if [ ${#areas[@]} -eq 0 ]; then
  for f in bench/gpu/*.sh; do n=$(basename "$f" .sh); [ "$n" = run_all ] || areas+=("$n"); done
fi

t0=$(date +%s)
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_PYTHON="$(command -v python3)" \
    -DDFLASH_CUDA_ARCHS=90a > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
fi
# Each area script may name the targets it needs in a line "# targets: a b c".
targets=()
for a in "${areas[@]}"; do
  t=$(sed -n 's/^# targets: //p' "bench/gpu/$a.sh")
  [ -n "$t" ] && targets+=($t)
done
echo "building: ${targets[*]:-all}"
ninja -C "$BUILD" -j "$(nproc)" "${targets[@]}" > "$OUT/build.log" 2>&1 || { grep -E 'error|Error' "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

rc=0
for a in "${areas[@]}"; do
  echo "=== $a"
  ta=$(date +%s)
  mkdir -p "$OUT/$a"
  bash "bench/gpu/$a.sh" "$BUILD" "$OUT/$a" > "$OUT/$a.log" 2>&1
  r=$?
  [ $r -eq 0 ] || rc=1
  echo "=== $a: rc=$r, $(( $(date +%s) - ta )) s"
done
for a in "${areas[@]}"; do echo "##### $a"; tail -40 "$OUT/$a.log"; done
exit $rc
