#include "trainer/optim/adamw.h"

#include <cmath>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/parse.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include "trainer/optim/adamw_kernels.h"
#endif

namespace dflash::optim {
namespace {
std::string shape_str(at::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

#ifdef DFLASH_CUDA
kernels::DType kernel_dtype(const at::Tensor& t, const std::string& what) {
  switch (t.scalar_type()) {
    case at::kBFloat16: return kernels::DType::BF16;
    case at::kHalf: return kernels::DType::F16;
    case at::kFloat: return kernels::DType::F32;
    default:
      DFLASH_CHECK(false, "AdamW CUDA kernels: {} has dtype {}; expected float32, bfloat16 or float16", what,
                   c10::toString(t.scalar_type()));
  }
  return kernels::DType::F32;
}
#endif
}  // namespace

const char* AdamW::impl_name() const {
  switch (impl_) {
    case Impl::Single: return "single-tensor";
    case Impl::Aten: return "ATen fused multi-tensor";
    case Impl::Kernels: return "dflash multi-tensor kernels";
  }
  return "?";
}

AdamW::AdamW(NamedTensors params, AdamWOptions opt) : params_(std::move(params)), opt_(opt) {
  at::NoGradGuard ng;
  std::set<std::string> names;
  for (auto& [name, p] : params_) {
    DFLASH_CHECK(p.defined(), "parameter {} is undefined", name);
    DFLASH_CHECK(names.insert(name).second, "parameter name {} appears twice", name);
    const auto dt = p.scalar_type();
    DFLASH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf,
                 "parameter {} has dtype {}; expected float32, bfloat16 or float16", name, c10::toString(dt));
    Slot s;
    s.separate_master = dt != at::kFloat;
    s.master = s.separate_master ? p.detach().to(at::kFloat).clone() : p.detach();
    s.exp_avg = at::zeros_like(s.master);
    s.exp_avg_sq = at::zeros_like(s.master);
    slots_.push_back(std::move(s));
  }
  // auto: fused when every parameter is on one CUDA device; 1 / aten: fused wherever they are, on one
  // device. Fused on CUDA means dflash's kernels (adamw_kernels.h) unless `aten` asks for ATen's
  // _fused_adamw_ path or a parameter is not contiguous; elsewhere ATen's.
  const std::string mode = env_choice(kOptimFusedEnv, "auto", {"auto", "0", "1", "aten"});
  bool one_device = !params_.empty(), all_cuda = !params_.empty(), all_contiguous = true;
  for (const auto& [name, p] : params_) {
    all_cuda = all_cuda && p.is_cuda();
    all_contiguous = all_contiguous && p.is_contiguous();
    if (p.device() != params_.front().second.device()) {
      one_device = false;
      if (mode == "1" || mode == "aten")
        throw_user("{}={}: the fused AdamW needs every parameter on one device; {} is on {}, {} on {}", kOptimFusedEnv,
                   mode, params_.front().first, params_.front().second.device().str(), name, p.device().str());
    }
  }
  const bool fused = one_device && (mode == "1" || mode == "aten" || (mode == "auto" && all_cuda));
  impl_ = fused ? Impl::Aten : Impl::Single;
#ifdef DFLASH_CUDA
  if (fused && mode != "aten" && all_cuda && all_contiguous) impl_ = Impl::Kernels;
#else
  (void)all_contiguous;
#endif
  if (impl_ == Impl::Aten) {
    const at::Device dev = params_.front().second.device();
    step_count_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev));
  }
#ifdef DFLASH_CUDA
  if (impl_ == Impl::Kernels) {
    int64_t chunks = 0;
    for (const auto& [name, p] : params_) chunks += kernels::chunks(p.numel());
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(params_.front().second.device());
    partials_ = at::empty({std::max<int64_t>(chunks, 1)}, f32);
    norm_coef_ = at::zeros({2}, f32);
    norm_host_ = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
  }
#endif
}

double AdamW::grad_norm() const {
  std::vector<at::Tensor> norms;
  for (const auto& [name, p] : params_)
    if (p.grad().defined()) norms.push_back(at::linalg_vector_norm(p.grad().to(at::kFloat), 2));
  if (norms.empty()) return 0.0;
  return at::linalg_vector_norm(at::stack(norms), 2).item<double>();
}

