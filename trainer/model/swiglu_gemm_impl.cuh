// The fused gate/up GEMM + SwiGLU kernel's template (swiglu_gemm.h), included by one .cu file per
// tile configuration (swiglu_gemm_c<N>.cu) so that the configurations compile in parallel.
//
// Main loop: CUTLASS's sm90 collective (TMA loads into a shared-memory ring, wgmma, a producer
// warp and consumer warp groups, persistent tiles), from its CollectiveBuilder. Epilogue: ours.
// A CTA tile is BLK_M x BLK_N columns of the blocked weight, i.e. BLK_N / 2 gate columns followed
// by the BLK_N / 2 matching up columns. In the wgmma accumulator layout a thread holds, for each
// 8-column group of the tile, the same two columns of each of its rows; the up partner of the gate
// value in group j sits in group j + BLK_N / 16 of the same thread. So the epilogue needs no
// shared memory and no shuffles: it rounds both to bf16, forms silu(g) * u in float32, and stores
// the BLK_N / 2 wide result, two adjacent bf16 per 4-byte store.
#pragma once

#include <stdexcept>
#include <string>

#include "trainer/model/swiglu_gemm.h"

#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/detail.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

namespace dflash::model::kernels::swiglu_detail {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

__device__ __forceinline__ float silu_f(float g) { return g / (1.f + __expf(-g)); }

// The operator-style epilogue (CUTLASS wraps it in Sm90TmaWarpSpecializedAdapter): called by the
// consumer threads with their accumulator fragment of one CTA tile.
class SwigluEpilogue {
 public:
  using EpilogueSchedule = cutlass::gemm::EpilogueDefault;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = bf16;
  using ElementD = bf16;
  using ElementOutput = bf16;
  using ElementAccumulator = float;
  using ElementCompute = float;
  struct ThreadEpilogueOp {};  // GemmUniversalAdapter names it; nothing reads it
  using StrideC = Stride<int64_t, Int<1>, int64_t>;
  using StrideD = Stride<int64_t, Int<1>, int64_t>;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;

  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  struct Arguments {
    bf16* act = nullptr;  // [M, N / 2] row-major
    int64_t ld = 0;       // its row stride (N / 2)
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return a.act != nullptr;
  }

  CUTLASS_HOST_DEVICE explicit SwigluEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params_(p) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl, Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    constexpr int kBlkM = size<0>(BlockShapeMNK{});
    constexpr int kBlkN = size<1>(BlockShapeMNK{});
    // one CTA tile holds one gate block of kBlkN / 2 columns and its up block
    // The fragment: ((2 columns, 2 row halves, V column groups of 8), MMA_M, MMA_N); the up half
    // of the tile is column groups V/2 .. V-1 of the same thread only if the atom spans the tile.
    static_assert(rank(FrgLayout{}) == 3, "accumulator fragment must be (values, MMA_M, MMA_N)");
    static_assert(size<2>(FrgLayout{}) == 1, "the MMA atom must span the whole tile width");
    static_assert(rank<0>(FrgLayout{}) == 3 && size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2,
                  "expected the sm90 wgmma accumulator layout");
    constexpr int kGroups = size<0, 2>(FrgLayout{});
    static_assert(kGroups * 8 == kBlkN, "column groups must cover the tile");
    constexpr int kMmaM = size<1>(FrgLayout{});

    const int64_t M = get<0>(problem_shape_mnkl);
    const auto m_coord = get<0>(blk_coord_mnkl);
    const auto n_coord = get<1>(blk_coord_mnkl);

    // Coordinates of every accumulator value within the tile, partitioned as the accumulators.
    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = make_identity_tensor(make_shape(Int<kBlkM>{}, Int<kBlkN>{}));
    Tensor tCcD = thr_mma.partition_C(cD);  // same shape as acc
    const int64_t row0 = int64_t(m_coord) * kBlkM;
    bf16* out = params_.act + int64_t(n_coord) * (kBlkN / 2);

