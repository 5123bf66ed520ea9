#include "trainer/roles/attention_choice.h"

#include <fmt/format.h>

#ifdef DFLASH_CUDA
#include <cuda_runtime_api.h>
#endif

#include "core/error.h"

namespace dflash::roles {

DeviceFacts device_facts(const c10::Device& device, bool probe_fused) {
  DeviceFacts f;
  f.kernel_built = attention::kernel_available();
  f.cuda = device.is_cuda();
#ifdef DFLASH_CUDA
  if (f.cuda) {
    const int idx = device.has_index() ? device.index() : 0;
    if (cudaDeviceGetAttribute(&f.major, cudaDevAttrComputeCapabilityMajor, idx) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.minor, cudaDevAttrComputeCapabilityMinor, idx) != cudaSuccess)
      f.major = f.minor = 0;  // unknown: the kernel is not chosen by auto
    if (probe_fused && f.kernel_built && f.major == 9 && f.minor == 0) {
      int prev = 0;  // the probe runs on the current device: this rank's, then back
      if (cudaGetDevice(&prev) == cudaSuccess && cudaSetDevice(idx) == cudaSuccess) {
        f.fused_backward = attention::fused_backward_available(128);
        cudaSetDevice(prev);
      }
    }
  }
#endif
  (void)probe_fused;
  return f;
}

namespace {

AttentionChoice choose_backend(const Config& cfg, const DeviceFacts& f, int64_t head_dim) {
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

}  // namespace

AttentionChoice choose_attention(const Config& cfg, const DeviceFacts& f, int64_t head_dim) {
  AttentionChoice c = choose_backend(cfg, f, head_dim);
  const bool fused_runs = c.backend == attention::Backend::Kernel && head_dim == 128 && f.fused_backward;
  const bool long_docs = cfg.data.max_seq_len >= kFusedHintSeqLen;
  if (cfg.drafter.attention_backward == "auto") {
    if (fused_runs && long_docs) {
      c.fused_backward = true;
      c.why += fmt::format(", fused backward (drafter.attention_backward=auto: {}-token documents)", cfg.data.max_seq_len);
    }
    return c;
  }
  if (cfg.drafter.attention_backward != "fused") {  // split (validate.cpp admits nothing else)
    if (fused_runs && long_docs)
      c.why += fmt::format(", split backward (drafter.attention_backward=fused (or auto) runs {}-token documents faster: the "
                           "1 x 40000 step by 4% on an H100)",
                           cfg.data.max_seq_len);
    return c;
  }
  std::string missing;
  if (c.backend != attention::Backend::Kernel)
    missing = fmt::format("the drafter runs the sdpa path ({})", c.why);
  else if (head_dim != 128)
    missing = fmt::format("the drafter's head_dim is {}, the fused backward is built for 128", head_dim);
  else if (!f.fused_backward)
    missing = f.major == 9 && f.minor == 0 ? std::string("this binary has no sm_90a code (DFLASH_CUDA_ARCHS)")
                                           : fmt::format("the GPU is sm_{}{}, the fused backward runs on sm_90",
                                                         f.major, f.minor);
  if (!missing.empty())
    throw_user("{}: key 'drafter.attention_backward' is fused, but {}; use auto (the default) or split",
               key_origin(cfg, "drafter.attention_backward"), missing);
  c.fused_backward = true;
  c.why += ", fused backward (drafter.attention_backward=fused)";
  return c;
}

}  // namespace dflash::roles
