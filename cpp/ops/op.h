// What every op header (cpp/ops/*.h) is made of: the binding's parameter types, the attribute
// names, the platforms' contexts and Run, the one body of every handler.
//
// An op is a struct in its family's header (casts.h, activations.h, scaling.h, norms.h,
// block_casts.h, gemms.h). Its static Handle<Ctx>(ctx, arguments, attributes, results) is the op's
// signature: XLA derives the FFI binding from its parameters (ffi::Ffi::BindTo: a buffer is an
// argument, an ffi::Result a result, an attr:: type a named attribute). Handle gathers them into
// the struct, the op's call, and returns Run(ctx, call): the op's argument check, Check(), then
// the platform's Compute(ctx), the only part a platform writes (cpu/*.cc for CpuPool, cuda/*.cu
// for CudaStream). So an op's parameter list and its check exist once; each platform's module
// instantiates every Handle with its context and defines the handler symbols from the X-list
// (common/op_table.h).
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// The parameter types of a handler's binding.
namespace sig {
using Any = ffi::AnyBuffer;         // a buffer of any dtype (the op's check checks it)
using F32 = ffi::Buffer<ffi::F32>;  // a float32 buffer
using AnyOut = ffi::Result<Any>;    // a result of any dtype
using F32Out = ffi::Result<F32>;    // a float32 result
}  // namespace sig

// The attributes: each one's name and type, once. A handler parameter `attr::Gated gated` binds
// the int64 attribute "gated", read as `*gated`.
namespace attr {
inline constexpr char kAct[] = "act";
inline constexpr char kGated[] = "gated";
inline constexpr char kMargin[] = "margin";
inline constexpr char kAlgo[] = "algo";
inline constexpr char kEpsilon[] = "epsilon";
inline constexpr char kZeroCenteredGamma[] = "zero_centered_gamma";
inline constexpr char kNormType[] = "norm_type";
inline constexpr char kNormEpsilon[] = "norm_epsilon";
inline constexpr char kBlockRows[] = "block_rows";
inline constexpr char kBlockCols[] = "block_cols";
inline constexpr char kScaleMode[] = "scale_mode";
inline constexpr char kRagged[] = "ragged";
inline constexpr char kABlockRows[] = "a_block_rows";
inline constexpr char kABlockCols[] = "a_block_cols";
inline constexpr char kBBlockRows[] = "b_block_rows";
inline constexpr char kBBlockCols[] = "b_block_cols";
inline constexpr char kWidth[] = "width";

using Act = ffi::Attr<int64_t, kAct>;        // the activation's code (common/activations.h)
using Gated = ffi::Attr<int64_t, kGated>;    // 1: x's k dim holds (a, b), the output a(a) * b
using Margin = ffi::Attr<int64_t, kMargin>;  // the scale's margin, a power of two
using Algo = ffi::Attr<int64_t, kAlgo>;      // 0: max of the history, 1: most recent
using Epsilon = ffi::Attr<float, kEpsilon>;  // the norm's, or a block cast's amax floor
using ZeroCenteredGamma =
    ffi::Attr<int64_t, kZeroCenteredGamma>;          // 1: the norm scales by 1 + gamma
using NormType = ffi::Attr<int64_t, kNormType>;      // 0: layernorm, 1: rmsnorm
using NormEpsilon = ffi::Attr<float, kNormEpsilon>;  // a fused norm's epsilon
using BlockRows = ffi::Attr<int64_t, kBlockRows>;    // a block cast's block shape
using BlockCols = ffi::Attr<int64_t, kBlockCols>;
using ScaleMode = ffi::Attr<int64_t, kScaleMode>;  // a block scale's form (common/block_scale.h)
using Ragged = ffi::Attr<int64_t, kRagged>;        // the grouped GEMM's form: 0 rows, 1 contracting
using ABlockRows = ffi::Attr<int64_t, kABlockRows>;  // the grouped GEMM's blocks (0: per group)
using ABlockCols = ffi::Attr<int64_t, kABlockCols>;
using BBlockRows = ffi::Attr<int64_t, kBBlockRows>;
using BBlockCols = ffi::Attr<int64_t, kBBlockCols>;
using Width = ffi::Attr<int64_t, kWidth>;  // a padded layout's segment width (grouped_scaling)
}  // namespace attr

// The platforms' contexts, each handler's first parameter: XLA's intra-op thread pool on the CPU
// (cpu/cpu_handler.h), XLA's stream on CUDA (cuda/cuda_handler.h).
struct CpuPool;
struct CudaStream;

// Every handler's body: the op's argument check, then the platform's computation of the checked
// call (Call::Compute(Ctx), defined by each platform).
template <typename Ctx, typename Call>
ffi::Error Run(Ctx ctx, Call call) {
  FP8JAX_RETURN_IF_ERROR(call.Check());
  return call.Compute(ctx);
}

}  // namespace fp8jax
