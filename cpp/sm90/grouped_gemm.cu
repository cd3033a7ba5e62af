// The ragged grouped FP8 GEMM on Hopper's tensor cores (sm_90a): CUTLASS's grouped ("ptr-array")
// warp-specialized GEMM, its problem shapes and pointers written on the device from the group sizes
// (cuda/cuda_grouped_tc_prep.cu), so one call is two small launches and the GEMM, with no host
// synchronisation (CUDA-graph compatible) and no allocation (the workspace is an XLA result).
//
// FFI target fp8jax_grouped_gemm_sm90 (CUDA only, built with CUTLASS's headers; Python:
// fp8jax/ops/gemms/grouped_gemm.py, opt-in by gemm_options(grouped_tensor_cores=True)). Operands
// as fp8jax_grouped_gemm's (ops/gemms.h, checked by its Check; its block attributes too, the scale
// grids transposed as common/grouped_tc.h says), and two more attributes: pad_width (the
// contracting form's operands come padded so that each group's columns start at a multiple of it,
// common/grouped_tc.h) and fast_accum (the forward GEMM's FP8 fast accumulation; else split, as
// dgrad and wgrad take). Results: out, workspace (uint8, grouped_tc::WorkspaceOf(G).bytes).
//
// Only the instantiations fp8jax's layers call are compiled (sm90/variants.h, one translation unit
// each); fp8jax/ops/gemms/grouped_gemm.py's SM90_VARIANTS lists the same (a test compares), and
// Python sends any other call to the CUDA-core kernel. Numerics: not the CUDA-core kernel's bits:
// the tensor cores sum in their own order, and with fast accumulation in reduced precision
// (docs/design.md states the tolerance).
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/cuda_handler.h"
#include "ops/gemms.h"
#include "sm90/grouped_gemm_variant.cuh"
#include "sm90/variants.h"

namespace fp8jax::grouped_tc {

#define FP8JAX_SM90_COUNT_(...) +1
static_assert(0 FP8JAX_SM90_VARIANTS(FP8JAX_SM90_COUNT_) == FP8JAX_SM90_INSTANCES,
              "FP8JAX_SM90_INSTANCES must count sm90/variants.h's entries (the build compiles "
              "that many instances)");
#undef FP8JAX_SM90_COUNT_

// Each entry's RunInstance and InstanceInfo, defined in its own translation unit.
#define FP8JAX_SM90_DECLARE_(I, A, B, O, F, N, na, nb, no)  \
  template <>                                               \
  ffi::Error RunInstance<I>(cudaStream_t stream, Call & c); \
  template <>                                               \
  VariantInfo InstanceInfo<I>();
FP8JAX_SM90_VARIANTS(FP8JAX_SM90_DECLARE_)
#undef FP8JAX_SM90_DECLARE_

int Multiprocessors(int device) {
  static int counts[64] = {};
  if (device < 0 || device >= 64) return 0;
  if (counts[device] == 0) {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess) {
      counts[device] = sms;
    }
  }
  return counts[device];
}

namespace {

constexpr char kOp[] = "grouped_gemm_sm90";

ffi::Error Dispatch(cudaStream_t stream, Call& c) {
  const ffi::DataType ta = c.a.element_type(), tb = c.b.element_type(), to = c.out->element_type();
  // block scales: the blockwise kernel, which has no fast accumulation
  const int64_t block_n = c.p.blocks ? c.p.b_block_rows : 0;
  const bool fast = c.fast && !c.p.blocks;
#define FP8JAX_SM90_DISPATCH_(I, A, B, O, F, N, na, nb, no)                                  \
  if (Named(ta, na) && Named(tb, nb) && Named(to, no) && fast == (F == 1) && block_n == N) { \
    return RunInstance<I>(stream, c);                                                        \
  }
  FP8JAX_SM90_VARIANTS(FP8JAX_SM90_DISPATCH_)
#undef FP8JAX_SM90_DISPATCH_
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "fp8jax grouped_gemm_sm90: no instantiation for these dtypes, scales and "
                    "accumulation (fp8jax/ops/gemms/grouped_gemm.py's SM90_VARIANTS lists them)");
}

