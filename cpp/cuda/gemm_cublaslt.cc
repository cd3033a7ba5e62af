// CUDA FFI handler fp8jax_gemm: FP8 x FP8 -> bf16/f16/f32 GEMM with cuBLASLt.
//
// Layout contract (row-major, "NT", both operands K-major as Hopper's FP8
// tensor cores want): a[M, K], b[N, K], out[M, N] =
//   (a @ b^T) * a_scale_inv * b_scale_inv (+ bias[N]), rounded once to out's type.
//
// cuBLASLt is column-major. Read column-major, the row-major buffers are
// a: K x M (ld K), b: K x N (ld K), out: N x M (ld N). So the handler asks for
// the column-major product out = b^T * a, which is cuBLASLt's required FP8
// "TN" form: cuBLASLt's A is our b (transposed, m = N), its B is our a
// (not transposed, n = M), k = K. Hence A_SCALE_POINTER = b_scale_inv and
// B_SCALE_POINTER = a_scale_inv; the bias (length m = N) runs along the rows of
// the column-major result, i.e. along the columns of the row-major one.
//
// Runtime behaviour, in XLA FFI's execution stages:
// - initialize (runs before each execution, outside any CUDA-graph capture,
//   with the real buffers and stream): takes the stream's device, creates its
//   cuBLASLt handle on first use (kept for the life of the process), builds
//   the descriptors and runs the heuristic query once per problem (shape,
//   dtypes, epilogue, accumulation mode, pointer alignments, device, workspace
//   size), caching the algorithm;
// - execute (what XLA captures into a CUDA graph, so the handler declares
//   kCmdBufferCompatible): builds the descriptors in stack memory with
//   cuBLASLt's *Init functions (no allocation), finds the handle and the
//   algorithm in the caches, and calls cublasLtMatmul. If a runtime never ran
//   the initialize stage, execute falls back to doing that work itself.
// The scales are read on the device (scale pointers), alpha and beta are host
// constants, and the workspace is an XLA-allocated output, so a call
// allocates no device memory and never synchronises the host. Every failure
// becomes an ffi::Error that names the cuBLAS status.
//
// Everything before cublasLtMatmul (checks, descriptors, layouts, preference)
// is host-only (gemm_setup.h); the test-only extension reads it back
// (cpp/testing/module_cuda_testing.cc). The handle and the heuristic query need a GPU.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/block_scale_layout.h"
#include "common/ffi_checks.h"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_util.h"
#include "cuda/gemm_setup.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr char kOp[] = "gemm";

// cuBLASLt's FP8 kernels need 16-byte aligned pointers and leading dimensions;
// with 1-byte operands and ld = K that means K % 16 == 0, and we ask the same
// of N (ld of the output, and the bias length) so that every output dtype
// qualifies. The Python wrapper pads K and N to these multiples.
constexpr int64_t kDimMultiple = 16;
constexpr uintptr_t kMinAlignment = 16;

// ------------------------------------------------------------ small helpers

