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
// Runtime behaviour: one cuBLASLt handle per CUDA device, created on first use
// and kept for the life of the process; the heuristic's algorithm is cached
// per problem (shape, dtypes, epilogue, accumulation mode, pointer alignments,
// device). The scales are read on the device (scale pointers), alpha and beta
// are host constants, and the workspace is an XLA-allocated output, so a call
// allocates nothing and never synchronises the host. Every failure becomes an
// ffi::Error that names the cuBLAS status.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "common/ffi_checks.h"
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
constexpr uintptr_t kMaxAlignment = 256;  // cuBLASLt's default alignment preference

// ------------------------------------------------------------ small helpers

std::string StatusText(cublasStatus_t st) {
  const char* name = cublasLtGetStatusName(st);
  const char* text = cublasLtGetStatusString(st);
  std::string s = name != nullptr ? name : "CUBLAS_STATUS_" + std::to_string(static_cast<int>(st));
  if (text != nullptr) s += std::string(" (") + text + ")";
  return s;
}

ffi::Error CublasError(const std::string& what, cublasStatus_t st) {
  const std::string msg = std::string("fp8jax ") + kOp + ": " + what + " failed: " + StatusText(st);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_ARCH_MISMATCH) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, msg);
  }
  if (st == CUBLAS_STATUS_INVALID_VALUE) return ffi::Error::InvalidArgument(msg);
  return ffi::Error::Internal(msg);
}

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

// RAII owners of the cuBLASLt descriptors (host objects, cheap to create).
struct DescDeleter {
  void operator()(cublasLtMatmulDescOpaque_t* d) const { cublasLtMatmulDescDestroy(d); }
  void operator()(cublasLtMatrixLayoutOpaque_t* l) const { cublasLtMatrixLayoutDestroy(l); }
  void operator()(cublasLtMatmulPreferenceOpaque_t* p) const { cublasLtMatmulPreferenceDestroy(p); }
};
using MatmulDesc = std::unique_ptr<cublasLtMatmulDescOpaque_t, DescDeleter>;
using Layout = std::unique_ptr<cublasLtMatrixLayoutOpaque_t, DescDeleter>;
using Preference = std::unique_ptr<cublasLtMatmulPreferenceOpaque_t, DescDeleter>;

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
  auto operator<=>(const AlgoKey&) const = default;
};

std::mutex algo_mu;
std::map<AlgoKey, cublasLtMatmulAlgo_t>& AlgoCache() {
  static auto* cache = new std::map<AlgoKey, cublasLtMatmulAlgo_t>();
  return *cache;
}

// ------------------------------------------------------------------ GEMM

struct GemmArgs {
  int64_t m = 0;  // rows of the row-major result (M)
  int64_t n = 0;  // columns of the row-major result (N)
  int64_t k = 0;
  cudaDataType_t a_type{}, b_type{}, d_type{};
};