double AdamW::step(double lr, double max_norm) {
  at::NoGradGuard ng;
  if (impl_ == Impl::Kernels) return step_kernels(lr, max_norm);
  const bool fused = impl_ == Impl::Aten;
  // fp32 gradients (a copy for low-precision parameters, the gradient itself for fp32 ones:
  // clipping then scales it in place, as torch does); undefined where a parameter has none.
  std::vector<at::Tensor> grads(params_.size());
  std::vector<at::Tensor> present, copy_dst, copy_src;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].second.grad();
    if (!g.defined()) continue;
    if (g.scalar_type() == at::kFloat) {
      grads[i] = g;
    } else if (fused) {
      // one multi-tensor copy below, into buffers that live for this step only (kept across
      // steps they would add their 4 bytes per parameter to the forward's peak memory)
      grads[i] = at::empty(g.sizes(), g.options().dtype(at::kFloat));
      copy_dst.push_back(grads[i]);
      copy_src.push_back(g);
    } else {
      grads[i] = g.to(at::kFloat);
    }
    present.push_back(grads[i]);
  }
  if (!copy_dst.empty()) at::_foreach_copy_(copy_dst, copy_src);
  at::Tensor total, grad_scale;
  if (!present.empty()) {
    std::vector<at::Tensor> norms;
    if (fused) {
      norms = at::_foreach_norm(present, 2);
    } else {
      for (const at::Tensor& g : present) norms.push_back(at::linalg_vector_norm(g, 2));
    }
    total = at::linalg_vector_norm(at::stack(norms), 2);
    if (max_norm > 0) {
      at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
      if (fused) {
        grad_scale = coef.reciprocal();  // the fused update divides each gradient by it
      } else {
        for (auto& g : present) g.mul_(coef);
      }
    }
  }
  ++steps_;
  if (fused) update_fused(grads, lr, grad_scale);
  else update_single(grads, lr);
  // The step's one host read (the caller logs the norm and stops on a non-finite one), after the
  // update is queued (it reads the clip coefficient on the device): the device is not idle while
  // the host waits. A non-finite norm has reached the weights either way, as in torch.
  return total.defined() ? total.item<double>() : 0.0;
}

double AdamW::step_kernels(double lr, double max_norm) {
#ifdef DFLASH_CUDA
  const at::Device dev = params_.front().second.device();
  c10::cuda::CUDAGuard guard(dev);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(dev.index());
  // Gradients are read where autograd left them (no fp32 copy); a strided one (not what autograd
  // makes for a contiguous parameter) is made contiguous for this step.
  std::vector<at::Tensor> keep;
  std::vector<kernels::GradRef> grads;
  std::vector<kernels::AdamWRef> refs;
  int64_t partials = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& [name, p] = params_[i];
    at::Tensor g = p.grad();
    if (!g.defined()) continue;
    DFLASH_CHECK(g.device() == dev && g.sizes().equals(p.sizes()),
                 "the gradient of parameter {} is {} on {}; the parameter is {} on {}", name, shape_str(g.sizes()),
                 g.device().str(), shape_str(p.sizes()), dev.str());
    if (!g.is_contiguous()) g = keep.emplace_back(g.contiguous());
    const kernels::DType gdt = kernel_dtype(g, "the gradient of " + name);
    Slot& s = slots_[i];
    grads.push_back({g.data_ptr(), g.numel(), gdt});
    kernels::AdamWRef r{};
    r.grad = g.data_ptr();
    r.master = s.master.data_ptr<float>();
    r.exp_avg = s.exp_avg.data_ptr<float>();
    r.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
    r.param = s.separate_master ? p.data_ptr() : nullptr;
    r.numel = g.numel();
    r.grad_dtype = gdt;
    r.param_dtype = kernel_dtype(p, name);
    refs.push_back(r);
    partials += kernels::chunks(g.numel());
  }
  ++steps_;
  if (refs.empty()) return 0.0;
  const int n = static_cast<int>(refs.size());
  float* nc = norm_coef_.data_ptr<float>();
  kernels::grad_sumsq(grads.data(), n, partials_.data_ptr<float>(), stream);
  kernels::grad_norm_clip(partials_.data_ptr<float>(), partials, max_norm, nc, stream);
  // The norm goes to pinned host memory before the update is queued, and the host waits for that
  // copy only: it returns while the update (the step's last ~7 ms on an H200) still runs, so the
  // next step's host work (receiving, block sampling, uploads) overlaps it; the next step's
  // kernels queue behind it on the same stream. The step's one host read, as in step().
  DFLASH_CHECK_CUDA(cudaMemcpyAsync(norm_host_.data_ptr<float>(), nc, sizeof(float), cudaMemcpyDeviceToHost, stream));
  at::cuda::CUDAEvent norm_ready;
  norm_ready.record(at::cuda::getCurrentCUDAStream(dev.index()));
  const kernels::AdamWHyper h{lr, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay, steps_};
  kernels::adamw_update(refs.data(), n, h, max_norm > 0 ? nc + 1 : nullptr, stream);
  norm_ready.synchronize();
  return static_cast<double>(norm_host_.data_ptr<float>()[0]);
#else
  (void)lr;
  (void)max_norm;
  DFLASH_CHECK(false, "AdamW: the CUDA kernels are not built in");
  return 0.0;
#endif
}

