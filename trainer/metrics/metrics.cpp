#include "trainer/metrics/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "core/files.h"

namespace dflash::metrics {
namespace {
// JSON number: finite values as %.6g-ish round-trip text, non-finite as null.
std::string num(double x) {
  if (!std::isfinite(x)) return "null";
  return fmt::format("{:.8g}", x);
}
}  // namespace

std::string human(double x) {
  const double a = std::fabs(x);
  if (a >= 1e9) return fmt::format("{:.2f}G", x / 1e9);
  if (a >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (a >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.0f}", x);
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  const int64_t t = static_cast<int64_t>(std::llround(seconds));
  if (t < 60) return fmt::format("{}s", t);
  if (t < 3600) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
}

std::string format_line(const StepMetrics& m) {
  std::string mfu = m.mfu < 0 ? "-" : fmt::format("{:.1f}%", 100.0 * m.mfu);
  return fmt::format(
      "step {}/{} ({:.1f}%) | epoch {}/{} | loss {:.4f} | acc {:.3f} | tau_est {:.2f} | tau {} | lr {:.2e} "
      "| gnorm {:.3f} | tok/s target {} drafter {} | wait target {:.3f}s drafter {:.3f}s | mfu {} "
      "| mem {:.1f} GB | elapsed {} | eta {}",
      m.step, m.total_steps, m.percent, m.epoch + 1, std::max<int64_t>(m.total_epochs, m.epoch + 1), m.loss,
      m.accuracy, m.tau,
      m.eval_tau < 0 ? std::string("-") : fmt::format("{:.2f}@{} (eval {:.1f}s)", m.eval_tau, m.eval_step, m.eval_s),
      m.lr, m.grad_norm, human(m.target_tok_s), human(m.drafter_tok_s), m.target_wait_s,
      m.drafter_wait_s, mfu, m.mem_gb, format_duration(m.elapsed_s), format_duration(m.eta_s));
}

std::string to_json(const StepMetrics& m) {
  auto opt = [](double x) { return x < 0 ? std::string("null") : num(x); };
  const std::string split =
      m.split.gpus == 0
          ? std::string("null")
          : fmt::format("{{\"gpus\": {}, \"target_ranks\": {}, \"drafter_ranks\": {}, \"tok_s\": {}, "
                        "\"colocated_tok_s\": {}}}",
                        m.split.gpus, m.split.best.target_ranks, m.split.best.drafter_ranks, num(m.split.best.tok_s),
                        num(m.split.colocated.tok_s));
  std::string per_pos = "[";
  for (size_t i = 0; i < m.accuracy_per_pos.size(); ++i) per_pos += (i ? ", " : "") + num(m.accuracy_per_pos[i]);
  per_pos += "]";
  return fmt::format(
      "{{\"step\": {}, \"total_steps\": {}, \"epoch\": {}, \"total_epochs\": {}, \"batch\": {}, \"loss\": {}, "
      "\"accuracy\": {}, \"tau_est\": {}, \"tau_est_block_mean\": {}, \"tau\": {}, \"tau_step\": {}, \"eval_s\": {}, \"lr\": {}, "
      "\"grad_norm\": {}, \"target_tok_s\": {}, \"drafter_tok_s\": {}, "
      "\"target_wait_s\": {}, \"drafter_wait_s\": {}, \"mfu\": {}, \"mem_gb\": {}, \"elapsed_s\": {}, "
      "\"eta_s\": {}, \"percent\": {}, \"accuracy_per_pos\": {}, \"target_busy_s\": {}, \"drafter_busy_s\": {}, "
      "\"interval_s\": {}, \"startup_s\": {}, \"load_s\": {}, \"first_step_s\": {}, \"first_wait_s\": {}, "
      "\"split\": {}}}",
      m.step, m.total_steps, m.epoch, m.total_epochs, m.batch, num(m.loss), num(m.accuracy), num(m.tau),
      num(m.tau_block_mean), m.eval_tau < 0 ? std::string("null") : num(m.eval_tau), m.eval_step,
      m.eval_tau < 0 ? std::string("null") : num(m.eval_s), num(m.lr),
      num(m.grad_norm), num(m.target_tok_s), num(m.drafter_tok_s), num(m.target_wait_s), num(m.drafter_wait_s),
      m.mfu < 0 ? "null" : num(m.mfu), num(m.mem_gb), num(m.elapsed_s), num(m.eta_s), num(m.percent), per_pos, num(m.target_busy_s), num(m.drafter_busy_s), num(m.interval_s),
      opt(m.startup_s), opt(m.load_s), opt(m.first_step_s), opt(m.first_wait_s), split);
}

std::string format_first_step(const StepMetrics& m) {
  auto s = [](double x) { return x < 0 ? std::string("?") : fmt::format("{:.2f} s", x); };
  const double total = m.startup_s < 0 || m.load_s < 0 || m.first_step_s < 0 ? -1 : m.startup_s + m.load_s + m.first_step_s;
  return fmt::format("first step done {} after the process started: start-up {}, loading weights {}, first step {}{}",
                     s(total), s(m.startup_s), s(m.load_s), s(m.first_step_s),
                     m.first_wait_s < 0 ? std::string() : fmt::format(" (of which {} waiting for the first batch)", s(m.first_wait_s)));
}

MetricsLog::MetricsLog(const std::string& run_dir, bool active, bool echo) : echo_(echo && active) {
  if (!active) return;
  files::make_dirs(run_dir);
  path_ = run_dir + "/metrics.jsonl";
  file_ = std::fopen(path_.c_str(), "a");
  if (!file_) throw_user("cannot open {} for writing: {}", path_, std::strerror(errno));
  tb_ = std::make_unique<TensorBoardWriter>(files::join(run_dir, "tensorboard"));
}

std::string MetricsLog::tensorboard_path() const { return tb_ ? tb_->path() : std::string(); }

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

void MetricsLog::write(const StepMetrics& m) {
  if (!file_) return;
  announce(format_line(m));
  write_record(m.step, to_json(m));
}

void MetricsLog::write_record(int64_t step, const std::string& json_object) {
  if (!file_) return;
  std::fputs((json_object + "\n").c_str(), file_);
  std::fflush(file_);
  tb_->write_record(step, json_object);
}

void MetricsLog::announce(const std::string& line) {
  if (!file_) return;
  log::info("{}", line);  // console (if this is the console rank) and the rank's log file
  if (echo_) {
    std::fputs(fmt::format("{} {}\n", log::prefix(), line).c_str(), stdout);
    std::fflush(stdout);
  }
}

double peak_rss_gb() { return device::peak_rss_gib(); }

}  // namespace dflash::metrics
