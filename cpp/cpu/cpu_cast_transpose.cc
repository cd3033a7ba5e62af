// The CPU computations of cast_transpose and cast_transpose_dbias (ops/casts.h), on the engine of
// cpu_cast_transpose.h with x itself as the row source.
#include "cpu/cpu_cast_transpose.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "cpu/cpu_handler.h"
#include "ops/casts.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// Both ops, their arguments checked (s: x's matrices); dbias is null for cast_transpose.
ffi::Error CastTransposeAny(const char* op, ffi::ThreadPool* pool, const MatrixShape& s,
                            ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                            ffi::Result<ffi::Buffer<ffi::F32>> amax, float* dbias,
                            float* workspace) {
  const CastTransposeOut o{scale.typed_data(),
                           static_cast<uint8_t*>(q->untyped_data()),
                           static_cast<uint8_t*>(qt->untyped_data()),
                           scale_inv->typed_data(),
                           amax->typed_data(),
                           dbias,
                           workspace};
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           CastTransposeRows<W, F>(pool, DirectRows{x.untyped_data()}, o, s);
                           return ffi::Error::Success();
                         });
}

}  // namespace

ffi::Error CastTranspose::Compute(CpuPool pool) {
  return CastTransposeAny(kName, &pool, s, x, scale, q, qt, scale_inv, amax, nullptr, nullptr);
}

// The dbias partials go to the workspace, one row per strip: the check's tiles.
static_assert(kStripRows == kDbiasTileRows, "the dbias workspace has a row per strip");

ffi::Error CastTransposeDbias::Compute(CpuPool pool) {
  return CastTransposeAny(kName, &pool, s, g, scale, q, qt, scale_inv, amax, dbias->typed_data(),
                          workspace->typed_data());
}

// Strips of kStripRows rows of each matrix, in parallel; each strip through the SSE2 16 x 16
// byte-block transpose (cpu_transpose.h).
ffi::Error Transpose::Compute(CpuPool pool) {
  const auto* src = static_cast<const uint8_t*>(x.untyped_data());
  auto* dst = static_cast<uint8_t*>(xt->untyped_data());
  const int64_t strips = (s.rows + kStripRows - 1) / kStripRows;
  const int64_t items = s.matrices * strips;
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, kStripRows * s.cols));
  ParallelFor(&pool, items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t base = (item / strips) * s.rows * s.cols;
      const int64_t r0 = (item % strips) * kStripRows;
      TransposeRows(src + base, dst + base, s.rows, s.cols, r0, std::min(s.rows, r0 + kStripRows));
    }
  });
  return ffi::Error::Success();
}

// Each output row (a column of one matrix of x) in parallel: every padded position from its source
// row.
ffi::Error TransposePadded::Compute(CpuPool pool) {
  const auto* src = static_cast<const uint8_t*>(x.untyped_data());
  auto* dst = static_cast<uint8_t*>(xt->untyped_data());
  const auto* sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  std::vector<int64_t> from(s.matrices * padded);
  for (int64_t m = 0; m < s.matrices; ++m) {
    for (int64_t p = 0; p < padded; ++p) {
      from[m * padded + p] = grouped::PaddedSource(sizes + m * groups, groups, s.rows, width, p);
    }
  }
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(1, padded));
  ParallelFor(&pool, s.matrices * s.cols, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m = item / s.cols, c = item % s.cols;
      const uint8_t* in = src + m * s.rows * s.cols;
      const int64_t* f = from.data() + m * padded;
      uint8_t* out = dst + (m * s.cols + c) * padded;
      for (int64_t p = 0; p < padded; ++p) out[p] = f[p] < 0 ? 0 : in[f[p] * s.cols + c];
    }
  });
  return ffi::Error::Success();
}

}  // namespace fp8jax
