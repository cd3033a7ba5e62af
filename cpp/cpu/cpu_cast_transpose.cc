// The CPU computations of cast_transpose and cast_transpose_dbias (ops/casts.h), on the engine of
// cpu_cast_transpose.h with x itself as the row source.
#include "cpu/cpu_cast_transpose.h"

#include <cstdint>

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

}  // namespace fp8jax
