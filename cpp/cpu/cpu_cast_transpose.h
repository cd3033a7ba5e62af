// The CPU cast_transpose engine (host only): one loop for cast_transpose,
// cast_transpose_dbias and the activation forms.
//
// A `rows x cols` matrix (several, from vmap; `matrices / groups` share a
// scale) is cut into strips of kStripRows rows. Per strip: each row's values
// come from a row *source* (x itself, or a prologue that computes the row from
// the inputs, e.g. act(a) * b, rounded to the wide dtype), are quantized into
// q (long vectorised runs, cpu_loops.h), and the strip is then transposed
// from q, still in cache, into q_t (cpu_transpose.h). amax is the max over
// the rows' values (what was quantized). With dbias, the strip also adds its
// rows' float32 values into its own column partials.
//
// dbias summation order (fixed: independent of the thread count and of how
// the thread pool schedules strips), the CUDA kernel's too (common/
// launch_plan.h): per column, each group of kSumGroup (8) rows is summed in
// row order, each strip (128 rows, a CUDA tile row) sums its groups in order,
// and the strips' sums are added in 16 interleaved lanes, then the lanes in
// order (plan::ColumnLane); every sum starts from +0. So dbias
// has the same bits on every run, with any number of threads, on CPU and GPU.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/launch_plan.h"
#include "cpu/cpu_loops.h"
#include "cpu/cpu_parallel.h"
#include "cpu/cpu_transpose.h"

namespace fp8jax {

template <WideKind W>
constexpr int64_t kWideSize = W == WideKind::kF32 ? 4 : 2;

// Rows per strip: a strip's q_t columns are 128-byte runs; the dbias
// partials are one float32 row per strip (plan::kBigTile, the CUDA tile).
constexpr int64_t kStripRows = plan::kBigTile;
constexpr int64_t kGroupRows = plan::kSumGroup;

// A row source that is x itself: row r of matrix m starts at element
// (m * rows + r) * cols of x.
struct DirectRows {
  static constexpr bool kDirect = true;
  const void* x;
};

// What the engine writes; dbias (matrices x cols float32) may be null, else
// `partial` is its workspace, float32 [matrices, strips, cols] (the XLA
// buffer the op passes in, fp8jax.ops.casts.cast_transpose.dbias_workspace).
struct CastTransposeOut {
  const float* scale;
  uint8_t* q;
  uint8_t* qt;
  float* scale_inv;
  float* amax;
  float* dbias;
  float* partial;
};

// p[c] += float(row[c]) for c in [0, cols).
template <WideKind W>
inline void AddRow(const void* row, int64_t cols, float* p) {
  for (int64_t c = 0; c < cols; ++c) p[c] += BitsToFloat(loops::LoadBits<W>(row, c));
}

inline void AddFloats(const float* v, int64_t cols, float* p) {
  for (int64_t c = 0; c < cols; ++c) p[c] += v[c];
}

// Adds rows of one strip into its partial p in the order above: each
// group's rows into `group` (from 0), then the group into p.
class StripSum {
 public:
  StripSum(float* p, float* group, int64_t cols) : p_(p), group_(group), cols_(cols) {}
  template <WideKind W>
  void Add(const void* row) {
    if (n_ == 0) std::fill(group_, group_ + cols_, 0.0f);
    AddRow<W>(row, cols_, group_);
    if (++n_ == kGroupRows) Flush();
  }
  void Flush() {
    if (n_ > 0) AddFloats(group_, cols_, p_);
    n_ = 0;
  }

