// The node-local progress board (comm/progress.h): records in /dev/shm, the diagnosis on a
// timeout, and the DFLASH_TEST_FAIL_AT phase hook.
#include "comm/progress.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/watchdog.h"
#include "core/error.h"
#include "core/fault.h"
#include "core/log.h"

namespace dflash::comm::progress {
namespace {

constexpr uint32_t kMagic = 0x64505232;  // "dPR2"
constexpr const char* kRoot = "/dev/shm/dflash-board";

struct Record {
  uint32_t magic;
  std::atomic<uint32_t> seq;  // odd while being written
  int32_t pid;
  int32_t rank;
  int64_t start_ticks;        // /proc/<pid>/stat field 22: tells a recycled pid apart
  int64_t t_ns;               // CLOCK_MONOTONIC (one clock for the whole host) of the last update
  int64_t step;
  int64_t batch;
  int32_t waits;              // > 0 while blocked in a communication
  std::atomic<int32_t> ending;  // 1: the rank is ending on its own (a signal from the launcher, an error)
  int64_t wait_since_ns;
  char phase[64];
  char wait[168];
};

std::mutex g_mu;
Record* g_rec = nullptr;
std::atomic<Record*> g_sig_rec{nullptr};  // g_rec for mark_ending() (a signal handler: no lock)
std::string g_dir;
std::string g_file;
int g_world = 0;
bool g_one_node = false;

int64_t mono_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  return end && *end == 0 ? static_cast<int>(x) : fallback;
}

// /proc/<pid>/stat: state and start time; false when the process is gone.
bool proc_stat(int pid, char* state, int64_t* start) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return false;
  char buf[1024] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');
  if (!p) return false;
  p += 2;  // ") S ..."
  *state = *p;
  // field 3 is the state; the start time is field 22, i.e. 19 fields further
  for (int i = 0; i < 19 && p; ++i) {
    p = std::strchr(p, ' ');
    if (p) ++p;
  }
  *start = p ? std::strtoll(p, nullptr, 10) : 0;
  return true;
}

std::string job_key() {
  std::string k;
  if (const char* v = env("PMIX_NAMESPACE")) k = v;
  else if (const char* j = env("SLURM_JOB_ID")) k = fmt::format("slurm{}.{}", j, env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : "x");
  else if (const char* r = env("TORCHELASTIC_RUN_ID")) k = fmt::format("tr{}", r);
  else if (env("MASTER_ADDR") && env("MASTER_PORT")) k = fmt::format("{}_{}", env("MASTER_ADDR"), env("MASTER_PORT"));
  for (char& c : k)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  return k;
}

bool read_record(const std::string& path, Record* out) {
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  bool ok = false;
  for (int attempt = 0; attempt < 20 && !ok; ++attempt) {
    ssize_t n = ::pread(fd, reinterpret_cast<char*>(out), sizeof(Record), 0);
    if (n != static_cast<ssize_t>(sizeof(Record)) || out->magic != kMagic) break;
    uint32_t s = out->seq.load();
    ok = (s % 2) == 0;
    if (!ok) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ::close(fd);
  return ok;
}

// Seconds since the last change of a file or directory (a large number when it is gone).
double age_s(const std::string& path) {
  struct stat sb{};
  if (::stat(path.c_str(), &sb) != 0) return 1e9;
  timespec now{};
  clock_gettime(CLOCK_REALTIME, &now);
  return static_cast<double>(now.tv_sec - sb.st_mtim.tv_sec) + (now.tv_nsec - sb.st_mtim.tv_nsec) * 1e-9;
}

// Job directories of earlier runs whose ranks are all gone (killed runs leave records). Another
// job's directory that is being made right now (empty, or a record not written yet) is young:
// it is left alone, else its ranks would lose their records and be "never started" to the others.
constexpr double kYoungS = 60;

void prune_stale(const std::string& keep) {
  DIR* d = opendir(kRoot);
  if (!d) return;
  std::vector<std::string> dirs;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.' && keep != e->d_name) dirs.emplace_back(e->d_name);
  closedir(d);
  for (const auto& name : dirs) {
    std::string dir = fmt::format("{}/{}", kRoot, name);
    DIR* jd = opendir(dir.c_str());
    if (!jd) continue;
    std::vector<std::string> files;
    bool live = false;
    while (dirent* e = readdir(jd)) {
      if (e->d_name[0] == '.') continue;
      files.emplace_back(dir + "/" + e->d_name);
      Record r{};
      char st = 0;
      int64_t start = 0;
      if (!read_record(files.back(), &r)) {
        if (age_s(files.back()) < kYoungS) live = true;  // being written
      } else if (proc_stat(r.pid, &st, &start) && start == r.start_ticks && st != 'Z') {
        live = true;
      }
    }
    closedir(jd);
    if (live || (files.empty() && age_s(dir) < kYoungS)) continue;
    for (const auto& f : files) ::unlink(f.c_str());
    ::rmdir(dir.c_str());
  }
}

void copy_str(char* dst, size_t cap, const char* src) {
  size_t n = src ? std::strlen(src) : 0;
  if (n >= cap) n = cap - 1;
  if (n) std::memcpy(dst, src, n);
  dst[n] = 0;
}

// Caller holds g_mu.
template <class F>
void update(F&& f) {
  if (!g_rec) return;
  g_rec->seq.fetch_add(1);
  f(*g_rec);
  g_rec->t_ns = mono_ns();
  g_rec->seq.fetch_add(1);
}

std::string where(const Record& r) {
  std::string s = fmt::format("in '{}'", r.phase);
  if (r.step >= 0) s += fmt::format(" step {}", r.step);
  if (r.batch >= 0) s += fmt::format(", batch {}", r.batch);
  return s;
}

bool gave_up(const Record& r) {
  return r.ending.load() != 0 || std::strcmp(r.phase, "failed") == 0 || std::strcmp(r.phase, "gave up") == 0 ||
         std::strcmp(r.phase, "done") == 0;
}

}  // namespace