void AdamW::update_single(const std::vector<at::Tensor>& grads, double lr) {
  const double b1 = opt_.beta1, b2 = opt_.beta2;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(steps_));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(steps_));
  const double step_size = lr / bc1;
  const double bc2_sqrt = std::sqrt(bc2);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grads[i].defined()) continue;
    Slot& s = slots_[i];
    const at::Tensor& g = grads[i];
    s.master.mul_(1.0 - lr * opt_.weight_decay);
    s.exp_avg.lerp_(g, 1.0 - b1);
    s.exp_avg_sq.mul_(b2).addcmul_(g, g, 1.0 - b2);
    at::Tensor denom = (s.exp_avg_sq.sqrt() / bc2_sqrt).add_(opt_.eps);
    s.master.addcdiv_(s.exp_avg, denom, -step_size);
    if (s.separate_master) params_[i].second.detach().copy_(s.master);
  }
}

void AdamW::update_fused(const std::vector<at::Tensor>& grads, double lr, const at::Tensor& grad_scale) {
  std::vector<at::Tensor> masters, g, m, v, dst, src;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!grads[i].defined()) continue;
    Slot& s = slots_[i];
    masters.push_back(s.master);
    g.push_back(grads[i]);
    m.push_back(s.exp_avg);
    v.push_back(s.exp_avg_sq);
    if (s.separate_master) {
      dst.push_back(params_[i].second.detach());
      src.push_back(s.master);
    }
  }
  if (masters.empty()) return;
  // The kernel reads the step (already counted) for its bias corrections; one scalar serves
  // every tensor (read only). fill_ with a host value queues a kernel: no host sync.
  step_count_.fill_(static_cast<double>(steps_));
  const std::vector<at::Tensor> steps(masters.size(), step_count_);
  at::_fused_adamw_(masters, g, m, v, /*max_exp_avg_sqs=*/{}, steps, lr, opt_.beta1, opt_.beta2, opt_.weight_decay,
                    opt_.eps, /*amsgrad=*/false, /*maximize=*/false,
                    grad_scale.defined() ? std::optional<at::Tensor>(grad_scale) : std::nullopt);
  if (!dst.empty()) at::_foreach_copy_(dst, src);
}

void AdamW::zero_grad() {
  for (auto& [name, p] : params_)
    if (p.grad().defined()) p.mutable_grad().reset();
}

NamedTensors AdamW::state() const {
  NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i].first;
    out.emplace_back("exp_avg." + n, slots_[i].exp_avg);
    out.emplace_back("exp_avg_sq." + n, slots_[i].exp_avg_sq);
    if (slots_[i].separate_master) out.emplace_back("master." + n, slots_[i].master);
  }
  return out;
}

void AdamW::load_state(const NamedTensors& state, int64_t steps, const std::string& origin) {
  at::NoGradGuard ng;
  std::map<std::string, at::Tensor> by_name(state.begin(), state.end());
  std::vector<std::string> missing, bad;
  std::set<std::string> used;
  auto take = [&](const std::string& key, at::Tensor& dst) {
    auto it = by_name.find(key);
    if (it == by_name.end()) {
      missing.push_back(key);
      return;
    }
    used.insert(key);
    if (!it->second.sizes().equals(dst.sizes())) {
      bad.push_back(fmt::format("{} has shape {}, expected {}", key, shape_str(it->second.sizes()),
                                shape_str(dst.sizes())));
      return;
    }
    dst.copy_(it->second);
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string& n = params_[i].first;
    take("exp_avg." + n, slots_[i].exp_avg);
    take("exp_avg_sq." + n, slots_[i].exp_avg_sq);
    if (slots_[i].separate_master) take("master." + n, slots_[i].master);
  }
  std::vector<std::string> unexpected;
  for (const auto& [k, v] : by_name)
    if (!used.count(k)) unexpected.push_back(k);
  if (!missing.empty() || !bad.empty() || !unexpected.empty())
    throw_user("optimizer state {} does not fit this drafter: missing [{}]; unexpected [{}]; {}", origin,
               fmt::join(missing, ", "), fmt::join(unexpected, ", "), fmt::join(bad, "; "));
  for (size_t i = 0; i < params_.size(); ++i)
    if (slots_[i].separate_master) params_[i].second.detach().copy_(slots_[i].master);
  steps_ = steps;
}

LrSchedule LrSchedule::cosine(double lr, double warmup_ratio, int64_t total_steps) {
  if (total_steps <= 0) throw_user("training has {} optimizer steps; expected at least one", total_steps);
  if (warmup_ratio < 0 || warmup_ratio > 1)
    throw_user("config: train.warmup_ratio = {}, expected a fraction in [0, 1]", warmup_ratio);
  LrSchedule s;
  s.lr = lr;
  s.total = total_steps;
  s.warmup = static_cast<int64_t>(warmup_ratio * static_cast<double>(total_steps));  // int() truncation
  return s;
}

double LrSchedule::at(int64_t step) const {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (total <= warmup) return lr;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return lr * 0.5 * (1.0 + std::cos(M_PI * std::min(progress, 1.0)));
}

}  // namespace dflash::optim
