// One instantiation of the tensor-core grouped GEMM (CUTLASS's Hopper ptr-array kernels) and how
// a call runs it, for sm90/grouped_gemm_instance.cu (one translation unit per instantiation, so a
// build compiles them in parallel) and the dispatch in sm90/grouped_gemm.cu. Only sm90/*.cu
// include it (it pulls in CUTLASS).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/grouped_gemm.h"
#include "common/grouped_tc.h"
#include "cuda/cuda_grouped_tc_prep.h"
#include "cuda/cuda_util.h"
#include "sm90/grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

// CUTLASS after fp8jax's headers (its own use of `half` etc. stays inside its namespaces).
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace fp8jax::grouped_tc {

namespace ffi = xla::ffi;
using namespace cute;  // NOLINT: CUTLASS's types are spelt in cute's vocabulary

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
static_assert(sizeof(ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t),
              "the preparation writes each problem as int32 [3]");

// The contraction's block (Float8BlockScaling's 128; the kernels' K tile).
inline constexpr int kBlockK = 128;

// One instantiation: a (row-major, K contiguous) x b (K contiguous per group) -> out (row-major),
// float32 accumulators, the per-group alpha in the epilogue, no source operand. kBlockN: 0 for
// per-group scales; else block scales with 1 x 128 blocks of a and kBlockN x 128 blocks of b
// (128: the rows form's 128 x 128 weights; 1: the contracting form's segment blocks), applied in
// the mainloop at each 128-wide K block (CUTLASS's FP8 blockwise kernel; kFast is then false).
template <typename EA, typename EB, typename EOut, bool kFast, int kBlockN>
struct Variant {
  static constexpr bool kBlocks = kBlockN > 0;
  static constexpr int kScaleN = kBlocks ? kBlockN : 1;  // b's scale rows per block
  static_assert(!(kBlocks && kFast), "the blockwise kernel promotes at every K block");
  using TileShape = Shape<_128, _128, Int<kBlockK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, kBlockK>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using KernelSchedule = std::conditional_t<
      kBlocks, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
      std::conditional_t<kFast,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using LayoutA = std::conditional_t<kBlocks, cute::tuple<cutlass::layout::RowMajor*, LayoutSFA*>,
                                     cutlass::layout::RowMajor*>;
  using LayoutB =
      std::conditional_t<kBlocks, cute::tuple<cutlass::layout::ColumnMajor*, LayoutSFB*>,
                         cutlass::layout::ColumnMajor*>;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  static constexpr int kAlignA = 16, kAlignB = 16, kAlignOut = 16 / sizeof(EOut);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor*, kAlignOut, EOut, cutlass::layout::RowMajor*, kAlignOut,
      EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<EOut, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, EA, LayoutA, kAlignA, EB, LayoutB,
      kAlignB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  static_assert(sizeof(StrideA) <= kStrideBytes && sizeof(StrideB) <= kStrideBytes &&
                sizeof(StrideD) <= kStrideBytes && sizeof(LayoutSFA) <= kStrideBytes &&
                sizeof(LayoutSFB) <= kStrideBytes);
};

using E4 = cutlass::float_e4m3_t;
using E5 = cutlass::float_e5m2_t;
using Bf16 = cutlass::bfloat16_t;

// A row-major stride (leading dim `ld`, unit inner stride; the batch mode unused).
template <typename Stride>
__host__ __device__ Stride RowStride(int64_t ld) {
  static_assert(cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<1>(Stride{}))>> &&
                    decltype(cute::get<1>(Stride{}))::value == 1,
                "the inner dim must be the unit stride");
  Stride s{};
  cute::get<0>(s) = ld;
  return s;
}

// A block-scale layout of CUTLASS's Sm90BlockwiseScaleConfig (MN-major): `mn` rows (or columns)
// in blocks of kVec, `k` contraction in blocks of kBlockK, the K blocks `ld` scales apart.
template <typename Layout, int kVec>
__host__ __device__ Layout ScaleLayout(int32_t mn, int32_t k, int32_t ld) {
  return make_layout(
      make_shape(make_shape(Int<kVec>{}, (mn + kVec - 1) / kVec),
                 make_shape(Int<kBlockK>{}, (k + kBlockK - 1) / kBlockK), int32_t{1}),
      make_stride(make_stride(_0{}, _1{}), make_stride(_0{}, ld), int32_t{0}));
}

// What FillArgs writes, beside the preparation's arrays.
template <typename V>
struct FillPtrs {
  typename V::StrideA* sa;
  typename V::StrideB* sb;
  typename V::StrideD* sd;
  typename V::LayoutSFA* layout_sfa;
  typename V::LayoutSFB* layout_sfb;
  const int32_t* problems;
};

