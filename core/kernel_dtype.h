// The element types of the tensors our CUDA kernels read and write, as their launchers take them
// (plain pointers plus this tag; no LibTorch in kernel headers). trainer/model/target_kernels_dtype.h
// maps an at::Tensor's dtype to it.
#pragma once

namespace dflash::kernels {

enum class DType { BF16, F16, F32 };

}  // namespace dflash::kernels
