// trainer/roles/run_info.h: the run header, the data record, the closing lines.
#include "trainer/roles/run_info.h"

#include <unistd.h>

#include <algorithm>
#include <climits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"
#include "core/version.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/metrics/metrics.h"

namespace dflash::roles {
namespace {

// Shell quoting for the printed commands: bare when safe, else single quotes.
std::string sh(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,@+") ==
                        std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// This binary, relative to the working directory when it lies below it.
std::string self_path() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "dflash_rank";
  std::string exe(buf, static_cast<size_t>(n));
  char cwd[PATH_MAX];
  if (::getcwd(cwd, sizeof(cwd))) {
    const std::string base = std::string(cwd) + "/";
    if (exe.rfind(base, 0) == 0) return exe.substr(base.size());
  }
  return exe;
}

// The record fields of one prepare_info.json that an export carries (the rest stays in the run
// directory's copy): what the data was made for and how much of it there is.
std::string data_summary(const std::string& path) {
  const json::Value v = json::parse_file(path);
  std::string out = "{" + json::quote("prepare_info") + ": " + json::quote(path);
  for (const char* k : {"model", "chat_template_sha256", "chat_template_kwargs", "thinking", "supervise",
                        "block_size", "max_seq_len", "written", "tokens", "supervised_tokens"}) {
    if (const auto* f = v.find(k)) out += ", " + json::quote(k) + ": " + f->dump();
  }
  return out + "}";
}

std::string human_count(int64_t n) { return metrics::human(static_cast<double>(n)); }

}  // namespace

std::vector<std::string> prepare_info_files(const Config& cfg) {
  std::vector<std::string> out;
  for (const auto& s : cfg.data.shards) {
    const std::string dir = files::is_dir(s) ? s : files::parent(s);
    const std::string p = files::join(dir, "prepare_info.json");
    if (files::exists(p) && std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  }
  return out;
}

void copy_data_record(const Config& cfg) {
  const auto infos = prepare_info_files(cfg);
  if (infos.empty()) return;
  std::string text;
  if (infos.size() == 1) {
    text = files::read_file(infos[0]);
  } else {
    text = "[\n";
    for (size_t i = 0; i < infos.size(); ++i) text += (i ? ",\n" : "") + files::read_file(infos[i]);
    text += "\n]\n";
  }
  files::make_dirs(cfg.run.dir);
  files::write_file_atomic(files::join(cfg.run.dir, "prepare_info.json"), text);
}

model::ExportRecord export_record(const Config& cfg, const RunPlan& p) {
  model::ExportRecord r;
  r.target_path = cfg.target.model_dir;
  r.target_model_type = p.target_config.model_type;
  r.target_num_layers = p.target_config.num_hidden_layers;
  r.target_hidden_size = p.target_config.hidden_size;
  r.target_vocab_size = p.target_config.vocab_size;
  const auto infos = prepare_info_files(cfg);
  if (infos.size() == 1) {
    r.data_json = data_summary(infos[0]);
  } else if (!infos.empty()) {
    r.data_json = "[";
    for (size_t i = 0; i < infos.size(); ++i) r.data_json += (i ? ", " : "") + data_summary(infos[i]);
    r.data_json += "]";
  }
  r.version = version();
  return r;
}

std::vector<std::string> run_header(const Config& cfg, const RankContext& ctx, const RunPlan& p) {
  std::vector<std::string> h;
  const auto& id = ctx.id;
  const auto& t = p.target_config;
  h.push_back(fmt::format("dflash {} | run '{}'", version(), cfg.run.name));
  h.push_back(fmt::format("  launch    {}, world size {} (rank 0 on {}), device {}", comm::source_name(id.source),
                          id.world_size, id.host, p.device.str()));
  h.push_back(fmt::format("  layout    {} target + {} drafter rank(s){}; {} batches/step ({} x grad_accum {})",
                          p.target_ranks, p.drafter_ranks, p.colocated ? " (colocated)" : "", p.batches_per_step,
                          p.drafter_ranks, p.grad_accum));
  h.push_back(fmt::format("  target    {} ({}, {} layers, hidden {}, vocab {}); captured layers [{}]",
                          cfg.target.model_dir, t.model_type, t.num_hidden_layers, t.hidden_size, t.vocab_size,
                          fmt::join(p.layer_ids, ", ")));
  h.push_back(fmt::format("  drafter   {} layers, block {}, {} anchors/sequence, attention {}{}", p.spec.num_layers,
                          p.spec.block_size, cfg.drafter.num_anchors, cfg.drafter.attention,
                          cfg.drafter.init_from.empty() ? "" : ", from " + cfg.drafter.init_from));
  h.push_back(fmt::format("  data      {} shard(s), {} documents, {} tokens ({})", p.data->shard_paths().size(),
                          human_count(p.data->num_docs()), human_count(p.data->num_tokens()),
                          fmt::join(cfg.data.shards, ", ")));
  for (const auto& info : prepare_info_files(cfg)) {
    const json::Value v = json::parse_file(info);
    std::string what;
    for (const char* k : {"chat_template_sha256", "chat_template_kwargs", "thinking", "supervise"}) {
      const auto* f = v.find(k);
      if (!f) continue;
      std::string text = f->dump();
      if (std::string(k) == "chat_template_sha256" && text.size() > 14) text = text.substr(0, 13) + "...\"";
      what += fmt::format("{}{} {}", what.empty() ? "" : ", ", k, text);
    }
    h.push_back(fmt::format("  prepared  {}{}{}", info, what.empty() ? "" : ": ", what));
  }
  const int64_t epochs = p.data->locate(std::max<int64_t>(0, p.total_batches - 1)).first + 1;
  h.push_back(fmt::format("  training  steps {}..{} ({} epoch(s)), lr {:g}, log every {} step(s){}", p.start_step,
                          p.total_steps, epochs, cfg.train.lr, cfg.log.interval,
                          p.resume ? ", resuming from " + p.resume_dir : ""));
  const std::string& d = cfg.run.dir;
  h.push_back(fmt::format("  run dir   {}: metrics {}, TensorBoard {} (tensorboard --logdir {})", d,
                          files::join(d, "metrics.jsonl"), files::join(d, "tensorboard"), files::parent(d)));
  h.push_back(fmt::format("            checkpoints {}, exports {} (every {} steps and final)",
                          files::join(d, "checkpoints"), files::join(d, "exports"), cfg.checkpoint.export_every));
  return h;
}

std::vector<std::string> finish_lines(const Config& cfg, const RunPlan& p, const std::string& dir) {
  std::vector<std::string> l;
  const std::string bin = self_path();
  l.push_back(fmt::format("export: {} (config.json, model.safetensors, dflash.py)", dir));
  l.push_back(fmt::format("  check:    {} check-export {} --target {}", bin, sh(dir), sh(cfg.target.model_dir)));
  std::string eval = fmt::format("{} eval", bin);
  if (!cfg.source_path.empty()) eval += " --config " + sh(cfg.source_path);
  for (const auto& o : cfg.overrides)
    if (o.rfind("eval.", 0) != 0) eval += " " + sh(o);
  l.push_back(fmt::format("  evaluate: {} eval.drafter_dir={}", eval, sh(dir)));
  l.push_back(fmt::format("  SGLang:   python -m sglang.launch_server --model-path {} --speculative-algorithm DFLASH "
                          "--speculative-draft-model-path {} --speculative-num-draft-tokens {} --dtype bfloat16",
                          sh(cfg.target.model_dir), sh(dir), p.spec.block_size));
  l.push_back(fmt::format("  vLLM:     vllm serve {} --speculative-config '{{\"method\": \"dflash\", \"model\": \"{}\", "
                          "\"num_speculative_tokens\": {}}}' --attention-backend flash_attn",
                          sh(cfg.target.model_dir), dir, p.spec.block_size - 1));
  l.push_back(fmt::format("  transformers: AutoModel.from_pretrained(\"{}\", trust_remote_code=True)", dir));
  return l;
}

}  // namespace dflash::roles
