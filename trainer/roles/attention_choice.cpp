#include "trainer/roles/attention_choice.h"

#include <fmt/format.h>

#ifdef DFLASH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "core/error.h"

namespace dflash::roles {

DeviceFacts device_facts(const c10::Device& device) {
  DeviceFacts f;
  f.kernel_built = attention::kernel_available();
  f.cuda = device.is_cuda();
#ifdef DFLASH_CUDA
  if (f.cuda) {
    const int idx = device.has_index() ? device.index() : 0;
    if (cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, idx) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, idx) != cudaSuccess)
      f.major = f.minor = 0;  // unknown: the kernel is not chosen by auto
  }
#endif
  return f;
}

AttentionChoice choose_attention(const Config& cfg, const DeviceFacts& f, int64_t head_dim) {
  const std::string& want = cfg.drafter.attention;
  AttentionChoice c;
  if (want == "sdpa") {
    c.why = "sdpa (drafter.attention=sdpa: the reference path, chosen explicitly)";
    return c;
  }
  // What keeps the kernel from running here ("" if nothing does).
  std::string missing;
  if (!f.kernel_built)
    missing = "this binary has no CUDA attention kernel (built without CUDA)";
  else if (!f.cuda)
    missing = "this rank runs on the CPU";
  else if (!(f.major == 8 || (f.major == 9 && f.minor == 0)))
    missing = fmt::format("the GPU is sm_{}{}, the kernel runs on sm_80/sm_86/sm_89/sm_90", f.major, f.minor);
  else if (head_dim != 64 && head_dim != 128)
    missing = fmt::format("the drafter's head_dim is {}, the kernel supports 64 and 128", head_dim);
  const std::string where = f.cuda ? fmt::format("CUDA sm_{}{}", f.major, f.minor) : std::string("CPU");
  if (want == "kernel") {
    if (!missing.empty())
      throw_user("{}: key 'drafter.attention' is kernel, but {}; use auto (the kernel where it runs, else sdpa) "
                 "or sdpa", key_origin(cfg, "drafter.attention"), missing);
    c.backend = attention::Backend::Kernel;
    c.why = fmt::format("kernel (drafter.attention=kernel: {}, head_dim {})", where, head_dim);
    return c;
  }
  // auto (config.cpp admits nothing else)
  if (missing.empty()) {
    c.backend = attention::Backend::Kernel;
    c.why = fmt::format("kernel (drafter.attention=auto: {}, head_dim {}, kernel built)", where, head_dim);
  } else {
    c.why = fmt::format("sdpa (drafter.attention=auto: {})", missing);
  }
  return c;
}

}  // namespace dflash::roles
