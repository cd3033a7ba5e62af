// FP8JAX_CPU_HANDLER(Stem, impl): defines the CPU handler symbol Fp8jax<Stem>Cpu for `impl`,
// which takes XLA's intra-op thread pool and then the op's signature (common/op_table.h).
#pragma once

#include "common/op_table.h"
#include "xla/ffi/api/ffi.h"

// clang-format off: the builder chain one call per line
#define FP8JAX_CPU_HANDLER(Stem, impl)                                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jax##Stem##Cpu, impl,                      \
                                ::xla::ffi::Ffi::Bind()                       \
                                    .Ctx<::xla::ffi::ThreadPool>() FP8JAX_SIGNATURE_##Stem)
// clang-format on
