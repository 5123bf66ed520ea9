// Errors of dflash, and the one family of check macros (conditions, system calls, CUDA); the MPI
// and NCCL members of the family live in comm/check.h, the only layer that calls those libraries.
//
// Owns: the error types that travel to main (UserError = bad input from the user: exit 2, one
// line, no stack trace; CommError = a peer died, was silent or a collective failed: exit 3;
// everything else: exit 1), and DFLASH_CHECK_* macros that throw with statement text, file:line,
// rank and the library's own error string. Nothing in dflash calls exit() below main: errors
// propagate to one place (trainer/main.cpp) that aborts the communicators and exits every rank.
// Thread-safety: stateless; the rank prefix comes from core/log.h's process-wide identity.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace dflash {

// Bad input: config, data, checkpoints, environment. The message is complete and for a user.
class UserError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A communication failure: a dead or silent peer, an aborted communicator, a timeout.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Process exit codes, documented in docs/environment.md.
constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;
constexpr int kExitUser = 2;
constexpr int kExitComm = 3;

template <typename... Args>
[[noreturn]] void throw_user(fmt::format_string<Args...> f, Args&&... args) {
  throw UserError(fmt::format(f, std::forward<Args>(args)...));
}

namespace detail {
[[noreturn]] void throw_check_failed(const char* lib, const char* stmt, const char* file, int line,
                                     const std::string& what);
}  // namespace detail
}  // namespace dflash

// Throwing checks for normal code paths.
#define DFLASH_CHECK(cond, ...)                                                               \
  do {                                                                                        \
    if (!(cond))                                                                              \
      ::dflash::detail::throw_check_failed("check", #cond, __FILE__, __LINE__,                \
                                           ::fmt::format(__VA_ARGS__));                       \
  } while (0)

#define DFLASH_CHECK_SYS(stmt)                                                                \
  do {                                                                                        \
    if ((stmt) < 0)                                                                           \
      ::dflash::detail::throw_check_failed("system", #stmt, __FILE__, __LINE__,               \
                                           std::string(std::strerror(errno)));                \
  } while (0)

#ifdef DFLASH_CUDA
#define DFLASH_CHECK_CUDA(stmt)                                                               \
  do {                                                                                        \
    cudaError_t _dflash_rc = (stmt);                                                          \
    if (_dflash_rc != cudaSuccess)                                                            \
      ::dflash::detail::throw_check_failed("CUDA", #stmt, __FILE__, __LINE__,                 \
                                           cudaGetErrorString(_dflash_rc));                   \
  } while (0)

#endif
