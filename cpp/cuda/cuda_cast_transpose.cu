// CUDA FFI handlers: cast_transpose and cast_transpose_dbias, the kernel of
// cuda_cast_transpose.cuh reading x itself.
//
// Same target names and numerics as the CPU handlers. Every handler takes
// XLA's stream, never synchronises the host, and reports launch failures as
// ffi::Error, and allocates nothing (command-buffer compatible).
// cast_transpose_dbias reads g once: the cast_transpose kernel also writes
// each 128-row tile's column sums to a workspace (a buffer XLA allocates, the
// op's last operand, aliased to its last result), and a second, small kernel
// adds them in order (deterministic).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "cuda/cuda_cast_transpose.cuh"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

ffi::Error CastTransposeImpl(cudaStream_t stream, sig::Any x, sig::F32 scale, sig::AnyOut q,
                             sig::AnyOut qt, sig::F32Out scale_inv, sig::F32Out amax) {
  const char* op = kCastTransposeOp;
  MatrixShape s;
  FP8JAX_RETURN_IF_ERROR(CheckCastTranspose(op, x, scale, *q, *qt, *scale_inv, *amax, &s));
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return LaunchCastTransposeOf<W, F, false>(
                               op, stream, DirectSource<W>{x.untyped_data()},
                               Addr(x.untyped_data()), s, scale.typed_data(), q->untyped_data(),
                               qt->untyped_data(), scale_inv->typed_data(), amax->typed_data(),
                               nullptr);
                         });
}

// The workspace arrives as the last operand and leaves, aliased, as the last
// result; it is written through the result.
ffi::Error CastTransposeDbiasImpl(cudaStream_t stream, sig::Any g, sig::F32 scale, sig::F32,
                                  sig::AnyOut q, sig::AnyOut qt, sig::F32Out scale_inv,
                                  sig::F32Out amax, sig::F32Out dbias, sig::F32Out workspace) {
  const char* op = kCastTransposeDbiasOp;
  MatrixShape s;
  FP8JAX_RETURN_IF_ERROR(CheckCastTransposeDbias(g, scale, *q, *qt, *scale_inv, *amax, *dbias,
                                                 workspace->element_count(), plan::kBigTile, &s));
  float* partial = workspace->typed_data();
  if (auto err = DispatchWideFp8(op, WideKindOf(g.element_type()), Fp8KindOf(q->element_type()),
                                 [&]<WideKind W, typename F>() {
                                   return LaunchCastTransposeOf<W, F, true>(
                                       op, stream, DirectSource<W>{g.untyped_data()},
                                       Addr(g.untyped_data()), s, scale.typed_data(),
                                       q->untyped_data(), qt->untyped_data(),
                                       scale_inv->typed_data(), amax->typed_data(), partial);
                                 });
      !err.success()) {
    return err;
  }
  return LaunchColumnTotals(op, stream, partial, s, dbias->typed_data());
}

}  // namespace
}  // namespace fp8jax

// Both are command-buffer (CUDA graph) compatible: the same memset and
// launches for the same shapes, no allocation, no host synchronisation.
FP8JAX_CUDA_HANDLER(CastTranspose, fp8jax::CastTransposeImpl);
FP8JAX_CUDA_HANDLER(CastTransposeDbias, fp8jax::CastTransposeDbiasImpl);