// Block scales the blockwise kernel takes: float32, 1 x 128 blocks of a with 128 x 128 blocks of
// b (rows) or the same 1 x 128 segment blocks (contracting, padded to them).
ffi::Error CheckBlocks(const grouped::Gemm& p, int64_t pad_width) {
  const bool rows = p.form == grouped::kRows;
  if (p.e8m0 || p.width != kBlockK || p.b_block_rows != (rows ? 128 : 1)) {
    return BadArg(kOp,
                  "block scales must be float32 1 x 128 blocks of a with 128 x 128 blocks of "
                  "b (rows) or 1 x 128 segment blocks of both (contracting)");
  }
  if (!rows && pad_width != kBlockK) {
    return BadArg(kOp, "block-scaled contracting operands must come padded to the block width");
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                   ffi::AnyBuffer group_sizes, ffi::AnyBuffer a_scale_inv,
                   ffi::AnyBuffer b_scale_inv, int64_t ragged, int64_t a_block_rows,
                   int64_t a_block_cols, int64_t b_block_rows, int64_t b_block_cols,
                   int64_t pad_width, int64_t fast_accum, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> workspace) {
  // the operands' check (shapes, dtypes, scales' sizes) is fp8jax_grouped_gemm's
  GroupedGemm check{a,
                    b,
                    group_sizes,
                    a_scale_inv,
                    b_scale_inv,
                    ragged,
                    a_block_rows,
                    a_block_cols,
                    b_block_rows,
                    b_block_cols,
                    out};
  FP8JAX_RETURN_IF_ERROR(check.Check());
  if (check.p.form == grouped::kContracting && (pad_width < 16 || pad_width % 16 != 0)) {
    return BadArg(kOp, "pad_width must be a positive multiple of 16");
  }
  if (check.p.blocks) FP8JAX_RETURN_IF_ERROR(CheckBlocks(check.p, pad_width));
  Call c{a,   b,         group_sizes, a_scale_inv, b_scale_inv, pad_width, fast_accum != 0,
         out, workspace, check.p};
  if (c.p.OutputSize() == 0) return ffi::Error::Success();
  return Dispatch(stream, c);
}

// The initialize stage (outside any CUDA-graph capture), with the execute stage's binding: the
// device's multiprocessor count is read here once, so that the execute stage makes no query a
// capture could refuse.
ffi::Error Initialize(cudaStream_t, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer, ffi::AnyBuffer,
                      ffi::AnyBuffer, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                      ffi::Result<ffi::AnyBuffer>, ffi::Result<ffi::AnyBuffer>) {
  int device = 0;
  FP8JAX_RETURN_IF_ERROR(CurrentDevice(kOp, &device));
  if (Multiprocessors(device) < 1) {
    return ffi::Error::Internal("fp8jax grouped_gemm_sm90: the device has no multiprocessors");
  }
  return ffi::Error::Success();
}

}  // namespace

std::vector<VariantInfo> Sm90Variants() {
  std::vector<VariantInfo> out;
#define FP8JAX_SM90_INFO_(I, A, B, O, F, N, na, nb, no) out.push_back(InstanceInfo<I>());
  FP8JAX_SM90_VARIANTS(FP8JAX_SM90_INFO_)
#undef FP8JAX_SM90_INFO_
  return out;
}

}  // namespace fp8jax::grouped_tc

// fp8jax_grouped_gemm_sm90
#define FP8JAX_SM90_BINDING(BIND)                                                 \
  xla::ffi::Ffi::BIND()                                                           \
      .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()                              \
      .Arg<xla::ffi::AnyBuffer>()    /* a: FP8 codes */                           \
      .Arg<xla::ffi::AnyBuffer>()    /* b: FP8 codes */                           \
      .Arg<xla::ffi::AnyBuffer>()    /* group_sizes int32 [G] */                  \
      .Arg<xla::ffi::AnyBuffer>()    /* a_scale_inv: [G] or a's grid, MN-major */ \
      .Arg<xla::ffi::AnyBuffer>()    /* b_scale_inv: [G] or b's grid, MN-major */ \
      .Attr<int64_t>("ragged")       /* 0 rows, 1 contracting */                  \
      .Attr<int64_t>("a_block_rows") /* 0 x 0: per-group scales */                \
      .Attr<int64_t>("a_block_cols")                                              \
      .Attr<int64_t>("b_block_rows")                                              \
      .Attr<int64_t>("b_block_cols")                                              \
      .Attr<int64_t>("pad_width")  /* the contracting form's padding */           \
      .Attr<int64_t>("fast_accum") /* 0 or 1 */                                   \
      .Ret<xla::ffi::AnyBuffer>()  /* out */                                      \
      .Ret<xla::ffi::AnyBuffer>()  /* workspace uint8 */

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxGroupedGemmSm90InitializeCuda, fp8jax::grouped_tc::Initialize,
                              FP8JAX_SM90_BINDING(BindInitialize));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxGroupedGemmSm90Cuda, fp8jax::grouped_tc::Execute,
                              FP8JAX_SM90_BINDING(Bind), {fp8jax::kCudaHandlerTraits});
