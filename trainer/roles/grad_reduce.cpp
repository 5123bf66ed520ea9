// Bucketed gradient all-reduce driven by post-accumulate-grad hooks (grad_reduce.h).
#include "trainer/roles/grad_reduce.h"

#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <cmath>

#include "core/error.h"

namespace dflash::roles {

std::vector<std::vector<size_t>> plan_buckets(const std::vector<int64_t>& nbytes, int64_t cap_bytes) {
  DFLASH_CHECK(cap_bytes > 0, "bucket cap of {} bytes", cap_bytes);
  std::vector<std::vector<size_t>> buckets;
  int64_t filled = 0;
  for (size_t k = nbytes.size(); k-- > 0;) {
    if (buckets.empty() || (!buckets.back().empty() && filled + nbytes[k] > cap_bytes)) {
      buckets.emplace_back();
      filled = 0;
    }
    buckets.back().push_back(k);
    filled += nbytes[k];
  }
  return buckets;
}

int64_t bucket_cap_bytes(double grad_bucket_mb) {
  return static_cast<int64_t>(std::llround(grad_bucket_mb * 1024.0 * 1024.0));
}

// Runs after AccumulateGrad wrote param.grad() (LibTorch calls it with the parameter).
struct GradReducer::Hook : torch::autograd::PostAccumulateGradHook {
  Hook(GradReducer* r, size_t i) : reducer(r), index(i) {}
  void operator()(const torch::autograd::Variable& /*param*/) override { reducer->on_grad_ready(index); }
  GradReducer* reducer;
  size_t index;
};

GradReducer::GradReducer(const std::vector<std::pair<std::string, at::Tensor>>& named_parameters,
                         comm::Communicator& comm, comm::Group& group, int64_t cap_bytes)
    : comm_(comm), group_(group), cap_bytes_(cap_bytes) {
  std::vector<int64_t> nbytes;
  for (const auto& [name, p] : named_parameters) {
    DFLASH_CHECK(p.is_leaf() && p.requires_grad(), "gradient reduction: parameter {} is not a leaf that requires grad",
                 name);
    DFLASH_CHECK(!torch::autograd::impl::post_acc_grad_hooks(p), "gradient reduction: parameter {} has a hook already",
                 name);
    params_.push_back(p);
    nbytes.push_back(static_cast<int64_t>(p.nbytes()));
  }
  buckets_ = plan_buckets(nbytes, cap_bytes);
  bucket_of_.assign(params_.size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t i : buckets_[b]) bucket_of_[i] = b;
  ready_.assign(params_.size(), 0);
  pending_.assign(buckets_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i)
    torch::autograd::impl::set_post_acc_grad_hooks(params_[i], std::make_unique<Hook>(this, i));
}

GradReducer::~GradReducer() {
  for (const at::Tensor& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
  // handles left by an exception are destroyed unwaited: the communicator keeps their buffers
}

void GradReducer::arm(int64_t batch) {
  std::lock_guard<std::mutex> g(mu_);
  DFLASH_CHECK(!armed_, "gradient reduction armed twice (batch {}, then {})", batch_, batch);
  DFLASH_CHECK(handles_.empty(), "gradient reduction armed with {} buckets still in flight", handles_.size());
  armed_ = true;
  batch_ = batch;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) pending_[b] = buckets_[b].size();
  next_ = by_hooks_ = tested_ = 0;
}

bool GradReducer::armed() const {
  std::lock_guard<std::mutex> g(mu_);
  return armed_;
}

void GradReducer::on_grad_ready(size_t param) {
  std::lock_guard<std::mutex> g(mu_);
  hook_thread_ = std::this_thread::get_id();
  if (!armed_ || ready_[param]) return;  // an earlier micro-batch of the step: just accumulate
  ready_[param] = 1;
  const size_t b = bucket_of_[param];
  if (--pending_[b] == 0 && b == next_) {
    const size_t before = next_;
    post_ready_locked();
    by_hooks_ += next_ - before;
  } else {
    // MPI advances posted collectives only inside MPI calls (mpi_communicator.cpp)
    while (tested_ < handles_.size() && handles_[tested_]->test()) ++tested_;
  }
}

void GradReducer::post_ready_locked() {
  for (; next_ < buckets_.size() && pending_[next_] == 0; ++next_) handles_.push_back(post_locked(next_));
}

comm::HandlePtr GradReducer::post_locked(size_t bucket) {
  std::vector<at::Tensor> grads;
  for (size_t i : buckets_[bucket]) {
    at::Tensor& p = params_[i];
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);  // only in finish(): a hook saw it written
    grads.push_back(p.grad());
  }
  return comm_.iall_reduce(group_, std::move(grads), comm::ReduceOp::Average, batch_);
}

void GradReducer::finish() {
  std::lock_guard<std::mutex> g(mu_);
  DFLASH_CHECK(armed_, "gradient reduction: finish() without arm()");
  armed_ = false;  // first: whatever throws below, the next step starts unarmed
  std::vector<comm::HandlePtr> hs = std::move(handles_);  // an exception drops them unwaited
  handles_.clear();
  for (; next_ < buckets_.size(); ++next_) hs.push_back(post_locked(next_));
  for (comm::HandlePtr& h : hs) h->wait();
}

size_t GradReducer::posted_by_hooks() const {
  std::lock_guard<std::mutex> g(mu_);
  return by_hooks_;
}

std::thread::id GradReducer::hook_thread() const {
  std::lock_guard<std::mutex> g(mu_);
  return hook_thread_;
}

}  // namespace dflash::roles
