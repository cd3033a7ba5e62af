// The cuBLASLt FP8 GEMM's host-only setup (gemm_setup.h): argument checks, descriptors, layouts,
// the heuristic preference and the algorithm cache key. No CUDA call; the handlers
// (gemm_cublaslt.cc) and the test-only extension both use it.
//
// Layout contract (row-major, "NT", both operands K-major as Hopper's FP8 tensor cores want):
// a[M, K], b[N, K], out[M, N] = epilogue((a @ b^T) * a_scale_inv * b_scale_inv).
//
// cuBLASLt is column-major. Read column-major, the row-major buffers are a: K x M (ld K),
// b: K x N (ld K), out: N x M (ld N). So the handler asks for the column-major product
// out = b^T * a, which is cuBLASLt's required FP8 "TN" form: cuBLASLt's A is our b (transposed,
// m = N), its B is our a (not transposed, n = M), k = K. Hence A_SCALE_POINTER = b_scale_inv and
// B_SCALE_POINTER = a_scale_inv; the bias (length m = N) runs along the rows of the column-major
// result, i.e. along the columns of the row-major one, and so does the bias gradient (a sum over
// the column-major result's columns: over M). The GELU input `aux` is laid out like out
// (N x M, ld N).
#include "cuda/gemm_setup.h"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/block_scale_layout.h"
#include "common/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr char kOp[] = "gemm";

// cuBLASLt's FP8 kernels need 16-byte aligned pointers and leading dimensions;
// with 1-byte operands and ld = K that means K % 16 == 0, and we ask the same
// of N (ld of the output, and the bias length) so that every output dtype
// qualifies (and the GELU input's ld, which cuBLASLt wants a multiple of 8).
// The Python wrapper pads K and N to these multiples.
constexpr int64_t kDimMultiple = 16;

std::string StatusText(cublasStatus_t st) {
  const char* name = cublasLtGetStatusName(st);
  const char* text = cublasLtGetStatusString(st);
  std::string s = name != nullptr ? name : "CUBLAS_STATUS_" + std::to_string(static_cast<int>(st));
  if (text != nullptr) s += std::string(" (") + text + ")";
  return s;
}

bool CudaTypeOfFp8(ffi::DataType t, cudaDataType_t* out) {
  switch (Fp8KindOf(t)) {
    case Fp8Kind::kE4M3:
      *out = CUDA_R_8F_E4M3;
      return true;
    case Fp8Kind::kE5M2:
      *out = CUDA_R_8F_E5M2;
      return true;
    default:
      return false;
  }
}

bool CudaTypeOfWide(ffi::DataType t, cudaDataType_t* out) {
  switch (WideKindOf(t)) {
    case WideKind::kF32:
      *out = CUDA_R_32F;
      return true;
    case WideKind::kBF16:
      *out = CUDA_R_16BF;
      return true;
    case WideKind::kF16:
      *out = CUDA_R_16F;
      return true;
    default:
      return false;
  }
}

template <typename T>
cublasStatus_t SetDesc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  return cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v));
}

template <typename T>
cublasStatus_t SetPref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                       const T& v) {
  return cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v));
}