// Every group's strides are the same: a's and b's leading dims along the contraction, out's rows.
// Under block scales each group's scale layouts, from its problem (written by the preparation
// before this launch, on the same stream): a's scales `sfa_ld` apart per K block, b's `sfb_ld`.
template <typename V>
__global__ void FillArgs(FillPtrs<V> f, int64_t lda, int64_t ldb, int64_t ldd, int32_t sfa_ld,
                         int32_t sfb_ld, int64_t groups) {
  for (int64_t g = threadIdx.x; g < groups; g += blockDim.x) {
    f.sa[g] = RowStride<typename V::StrideA>(lda);
    f.sb[g] = RowStride<typename V::StrideB>(ldb);
    f.sd[g] = RowStride<typename V::StrideD>(ldd);
    if constexpr (V::kBlocks) {
      const int32_t m = f.problems[3 * g], n = f.problems[3 * g + 1], k = f.problems[3 * g + 2];
      f.layout_sfa[g] = ScaleLayout<typename V::LayoutSFA, 1>(m, k, sfa_ld);
      f.layout_sfb[g] = ScaleLayout<typename V::LayoutSFB, V::kScaleN>(n, k, sfb_ld);
    }
  }
}

template <typename V>
typename V::Gemm::Arguments ArgumentsOf(int64_t groups, uint8_t* ws, int sms) {
  const Workspace w = WorkspaceOf(groups);
  using Shape3 = ProblemShape::UnderlyingProblemShape;
  using EA = typename V::Mainloop::ElementA;
  using EB = typename V::Mainloop::ElementB;
  typename V::Mainloop::Arguments mainloop{};
  mainloop.ptr_A = reinterpret_cast<const EA**>(ws + w.a);
  mainloop.dA = reinterpret_cast<typename V::StrideA*>(ws + w.stride_a);
  mainloop.ptr_B = reinterpret_cast<const EB**>(ws + w.b);
  mainloop.dB = reinterpret_cast<typename V::StrideB*>(ws + w.stride_b);
  if constexpr (V::kBlocks) {
    mainloop.ptr_SFA = reinterpret_cast<const float**>(ws + w.sfa);
    mainloop.layout_SFA = reinterpret_cast<typename V::LayoutSFA*>(ws + w.layout_sfa);
    mainloop.ptr_SFB = reinterpret_cast<const float**>(ws + w.sfb);
    mainloop.layout_SFB = reinterpret_cast<typename V::LayoutSFB*>(ws + w.layout_sfb);
  }
  typename V::Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {static_cast<int>(groups), reinterpret_cast<Shape3*>(ws + w.problems), nullptr},
      mainloop,
      {{},
       nullptr,
       nullptr,
       reinterpret_cast<typename V::Epilogue::ElementD**>(ws + w.out),
       reinterpret_cast<typename V::StrideD*>(ws + w.stride_out)},
      cutlass::KernelHardwareInfo{0, sms}};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = reinterpret_cast<const float**>(ws + w.alpha_ptrs);
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 1};
  fusion.dBeta = {_0{}, _0{}, 0};
  return args;
}

// One call, as the handler checked it.
struct Call {
  ffi::AnyBuffer a, b, group_sizes, a_scale_inv, b_scale_inv;
  int64_t pad_width = 0;
  bool fast = false;
  ffi::Result<ffi::AnyBuffer> out;
  ffi::Result<ffi::AnyBuffer> workspace;
  grouped::Gemm p{};
};

inline bool Named(ffi::DataType t, const char* name) {
  switch (t) {
    case ffi::DataType::F8E4M3FN:
      return std::strcmp(name, "e4m3") == 0;
    case ffi::DataType::F8E5M2:
      return std::strcmp(name, "e5m2") == 0;
    case ffi::DataType::BF16:
      return std::strcmp(name, "bfloat16") == 0;
    case ffi::DataType::F32:
      return std::strcmp(name, "float32") == 0;
    default:
      return false;
  }
}

// The device's multiprocessor count, read once per device (first from the initialize stage).
int Multiprocessors(int device);  // sm90/grouped_gemm.cu

