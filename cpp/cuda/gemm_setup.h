// The host-only part of the cuBLASLt FP8 GEMM (cpp/cuda/gemm_cublaslt.cc): the argument checks
// and every descriptor, layout and preference set before cublasLtMatmul. None of it needs a GPU;
// the handler uses it, and so does the test-only extension (cpp/testing/module_cuda_testing.cc),
// which reads the descriptors back for tests/ops/test_gemm_setup.py.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// cuBLASLt's default alignment preference, and the cap of the alignments the handler reports.
inline constexpr uintptr_t kMaxAlignment = 256;

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
  // How a_scale_inv and b_scale_inv are laid out (blockscale::Mode, common/block_scale_layout.h)
  // and how many values each holds.
  int64_t a_scale_mode = 0;
  int64_t b_scale_mode = 0;
  int64_t a_scale_count = 1;
  int64_t b_scale_count = 1;
  // The scales' dtypes: float32, or E8M0 for VEC32_UE8M0 (MXFP8).
  xla::ffi::DataType a_scale_type = xla::ffi::DataType::F32;
  xla::ffi::DataType b_scale_type = xla::ffi::DataType::F32;
};

// The checked problem in cuBLASLt's terms.
struct GemmArgs {
  int64_t m = 0;  // rows of the row-major result (M)
  int64_t n = 0;  // columns of the row-major result (N)
  int64_t k = 0;
  cudaDataType_t a_type{}, b_type{}, d_type{};
  bool has_bias = false;
  bool fast_accum = false;
  int32_t a_scale_mode = 0;  // blockscale::Mode of our a (cuBLASLt's B) and our b (its A)
  int32_t b_scale_mode = 0;
};

// Device addresses the descriptors point at (placeholders in the host test),
// their alignments and the usable workspace size.
struct GemmPointers {
  const void* a_scale_inv = nullptr;
  const void* b_scale_inv = nullptr;
  const void* bias = nullptr;
  uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0;
  uint64_t workspace_bytes = 0;
};

// Descriptors in caller-owned memory (cuBLASLt's public opaque structs,
// initialised by cublasLt*Init): building them allocates nothing and they
// need no destroy, so the execute stage can build them inside a graph capture.
struct GemmSetup {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatrixLayoutOpaque_t la, lb, ld;
  cublasLtMatmulPreferenceOpaque_t pref;
};

// The dtype, dimension and flag checks, on a problem description alone.
xla::ffi::Error CheckGemmProblem(const GemmProblem& p, GemmArgs* g);

// Why a GPU of compute capability `cc_major`.x with cuBLASLt `cublaslt_version`
// (cublasLtGetVersion()) cannot run scale mode `mode` (blockscale::Mode), or "" when it can:
// VEC128_32F and BLK128x128_32F need sm_90 (Hopper) and cuBLAS 12.9, VEC32_UE8M0 (MXFP8)
// sm_100 or later and cuBLAS 12.8; per-tensor scales run everywhere the FP8 GEMM does.
std::string ScaleModeUnsupported(int32_t mode, int cc_major, int64_t cublaslt_version);

// Everything before cublasLtMatmul for a checked problem; host-only.
xla::ffi::Error BuildGemmSetup(const GemmArgs& g, const GemmPointers& ptr, GemmSetup* s);

// A failed cuBLAS call as an ffi::Error naming `what` and the status (kUnimplemented for an
// unsupported problem or architecture, InvalidArgument for an invalid value, Internal else).
xla::ffi::Error CublasError(const std::string& what, cublasStatus_t st);

}  // namespace fp8jax
