// Logging through fmt with a rank/role prefix: "[dflash r3/8 drafter] message".
//
// Owns: the process-wide log sink. By default only rank 0 (or the rank chosen with
// log::set_console_rank) writes to the console; every rank can also write its own file
// (log.per_rank_files). Errors are always written by every rank to stderr, so that a failure
// on any rank is visible. Thread-safety: every call is safe from any thread (one mutex).
#pragma once

#include <string>

#include <fmt/format.h>

namespace dflash::log {

enum class Level { Debug = 0, Info = 1, Warn = 2, Error = 3 };

// Set once the identity is known; before that the prefix is "[dflash]".
void set_identity(int rank, int world_size, const std::string& role);
// Which rank prints Info/Debug to the console (-1: all ranks).
void set_console_rank(int rank);
void set_level(Level level);
Level parse_level(const std::string& name);  // throws UserError on an unknown name
// Also append every line of this rank to `path` (created with its directories).
void open_file(const std::string& path);
void close_file();

std::string prefix();
void write(Level level, const std::string& line);

template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Debug, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Info, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Warn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... args) {
  write(Level::Error, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace dflash::log
