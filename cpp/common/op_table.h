// The one declaration of every fp8jax FFI target: its name and its signature.
//
// FP8JAX_OPS(X) calls X(Stem, "target") once per op that has a CPU and a CUDA handler; both
// extensions declare (FP8JAX_DECLARE_CPU_HANDLER_ / FP8JAX_DECLARE_CUDA_HANDLER_), register
// (module_*.cc) and, on CUDA, mark the command-buffer trait from it. FP8JAX_SIGNATURE_<Stem> is the
// op's binding after the platform context (the CPU thread pool or the CUDA stream): its arguments,
// attributes and results, in order. A handler file defines its op with one line,
// FP8JAX_CPU_HANDLER(Stem, impl) or FP8JAX_CUDA_HANDLER(Stem, impl) (cpu/cpu_handler.h,
// cuda/cuda_handler.h).
//
// Each signature is followed by the op's argument check, Check<Stem>, which both handlers call
// first (then they only compute); the checks several ops share come before them, and the
// block-scaled casts' checks are in block_checks.h. All are built from the shape checks of
// ffi_checks.h.
//
// Adding an op: a line here, its signature and its argument check below, its kernels, its Python
// module.
// The GEMM (CUDA only, two execution stages) is declared in cuda/gemm_cublaslt.cc.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/block_checks.h"
#include "common/ffi_checks.h"
#include "common/norm_row.h"
#include "xla/ffi/api/ffi.h"

// The parameter types of the signatures (handlers spell their parameters with them too).
namespace fp8jax::sig {
using Any = ::xla::ffi::AnyBuffer;                // a buffer of any dtype (checked by the handler)
using F32 = ::xla::ffi::Buffer<::xla::ffi::F32>;  // a float32 buffer
using AnyOut = ::xla::ffi::Result<Any>;           // a result of any dtype
using F32Out = ::xla::ffi::Result<F32>;           // a float32 result
}  // namespace fp8jax::sig

// clang-format off: one op a line
#define FP8JAX_OPS(X)                                                         \
  X(Quantize, "fp8jax_quantize")                                              \
  X(Dequantize, "fp8jax_dequantize")                                          \
  X(CastTranspose, "fp8jax_cast_transpose")                                   \
  X(CastTransposeDbias, "fp8jax_cast_transpose_dbias")                        \
  X(Activation, "fp8jax_activation")                                          \
  X(DActivation, "fp8jax_dactivation")                                        \
  X(ActivationCastTranspose, "fp8jax_activation_cast_transpose")              \
  X(DActivationCastTransposeDbias, "fp8jax_dactivation_cast_transpose_dbias") \
  X(UpdateFp8State, "fp8jax_update_fp8_state")                                \
  X(LayerNormForward, "fp8jax_layernorm_forward")                             \
  X(RmsNormForward, "fp8jax_rmsnorm_forward")                                 \
  X(LayerNormForwardFp8, "fp8jax_layernorm_forward_fp8")                      \
  X(RmsNormForwardFp8, "fp8jax_rmsnorm_forward_fp8")                          \
  X(NormBackward, "fp8jax_norm_backward")                                     \
  X(BlockQuantize, "fp8jax_block_quantize")                                   \
  X(BlockCastTranspose, "fp8jax_block_cast_transpose")                       \
  X(BlockCastTransposeDbias, "fp8jax_block_cast_transpose_dbias")             \
  X(ActivationBlockCastTranspose, "fp8jax_activation_block_cast_transpose")   \
  X(DActivationBlockCastTransposeDbias, "fp8jax_dactivation_block_cast_transpose_dbias") \
  X(NormBlockCastTranspose, "fp8jax_norm_block_cast_transpose")
// clang-format on

