// nanobind module `fp8jax._fp8jax_cpu`: defines every op's CPU handler, Fp8jax<Stem>Cpu, from the
// X-list (common/op_table.h; each op's Handle with the thread pool, cpu/cpu_handler.h) and hands
// them to Python as PyCapsules, keyed by the target name every platform shares.
#include <nanobind/nanobind.h>

#include "common/op_table.h"
#include "common/registrations.h"
#include "cpu/cpu_handler.h"
#include "xla/ffi/api/ffi.h"

FP8JAX_OPS(FP8JAX_DEFINE_CPU_HANDLER)

NB_MODULE(_fp8jax_cpu, m) {
  m.doc() = "fp8jax CPU kernels (XLA FFI handlers)";
  m.def("registrations", []() {
#define FP8JAX_ENTRY_(Stem, target) {target, Fp8jax##Stem##Cpu},
    return fp8jax::Registrations({FP8JAX_OPS(FP8JAX_ENTRY_)});
#undef FP8JAX_ENTRY_
  });
}
