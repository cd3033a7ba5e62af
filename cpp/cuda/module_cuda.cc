// nanobind module `fp8jax._fp8jax_cuda`: the CUDA FFI handlers as PyCapsules,
// under the same target names as the CPU ones. Loaded only when JAX has a
// CUDA backend (see fp8jax/_ffi.py).
#include <nanobind/nanobind.h>

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxDequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxCastTransposeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxUpdateFp8StateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmCuda);

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_fp8jax_cuda, m) {
  m.doc() = "fp8jax CUDA kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    nb::dict d;
    d["fp8jax_quantize"] = Capsule(Fp8jaxQuantizeCuda);
    d["fp8jax_dequantize"] = Capsule(Fp8jaxDequantizeCuda);
    d["fp8jax_cast_transpose"] = Capsule(Fp8jaxCastTransposeCuda);
    d["fp8jax_update_fp8_state"] = Capsule(Fp8jaxUpdateFp8StateCuda);
    d["fp8jax_gemm"] = Capsule(Fp8jaxGemmCuda);
    return d;
  });
}
