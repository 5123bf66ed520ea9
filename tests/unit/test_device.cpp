// core/device.h's WarmUp: the thread that sets up cuBLAS and the first kernels' modules while a
// rank loads its weights. On CPU it does nothing; on CUDA it must finish without an error (wait()
// rethrows what the thread threw: a wrong op signature or a device fault shows here) and leave the
// device usable from the calling thread. Its effect on the first step is a benchmark
// (bench/gpu/first_step.sh), not a timed assertion.
#include <gtest/gtest.h>

#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>

#include <stdexcept>

#include "core/device.h"
#include "tests/gpu_test.h"

namespace dflash::device {
namespace {

TEST(DeviceWarmUp, DoesNothingOnCpu) {
  bool ran = false;
  WarmUp w(c10::Device(c10::kCPU), [&ran] { ran = true; });
  w.wait();
  w.wait();  // joining twice is fine
  EXPECT_FALSE(ran) << "the warm-up ran on the CPU, where there is nothing to set up";
}

TEST(DeviceWarmUp, FinishesOnCudaAndLeavesTheDeviceUsable) {
  if (!dflash::test::have_cuda()) GTEST_SKIP() << "no CUDA device";
  const c10::Device d(c10::kCUDA, 0);
  bool ran = false;
  {
    WarmUp w(d, [&ran] { ran = true; });
    EXPECT_NO_THROW(w.wait());
  }
  EXPECT_TRUE(ran) << "the extra warm-up did not run";
  {
    WarmUp w(d, [] { throw std::runtime_error("boom"); });
    EXPECT_THROW(w.wait(), std::runtime_error) << "wait() rethrows what the thread threw";
  }
  { WarmUp dropped(d); }  // the destructor joins a thread not waited for
  const auto opt = at::TensorOptions().device(d).dtype(at::kBFloat16);
  at::Tensor c = at::mm(at::ones({64, 32}, opt), at::ones({32, 16}, opt));
  EXPECT_EQ(c.sum().item<float>(), 64.f * 16.f * 32.f);
}

}  // namespace
}  // namespace dflash::device
