// nanobind module `fp8jax._fp8jax_cuda`: the CUDA FFI handlers as PyCapsules,
// under the same target names as the CPU ones (common/op_table.h). Loaded only
// when JAX has a CUDA backend (see fp8jax/_ffi.py); loading it runs no CUDA call.
#include <nanobind/nanobind.h>

#include <cstdint>

#include "common/op_table.h"
#include "cuda/cuda_handler.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

FP8JAX_OPS(FP8JAX_DECLARE_CUDA_HANDLER_)
// The cuBLASLt GEMMs (cuda/gemm_cublaslt.cc): a plain one and the MLP's two GELU epilogues.
#define FP8JAX_GEMM_TARGETS(X)    \
  X(Gemm, "fp8jax_gemm")          \
  X(GemmGelu, "fp8jax_gemm_gelu") \
  X(GemmDGelu, "fp8jax_gemm_dgelu")
#define FP8JAX_DECLARE_GEMM_(Symbol, target)                      \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Symbol##InitializeCuda); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Symbol##Cuda);
FP8JAX_GEMM_TARGETS(FP8JAX_DECLARE_GEMM_)
#undef FP8JAX_DECLARE_GEMM_

namespace {

nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_fp8jax_cuda, m) {
  m.doc() = "fp8jax CUDA kernels (XLA FFI handlers)";
  // A capsule (execute stage only) or a dict of XLA FFI stage -> capsule.
  m.def("registrations", []() {
    nb::dict d;
#define FP8JAX_REGISTER_(Stem, target) d[target] = Capsule(Fp8jax##Stem##Cuda);
    FP8JAX_OPS(FP8JAX_REGISTER_)
#undef FP8JAX_REGISTER_
    // A GEMM's initialize stage creates the cuBLASLt handle and chooses the algorithm (the
    // heuristic, timed when autotuning) outside CUDA-graph capture; execute calls cublasLtMatmul.
#define FP8JAX_REGISTER_GEMM_(Symbol, target)                       \
  {                                                                 \
    nb::dict stages;                                                \
    stages["initialize"] = Capsule(Fp8jax##Symbol##InitializeCuda); \
    stages["execute"] = Capsule(Fp8jax##Symbol##Cuda);              \
    d[target] = stages;                                             \
  }
    FP8JAX_GEMM_TARGETS(FP8JAX_REGISTER_GEMM_)
#undef FP8JAX_REGISTER_GEMM_
    return d;
  });
  // The traits to register each target with (XLA reads the registration's, not the
  // handler's): the ones every fp8jax CUDA handler declares, cuda/cuda_handler.h.
  m.def("traits", []() {
    nb::dict d;
    const auto traits = static_cast<int64_t>(fp8jax::kCudaHandlerTraits);
#define FP8JAX_TRAITS_(Stem, target) d[target] = traits;
    FP8JAX_OPS(FP8JAX_TRAITS_)
#undef FP8JAX_TRAITS_
#define FP8JAX_GEMM_TRAITS_(Symbol, target) d[target] = traits;
    FP8JAX_GEMM_TARGETS(FP8JAX_GEMM_TRAITS_)
#undef FP8JAX_GEMM_TRAITS_
    return d;
  });
}