template <typename V>
ffi::Error RunVariant(cudaStream_t stream, Call& c) {
  constexpr char kOp[] = "grouped_gemm_sm90";
  const int64_t groups = c.p.groups;
  const Workspace w = WorkspaceOf(groups);
  auto* ws = static_cast<uint8_t*>(c.workspace->untyped_data());
  if (static_cast<int64_t>(c.workspace->size_bytes()) < w.bytes) {
    return BadArg(kOp, "workspace is smaller than grouped_tc::WorkspaceOf(G).bytes");
  }
  PrepArgs prep;
  prep.p = c.p;
  prep.width = c.pad_width;
  prep.a = static_cast<const uint8_t*>(c.a.untyped_data());
  prep.b = static_cast<const uint8_t*>(c.b.untyped_data());
  prep.out = static_cast<uint8_t*>(c.out->untyped_data());
  prep.out_bytes = sizeof(typename V::Epilogue::ElementD);
  prep.problems = reinterpret_cast<int32_t*>(ws + w.problems);
  prep.a_ptrs = reinterpret_cast<const void**>(ws + w.a);
  prep.b_ptrs = reinterpret_cast<const void**>(ws + w.b);
  prep.out_ptrs = reinterpret_cast<void**>(ws + w.out);
  prep.alpha = reinterpret_cast<float*>(ws + w.alpha);
  prep.alpha_ptrs = reinterpret_cast<const float**>(ws + w.alpha_ptrs);
  if constexpr (V::kBlocks) {
    prep.sfa = static_cast<const float*>(c.a_scale_inv.untyped_data());
    prep.sfb = static_cast<const float*>(c.b_scale_inv.untyped_data());
    prep.sfa_ptrs = reinterpret_cast<const float**>(ws + w.sfa);
    prep.sfb_ptrs = reinterpret_cast<const float**>(ws + w.sfb);
  }
  FP8JAX_RETURN_IF_ERROR(Prepare(kOp, stream, prep,
                                 static_cast<const int32_t*>(c.group_sizes.untyped_data()),
                                 static_cast<const float*>(c.a_scale_inv.untyped_data()),
                                 static_cast<const float*>(c.b_scale_inv.untyped_data())));
  FillPtrs<V> f{reinterpret_cast<typename V::StrideA*>(ws + w.stride_a),
                reinterpret_cast<typename V::StrideB*>(ws + w.stride_b),
                reinterpret_cast<typename V::StrideD*>(ws + w.stride_out),
                reinterpret_cast<typename V::LayoutSFA*>(ws + w.layout_sfa),
                reinterpret_cast<typename V::LayoutSFB*>(ws + w.layout_sfb),
                prep.problems};
  // the scale grids' K-block strides (common/grouped_tc.h): a's [kb, M] or [nb, K]; b's
  // [G, kb, ceil(N / 128)] or [nb, N]
  const auto sfa_ld = static_cast<int32_t>(c.p.rows);
  const auto sfb_ld = static_cast<int32_t>(c.p.form == grouped::kRows ? c.p.b_grid_rows : c.p.cols);
  FillArgs<V><<<1, 128, 0, stream>>>(f, c.p.depth, c.p.depth, c.p.cols, sfa_ld, sfb_ld, groups);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
    return CudaError(kOp, "FillArgs launch", err);
  }
  int device = 0;
  FP8JAX_RETURN_IF_ERROR(CurrentDevice(kOp, &device));
  auto args = ArgumentsOf<V>(groups, ws, Multiprocessors(device));
  typename V::Gemm gemm;
  if (V::Gemm::get_workspace_size(args) > static_cast<size_t>(kCutlassBytes)) {
    return ffi::Error::Internal(
        "fp8jax grouped_gemm_sm90: CUTLASS needs more workspace than "
        "grouped_tc::kCutlassBytes on this device");
  }
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    return BadArg(kOp, "CUTLASS cannot run this call (its dims' 16-byte alignment)");
  }
  if (gemm.initialize(args, ws + w.cutlass, stream) != cutlass::Status::kSuccess) {
    return ffi::Error::Internal("fp8jax grouped_gemm_sm90: CUTLASS's initialize failed");
  }
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    return ffi::Error::Internal("fp8jax grouped_gemm_sm90: CUTLASS's run failed");
  }
  return ffi::Error::Success();
}

// What a test reads of an instantiation (sm90/grouped_gemm.h's VariantInfo).
template <typename V>
VariantInfo InfoOf(const char* a, const char* b, const char* out, bool fast, int block_n) {
  auto args = ArgumentsOf<V>(256, nullptr, static_cast<int>(kMaxSms));
  return {a,
          b,
          out,
          fast,
          block_n,
          V::Gemm::get_workspace_size(args),
          sizeof(typename V::StrideA),
          sizeof(typename V::StrideB),
          sizeof(typename V::StrideD)};
}

// Entry I of sm90/variants.h, each defined in its own sm90/grouped_gemm_instance.cu.
template <int I>
ffi::Error RunInstance(cudaStream_t stream, Call& c);
template <int I>
VariantInfo InstanceInfo();

}  // namespace fp8jax::grouped_tc
