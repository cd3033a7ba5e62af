// nanobind module `fp8jax._fp8jax_cpu`: hands the CPU FFI handlers to Python
// as PyCapsules, keyed by the target name every platform shares (common/op_table.h).
#include <nanobind/nanobind.h>

#include "common/op_table.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

FP8JAX_OPS(FP8JAX_DECLARE_CPU_HANDLER_)

NB_MODULE(_fp8jax_cpu, m) {
  m.doc() = "fp8jax CPU kernels (XLA FFI handlers)";
  m.def("registrations", []() {
    nb::dict d;
#define FP8JAX_REGISTER_(Stem, target) \
  d[target] = nb::capsule(reinterpret_cast<void*>(Fp8jax##Stem##Cpu));
    FP8JAX_OPS(FP8JAX_REGISTER_)
#undef FP8JAX_REGISTER_
    return d;
  });
}
