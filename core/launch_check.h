// The one launch check of dflash's CUDA kernels (attention/kernel/*.cu, trainer/model/*.cu).
//
// Owns: DFLASH_CHECK_LAUNCH("what"), written right after a <<<...>>> launch: a launch error
// (bad grid, too much shared memory, no kernel image for this GPU) becomes the check failure of
// core/error.h: "CUDA launch failed on [dflash r5/8 drafter]: <what> at <file>:<line>: <CUDA
// error>", exit 1. This header is free of fmt and LibTorch so that nvcc-compiled sources can
// include it; the macro itself needs the CUDA runtime (every .cu file has it).
// Thread-safety: cudaGetLastError() reads and clears this thread's last CUDA error.
#pragma once

namespace dflash::detail {
[[noreturn]] void throw_launch_failed(const char* what, const char* file, int line, const char* cuda_error);
}  // namespace dflash::detail

#define DFLASH_CHECK_LAUNCH(what)                                                             \
  do {                                                                                        \
    const cudaError_t _dflash_launch_rc = cudaGetLastError();                                 \
    if (_dflash_launch_rc != cudaSuccess)                                                     \
      ::dflash::detail::throw_launch_failed((what), __FILE__, __LINE__,                       \
                                            cudaGetErrorString(_dflash_launch_rc));           \
  } while (0)
