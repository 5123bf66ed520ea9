// Training metrics: the console line of rank 0 of the drafters, <run.dir>/metrics.jsonl and the
// TensorBoard event file <run.dir>/tensorboard/events.out.tfevents.* (tensorboard.h).
//
// Owns: the metrics file (appended, one JSON object per log interval, flushed each time), the
// event file (every numeric field of each JSON line, same step) and the definitions of the
// derived numbers (docs/training.md):
//   loss, accuracy, tau  means over the interval's optimizer steps (each step's value is the mean
//                        over its D x grad_accum batches); `tau` is the training ESTIMATE of
//                        served τ (printed and written as tau_est): the harmonic mean of the
//                        blocks' 1 + accepted (loss.h says why harmonic)
//   tau_block_mean       their plain mean (written as tau_est_block_mean), for comparison: it
//                        weighs positions, not decoding steps, and overstates served τ
//   eval_tau, eval_step  the real acceptance length of the latest evaluation during training
//                        (docs/eval.md) and the step whose weights it measured (< 0 / 0: none yet)
//   eval_s               the cost (seconds) of that evaluation on the rank that ran it
//   lr, grad_norm        of the interval's last step
//   target_tok_s         the targets' supply capacity: T x (tokens forwarded / busy seconds)
//                        summed over the interval's batches (busy = read + forward + capture)
//   drafter_tok_s        tokens trained per wall second over the interval (all drafters)
//   target_wait_s        mean seconds per batch a target spent blocked on its sends (drafters slow)
//   drafter_wait_s       mean seconds per step a drafter spent waiting for batches (targets slow)
//   target_busy_s        mean seconds per batch a target was busy with it (read + forward + capture)
//   drafter_busy_s       mean seconds per step a drafter rank was busy (forward + backward of its
//                        batches, gradient reduction + AdamW)
//   interval_s           wall seconds of the interval on the reporting rank
//                        Every time is taken with events on the device's stream (roles use
//                        metrics::Timeline) or after a sync of that stream; see docs/training.md.
//   startup_s, load_s,   time to first step of the reporting process: process start -> loading
//   first_step_s         begins; loading the weights; loaded -> the first optimizer step done
//   first_wait_s         the part of first_step_s spent waiting for the first batch
//   split                the recommended T : D split from this interval's rates (split.h): gpus,
//                        target_ranks, drafter_ranks, tok_s, colocated_tok_s (per GPU)
//   mfu                  drafter model FLOPs per second / (D x peak bf16 FLOP/s); GPU only, else <0
//   mem_gb               peak memory of this process: CUDA allocator peak on GPU, else VmHWM
//   accuracy_per_pos     accuracy at block offset k = 1..bs-1 over the interval (entry k-1)
//   elapsed_s, eta_s     seconds since training started in this process; the remaining steps
//                        at this process's mean seconds per step so far
//   percent              100 x step / total_steps
// Thread-safety: a MetricsLog is used by one thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "trainer/metrics/split.h"
#include "trainer/metrics/tensorboard.h"

namespace dflash::metrics {

struct StepMetrics {
  int64_t step = 0;         // optimizer steps completed
  int64_t total_steps = 0;
  int64_t epoch = 0;         // 0-based epoch of the step's last batch
  int64_t total_epochs = 0;  // epochs the run's steps reach into
  int64_t batch = 0;        // global batch cursor after this step
  double loss = 0, accuracy = 0, tau = 0;  // tau: the estimate (tau_est)
  double tau_block_mean = 0;                // tau_est_block_mean
  double eval_tau = -1;     // < 0: no evaluation yet
  int64_t eval_step = 0;
  double eval_s = 0;
  double lr = 0, grad_norm = 0;
  double target_tok_s = 0, drafter_tok_s = 0;
  double target_wait_s = 0, drafter_wait_s = 0;
  double target_busy_s = 0, drafter_busy_s = 0;
  double interval_s = 0;
  double startup_s = -1, load_s = -1, first_step_s = -1, first_wait_s = -1;  // < 0: unknown (null)
  SplitAdvice split;         // gpus == 0: not enough measurements (null)
  double mfu = -1;          // < 0: not measured (CPU)
  double mem_gb = 0;
  double elapsed_s = 0;     // since training started
  double eta_s = 0;         // estimated seconds to the last step
  double percent = 0;       // 100 x step / total_steps
  std::vector<double> accuracy_per_pos;  // block offsets 1..bs-1
};

// "step 120/400 (30.0%) | epoch 1/6 | loss 3.4121 | acc 0.412 | tau_est 2.31 | tau 1.62@100 (eval
//  3.1s) | lr 4.20e-04 | gnorm 0.830 | tok/s target 12.3K drafter 11.9K | wait target 0.120s
//  drafter 0.030s | mfu 41.2% | mem 23.1 GB | elapsed 12m05s | eta 28m10s"   (epoch shown 1-based)
std::string format_line(const StepMetrics& m);
// One JSON object (one line, no newline), every field of StepMetrics (mfu null when < 0).
std::string to_json(const StepMetrics& m);
// "first step done 6.1 s after the process started: start-up 1.2 s, loading weights 2.0 s,
//  first step 2.9 s (of which 2.5 s waiting for the first batch)"
std::string format_first_step(const StepMetrics& m);
// "45s", "12m05s", "3h07m"
std::string format_duration(double seconds);

// Appends to <run_dir>/metrics.jsonl and <run_dir>/tensorboard/. Inactive (no file, no
// output) when `active` is false.
// The reporting rank (rank 0 of the drafters) is usually not log.console_rank (rank 0 is a
// target): with `echo` its lines also go to stdout, so the user sees them whatever the console rank.
class MetricsLog {
 public:
  MetricsLog(const std::string& run_dir, bool active, bool echo = false);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  // Prints the console line (log::info) and appends the JSON line and its TensorBoard event.
  void write(const StepMetrics& m);
  // Appends another JSON object (e.g. an evaluation result) at `step` to both files; every
  // numeric field becomes a TensorBoard scalar. Not printed.
  void write_record(int64_t step, const std::string& json_object);
  // A progress line of the reporting rank (state written, export, done), shown like write's.
  void announce(const std::string& line);
  const std::string& path() const { return path_; }
  std::string tensorboard_path() const;

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  std::unique_ptr<TensorBoardWriter> tb_;
  bool echo_ = false;
};

// Peak resident memory of this process in GB (VmHWM of /proc/self/status; 0 if unavailable).
double peak_rss_gb();
// "12.3K", "1.05M", "950"
std::string human(double x);

}  // namespace dflash::metrics
