// CUDA FFI handlers of the cuBLASLt FP8 GEMM: out[M, N] = epilogue((a @ b^T) * a_scale_inv *
// b_scale_inv) for FP8 a[M, K], b[N, K] (the layout contract and the descriptors:
// gemm_setup.h/.cc), under three targets:
// - fp8jax_gemm: the plain GEMM (+ bias), wide output (block scales too);
// - fp8jax_gemm_gelu: an MLP's first GEMM, FP8 output of gelu(p + bias) with its amax and the
//   float16 GELU input for the backward (GemmEpilogue::kGeluFp8);
// - fp8jax_gemm_dgelu: that MLP's dgrad into the GELU, FP8 output of p * gelu'(aux) with its
//   amax and the bias gradient (GemmEpilogue::kDGeluFp8).
//
// Runtime behaviour, in XLA FFI's execution stages:
// - initialize (runs before each execution, outside any CUDA-graph capture, with the real
//   buffers and stream): takes the stream's device, creates its cuBLASLt handle on first use
//   (kept for the life of the process), builds the descriptors and chooses the algorithm once per
//   AlgoKey (gemm_setup.h): with autotuning (the `autotune` attribute), the heuristic's first
//   kMaxCandidates answers are timed on the stream and the fastest is cached (gemm_autotune.h
//   holds the rules). The timed runs write their outputs to scratch memory from XLA's allocator
//   (ffi::ScratchAllocator, freed when the stage returns), never to the call's own output buffers,
//   which at this point may still hold a donated input's data; the inputs are only read. Without
//   scratch memory the heuristic's first answer runs, untimed.
// - execute (what XLA captures into a CUDA graph, so the handlers declare kCmdBufferCompatible):
//   builds the descriptors in stack memory with cuBLASLt's *Init functions (no allocation), finds
//   the handle and the algorithm in the caches, and calls cublasLtMatmul. If a runtime never ran
//   the initialize stage for this key, execute does its work itself: outside a capture
//   (cudaStreamIsCapturing) it times on its own output buffers (stream-ordered: the final run
//   overwrites them), inside one it takes the heuristic's first answer and times nothing.
// The scales are read on the device (scale pointers), alpha and beta are host constants, and the
// workspace is an XLA-allocated output, so the execute stage allocates no device memory and
// synchronises the host only the one time it tunes a key outside a capture (never once
// initialize has tuned it). Every failure becomes an ffi::Error that names the cuBLAS status.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/block_scale_layout.h"
#include "common/ffi_checks.h"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_util.h"
#include "cuda/gemm_autotune.h"
#include "cuda/gemm_setup.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr char kOp[] = "gemm";
constexpr uintptr_t kMinAlignment = 16;

// Largest power of two (capped at 256) dividing the address; 256 for null.
uint32_t AlignmentOf(const void* p) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if (addr == 0) return static_cast<uint32_t>(kMaxAlignment);
  const uintptr_t low = addr & (~addr + 1);
  return static_cast<uint32_t>(low < kMaxAlignment ? low : kMaxAlignment);
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

using AlgoCache = autotune::OnceCache<AlgoKey, cublasLtMatmulAlgo_t>;

AlgoCache& Algos() {
  static auto* cache = new AlgoCache();
  return *cache;
}

// ------------------------------------------------------------------ a call

// What a call got from XLA, whichever target it came through.
struct GemmCall {
  GemmProblem p;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  GemmPointers ptr;  // the scale, bias and epilogue pointers (alignments: filled by Prepare)
  ffi::Buffer<ffi::U8>* workspace = nullptr;
  bool autotune = true;
};

