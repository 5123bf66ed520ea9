#include "comm/error.h"

#include "comm/log.h"

namespace dflash::detail {

void throw_check_failed(const char* lib, const char* stmt, const char* file, int line,
                        const std::string& what) {
  throw std::runtime_error(fmt::format("{} failed on {}: {} at {}:{}: {}", lib, log::prefix(),
                                       stmt, file, line, what));
}

}  // namespace dflash::detail
