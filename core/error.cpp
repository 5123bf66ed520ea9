#include "core/error.h"

#include "core/launch_check.h"
#include "core/log.h"

namespace dflash::detail {

void throw_check_failed(const char* lib, const char* stmt, const char* file, int line,
                        const std::string& what) {
  std::string msg = fmt::format("{} failed on {}: {} at {}:{}: {}", lib, log::prefix(),
                                       stmt, file, line, what);
  // a failed MPI/NCCL call is a communication failure (exit 3); anything else is internal
  std::string l = lib;
  if (l == "MPI" || l == "NCCL") throw CommError(msg);
  throw std::runtime_error(msg);
}

void throw_launch_failed(const char* what, const char* file, int line, const char* cuda_error) {
  throw_check_failed("CUDA launch", what, file, line, cuda_error);
}

}  // namespace dflash::detail
