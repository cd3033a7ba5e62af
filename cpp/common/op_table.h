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
// Adding an op: a line here, its signature below, its kernels, its Python module.
// The GEMM (CUDA only, two execution stages) is declared in cuda/gemm_cublaslt.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

// The parameter types of the signatures (handlers spell their parameters with them too).
namespace fp8jax::sig {
using Any = ::xla::ffi::AnyBuffer;                // a buffer of any dtype (checked by the handler)
using F32 = ::xla::ffi::Buffer<::xla::ffi::F32>;  // a float32 buffer
using AnyOut = ::xla::ffi::Result<Any>;           // a result of any dtype
using F32Out = ::xla::ffi::Result<F32>;           // a float32 result
}  // namespace fp8jax::sig

// clang-format off: one builder call per line, aligned, reads as the signature
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
  X(NormBackward, "fp8jax_norm_backward")

// x, scale -> q, scale_inv, amax (one scale per group of x)
#define FP8JAX_SIGNATURE_Quantize \
  .Arg<fp8jax::sig::Any>()        \
  .Arg<fp8jax::sig::F32>()        \
  .Ret<fp8jax::sig::Any>()        \
  .Ret<fp8jax::sig::F32>()        \
  .Ret<fp8jax::sig::F32>()

// q, scale_inv -> out
#define FP8JAX_SIGNATURE_Dequantize \
  .Arg<fp8jax::sig::Any>()          \
  .Arg<fp8jax::sig::F32>()          \
  .Ret<fp8jax::sig::Any>()

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

// dy, x; act, gated -> dx
#define FP8JAX_SIGNATURE_DActivation \
  .Arg<fp8jax::sig::Any>()           \
  .Arg<fp8jax::sig::Any>()           \
  .Attr<int64_t>("act")              \
  .Attr<int64_t>("gated")            \
  .Ret<fp8jax::sig::Any>()

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

// `extern "C"` declarations of every op's handler, Fp8jax<Stem>Cpu or Fp8jax<Stem>Cuda.
#define FP8JAX_DECLARE_CPU_HANDLER_(Stem, target) XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Stem##Cpu);
#define FP8JAX_DECLARE_CUDA_HANDLER_(Stem, target) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Stem##Cuda);
