// The instantiations of the tensor-core grouped GEMM that fp8jax's layers call, one X entry each:
// X(index, a, b, out, fast, block_n, a's name, b's name, out's name). fast: FP8 fast accumulation
// (the forward under per-group scales); block_n: 0 for per-group scales, else block scales with
// b's block rows (128: the rows form's 128 x 128 weights; 1: the contracting form's segment
// blocks). Each is compiled in a translation unit of its own (sm90/grouped_gemm_instance.cu with
// FP8JAX_SM90_INSTANCE=index, CMakeLists.txt), so a build compiles them in parallel;
// fp8jax/ops/gemms/grouped_gemm.py's SM90_VARIANTS lists the same (a test compares).
#pragma once

#define FP8JAX_SM90_VARIANTS(X)                                                       \
  X(0, E4, E4, Bf16, 1, 0, "e4m3", "e4m3", "bfloat16") /* forward */                  \
  X(1, E4, E4, float, 1, 0, "e4m3", "e4m3", "float32")                                \
  X(2, E5, E4, Bf16, 0, 0, "e5m2", "e4m3", "bfloat16") /* dgrad, HYBRID */            \
  X(3, E5, E4, float, 0, 0, "e5m2", "e4m3", "float32")                                \
  X(4, E4, E4, Bf16, 0, 0, "e4m3", "e4m3", "bfloat16")   /* dgrad, E4M3 */            \
  X(5, E4, E5, float, 0, 0, "e4m3", "e5m2", "float32")   /* wgrad, HYBRID */          \
  X(6, E4, E4, float, 0, 0, "e4m3", "e4m3", "float32")   /* wgrad, E4M3 */            \
  X(7, E4, E4, Bf16, 0, 128, "e4m3", "e4m3", "bfloat16") /* blocks: forward, dgrad */ \
  X(8, E4, E4, float, 0, 128, "e4m3", "e4m3", "float32")                              \
  X(9, E4, E4, float, 0, 1, "e4m3", "e4m3", "float32") /* blocks: wgrad */

// How many entries FP8JAX_SM90_VARIANTS has (CMakeLists.txt compiles that many instances).
#define FP8JAX_SM90_INSTANCES 10
