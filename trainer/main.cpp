// dflash_rank: one process of a dflash run (one per GPU, or the CPU demo). Wiring only.
//
//   dflash_rank --config FILE.yaml [section.key=value ...] [--print-config] [--resume]
//               [--comm-check [N]] [--whoami]          train (the default command)
//   dflash_rank eval --config FILE.yaml [eval.key=value ...]   speculative decoding: real tau
//   dflash_rank regenerate --model DIR --in ITEMS.jsonl --out RESULTS.jsonl ...
//   dflash_rank check-export DIR --target DIR          verify an export before serving
//   dflash_rank --help | --version
// Subcommands are rows of kCommands (name, usage, summary, function); the first argument selects
// one, anything else is the training command.
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"
#include "core/version.h"
#include "comm/watchdog.h"
#include "comm/whoami.h"
#include "trainer/config.h"
#include "trainer/eval/evaluate.h"
#include "trainer/eval/regenerate.h"
#include "trainer/model/check_export.h"
#include "trainer/roles/comm_check.h"
#include "trainer/roles/startup.h"
#include "trainer/roles/training.h"

namespace {

struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  bool print_config = false;
  bool resume = false;
  int64_t comm_check = -1;  // --comm-check [N]: batches of the communication self-test
  bool whoami = false;
};

// ---- subcommands ------------------------------------------------------------------------------
int run_check_export(int argc, char** argv);  // argv[0] is the subcommand's name
int run_eval(int argc, char** argv);
int run_regenerate(int argc, char** argv);

struct Command {
  const char* name;
  const char* usage;    // after "dflash_rank "
  const char* summary;  // one line for --help
  int (*run)(int argc, char** argv);
};
const Command kCommands[] = {
    {"eval", "eval --config FILE.yaml [eval.key=value ...]",
     "speculative decoding with a drafter export: real acceptance length and speedup (docs/eval.md)",
     run_eval},
    {"regenerate", "regenerate --model DIR --in ITEMS.jsonl --out RESULTS.jsonl [...]",
     "the target's own responses to tokenised prompts, batched and resumable (docs/real_model.md)",
     run_regenerate},
    {"check-export", "check-export DIR --target TARGET_DIR",
     "verify an exported drafter against the target it will be served with", run_check_export},
};

// ---- options of the training command ----------------------------------------------------------
struct Option {
  const char* name;
  const char* arg;
  const char* doc;
};
const Option kOptions[] = {
    {"--config", "FILE", "the run's YAML config (configs/*.yaml); without it the built-in defaults"},
    {"--print-config", "", "print the resolved config (every key with its value and doc) and exit"},
    {"--resume", "", "continue from the latest complete training state in <run.dir>/checkpoints"},
    {"--comm-check", "[N]", "communication self-test over N batches (default 200) instead of training"},
    {"--whoami", "", "print each rank's identity (launcher, rank, GPU) and exit"},
    {"--version", "", "print the code version and exit"},
    {"--help", "", "this help (also -h)"},
};

const char* kUsage =
    "usage: dflash_rank --config FILE.yaml [section.key=value ...] [--print-config] [--resume]\n"
    "                   [--comm-check [N]] [--whoami]\n";

std::string usage_lines() {
  std::string s = kUsage;
  for (const auto& c : kCommands) s += fmt::format("       dflash_rank {}\n", c.usage);
  s += "       dflash_rank --help | --version\n";
  return s;
}

std::string help_text() {
  std::string s = usage_lines();
  s += "\nTrains a DFlash drafter for a frozen target: ranks 0..T-1 run the target, T..T+D-1 train the\n"
       "drafter. Launch one process per GPU (CPU: per rank) with mpirun, torchrun or srun:\n"
       "  mpirun -np 4 dflash_rank --config configs/demo.yaml   (docs/training.md, docs/comm.md)\n\n"
       "options:\n";
  for (const auto& o : kOptions)
    s += fmt::format("  {:<20}{}\n", fmt::format("{} {}", o.name, o.arg), o.doc);
  s += fmt::format("  {:<20}{}\n", "section.key=value",
                   "override one key; the value is YAML (train.lr=3e-4, data.shards=[a,b])");
  s += "\ncommands:\n";
  for (const auto& c : kCommands) s += fmt::format("  {:<20}{}\n", c.name, c.summary);
  s += "\nconfig sections and keys (dflash_rank --print-config shows each key's value and doc):\n";
  s += dflash::config_sections_help();
  return s;
}