namespace fp8jax {

// Op names in error messages, one spelling for an op's check and its CPU and CUDA handlers.
inline constexpr char kActivationOp[] = "activation";
inline constexpr char kDActivationOp[] = "dactivation";
inline constexpr char kActivationCastTransposeOp[] = "activation_cast_transpose";
inline constexpr char kDActivationCastTransposeDbiasOp[] = "dactivation_cast_transpose_dbias";
inline constexpr char kNormBackwardOp[] = "norm_backward";
inline constexpr char kCastTransposeOp[] = "cast_transpose";
inline constexpr char kCastTransposeDbiasOp[] = "cast_transpose_dbias";

// ---- Shared checks ----

// The FP8 outputs of a fused cast-transpose: q and q_t of `count` codes each, one FP8 dtype.
inline ffi::Error CheckFp8Outputs(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                  int64_t count) {
  if (q.element_type() != qt.element_type() || q.element_count() != count ||
      qt.element_count() != count) {
    return BadArg(op, "q and q_t must have the quantized size and share an FP8 dtype");
  }
  return ffi::Error::Success();
}

// The scale outputs of a cast: scale_inv and amax, one value per scale (per group). The kernels
// write one of each per group, so a shorter buffer would be written out of bounds.
inline ffi::Error CheckScaleOutputs(const char* op, int64_t scale_inv_count, int64_t amax_count,
                                    int64_t groups) {
  if (scale_inv_count != groups || amax_count != groups) {
    return BadArg(
        op, "scale_inv and amax must have one value per scale (" + std::to_string(groups) + ")");
  }
  return ffi::Error::Success();
}

// A norm's forward outputs: y like x, mean and rsigma one value per row.
inline ffi::Error CheckNormForward(const char* op, const ffi::AnyBuffer& x,
                                   const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                                   const ffi::AnyBuffer& y, int64_t n_stats, NormShape* s) {
  FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, beta, s));
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count() ||
      n_stats != s->groups * s->rows) {
    return BadArg(op, "outputs must be y like x and mu, rsigma with one value per row");
  }
  return ffi::Error::Success();
}

// A norm's FP8 forward: one scale per group; q and q_t like x in one FP8 dtype, scale_inv and
// amax one value per group, mean and rsigma one value per row.
inline ffi::Error CheckNormForwardFp8(const char* op, const ffi::AnyBuffer& x,
                                      const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                                      const F32Buffer& scale, const ffi::AnyBuffer& q,
                                      const ffi::AnyBuffer& qt, int64_t scale_inv_count,
                                      int64_t amax_count, int64_t n_stats, NormShape* s) {
  FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, beta, s));
  if (scale.element_count() != s->groups) return BadArg(op, "scale must hold one value per group");
  if (q.element_type() != qt.element_type() || q.element_count() != x.element_count() ||
      qt.element_count() != x.element_count() || n_stats != s->groups * s->rows) {
    return BadArg(op, "outputs must be q, q_t like x and mu, rsigma with one value per row");
  }
  return CheckScaleOutputs(op, scale_inv_count, amax_count, s->groups);
}

// ---- The ops: each signature, then its check ----
//
// The signatures are kept out of clang-format: one builder call per line, aligned, reads as the
// signature.

// clang-format off
// x, scale -> q, scale_inv, amax (one scale per group of x)
#define FP8JAX_SIGNATURE_Quantize \
  .Arg<fp8jax::sig::Any>()        \
  .Arg<fp8jax::sig::F32>()        \
  .Ret<fp8jax::sig::Any>()        \
  .Ret<fp8jax::sig::F32>()        \
  .Ret<fp8jax::sig::F32>()
// clang-format on

// quantize: x, one scale per group -> q (x's size).
inline ffi::Error CheckQuantize(const ffi::AnyBuffer& x, const F32Buffer& scale,
                                const ffi::AnyBuffer& q, const F32Buffer& scale_inv,
                                const F32Buffer& amax, GroupShape* s) {
  FP8JAX_RETURN_IF_ERROR(GroupShapeOf("quantize", x.element_count(), scale.element_count(), s));
  if (q.element_count() != x.element_count()) return BadArg("quantize", "output size mismatch");
  return CheckScaleOutputs("quantize", scale_inv.element_count(), amax.element_count(), s->groups);
}

