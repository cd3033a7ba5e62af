// The CUDA platform of the ops (ops/op.h): a CUDA handler's context, CudaStream, the traits every
// fp8jax CUDA handler has, and the definition of each op's CUDA handler symbol, Fp8jax<Stem>Cuda
// (cuda/module_cuda.cc defines them all from the X-list, common/op_table.h).
#pragma once

#include <cuda_runtime.h>

#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// Every fp8jax CUDA handler allocates nothing and never synchronises the host, so XLA may
// capture it into a CUDA graph (command buffer). The handlers declare it, and module_cuda.cc
// passes the same value to the registration (which is what XLA reads).
inline constexpr ::xla::ffi::Traits kCudaHandlerTraits = ::xla::ffi::Traits::kCmdBufferCompatible;

// A CUDA handler's context: XLA's stream for the call, which it converts to.
struct CudaStream {
  CudaStream(cudaStream_t s) : stream(s) {}         // NOLINT: XLA's decoded stream converts
  operator cudaStream_t() const { return stream; }  // NOLINT: and back, for the CUDA calls
  cudaStream_t stream;
};

}  // namespace fp8jax

namespace xla::ffi {

// A handler parameter of type CudaStream binds XLA's stream (ffi::Ffi::BindTo).
template <>
struct CtxBinding<fp8jax::CudaStream> {
  using Ctx = PlatformStream<cudaStream_t>;
};

}  // namespace xla::ffi

// Defines Fp8jax<Stem>Cuda, the CUDA handler of the X-list entry (Stem, target): Stem::Handle with
// the stream first, its binding derived from its parameters, command-buffer compatible.
#define FP8JAX_DEFINE_CUDA_HANDLER(Stem, target)                                                  \
  extern "C" XLA_FFI_Error* Fp8jax##Stem##Cuda(XLA_FFI_CallFrame* call_frame) {                   \
    static auto* handler = ::xla::ffi::Ffi::BindTo(&::fp8jax::Stem::Handle<::fp8jax::CudaStream>, \
                                                   {::fp8jax::kCudaHandlerTraits})                \
                               .release();                                                        \
    return handler->Call(call_frame);                                                             \
  }
