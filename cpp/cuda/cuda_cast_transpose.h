// Launch functions of the CUDA cast_transpose family (cuda_cast_transpose.cu),
// shared with the activation forms (cuda_activation.cu).
#pragma once

#include <cuda_runtime.h>

#include "common/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// Enqueues the cast_transpose of `s.matrices` [rows, cols] matrices of wide
// kind `w` at x into q and qt (FP8 kind `f`), with scale_inv and amax per group.
ffi::Error LaunchCastTranspose(const char* op, cudaStream_t stream, const void* x, WideKind w,
                               const MatrixShape& s, const float* scale, void* q, void* qt,
                               Fp8Kind f, float* scale_inv, float* amax);

// Enqueues dbias[matrix][col] = the column sums of x (float32, in the fixed
// strip order of common/launch_plan.h), with a workspace from `scratch`.
ffi::Error LaunchColumnSums(const char* op, cudaStream_t stream, ffi::ScratchAllocator& scratch,
                            const void* x, WideKind w, const MatrixShape& s, float* dbias);

}  // namespace fp8jax
