// The `_plan_*` functions of the test-only `fp8jax._fp8jax_testing`: the CUDA kernels' launch
// planning (cpp/common/launch_plan.h), compiled for the host so that
// tests/ops/test_launch_plan.py checks its arithmetic without a GPU, also for sizes too large to
// run. The kernels themselves, walking these plans, run on the host runtime of
// cpp/testing/host_cuda.h (tests/ops/test_host_cuda_walks.py).
#include "testing/plan_bindings.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/launch_plan.h"
#include "common/resident_cache.h"

namespace nb = nanobind;

namespace fp8jax {
namespace {

namespace p = plan;

void CheckNonNegative(const char* what, int64_t v) {
  if (v < 0) throw std::invalid_argument(std::string(what) + " must be >= 0");
}

nb::dict ChunkDict(const p::ChunkElems& e) {
  nb::dict d;
  d["first"] = e.first;
  d["count"] = e.count;
  d["vector"] = e.vector;
  return d;
}

nb::dict TileChunkDict(const p::TileChunk& c) {
  nb::dict d;
  d["offset"] = c.offset;
  d["count"] = c.count;
  d["vector"] = c.vector;
  d["tile_row"] = c.slot.row;
  d["tile_col"] = c.slot.col;
  return d;
}

nb::dict PlanElementwise(int64_t groups, int64_t per_group, int64_t resident_blocks) {
  CheckNonNegative("groups", groups);
  CheckNonNegative("per_group", per_group);
  const p::ElementwisePlan pl = p::PlanElementwise(groups, per_group, resident_blocks);
  nb::dict d;
  d["tiles_per_group"] = pl.tiles_per_group;
  d["tiles"] = pl.tiles;
  d["grid"] = pl.grid;
  d["block"] = pl.block;
  d["chunks_per_tile"] = p::kChunksPerTile;
  return d;
}

nb::dict SplitChunks(uint64_t wide_addr, int wide_bytes, uint64_t narrow_addr, int64_t n) {
  const p::ChunkSplit s = p::SplitChunks(wide_addr, wide_bytes, narrow_addr, n);
  nb::dict d;
  d["start"] = s.start;
  d["chunks"] = s.chunks;
  d["vector"] = s.vector;
  return d;
}

nb::dict ChunkAt(uint64_t wide_addr, int wide_bytes, uint64_t narrow_addr, int64_t n, int64_t c) {
  return ChunkDict(p::ChunkAt(p::SplitChunks(wide_addr, wide_bytes, narrow_addr, n), c, n));
}

nb::tuple GroupTileAt(int64_t tile, int64_t tiles_per_group) {
  if (tiles_per_group < 1) throw std::invalid_argument("tiles_per_group must be >= 1");
  const p::GroupTile gt = p::GroupTileAt(tile, tiles_per_group);
  return nb::make_tuple(gt.group, gt.first_chunk);
}

nb::dict PlanCastTranspose(int64_t matrices, int64_t rows, int64_t cols, int64_t resident_blocks) {
  CheckNonNegative("matrices", matrices);
  CheckNonNegative("rows", rows);
  CheckNonNegative("cols", cols);
  const p::TransposePlan pl = p::PlanCastTranspose(matrices, rows, cols, resident_blocks);
  nb::dict d;
  d["row_tiles"] = pl.row_tiles;
  d["col_tiles"] = pl.col_tiles;
  d["tiles"] = pl.tiles;
  d["grid"] = pl.grid;
  d["block"] = pl.block;
  d["tile"] = p::kTile;
  return d;
}

p::TransposeArgs TransposeArgsOf(int64_t matrices, int64_t rows, int64_t cols, int wide_bytes,
                                 uint64_t x_addr, uint64_t q_addr, uint64_t qt_addr) {
  CheckNonNegative("matrices", matrices);
  CheckNonNegative("rows", rows);
  CheckNonNegative("cols", cols);
  const p::TransposePlan pl = p::PlanCastTranspose(matrices, rows, cols, 1);
  p::TransposeArgs a;
  a.rows = rows;
  a.cols = cols;
  a.mats_per_group = matrices;
  a.row_tiles = pl.row_tiles;
  a.col_tiles = pl.col_tiles;
  a.tiles = pl.tiles;
  a.x_addr = x_addr;
  a.wide_bytes = wide_bytes;
  a.q_addr = q_addr;
  a.qt_addr = qt_addr;
  a.fast = p::FastEligible(rows, cols, x_addr, wide_bytes, q_addr, qt_addr);
  return a;
}

nb::dict TransposeChunks(int64_t rows, int64_t cols, int wide_bytes, uint64_t x_addr,
                         uint64_t q_addr, uint64_t qt_addr, int64_t tile, int64_t matrices, int sub,
                         int thread, int pass) {
  if (thread < 0 || thread >= p::kThreads || pass < 0 || pass > 1 || sub < 0 ||
      sub >= p::kSubTiles) {
    throw std::invalid_argument("thread must be in [0, 256), sub in [0, 4) and pass 0 or 1");
  }
  const p::TransposeArgs a =
      TransposeArgsOf(matrices, rows, cols, wide_bytes, x_addr, q_addr, qt_addr);
  if (tile < 0 || tile >= a.tiles) throw std::invalid_argument("tile out of range");
  const p::MatTile big = p::MatTileAt(tile, a.row_tiles, a.col_tiles);
  const p::MatTile mt = p::SubTile(big, sub);
  nb::dict d;
  d["mat"] = mt.mat;
  d["row0"] = big.row0;
  d["col0"] = big.col0;
  d["fast"] = p::FastTileOk(a, big);
  d["load"] = TileChunkDict(p::LoadChunk(a, mt, thread, pass));
  d["store"] = TileChunkDict(p::StoreChunk(a, mt, thread, pass));
  return d;
}

nb::tuple Transpose8x8(const std::vector<uint64_t>& rows) {
  if (rows.size() != 8) throw std::invalid_argument("need 8 words");
  uint64_t w[8];
  for (int i = 0; i < 8; ++i) w[i] = rows[static_cast<size_t>(i)];
  p::Transpose8x8(w);
  return nb::make_tuple(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]);
}

// Pass 2 of the column sums (dbias, the norm backward's dgamma/dbeta) for `rows` partial rows
// of `matrices` x `cols` columns: its work items (blocks' worth of columns) and the rows each
// thread adds in sequence.
nb::dict PlanTotals(int64_t matrices, int64_t rows, int64_t cols) {
  if (matrices < 0 || rows < 0 || cols < 0) throw std::invalid_argument("negative size");
  nb::dict d;
  d["items"] = p::TotalsItems(matrices, cols);
  d["steps"] = p::TotalsSteps(rows);
  d["threads"] = p::kThreads;
  return d;
}

// cuda/cuda_util.h's ResidentBlocks caching (common/resident_cache.h), with a stand-in for the
// occupancy query: 2048 / threads blocks, a failure for threads < 1. Asks one fresh cache for
// each (device, kernel id, threads) in order; returns each answer (-1 for a failure) and how many
// times the query ran.
struct StubResult {
  bool ok = true;
  bool success() const { return ok; }
  static StubResult Success() { return {}; }
};

std::pair<std::vector<int64_t>, int64_t> ResidentCacheAnswers(
    const std::vector<std::vector<int64_t>>& asks) {
  ResidentCache cache;
  std::vector<int64_t> answers;
  int64_t queries = 0;
  for (const auto& ask : asks) {
    if (ask.size() != 3) throw std::invalid_argument("each ask is (device, kernel, threads)");
    const auto threads = static_cast<int>(ask[2]);
    int64_t out = -1;
    const ResidentCache::Key key{static_cast<int>(ask[0]),
                                 reinterpret_cast<const void*>(static_cast<uintptr_t>(ask[1])),
                                 threads};
    const StubResult r = cache.Get(key, &out, [&](int64_t* count) {
      ++queries;
      if (threads < 1) return StubResult{false};
      *count = 2048 / threads;
      return StubResult{};
    });
    answers.push_back(r.success() ? out : -1);
  }
  return {answers, queries};
}

}  // namespace

