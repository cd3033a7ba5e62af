// The CUDA computations of cast_transpose and cast_transpose_dbias (ops/casts.h), the kernel of
// cuda_cast_transpose.cuh reading x itself.
//
// Same numerics as the CPU computations. Each runs on XLA's stream, never synchronises the host,
// reports launch failures as ffi::Error, and allocates nothing (command-buffer compatible).
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
#include "ops/casts.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

ffi::Error CastTranspose::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return LaunchCastTransposeOf<W, F, false>(
                               op, stream, DirectSource<W>{x.untyped_data()},
                               Addr(x.untyped_data()), s, scale.typed_data(), q->untyped_data(),
                               qt->untyped_data(), scale_inv->typed_data(), amax->typed_data(),
                               nullptr);
                         });
}

// The kernel's 128-row tiles write the workspace's partial rows (kDbiasTileRows each).
ffi::Error CastTransposeDbias::Compute(CudaStream stream) {
  const char* op = kName;
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

// Both are command-buffer (CUDA graph) compatible: the same memset and
// launches for the same shapes, no allocation, no host synchronisation.

}  // namespace fp8jax
