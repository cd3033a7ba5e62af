// Private `_plan_norm*` / `_simulate_norm*` functions of the test-only `fp8jax._fp8jax_testing`:
// the CUDA norm kernels' launch planning (cpp/common/norm_plan.h), compiled
// for the host so that tests/ops/test_norm_plan.py checks it without a GPU.
//
// The simulations walk the kernels' loops (the same NormForwardRow /
// NormSlot / NormChunkStart / NormChunkCount / NormTileAt the kernels call)
// for every block, row group, iteration and thread of the planned grid, and
// count how often each element is touched. Meant for small shapes.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "common/norm_plan.h"
#include "testing/plan_bindings.h"

namespace nb = nanobind;

namespace fp8jax {
namespace {

namespace p = plan;

nb::bytes Bytes(const std::vector<int64_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

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

// Visits per element of a [rows, h] matrix by the forward's walk (backward:
// the backward's walk, also returning the slot of each row and the largest
// number of elements one thread holds for one row).
nb::dict Simulate(int64_t rows, int64_t h, int elem_bytes, bool aligned, int64_t resident,
                  int64_t max_slots, bool backward) {
  const p::NormPlan pl = Plan(rows, h, elem_bytes, aligned, resident, max_slots);
  std::vector<int64_t> visits(static_cast<size_t>(rows * h), 0);
  std::vector<int64_t> slot_of(static_cast<size_t>(rows), -1);
  int64_t max_elems = 0;
  const int64_t iters = backward ? p::CeilDiv(rows, pl.slots) : p::NormIterations(pl, rows);
  for (int64_t cta = 0; cta < pl.grid; ++cta) {
    for (int grp = 0; grp < pl.rows_per_cta; ++grp) {
      for (int64_t it = 0; it < iters; ++it) {
        const int64_t slot = p::NormSlot(pl, cta, grp);
        const int64_t row = backward ? slot + it * pl.slots : p::NormForwardRow(pl, cta, grp, it);
        if (row >= rows) continue;
        if (backward) slot_of[static_cast<size_t>(row)] = slot;
        for (int t = 0; t < pl.threads_per_row; ++t) {
          int64_t elems = 0;
          for (int k = 0; k < pl.chunks_per_thread && p::NormChunkValid(pl, t, k); ++k) {
            const int64_t c0 = p::NormChunkStart(pl, t, k);
            const int n = p::NormChunkCount(pl, h, c0);
            if (pl.vector && n != pl.vec) throw std::logic_error("partial vector chunk");
            for (int j = 0; j < n; ++j) ++visits[static_cast<size_t>(row * h + c0 + j)];
            elems += n;
          }
          max_elems = elems > max_elems ? elems : max_elems;
        }
      }
    }
  }
  nb::dict d;
  d["visits"] = Bytes(visits);
  d["slot_of"] = Bytes(slot_of);
  d["max_thread_elems"] = max_elems;
  return d;
}

// Which q element each q_t element comes from, by the transpose kernel's
// tile walk (-1: never written).
nb::bytes SimulateTranspose(int64_t matrices, int64_t rows, int64_t cols) {
  std::vector<int64_t> src(static_cast<size_t>(matrices * rows * cols), -1);
  constexpr int kT = p::kNormTransposeTile;
  for (int64_t i = 0; i < p::NormTiles(matrices, rows, cols); ++i) {
    const p::NormTile tl = p::NormTileAt(i, rows, cols);
    for (int c = 0; c < kT; ++c) {
      for (int r = 0; r < kT; ++r) {
        if (tl.col0 + c < cols && tl.row0 + r < rows) {
          const int64_t base = tl.matrix * rows * cols;
          src[static_cast<size_t>(base + (tl.col0 + c) * rows + tl.row0 + r)] =
              base + (tl.row0 + r) * cols + tl.col0 + c;
        }
      }
    }
  }
  return Bytes(src);
}

}  // namespace

void AddNormPlanBindings(nb::module_& m) {
  m.def("_plan_norm", &PlanDict, nb::arg("rows"), nb::arg("h"), nb::arg("elem_bytes"),
        nb::arg("aligned"), nb::arg("resident"), nb::arg("max_slots"));
  m.def("_simulate_norm", &Simulate, nb::arg("rows"), nb::arg("h"), nb::arg("elem_bytes"),
        nb::arg("aligned"), nb::arg("resident"), nb::arg("max_slots"), nb::arg("backward"));
  m.def("_simulate_norm_transpose", &SimulateTranspose, nb::arg("matrices"), nb::arg("rows"),
        nb::arg("cols"));
}

}  // namespace fp8jax