ffi::Error CheckGemmArgs(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                         const ffi::Buffer<ffi::F32>& a_scale_inv,
                         const ffi::Buffer<ffi::F32>& b_scale_inv, const ffi::AnyBuffer& bias,
                         int64_t has_bias, int64_t fast_accum, const ffi::AnyBuffer& out,
                         GemmArgs* g) {
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || out.dimensions().size() != 2) {
    return BadArg(kOp, "a, b and the output must be 2-D");
  }
  g->m = a.dimensions()[0];
  g->k = a.dimensions()[1];
  g->n = b.dimensions()[0];
  if (b.dimensions()[1] != g->k) return BadArg(kOp, "a and b must have the same K (last dim)");
  if (out.dimensions()[0] != g->m || out.dimensions()[1] != g->n) {
    return BadArg(kOp, "output must have shape [M, N]");
  }
  if (!CudaTypeOfFp8(a.element_type(), &g->a_type) ||
      !CudaTypeOfFp8(b.element_type(), &g->b_type)) {
    return BadArg(kOp, "a and b must be float8_e4m3fn or float8_e5m2");
  }
  if (g->a_type == CUDA_R_8F_E5M2 && g->b_type == CUDA_R_8F_E5M2) {
    return BadArg(kOp, "E5M2 x E5M2 is not supported by cuBLASLt; one operand must be E4M3");
  }
  if (!CudaTypeOfWide(out.element_type(), &g->d_type)) {
    return BadArg(kOp, "output must be float32, bfloat16 or float16");
  }
  if (a_scale_inv.element_count() != 1 || b_scale_inv.element_count() != 1) {
    return BadArg(kOp, "a_scale_inv and b_scale_inv must hold one value each");
  }
  if ((has_bias != 0 && has_bias != 1) || (fast_accum != 0 && fast_accum != 1)) {
    return BadArg(kOp, "has_bias and fast_accum must be 0 or 1");
  }
  if (has_bias == 1) {
    // cuBLASLt's FP8 bias epilogue takes a bias of the output type for 16-bit
    // outputs, but only a bf16 bias for a float32 output; the Python wrapper
    // adds a float32 bias itself, outside the kernel.
    if (g->d_type == CUDA_R_32F) {
      return BadArg(kOp, "a fused bias needs a bfloat16 or float16 output");
    }
    if (bias.element_type() != out.element_type() ||
        static_cast<int64_t>(bias.element_count()) != g->n) {
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
  return ffi::Error::Success();
}

ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                    ffi::Buffer<ffi::F32> a_scale_inv, ffi::Buffer<ffi::F32> b_scale_inv,
                    ffi::AnyBuffer bias, int64_t has_bias, int64_t fast_accum,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::U8>> workspace) {
  GemmArgs g;
  if (auto err =
          CheckGemmArgs(a, b, a_scale_inv, b_scale_inv, bias, has_bias, fast_accum, *out, &g);
      !err.success()) {
    return err;
  }
  if (g.m == 0 || g.n == 0) return ffi::Error::Success();

  const void* a_ptr = a.untyped_data();
  const void* b_ptr = b.untyped_data();
  void* d_ptr = out->untyped_data();
  const void* bias_ptr = has_bias ? bias.untyped_data() : nullptr;
  const uint32_t align_a = AlignmentOf(a_ptr);
  const uint32_t align_b = AlignmentOf(b_ptr);
  const uint32_t align_d = AlignmentOf(d_ptr);
  const uint32_t align_bias = AlignmentOf(bias_ptr);
  if (align_a < kMinAlignment || align_b < kMinAlignment || align_d < kMinAlignment ||
      align_bias < kMinAlignment) {
    return BadArg(kOp, "a, b, bias and the output must be 16-byte aligned");
  }

  // The workspace is used from its first 256-byte aligned address; its usable
  // size is fixed by the buffer size alone so that cached algorithms stay valid.
  const uint64_t ws_total = static_cast<uint64_t>(workspace->element_count());
  if (ws_total < 2 * kMaxAlignment) return BadArg(kOp, "workspace too small");
  const uintptr_t ws_addr = reinterpret_cast<uintptr_t>(workspace->typed_data());
  void* ws_ptr = reinterpret_cast<void*>((ws_addr + kMaxAlignment - 1) & ~(kMaxAlignment - 1));
  const uint64_t ws_bytes = ws_total - kMaxAlignment;

  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    return ffi::Error::Internal(std::string("fp8jax gemm: cudaGetDevice failed: ") +
                                cudaGetErrorString(cudaGetLastError()));
  }
  cublasLtHandle_t handle = nullptr;
  if (auto err = HandleFor(device, &handle); !err.success()) return err;

  // cuBLASLt operands (see the header comment): A = b (K x N, transposed),
  // B = a (K x M), C = D = out (N x M, ld N).
  cublasLtMatmulDesc_t raw_desc = nullptr;
  if (auto st = cublasLtMatmulDescCreate(&raw_desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
      st != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasLtMatmulDescCreate", st);
  }
  MatmulDesc desc(raw_desc);
  const int32_t trans_a = CUBLAS_OP_T;
  const int32_t trans_b = CUBLAS_OP_N;
  const int8_t fast = fast_accum ? 1 : 0;
  const void* a_scale_ptr = b_scale_inv.typed_data();  // cuBLASLt's A is our b
  const void* b_scale_ptr = a_scale_inv.typed_data();
  cublasStatus_t st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, trans_a);
  if (st == CUBLAS_STATUS_SUCCESS) st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, trans_b);
  if (st == CUBLAS_STATUS_SUCCESS) st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale_ptr);
  }
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale_ptr);
  }
  if (has_bias && st == CUBLAS_STATUS_SUCCESS) {
    const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;  // documented as uint32_t
    const int32_t bias_type = static_cast<int32_t>(g.d_type);
    st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetDesc(desc.get(), CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
    }
  }
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulDescSetAttribute", st);

  const auto k = static_cast<uint64_t>(g.k);
  const auto m = static_cast<uint64_t>(g.m);
  const auto n = static_cast<uint64_t>(g.n);
  cublasLtMatrixLayout_t raw_la = nullptr, raw_lb = nullptr, raw_ld = nullptr;
  st = cublasLtMatrixLayoutCreate(&raw_la, g.b_type, k, n, g.k);
  Layout la(raw_la);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&raw_lb, g.a_type, k, m, g.k);
  Layout lb(raw_lb);
  if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&raw_ld, g.d_type, n, m, g.n);
  Layout ld(raw_ld);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatrixLayoutCreate", st);

  const AlgoKey key{device,
                    g.n,
                    g.m,
                    g.k,
                    static_cast<int>(g.a_type),
                    static_cast<int>(g.b_type),
                    static_cast<int>(g.d_type),
                    has_bias == 1,
                    fast_accum == 1,
                    align_b,
                    align_a,
                    align_d,
                    align_bias,
                    ws_bytes};
  cublasLtMatmulAlgo_t algo;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(algo_mu);
    auto it = AlgoCache().find(key);
    if (it != AlgoCache().end()) {
      algo = it->second;
      cached = true;
    }
  }
  if (!cached) {
    cublasLtMatmulPreference_t raw_pref = nullptr;
    if (st = cublasLtMatmulPreferenceCreate(&raw_pref); st != CUBLAS_STATUS_SUCCESS) {
      return CublasError("cublasLtMatmulPreferenceCreate", st);
    }
    Preference pref(raw_pref);
    st = SetPref(pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, ws_bytes);
    // cuBLASLt's A is our b, its B our a; C and D are the output.
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetPref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b);
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetPref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a);
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetPref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d);
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
      st = SetPref(pref.get(), CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d);
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
      return CublasError("cublasLtMatmulPreferenceSetAttribute", st);
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    st = cublasLtMatmulAlgoGetHeuristic(handle, desc.get(), la.get(), lb.get(), ld.get(), ld.get(),
                                        pref.get(), 1, &result, &found);
    if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulAlgoGetHeuristic", st);
    if (found < 1 || result.state != CUBLAS_STATUS_SUCCESS) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        "fp8jax gemm: cuBLASLt has no FP8 algorithm for M=" + std::to_string(g.m) +
                            " N=" + std::to_string(g.n) + " K=" + std::to_string(g.k) +
                            " on this device (FP8 GEMM needs compute capability >= 8.9)");
    }
    algo = result.algo;
    std::lock_guard<std::mutex> lock(algo_mu);
    AlgoCache().emplace(key, algo);
  }

  const float alpha = 1.0f;
  const float beta = 0.0f;
  st = cublasLtMatmul(handle, desc.get(), &alpha, b_ptr, la.get(), a_ptr, lb.get(), &beta, d_ptr,
                      ld.get(), d_ptr, ld.get(), &algo, ws_ptr, ws_bytes, stream);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmul", st);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxGemmCuda, fp8jax::GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a [M, K] FP8
                                  .Arg<ffi::AnyBuffer>()          // b [N, K] FP8
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a_scale_inv
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b_scale_inv
                                  .Arg<ffi::AnyBuffer>()          // bias [N] or [0]
                                  .Attr<int64_t>("has_bias")      // 0 or 1
                                  .Attr<int64_t>("fast_accum")    // 0 or 1
                                  .Ret<ffi::AnyBuffer>()          // out [M, N]
                                  .Ret<ffi::Buffer<ffi::U8>>());  // workspace
