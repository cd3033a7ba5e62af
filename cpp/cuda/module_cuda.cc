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
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmInitializeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmCuda);

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
    // The GEMM's initialize stage creates the cuBLASLt handle and runs the
    // heuristic query outside CUDA-graph capture; execute only calls cublasLtMatmul.
    nb::dict gemm;
    gemm["initialize"] = Capsule(Fp8jaxGemmInitializeCuda);
    gemm["execute"] = Capsule(Fp8jaxGemmCuda);
    d["fp8jax_gemm"] = gemm;
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
    d["fp8jax_gemm"] = traits;
    return d;
  });
}