// The scale modes of a checked problem (cuBLAS documentation, "Narrow precision data types
// usage"): both per-tensor, both MXFP8 (VEC32_UE8M0), both row-wise (OUTER_VEC_32F), or 1 x 128
// and 128 x 128 blocks with at most one 128 x 128 operand; block and row-wise modes need split
// accumulation, 1 x 128 and 128 x 128 blocks M, N multiples of 4; each scale buffer holds what
// cuBLASLt reads (blockscale::ScaleCount, padding included).
ffi::Error CheckScaleModes(const GemmProblem& p, GemmArgs* g) {
  using blockscale::Mode;
  const auto known = [](int64_t m) {
    return m == Mode::kScalar || m == Mode::kVec32Ue8m0 || m == Mode::kOuterVec ||
           m == Mode::kVec128 || m == Mode::kBlk128x128;
  };
  if (!known(p.a_scale_mode) || !known(p.b_scale_mode)) {
    return BadArg(kOp,
                  "a_scale_mode and b_scale_mode must be 0 (per tensor), 2 (VEC32_UE8M0), "
                  "3 (OUTER_VEC_32F), 4 (VEC128_32F) or 5 (BLK128x128_32F)");
  }
  const auto a = static_cast<int32_t>(p.a_scale_mode);
  const auto b = static_cast<int32_t>(p.b_scale_mode);
  const bool sm90_blocks = (a == Mode::kVec128 || a == Mode::kBlk128x128) &&
                           (b == Mode::kVec128 || b == Mode::kBlk128x128);
  const bool same =
      a == b && (a == Mode::kScalar || a == Mode::kVec32Ue8m0 || a == Mode::kOuterVec);
  if (!same && !sm90_blocks) {
    return BadArg(kOp,
                  "a_scale_mode and b_scale_mode: both per tensor (0), both VEC32_UE8M0 "
                  "(2), both OUTER_VEC_32F (3), or each VEC128_32F (4) or BLK128x128_32F (5)");
  }
  if (a == Mode::kBlk128x128 && b == Mode::kBlk128x128) {
    return BadArg(kOp, "at most one operand may have 128 x 128 block scales (BLK128x128_32F)");
  }
  if (a != Mode::kScalar && g->fast_accum) {
    return BadArg(kOp, "block- and row-scaled GEMMs need split accumulation (fast_accum = 0)");
  }
  if (sm90_blocks && (g->m % 4 != 0 || g->n % 4 != 0)) {
    return BadArg(kOp, "1 x 128 and 128 x 128 block scales need M and N multiples of 4");
  }
  const auto scale_type = [](int32_t mode) {
    return mode == Mode::kVec32Ue8m0 ? ffi::DataType::F8E8M0FNU : ffi::DataType::F32;
  };
  if (p.a_scale_type != scale_type(a) || p.b_scale_type != scale_type(b)) {
    return BadArg(kOp, "a_scale_inv and b_scale_inv must be float32 (E8M0 for VEC32_UE8M0)");
  }
  if (p.a_scale_count != blockscale::ScaleCount(a, g->m, g->k) ||
      p.b_scale_count != blockscale::ScaleCount(b, g->n, g->k)) {
    return BadArg(kOp,
                  "a_scale_inv and b_scale_inv must hold the scales their modes lay out "
                  "(blockscale::ScaleCount: 1 per tensor, M and N row-wise, padding included "
                  "for blocks)");
  }
  g->a_scale_mode = a;
  g->b_scale_mode = b;
  return ffi::Error::Success();
}

// The output, bias and epilogue buffers of kPlain.
ffi::Error CheckPlainOutput(const GemmProblem& p, GemmArgs* g) {
  if (!CudaTypeOfWide(p.out_type, &g->d_type)) {
    return BadArg(kOp, "output must be float32, bfloat16 or float16");
  }
  g->c_type = g->d_type;
  if (g->has_bias) {
    // cuBLASLt's FP8 bias epilogue takes a bias of the output type for 16-bit
    // outputs, but only a bf16 bias for a float32 output; the Python wrapper
    // adds a float32 bias itself, outside the kernel.
    if (g->d_type == CUDA_R_32F) {
      return BadArg(kOp, "a fused bias needs a bfloat16 or float16 output");
    }
    if (p.bias_type != p.out_type || p.bias_count != g->n) {
      return BadArg(kOp, "bias must have N elements of the output dtype");
    }
  }
  return ffi::Error::Success();
}

// The output, bias and epilogue buffers of the FP8-output epilogues (kGeluFp8, kDGeluFp8), as
// cuBLASLt documents them: an FP8 D (E5M2 only with an E5M2 operand), C and the bias (gradient)
// of one 16-bit dtype, the GELU input float16 (the one wide aux dtype cuBLASLt takes beside an
// FP8 D), per-tensor scales, a scale for D and an amax.
ffi::Error CheckFp8Output(const GemmProblem& p, GemmArgs* g) {
  if (!CudaTypeOfFp8(p.out_type, &g->d_type)) {
    return BadArg(kOp, "the GELU epilogues write float8_e4m3fn or float8_e5m2");
  }
  if (g->d_type == CUDA_R_8F_E5M2 && g->a_type == CUDA_R_8F_E4M3 && g->b_type == CUDA_R_8F_E4M3) {
    return BadArg(kOp, "an E4M3 x E4M3 GEMM cannot write E5M2 (cuBLASLt)");
  }
  if (p.bias_type != ffi::DataType::BF16 && p.bias_type != ffi::DataType::F16) {
    return BadArg(kOp, "the GELU epilogues' bias (or bias gradient) must be bfloat16 or float16");
  }
  CudaTypeOfWide(p.bias_type, &g->c_type);
  if (p.bias_count != (g->has_bias ? g->n : 0)) {
    return BadArg(kOp, "bias must have N elements (none without has_bias)");
  }
  if (p.aux_type != ffi::DataType::F16 || p.aux_count != g->m * g->n) {
    return BadArg(kOp, "the GELU input must be float16 [M, N]");
  }
  if (p.d_scale_count != 1 || p.amax_count != 1) {
    return BadArg(kOp, "the GELU epilogues take one float32 scale and write one float32 amax");
  }
  if (p.a_scale_mode != 0 || p.b_scale_mode != 0) {
    return BadArg(kOp, "the GELU epilogues take per-tensor scales (a_scale_mode = 0)");
  }
  return ffi::Error::Success();
}

}  // namespace

