// Private `_plan_norm` of the test-only `fp8jax._fp8jax_testing`: the CUDA norm kernels' launch
// planning (cpp/common/norm_plan.h), compiled for the host so that tests/ops/test_norm_plan.py
// checks it without a GPU. The kernels themselves run on the host in tests/ops/test_host_cuda.py
// (test_norm_kernels_over_the_plan_cases), which replaced the hand-written walks of their loops
// that were here.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>

#include "common/norm_plan.h"
#include "testing/plan_bindings.h"

namespace nb = nanobind;

namespace fp8jax {
namespace {

namespace p = plan;

p::NormPlan Plan(int64_t rows, int64_t h, int elem_bytes, bool aligned, int64_t resident,
                 int64_t max_slots) {
  if (rows < 0 || h < 1 || (elem_bytes != 2 && elem_bytes != 4)) {
    throw std::invalid_argument("need rows >= 0, h >= 1, elem_bytes 2 or 4");
  }
  return p::PlanNorm(rows, h, elem_bytes, aligned, resident, max_slots);
}

nb::dict PlanDict(int64_t rows, int64_t h, int elem_bytes, bool aligned, int64_t resident,
                  int64_t max_slots) {
  const p::NormPlan pl = Plan(rows, h, elem_bytes, aligned, resident, max_slots);
  nb::dict d;
  d["vec"] = pl.vec;
  d["vector"] = pl.vector;
  d["threads_per_row"] = pl.threads_per_row;
  d["threads"] = pl.threads;
  d["rows_per_cta"] = pl.rows_per_cta;
  d["chunks"] = pl.chunks;
  d["chunks_per_thread"] = pl.chunks_per_thread;
  d["grid"] = pl.grid;
  d["slots"] = pl.slots;
  d["backward_ok"] = pl.backward_ok;
  d["workspace_fits"] = max_slots <= 0 || p::NormWorkspaceFits(pl, max_slots);
  return d;
}

}  // namespace

void AddNormPlanBindings(nb::module_& m) {
  m.def("_plan_norm", &PlanDict, nb::arg("rows"), nb::arg("h"), nb::arg("elem_bytes"),
        nb::arg("aligned"), nb::arg("resident"), nb::arg("max_slots"));
}

}  // namespace fp8jax
