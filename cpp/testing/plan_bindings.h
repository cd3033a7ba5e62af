// The CUDA launch planning, exposed to the tests by the test-only extension (module_testing.cc).
#pragma once

#include <nanobind/nanobind.h>

namespace fp8jax {

// Adds the private _plan_* functions to the module.
void AddPlanBindings(nanobind::module_& m);

// Adds the norm kernels' _plan_norm (norm_plan_bindings.cc).
void AddNormPlanBindings(nanobind::module_& m);

}  // namespace fp8jax