// Everything a call needs, shared by the initialize and execute stages.
struct PreparedGemm {
  GemmArgs g;
  GemmPointers ptr;
  GemmSetup setup;
  cublasLtHandle_t handle = nullptr;
  AlgoKey key;
  const void* a = nullptr;
  const void* b = nullptr;
  void* d = nullptr;
  void* ws = nullptr;
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

// Checks the call, lays out the workspace, builds the descriptors and finds the handle and key.
ffi::Error Prepare(const GemmCall& c, PreparedGemm* pg) {
  GemmArgs& g = pg->g;
  FP8JAX_RETURN_IF_ERROR(CheckGemmProblem(c.p, &g));
  FP8JAX_RETURN_IF_ERROR(CheckModesOnDevice(g));
  if (g.m == 0 || g.n == 0) {
    pg->empty = true;
    return ffi::Error::Success();
  }
  pg->a = c.a;
  pg->b = c.b;
  pg->d = c.d;
  GemmPointers& ptr = pg->ptr;
  ptr = c.ptr;
  ptr.align_a = AlignmentOf(c.a);
  ptr.align_b = AlignmentOf(c.b);
  ptr.align_d = AlignmentOf(c.d);
  ptr.align_bias = AlignmentOf(g.has_bias ? ptr.bias : nullptr);
  const uint32_t align_aux = AlignmentOf(ptr.aux);
  if (ptr.align_a < kMinAlignment || ptr.align_b < kMinAlignment || ptr.align_d < kMinAlignment ||
      ptr.align_bias < kMinAlignment || align_aux < kMinAlignment) {
    return BadArg(kOp, "a, b, the bias, the GELU input and the output must be 16-byte aligned");
  }
  // The workspace is used from its first 256-byte aligned address; its usable
  // size is fixed by the buffer size alone so that cached algorithms stay valid.
  const uint64_t ws_total = static_cast<uint64_t>(c.workspace->element_count());
  if (ws_total < 2 * kMaxAlignment) return BadArg(kOp, "workspace too small");
  const uintptr_t ws_addr = reinterpret_cast<uintptr_t>(c.workspace->typed_data());
  pg->ws = reinterpret_cast<void*>((ws_addr + kMaxAlignment - 1) & ~(kMaxAlignment - 1));
  pg->ws_bytes = ws_total - kMaxAlignment;
  ptr.workspace_bytes = pg->ws_bytes;
  FP8JAX_RETURN_IF_ERROR(BuildGemmSetup(g, ptr, &pg->setup));
  // The stream's device (XLA makes it the current one; see CurrentDevice):
  // handles and algorithms are per device.
  int device = 0;
  FP8JAX_RETURN_IF_ERROR(CurrentDevice(kOp, &device));
  FP8JAX_RETURN_IF_ERROR(HandleFor(device, &pg->handle));
  pg->key = AlgoKeyOf(device, g, ptr, c.autotune);
  return ffi::Error::Success();
}

// An FP8 D has no C: cuBLASLt reads C only with beta != 0, and its C layout is the 16-bit one.
const void* CPointer(const PreparedGemm& pg, const void* d) {
  return pg.g.epilogue == GemmEpilogue::kPlain ? d : nullptr;
}

cublasStatus_t Matmul(cudaStream_t stream, const PreparedGemm& pg, GemmSetup& s, void* d,
                      const cublasLtMatmulAlgo_t& algo) {
  const float alpha = 1.0f;
  const float beta = 0.0f;
  return cublasLtMatmul(pg.handle, &s.desc, &alpha, pg.b, &s.la, pg.a, &s.lb, &beta,
                        CPointer(pg, d), &s.lc, d, &s.ld, &algo, pg.ws, pg.ws_bytes, stream);
}

// Up to `want` of the heuristic's algorithms for the call, best first (needs a GPU).
ffi::Error Candidates(PreparedGemm& pg, int want, std::vector<cublasLtMatmulAlgo_t>* out) {
  std::vector<cublasLtMatmulHeuristicResult_t> results(want);
  int found = 0;
  GemmSetup& s = pg.setup;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
      pg.handle, &s.desc, &s.la, &s.lb, &s.lc, &s.ld, &s.pref, want, results.data(), &found);
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("cublasLtMatmulAlgoGetHeuristic", st);
  out->clear();
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) out->push_back(results[i].algo);
  }
  if (out->empty()) {
    const AlgoKey& key = pg.key;
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "fp8jax gemm: cuBLASLt has no FP8 algorithm for M=" + std::to_string(key.n) +
                          " N=" + std::to_string(key.m) + " K=" + std::to_string(key.k) +
                          " with epilogue " + std::to_string(key.epilogue) +
                          " on this device (FP8 GEMM needs compute capability >= 8.9; the GELU "
                          "epilogues can be switched off with "
                          "fp8jax.ops.gemm_options(fused_epilogues=False))");
  }
  return ffi::Error::Success();
}

