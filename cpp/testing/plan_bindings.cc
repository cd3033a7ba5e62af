// The `_plan_*` / `_simulate_*` functions of the test-only `fp8jax._fp8jax_testing`: the
// CUDA kernels' launch planning (cpp/common/launch_plan.h), compiled for the
// host so that tests/ops/test_launch_plan.py checks it without a GPU.
//
// The simulations run each kernel's tile walk (the same WalkElementwise /
// WalkCastTranspose / WalkGroups the kernels call) for every block and thread
// of the planned grid, and record which element each thread touches, whether
// by a vector access (and whether that access is aligned), and, for
// cast_transpose, which input element each q_t code comes from through the
// shared-memory tile. Meant for small shapes: the arrays are one entry per
// element.
#include "testing/plan_bindings.h"

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <limits>
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

nb::bytes Bytes(const std::vector<int64_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int64_t));
}

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

p::TransposeArgs TransposeArgsOf(int64_t matrices, int64_t rows, int64_t cols, int64_t groups,
                                 int wide_bytes, uint64_t x_addr, uint64_t q_addr, uint64_t qt_addr,
                                 int64_t resident_blocks) {
  CheckNonNegative("matrices", matrices);
  CheckNonNegative("rows", rows);
  CheckNonNegative("cols", cols);
  if (groups < 1 || matrices % groups != 0) {
    throw std::invalid_argument("groups must be >= 1 and divide matrices");
  }
  const p::TransposePlan pl = p::PlanCastTranspose(matrices, rows, cols, resident_blocks);
  p::TransposeArgs a;
  a.rows = rows;
  a.cols = cols;
  a.mats_per_group = matrices / groups;
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
      TransposeArgsOf(matrices, rows, cols, 1, wide_bytes, x_addr, q_addr, qt_addr, 1);
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

// Every group written by exactly one thread of the grid (scale_inv).
std::vector<int64_t> SimulateGroups(int64_t groups, int64_t grid) {
  std::vector<int64_t> writes(static_cast<size_t>(groups), 0);
  for (int64_t b = 0; b < grid; ++b) {
    for (int t = 0; t < p::kThreads; ++t) {
      p::WalkGroups(groups, b, grid, t, [&](int64_t g) { ++writes[static_cast<size_t>(g)]; });
    }
  }
  return writes;
}

constexpr int64_t kMaxSimElements = int64_t{1} << 24;

nb::dict SimulateElementwise(int64_t groups, int64_t per_group, int wide_bytes, uint64_t wide_addr,
                             uint64_t narrow_addr, int64_t resident_blocks) {
  CheckNonNegative("groups", groups);
  CheckNonNegative("per_group", per_group);
  if (groups * per_group > kMaxSimElements) throw std::invalid_argument("too large to simulate");
  const p::ElementwisePlan pl = p::PlanElementwise(groups, per_group, resident_blocks);
  p::ElementwiseArgs a;
  a.groups = groups;
  a.per_group = per_group;
  a.tiles_per_group = pl.tiles_per_group;
  a.tiles = pl.tiles;
  a.wide_addr = wide_addr;
  a.wide_bytes = wide_bytes;
  a.narrow_addr = narrow_addr;
  const auto n = static_cast<size_t>(groups * per_group);
  std::vector<int64_t> visits(n, 0), vector_visits(n, 0), flushes(static_cast<size_t>(groups), 0);
  int64_t misaligned = 0;
  int64_t out_of_group = 0;
  for (int64_t b = 0; b < pl.grid; ++b) {
    // The kernel flushes amax once per (block, group); count it per block.
    std::vector<int64_t> block_flushes(static_cast<size_t>(groups), 0);
    for (int t = 0; t < p::kThreads; ++t) {
      p::WalkElementwise(
          a, b, pl.grid, t,
          [&](int64_t g, int64_t base, const p::ChunkElems* chunks) {
            for (int k = 0; k < p::kChunksPerThread; ++k) {
              const p::ChunkElems& e = chunks[k];
              for (int j = 0; j < e.count; ++j) {
                const int64_t i = base + e.first + j;
                if (i < g * per_group || i >= (g + 1) * per_group) {
                  ++out_of_group;
                  continue;
                }
                ++visits[static_cast<size_t>(i)];
                if (e.vector) ++vector_visits[static_cast<size_t>(i)];
              }
              if (e.vector) {
                const uint64_t i = static_cast<uint64_t>(base + e.first);
                if ((wide_addr + i * static_cast<uint64_t>(wide_bytes)) % p::kWideAlign != 0 ||
                    (narrow_addr + i) % p::kNarrowAlign != 0) {
                  ++misaligned;
                }
              }
            }
          },
          [&](int64_t g) {
            if (t == 0) ++block_flushes[static_cast<size_t>(g)];
          });
    }
    for (size_t g = 0; g < block_flushes.size(); ++g) flushes[g] += block_flushes[g];
  }
  nb::dict d;
  d["grid"] = pl.grid;
  d["tiles"] = pl.tiles;
  d["visits"] = Bytes(visits);
  d["vector_visits"] = Bytes(vector_visits);
  d["misaligned_vector_chunks"] = misaligned;
  d["out_of_group"] = out_of_group;
  d["amax_flushes"] = Bytes(flushes);
  d["scale_inv_writes"] = Bytes(SimulateGroups(groups, pl.grid));
  return d;
}

nb::dict SimulateCastTranspose(int64_t matrices, int64_t rows, int64_t cols, int64_t groups,
                               int wide_bytes, uint64_t x_addr, uint64_t q_addr, uint64_t qt_addr,
                               int64_t resident_blocks) {
  const p::TransposeArgs a = TransposeArgsOf(matrices, rows, cols, groups, wide_bytes, x_addr,
                                             q_addr, qt_addr, resident_blocks);
  if (matrices * rows * cols > kMaxSimElements) {
    throw std::invalid_argument("too large to simulate");
  }
  const p::TransposePlan pl = p::PlanCastTranspose(matrices, rows, cols, resident_blocks);
  const auto n = static_cast<size_t>(matrices * rows * cols);
  // q_src[i]: the x element whose code thread wrote to q[i]; qt_src[i]: the x
  // element whose code reached q_t[i] through the shared-memory tile.
  std::vector<int64_t> q_visits(n, 0), qt_visits(n, 0), q_src(n, -1), qt_src(n, -1);
  std::vector<int64_t> vector_q(n, 0), vector_qt(n, 0), flushes(static_cast<size_t>(groups), 0);
  int64_t misaligned = 0;
  std::vector<int64_t> smem(static_cast<size_t>(p::kTile) * (p::kTile + 8), -1);
  auto at = [&](int r, int c) -> int64_t& {
    return smem[static_cast<size_t>(r) * (p::kTile + 8) + static_cast<size_t>(c)];
  };
  // The fast path's shared buffer: the source element of each byte of each word.
  std::vector<int64_t> words(static_cast<size_t>(p::kBigTile) * p::kBlocksPerEdge * 8, -1);
  int64_t fast_tiles = 0;
  int64_t bank_conflicts = 0;
  // Shared-memory wavefronts beyond the minimum for one warp instruction:
  // `slots` are the accessed addresses in units of the access width (8 or 16
  // bytes); a phase serves 128 bytes (16 threads of 8 bytes, 8 of 16) and is
  // conflict-free when its slots hit distinct banks (distinct slot mod phase).
  auto conflicts = [](const std::vector<int>& slots, int per_phase) {
    int64_t extra = 0;
    for (size_t first = 0; first < slots.size(); first += static_cast<size_t>(per_phase)) {
      std::vector<int> hits(static_cast<size_t>(per_phase), 0);
      int worst = 0;
      for (size_t i = first; i < first + static_cast<size_t>(per_phase) && i < slots.size(); ++i) {
        const int h = ++hits[static_cast<size_t>(slots[i] % per_phase)];
        worst = h > worst ? h : worst;
      }
      extra += worst > 1 ? worst - 1 : 0;
    }
    return extra;
  };
  auto fast_tile = [&](const p::MatTile& mt) {
    ++fast_tiles;
    const int64_t mat_base = mt.mat * rows * cols;
    for (int warp = 0; warp < p::kThreads / 32; ++warp) {
      std::vector<std::vector<int>> write_slots(p::kVec);
      for (int t = warp * 32; t < warp * 32 + 32; ++t) {
        const int rb = p::FastRowBlock(t);
        const int cb = p::FastColBlock(t);
        uint64_t w[8];
        int64_t src[8][8];
        for (int i = 0; i < 8; ++i) {
          const int64_t off =
              mat_base + (mt.row0 + rb * 8 + i) * cols + mt.col0 + static_cast<int64_t>(cb) * 8;
          if ((x_addr + static_cast<uint64_t>(off) * wide_bytes) % p::kWideAlign != 0 ||
              (q_addr + static_cast<uint64_t>(off)) % p::kNarrowAlign != 0) {
            ++misaligned;
          }
          w[i] = 0;
          for (int j = 0; j < 8; ++j) {
            const auto e = static_cast<size_t>(off + j);
            ++q_visits[e];
            q_src[e] = off + j;
            ++vector_q[e];
            src[i][j] = off + j;
            w[i] |= static_cast<uint64_t>(i * 8 + j) << (8 * j);  // element ids
          }
        }
        p::Transpose8x8(w);
        for (int j = 0; j < 8; ++j) {
          const int word = p::FastWord(cb * 8 + j, rb);
          write_slots[static_cast<size_t>(j)].push_back(word);
          for (int i = 0; i < 8; ++i) {
            const auto id = static_cast<int>((w[j] >> (8 * i)) & 0xFF);
            words[static_cast<size_t>(word) * 8 + static_cast<size_t>(i)] = src[id / 8][id % 8];
          }
        }
      }
      for (const auto& slots : write_slots) bank_conflicts += conflicts(slots, 16);
    }
    for (int warp = 0; warp < p::kThreads / 32; ++warp) {
      for (int step = 0; step < p::kFastReadSteps; ++step) {
        std::vector<int> read_slots;
        for (int t = warp * 32; t < warp * 32 + 32; ++t) {
          const int c = p::FastReadCol(t, step);
          const int k = p::FastReadPair(t);
          const int word = p::FastReadWord(c, k);
          if (word % 2 != 0) ++misaligned;
          read_slots.push_back(word / 2);
          const int64_t dst = mat_base + (mt.col0 + c) * rows + mt.row0 + 16 * k;
          if ((qt_addr + static_cast<uint64_t>(dst)) % 16 != 0) ++misaligned;
          const bool swapped = p::FastReadSwapped(c);
          for (int h = 0; h < 2; ++h) {
            const int from = word + (swapped ? 1 - h : h);
            for (int i = 0; i < 8; ++i) {
              const auto e = static_cast<size_t>(dst + 8 * h + i);
              ++qt_visits[e];
              ++vector_qt[e];
              qt_src[e] = words[static_cast<size_t>(from) * 8 + static_cast<size_t>(i)];
            }
          }
        }
        bank_conflicts += conflicts(read_slots, 8);
      }
    }
  };
  auto guarded_tile = [&](const p::MatTile& mt) {
    for (int t = 0; t < p::kThreads; ++t) {
      for (int pass = 0; pass < 2; ++pass) {
        const p::TileChunk c = p::LoadChunk(a, mt, t, pass);
        for (int j = 0; j < p::kVec; ++j) at(c.slot.row, c.slot.col + j) = -1;
        for (int j = 0; j < c.count; ++j) {
          const auto i = static_cast<size_t>(c.offset + j);
          ++q_visits[i];
          q_src[i] = c.offset + j;
          vector_q[i] += c.vector ? 1 : 0;
          at(c.slot.row, c.slot.col + j) = c.offset + j;
        }
        if (c.vector && ((x_addr + static_cast<uint64_t>(c.offset) * wide_bytes) % 16 != 0 ||
                         (q_addr + static_cast<uint64_t>(c.offset)) % 8 != 0)) {
          ++misaligned;
        }
      }
    }
    for (int t = 0; t < p::kThreads; ++t) {
      for (int pass = 0; pass < 2; ++pass) {
        const p::TileChunk c = p::StoreChunk(a, mt, t, pass);
        for (int j = 0; j < c.count; ++j) {
          const auto i = static_cast<size_t>(c.offset + j);
          ++qt_visits[i];
          qt_src[i] = at(c.slot.row + j, c.slot.col);
          vector_qt[i] += c.vector ? 1 : 0;
        }
        if (c.vector && (qt_addr + static_cast<uint64_t>(c.offset)) % 8 != 0) ++misaligned;
      }
    }
  };
  for (int64_t b = 0; b < pl.grid; ++b) {
    // A block's threads run in lock step between barriers: walk the block's
    // tiles once, running each phase for all threads before the next.
    p::WalkCastTranspose(
        a, b, pl.grid,
        [&](int64_t, const p::MatTile& mt) {
          if (p::FastTileOk(a, mt)) {
            fast_tile(mt);
            return;
          }
          for (int sub = 0; sub < p::kSubTiles; ++sub) guarded_tile(p::SubTile(mt, sub));
        },
        [&](int64_t g) { ++flushes[static_cast<size_t>(g)]; });
  }
  nb::dict d;
  d["grid"] = pl.grid;
  d["tiles"] = pl.tiles;
  d["q_visits"] = Bytes(q_visits);
  d["qt_visits"] = Bytes(qt_visits);
  d["q_src"] = Bytes(q_src);
  d["qt_src"] = Bytes(qt_src);
  d["vector_q"] = Bytes(vector_q);
  d["vector_qt"] = Bytes(vector_qt);
  d["misaligned_vector_chunks"] = misaligned;
  d["amax_flushes"] = Bytes(flushes);
  d["scale_inv_writes"] = Bytes(SimulateGroups(groups, pl.grid));
  d["fast_tiles"] = fast_tiles;
  d["bank_conflicts"] = bank_conflicts;
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
  m.def("_simulate_elementwise", &SimulateElementwise, nb::arg("groups"), nb::arg("per_group"),
        nb::arg("wide_bytes"), nb::arg("wide_addr"), nb::arg("narrow_addr"),
        nb::arg("resident_blocks"));
  m.def("_simulate_cast_transpose", &SimulateCastTranspose, nb::arg("matrices"), nb::arg("rows"),
        nb::arg("cols"), nb::arg("groups"), nb::arg("wide_bytes"), nb::arg("x_addr"),
        nb::arg("q_addr"), nb::arg("qt_addr"), nb::arg("resident_blocks"));
  m.def("_plan_transpose8x8", &Transpose8x8, nb::arg("words"));
}

}  // namespace fp8jax
