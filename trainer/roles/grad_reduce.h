// The drafter's gradient average over the drafter group, overlapped with the backward (the
// bucketed reduction PyTorch DDP does; docs/training.md "Gradient reduction").
//
// Owns: the buckets (parameters in REVERSE order of named_parameters(), i.e. the order in which
// the backward finishes them, last layer first; consecutive; each filled up to the cap, a
// parameter larger than the cap alone), LibTorch post-accumulate-grad hooks on every parameter,
// and the asynchronous all-reduces (Communicator::iall_reduce, Average) of the buckets.
//
// Use, per optimizer step (trainer/roles/drafter_role.cpp):
//   reducer.arm(batch);      // before the backward of the step's LAST micro-batch
//   loss.backward();          // hooks: bucket i is posted once all its gradients are written
//                             // and buckets 0..i-1 are posted
//   reducer.finish();         // posts the rest (zeros for a parameter without a gradient), waits
//   optimizer.step();         // every .grad holds the group mean
// Earlier micro-batches of a step (train.grad_accum > 1) run their backward unarmed: the hooks
// then do nothing and the gradients accumulate. Buckets are posted strictly in bucket order, so
// every rank posts the same collectives in the same order whatever order its gradients were
// ready in (communicator.h's ordering rule). Each element is the group mean, as with the one
// all_reduce over every gradient after the backward (comm.grad_bucket_mb = 0, the oracle): bit for
// bit with two ranks ((a + b) / 2 either way); with more, MPI and NCCL pick their algorithm by
// message size, so a bucket's elements may be summed in another order (float rounding only).
//
// Threads: the autograd engine calls the hooks (on CPU the thread that called backward(); on a
// GPU the engine's device thread, with the stream the backward runs on current) while the caller
// of backward() is blocked in it, so the Communicator sees one thread at a time; a mutex guards
// the reducer's own state all the same. A CommError thrown by a hook is rethrown by backward()
// as it is (the engine carries it as an exception_ptr) and ends the rank like any CommError.
// Handles left unwaited by an exception are destroyed without blocking (communicator.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace dflash::roles {

// The buckets of parameters of `nbytes` each (in named_parameters() order), as lists of indices
// into that order: bucket 0 starts with the last parameter; a bucket grows while its bytes stay
// <= cap_bytes, and a parameter larger than the cap is a bucket of its own. cap_bytes > 0.
std::vector<std::vector<size_t>> plan_buckets(const std::vector<int64_t>& nbytes, int64_t cap_bytes);

// comm.grad_bucket_mb (MiB) in bytes.
int64_t bucket_cap_bytes(double grad_bucket_mb);

class GradReducer {
 public:
  // Sets a post-accumulate-grad hook on every parameter (each must be a leaf that requires
  // grad and have no such hook yet). `comm` and `group` must outlive the reducer.
  GradReducer(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters, comm::Communicator& comm,
              comm::Group& group, int64_t cap_bytes);
  ~GradReducer();  // removes the hooks; never throws or blocks
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  size_t num_buckets() const { return buckets_.size(); }
  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  int64_t cap_bytes() const { return cap_bytes_; }

  // The next backward is the last of an optimizer step: its hooks post the buckets. `batch`
  // names the step in error messages (as the all-reduce it replaces: s * batches_per_step).
  void arm(int64_t batch);
  bool armed() const;
  // Posts every bucket not posted yet, in order, then waits for all of them: each parameter's
  // .grad then holds the mean over the group. Disarms. Call once after the armed backward.
  void finish();
  // Buckets the hooks posted during the last armed backward (the rest were posted by finish()).
  size_t posted_by_hooks() const;
  // The thread that ran the last hook (tests; docs).
  std::thread::id hook_thread() const;

 private:
  void on_grad_ready(size_t param);  // from the hook
  void post_ready_locked();          // every complete bucket next in order
  comm::HandlePtr post_locked(size_t bucket);

  std::vector<at::Tensor> params_;
  comm::Communicator& comm_;
  comm::Group& group_;
  int64_t cap_bytes_;
  std::vector<std::vector<size_t>> buckets_;
  std::vector<size_t> bucket_of_;  // parameter -> bucket

  mutable std::mutex mu_;  // the state below
  bool armed_ = false;
  int64_t batch_ = comm::kNoBatch;
  std::vector<char> ready_;        // per parameter, this backward
  std::vector<size_t> pending_;    // per bucket: gradients not yet ready
  size_t next_ = 0;                // the next bucket to post
  size_t by_hooks_ = 0;
  size_t tested_ = 0;              // handles [0, tested_) are known complete
  std::vector<comm::HandlePtr> handles_;  // one per posted bucket, in order
  std::thread::id hook_thread_;

  struct Hook;
};

}  // namespace dflash::roles