// Whether `stream` is being captured into a CUDA graph; an unknown status counts as captured.
bool Capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();  // the query's error is not the stream's
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Events around a timed loop, destroyed with the object.
struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  bool ok = false;
  Events() {
    ok = cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
    if (!ok) cudaGetLastError();
  }
  ~Events() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
};

// Milliseconds per run of candidate `algo` with setup `s` writing `d` (negative: it failed).
float TimeOne(cudaStream_t stream, const PreparedGemm& pg, GemmSetup& s, void* d,
              const cublasLtMatmulAlgo_t& algo, const Events& ev) {
  if (Matmul(stream, pg, s, d, algo) != CUBLAS_STATUS_SUCCESS) return -1.0f;  // warm-up
  if (cudaEventRecord(ev.start, stream) != cudaSuccess) return -1.0f;
  for (int r = 0; r < autotune::kTimedRuns; ++r) {
    if (Matmul(stream, pg, s, d, algo) != CUBLAS_STATUS_SUCCESS) return -1.0f;
  }
  float ms = -1.0f;
  if (cudaEventRecord(ev.stop, stream) != cudaSuccess ||
      cudaEventSynchronize(ev.stop) != cudaSuccess ||
      cudaEventElapsedTime(&ms, ev.start, ev.stop) != cudaSuccess) {
    cudaGetLastError();
    return -1.0f;
  }
  return ms / autotune::kTimedRuns;
}

// Where the timed runs write: scratch copies of every output the epilogue writes (D, the GELU
// input, the amax, the bias gradient), from XLA's allocator; false if it has no room.
bool ScratchOutputs(ffi::ScratchAllocator& scratch, const PreparedGemm& pg, GemmPointers* ptr,
                    void** d) {
  const GemmArgs& g = pg.g;
  const auto bytes = [](cudaDataType_t t) {
    return t == CUDA_R_32F ? 4 : (t == CUDA_R_16F || t == CUDA_R_16BF) ? 2 : 1;
  };
  const auto get = [&](size_t size) -> void* {
    std::optional<void*> p = scratch.Allocate(size, kMaxAlignment);
    return p.has_value() ? *p : nullptr;
  };
  const size_t mn = static_cast<size_t>(g.m) * static_cast<size_t>(g.n);
  *d = get(mn * bytes(g.d_type));
  if (*d == nullptr) return false;
  if (g.epilogue == GemmEpilogue::kPlain) return true;
  ptr->amax = get(sizeof(float));
  if (ptr->amax == nullptr) return false;
  if (g.epilogue == GemmEpilogue::kGeluFp8) {
    ptr->aux = get(mn * 2);
    if (ptr->aux == nullptr) return false;
  }
  if (g.epilogue == GemmEpilogue::kDGeluFp8 && g.has_bias) {
    ptr->bias = get(static_cast<size_t>(g.n) * 2);
    if (ptr->bias == nullptr) return false;
  }
  return true;
}

// Times the heuristic's candidates (the outputs in scratch memory when `scratch` is given, else
// the call's own) and returns the fastest; nullopt when nothing could be timed.
std::optional<cublasLtMatmulAlgo_t> Tuned(cudaStream_t stream, PreparedGemm& pg,
                                          ffi::ScratchAllocator* scratch, ffi::Error* err) {
  std::vector<cublasLtMatmulAlgo_t> algos;
  if (*err = Candidates(pg, autotune::kMaxCandidates, &algos); !err->success()) {
    return std::nullopt;
  }
  GemmSetup timed = pg.setup;
  void* d = pg.d;
  if (scratch != nullptr) {
    GemmPointers ptr = pg.ptr;
    if (!ScratchOutputs(*scratch, pg, &ptr, &d)) return std::nullopt;
    if (!BuildGemmSetup(pg.g, ptr, &timed).success()) return std::nullopt;
  }
  Events ev;
  if (!ev.ok) return std::nullopt;
  const auto [best, ran] = autotune::Tune(static_cast<int>(algos.size()), [&](int i) {
    return TimeOne(stream, pg, timed, d, algos[i], ev);
  });
  // Nothing may still run on the scratch memory when the stage returns and frees it.
  if (cudaStreamSynchronize(stream) != cudaSuccess) cudaGetLastError();
  if (!ran) return std::nullopt;
  return algos[best];
}

