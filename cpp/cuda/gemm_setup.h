// The host-only part of the cuBLASLt FP8 GEMM (cpp/cuda/gemm_setup.cc, used by the handlers in
// gemm_cublaslt.cc): the argument checks, every descriptor, layout and preference set before
// cublasLtMatmul, and the key its algorithm is cached under. None of it needs a GPU; the
// test-only extension (cpp/testing/module_cuda_testing.cc) reads the descriptors back for
// tests/ops/test_gemm_setup.py.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// cuBLASLt's default alignment preference, and the cap of the alignments the handler reports.
inline constexpr uintptr_t kMaxAlignment = 256;

// What the GEMM does after the scaled product `p = (a @ b^T) * a_scale_inv * b_scale_inv`
// (the `epilogue` FFI attribute; fp8jax/ops/gemms/gemm.py and fp8jax/ops/gemms/gemm_epilogue.py).
enum class GemmEpilogue : int32_t {
  // out = p (+ bias[N]), rounded once to out's wide dtype: cuBLASLt's DEFAULT or BIAS.
  kPlain = 0,
  // An MLP's first GEMM: h = p (+ bias), stored as float16 in `aux` (the backward's GELU input);
  // out = FP8(d_scale * gelu(h)), gelu the tanh approximation in float32; amax = max |gelu(h)|.
  // cuBLASLt's GELU_AUX or GELU_AUX_BIAS with an FP8 D.
  kGeluFp8 = 1,
  // That MLP's dgrad of its second GEMM: dh = p * gelu'(aux); out = FP8(d_scale * dh);
  // amax = max |dh|; with has_bias, bias (an output) = the sum of dh over M, in the 16-bit
  // epilogue dtype. cuBLASLt's DGELU or DGELU_BGRAD with an FP8 D.
  kDGeluFp8 = 2,
};

// One GEMM as the handler sees it: a[M, K] (FP8), b[N, K] (FP8), out[M, N], optional
// bias[N] (an input for kPlain and kGeluFp8, the bias gradient output for kDGeluFp8);
// the dtypes are XLA's.
struct GemmProblem {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  xla::ffi::DataType a_type = xla::ffi::DataType::INVALID;
  xla::ffi::DataType b_type = xla::ffi::DataType::INVALID;
  xla::ffi::DataType out_type = xla::ffi::DataType::INVALID;
  // kPlain: the bias's dtype (INVALID without one). The FP8-output epilogues: their 16-bit
  // epilogue dtype (bfloat16 or float16: the bias or bias gradient, cuBLASLt's C type), given
  // even without a bias by the dtype of the empty buffer.
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
  // GemmEpilogue, and what the FP8-output epilogues add: the GELU input `aux` [M, N]
  // (float16), d_scale (float32, one value) and amax (float32, one value).
  int64_t epilogue = 0;
  xla::ffi::DataType aux_type = xla::ffi::DataType::INVALID;
  int64_t aux_count = 0;
  int64_t d_scale_count = 0;
  int64_t amax_count = 0;
};

// The checked problem in cuBLASLt's terms.
struct GemmArgs {
  int64_t m = 0;  // rows of the row-major result (M)
  int64_t n = 0;  // columns of the row-major result (N)
  int64_t k = 0;
  cudaDataType_t a_type{}, b_type{}, d_type{};
  // cuBLASLt's C, which is also the bias (or bias gradient) dtype: d_type for kPlain, the 16-bit
  // epilogue dtype for an FP8 D.
  cudaDataType_t c_type{};
  bool has_bias = false;
  bool fast_accum = false;
  int32_t a_scale_mode = 0;  // blockscale::Mode of our a (cuBLASLt's B) and our b (its A)
  int32_t b_scale_mode = 0;
  GemmEpilogue epilogue = GemmEpilogue::kPlain;
};

// Device addresses the descriptors point at (placeholders in the host test),
// their alignments and the usable workspace size.
struct GemmPointers {
  const void* a_scale_inv = nullptr;
  const void* b_scale_inv = nullptr;
  const void* bias = nullptr;  // the bias, or (kDGeluFp8) the bias gradient it writes
  const void* d_scale = nullptr;
  const void* amax = nullptr;  // written by the FP8-output epilogues
  const void* aux = nullptr;   // written by kGeluFp8, read by kDGeluFp8
  uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0;
  uint64_t workspace_bytes = 0;
};

// Descriptors in caller-owned memory (cuBLASLt's public opaque structs,
// initialised by cublasLt*Init): building them allocates nothing and they
// need no destroy, so the execute stage can build them inside a graph capture.
struct GemmSetup {
  cublasLtMatmulDescOpaque_t desc;
  cublasLtMatrixLayoutOpaque_t la, lb, lc, ld;
  cublasLtMatmulPreferenceOpaque_t pref;
};

// Everything an algorithm choice depends on: the device, the problem (shape, dtypes, epilogue,
// accumulation, scale modes; the layouts follow from the shape), the pointer alignments and the
// workspace size, and whether the choice was autotuned (an untuned choice cached by a program
// with autotuning off must not stand in for a tuned one).
struct AlgoKey {
  int device = 0;
  int64_t m = 0, n = 0, k = 0;  // cuBLASLt's m = N, n = M
  int a_type = 0, b_type = 0, c_type = 0, d_type = 0;
  int epilogue = 0;
  bool bias = false;
  bool fast_accum = false;
  uint32_t align_a = 0, align_b = 0, align_d = 0, align_bias = 0;
  uint64_t workspace = 0;
  int32_t a_scale_mode = 0, b_scale_mode = 0;  // cuBLASLt's A and B (our b and a)
  bool autotuned = false;
  auto operator<=>(const AlgoKey&) const = default;
};

// The key of a checked problem with these pointers on `device`.
AlgoKey AlgoKeyOf(int device, const GemmArgs& g, const GemmPointers& ptr, bool autotune);

// The dtype, dimension and flag checks, on a problem description alone.
xla::ffi::Error CheckGemmProblem(const GemmProblem& p, GemmArgs* g);

// Why a GPU of compute capability `cc_major`.x with cuBLASLt `cublaslt_version`
// (cublasLtGetVersion()) cannot run scale mode `mode` (blockscale::Mode), or "" when it can:
// VEC128_32F, BLK128x128_32F and OUTER_VEC_32F (row-wise) need sm_90 (Hopper) and cuBLAS 12.9,
// VEC32_UE8M0 (MXFP8) sm_100 or later and cuBLAS 12.8; per-tensor scales run everywhere the FP8
// GEMM does.
std::string ScaleModeUnsupported(int32_t mode, int cc_major, int64_t cublaslt_version);

// Everything before cublasLtMatmul for a checked problem; host-only.
xla::ffi::Error BuildGemmSetup(const GemmArgs& g, const GemmPointers& ptr, GemmSetup* s);

// A failed cuBLAS call as an ffi::Error naming `what` and the status (kUnimplemented for an
// unsupported problem or architecture, InvalidArgument for an invalid value, Internal else).
xla::ffi::Error CublasError(const std::string& what, cublasStatus_t st);

}  // namespace fp8jax