ffi::Error CublasError(const std::string& what, cublasStatus_t st) {
  const std::string msg = std::string("fp8jax ") + kOp + ": " + what + " failed: " + StatusText(st);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_ARCH_MISMATCH) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, msg);
  }
  if (st == CUBLAS_STATUS_INVALID_VALUE) return ffi::Error::InvalidArgument(msg);
  return ffi::Error::Internal(msg);
}

std::string ScaleModeUnsupported(int32_t mode, int cc_major, int64_t cublaslt_version) {
  using blockscale::Mode;
  if (mode == Mode::kVec128 || mode == Mode::kBlk128x128) {
    if (cc_major != 9) return "1 x 128 and 128 x 128 block scales need an sm_90 (Hopper) GPU";
    if (cublaslt_version < 120900) return "1 x 128 and 128 x 128 block scales need cuBLAS 12.9";
  } else if (mode == Mode::kVec32Ue8m0) {
    if (cc_major < 10) return "MXFP8 (VEC32_UE8M0) scales need an sm_100 or later GPU";
    if (cublaslt_version < 120800) return "MXFP8 (VEC32_UE8M0) scales need cuBLAS 12.8";
  } else if (mode == Mode::kOuterVec) {
    // Documented for Hopper since cuBLAS 12.9; other GPUs are left out until one is verified.
    if (cc_major != 9) return "row-wise (OUTER_VEC_32F) scales need an sm_90 (Hopper) GPU";
    if (cublaslt_version < 120900) return "row-wise (OUTER_VEC_32F) scales need cuBLAS 12.9";
  }
  return "";
}

// The dtype, dimension and flag checks, on a problem description alone (the
// host tests call this through DescribeGemmSetup).
ffi::Error CheckGemmProblem(const GemmProblem& p, GemmArgs* g) {
  g->m = p.m;
  g->n = p.n;
  g->k = p.k;
  if (p.epilogue < 0 || p.epilogue > static_cast<int64_t>(GemmEpilogue::kDGeluFp8)) {
    return BadArg(kOp, "epilogue must be 0 (plain), 1 (GELU, FP8 out) or 2 (DGELU, FP8 out)");
  }
  g->epilogue = static_cast<GemmEpilogue>(p.epilogue);
  if (!CudaTypeOfFp8(p.a_type, &g->a_type) || !CudaTypeOfFp8(p.b_type, &g->b_type)) {
    return BadArg(kOp, "a and b must be float8_e4m3fn or float8_e5m2");
  }
  if (g->a_type == CUDA_R_8F_E5M2 && g->b_type == CUDA_R_8F_E5M2) {
    return BadArg(kOp, "E5M2 x E5M2 is not supported by cuBLASLt; one operand must be E4M3");
  }
  if ((p.has_bias != 0 && p.has_bias != 1) || (p.fast_accum != 0 && p.fast_accum != 1)) {
    return BadArg(kOp, "has_bias and fast_accum must be 0 or 1");
  }
  g->has_bias = p.has_bias == 1;
  g->fast_accum = p.fast_accum == 1;
  FP8JAX_RETURN_IF_ERROR(g->epilogue == GemmEpilogue::kPlain ? CheckPlainOutput(p, g)
                                                             : CheckFp8Output(p, g));
  if (g->m < 0 || g->n < 0 || g->k < 0) return BadArg(kOp, "negative dimension");
  if (g->m > 0 && g->n > 0) {
    if (g->k == 0) return BadArg(kOp, "K must be > 0 (the Python wrapper handles K == 0)");
    if (g->k % kDimMultiple != 0 || g->n % kDimMultiple != 0) {
      return BadArg(kOp, "K and N must be multiples of 16 (the Python wrapper pads them)");
    }
  }
  return CheckScaleModes(p, g);
}

namespace {

// cuBLASLt's epilogue for a checked problem (documented as uint32_t).
uint32_t EpilogueOf(const GemmArgs& g) {
  switch (g.epilogue) {
    case GemmEpilogue::kGeluFp8:
      return g.has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
    case GemmEpilogue::kDGeluFp8:
      return g.has_bias ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
    default:
      return g.has_bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// The epilogue's attributes: the bias (or bias gradient) and, for an FP8 D, its scale, its amax
// and the GELU input (pointer, ld N, float16).
cublasStatus_t SetEpilogue(const GemmArgs& g, const GemmPointers& ptr, cublasLtMatmulDesc_t desc) {
  cublasStatus_t st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, EpilogueOf(g));
  if (g.has_bias) {
    const int32_t bias_type = static_cast<int32_t>(g.c_type);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, ptr.bias);
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
    }
  }
  if (g.epilogue == GemmEpilogue::kPlain || st != CUBLAS_STATUS_SUCCESS) return st;
  const int64_t aux_ld = g.n;
  const int32_t aux_type = CUDA_R_16F;
  st = SetDesc(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, ptr.d_scale);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, ptr.amax);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, ptr.aux);
  }
  if (st == CUBLAS_STATUS_SUCCESS) st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, aux_ld);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, aux_type);
  }
  return st;
}

}  // namespace

