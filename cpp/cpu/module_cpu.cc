// nanobind module `fp8jax._fp8jax_cpu`: hands the CPU FFI handlers to Python
// as PyCapsules, keyed by the target name every platform shares.
#include <nanobind/nanobind.h>

#include "cpu/plan_bindings.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxQuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxDequantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxCastTransposeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxUpdateFp8StateCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxLayerNormForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxRmsNormForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxLayerNormForwardFp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxRmsNormForwardFp8Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxNormBackwardCpu);

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_fp8jax_cpu, m) {
  m.doc() = "fp8jax CPU kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    nb::dict d;
    d["fp8jax_quantize"] = Capsule(Fp8jaxQuantizeCpu);
    d["fp8jax_dequantize"] = Capsule(Fp8jaxDequantizeCpu);
    d["fp8jax_cast_transpose"] = Capsule(Fp8jaxCastTransposeCpu);
    d["fp8jax_update_fp8_state"] = Capsule(Fp8jaxUpdateFp8StateCpu);
    d["fp8jax_layernorm_forward"] = Capsule(Fp8jaxLayerNormForwardCpu);
    d["fp8jax_rmsnorm_forward"] = Capsule(Fp8jaxRmsNormForwardCpu);
    d["fp8jax_layernorm_forward_fp8"] = Capsule(Fp8jaxLayerNormForwardFp8Cpu);
    d["fp8jax_rmsnorm_forward_fp8"] = Capsule(Fp8jaxRmsNormForwardFp8Cpu);
    d["fp8jax_norm_backward"] = Capsule(Fp8jaxNormBackwardCpu);
    return d;
  });
  // Private: the CUDA kernels' launch planning, for tests/ops/test_launch_plan.py.
  fp8jax::AddPlanBindings(m);
  fp8jax::AddNormPlanBindings(m);
}