// clang-format off
// q, scale_inv -> out
#define FP8JAX_SIGNATURE_Dequantize \
  .Arg<fp8jax::sig::Any>()          \
  .Arg<fp8jax::sig::F32>()          \
  .Ret<fp8jax::sig::Any>()
// clang-format on

// dequantize: q, one scale_inv per group -> out (q's size).
inline ffi::Error CheckDequantize(const ffi::AnyBuffer& q, const F32Buffer& scale_inv,
                                  const ffi::AnyBuffer& out, GroupShape* s) {
  FP8JAX_RETURN_IF_ERROR(
      GroupShapeOf("dequantize", q.element_count(), scale_inv.element_count(), s));
  if (out.element_count() != q.element_count()) {
    return BadArg("dequantize", "output size mismatch");
  }
  return ffi::Error::Success();
}

// clang-format off
// x, scale -> q, q_t, scale_inv, amax
#define FP8JAX_SIGNATURE_CastTranspose \
  .Arg<fp8jax::sig::Any>()             \
  .Arg<fp8jax::sig::F32>()             \
  .Ret<fp8jax::sig::Any>()             \
  .Ret<fp8jax::sig::Any>()             \
  .Ret<fp8jax::sig::F32>()             \
  .Ret<fp8jax::sig::F32>()

// x, scale, workspace -> q, q_t, scale_inv, amax, dbias, workspace
#define FP8JAX_SIGNATURE_CastTransposeDbias \
  .Arg<fp8jax::sig::Any>()                  \
  .Arg<fp8jax::sig::F32>()                  \
  .Arg<fp8jax::sig::F32>()                  \
  .Ret<fp8jax::sig::Any>()                  \
  .Ret<fp8jax::sig::Any>()                  \
  .Ret<fp8jax::sig::F32>()                  \
  .Ret<fp8jax::sig::F32>()                  \
  .Ret<fp8jax::sig::F32>()                  \
  .Ret<fp8jax::sig::F32>()

// x; act, gated -> y
#define FP8JAX_SIGNATURE_Activation \
  .Arg<fp8jax::sig::Any>()          \
  .Attr<int64_t>("act")             \
  .Attr<int64_t>("gated")           \
  .Ret<fp8jax::sig::Any>()
// clang-format on

// cast_transpose: x [..., m, n], one scale per matrix -> q, q_t (x's size, one FP8 dtype),
// scale_inv and amax one value per matrix.
inline ffi::Error CheckCastTranspose(const char* op, const ffi::AnyBuffer& x,
                                     const F32Buffer& scale, const ffi::AnyBuffer& q,
                                     const ffi::AnyBuffer& qt, const F32Buffer& scale_inv,
                                     const F32Buffer& amax, MatrixShape* s) {
  FP8JAX_RETURN_IF_ERROR(MatrixShapeOf(op, x.dimensions(), scale.element_count(), s));
  FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(op, q, qt, x.element_count()));
  return CheckScaleOutputs(op, scale_inv.element_count(), amax.element_count(), s->groups);
}

// cast_transpose_dbias: cast_transpose's, plus dbias one value per column of each matrix and the
// workspace of `workspace_count` elements for tiles of `tile_rows` rows.
inline ffi::Error CheckCastTransposeDbias(const ffi::AnyBuffer& g, const F32Buffer& scale,
                                          const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                          const F32Buffer& scale_inv, const F32Buffer& amax,
                                          const F32Buffer& dbias, int64_t workspace_count,
                                          int64_t tile_rows, MatrixShape* s) {
  const char* op = kCastTransposeDbiasOp;
  FP8JAX_RETURN_IF_ERROR(CheckCastTranspose(op, g, scale, q, qt, scale_inv, amax, s));
  if (dbias.element_count() != s->matrices * s->cols) {
    return BadArg(op, "dbias must have one element per column of each matrix");
  }
  return CheckDbiasWorkspace(op, *s, tile_rows, workspace_count);
}

