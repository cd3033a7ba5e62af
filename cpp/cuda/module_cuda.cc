// nanobind module `fp8jax._fp8jax_cuda`: defines every op's CUDA handler, Fp8jax<Stem>Cuda, from
// the X-list (common/op_table.h; each op's Handle with the stream, cuda/cuda_handler.h) and hands
// them to Python as PyCapsules under the same target names as the CPU ones. Loaded only when JAX
// has a CUDA backend (see fp8jax/_ffi.py); loading it runs no CUDA call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "common/op_table.h"
#include "common/registrations.h"
#include "cuda/cuda_handler.h"
#include "xla/ffi/api/ffi.h"

FP8JAX_OPS(FP8JAX_DEFINE_CUDA_HANDLER)
// The cuBLASLt GEMMs (CUDA only, two execution stages; their handlers are defined in
// cuda/gemm_cublaslt.cc): a plain one and the MLP's two GELU epilogues.
#define FP8JAX_GEMM_TARGETS(X)    \
  X(Gemm, "fp8jax_gemm")          \
  X(GemmGelu, "fp8jax_gemm_gelu") \
  X(GemmDGelu, "fp8jax_gemm_dgelu")
#define FP8JAX_DECLARE_GEMM_(Symbol, target)                      \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Symbol##InitializeCuda); \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Symbol##Cuda);
FP8JAX_GEMM_TARGETS(FP8JAX_DECLARE_GEMM_)
#undef FP8JAX_DECLARE_GEMM_
#ifdef FP8JAX_HAS_CUTLASS
// The grouped GEMM on Hopper's tensor cores (sm90/grouped_gemm.cu; built with CUTLASS).
#include "sm90/grouped_gemm.h"
#endif

NB_MODULE(_fp8jax_cuda, m) {
  namespace nb = nanobind;
  m.doc() = "fp8jax CUDA kernels (XLA FFI handlers)";
  // A capsule (execute stage only) or a dict of XLA FFI stage -> capsule.
  m.def("registrations", []() {
#define FP8JAX_ENTRY_(Stem, target) {target, Fp8jax##Stem##Cuda},
    nb::dict d = fp8jax::Registrations({FP8JAX_OPS(FP8JAX_ENTRY_)});
#undef FP8JAX_ENTRY_
    // A GEMM's initialize stage creates the cuBLASLt handle and chooses the algorithm (the
    // heuristic, timed when autotuning) outside CUDA-graph capture; execute calls cublasLtMatmul.
#define FP8JAX_REGISTER_GEMM_(Symbol, target) \
  d[target] = fp8jax::Registrations(          \
      {{"initialize", Fp8jax##Symbol##InitializeCuda}, {"execute", Fp8jax##Symbol##Cuda}});
    FP8JAX_GEMM_TARGETS(FP8JAX_REGISTER_GEMM_)
#undef FP8JAX_REGISTER_GEMM_
#ifdef FP8JAX_HAS_CUTLASS
    d["fp8jax_grouped_gemm_sm90"] =
        fp8jax::Registrations({{"initialize", Fp8jaxGroupedGemmSm90InitializeCuda},
                               {"execute", Fp8jaxGroupedGemmSm90Cuda}});
#endif
    return d;
  });
  // The tensor-core grouped GEMM's instantiations (empty without CUTLASS), for the tests: each
  // one's dtypes, accumulation, CUTLASS workspace bound and stride sizes.
  m.def("sm90_grouped_variants", []() {
    nb::list out;
#ifdef FP8JAX_HAS_CUTLASS
    for (const auto& v : fp8jax::grouped_tc::Sm90Variants()) {
      out.append(nb::make_tuple(v.a, v.b, v.out, v.fast_accum, v.block_n, v.cutlass_workspace,
                                v.stride_a, v.stride_b, v.stride_d));
    }
#endif
    return out;
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
#ifdef FP8JAX_HAS_CUTLASS
    d["fp8jax_grouped_gemm_sm90"] = traits;
#endif
    return d;
  });
}
