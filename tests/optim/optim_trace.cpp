// Test helper: runs dflash's AdamW + clipping + schedule over parameters and per-step gradients
// from a safetensors file written by tests/optim/test_optim_reference.py, and writes every
// step's parameters, masters, gradient norms and learning rates for the Python comparison.
//
//   dflash_optim_trace IN.safetensors OUT.safetensors
// IN: "param.<name>" (initial, fp32 or bf16), "grad.<step>.<name>"; metadata: steps, lr,
//     warmup_ratio, beta1, beta2, eps, weight_decay, max_norm, and optionally resume_at (the
//     run is split there through state() -> a file -> load_state() into a fresh optimizer).
// OUT: "param.<step>.<name>", "norm" [steps] f64, "lr" [steps] f64, "state.<key>" at the end.
#include <cstdio>
#include <map>
#include <string>

#include <ATen/ATen.h>

#include "core/error.h"
#include "trainer/model/safetensors.h"
#include "trainer/optim/adamw.h"

using namespace dflash;

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s IN.safetensors OUT.safetensors\n", argv[0]);
    return 1;
  }
  auto in = st::SafeTensors::open(argv[1]);
  const auto& md = in.metadata();
  auto num = [&](const char* k) { return std::stod(md.at(k)); };
  const int64_t steps = static_cast<int64_t>(num("steps"));
  const int64_t resume_at = md.count("resume_at") ? static_cast<int64_t>(num("resume_at")) : -1;
  optim::AdamWOptions o{num("beta1"), num("beta2"), num("eps"), num("weight_decay")};
  auto sched = optim::LrSchedule::cosine(num("lr"), num("warmup_ratio"), steps);

  optim::NamedTensors params;
  for (const auto& n : in.names()) {
    if (n.rfind("param.", 0) != 0) continue;
    at::Tensor p = in.load(n, in.info(n).dtype, at::kCPU).set_requires_grad(true);
    params.emplace_back(n.substr(6), p);
  }
  auto opt = std::make_unique<optim::AdamW>(params, o);
  std::vector<std::pair<std::string, at::Tensor>> out;
  at::Tensor norms = at::zeros({steps}, at::kDouble), lrs = at::zeros({steps}, at::kDouble);
  for (int64_t s = 0; s < steps; ++s) {
    if (s == resume_at) {
      // Checkpoint round trip: state to a file, a fresh optimizer over fresh parameter copies.
      const std::string path = std::string(argv[2]) + ".state";
      auto state = opt->state();
      std::vector<std::pair<std::string, at::Tensor>> saved = state;
      for (auto& [n, p] : params) saved.emplace_back("p." + n, p.detach());
      st::save(path, saved);
      auto back = st::SafeTensors::open(path);
      optim::NamedTensors fresh, loaded;
      for (auto& [n, p] : params)
        fresh.emplace_back(n, back.load("p." + n, p.scalar_type(), at::kCPU).set_requires_grad(true));
      for (auto& [k, v] : state) loaded.emplace_back(k, back.load(k, at::kFloat, at::kCPU));
      params = fresh;
      opt = std::make_unique<optim::AdamW>(params, o);
      opt->load_state(loaded, s, path);
    }
    for (auto& [n, p] : params) p.mutable_grad() = in.load("grad." + std::to_string(s) + "." + n, p.scalar_type(), at::kCPU);
    const double lr = sched.at(s);
    norms[s] = opt->step(lr, std::stod(md.at("max_norm")));
    lrs[s] = lr;
    opt->zero_grad();
    for (auto& [n, p] : params) out.emplace_back("param." + std::to_string(s) + "." + n, p.detach().clone());
  }
  for (auto& [k, v] : opt->state()) out.emplace_back("state." + k, v);
  out.emplace_back("norm", norms);
  out.emplace_back("lr", lrs);
  out.emplace_back("fused", at::full({1}, opt->fused() ? 1 : 0, at::kLong));  // which update ran (DFLASH_OPTIM_FUSED)
  st::save(argv[2], out, {{"steps_done", std::to_string(opt->steps())}});
  return 0;
}