int rank_from_env() {
  for (const char* v : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "RANK", "SLURM_PROCID"}) {
    int r = env_int(v, -1);
    if (r >= 0) return r;
  }
  return -1;
}

void open_from_env() {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_rec) return;
  int rank = rank_from_env();
  int world = env_int("OMPI_COMM_WORLD_SIZE", env_int("WORLD_SIZE", env_int("SLURM_NTASKS", 0)));
  std::string key = job_key();
  if (rank < 0 || world <= 1 || key.empty()) return;
  // ranks on this node: every rank runs here when the launcher says so (torchrun-style without
  // LOCAL_WORLD_SIZE means one node, as comm/identity.cpp reads it)
  int one = env("RANK") || env_int("SLURM_JOB_NUM_NODES", 0) == 1 ? world : 0;
  int local = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", env_int("LOCAL_WORLD_SIZE", one));
  ::mkdir(kRoot, 0777);
  prune_stale(key);
  g_dir = fmt::format("{}/{}", kRoot, key);
  ::mkdir(g_dir.c_str(), 0777);
  g_file = fmt::format("{}/rank{}", g_dir, rank);
  int fd = ::open(g_file.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  if (::ftruncate(fd, sizeof(Record)) != 0) {
    ::close(fd);
    return;
  }
  void* p = ::mmap(nullptr, sizeof(Record), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) return;
  g_rec = static_cast<Record*>(p);
  g_world = world;
  g_one_node = local == world;
  char st = 0;
  int64_t start = 0;
  proc_stat(static_cast<int>(getpid()), &st, &start);
  g_rec->seq.store(1);
  g_rec->pid = static_cast<int32_t>(getpid());
  g_rec->rank = rank;
  g_rec->start_ticks = start;
  g_rec->step = g_rec->batch = -1;
  g_rec->waits = 0;
  g_rec->ending.store(0);
  copy_str(g_rec->phase, sizeof(g_rec->phase), "start");
  g_rec->t_ns = mono_ns();
  g_rec->magic = kMagic;
  g_rec->seq.store(2);
  g_sig_rec.store(g_rec);
}

void publish(const char* phase, int64_t step, int64_t batch) {
  std::lock_guard<std::mutex> g(g_mu);
  update([&](Record& r) {
    copy_str(r.phase, sizeof(r.phase), phase);
    r.step = step;
    r.batch = batch;
  });
}

void waiting(const char* what, int64_t batch) {
  std::lock_guard<std::mutex> g(g_mu);
  update([&](Record& r) {
    if (batch >= 0) r.batch = batch;
    if (what) {
      if (r.waits++ == 0) r.wait_since_ns = mono_ns();
      copy_str(r.wait, sizeof(r.wait), what);
    } else if (r.waits > 0) {
      --r.waits;
    }
  });
}

