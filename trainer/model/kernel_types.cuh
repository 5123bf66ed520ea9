// float <-> bf16 / fp16 / float conversions shared by the CUDA kernels of trainer/model/*.cu.
// Device functions only; include from .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dflash::model::kernels {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(float v) { return v; }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half(v); }

}  // namespace dflash::model::kernels