std::string StatusText(cublasStatus_t st) {
  const char* name = cublasLtGetStatusName(st);
  const char* text = cublasLtGetStatusString(st);
  std::string s = name != nullptr ? name : "CUBLAS_STATUS_" + std::to_string(static_cast<int>(st));
  if (text != nullptr) s += std::string(" (") + text + ")";
  return s;
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

namespace {

// Largest power of two (capped at 256) dividing the address; 256 for null.
uint32_t AlignmentOf(const void* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if (addr == 0) return static_cast<uint32_t>(kMaxAlignment);
  const uintptr_t low = addr & (~addr + 1);
  return static_cast<uint32_t>(low < kMaxAlignment ? low : kMaxAlignment);
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

// --------------------------------------------------------------- caches

// One handle per CUDA device. Handles are never destroyed: XLA may run this
// handler until process exit, and destroying a handle after the CUDA context
// is torn down is worse than leaking a few host bytes.
ffi::Error HandleFor(int device, cublasLtHandle_t* out) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t>* handles = new std::map<int, cublasLtHandle_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles->find(device);
  if (it != handles->end()) {
    *out = it->second;
    return ffi::Error::Success();
  }
  cublasLtHandle_t h = nullptr;
  if (cublasStatus_t st = cublasLtCreate(&h); st != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasLtCreate", st);
  }
  handles->emplace(device, h);
  *out = h;
  return ffi::Error::Success();
}

// Everything the heuristic's choice depends on.
struct AlgoKey {
  int device;
  int64_t m, n, k;  // cuBLASLt's m = N, n = M
  int a_type, b_type, d_type;
  bool bias;
  bool fast_accum;
  uint32_t align_a, align_b, align_d, align_bias;
  uint64_t workspace;
  int32_t a_scale_mode, b_scale_mode;  // cuBLASLt's A and B (our b and a)
  auto operator<=>(const AlgoKey&) const = default;
};

std::mutex algo_mu;
std::map<AlgoKey, cublasLtMatmulAlgo_t>& AlgoCache() {
  static auto* cache = new std::map<AlgoKey, cublasLtMatmulAlgo_t>();
  return *cache;
}

// ------------------------------------------------------------------ GEMM

}  // namespace

namespace {

// The scale modes of a checked problem (cuBLAS documentation, "Narrow precision data types
// usage"): both per-tensor, both MXFP8 (VEC32_UE8M0), or 1 x 128 and 128 x 128 blocks with at
// most one 128 x 128 operand; block modes need split accumulation and M, N multiples of 4; each
// scale buffer holds what cuBLASLt reads (blockscale::ScaleCount, padding included).
ffi::Error CheckScaleModes(const GemmProblem& p, GemmArgs* g) {
  using blockscale::Mode;
  const auto known = [](int64_t m) {
    return m == Mode::kScalar || m == Mode::kVec32Ue8m0 || m == Mode::kVec128 ||
           m == Mode::kBlk128x128;
  };
  if (!known(p.a_scale_mode) || !known(p.b_scale_mode)) {
    return BadArg(kOp,
                  "a_scale_mode and b_scale_mode must be 0 (per tensor), 2 (VEC32_UE8M0), "
                  "4 (VEC128_32F) or 5 (BLK128x128_32F)");
  }
  const auto a = static_cast<int32_t>(p.a_scale_mode);
  const auto b = static_cast<int32_t>(p.b_scale_mode);
  const bool sm90_blocks = (a == Mode::kVec128 || a == Mode::kBlk128x128) &&
                           (b == Mode::kVec128 || b == Mode::kBlk128x128);
  const bool pair_ok = (a == Mode::kScalar && b == Mode::kScalar) ||
                       (a == Mode::kVec32Ue8m0 && b == Mode::kVec32Ue8m0) || sm90_blocks;
  if (!pair_ok) {
    return BadArg(kOp,
                  "a_scale_mode and b_scale_mode: both per tensor (0), both VEC32_UE8M0 "
                  "(2), or each VEC128_32F (4) or BLK128x128_32F (5)");
  }
  if (a == Mode::kBlk128x128 && b == Mode::kBlk128x128) {
    return BadArg(kOp, "at most one operand may have 128 x 128 block scales (BLK128x128_32F)");
  }
  if (a != Mode::kScalar && g->fast_accum) {
    return BadArg(kOp, "block-scaled GEMMs need split accumulation (fast_accum = 0)");
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
                  "(blockscale::ScaleCount: 1 per tensor, padding included for blocks)");
  }
  g->a_scale_mode = a;
  g->b_scale_mode = b;
  return ffi::Error::Success();
}

}  // namespace

std::string ScaleModeUnsupported(int32_t mode, int cc_major, int64_t cublaslt_version) {
  using blockscale::Mode;
  if (mode == Mode::kVec128 || mode == Mode::kBlk128x128) {
    if (cc_major != 9) return "1 x 128 and 128 x 128 block scales need an sm_90 (Hopper) GPU";
    if (cublaslt_version < 120900) return "1 x 128 and 128 x 128 block scales need cuBLAS 12.9";
  } else if (mode == Mode::kVec32Ue8m0) {
    if (cc_major < 10) return "MXFP8 (VEC32_UE8M0) scales need an sm_100 or later GPU";
    if (cublaslt_version < 120800) return "MXFP8 (VEC32_UE8M0) scales need cuBLAS 12.8";
  }
  return "";
}