// Everything before cublasLtMatmul; host-only, no GPU needed.
// cuBLASLt operands (see the header comment): A = b (K x N, transposed),
// B = a (K x M), C = D = out (N x M, ld N); for an FP8 D, C is a 16-bit layout that is never
// read (beta = 0, no C pointer), as cuBLASLt wants C of the bias's dtype there.
ffi::Error BuildGemmSetup(const GemmArgs& g, const GemmPointers& ptr, GemmSetup* s) {
  cublasLtMatmulDesc_t desc = &s->desc;
  if (auto st = cublasLtMatmulDescInit(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      st != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasLtMatmulDescInit", st);
  }
  const int32_t trans_a = CUBLAS_OP_T;
  const int32_t trans_b = CUBLAS_OP_N;
  // Fast accumulation (forward) keeps Hopper's reduced-precision FP8
  // accumulator; 0 selects split accumulation, promoted to FP32 (dgrad, wgrad).
  const int8_t fast = g.fast_accum ? 1 : 0;
  const void* a_scale_ptr = ptr.b_scale_inv;  // cuBLASLt's A is our b
  const void* b_scale_ptr = ptr.a_scale_inv;
  cublasStatus_t st = SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
  if (st == CUBLAS_STATUS_SUCCESS) st = SetDesc(desc, CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
  if (st == CUBLAS_STATUS_SUCCESS) st = SetDesc(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale_ptr);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale_ptr);
  }
  if (g.a_scale_mode != blockscale::kScalar && st == CUBLAS_STATUS_SUCCESS) {
    // Block or row scales: cuBLASLt's A is our b, its B our a (int32_t, as documented); so the
    // row-wise A vector (cuBLASLt's M) is our b's N scales, its B vector our a's M scales.
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, g.b_scale_mode);
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, g.a_scale_mode);
    }
  }
  if (st == CUBLAS_STATUS_SUCCESS) st = SetEpilogue(g, ptr, desc);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulDescSetAttribute", st);

  const auto k = static_cast<uint64_t>(g.k);
  const auto m = static_cast<uint64_t>(g.m);
  const auto n = static_cast<uint64_t>(g.n);
  st = cublasLtMatrixLayoutInit(&s->la, g.b_type, k, n, g.k);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&s->lb, g.a_type, k, m, g.k);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&s->lc, g.c_type, n, m, g.n);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&s->ld, g.d_type, n, m, g.n);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatrixLayoutInit", st);

  cublasLtMatmulPreference_t pref = &s->pref;
  if (st = cublasLtMatmulPreferenceInit(pref); st != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasLtMatmulPreferenceInit", st);
  }
  st = SetPref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ptr.workspace_bytes);
  // cuBLASLt's A is our b, its B our a; C and D are the output (an FP8 D has no C pointer: the
  // largest alignment).
  const uint32_t align_c = g.epilogue == GemmEpilogue::kPlain ? ptr.align_d : kMaxAlignment;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ptr.align_b);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ptr.align_a);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ptr.align_d);
  }
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulPreferenceSetAttribute", st);
  return ffi::Error::Success();
}

AlgoKey AlgoKeyOf(int device, const GemmArgs& g, const GemmPointers& ptr, bool autotune) {
  AlgoKey key;
  key.device = device;
  key.m = g.n;  // cuBLASLt's m, n: our N, M
  key.n = g.m;
  key.k = g.k;
  key.a_type = static_cast<int>(g.b_type);  // cuBLASLt's A is our b
  key.b_type = static_cast<int>(g.a_type);
  key.c_type = static_cast<int>(g.c_type);
  key.d_type = static_cast<int>(g.d_type);
  key.epilogue = static_cast<int>(g.epilogue);
  key.bias = g.has_bias;
  key.fast_accum = g.fast_accum;
  key.align_a = ptr.align_b;
  key.align_b = ptr.align_a;
  key.align_d = ptr.align_d;
  key.align_bias = ptr.align_bias;
  key.workspace = ptr.workspace_bytes;
  key.a_scale_mode = g.b_scale_mode;
  key.b_scale_mode = g.a_scale_mode;
  key.autotuned = autotune;
  return key;
}

}  // namespace fp8jax
