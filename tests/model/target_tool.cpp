// target_tool: a small CLI over trainer/model for the Python reference tests (tests/model/).
//
//   target_tool st-copy IN OUT [--dtype bf16|f16|f32]
//       read IN (a .safetensors file or checkpoint directory) with our reader, write every
//       tensor (converted to --dtype if given, else as stored) to OUT with our writer.
//
// Exit codes as dflash_rank: 0 ok, 2 bad input (UserError, one line on stderr), 1 internal.
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/error.h"
#include "trainer/model/safetensors.h"

namespace {

using dflash::throw_user;

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "bf16") return at::kBFloat16;
  if (s == "f16") return at::kHalf;
  if (s == "f32") return at::kFloat;
  throw_user("unknown --dtype '{}' (bf16, f16, f32)", s);
}

int st_copy(const std::vector<std::string>& args) {
  if (args.size() < 2) throw_user("usage: target_tool st-copy IN OUT [--dtype bf16|f16|f32]");
  bool convert = false;
  at::ScalarType dtype = at::kFloat;
  for (size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--dtype" && i + 1 < args.size()) {
      convert = true;
      dtype = parse_dtype(args[++i]);
    } else {
      throw_user("st-copy: unknown argument '{}'", args[i]);
    }
  }
  auto st = dflash::st::SafeTensors::open(args[0]);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& name : st.names()) {
    const auto& info = st.info(name);
    out.emplace_back(name, st.load(name, convert ? dtype : info.dtype, at::kCPU, &info.shape));
  }
  dflash::st::save(args[1], out, st.metadata());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) throw_user("usage: target_tool st-copy|dump|generate ...");
    std::string cmd = argv[1];
    std::vector<std::string> args(argv + 2, argv + argc);
    if (cmd == "st-copy") return st_copy(args);
    throw_user("unknown command '{}'", cmd);
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "target_tool: error: %s\n", e.what());
    return dflash::kExitUser;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "target_tool: internal error: %s\n", e.what());
    return dflash::kExitInternal;
  }
}