// activation: x [..., m, k, n] (k = 2 when gated) -> y [..., m, n] in x's dtype.
inline ffi::Error CheckActivation(const ffi::AnyBuffer& x, int64_t gated, const ffi::AnyBuffer& y,
                                  MatrixShape* s) {
  const char* op = kActivationOp;
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, 1, s));
  if (y.element_type() != x.element_type() ||
      y.element_count() != s->matrices * s->rows * s->cols) {
    return BadArg(op, "y must be [m, n] of x's [m, k, n], in x's dtype");
  }
  return ffi::Error::Success();
}

// clang-format off
// dy, x; act, gated -> dx
#define FP8JAX_SIGNATURE_DActivation \
  .Arg<fp8jax::sig::Any>()           \
  .Arg<fp8jax::sig::Any>()           \
  .Attr<int64_t>("act")              \
  .Attr<int64_t>("gated")            \
  .Ret<fp8jax::sig::Any>()
// clang-format on

// dactivation: g, x -> dx (x's shape, g's dtype).
inline ffi::Error CheckDActivation(const ffi::AnyBuffer& g, const ffi::AnyBuffer& x, int64_t gated,
                                   const ffi::AnyBuffer& dx, MatrixShape* s) {
  const char* op = kDActivationOp;
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, 1, s));
  FP8JAX_RETURN_IF_ERROR(CheckGradInputs(op, g, x, *s));
  if (dx.element_type() != g.element_type() || dx.element_count() != x.element_count()) {
    return BadArg(op, "dx must have x's shape and g's dtype");
  }
  return ffi::Error::Success();
}

// clang-format off
// x, scale; act, gated -> q, q_t, scale_inv, amax
#define FP8JAX_SIGNATURE_ActivationCastTranspose \
  .Arg<fp8jax::sig::Any>()                       \
  .Arg<fp8jax::sig::F32>()                       \
  .Attr<int64_t>("act")                          \
  .Attr<int64_t>("gated")                        \
  .Ret<fp8jax::sig::Any>()                       \
  .Ret<fp8jax::sig::Any>()                       \
  .Ret<fp8jax::sig::F32>()                       \
  .Ret<fp8jax::sig::F32>()
// clang-format on

// activation_cast_transpose: x [..., m, k, n], one scale per group -> q, q_t of [m, n].
inline ffi::Error CheckActivationCastTranspose(const ffi::AnyBuffer& x, const F32Buffer& scale,
                                               int64_t gated, const ffi::AnyBuffer& q,
                                               const ffi::AnyBuffer& qt, const F32Buffer& scale_inv,
                                               const F32Buffer& amax, MatrixShape* s) {
  const char* op = kActivationCastTransposeOp;
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, scale.element_count(), s));
  FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(op, q, qt, s->matrices * s->rows * s->cols));
  return CheckScaleOutputs(op, scale_inv.element_count(), amax.element_count(), s->groups);
}

// clang-format off
// dy, x, scale, workspace; act, gated -> q, q_t, scale_inv, amax, dbias, workspace
#define FP8JAX_SIGNATURE_DActivationCastTransposeDbias \
  .Arg<fp8jax::sig::Any>()                             \
  .Arg<fp8jax::sig::Any>()                             \
  .Arg<fp8jax::sig::F32>()                             \
  .Arg<fp8jax::sig::F32>()                             \
  .Attr<int64_t>("act")                                \
  .Attr<int64_t>("gated")                              \
  .Ret<fp8jax::sig::Any>()                             \
  .Ret<fp8jax::sig::Any>()                             \
  .Ret<fp8jax::sig::F32>()                             \
  .Ret<fp8jax::sig::F32>()                             \
  .Ret<fp8jax::sig::F32>()                             \
  .Ret<fp8jax::sig::F32>()
// clang-format on

// The shapes of a fused activation-gradient cast-transpose: x's, and the quantized matrix's
// ([m, k * n]).
struct ActCastShapes {
  MatrixShape x;
  MatrixShape q;
};

