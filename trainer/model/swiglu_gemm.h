// The target MLP's gate/up GEMM with SwiGLU in its epilogue (trainer/model/swiglu_gemm.cu):
// act = silu(x W_gate^T) * (x W_up^T) in one kernel, so that the [T, 2I] gate/up product never
// goes to memory and no separate silu_mul kernel reads it back. Built on CUTLASS's Hopper
// mainloop (TMA, warp-specialised, persistent), with an epilogue of our own; only where CUTLASS
// was found at configure time (DFLASH_SWIGLU_GEMM) and for sm_90a.
//
// Plain pointers and sizes only (no LibTorch here): the tensor checks live in target_ops.cpp.
// Owns nothing. Launches are asynchronous on the given stream. Thread-safety: stateless.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace dflash::model::kernels {

// The row interleave of W the kernel reads ("blocked" layout of the [2I, H] gate/up weight, row
// block B): rows [2bB, 2bB + B) are gate rows bB .. bB + B - 1, rows [2bB + B, 2(b + 1)B) the
// matching up rows. One CTA tile is 2B columns wide, so each thread holds a gate value and its up
// value. B depends on the tile configuration (kSwigluConfigBlocks).
//
// Tile configurations (CUTLASS kernel schedule, tile M x N x K, cluster), compared by
// `target_bench swiglu`; the model runs kSwigluDefaultConfig:
//   0  cooperative (two consumer warp groups on one tile), 128 x 256 x 64, cluster 2 x 1, B 128
//   1  ping-pong (a tile per consumer warp group; one's epilogue beside the other's main loop),
//      64 x 256 x 64, cluster 2 x 1, B 128
//   2  cooperative, 256 x 128 x 64, cluster 1 x 2, B 64
//   3  cooperative, 256 x 128 x 64, cluster 2 x 1, B 64
//   4  ping-pong, 128 x 128 x 64, cluster 2 x 1, B 64
//   5  cooperative, 128 x 256 x 64, cluster 1 x 2, B 128
constexpr int kSwigluConfigs = 6;
constexpr int64_t kSwigluConfigBlocks[kSwigluConfigs] = {128, 128, 64, 64, 64, 128};
constexpr int kSwigluDefaultConfig = 0;
constexpr int64_t kSwigluBlock = kSwigluConfigBlocks[kSwigluDefaultConfig];

// The row block of configuration `config` (std::runtime_error if there is none).
int64_t swiglu_block(int config);

// Whether the kernel was built into this binary and runs on the current device (sm_90).
bool swiglu_gemm_available();

// act[t, i] = bf16(silu(g) * u), g = bf16(x[t] . W[gate row i]), u = bf16(x[t] . W[up row i])
// (the products rounded to bf16 first, as when the GEMM writes them; silu(g) = g / (1 + e^-g) in
// float32, as the silu_mul kernel). x [T, H] bf16 with row stride ldx; w [2I, H] bf16 contiguous
// in the blocked layout of the configuration's block; act [T, I] bf16 contiguous. Needs
// I % swiglu_block(config) == 0,
// H % 8 == 0, ldx % 8 == 0, 16-byte aligned pointers. max_swizzle / raster: CUTLASS's persistent
// scheduler options (1 / 0 = its heuristic). Throws std::runtime_error on a CUTLASS failure.
void swiglu_gemm(const void* x, int64_t ldx, const void* w, void* act, int64_t T, int64_t H,
                 int64_t I, int config, int max_swizzle, int raster, cudaStream_t stream);

}  // namespace dflash::model::kernels