// The algorithm of the call (gemm_autotune.h, Decide). `scratch`: the initialize stage's
// allocator (its timed runs write there); null in the execute stage (its own outputs).
ffi::Error ChooseAlgo(cudaStream_t stream, PreparedGemm& pg, ffi::ScratchAllocator* scratch,
                      cublasLtMatmulAlgo_t* algo) {
  AlgoCache& cache = Algos();
  const std::optional<cublasLtMatmulAlgo_t> cached = cache.Find(pg.key);
  const bool capturing = Capturing(stream);
  const auto first = [&]() -> std::optional<cublasLtMatmulAlgo_t> {
    std::vector<cublasLtMatmulAlgo_t> algos;
    if (!Candidates(pg, 1, &algos).success()) return std::nullopt;
    return algos[0];
  };
  std::optional<cublasLtMatmulAlgo_t> got;
  switch (autotune::Decide(cached.has_value(), pg.key.autotuned, capturing, true)) {
    case autotune::Action::kUseCached:
      got = cached;
      break;
    case autotune::Action::kFirstCache:
      got = cache.GetOrCompute(pg.key, first);
      break;
    case autotune::Action::kFirstOnly:
      got = first();
      break;
    case autotune::Action::kTime: {
      ffi::Error err = ffi::Error::Success();
      got = cache.GetOrCompute(pg.key, [&]() { return Tuned(stream, pg, scratch, &err); });
      if (!err.success()) return err;
      if (!got.has_value()) got = first();  // no timing possible: untimed, not cached
      break;
    }
  }
  if (got.has_value()) {
    *algo = *got;
    return ffi::Error::Success();
  }
  std::vector<cublasLtMatmulAlgo_t> algos;  // the query again, for its error
  FP8JAX_RETURN_IF_ERROR(Candidates(pg, 1, &algos));
  *algo = algos[0];
  return ffi::Error::Success();
}

// Initialize stage: outside any graph capture; fills the handle and algorithm caches for
// exactly the buffers execute will get.
ffi::Error Initialize(cudaStream_t stream, ffi::ScratchAllocator& scratch, const GemmCall& c) {
  PreparedGemm pg;
  FP8JAX_RETURN_IF_ERROR(Prepare(c, &pg));
  if (pg.empty) return ffi::Error::Success();
  cublasLtMatmulAlgo_t algo;
  return ChooseAlgo(stream, pg, &scratch, &algo);
}

// Execute stage: after initialize, Prepare only builds stack descriptors and reads the caches.
ffi::Error Execute(cudaStream_t stream, const GemmCall& c) {
  PreparedGemm pg;
  FP8JAX_RETURN_IF_ERROR(Prepare(c, &pg));
  if (pg.empty) return ffi::Error::Success();
  cublasLtMatmulAlgo_t algo;
  FP8JAX_RETURN_IF_ERROR(ChooseAlgo(stream, pg, nullptr, &algo));
  if (const cublasStatus_t st = Matmul(stream, pg, pg.setup, pg.d, algo);
      st != CUBLAS_STATUS_SUCCESS) {
    return CublasError("cublasLtMatmul", st);
  }
  return ffi::Error::Success();
}

// ------------------------------------------------------------------ the three targets

ffi::Error Rank2(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b, const ffi::AnyBuffer& out,
                 GemmProblem* p) {
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || out.dimensions().size() != 2) {
    return BadArg(kOp, "a, b and the output must be 2-D");
  }
  p->m = a.dimensions()[0];
  p->k = a.dimensions()[1];
  p->n = b.dimensions()[0];
  if (b.dimensions()[1] != p->k) return BadArg(kOp, "a and b must have the same K (last dim)");
  if (out.dimensions()[0] != p->m || out.dimensions()[1] != p->n) {
    return BadArg(kOp, "output must have shape [M, N]");
  }
  return ffi::Error::Success();
}