// The dtype, dimension and flag checks, on a problem description alone (the
// host tests call this through DescribeGemmSetup).
ffi::Error CheckGemmProblem(const GemmProblem& p, GemmArgs* g) {
  g->m = p.m;
  g->n = p.n;
  g->k = p.k;
  if (!CudaTypeOfFp8(p.a_type, &g->a_type) || !CudaTypeOfFp8(p.b_type, &g->b_type)) {
    return BadArg(kOp, "a and b must be float8_e4m3fn or float8_e5m2");
  }
  if (g->a_type == CUDA_R_8F_E5M2 && g->b_type == CUDA_R_8F_E5M2) {
    return BadArg(kOp, "E5M2 x E5M2 is not supported by cuBLASLt; one operand must be E4M3");
  }
  if (!CudaTypeOfWide(p.out_type, &g->d_type)) {
    return BadArg(kOp, "output must be float32, bfloat16 or float16");
  }
  if ((p.has_bias != 0 && p.has_bias != 1) || (p.fast_accum != 0 && p.fast_accum != 1)) {
    return BadArg(kOp, "has_bias and fast_accum must be 0 or 1");
  }
  g->has_bias = p.has_bias == 1;
  g->fast_accum = p.fast_accum == 1;
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

ffi::Error CheckGemmArgs(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                         const ffi::AnyBuffer& a_scale_inv, const ffi::AnyBuffer& b_scale_inv,
                         const ffi::AnyBuffer& bias, int64_t has_bias, int64_t fast_accum,
                         int64_t a_scale_mode, int64_t b_scale_mode, const ffi::AnyBuffer& out,
                         GemmArgs* g) {
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || out.dimensions().size() != 2) {
    return BadArg(kOp, "a, b and the output must be 2-D");
  }
  GemmProblem p;
  p.m = a.dimensions()[0];
  p.k = a.dimensions()[1];
  p.n = b.dimensions()[0];
  if (b.dimensions()[1] != p.k) return BadArg(kOp, "a and b must have the same K (last dim)");
  if (out.dimensions()[0] != p.m || out.dimensions()[1] != p.n) {
    return BadArg(kOp, "output must have shape [M, N]");
  }
  p.a_scale_mode = a_scale_mode;
  p.b_scale_mode = b_scale_mode;
  p.a_scale_count = static_cast<int64_t>(a_scale_inv.element_count());
  p.b_scale_count = static_cast<int64_t>(b_scale_inv.element_count());
  p.a_scale_type = a_scale_inv.element_type();
  p.b_scale_type = b_scale_inv.element_type();
  p.a_type = a.element_type();
  p.b_type = b.element_type();
  p.out_type = out.element_type();
  p.bias_type = bias.element_type();
  p.bias_count = static_cast<int64_t>(bias.element_count());
  p.has_bias = has_bias;
  p.fast_accum = fast_accum;
  return CheckGemmProblem(p, g);
}

}  // namespace

// Everything before cublasLtMatmul; host-only, no GPU needed.
// cuBLASLt operands (see the header comment): A = b (K x N, transposed),
// B = a (K x M), C = D = out (N x M, ld N).
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
    // Block scales: cuBLASLt's A is our b, its B our a (int32_t, as documented).
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, g.b_scale_mode);
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, g.a_scale_mode);
    }
  }
  if (g.has_bias && st == CUBLAS_STATUS_SUCCESS) {
    const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;  // documented as uint32_t
    const int32_t bias_type = static_cast<int32_t>(g.d_type);
    st = SetDesc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    if (st == CUBLAS_STATUS_SUCCESS)
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, ptr.bias);
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetDesc(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
    }
  }
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulDescSetAttribute", st);

  const auto k = static_cast<uint64_t>(g.k);
  const auto m = static_cast<uint64_t>(g.m);
  const auto n = static_cast<uint64_t>(g.n);
  st = cublasLtMatrixLayoutInit(&s->la, g.b_type, k, n, g.k);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&s->lb, g.a_type, k, m, g.k);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutInit(&s->ld, g.d_type, n, m, g.n);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatrixLayoutInit", st);

  cublasLtMatmulPreference_t pref = &s->pref;
  if (st = cublasLtMatmulPreferenceInit(pref); st != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasLtMatmulPreferenceInit", st);
  }
  st = SetPref(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ptr.workspace_bytes);
  // cuBLASLt's A is our b, its B our a; C and D are the output.
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, ptr.align_b);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ptr.align_a);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ptr.align_d);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetPref(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ptr.align_d);
  }
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulPreferenceSetAttribute", st);
  return ffi::Error::Success();
}