namespace {

struct Board {
  std::string dir;
  int world = 0, self = -1;
  bool one_node = false;
};

bool board(Board* b) {
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_rec) return false;
  b->dir = g_dir;
  b->world = g_world;
  b->self = g_rec->rank;
  b->one_node = g_one_node;
  return true;
}

// One rank's record on this node's board.
Seen classify(const Board& b, int r, Record* rec, char* st) {
  if (!read_record(fmt::format("{}/rank{}", b.dir, r), rec)) return b.one_node ? Seen::NeverStarted : Seen::Unknown;
  int64_t start = 0;
  bool alive = proc_stat(rec->pid, st, &start) && start == rec->start_ticks && *st != 'Z' && *st != 'X';
  if (!alive) return gave_up(*rec) ? Seen::Ended : Seen::Dead;
  if (*st == 'T' || *st == 't') return Seen::Stopped;
  return gave_up(*rec) ? Seen::Ended : Seen::Running;
}

}  // namespace

Seen seen(int rank) {
  Board b;
  if (!board(&b) || rank < 0 || rank >= b.world) return Seen::Unknown;
  Record rec{};
  char st = 0;
  return classify(b, rank, &rec, &st);
}

std::string diagnose() {
  Board b;
  if (!board(&b)) return "";
  publish("gave up", -1, -1);  // this rank is about to end: never blamed by the others
  int64_t now = mono_ns();
  std::vector<std::string> stopped, dead, missing, idle;
  for (int r = 0; r < b.world; ++r) {
    if (r == b.self) continue;
    Record rec{};
    char st = 0;
    switch (classify(b, r, &rec, &st)) {
      case Seen::NeverStarted: missing.push_back(name_rank(r)); break;
      case Seen::Dead: dead.push_back(fmt::format("{} (pid {}) died {}", name_rank(r), rec.pid, where(rec))); break;
      case Seen::Stopped:
        stopped.push_back(fmt::format("{} is stopped (SIGSTOP or a debugger; pid {}) {}", name_rank(r), rec.pid, where(rec)));
        break;
      case Seen::Running:
        if (rec.waits == 0)
          idle.push_back(fmt::format("{} (pid {}) is not in a communication and made no progress for {:.1f} s {}",
                                     name_rank(r), rec.pid, (now - rec.t_ns) / 1e9, where(rec)));
        break;
      case Seen::Unknown:
      case Seen::Ended: break;
    }
  }
  auto join = [](const std::vector<std::string>& v) { return fmt::format("{}", fmt::join(v, "; ")); };
  if (!stopped.empty()) return "progress: " + join(stopped) + "; the others wait for it";
  if (!dead.empty()) return "progress: " + join(dead);
  if (!missing.empty()) return fmt::format("progress: {} never started (no record on this node)", fmt::join(missing, ", "));
  if (!idle.empty()) return "progress: " + join(idle) + " (it hangs, or computes for longer than the deadline)";
  return b.one_node ? "" : "progress: no rank of this node is late (look at the other nodes' logs)";
}

void mark_ending() {
  if (Record* r = g_sig_rec.load()) r->ending.store(1);
}

void close() {
  std::lock_guard<std::mutex> g(g_mu);
  if (!g_rec) return;
  // Mark this rank done (a rank that ends early is not "never started" to the others); the last
  // rank out removes the job's directory.
  update([](Record& r) { copy_str(r.phase, sizeof(r.phase), "done"); });
  g_sig_rec.store(nullptr);
  ::munmap(g_rec, sizeof(Record));
  g_rec = nullptr;
  bool all_out = true;
  for (int r = 0; r < g_world && all_out; ++r) {
    Record rec{};
    char st = 0;
    int64_t start = 0;
    if (!read_record(fmt::format("{}/rank{}", g_dir, r), &rec)) continue;  // on another node
    bool alive = proc_stat(rec.pid, &st, &start) && start == rec.start_ticks && st != 'Z';
    if (alive && std::strcmp(rec.phase, "done") != 0) all_out = false;
  }
  if (!all_out) return;
  for (int r = 0; r < g_world; ++r) ::unlink(fmt::format("{}/rank{}", g_dir, r).c_str());
  ::rmdir(g_dir.c_str());
}

void maybe_fail(int rank, const std::string& phase) {
  fault::point(rank, phase, [](const std::string& kind) { publish(("inject " + kind).c_str(), -1, -1); });
}

}  // namespace dflash::comm::progress
