#include "core/log.h"

#include <chrono>
#include <cstdio>
#include <mutex>

#include "core/error.h"
#include "core/files.h"

namespace dflash::log {
namespace {

struct Sink {
  std::mutex mu;
  int rank = 0;
  int world = 1;
  std::string role;
  int console_rank = 0;
  Level level = Level::Info;
  std::FILE* file = nullptr;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
};

Sink& sink() {
  static Sink s;
  return s;
}

const char* level_tag(Level l) {
  switch (l) {
    case Level::Debug: return "debug: ";
    case Level::Info: return "";
    case Level::Warn: return "warning: ";
    case Level::Error: return "error: ";
  }
  return "";
}

}  // namespace

void set_identity(int rank, int world_size, const std::string& role) {
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  s.rank = rank;
  s.world = world_size;
  s.role = role;
}

void set_console_rank(int rank) {
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  s.console_rank = rank;
}

void set_level(Level level) {
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  s.level = level;
}

Level parse_level(const std::string& name) {
  if (name == "debug") return Level::Debug;
  if (name == "info") return Level::Info;
  if (name == "warn" || name == "warning") return Level::Warn;
  if (name == "error") return Level::Error;
  throw_user("log level '{}' is not one of: debug, info, warn, error", name);
}

void open_file(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash != std::string::npos && slash > 0) files::make_dirs(path.substr(0, slash));
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (!f) throw_user("cannot open log file '{}' for writing", path);
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.file) std::fclose(s.file);
  s.file = f;
}

void close_file() {
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  if (s.file) std::fclose(s.file);
  s.file = nullptr;
}

static std::string prefix_locked(const Sink& s) {
  if (s.role.empty()) return s.world > 1 ? fmt::format("[dflash r{}/{}]", s.rank, s.world) : "[dflash]";
  return fmt::format("[dflash r{}/{} {}]", s.rank, s.world, s.role);
}

std::string prefix() {
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  return prefix_locked(s);
}

void write(Level level, const std::string& line) {
  Sink& s = sink();
  std::lock_guard<std::mutex> g(s.mu);
  if (level < s.level) return;
  double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - s.start).count();
  std::string out = fmt::format("{} {}{}\n", prefix_locked(s), level_tag(level), line);
  bool console = level >= Level::Warn || s.console_rank < 0 || s.console_rank == s.rank;
  if (console) {
    std::FILE* stream = level >= Level::Warn ? stderr : stdout;
    std::fputs(out.c_str(), stream);
    std::fflush(stream);
  }
  if (s.file) {
    std::fprintf(s.file, "%9.3f %s", t, out.c_str());
    std::fflush(s.file);
  }
}

}  // namespace dflash::log
