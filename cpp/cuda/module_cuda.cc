// nanobind module `fp8jax._fp8jax_cuda`: defines every op's CUDA handler, Fp8jax<Stem>Cuda, from
// the X-list (common/op_table.h; each op's Handle with the stream, cuda/cuda_handler.h) and hands
// them to Python as PyCapsules under the same target names as the CPU ones. Loaded only when JAX
// has a CUDA backend (see fp8jax/_ffi.py); loading it runs no CUDA call.
#include <nanobind/nanobind.h>

#include <cstdint>

#include "common/op_table.h"
#include "common/registrations.h"
#include "cuda/cuda_handler.h"
#include "xla/ffi/api/ffi.h"

FP8JAX_OPS(FP8JAX_DEFINE_CUDA_HANDLER)
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmInitializeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmCuda);

NB_MODULE(_fp8jax_cuda, m) {
  namespace nb = nanobind;
  m.doc() = "fp8jax CUDA kernels (XLA FFI handlers)";
  // A capsule (execute stage only) or a dict of XLA FFI stage -> capsule.
  m.def("registrations", []() {
#define FP8JAX_ENTRY_(Stem, target) {target, Fp8jax##Stem##Cuda},
    nb::dict d = fp8jax::Registrations({FP8JAX_OPS(FP8JAX_ENTRY_)});
#undef FP8JAX_ENTRY_
    // The GEMM's initialize stage creates the cuBLASLt handle and runs the
    // heuristic query outside CUDA-graph capture; execute only calls cublasLtMatmul.
    d["fp8jax_gemm"] = fp8jax::Registrations(
        {{"initialize", Fp8jaxGemmInitializeCuda}, {"execute", Fp8jaxGemmCuda}});
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
