// FP8JAX_CUDA_HANDLER(Stem, impl): defines the CUDA handler symbol Fp8jax<Stem>Cuda for `impl`,
// which takes XLA's stream and then the op's signature (common/op_table.h), with the traits every
// fp8jax CUDA handler has (kCudaHandlerTraits).
#pragma once

#include <cuda_runtime.h>

#include "common/op_table.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// Every fp8jax CUDA handler allocates nothing and never synchronises the host, so XLA may
// capture it into a CUDA graph (command buffer). The handlers declare it, and module_cuda.cc
// passes the same value to the registration (which is what XLA reads).
inline constexpr ::xla::ffi::Traits kCudaHandlerTraits = ::xla::ffi::Traits::kCmdBufferCompatible;

}  // namespace fp8jax

#if defined(FP8JAX_HOST_CUDA)
// cpp/testing/host_cuda.h: the handler bound for XLA's CPU platform, Fp8jax<Stem>HostCuda, which
// calls `impl` with no stream (the kernels run on the host).
// clang-format off
#define FP8JAX_CUDA_HANDLER(Stem, impl)                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                      \
      Fp8jax##Stem##HostCuda,                                                         \
      [](auto&&... args) { return impl(cudaStream_t{}, std::forward<decltype(args)>(args)...); }, \
      ::xla::ffi::Ffi::Bind() FP8JAX_SIGNATURE_##Stem)
// clang-format on
#else
// clang-format off: the builder chain one call per line
#define FP8JAX_CUDA_HANDLER(Stem, impl)                                               \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                      \
      Fp8jax##Stem##Cuda, impl,                                                       \
      ::xla::ffi::Ffi::Bind().Ctx<::xla::ffi::PlatformStream<cudaStream_t>>()         \
          FP8JAX_SIGNATURE_##Stem,                                                    \
      {fp8jax::kCudaHandlerTraits})
// clang-format on
#endif