// dactivation_cast_transpose_dbias: g, x -> q, q_t (x's size), dbias [k, n], and the dbias
// workspace of `workspace_count` elements for tiles of `tile_rows` rows. Returns the shapes.
inline ffi::ErrorOr<ActCastShapes> CheckDActivationCastTransposeDbias(
    const ffi::AnyBuffer& g, const ffi::AnyBuffer& x, const F32Buffer& scale, int64_t gated,
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt, const F32Buffer& scale_inv,
    const F32Buffer& amax, const F32Buffer& dbias, int64_t workspace_count, int64_t tile_rows) {
  const char* op = kDActivationCastTransposeDbiasOp;
  ActCastShapes s;
  ffi::Error err = [&]() -> ffi::Error {
    FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, scale.element_count(), &s.x));
    FP8JAX_RETURN_IF_ERROR(CheckGradInputs(op, g, x, s.x));
    FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(op, q, qt, x.element_count()));
    FP8JAX_RETURN_IF_ERROR(
        CheckScaleOutputs(op, scale_inv.element_count(), amax.element_count(), s.x.groups));
    s.q = s.x;
    s.q.cols = (gated != 0 ? 2 : 1) * s.x.cols;
    if (dbias.element_count() != s.q.matrices * s.q.cols) {
      return BadArg(op, "dbias must have shape [k, n]");
    }
    return CheckDbiasWorkspace(op, s.q, tile_rows, workspace_count);
  }();
  if (!err.success()) return ffi::Unexpected(std::move(err));
  return s;
}

// clang-format off
// history, scale, amax, fp8_max; margin, algo -> history, scale
#define FP8JAX_SIGNATURE_UpdateFp8State \
  .Arg<fp8jax::sig::F32>()              \
  .Arg<fp8jax::sig::F32>()              \
  .Arg<fp8jax::sig::F32>()              \
  .Arg<fp8jax::sig::F32>()              \
  .Attr<int64_t>("margin")              \
  .Attr<int64_t>("algo")                \
  .Ret<fp8jax::sig::F32>()              \
  .Ret<fp8jax::sig::F32>()
// clang-format on

// update_fp8_state: history [rows, len], scale/amax/fp8_max one per row, a known algorithm.
inline ffi::Error CheckUpdateFp8State(const F32Buffer& history, const F32Buffer& scale,
                                      const F32Buffer& amax, const F32Buffer& fp8_max, int64_t algo,
                                      HistoryShape* s) {
  if (auto err =
          HistoryShapeOf(history.dimensions(), history.element_count(), scale.element_count(),
                         amax.element_count(), fp8_max.element_count(), s);
      !err.success()) {
    return err;
  }
  return CheckAlgo(algo);
}

// clang-format off
// x, gamma, beta; epsilon, zero_centered_gamma -> y, mean, rsigma
#define FP8JAX_SIGNATURE_LayerNormForward \
  .Arg<fp8jax::sig::Any>()                \
  .Arg<fp8jax::sig::Any>()                \
  .Arg<fp8jax::sig::Any>()                \
  .Attr<float>("epsilon")                 \
  .Attr<int64_t>("zero_centered_gamma")   \
  .Ret<fp8jax::sig::Any>()                \
  .Ret<fp8jax::sig::F32>()                \
  .Ret<fp8jax::sig::F32>()

// x, gamma; epsilon, zero_centered_gamma -> y, mean, rsigma
#define FP8JAX_SIGNATURE_RmsNormForward \
  .Arg<fp8jax::sig::Any>()              \
  .Arg<fp8jax::sig::Any>()              \
  .Attr<float>("epsilon")               \
  .Attr<int64_t>("zero_centered_gamma") \
  .Ret<fp8jax::sig::Any>()              \
  .Ret<fp8jax::sig::F32>()              \
  .Ret<fp8jax::sig::F32>()