void AddPlanBindings(nb::module_& m) {
  m.def("_resident_cache_answers", &ResidentCacheAnswers, nb::arg("asks"));
  m.def("_plan_totals", &PlanTotals, nb::arg("matrices"), nb::arg("rows"), nb::arg("cols"));
  m.def("_plan_elementwise", &PlanElementwise, nb::arg("groups"), nb::arg("per_group"),
        nb::arg("resident_blocks"));
  m.def("_plan_split_chunks", &SplitChunks, nb::arg("wide_addr"), nb::arg("wide_bytes"),
        nb::arg("narrow_addr"), nb::arg("n"));
  m.def("_plan_chunk_at", &ChunkAt, nb::arg("wide_addr"), nb::arg("wide_bytes"),
        nb::arg("narrow_addr"), nb::arg("n"), nb::arg("chunk"));
  m.def("_plan_group_tile_at", &GroupTileAt, nb::arg("tile"), nb::arg("tiles_per_group"));
  m.def("_plan_cast_transpose", &PlanCastTranspose, nb::arg("matrices"), nb::arg("rows"),
        nb::arg("cols"), nb::arg("resident_blocks"));
  m.def("_plan_transpose_chunks", &TransposeChunks, nb::arg("rows"), nb::arg("cols"),
        nb::arg("wide_bytes"), nb::arg("x_addr"), nb::arg("q_addr"), nb::arg("qt_addr"),
        nb::arg("tile"), nb::arg("matrices"), nb::arg("sub"), nb::arg("thread"), nb::arg("pass_"));
  m.def("_plan_transpose8x8", &Transpose8x8, nb::arg("words"));
}

}  // namespace fp8jax
