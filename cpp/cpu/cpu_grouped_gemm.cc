// The CPU computation of the ragged grouped GEMM (ops/gemms.h): the numerics and the group walk are
// common/grouped_gemm.h's, which the CUDA kernel shares, so both give the same bits.
//
// Work items of up to kRows output rows (one group's: the rows form's tiles never mix groups) by
// kCols output columns, split over XLA's intra-op pool (ParallelFor). An item walks the
// contraction in chunks of kDepth: it dequantizes B's chunk once into a [kDepth, kCols] panel
// (columns past N are 0, and their sums are dropped), then for each of its rows A's chunk, and adds
// the products into kCols sums per row, t ascending: the inner loop runs over the columns, so the
// compiler vectorizes it without changing any one sum's order (no FMA: the build enables none).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/grouped_gemm.h"
#include "common/launch_plan.h"
#include "common/wide.h"
#include "cpu/cpu_handler.h"
#include "cpu/cpu_parallel.h"
#include "ops/gemms.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

using grouped::Gemm;
using grouped::Span;

constexpr int64_t kRows = 32;
constexpr int64_t kCols = 64;
constexpr int64_t kDepth = 256;

template <WideKind W, typename FA, typename FB>
struct GroupedGemmCpu {
  const Gemm& p;
  const uint8_t* a;
  const uint8_t* b;
  const int32_t* sizes;
  const void* a_scale;
  const void* b_scale;
  void* out;

  // Output rows [i0, i0 + rows) and columns [j0, j0 + kCols) of group g, contracting over s.
  void Item(int64_t g, const Span& s, int64_t i0, int64_t rows, int64_t j0, float* panel,
            float* av) const {
    const int64_t cols = std::min(kCols, p.cols - j0);
    float acc[kRows][kCols] = {};
    for (int64_t t0 = s.begin; t0 < s.begin + s.size; t0 += kDepth) {
      const int64_t len = std::min(kDepth, s.begin + s.size - t0);
      for (int64_t jj = 0; jj < kCols; ++jj) {
        for (int64_t tt = 0; tt < len; ++tt) {
          const int64_t j = j0 + jj, t = t0 + tt;
          panel[tt * kCols + jj] =
              jj < cols ? grouped::Operand<FB>(p, b[grouped::BCode(p, g, j, t)], b_scale,
                                               p.blocks ? grouped::BScale(p, s, g, j, t) : 0)
                        : 0.0f;
        }
      }
      for (int64_t ii = 0; ii < rows; ++ii) {
        const int64_t i = i0 + ii;
        for (int64_t tt = 0; tt < len; ++tt) {
          const int64_t t = t0 + tt;
          av[tt] = grouped::Operand<FA>(p, a[grouped::ACode(p, i, t)], a_scale,
                                        p.blocks ? grouped::AScale(p, s, i, t) : 0);
        }
        float* sums = acc[ii];
        for (int64_t tt = 0; tt < len; ++tt) {
          const float x = av[tt];
          const float* bv = panel + tt * kCols;
          for (int64_t jj = 0; jj < kCols; ++jj)
            sums[jj] = grouped::Accumulate(sums[jj], x, bv[jj]);
        }
      }
    }
    const float gs = grouped::GroupScale(p, static_cast<const float*>(a_scale),
                                         static_cast<const float*>(b_scale), g);
    for (int64_t ii = 0; ii < rows; ++ii) {
      for (int64_t jj = 0; jj < cols; ++jj) {
        StoreWide<W>(out, grouped::OutIndex(p, g, i0 + ii, j0 + jj),
                     grouped::Finish(p, acc[ii][jj], gs));
      }
    }
  }

  void Run(ffi::ThreadPool* pool) const {
    const int64_t panels = plan::CeilDiv(p.cols, kCols);
    const bool rows_form = p.form == grouped::kRows;
    const int64_t row_tiles = rows_form ? grouped::RowTiles(p.ragged, p.groups, kRows)
                                        : p.groups * plan::CeilDiv(p.rows, kRows);
    ParallelFor(pool, row_tiles * panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> panel(kDepth * kCols), av(kDepth);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t rt = item / panels, j0 = item % panels * kCols;
        if (!rows_form) {
          const int64_t g = rt / plan::CeilDiv(p.rows, kRows);
          const int64_t i0 = rt % plan::CeilDiv(p.rows, kRows) * kRows;
          const Span s = grouped::SpanOf(sizes, g, p.ragged, p.width);
          Item(g, s, i0, std::min(kRows, p.rows - i0), j0, panel.data(), av.data());
          continue;
        }
        const grouped::RowTile t = grouped::RowTileAt(sizes, p.groups, p.ragged, kRows, rt);
        if (t.group < p.groups) {
          Item(t.group, Span{0, p.depth, 0}, t.row0, t.rows, j0, panel.data(), av.data());
          continue;
        }
        const int64_t cols = std::min(kCols, p.cols - j0);  // rows past the sum: +0
        for (int64_t i = t.row0; i < t.row0 + t.rows; ++i) {
          for (int64_t j = j0; j < j0 + cols; ++j)
            StoreWide<W>(out, grouped::OutIndex(p, 0, i, j), 0.0f);
        }
      }
    });
  }
};

}  // namespace

ffi::Error GroupedGemm::Compute(CpuPool pool) {
  if (p.OutputSize() == 0) return ffi::Error::Success();
  return Dispatch([&]<WideKind W, typename FA, typename FB>() {
    const GroupedGemmCpu<W, FA, FB> k{p,
                                      static_cast<const uint8_t*>(a.untyped_data()),
                                      static_cast<const uint8_t*>(b.untyped_data()),
                                      static_cast<const int32_t*>(group_sizes.untyped_data()),
                                      a_scale_inv.untyped_data(),
                                      b_scale_inv.untyped_data(),
                                      out->untyped_data()};
    k.Run(&pool);
    return ffi::Error::Success();
  });
}

}  // namespace fp8jax