// x, gamma, beta, scale; epsilon, zero_centered_gamma -> y, q, scale_inv, amax, mean, rsigma
#define FP8JAX_SIGNATURE_LayerNormForwardFp8 \
  .Arg<fp8jax::sig::Any>()                   \
  .Arg<fp8jax::sig::Any>()                   \
  .Arg<fp8jax::sig::Any>()                   \
  .Arg<fp8jax::sig::F32>()                   \
  .Attr<float>("epsilon")                    \
  .Attr<int64_t>("zero_centered_gamma")      \
  .Ret<fp8jax::sig::Any>()                   \
  .Ret<fp8jax::sig::Any>()                   \
  .Ret<fp8jax::sig::F32>()                   \
  .Ret<fp8jax::sig::F32>()                   \
  .Ret<fp8jax::sig::F32>()                   \
  .Ret<fp8jax::sig::F32>()

// x, gamma, scale; epsilon, zero_centered_gamma -> y, q, scale_inv, amax, mean, rsigma
#define FP8JAX_SIGNATURE_RmsNormForwardFp8 \
  .Arg<fp8jax::sig::Any>()                 \
  .Arg<fp8jax::sig::Any>()                 \
  .Arg<fp8jax::sig::F32>()                 \
  .Attr<float>("epsilon")                  \
  .Attr<int64_t>("zero_centered_gamma")    \
  .Ret<fp8jax::sig::Any>()                 \
  .Ret<fp8jax::sig::Any>()                 \
  .Ret<fp8jax::sig::F32>()                 \
  .Ret<fp8jax::sig::F32>()                 \
  .Ret<fp8jax::sig::F32>()                 \
  .Ret<fp8jax::sig::F32>()

// dy, x, mean, rsigma, gamma; norm_type, zero_centered_gamma -> dx, dgamma, dbeta, workspace
#define FP8JAX_SIGNATURE_NormBackward   \
  .Arg<fp8jax::sig::Any>()              \
  .Arg<fp8jax::sig::Any>()              \
  .Arg<fp8jax::sig::F32>()              \
  .Arg<fp8jax::sig::F32>()              \
  .Arg<fp8jax::sig::Any>()              \
  .Attr<int64_t>("norm_type")           \
  .Attr<int64_t>("zero_centered_gamma") \
  .Ret<fp8jax::sig::Any>()              \
  .Ret<fp8jax::sig::F32>()              \
  .Ret<fp8jax::sig::F32>()              \
  .Ret<fp8jax::sig::F32>()
// clang-format on

// norm_backward: dy, dx like x; mean, rsigma one per row; dgamma, dbeta like gamma.
inline ffi::Error CheckNormBackward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                    const F32Buffer& mu, const F32Buffer& rs,
                                    const ffi::AnyBuffer& gamma, int64_t norm_type,
                                    const ffi::AnyBuffer& dx, const F32Buffer& dgamma,
                                    const F32Buffer& dbeta, NormShape* s) {
  const char* op = kNormBackwardOp;
  FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, nullptr, s));
  if (norm_type != static_cast<int64_t>(NormType::kLayerNorm) &&
      norm_type != static_cast<int64_t>(NormType::kRmsNorm)) {
    return BadArg(op, "norm_type must be 0 (layernorm) or 1 (rmsnorm)");
  }
  const int64_t n_rows = s->groups * s->rows;
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count() ||
      dx.element_type() != x.element_type() || dx.element_count() != x.element_count() ||
      mu.element_count() != n_rows || rs.element_count() != n_rows ||
      dgamma.element_count() != gamma.element_count() ||
      dbeta.element_count() != gamma.element_count()) {
    return BadArg(op,
                  "dy, dx must be like x; mu, rsigma one value per row; dgamma, dbeta like gamma");
  }
  return ffi::Error::Success();
}

// clang-format off
// The block casts' attributes (block shape, scale mode, amax epsilon) and the four outputs of a
// cast in both layouts (q, scale_inv, q_t, scale_inv_t), shared by their signatures below.
#define FP8JAX_BLOCK_CAST_ATTRS \
  .Attr<int64_t>("block_rows")  \
  .Attr<int64_t>("block_cols")  \
  .Attr<int64_t>("scale_mode")  \
  .Attr<float>("epsilon")
#define FP8JAX_BLOCK_CAST_BOTH_RETS \
  .Ret<fp8jax::sig::Any>()          \
  .Ret<fp8jax::sig::Any>()          \
  .Ret<fp8jax::sig::Any>()          \
  .Ret<fp8jax::sig::Any>()