// The operands every target shares: a, b and their scales, the output, the flags.
ffi::Error CommonCall(const ffi::AnyBuffer& a, const ffi::AnyBuffer& b,
                      const ffi::AnyBuffer& a_scale_inv, const ffi::AnyBuffer& b_scale_inv,
                      ffi::AnyBuffer& out, ffi::Buffer<ffi::U8>& workspace, int64_t has_bias,
                      int64_t fast_accum, int64_t autotune, GemmCall* c) {
  FP8JAX_RETURN_IF_ERROR(Rank2(a, b, out, &c->p));
  if (autotune != 0 && autotune != 1) return BadArg(kOp, "autotune must be 0 or 1");
  GemmProblem& p = c->p;
  p.a_type = a.element_type();
  p.b_type = b.element_type();
  p.out_type = out.element_type();
  p.a_scale_count = static_cast<int64_t>(a_scale_inv.element_count());
  p.b_scale_count = static_cast<int64_t>(b_scale_inv.element_count());
  p.a_scale_type = a_scale_inv.element_type();
  p.b_scale_type = b_scale_inv.element_type();
  p.has_bias = has_bias;
  p.fast_accum = fast_accum;
  c->a = a.untyped_data();
  c->b = b.untyped_data();
  c->d = out.untyped_data();
  c->ptr.a_scale_inv = a_scale_inv.untyped_data();
  c->ptr.b_scale_inv = b_scale_inv.untyped_data();
  c->workspace = &workspace;
  c->autotune = autotune == 1;
  return ffi::Error::Success();
}

// fp8jax_gemm.
ffi::Error PlainCall(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                     ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias, int64_t has_bias,
                     int64_t fast_accum, int64_t a_scale_mode, int64_t b_scale_mode,
                     int64_t autotune, ffi::AnyBuffer& out, ffi::Buffer<ffi::U8>& workspace,
                     GemmCall* c) {
  FP8JAX_RETURN_IF_ERROR(CommonCall(a, b, a_scale_inv, b_scale_inv, out, workspace, has_bias,
                                    fast_accum, autotune, c));
  c->p.a_scale_mode = a_scale_mode;
  c->p.b_scale_mode = b_scale_mode;
  c->p.bias_type = bias.element_type();
  c->p.bias_count = static_cast<int64_t>(bias.element_count());
  c->ptr.bias = has_bias == 1 ? bias.untyped_data() : nullptr;
  return ffi::Error::Success();
}

// What both GELU targets add: the epilogue dtype (of the bias or bias gradient buffer, even an
// empty one), the GELU input, the scale of D and the amax.
void Fp8OutputCall(GemmEpilogue epilogue, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& aux,
                   const ffi::AnyBuffer& d_scale, const ffi::AnyBuffer& amax, GemmCall* c) {
  GemmProblem& p = c->p;
  p.epilogue = static_cast<int64_t>(epilogue);
  p.bias_type = bias.element_type();
  p.bias_count = static_cast<int64_t>(bias.element_count());
  p.aux_type = aux.element_type();
  p.aux_count = static_cast<int64_t>(aux.element_count());
  p.d_scale_count = d_scale.element_type() == ffi::DataType::F32
                        ? static_cast<int64_t>(d_scale.element_count())
                        : 0;
  p.amax_count =
      amax.element_type() == ffi::DataType::F32 ? static_cast<int64_t>(amax.element_count()) : 0;
  c->ptr.bias = p.has_bias == 1 ? bias.untyped_data() : nullptr;
  c->ptr.aux = aux.untyped_data();
  c->ptr.d_scale = d_scale.untyped_data();
  c->ptr.amax = amax.untyped_data();
}

#define FP8JAX_GEMM_STAGES(Name, ...)                                                            \
  ffi::Error Name##Initialize(cudaStream_t stream, ffi::ScratchAllocator scratch, __VA_ARGS__) { \
    GemmCall c;                                                                                  \
    FP8JAX_RETURN_IF_ERROR(Name##Call(FP8JAX_GEMM_FORWARD_ARGS_##Name, &c));                     \
    return Initialize(stream, scratch, c);                                                       \
  }                                                                                              \
  ffi::Error Name##Execute(cudaStream_t stream, __VA_ARGS__) {                                   \
    GemmCall c;                                                                                  \
    FP8JAX_RETURN_IF_ERROR(Name##Call(FP8JAX_GEMM_FORWARD_ARGS_##Name, &c));                     \
    return Execute(stream, c);                                                                   \
  }

