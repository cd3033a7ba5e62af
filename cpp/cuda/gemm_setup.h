// The host-only part of the cuBLASLt FP8 GEMM (cpp/cuda/gemm_cublaslt.cc):
// argument checks and every descriptor, layout and preference set before
// cublasLtMatmul. None of it needs a GPU, so module_cuda.cc exposes it to the
// tests (tests/ops/test_gemm_setup.py) as `_gemm_setup`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// One GEMM as the handler sees it: a[M, K] (FP8), b[N, K] (FP8), out[M, N],
// optional bias[N]; the dtypes are XLA's.
struct GemmProblem {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  xla::ffi::DataType a_type = xla::ffi::DataType::INVALID;
  xla::ffi::DataType b_type = xla::ffi::DataType::INVALID;
  xla::ffi::DataType out_type = xla::ffi::DataType::INVALID;
  xla::ffi::DataType bias_type = xla::ffi::DataType::INVALID;
  int64_t bias_count = 0;
  int64_t has_bias = 0;
  int64_t fast_accum = 0;
};

// Checks the problem and builds the cuBLASLt setup for it with placeholder
// device pointers (no GPU involved), then reads every attribute back from the
// descriptors: (name, value) pairs, e.g. ("desc.fast_accum", 1). An invalid or
// unsupported problem returns the same ffi::Error the handler would.
xla::ffi::Error DescribeGemmSetup(const GemmProblem& problem,
                                  std::vector<std::pair<std::string, int64_t>>* out);

// The cuBLASLt constants the description uses (data types, ops, epilogues),
// by name, so tests compare against the header's values.
std::vector<std::pair<std::string, int64_t>> CublasLtConstants();

// Tries cublasLtCreate (and destroys the handle): "CUBLAS_STATUS_SUCCESS" or
// the failure's status name. Tells the tests what needs a device.
std::string ProbeCublasLtCreate();

}  // namespace fp8jax