namespace {

// The heuristic's algorithm for `key`: from the cache, else (needs a GPU)
// asked of cuBLASLt and cached.
ffi::Error AlgoFor(const AlgoKey& key, cublasLtHandle_t handle, GemmSetup& s,
                   cublasLtMatmulAlgo_t* algo) {
  {
    std::lock_guard<std::mutex> lock(algo_mu);
    auto it = AlgoCache().find(key);
    if (it != AlgoCache().end()) {
      *algo = it->second;
      return ffi::Error::Success();
    }
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle, &s.desc, &s.la, &s.lb, &s.ld,
                                                           &s.ld, &s.pref, 1, &result, &found);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulAlgoGetHeuristic", st);
  if (found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "fp8jax gemm: cuBLASLt has no FP8 algorithm for M=" + std::to_string(key.n) +
                          " N=" + std::to_string(key.m) + " K=" + std::to_string(key.k) +
                          " on this device (FP8 GEMM needs compute capability >= 8.9)");
  }
  *algo = result.algo;
  std::lock_guard<std::mutex> lock(algo_mu);
  AlgoCache().emplace(key, *algo);
  return ffi::Error::Success();
}

// Everything a call needs, shared by the initialize and execute stages.
struct PreparedGemm {
  GemmArgs g;
  GemmSetup setup;
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulAlgo_t algo{};
  const void* a_ptr = nullptr;
  const void* b_ptr = nullptr;
  void* d_ptr = nullptr;
  void* ws_ptr = nullptr;
  uint64_t ws_bytes = 0;
  bool empty = false;
};

// The current device's support of block scale modes (ScaleModeUnsupported), as an error.
// cudaDeviceGetAttribute enqueues nothing, so it is allowed during a graph capture.
ffi::Error CheckModesOnDevice(const GemmArgs& g) {
  if (g.a_scale_mode == blockscale::kScalar && g.b_scale_mode == blockscale::kScalar) {
    return ffi::Error::Success();
  }
  int device = 0, major = 0;
  FP8JAX_RETURN_IF_ERROR(CurrentDevice(kOp, &device));
  if (const cudaError_t err =
          cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
      err != cudaSuccess) {
    return CudaError(kOp, "cudaDeviceGetAttribute(ComputeCapabilityMajor)", err);
  }
  const int64_t version = static_cast<int64_t>(cublasLtGetVersion());
  for (const int32_t mode : {g.a_scale_mode, g.b_scale_mode}) {
    if (const std::string why = ScaleModeUnsupported(mode, major, version); !why.empty()) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented, std::string("fp8jax gemm: ") + why);
    }
  }
  return ffi::Error::Success();
}

ffi::Error PrepareGemm(cudaStream_t stream, const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                       const ffi::AnyBuffer& a_scale_inv, const ffi::AnyBuffer& b_scale_inv,
                       const ffi::AnyBuffer& bias, int64_t has_bias, int64_t fast_accum,
                       int64_t a_scale_mode, int64_t b_scale_mode, ffi::AnyBuffer& out,
                       ffi::Buffer<ffi::U8>& workspace, PreparedGemm* pg) {
  GemmArgs& g = pg->g;
  FP8JAX_RETURN_IF_ERROR(CheckGemmArgs(a, b, a_scale_inv, b_scale_inv, bias, has_bias, fast_accum,
                                       a_scale_mode, b_scale_mode, out, &g));
  FP8JAX_RETURN_IF_ERROR(CheckModesOnDevice(g));
  if (g.m == 0 || g.n == 0) {
    pg->empty = true;
    return ffi::Error::Success();
  }
  pg->a_ptr = a.untyped_data();
  pg->b_ptr = b.untyped_data();
  pg->d_ptr = out.untyped_data();
  GemmPointers ptr;
  ptr.a_scale_inv = a_scale_inv.untyped_data();
  ptr.b_scale_inv = b_scale_inv.untyped_data();
  ptr.bias = g.has_bias ? bias.untyped_data() : nullptr;
  ptr.align_a = AlignmentOf(pg->a_ptr);
  ptr.align_b = AlignmentOf(pg->b_ptr);
  ptr.align_d = AlignmentOf(pg->d_ptr);
  ptr.align_bias = AlignmentOf(ptr.bias);
  if (ptr.align_a < kMinAlignment || ptr.align_b < kMinAlignment || ptr.align_d < kMinAlignment ||
      ptr.align_bias < kMinAlignment) {
    return BadArg(kOp, "a, b, bias and the output must be 16-byte aligned");
  }
  // The workspace is used from its first 256-byte aligned address; its usable
  // size is fixed by the buffer size alone so that cached algorithms stay valid.
  const uint64_t ws_total = static_cast<uint64_t>(workspace.element_count());
  if (ws_total < 2 * kMaxAlignment) return BadArg(kOp, "workspace too small");
  const uintptr_t ws_addr = reinterpret_cast<uintptr_t>(workspace.typed_data());
  pg->ws_ptr = reinterpret_cast<void*>((ws_addr + kMaxAlignment - 1) & ~(kMaxAlignment - 1));
  pg->ws_bytes = ws_total - kMaxAlignment;
  ptr.workspace_bytes = pg->ws_bytes;

  FP8JAX_RETURN_IF_ERROR(BuildGemmSetup(g, ptr, &pg->setup));

  // The stream's device (XLA makes it the current one; see CurrentDevice):
  // handles and algorithms are per device.
  int device = 0;
  FP8JAX_RETURN_IF_ERROR(CurrentDevice(kOp, &device));
  FP8JAX_RETURN_IF_ERROR(HandleFor(device, &pg->handle));
  const AlgoKey key{device,
                    g.n,
                    g.m,
                    g.k,
                    static_cast<int>(g.a_type),
                    static_cast<int>(g.b_type),
                    static_cast<int>(g.d_type),
                    g.has_bias,
                    g.fast_accum,
                    ptr.align_b,
                    ptr.align_a,
                    ptr.align_d,
                    ptr.align_bias,
                    pg->ws_bytes,
                    g.b_scale_mode,
                    g.a_scale_mode};
  return AlgoFor(key, pg->handle, pg->setup, &pg->algo);
}

