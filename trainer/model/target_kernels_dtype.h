// The LibTorch side of target_kernels.h (CUDA builds): a tensor's dtype as the kernels' DType.
// Its callers are target_ops.cpp and target_deltanet.cpp; target_kernels.h itself stays free of
// LibTorch.
//
// Owns nothing. Thread-safety: stateless.
#pragma once

#include <ATen/core/Tensor.h>

#include "core/error.h"
#include "trainer/model/target_kernels.h"

namespace dflash::model::kernels {

inline DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kFloat: return DType::F32;
    default: DFLASH_CHECK(false, "target kernels: unsupported dtype {}", c10::toString(t.scalar_type()));
  }
  return DType::F32;
}

}  // namespace dflash::model::kernels
