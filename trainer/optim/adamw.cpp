#include "trainer/optim/adamw.h"

#include <cmath>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/parse.h"

namespace dflash::optim {
namespace {
std::string shape_str(at::IntArrayRef s) { return fmt::format("[{}]", fmt::join(s, ", ")); }
}  // namespace

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
  // auto: fused when every parameter is on one CUDA device; 1: fused wherever they are, on one device.
  const std::string fused = env_choice(kOptimFusedEnv, "auto", {"auto", "0", "1"});
  bool one_device = !params_.empty(), all_cuda = !params_.empty();
  for (const auto& [name, p] : params_) {
    all_cuda = all_cuda && p.is_cuda();
    if (p.device() != params_.front().second.device()) {
      one_device = false;
      if (fused == "1")
        throw_user("{}=1: the fused AdamW needs every parameter on one device; {} is on {}, {} on {}", kOptimFusedEnv,
                   params_.front().first, params_.front().second.device().str(), name, p.device().str());
    }
  }
  fused_ = one_device && (fused == "1" || (fused == "auto" && all_cuda));
  if (fused_) {
    const at::Device dev = params_.front().second.device();
    step_count_ = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(dev));
  }
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
  // fp32 gradients (a copy for low-precision parameters, the gradient itself for fp32 ones:
  // clipping then scales it in place, as torch does); undefined where a parameter has none.
  std::vector<at::Tensor> grads(params_.size());
  std::vector<at::Tensor> present, copy_dst, copy_src;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].second.grad();
    if (!g.defined()) continue;
    if (g.scalar_type() == at::kFloat) {
      grads[i] = g;
    } else if (fused_) {
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
    if (fused_) {
      norms = at::_foreach_norm(present, 2);
    } else {
      for (const at::Tensor& g : present) norms.push_back(at::linalg_vector_norm(g, 2));
    }
    total = at::linalg_vector_norm(at::stack(norms), 2);
    if (max_norm > 0) {
      at::Tensor coef = at::clamp_max(max_norm / (total + 1e-6), 1.0);
      if (fused_) {
        grad_scale = coef.reciprocal();  // the fused update divides each gradient by it
      } else {
        for (auto& g : present) g.mul_(coef);
      }
    }
  }
  ++steps_;
  if (fused_) update_fused(grads, lr, grad_scale);
  else update_single(grads, lr);
  // The step's one host read (the caller logs the norm and stops on a non-finite one), after the
  // update is queued (it reads the clip coefficient on the device): the device is not idle while
  // the host waits. A non-finite norm has reached the weights either way, as in torch.
  return total.defined() ? total.item<double>() : 0.0;
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