std::string option_suggestion(const std::string& s) {
  std::vector<std::string> names;
  for (const auto& o : kOptions) names.emplace_back(o.name);
  for (const auto& c : kCommands) names.emplace_back(c.name);
  return dflash::did_you_mean(s, names);
}

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--config") {
      if (i + 1 >= argc) dflash::throw_user("--config needs a file name\n{}", kUsage);
      a.config_path = argv[++i];
    } else if (s.rfind("--config=", 0) == 0) {
      a.config_path = s.substr(9);
    } else if (s == "--print-config") {
      a.print_config = true;
    } else if (s == "--comm-check") {
      a.comm_check = 200;
      if (i + 1 < argc && argv[i + 1][0] >= '0' && argv[i + 1][0] <= '9') {
        std::string n = argv[++i];
        if (n.find_first_not_of("0123456789") != std::string::npos)
          dflash::throw_user("--comm-check expects a number of batches, got '{}'", n);
        a.comm_check = std::stoll(n);
      }
    } else if (s == "--whoami") {
      a.whoami = true;
    } else if (s == "--resume") {
      a.resume = true;
    } else if (s == "--help" || s == "-h") {
      std::fputs(help_text().c_str(), stdout);
      std::exit(0);
    } else if (s == "--version") {
      std::printf("dflash_rank %s\n", dflash::version());
      std::exit(0);
    } else if (s.rfind("-", 0) == 0) {
      dflash::throw_user("unknown option '{}'{} (dflash_rank --help lists the options)", s, option_suggestion(s));
    } else if (s.find('=') == std::string::npos) {
      dflash::throw_user("unexpected argument '{}'{}: expected section.key=value, an option or a command "
                         "(dflash_rank --help)", s, option_suggestion(s));
    } else {
      a.overrides.push_back(s);
    }
  }
  return a;
}

int run_eval(int argc, char** argv) {  // one process, no communicator
  Args args = parse_args(argc, argv);
  dflash::Config cfg = dflash::load_config(args.config_path, args.overrides);
  if (args.print_config) return std::fputs(dflash::to_yaml(cfg).c_str(), stdout), dflash::kExitOk;
  return dflash::eval::run_eval_command(cfg);
}

// One process without a communicator: its errors are printed here, not through fail_fast.
int run_regenerate(int argc, char** argv) {
  try {
    return dflash::eval::regenerate_command(argc, argv);
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "dflash_rank: error: %s\n", e.what());
    return dflash::kExitUser;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dflash_rank: internal error: %s\n", e.what());
    return dflash::kExitInternal;
  }
}

int run_check_export(int argc, char** argv) {
  std::string dir, target;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--target" && i + 1 < argc) target = argv[++i];
    else if (s.rfind("--target=", 0) == 0) target = s.substr(9);
    else if (s == "--help" || s == "-h") { std::printf("usage: dflash_rank %s\n", kCommands[2].usage); return 0; }
    else if (s.rfind("-", 0) == 0 || !dir.empty())
      dflash::throw_user("check-export: unexpected argument '{}'; usage: dflash_rank {}", s, kCommands[2].usage);
    else dir = s;
  }
  if (dir.empty() || target.empty())
    dflash::throw_user("check-export: usage: dflash_rank {}", kCommands[2].usage);
  const auto r = dflash::model::check_export(dir, target);
  std::printf("check-export: %s fits the target %s\n", dir.c_str(), target.c_str());
  for (const auto& f : r.facts) std::printf("  ok    %s\n", f.c_str());
  for (const auto& w : r.warnings) std::printf("  note  %s\n", w.c_str());
  return dflash::kExitOk;
}

int run_train(int argc, char** argv) {
  Args args = parse_args(argc, argv);
  dflash::Config cfg = dflash::load_config(args.config_path, args.overrides);
  if (args.print_config) {
    std::fputs(dflash::to_yaml(cfg).c_str(), stdout);
    return dflash::kExitOk;
  }
  auto rank = dflash::roles::start_rank(cfg, /*check_layout=*/!args.whoami);
  int rc = dflash::kExitOk;
  if (args.whoami) rc = dflash::comm::run_whoami(rank.id, cfg.comm.startup_timeout_s);
  else if (args.comm_check >= 0) rc = dflash::roles::run_comm_check(rank, cfg, args.comm_check);
  else rc = dflash::run_training(cfg, rank, args.resume);
  dflash::comm::finalize_mpi();
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1)
      for (const auto& c : kCommands)
        if (std::strcmp(argv[1], c.name) == 0) return c.run(argc - 1, argv + 1);
    return run_train(argc, argv);
  } catch (const std::exception& e) {
    dflash::comm::fail_fast(e);  // logs on this rank, aborts communicators, exits with the code
  }
}
