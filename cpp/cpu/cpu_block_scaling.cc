// The CPU computations of the block-scaled casts (ops/block_casts.h): block_quantize,
// block_cast_transpose and its fused forms, block_cast_transpose_dbias,
// activation_block_cast_transpose, dactivation_block_cast_transpose_dbias and
// norm_block_cast_transpose (the norm computed into a scratch buffer by cpu_norm.cc, then cast:
// norm_forward's y itself), and rowwise_quantize (the block cast with one 1 x K block a row)
// (common/block_scale.h has the numerics and the layouts,
// common/block_sources.h what the fused forms quantize and the dbias order;
// fp8jax/ops/block/block_scaling.py and fused/block_fused.py the references they equal).
//
// Work is split by block rows: a task takes br rows of one matrix, computes their values once
// (the source), finds the amax of each block along them, makes the scales, then writes the codes
// (row-major, or column by column for the transposed layout, so the [K, M] codes are written in
// order).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/block_scale.h"
#include "common/block_sources.h"
#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/wide.h"
#include "cpu/cpu_cast_transpose.h"  // ColumnTotals
#include "cpu/cpu_handler.h"
#include "cpu/cpu_norm.h"
#include "cpu/cpu_parallel.h"
#include "ops/block_casts.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

using block::ActSource;
using block::DActSource;
using block::DirectSource;

// One layout of a block-scaled cast of `src`'s values (block_sources.h).
template <WideKind W, typename F, typename Source>
void BlockCastCompute(ffi::ThreadPool* pool, const Source& src, const block::Cast& c, uint8_t* q,
                      void* scale_inv) {
  const int64_t grid_rows = c.GridRows(), grid_cols = c.GridCols();
  const int64_t strips = c.groups * grid_rows;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, c.br * c.cols));
  ParallelFor(pool, strips, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> values(c.br * c.cols);  // the strip's values, computed once
    std::vector<uint32_t> amax(grid_cols);
    std::vector<float> scale(grid_cols);
    std::vector<uint8_t> expo(grid_cols);
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t g = strip / grid_rows, i = strip % grid_rows;
      const int64_t r0 = i * c.br, r1 = std::min(c.rows, r0 + c.br);
      std::fill(amax.begin(), amax.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) {
        float* row = values.data() + (r - r0) * c.cols;
        for (int64_t col = 0; col < c.cols; ++col) {
          row[col] = src(g, r, col);
          uint32_t& m = amax[col / c.bc];
          m = std::max(m, block::AmaxBits(row[col]));
        }
      }
      for (int64_t j = 0; j < grid_cols; ++j) {
        const float a = BitsToFloat(amax[j]);
        const int64_t at = c.ScaleIndex(g, i, j);
        if (c.mode == block::ScaleMode::kE8m0) {
          expo[j] = block::E8m0Exponent(a, F::kMax);
          static_cast<uint8_t*>(scale_inv)[at] = expo[j];
        } else {
          scale[j] = block::BlockScale(a, F::kMax, block::InputMax<W>(),
                                       c.mode == block::ScaleMode::kPow2, c.epsilon);
          static_cast<float*>(scale_inv)[at] = block::InverseScale(scale[j]);
        }
      }
      const auto code = [&](int64_t r, int64_t col) {
        const float v = values[(r - r0) * c.cols + col];
        const int64_t j = col / c.bc;
        q[c.CodeIndex(g, r, col)] = c.mode == block::ScaleMode::kE8m0
                                        ? block::MxQuantizeValue<F>(v, expo[j], QuantizeValue<F>)
                                        : QuantizeValue<F>(v, scale[j]);
      };
      if (c.transposed) {
        for (int64_t col = 0; col < c.cols; ++col) {
          for (int64_t r = r0; r < r1; ++r) code(r, col);
        }
      } else {
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t col = 0; col < c.cols; ++col) code(r, col);
        }
      }
    }
  });
}

// Both layouts of the cast of `src` (q: blocks br x bc; q_t: bc x br of the transpose), and with
// a dbias buffer its column sums: the tiles' partials (block::TileColumnSum) into `partial`
// [groups, row tiles, cols], then the column totals in the order of the other dbias kernels.
template <WideKind W, typename F, typename Source>
void BlockCastBoth(ffi::ThreadPool* pool, const Source& src, const block::Cast& c,
                   const block::Cast& ct, ffi::AnyBuffer& q, ffi::AnyBuffer& scale_inv,
                   ffi::AnyBuffer& qt, ffi::AnyBuffer& scale_inv_t, float* dbias = nullptr,
                   float* partial = nullptr) {
  BlockCastCompute<W, F>(pool, src, c, static_cast<uint8_t*>(q.untyped_data()),
                         scale_inv.untyped_data());
  BlockCastCompute<W, F>(pool, src, ct, static_cast<uint8_t*>(qt.untyped_data()),
                         scale_inv_t.untyped_data());
  if (dbias == nullptr) return;
  // block::TileColumnSum's order for every column, walked row by row (every column's group sum
  // in a row of accumulators): the same additions in the same order, reading src along its rows.
  const int64_t tiles = (c.rows + block::kTile - 1) / block::kTile;
  ParallelFor(pool, c.groups * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> group(static_cast<size_t>(c.cols));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / tiles, r0 = item % tiles * block::kTile;
      float* tile = partial + item * c.cols;
      std::fill(tile, tile + c.cols, 0.0f);
      for (int64_t q0 = r0; q0 < r0 + block::kTile && q0 < c.rows; q0 += plan::kSumGroup) {
        std::fill(group.begin(), group.end(), 0.0f);
        for (int64_t r = q0; r < q0 + plan::kSumGroup && r < c.rows; ++r) {
          for (int64_t col = 0; col < c.cols; ++col) {
            group[col] = RnAdd(group[col], src(g, r, col));
          }
        }
        for (int64_t col = 0; col < c.cols; ++col) tile[col] = RnAdd(tile[col], group[col]);
      }
    }
  });
  ColumnTotals(pool, partial, c.groups, tiles, c.cols, dbias);
}

