// dflash_rank: one process of a dflash run (one per GPU, or the CPU demo). Wiring only.
//
//   dflash_rank --config FILE.yaml [section.key=value ...] [--print-config] [--resume]
//               [--comm-check [N]] [--whoami]
//   dflash_rank eval --config FILE.yaml [eval.key=value ...]   (trainer/eval/evaluate.h)
//   dflash_rank regenerate --model DIR --in ITEMS.jsonl --out RESULTS.jsonl ...
//               (one process, no communicator: trainer/eval/regenerate.h)
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "comm/watchdog.h"
#include "comm/whoami.h"
#include "trainer/config.h"
#include "trainer/eval/evaluate.h"
#include "trainer/eval/regenerate.h"
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

const char* kUsage =
    "usage: dflash_rank --config FILE.yaml [section.key=value ...] [--print-config] [--resume]\n"
    "                   [--comm-check [N]] [--whoami]\n";

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
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (s.rfind("--", 0) == 0) {
      dflash::throw_user("unknown option '{}'\n{}", s, kUsage);
    } else {
      a.overrides.push_back(s);
    }
  }
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "regenerate") == 0) {  // one process, no communicator
    try {
      return dflash::eval::regenerate_command(argc - 1, argv + 1);
    } catch (const dflash::UserError& e) {
      std::fprintf(stderr, "dflash_rank: error: %s\n", e.what());
      return dflash::kExitUser;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dflash_rank: internal error: %s\n", e.what());
      return dflash::kExitInternal;
    }
  }
  try {
    if (argc > 1 && std::strcmp(argv[1], "eval") == 0) {  // one process, no communicator
      Args args = parse_args(argc - 1, argv + 1);
      dflash::Config cfg = dflash::load_config(args.config_path, args.overrides);
      if (args.print_config) return std::fputs(dflash::to_yaml(cfg).c_str(), stdout), dflash::kExitOk;
      return dflash::eval::run_eval_command(cfg);
    }
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
  } catch (const std::exception& e) {
    dflash::comm::fail_fast(e);  // logs on this rank, aborts communicators, exits with the code
  }
}
