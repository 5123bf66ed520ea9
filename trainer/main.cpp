// dflash_rank: one process of a dflash run (one per GPU, or the CPU demo). Wiring only.
//
//   dflash_rank --config FILE.yaml [section.key=value ...] [--print-config] [--resume]
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "comm/error.h"
#include "comm/log.h"
#include "trainer/config.h"

namespace {

struct Args {
  std::string config_path;
  std::vector<std::string> overrides;
  bool print_config = false;
  bool resume = false;
};

const char* kUsage =
    "usage: dflash_rank --config FILE.yaml [section.key=value ...] [--print-config] [--resume]\n";

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
  try {
    Args args = parse_args(argc, argv);
    dflash::Config cfg = dflash::load_config(args.config_path, args.overrides);
    if (args.print_config) {
      std::fputs(dflash::to_yaml(cfg).c_str(), stdout);
      return dflash::kExitOk;
    }
    dflash::log::info("nothing to run yet");
    return dflash::kExitOk;
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "dflash_rank: error: %s\n", e.what());
    return dflash::kExitUser;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dflash_rank: internal error: %s\n", e.what());
    return dflash::kExitInternal;
  }
}
