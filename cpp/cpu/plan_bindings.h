// The CUDA launch planning, exposed to Python by the CPU extension for tests.
#pragma once

#include <nanobind/nanobind.h>

namespace fp8jax {

// Adds the private _plan_* and _simulate_* functions to the module.
void AddPlanBindings(nanobind::module_& m);

// Adds the norm kernels' _plan_norm* and _simulate_norm* (norm_plan_bindings.cc).
void AddNormPlanBindings(nanobind::module_& m);

}  // namespace fp8jax
