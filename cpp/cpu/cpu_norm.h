// What cpu_norm.cc offers the other CPU handlers: the norm forward into a buffer of the caller's,
// for norm_block_cast_transpose (cpu_block_scaling.cc), which block-casts the very y that
// norm_forward returns.
#pragma once

#include "common/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// norm_forward of x ([groups * rows, h] in memory, shape `s`, already checked; x's dtype must be
// float32, bfloat16 or float16) into y (x's dtype and size), mu and rs (one per row), on `pool`.
// `layer`: layernorm (beta read), else rmsnorm (beta may be null).
void NormForwardInto(ffi::ThreadPool* pool, bool layer, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, float eps,
                     bool zero_centered, const NormShape& s, void* y, float* mu, float* rs);

}  // namespace fp8jax
