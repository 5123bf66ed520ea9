#include "trainer/roles/plan.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/log.h"
#include "trainer/model/export.h"
#include "trainer/model/target.h"

namespace dflash::roles {

RunPlan make_plan(const Config& cfg, const Schedule& schedule, int world_size, int gpu, bool resume) {
  RunPlan p;
  p.colocated = schedule.colocated();
  p.target_ranks = schedule.targets();
  p.drafter_ranks = schedule.drafters();
  if (cfg.train.grad_accum < 1) throw_user("config: train.grad_accum = {}, expected >= 1", cfg.train.grad_accum);
  p.grad_accum = cfg.train.grad_accum;
  p.batches_per_step = schedule.batches_per_step(p.grad_accum);

  // The target and the drafter's shape (every rank: a mismatch is reported everywhere).
  if (cfg.target.model_dir.empty()) throw_user("config: target.model_dir is empty; expected a Hugging Face model directory");
  check_paths(cfg);  // a missing directory or shard names its key (and the override that set it)
  p.target_config = model::load_hf_config(cfg.target.model_dir);
  p.target_info = model::target_info(p.target_config);
  model::check_target_weights(cfg.target.model_dir, p.target_config);  // headers only, before anything is written
  if (!cfg.drafter.init_from.empty()) {
    p.spec = model::read_drafter_dir(cfg.drafter.init_from);  // config and tensor shapes, nothing allocated
    p.spec.check_fits(p.target_info, cfg.drafter.init_from + "/config.json (drafter.init_from)");
    if (p.spec.block_size != cfg.drafter.block_size)
      throw_user("drafter.init_from {}: block_size {} differs from drafter.block_size {}", cfg.drafter.init_from,
                 p.spec.block_size, cfg.drafter.block_size);
  } else {
    p.spec = model::make_spec(p.target_info, cfg.drafter, cfg.target.layer_ids, cfg.target.num_features);
    p.spec.check_fits(p.target_info, fmt::format("drafter config for target {}", cfg.target.model_dir));
  }
  p.layer_ids = p.spec.target_layer_ids;
  for (size_t i = 1; i < p.layer_ids.size(); ++i)
    if (p.layer_ids[i] <= p.layer_ids[i - 1])
      throw_user("target.layer_ids must be strictly increasing, got [{}]", fmt::join(p.layer_ids, ", "));
  p.gamma = model::resolve_gamma(p.spec.block_size, cfg.drafter.gamma);

  // The data (every rank opens and validates it).
  data::DataOptions d;
  d.shards = cfg.data.shards;
  d.batch_tokens = cfg.data.batch_tokens;
  d.max_seq_len = cfg.data.max_seq_len;
  d.seed = cfg.run.seed;
  d.vocab_limit = p.target_config.vocab_size;
  p.data = std::make_shared<data::Dataset>(d);

  if (cfg.train.epochs < 1 && cfg.train.max_steps <= 0)
    throw_user("config: train.epochs = {} and train.max_steps = {}; set one of them", cfg.train.epochs,
               cfg.train.max_steps);
  if (cfg.train.max_steps > 0) {
    p.total_steps = cfg.train.max_steps;
  } else {
    const int64_t batches = p.data->batches_in_epochs(cfg.train.epochs);
    p.total_steps = batches / p.batches_per_step;
    if (p.total_steps == 0)
      throw_user("data: {} epoch(s) give {} batches, fewer than one optimizer step needs (layout.drafter_ranks x "
                 "train.grad_accum = {}); add data, lower data.batch_tokens or set train.max_steps",
                 cfg.train.epochs, batches, p.batches_per_step);
  }
  p.total_batches = p.total_steps * p.batches_per_step;

  p.signature.world_size = world_size;
  p.signature.target_ranks = schedule.targets();
  p.signature.drafter_ranks = schedule.drafters();
  p.signature.colocated = p.colocated;
  p.signature.grad_accum = p.grad_accum;
  p.signature.seed = cfg.run.seed;
  p.signature.batch_tokens = cfg.data.batch_tokens;
  p.signature.max_seq_len = cfg.data.max_seq_len;
  p.signature.data_docs = p.data->num_docs();
  p.signature.data_tokens = p.data->num_tokens();

  if (resume) {
    p.resume = ckpt::find_latest_state(cfg.run.dir, &p.resume_dir);
    if (!p.resume)
      throw_user("--resume: no complete training state under {}/checkpoints (start without --resume)", cfg.run.dir);
    ckpt::check_resumable(*p.resume, p.signature, p.resume_dir);
    if (p.resume->next_batch != p.resume->step * p.batches_per_step)
      throw_user("cannot resume from {}: its batch cursor {} is not step {} x {} batches per step", p.resume_dir,
                 p.resume->next_batch, p.resume->step, p.batches_per_step);
    if (p.resume->step > p.total_steps)
      throw_user("cannot resume from {}: it is at step {}, beyond this run's {} steps", p.resume_dir, p.resume->step,
                 p.total_steps);
    p.start_step = p.resume->step;
  }
  p.start_batch = p.start_step * p.batches_per_step;

  const bool on_gpu = gpu >= 0;
  p.device = on_gpu ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu)) : at::Device(at::kCPU);
  p.target_dtype = model::resolve_dtype(cfg.target.dtype, p.device, "target.dtype");
  p.drafter_dtype = on_gpu ? at::kBFloat16 : at::kFloat;
  // the fused backward's probe: where it is asked for, or where the header would recommend it (long documents)
  const bool probe_fused = cfg.drafter.attention_backward == "fused" || cfg.data.max_seq_len >= kFusedHintSeqLen;
  p.attention = choose_attention(cfg, device_facts(p.device, probe_fused), p.spec.head_dim);
  return p;
}

double drafter_step_flops(const model::DrafterSpec& s, int64_t S, int64_t Q) {
  const double H = static_cast<double>(s.hidden_size), qd = static_cast<double>(s.num_heads * s.head_dim);
  const double kvd = static_cast<double>(s.num_kv_heads * s.head_dim), I = static_cast<double>(s.intermediate_size);
  const double K = static_cast<double>(s.num_features()), V = static_cast<double>(s.vocab_size);
  const double dS = static_cast<double>(S), dQ = static_cast<double>(Q);
  double fwd = 2.0 * dS * K * H * H;  // fc
  const double layer = 2.0 * dQ * H * qd * 2.0           // q_proj, o_proj
                       + 2.0 * (dS + dQ) * H * kvd * 2.0  // k_proj, v_proj over context + block
                       + 2.0 * 2.0 * dQ * (dS + dQ) * qd  // QK^T and PV (dense)
                       + 2.0 * dQ * H * I * 3.0;          // gate, up, down
  fwd += static_cast<double>(s.num_layers) * layer;
  fwd += 2.0 * dQ * H * V;  // LM head
  return 3.0 * fwd;
}

}  // namespace dflash::roles
