// CPU FFI handlers of the block-scaled casts: block_quantize and block_cast_transpose
// (common/block_scale.h has the numerics and the layouts; fp8jax/ops/block_scaling.py the
// references they equal bit for bit).
//
// Work is split by block rows: a task takes br rows of one matrix, finds the amax of each block
// along them (one row-major pass), makes the scales, then writes the codes (row-major, or column
// by column for the transposed layout, so the [K, M] codes are written in order).
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/block_scale.h"
#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/op_table.h"
#include "common/wide.h"
#include "cpu/cpu_handler.h"
#include "cpu/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

template <WideKind W, typename F>
void BlockCastCompute(ffi::ThreadPool* pool, const void* x, const block::Cast& c, uint8_t* q,
                      void* scale_inv) {
  const int64_t grid_rows = c.GridRows(), grid_cols = c.GridCols();
  const int64_t strips = c.groups * grid_rows;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, c.br * c.cols));
  ParallelFor(pool, strips, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> amax(grid_cols);
    std::vector<float> scale(grid_cols);
    std::vector<uint8_t> expo(grid_cols);
    for (int64_t strip = begin; strip < end; ++strip) {
      const int64_t g = strip / grid_rows, i = strip % grid_rows;
      const int64_t r0 = i * c.br, r1 = std::min(c.rows, r0 + c.br);
      const int64_t base = g * c.rows * c.cols;
      std::fill(amax.begin(), amax.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t col = 0; col < c.cols; ++col) {
          const uint32_t a = block::AmaxBits(LoadWide<W>(x, base + r * c.cols + col));
          uint32_t& m = amax[col / c.bc];
          m = std::max(m, a);
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
        const float v = LoadWide<W>(x, base + r * c.cols + col);
        const int64_t j = col / c.bc;
        q[c.CodeIndex(g, r, col)] = c.mode == block::ScaleMode::kE8m0
                                        ? block::MxQuantizeValue<F>(v, expo[j])
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

ffi::Error BlockCast(ffi::ThreadPool* pool, const char* op, const ffi::AnyBuffer& x,
                     const block::Cast& c, ffi::AnyBuffer& q, ffi::AnyBuffer& scale_inv) {
  return DispatchWideFp8(
      op, WideKindOf(x.element_type()), Fp8KindOf(q.element_type()), [&]<WideKind W, typename F>() {
        BlockCastCompute<W, F>(pool, x.untyped_data(), c, static_cast<uint8_t*>(q.untyped_data()),
                               scale_inv.untyped_data());
        return ffi::Error::Success();
      });
}

ffi::Error BlockQuantizeImpl(ffi::ThreadPool pool, sig::Any x, int64_t block_rows,
                             int64_t block_cols, int64_t scale_mode, float epsilon, sig::AnyOut q,
                             sig::AnyOut scale_inv) {
  block::Cast c;
  FP8JAX_RETURN_IF_ERROR(CheckBlockCast(kBlockQuantizeOp, x, block_rows, block_cols, scale_mode,
                                        epsilon, *q, *scale_inv, &c));
  return BlockCast(&pool, kBlockQuantizeOp, x, c, *q, *scale_inv);
}

ffi::Error BlockCastTransposeImpl(ffi::ThreadPool pool, sig::Any x, int64_t block_rows,
                                  int64_t block_cols, int64_t scale_mode, float epsilon,
                                  sig::AnyOut q, sig::AnyOut scale_inv, sig::AnyOut qt,
                                  sig::AnyOut scale_inv_t) {
  block::Cast c, ct;
  FP8JAX_RETURN_IF_ERROR(CheckBlockCastTranspose(x, block_rows, block_cols, scale_mode, epsilon, *q,
                                                 *scale_inv, *qt, *scale_inv_t, &c, &ct));
  FP8JAX_RETURN_IF_ERROR(BlockCast(&pool, kBlockCastTransposeOp, x, c, *q, *scale_inv));
  return BlockCast(&pool, kBlockCastTransposeOp, x, ct, *qt, *scale_inv_t);
}

}  // namespace
}  // namespace fp8jax

FP8JAX_CPU_HANDLER(BlockQuantize, fp8jax::BlockQuantizeImpl);
FP8JAX_CPU_HANDLER(BlockCastTranspose, fp8jax::BlockCastTransposeImpl);