 private:
  float* p_;
  float* group_;
  int64_t cols_;
  int64_t n_ = 0;
};

// dbias[m][c] from the partial rows `partial` [matrices, strips, cols] (one per 128-row tile),
// added in plan::ColumnLane order (interleaved lanes, then the lanes in order: the CUDA pass 2's
// order); blocks of columns in parallel. A NaN total is stored canonical.
inline void ColumnTotals(ffi::ThreadPool* pool, const float* partial, int64_t matrices,
                         int64_t strips, int64_t cols, float* dbias) {
  constexpr int64_t kCols = 256;
  const int64_t col_blocks = (cols + kCols - 1) / kCols;
  ParallelFor(pool, matrices * col_blocks, std::max<int64_t>(1, kGrain / (kCols * strips + 1)),
              [&](int64_t begin, int64_t end) {
                float lanes[plan::kColumnLanes][kCols];
                for (int64_t i = begin; i < end; ++i) {
                  const int64_t m = i / col_blocks;
                  const int64_t c0 = (i % col_blocks) * kCols;
                  const int64_t n = std::min(kCols, cols - c0);
                  for (auto& lane : lanes) std::fill(lane, lane + n, 0.0f);
                  for (int64_t st = 0; st < strips; ++st) {
                    const float* p = partial + (m * strips + st) * cols + c0;
                    float* lane = lanes[plan::ColumnLane(st)];
                    for (int64_t c = 0; c < n; ++c) lane[c] += p[c];
                  }
                  float* out = dbias + m * cols + c0;
                  std::fill(out, out + n, 0.0f);
                  for (const auto& lane : lanes) {
                    for (int64_t c = 0; c < n; ++c) out[c] += lane[c];
                  }
                  for (int64_t c = 0; c < n; ++c) out[c] = CanonicalNan(out[c]);
                }
              });
}

// The engine. `src` is DirectRows or a prologue with
//   void Row(int64_t matrix, int64_t r, void* out) const
// that writes the `cols` wide values of row r of `matrix` to `out`.
template <WideKind W, typename F, typename Source>
void CastTransposeRows(ffi::ThreadPool* pool, const Source& src, const CastTransposeOut& o,
                       const MatrixShape& s) {
  const int64_t per_group = s.matrices / s.groups;
  const int64_t mat_size = s.rows * s.cols;
  const int64_t strips = (s.rows + kStripRows - 1) / kStripRows;
  const int64_t items = s.matrices * strips;
  std::unique_ptr<std::atomic<uint32_t>[]> amax_bits(new std::atomic<uint32_t>[s.groups]());
  float* const partial = o.partial;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, kStripRows * s.cols));
  ParallelFor(pool, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<char> row_buf(Source::kDirect ? 0 : s.cols * kWideSize<W>);
    std::vector<float> group_buf(o.dbias != nullptr ? s.cols : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / strips;
      const int64_t g = m / per_group;
      const int64_t r0 = (item % strips) * kStripRows;
      const int64_t r1 = std::min(s.rows, r0 + kStripRows);
      const int64_t base = m * mat_size;
      const float sc = o.scale[g];
      const bool sums = o.dbias != nullptr;
      StripSum sum(sums ? partial + item * s.cols : nullptr, group_buf.data(), s.cols);
      uint32_t local = 0;
      if constexpr (Source::kDirect) {
        const char* x = static_cast<const char*>(src.x) + base * kWideSize<W>;
        loops::QuantizeRange<W, F>(x, sc, o.q + base, r0 * s.cols, r1 * s.cols, &local);
        if (sums) {
          for (int64_t r = r0; r < r1; ++r) sum.Add<W>(x + r * s.cols * kWideSize<W>);
        }
      } else {
        for (int64_t r = r0; r < r1; ++r) {
          src.Row(m, r, row_buf.data());
          loops::QuantizeRange<W, F>(row_buf.data(), sc, o.q + base + r * s.cols, 0, s.cols,
                                     &local);
          if (sums) sum.Add<W>(row_buf.data());
        }
      }
      if (sums) sum.Flush();
      TransposeRows(o.q + base, o.qt + base, s.rows, s.cols, r0, r1);
      AtomicMaxBits(amax_bits[g], local);
    }
  });
  for (int64_t g = 0; g < s.groups; ++g) {
    o.amax[g] = BitsToFloat(amax_bits[g].load(std::memory_order_relaxed));
    o.scale_inv[g] = ScaleInverse(o.scale[g]);
  }
  if (o.dbias != nullptr) ColumnTotals(pool, partial, s.matrices, strips, s.cols, o.dbias);
}

}  // namespace fp8jax