// fp8jax_gemm_gelu.
ffi::Error GeluCall(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                    ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias, ffi::AnyBuffer d_scale,
                    int64_t has_bias, int64_t fast_accum, int64_t autotune, ffi::AnyBuffer& out,
                    ffi::AnyBuffer& aux, ffi::AnyBuffer& amax, ffi::Buffer<ffi::U8>& workspace,
                    GemmCall* c) {
  FP8JAX_RETURN_IF_ERROR(CommonCall(a, b, a_scale_inv, b_scale_inv, out, workspace, has_bias,
                                    fast_accum, autotune, c));
  Fp8OutputCall(GemmEpilogue::kGeluFp8, bias, aux, d_scale, amax, c);
  return ffi::Error::Success();
}

// fp8jax_gemm_dgelu.
ffi::Error DGeluCall(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                     ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer aux, ffi::AnyBuffer d_scale,
                     int64_t has_bias, int64_t fast_accum, int64_t autotune, ffi::AnyBuffer& out,
                     ffi::AnyBuffer& amax, ffi::AnyBuffer& dbias, ffi::Buffer<ffi::U8>& workspace,
                     GemmCall* c) {
  FP8JAX_RETURN_IF_ERROR(CommonCall(a, b, a_scale_inv, b_scale_inv, out, workspace, has_bias,
                                    fast_accum, autotune, c));
  Fp8OutputCall(GemmEpilogue::kDGeluFp8, dbias, aux, d_scale, amax, c);
  return ffi::Error::Success();
}

using Out = ffi::Result<ffi::AnyBuffer>;
using Workspace = ffi::Result<ffi::Buffer<ffi::U8>>;

#define FP8JAX_GEMM_FORWARD_ARGS_Plain                                                    \
  a, b, a_scale_inv, b_scale_inv, bias, has_bias, fast_accum, a_scale_mode, b_scale_mode, \
      autotune, *out, *workspace
FP8JAX_GEMM_STAGES(Plain, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                   ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias, int64_t has_bias,
                   int64_t fast_accum, int64_t a_scale_mode, int64_t b_scale_mode, int64_t autotune,
                   Out out, Workspace workspace)

#define FP8JAX_GEMM_FORWARD_ARGS_Gelu                                                        \
  a, b, a_scale_inv, b_scale_inv, bias, d_scale, has_bias, fast_accum, autotune, *out, *aux, \
      *amax, *workspace
FP8JAX_GEMM_STAGES(Gelu, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                   ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer bias, ffi::AnyBuffer d_scale,
                   int64_t has_bias, int64_t fast_accum, int64_t autotune, Out out, Out aux,
                   Out amax, Workspace workspace)

#define FP8JAX_GEMM_FORWARD_ARGS_DGelu                                                       \
  a, b, a_scale_inv, b_scale_inv, aux, d_scale, has_bias, fast_accum, autotune, *out, *amax, \
      *dbias, *workspace
FP8JAX_GEMM_STAGES(DGelu, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_scale_inv,
                   ffi::AnyBuffer b_scale_inv, ffi::AnyBuffer aux, ffi::AnyBuffer d_scale,
                   int64_t has_bias, int64_t fast_accum, int64_t autotune, Out out, Out amax,
                   Out dbias, Workspace workspace)

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

// The stages' bindings: the same arguments, initialize with XLA's scratch allocator as well.
#define FP8JAX_GEMM_INIT_CTX(BIND) \
  ffi::Ffi::BIND().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>()
#define FP8JAX_GEMM_EXEC_CTX(BIND) ffi::Ffi::BIND().Ctx<ffi::PlatformStream<cudaStream_t>>()