// x; block_rows, block_cols, scale_mode, epsilon -> q, scale_inv
#define FP8JAX_SIGNATURE_BlockQuantize \
  .Arg<fp8jax::sig::Any>()             \
  FP8JAX_BLOCK_CAST_ATTRS              \
  .Ret<fp8jax::sig::Any>()             \
  .Ret<fp8jax::sig::Any>()

// x; block_rows, block_cols, scale_mode, epsilon -> q, scale_inv, q_t, scale_inv_t
#define FP8JAX_SIGNATURE_BlockCastTranspose \
  .Arg<fp8jax::sig::Any>()                  \
  FP8JAX_BLOCK_CAST_ATTRS                   \
  FP8JAX_BLOCK_CAST_BOTH_RETS

// x, workspace; block_rows, block_cols, scale_mode, epsilon -> q, scale_inv, q_t, scale_inv_t,
// dbias, workspace
#define FP8JAX_SIGNATURE_BlockCastTransposeDbias \
  .Arg<fp8jax::sig::Any>()                       \
  .Arg<fp8jax::sig::F32>()                       \
  FP8JAX_BLOCK_CAST_ATTRS                        \
  FP8JAX_BLOCK_CAST_BOTH_RETS                    \
  .Ret<fp8jax::sig::F32>()                       \
  .Ret<fp8jax::sig::F32>()

// x; act, gated, block_rows, block_cols, scale_mode, epsilon -> q, scale_inv, q_t, scale_inv_t
#define FP8JAX_SIGNATURE_ActivationBlockCastTranspose \
  .Arg<fp8jax::sig::Any>()                            \
  .Attr<int64_t>("act")                               \
  .Attr<int64_t>("gated")                             \
  FP8JAX_BLOCK_CAST_ATTRS                             \
  FP8JAX_BLOCK_CAST_BOTH_RETS

// g, x, workspace; act, gated, block_rows, block_cols, scale_mode, epsilon -> q, scale_inv, q_t,
// scale_inv_t, dbias, workspace
#define FP8JAX_SIGNATURE_DActivationBlockCastTransposeDbias \
  .Arg<fp8jax::sig::Any>()                                  \
  .Arg<fp8jax::sig::Any>()                                  \
  .Arg<fp8jax::sig::F32>()                                  \
  .Attr<int64_t>("act")                                     \
  .Attr<int64_t>("gated")                                   \
  FP8JAX_BLOCK_CAST_ATTRS                                   \
  FP8JAX_BLOCK_CAST_BOTH_RETS                               \
  .Ret<fp8jax::sig::F32>()                                  \
  .Ret<fp8jax::sig::F32>()

// x, gamma, beta; norm_type, norm_epsilon, zero_centered_gamma, block_rows, block_cols,
// scale_mode, epsilon -> q, scale_inv, q_t, scale_inv_t, mu, rsigma
#define FP8JAX_SIGNATURE_NormBlockCastTranspose \
  .Arg<fp8jax::sig::Any>()                      \
  .Arg<fp8jax::sig::Any>()                      \
  .Arg<fp8jax::sig::Any>()                      \
  .Attr<int64_t>("norm_type")                   \
  .Attr<float>("norm_epsilon")                  \
  .Attr<int64_t>("zero_centered_gamma")         \
  FP8JAX_BLOCK_CAST_ATTRS                       \
  FP8JAX_BLOCK_CAST_BOTH_RETS                   \
  .Ret<fp8jax::sig::F32>()                      \
  .Ret<fp8jax::sig::F32>()
// clang-format on

}  // namespace fp8jax

// `extern "C"` declarations of every op's handler, Fp8jax<Stem>Cpu or Fp8jax<Stem>Cuda.
#define FP8JAX_DECLARE_CPU_HANDLER_(Stem, target) XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Stem##Cpu);
#define FP8JAX_DECLARE_CUDA_HANDLER_(Stem, target) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Stem##Cuda);
