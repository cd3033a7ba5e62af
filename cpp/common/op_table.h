// The registry of fp8jax's FFI targets: FP8JAX_OPS(X) calls X(Stem, "target") once per op that
// has a CPU and a CUDA handler, each op family's list in order.
//
// An op's C++ is in one place, its family's header under cpp/ops/ (ops/op.h says how): its
// target and list entry, its signature (the parameters of Stem::Handle) and its argument check.
// From this list each platform's module defines the handler symbols, Fp8jax<Stem>Cpu
// (cpu/module_cpu.cc) and Fp8jax<Stem>Cuda (cuda/module_cuda.cc, which also registers them
// command-buffer compatible), and registers them under the target name; the host run of the
// CUDA kernels defines Fp8jax<Stem>HostCuda (testing/module_host_cuda.cc). Nothing else lists an
// op. The cuBLASLt GEMM (CUDA only, two execution stages) is declared in cuda/gemm_cublaslt.cc.
#pragma once

#include "ops/activations.h"
#include "ops/block_casts.h"
#include "ops/casts.h"
#include "ops/gemms.h"
#include "ops/norms.h"
#include "ops/scaling.h"

// clang-format off: one family a line
#define FP8JAX_OPS(X)       \
  FP8JAX_CAST_OPS(X)        \
  FP8JAX_ACTIVATION_OPS(X)  \
  FP8JAX_SCALING_OPS(X)     \
  FP8JAX_NORM_OPS(X)        \
  FP8JAX_BLOCK_CAST_OPS(X)  \
  FP8JAX_GEMM_OPS(X)
// clang-format on