// fp8jax_gemm
#define FP8JAX_GEMM_PLAIN(CTX)                              \
  CTX.Arg<ffi::AnyBuffer>()          /* a [M, K] FP8 */     \
      .Arg<ffi::AnyBuffer>()         /* b [N, K] FP8 */     \
      .Arg<ffi::AnyBuffer>()         /* a_scale_inv */      \
      .Arg<ffi::AnyBuffer>()         /* b_scale_inv */      \
      .Arg<ffi::AnyBuffer>()         /* bias [N] or [0] */  \
      .Attr<int64_t>("has_bias")     /* 0 or 1 */           \
      .Attr<int64_t>("fast_accum")   /* 0 or 1 */           \
      .Attr<int64_t>("a_scale_mode") /* blockscale::Mode */ \
      .Attr<int64_t>("b_scale_mode") /* blockscale::Mode */ \
      .Attr<int64_t>("autotune")     /* 0 or 1 */           \
      .Ret<ffi::AnyBuffer>()         /* out [M, N] */       \
      .Ret<ffi::Buffer<ffi::U8>>()   /* workspace */

// fp8jax_gemm_gelu
#define FP8JAX_GEMM_GELU(CTX)                                           \
  CTX.Arg<ffi::AnyBuffer>()        /* a [M, K] FP8 */                   \
      .Arg<ffi::AnyBuffer>()       /* b [N, K] FP8 */                   \
      .Arg<ffi::AnyBuffer>()       /* a_scale_inv */                    \
      .Arg<ffi::AnyBuffer>()       /* b_scale_inv */                    \
      .Arg<ffi::AnyBuffer>()       /* bias [N] or [0], bf16/f16 */      \
      .Arg<ffi::AnyBuffer>()       /* d_scale, f32[1] */                \
      .Attr<int64_t>("has_bias")   /* 0 or 1 */                         \
      .Attr<int64_t>("fast_accum") /* 0 or 1 */                         \
      .Attr<int64_t>("autotune")   /* 0 or 1 */                         \
      .Ret<ffi::AnyBuffer>()       /* out [M, N] FP8 */                 \
      .Ret<ffi::AnyBuffer>()       /* aux [M, N] f16: the GELU input */ \
      .Ret<ffi::AnyBuffer>()       /* amax f32[1] */                    \
      .Ret<ffi::Buffer<ffi::U8>>() /* workspace */

// fp8jax_gemm_dgelu
#define FP8JAX_GEMM_DGELU(CTX)                                           \
  CTX.Arg<ffi::AnyBuffer>()        /* a [M, K] FP8 */                    \
      .Arg<ffi::AnyBuffer>()       /* b [N, K] FP8 */                    \
      .Arg<ffi::AnyBuffer>()       /* a_scale_inv */                     \
      .Arg<ffi::AnyBuffer>()       /* b_scale_inv */                     \
      .Arg<ffi::AnyBuffer>()       /* aux [M, N] f16: the GELU input */  \
      .Arg<ffi::AnyBuffer>()       /* d_scale, f32[1] */                 \
      .Attr<int64_t>("has_bias")   /* 0 or 1: write the bias gradient */ \
      .Attr<int64_t>("fast_accum") /* 0 or 1 */                          \
      .Attr<int64_t>("autotune")   /* 0 or 1 */                          \
      .Ret<ffi::AnyBuffer>()       /* out [M, N] FP8 */                  \
      .Ret<ffi::AnyBuffer>()       /* amax f32[1] */                     \
      .Ret<ffi::AnyBuffer>()       /* dbias [N] or [0], bf16/f16 */      \
      .Ret<ffi::Buffer<ffi::U8>>() /* workspace */

#define FP8JAX_GEMM_DEFINE(Symbol, Name, BINDING)                                         \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jax##Symbol##InitializeCuda, fp8jax::Name##Initialize, \
                                BINDING(FP8JAX_GEMM_INIT_CTX(BindInitialize)));           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jax##Symbol##Cuda, fp8jax::Name##Execute,              \
                                BINDING(FP8JAX_GEMM_EXEC_CTX(Bind)), {fp8jax::kCudaHandlerTraits})

FP8JAX_GEMM_DEFINE(Gemm, Plain, FP8JAX_GEMM_PLAIN);
FP8JAX_GEMM_DEFINE(GemmGelu, Gelu, FP8JAX_GEMM_GELU);
FP8JAX_GEMM_DEFINE(GemmDGelu, DGelu, FP8JAX_GEMM_DGELU);
