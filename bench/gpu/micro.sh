#!/usr/bin/env bash
# Micro-benchmarks that price a kernel design before it is built (well under a minute on one GPU; it
# builds nothing of the project but the version stamp, so that run_all.sh does not build everything):
# bench/micro/red_bench.cu, the rate at which a backward can add fp32 dQ partials into global memory
# (plain stores, red.global.add .f32 / .v2.f32, and FlashAttention-3's way: the tile staged in
# shared memory and added by one TMA bulk reduce-add, and that add as int32 .add.u32: the fused backward's fixed point,
# NOTES.md v18; attention/kernel/NOTES.md "Tried: the fused
# backward" for why that rate decides the 5-product backward); bench/micro/wgmma_bench.cu, the tensor cores'
# rate by product shape with the operands in shared memory (NOTES.md v13: what the backward's 64 x 64
# products can reach at all).
#   bash bench/gpu/micro.sh BUILD_DIR OUT_DIR          (bash bench/gpu/run_all.sh micro)
# targets: dflash_version
set -uo pipefail
OUT=${2:?usage: micro.sh BUILD_DIR OUT_DIR}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.." || exit 1
rc=0
echo "## red_bench (fp32 tile adds, GB/s of payload)"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/micro/red_bench.cu -o "$OUT/red_bench" \
  > "$OUT/red_bench_build.txt" 2>&1 || { cat "$OUT/red_bench_build.txt"; exit 1; }
timeout 120 "$OUT/red_bench" > "$OUT/red_bench.txt" 2>&1 || rc=1
cat "$OUT/red_bench.txt"
rm -f "$OUT/red_bench"
echo "## wgmma_bench (the tensor cores' rate by product shape, operands in shared memory)"
nvcc -O3 -std=c++17 -I. --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a bench/micro/wgmma_bench.cu \
  -o "$OUT/wgmma_bench" > "$OUT/wgmma_bench_build.txt" 2>&1 || { cat "$OUT/wgmma_bench_build.txt"; exit 1; }
timeout 120 "$OUT/wgmma_bench" > "$OUT/wgmma_bench.txt" 2>&1 || rc=1
cat "$OUT/wgmma_bench.txt"
rm -f "$OUT/wgmma_bench"
exit $rc
