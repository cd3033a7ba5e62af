// nanobind module `fp8jax._fp8jax_testing`, built only for the tests (CMake FP8JAX_TESTING=ON,
// which tools/test.sh sets): the CUDA kernels' launch planning, compiled for the host
// (plan_bindings.cc, norm_plan_bindings.cc). Nothing in the package
// imports it; tests/ops/test_launch_plan.py and test_norm_plan.py do.
#include <nanobind/nanobind.h>

#include "testing/plan_bindings.h"

NB_MODULE(_fp8jax_testing, m) {
  m.doc() = "fp8jax test support: CUDA launch planning on the host";
  fp8jax::AddPlanBindings(m);
  fp8jax::AddNormPlanBindings(m);
}