// Initialize stage: outside any graph capture; fills the handle and
// algorithm caches for exactly the buffers execute will get.
ffi::Error GemmInitialize(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                          ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                          ffi::AnyBuffer bias, int64_t has_bias, int64_t fast_accum,
                          int64_t a_scale_mode, int64_t b_scale_mode,
                          ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  PreparedGemm pg;
  return PrepareGemm(stream, a, b, a_scale_inv, b_scale_inv, bias, has_bias, fast_accum,
                     a_scale_mode, b_scale_mode, *out, *workspace, &pg);
}

// Execute stage: after initialize, PrepareGemm only builds stack descriptors
// and reads the caches.
ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                    ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias,
                    int64_t has_bias, int64_t fast_accum, int64_t a_scale_mode,
                    int64_t b_scale_mode, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  PreparedGemm pg;
  FP8JAX_RETURN_IF_ERROR(PrepareGemm(stream, a, b, a_scale_inv, b_scale_inv, bias, has_bias,
                                     fast_accum, a_scale_mode, b_scale_mode, *out, *workspace,
                                     &pg));
  if (pg.empty) return ffi::Error::Success();
  const float alpha = 1.0f;
  const float beta = 0.0f;
  const cublasStatus_t st = cublasLtMatmul(
      pg.handle, &pg.setup.desc, &alpha, pg.b_ptr, &pg.setup.la, pg.a_ptr, &pg.setup.lb, &beta,
      pg.d_ptr, &pg.setup.ld, pg.d_ptr, &pg.setup.ld, &pg.algo, pg.ws_ptr, pg.ws_bytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmul", st);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

// The same binding for both stages.
#define FP8JAX_GEMM_BINDING(BIND)                           \
  ffi::Ffi::BIND()                                          \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()             \
      .Arg<ffi::AnyBuffer>()         /* a [M, K] FP8 */     \
      .Arg<ffi::AnyBuffer>()         /* b [N, K] FP8 */     \
      .Arg<ffi::AnyBuffer>()         /* a_scale_inv */      \
      .Arg<ffi::AnyBuffer>()         /* b_scale_inv */      \
      .Arg<ffi::AnyBuffer>()         /* bias [N] or [0] */  \
      .Attr<int64_t>("has_bias")     /* 0 or 1 */           \
      .Attr<int64_t>("fast_accum")   /* 0 or 1 */           \
      .Attr<int64_t>("a_scale_mode") /* blockscale::Mode */ \
      .Attr<int64_t>("b_scale_mode") /* blockscale::Mode */ \
      .Ret<ffi::AnyBuffer>()         /* out [M, N] */       \
      .Ret<ffi::Buffer<ffi::U8>>()   /* workspace */

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxGemmInitializeCuda, fp8jax::GemmInitialize,
                              FP8JAX_GEMM_BINDING(BindInitialize));

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxGemmCuda, fp8jax::GemmImpl, FP8JAX_GEMM_BINDING(Bind),
                              {fp8jax::kCudaHandlerTraits});