    CUTLASS_PRAGMA_UNROLL
    for (int mm = 0; mm < kMmaM; ++mm) {
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups / 2; ++g) {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h) {
          auto c = tCcD(make_coord(make_coord(0, h, g), mm, 0));
          const int64_t row = row0 + get<0>(c);
          const int col = get<1>(c);  // < kBlkN / 2: a gate column
          float o[2];
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            float gv = float(bf16(acc(make_coord(make_coord(e, h, g), mm, 0))));
            float uv = float(bf16(acc(make_coord(make_coord(e, h, g + kGroups / 2), mm, 0))));
            o[e] = silu_f(gv) * uv;
          }
          if (row < M) {
            cutlass::Array<bf16, 2> pair;
            pair[0] = bf16(o[0]);
            pair[1] = bf16(o[1]);
            *reinterpret_cast<cutlass::Array<bf16, 2>*>(out + row * params_.ld + col) = pair;
          }
        }
      }
    }
  }

 private:
  Params params_;
};

template <class TileShape, class ClusterShape, class KernelSchedule>
struct SwigluGemm {
  static constexpr int64_t kBlock = size<1>(TileShape{}) / 2;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<SwigluEpilogue>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      bf16, cutlass::layout::RowMajor, 8,     // x [T, H]
      bf16, cutlass::layout::ColumnMajor, 8,  // W^T [H, 2I] column-major = W [2I, H] row-major
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static void run(const void* x, int64_t ldx, const void* w, void* act, int64_t T, int64_t H, int64_t I,
                  int max_swizzle, int raster, cudaStream_t stream) {
    const int M = int(T), N = int(2 * I), K = int(H);
    typename Kernel::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGemm;
    args.problem_shape = {M, N, K, 1};
    args.mainloop.ptr_A = static_cast<const bf16*>(x);
    args.mainloop.dA = make_stride(ldx, Int<1>{}, int64_t(M) * ldx);
    args.mainloop.ptr_B = static_cast<const bf16*>(w);
    args.mainloop.dB = make_stride(int64_t(K), Int<1>{}, int64_t(N) * K);
    args.epilogue.act = static_cast<bf16*>(act);
    args.epilogue.ld = I;
    // The device's SM count and the kernel's cluster occupancy, queried once per device (the
    // occupancy query costs tens of microseconds of host time per call).
    int device = 0;
    cudaGetDevice(&device);
    static cutlass::KernelHardwareInfo cached[16];
    if (device >= 16) throw std::runtime_error("swiglu_gemm: device ordinal >= 16");
    if (cached[device].sm_count == 0) cached[device] = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
    args.hw_info = cached[device];
    args.scheduler.max_swizzle_size = max_swizzle < 1 ? 1 : max_swizzle;
    using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;

    Device gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("swiglu_gemm: CUTLASS cannot run this shape: ") +
                               cutlassGetStatusString(st));
    if (Device::get_workspace_size(args) != 0)
      throw std::runtime_error("swiglu_gemm: the kernel unexpectedly asks for a workspace");
    st = gemm.initialize(args, nullptr, stream);
    if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
    if (st != cutlass::Status::kSuccess)
      throw std::runtime_error(std::string("swiglu_gemm: CUTLASS launch failed: ") + cutlassGetStatusString(st));
  }
};

// Configuration C's launch, one explicit specialisation per swiglu_gemm_c<C>.cu.
template <int C>
void run_config(const void* x, int64_t ldx, const void* w, void* act, int64_t T, int64_t H, int64_t I,
                int max_swizzle, int raster, cudaStream_t stream);
#define DFLASH_SWIGLU_DECLARE(C)                                                                        \
  template <>                                                                                           \
  void run_config<C>(const void* x, int64_t ldx, const void* w, void* act, int64_t T, int64_t H, int64_t I, \
                     int max_swizzle, int raster, cudaStream_t stream);
DFLASH_SWIGLU_DECLARE(0)
DFLASH_SWIGLU_DECLARE(1)
DFLASH_SWIGLU_DECLARE(2)
DFLASH_SWIGLU_DECLARE(3)
DFLASH_SWIGLU_DECLARE(4)
DFLASH_SWIGLU_DECLARE(5)
#undef DFLASH_SWIGLU_DECLARE
static_assert(kSwigluConfigs == 6, "one declaration above and one swiglu_gemm_c<N>.cu per configuration");

}  // namespace dflash::model::kernels::swiglu_detail
