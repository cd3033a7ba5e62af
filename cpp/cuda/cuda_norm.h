// What cuda_norm.cu offers the other CUDA handlers: the norm forward's row statistics alone,
// for norm_block_cast_transpose (cuda_block_scaling.cu), whose block cast computes y from them
// (common/block_sources.h's NormSource) rather than reading it back from memory.
#pragma once

#include <cuda_runtime.h>

#include "common/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// mu and rsigma of every row of x ([groups * rows, h] in memory, shape `s`, already checked), as
// the plain forward computes them: its own kernel, with no y written. rmsnorm (`layer` false)
// writes zeros to mu and reads no beta.
ffi::Error NormStats(const char* op, bool layer, cudaStream_t stream, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, float eps,
                     bool zero_centered, const NormShape& s, float* mu, float* rsigma);

}  // namespace fp8jax
