// CPU FFI handlers: cast_transpose and cast_transpose_dbias, on the engine of
// cpu_cast_transpose.h with x itself as the row source.
#include "cpu/cpu_cast_transpose.h"

#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "cpu/cpu_handler.h"
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

ffi::Error CastTransposeImpl(ffi::ThreadPool pool, sig::Any x, sig::F32 scale, sig::AnyOut q,
                             sig::AnyOut qt, sig::F32Out scale_inv, sig::F32Out amax) {
  MatrixShape s;
  FP8JAX_RETURN_IF_ERROR(
      CheckCastTranspose(kCastTransposeOp, x, scale, *q, *qt, *scale_inv, *amax, &s));
  return CastTransposeAny(kCastTransposeOp, &pool, s, x, scale, q, qt, scale_inv, amax, nullptr,
                          nullptr);
}

// The workspace arrives as the last operand and leaves, aliased, as the last
// result (fp8jax.ops._opdef.OpDef.workspace); it is written through the result.
ffi::Error CastTransposeDbiasImpl(ffi::ThreadPool pool, sig::Any g, sig::F32 scale, sig::F32,
                                  sig::AnyOut q, sig::AnyOut qt, sig::F32Out scale_inv,
                                  sig::F32Out amax, sig::F32Out dbias, sig::F32Out workspace) {
  MatrixShape s;
  FP8JAX_RETURN_IF_ERROR(CheckCastTransposeDbias(g, scale, *q, *qt, *scale_inv, *amax, *dbias,
                                                 workspace->element_count(), kStripRows, &s));
  return CastTransposeAny(kCastTransposeDbiasOp, &pool, s, g, scale, q, qt, scale_inv, amax,
                          dbias->typed_data(), workspace->typed_data());
}

}  // namespace
}  // namespace fp8jax

FP8JAX_CPU_HANDLER(CastTranspose, fp8jax::CastTransposeImpl);
FP8JAX_CPU_HANDLER(CastTransposeDbias, fp8jax::CastTransposeDbiasImpl);