ffi::Error BlockCast(ffi::ThreadPool* pool, const char* op, const ffi::AnyBuffer& x,
                     const block::Cast& c, ffi::AnyBuffer& q, ffi::AnyBuffer& scale_inv) {
  return DispatchWideFp8(
      op, WideKindOf(x.element_type()), Fp8KindOf(q.element_type()), [&]<WideKind W, typename F>() {
        const DirectSource<W, ExactHalf> src{x.untyped_data(), c.rows, c.cols};
        BlockCastCompute<W, F>(pool, src, c, static_cast<uint8_t*>(q.untyped_data()),
                               scale_inv.untyped_data());
        return ffi::Error::Success();
      });
}

}  // namespace

ffi::Error BlockQuantize::Compute(CpuPool pool) {
  return BlockCast(&pool, kName, x, c, *q, *scale_inv);
}

// One 1 x K block per row, any K: the block walk takes it as is (a strip is one row). Empty rows
// (K = 0) have amax 0, hence scale 1, and no codes.
ffi::Error RowwiseQuantize::Compute(CpuPool pool) {
  if (c.cols == 0) {
    return DispatchWideFp8(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                           [&]<WideKind W, typename F>() {
                             std::fill_n(static_cast<float*>(scale_inv->untyped_data()), c.rows,
                                         1.0f);
                             return ffi::Error::Success();
                           });
  }
  return BlockCast(&pool, kName, x, c, *q, *scale_inv);
}

ffi::Error BlockCastTranspose::Compute(CpuPool pool) {
  return DispatchWideFp8(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           const DirectSource<W, ExactHalf> src{x.untyped_data(), c.rows, c.cols};
                           BlockCastBoth<W, F>(&pool, src, c, ct, *q, *scale_inv, *qt,
                                               *scale_inv_t);
                           return ffi::Error::Success();
                         });
}

ffi::Error BlockCastTransposeDbias::Compute(CpuPool pool) {
  return DispatchWideFp8(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           const DirectSource<W, ExactHalf> src{x.untyped_data(), c.rows, c.cols};
                           BlockCastBoth<W, F>(&pool, src, c, ct, *q, *scale_inv, *qt, *scale_inv_t,
                                               dbias->typed_data(), workspace->typed_data());
                           return ffi::Error::Success();
                         });
}

ffi::Error ActivationBlockCastTranspose::Compute(CpuPool pool) {
  return DispatchWideFp8(
      kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        return act::Dispatch(code, gated, [&]<int A, bool G>() {
          const ActSource<W, ExactHalf, A, G> src{x.untyped_data(), c.rows, c.cols};
          BlockCastBoth<W, F>(&pool, src, c, ct, *q, *scale_inv, *qt, *scale_inv_t);
          return ffi::Error::Success();
        });
      });
}

ffi::Error DActivationBlockCastTransposeDbias::Compute(CpuPool pool) {
  return DispatchWideFp8(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return act::Dispatch(code, gated, [&]<int A, bool G>() {
                             const DActSource<W, ExactHalf, A, G> src{
                                 g.untyped_data(), x.untyped_data(), c.rows, c.cols};
                             BlockCastBoth<W, F>(&pool, src, c, ct, *q, *scale_inv, *qt,
                                                 *scale_inv_t, dbias->typed_data(),
                                                 workspace->typed_data());
                             return ffi::Error::Success();
                           });
                         });
}

ffi::Error NormBlockCastTranspose::Compute(CpuPool pool) {
  const bool layer = norm_type == static_cast<int64_t>(NormType::kLayerNorm);
  const int64_t bytes = WideKindOf(x.element_type()) == WideKind::kF32 ? 4 : 2;
  std::vector<uint8_t> y(static_cast<size_t>(x.element_count() * bytes));
  NormForwardInto(&pool, layer, x, gamma, layer ? &beta : nullptr, norm_epsilon, zero_centered != 0,
                  s, y.data(), mu->typed_data(), rsigma->typed_data());
  return DispatchWideFp8(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           const DirectSource<W, ExactHalf> src{y.data(), c.rows, c.cols};
                           BlockCastBoth<W, F>(&pool, src, c, ct, *q, *scale_inv, *qt,
                                               *scale_inv_t);
                           return ffi::Error::Success();
                         });
}

}  // namespace fp8jax
