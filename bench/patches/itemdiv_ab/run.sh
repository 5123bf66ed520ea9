#!/usr/bin/env bash
# The A/Bs of bench/RESULTS.md 2026-12-07 07:18, calls 2-4. Call 4 (the default), the 2x2: the fused pass with neither (5802658), either and both
# (8c38de3) of the item walk's multiply and the loads before the bulk add, built side by side from one tree and run
# alternating on one machine, with the per-phase trace of both (bench/patches/fused_trace.patch). A record: the
# diffs apply to the attention/ and tests/ of 8c38de3 (to rerun it on a later main: git checkout 8c38de3 -- attention
# tests, then bash bench/patches/itemdiv_ab/run.sh with OUT set; about 6 minutes with the builds).
#   base.diff: git diff 8c38de3 5802658 -- attention tests; divonly.diff: the loads back behind the bulk add;
#   reorderonly.diff: i / G back in the fused pass.
# CALLS=23: calls 2 and 3 instead (base and new only: the split backward beside the fused one, and the drafter
# steps; about 4 minutes).
set -u
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cfg() { cmake -S $1 -B /tmp/b$2 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_PYTHON=$(command -v python3) -DDFLASH_CUDA_ARCHS=90a > $OUT/cmake_$2.log 2>&1; }
mk() { rm -rf /tmp/src_$1 && mkdir -p /tmp/src_$1 && cp -a . /tmp/src_$1/ && (cd /tmp/src_$1 && git apply bench/patches/itemdiv_ab/$1.diff) || { echo "apply $1 failed"; exit 1; }; }
if [ "${CALLS:-4}" = 23 ]; then
  mk base
  cfg . new & cfg /tmp/src_base base & wait
  for v in new base; do ninja -C /tmp/b$v -j 16 attention_bench drafter_bench > $OUT/ninja_$v.log 2>&1 || { tail -30 $OUT/ninja_$v.log; exit 1; }; done
  echo "built $(date +%T)"
  for r in 1 2; do for v in base new; do for s in long train; do
    echo "split $v $s r$r $(/tmp/b$v/bench/attention_bench --only $s --no-sdpa 2>&1 | grep "| $s" | awk -F'|' '{print $4, $5}')"
    echo "fused $v $s r$r $(DFLASH_ATTN_DKV_VARIANT=7 DFLASH_ATTN_FUSED_TMA=1 /tmp/b$v/bench/attention_bench --only $s --no-sdpa 2>&1 | grep "| $s" | awk -F'|' '{print $4, $5}')"
  done; done; done
  D="--attention kernel --optimizer"
  for v in base new; do
    echo "drafter 4x3072 split $v: $(timeout 100 /tmp/b$v/bench/drafter_bench --seq 3072 --rows 4 --anchors 512 $D --iters 5 --warmup 2 2>&1 | grep -E '^\| [0-9]|^steady' | tr '\n' ' ')"
    echo "drafter 1x40000 split $v: $(timeout 120 /tmp/b$v/bench/drafter_bench --seq 40000 --rows 1 --anchors 2048 $D --iters 3 --warmup 1 2>&1 | grep -E '^\| [0-9]|^steady' | tr '\n' ' ')"
  done
  for v in new base new base new base; do
    echo "drafter 1x40000 fused $v: $(DFLASH_ATTN_DKV_VARIANT=7 DFLASH_ATTN_FUSED_TMA=1 timeout 120 /tmp/b$v/bench/drafter_bench --seq 40000 --rows 1 --anchors 2048 $D --iters 3 --warmup 1 2>&1 | grep -E '^\| [0-9]|^steady' | tr '\n' ' ')"
  done
  echo "done $(date +%T)"
  exit 0
fi
mk base; mk divonly; mk reorderonly
rm -rf /tmp/src_trace && mkdir -p /tmp/src_trace && cp -a . /tmp/src_trace/ && (cd /tmp/src_trace && git apply bench/patches/fused_trace.patch) || exit 1
cfg . new & for v in base divonly reorderonly; do cfg /tmp/src_$v $v & done
cmake -S /tmp/src_trace -B /tmp/btrace -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_PYTHON=$(command -v python3) -DDFLASH_CUDA_ARCHS=90a -DCMAKE_CUDA_FLAGS=-DDFLASH_FUSED_TRACE > $OUT/cmake_trace.log 2>&1 & wait
ninja -C /tmp/bnew -j 16 attention_bench drafter_bench > $OUT/ninja_new.log 2>&1 || { tail -30 $OUT/ninja_new.log; exit 1; }
for v in base divonly reorderonly trace; do ninja -C /tmp/b$v -j 16 attention_bench > $OUT/ninja_$v.log 2>&1 || { tail -30 $OUT/ninja_$v.log; exit 1; }; done
echo "built $(date +%T)"
export DFLASH_ATTN_DKV_VARIANT=7 DFLASH_ATTN_FUSED_TMA=1
for r in 1 2 3; do for v in base divonly reorderonly new; do for s in long train; do
  echo "fused $v $s r$r $(/tmp/b$v/bench/attention_bench --only $s --no-sdpa 2>&1 | grep "| $s" | awk -F'|' '{print $4, $5}')"
done; done; done
for r in 1 2; do for m in 7 3; do
  echo "drafter 4x3072 dkv $m r$r: $(DFLASH_ATTN_DKV_VARIANT=$m timeout 100 /tmp/bnew/bench/drafter_bench --seq 3072 --rows 4 --anchors 512 --attention kernel --optimizer --iters 5 --warmup 2 2>&1 | grep -E '^\| [0-9]|^steady' | tr '\n' ' ')"
done; done
for s in long train; do echo "== trace $s"; /tmp/btrace/bench/attention_bench --only $s --no-sdpa --iters 1 2>&1 | grep -E "^fused trace|^\| " | head -16; done
echo "done $(date +%T)"
