// What the CUDA kernels of trainer/model/*.cu and trainer/optim/*.cu share about element types:
// the DType their launchers take (core/kernel_dtype.h) and the float <-> bf16 / fp16 / float
// conversions (device functions: include this file from .cu files only). In core so that model/
// and optim/ (which may include only core) both use one copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/kernel_dtype.h"

namespace dflash::kernels {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(float v) { return v; }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half(v); }

}  // namespace dflash::kernels
