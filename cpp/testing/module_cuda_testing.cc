// nanobind module `fp8jax._fp8jax_cuda_testing`, built only for the tests (CMake
// FP8JAX_TESTING=ON, which tools/test.sh sets) and only beside the CUDA extension: the cuBLASLt
// FP8 GEMM's host-side setup (cuda/gemm_setup.h) built with placeholder device pointers and read
// back from the descriptors, its algorithm cache key, and the autotuning rules
// (cuda/gemm_autotune.h) with injected timings, for tests/ops/test_gemm_setup.py and
// tests/ops/test_gemm_autotune.py. No GPU is needed; loading the module runs no CUDA call.
#include <cublasLt.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "common/block_scale_layout.h"
#include "common/ffi_checks.h"
#include "cuda/gemm_autotune.h"
#include "cuda/gemm_setup.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace fp8jax {
namespace {

template <typename T>
int64_t DescAttr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, cublasStatus_t* st) {
  T v{};
  size_t written = 0;
  if (*st == CUBLAS_STATUS_SUCCESS)
    *st = cublasLtMatmulDescGetAttribute(d, attr, &v, sizeof(v), &written);
  return static_cast<int64_t>(v);
}

int64_t DescPtrAttr(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                    cublasStatus_t* st) {
  const void* v = nullptr;
  size_t written = 0;
  if (*st == CUBLAS_STATUS_SUCCESS)
    *st = cublasLtMatmulDescGetAttribute(d, attr, &v, sizeof(v), &written);
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(v));
}

template <typename T>
int64_t LayoutAttr(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t attr,
                   cublasStatus_t* st) {
  T v{};
  size_t written = 0;
  if (*st == CUBLAS_STATUS_SUCCESS)
    *st = cublasLtMatrixLayoutGetAttribute(l, attr, &v, sizeof(v), &written);
  return static_cast<int64_t>(v);
}

template <typename T>
int64_t PrefAttr(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                 cublasStatus_t* st) {
  T v{};
  size_t written = 0;
  if (*st == CUBLAS_STATUS_SUCCESS)
    *st = cublasLtMatmulPreferenceGetAttribute(p, attr, &v, sizeof(v), &written);
  return static_cast<int64_t>(v);
}

// Placeholder device addresses for the host description.
constexpr uintptr_t kFakeAScaleInv = 0x1000;
constexpr uintptr_t kFakeBScaleInv = 0x2000;
constexpr uintptr_t kFakeBias = 0x3000;
constexpr uintptr_t kFakeDScale = 0x4000;
constexpr uintptr_t kFakeAmax = 0x5000;
constexpr uintptr_t kFakeAux = 0x6000;

// The placeholder pointers of a checked problem, every alignment the largest.
GemmPointers FakePointers(const GemmArgs& g) {
  GemmPointers ptr;
  ptr.a_scale_inv = reinterpret_cast<const void*>(kFakeAScaleInv);
  ptr.b_scale_inv = reinterpret_cast<const void*>(kFakeBScaleInv);
  ptr.bias = g.has_bias ? reinterpret_cast<const void*>(kFakeBias) : nullptr;
  if (g.epilogue != GemmEpilogue::kPlain) {
    ptr.d_scale = reinterpret_cast<const void*>(kFakeDScale);
    ptr.amax = reinterpret_cast<const void*>(kFakeAmax);
    ptr.aux = reinterpret_cast<const void*>(kFakeAux);
  }
  ptr.align_a = ptr.align_b = ptr.align_d = ptr.align_bias = static_cast<uint32_t>(kMaxAlignment);
  ptr.workspace_bytes = 32u << 20;
  return ptr;
}

// Checks the problem, builds its setup with placeholder device pointers and reads every
// attribute back: (name, value) pairs, e.g. ("desc.fast_accum", 1).
ffi::Error DescribeGemmSetup(const GemmProblem& problem,
                             std::vector<std::pair<std::string, int64_t>>* out) {
  GemmArgs g;
  FP8JAX_RETURN_IF_ERROR(CheckGemmProblem(problem, &g));
  const GemmPointers ptr = FakePointers(g);
  GemmSetup s;
  FP8JAX_RETURN_IF_ERROR(BuildGemmSetup(g, ptr, &s));
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  auto& r = *out;
  cublasLtMatmulDesc_t d = &s.desc;
  r.emplace_back("desc.compute_type", DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &st));
  r.emplace_back("desc.scale_type", DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_SCALE_TYPE, &st));
  r.emplace_back("desc.transa", DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_TRANSA, &st));
  r.emplace_back("desc.transb", DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_TRANSB, &st));
  r.emplace_back("desc.fast_accum", DescAttr<int8_t>(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &st));
  r.emplace_back("desc.epilogue", DescAttr<uint32_t>(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &st));
  r.emplace_back("desc.a_scale_pointer", DescPtrAttr(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &st));
  r.emplace_back("desc.b_scale_pointer", DescPtrAttr(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &st));
  r.emplace_back("desc.bias_pointer", DescPtrAttr(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &st));
  r.emplace_back("desc.a_scale_mode", DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &st));
  r.emplace_back("desc.b_scale_mode", DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &st));
  if (g.has_bias) {
    r.emplace_back("desc.bias_data_type",
                   DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &st));
  }
  if (g.epilogue != GemmEpilogue::kPlain) {
    r.emplace_back("desc.d_scale_pointer",
                   DescPtrAttr(d, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &st));
    r.emplace_back("desc.amax_d_pointer", DescPtrAttr(d, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &st));
    r.emplace_back("desc.aux_pointer",
                   DescPtrAttr(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &st));
    r.emplace_back("desc.aux_ld", DescAttr<int64_t>(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &st));
    r.emplace_back("desc.aux_data_type",
                   DescAttr<int32_t>(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &st));
  }
  const std::pair<const char*, cublasLtMatrixLayout_t> layouts[] = {
      {"a", &s.la}, {"b", &s.lb}, {"c", &s.lc}, {"d", &s.ld}};
  for (const auto& [name, l] : layouts) {
    const std::string pre = std::string("layout_") + name + ".";
    r.emplace_back(pre + "type", LayoutAttr<uint32_t>(l, CUBLASLT_MATRIX_LAYOUT_TYPE, &st));
    r.emplace_back(pre + "order", LayoutAttr<int32_t>(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &st));
    r.emplace_back(pre + "rows", LayoutAttr<uint64_t>(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &st));
    r.emplace_back(pre + "cols", LayoutAttr<uint64_t>(l, CUBLASLT_MATRIX_LAYOUT_COLS, &st));
    r.emplace_back(pre + "ld", LayoutAttr<int64_t>(l, CUBLASLT_MATRIX_LAYOUT_LD, &st));
  }
  cublasLtMatmulPreference_t p = &s.pref;
  r.emplace_back("pref.max_workspace_bytes",
                 PrefAttr<uint64_t>(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &st));
  r.emplace_back("pref.min_alignment_a",
                 PrefAttr<uint32_t>(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &st));
  r.emplace_back("pref.min_alignment_c",
                 PrefAttr<uint32_t>(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &st));
  r.emplace_back("pref.min_alignment_d",
                 PrefAttr<uint32_t>(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &st));
  if (st != CUBLAS_STATUS_SUCCESS) return CublasError("reading back the cuBLASLt setup", st);
  return ffi::Error::Success();
}

// The cuBLASLt constants the description uses, by name, so tests compare against the header.
std::vector<std::pair<std::string, int64_t>> CublasLtConstants() {
  return {
      {"CUBLAS_COMPUTE_32F", CUBLAS_COMPUTE_32F},
      {"CUDA_R_32F", CUDA_R_32F},
      {"CUDA_R_16F", CUDA_R_16F},
      {"CUDA_R_16BF", CUDA_R_16BF},
      {"CUDA_R_8F_E4M3", CUDA_R_8F_E4M3},
      {"CUDA_R_8F_E5M2", CUDA_R_8F_E5M2},
      {"CUBLAS_OP_N", CUBLAS_OP_N},
      {"CUBLAS_OP_T", CUBLAS_OP_T},
      {"CUBLASLT_ORDER_COL", CUBLASLT_ORDER_COL},
      {"CUBLASLT_EPILOGUE_DEFAULT", CUBLASLT_EPILOGUE_DEFAULT},
      {"CUBLASLT_EPILOGUE_BIAS", CUBLASLT_EPILOGUE_BIAS},
      {"CUBLASLT_EPILOGUE_GELU_AUX", CUBLASLT_EPILOGUE_GELU_AUX},
      {"CUBLASLT_EPILOGUE_GELU_AUX_BIAS", CUBLASLT_EPILOGUE_GELU_AUX_BIAS},
      {"CUBLASLT_EPILOGUE_DGELU", CUBLASLT_EPILOGUE_DGELU},
      {"CUBLASLT_EPILOGUE_DGELU_BGRAD", CUBLASLT_EPILOGUE_DGELU_BGRAD},
      {"CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F", CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F},
      {"CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0", CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0},
      {"CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F", CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F},
      {"CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F", CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F},
      {"CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F", CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F},
      {"fake_a_scale_inv", static_cast<int64_t>(kFakeAScaleInv)},
      {"fake_b_scale_inv", static_cast<int64_t>(kFakeBScaleInv)},
      {"fake_bias", static_cast<int64_t>(kFakeBias)},
      {"fake_d_scale", static_cast<int64_t>(kFakeDScale)},
      {"fake_amax", static_cast<int64_t>(kFakeAmax)},
      {"fake_aux", static_cast<int64_t>(kFakeAux)},
      {"autotune_max_candidates", autotune::kMaxCandidates},
      {"autotune_timed_runs", autotune::kTimedRuns}};
}

// Tries cublasLtCreate (and destroys the handle): "CUBLAS_STATUS_SUCCESS" or the failure's
// status name. Tells the tests what needs a device.
std::string ProbeCublasLtCreate() {
  cublasLtHandle_t h = nullptr;
  const cublasStatus_t st = cublasLtCreate(&h);
  if (st == CUBLAS_STATUS_SUCCESS) cublasLtDestroy(h);
  const char* name = cublasLtGetStatusName(st);
  return name != nullptr ? name : std::to_string(static_cast<int>(st));
}

ffi::DataType DataTypeOf(const std::string& name) {
  if (name == "float8_e4m3fn") return ffi::DataType::F8E4M3FN;
  if (name == "float8_e5m2") return ffi::DataType::F8E5M2;
  if (name == "float32") return ffi::DataType::F32;
  if (name == "bfloat16") return ffi::DataType::BF16;
  if (name == "float16") return ffi::DataType::F16;
  if (name == "int8") return ffi::DataType::S8;
  if (name == "float8_e8m0fnu") return ffi::DataType::F8E8M0FNU;
  if (name == "none") return ffi::DataType::INVALID;
  throw std::invalid_argument("unknown dtype name '" + name + "'");
}

nb::dict Pairs(const std::vector<std::pair<std::string, int64_t>>& pairs) {
  nb::dict d;
  for (const auto& [k, v] : pairs) d[k.c_str()] = v;
  return d;
}

// The handler's ffi::Error as a Python exception: ValueError for invalid
// arguments, NotImplementedError for unsupported ones, RuntimeError else.
[[noreturn]] void Raise(const ffi::Error& err) {
  const auto code = err.errc().value_or(ffi::ErrorCode::kUnknown);
  if (code == ffi::ErrorCode::kInvalidArgument) throw nb::value_error(err.message().c_str());
  if (code == ffi::ErrorCode::kUnimplemented) {
    throw nb::builtin_exception(nb::exception_type::runtime_error,
                                ("unimplemented: " + err.message()).c_str());
  }
  throw std::runtime_error(err.message());
}

// The problem the test describes: dtypes by name, "" for a scale dtype meaning the mode's own.
GemmProblem ProblemOf(const std::string& a, const std::string& b, const std::string& out, int64_t m,
                      int64_t n, int64_t k, int64_t has_bias, int64_t fast_accum,
                      const std::string& bias, int64_t bias_count, int64_t a_scale_mode,
                      int64_t b_scale_mode, int64_t a_scale_count, int64_t b_scale_count,
                      const std::string& a_scale_dtype, const std::string& b_scale_dtype,
                      int64_t epilogue, const std::string& aux, int64_t aux_count,
                      int64_t d_scale_count, int64_t amax_count) {
  GemmProblem p;
  // "": the dtype the mode takes (E8M0 for VEC32_UE8M0, else float32)
  const auto scale_type = [](const std::string& name, int64_t mode) {
    if (!name.empty()) return DataTypeOf(name);
    return mode == blockscale::kVec32Ue8m0 ? ffi::DataType::F8E8M0FNU : ffi::DataType::F32;
  };
  p.a_scale_type = scale_type(a_scale_dtype, a_scale_mode);
  p.b_scale_type = scale_type(b_scale_dtype, b_scale_mode);
  p.a_scale_mode = a_scale_mode;
  p.b_scale_mode = b_scale_mode;
  p.a_scale_count = a_scale_count;
  p.b_scale_count = b_scale_count;
  p.m = m;
  p.n = n;
  p.k = k;
  p.a_type = DataTypeOf(a);
  p.b_type = DataTypeOf(b);
  p.out_type = DataTypeOf(out);
  p.bias_type = DataTypeOf(bias);
  p.bias_count = bias_count;
  p.has_bias = has_bias;
  p.fast_accum = fast_accum;
  p.epilogue = epilogue;
  p.aux_type = DataTypeOf(aux);
  p.aux_count = aux_count;
  p.d_scale_count = d_scale_count;
  p.amax_count = amax_count;
  return p;
}

#define FP8JAX_PROBLEM_PARAMS                                                                    \
  const std::string &a, const std::string &b, const std::string &out, int64_t m, int64_t n,      \
      int64_t k, int64_t has_bias, int64_t fast_accum, const std::string &bias,                  \
      int64_t bias_count, int64_t a_scale_mode, int64_t b_scale_mode, int64_t a_scale_count,     \
      int64_t b_scale_count, const std::string &a_scale_dtype, const std::string &b_scale_dtype, \
      int64_t epilogue, const std::string &aux, int64_t aux_count, int64_t d_scale_count,        \
      int64_t amax_count
#define FP8JAX_PROBLEM_ARGS                                                                 \
  a, b, out, m, n, k, has_bias, fast_accum, bias, bias_count, a_scale_mode, b_scale_mode,   \
      a_scale_count, b_scale_count, a_scale_dtype, b_scale_dtype, epilogue, aux, aux_count, \
      d_scale_count, amax_count

nb::dict GemmSetupOf(FP8JAX_PROBLEM_PARAMS) {
  std::vector<std::pair<std::string, int64_t>> report;
  if (auto err = DescribeGemmSetup(ProblemOf(FP8JAX_PROBLEM_ARGS), &report); !err.success()) {
    Raise(err);
  }
  return Pairs(report);
}

// The algorithm cache key of the problem with placeholder pointers of alignment `align`, a
// workspace of `workspace` bytes, on `device`, autotuned or not: its fields by name.
nb::dict AlgoKeyFor(int device, uint32_t align, uint64_t workspace, bool autotune,
                    FP8JAX_PROBLEM_PARAMS) {
  GemmArgs g;
  if (auto err = CheckGemmProblem(ProblemOf(FP8JAX_PROBLEM_ARGS), &g); !err.success()) Raise(err);
  GemmPointers ptr = FakePointers(g);
  ptr.align_a = ptr.align_b = ptr.align_d = ptr.align_bias = align;
  ptr.workspace_bytes = workspace;
  const AlgoKey key = AlgoKeyOf(device, g, ptr, autotune);
  return Pairs({{"device", key.device},
                {"m", key.m},
                {"n", key.n},
                {"k", key.k},
                {"a_type", key.a_type},
                {"b_type", key.b_type},
                {"c_type", key.c_type},
                {"d_type", key.d_type},
                {"epilogue", key.epilogue},
                {"bias", key.bias},
                {"fast_accum", key.fast_accum},
                {"align_a", key.align_a},
                {"align_b", key.align_b},
                {"align_d", key.align_d},
                {"align_bias", key.align_bias},
                {"workspace", static_cast<int64_t>(key.workspace)},
                {"a_scale_mode", key.a_scale_mode},
                {"b_scale_mode", key.b_scale_mode},
                {"autotuned", key.autotuned}});
}

// autotune::Tune over injected timings: (winner, whether any candidate ran, how many times each
// candidate was timed).
std::tuple<int, bool, std::vector<int>> TuneWith(const std::vector<float>& ms) {
  std::vector<int> calls(ms.size(), 0);
  const auto [best, ran] = autotune::Tune(static_cast<int>(ms.size()), [&](int i) {
    ++calls[i];
    return ms[i];
  });
  return {best, ran, calls};
}

// The once-per-key cache under contention: `threads` threads each ask for every key of `keys`
// (in an order of their own), the computation of key k takes `compute_ms` and fails (caches
// nothing) when k is in `failing`. Returns, per key, (the value every caller got, or -1 when
// callers disagreed; how many computations ran; whether Find sees a value afterwards).
std::map<int, std::tuple<int, int, bool>> CacheUnderContention(const std::vector<int>& keys,
                                                               int threads, int compute_ms,
                                                               const std::vector<int>& failing) {
  autotune::OnceCache<int, int> cache;
  std::map<int, std::atomic<int>> computes;
  std::map<int, std::vector<int>> got;
  for (int k : keys) {
    computes[k] = 0;
    got[k] = std::vector<int>(threads, -2);
  }
  const auto fails = [&](int k) {
    for (int f : failing) {
      if (f == k) return true;
    }
    return false;
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t]() {
      for (size_t i = 0; i < keys.size(); ++i) {
        const int k = keys[(i + t) % keys.size()];
        const std::optional<int> v = cache.GetOrCompute(k, [&]() -> std::optional<int> {
          ++computes.at(k);
          std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
          if (fails(k)) return std::nullopt;
          return 1000 + k;
        });
        got.at(k)[t] = v.has_value() ? *v : -1;
      }
    });
  }
  for (auto& th : pool) th.join();
  std::map<int, std::tuple<int, int, bool>> out;
  for (int k : keys) {
    const std::vector<int>& vs = got[k];
    int agreed = vs[0];
    for (int v : vs) {
      if (v != vs[0]) agreed = -1;
    }
    out[k] = {agreed, computes[k].load(), cache.Find(k).has_value()};
  }
  return out;
}

}  // namespace
}  // namespace fp8jax

NB_MODULE(_fp8jax_cuda_testing, m) {
  m.doc() = "fp8jax test support: the cuBLASLt GEMM setup and autotuning rules on the host";
  m.def("_gemm_setup", &fp8jax::GemmSetupOf, nb::arg("a"), nb::arg("b"), nb::arg("out"),
        nb::arg("m"), nb::arg("n"), nb::arg("k"), nb::arg("has_bias"), nb::arg("fast_accum"),
        nb::arg("bias") = "none", nb::arg("bias_count") = 0, nb::arg("a_scale_mode") = 0,
        nb::arg("b_scale_mode") = 0, nb::arg("a_scale_count") = 1, nb::arg("b_scale_count") = 1,
        nb::arg("a_scale_dtype") = "", nb::arg("b_scale_dtype") = "", nb::arg("epilogue") = 0,
        nb::arg("aux") = "none", nb::arg("aux_count") = 0, nb::arg("d_scale_count") = 0,
        nb::arg("amax_count") = 0);
  m.def("_algo_key", &fp8jax::AlgoKeyFor, nb::arg("device"), nb::arg("align"), nb::arg("workspace"),
        nb::arg("autotune"), nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("m"), nb::arg("n"),
        nb::arg("k"), nb::arg("has_bias"), nb::arg("fast_accum"), nb::arg("bias") = "none",
        nb::arg("bias_count") = 0, nb::arg("a_scale_mode") = 0, nb::arg("b_scale_mode") = 0,
        nb::arg("a_scale_count") = 1, nb::arg("b_scale_count") = 1, nb::arg("a_scale_dtype") = "",
        nb::arg("b_scale_dtype") = "", nb::arg("epilogue") = 0, nb::arg("aux") = "none",
        nb::arg("aux_count") = 0, nb::arg("d_scale_count") = 0, nb::arg("amax_count") = 0);
  // The autotuning rules (cuda/gemm_autotune.h) with injected inputs.
  m.def("_autotune_decide", [](bool cached, bool autotune, bool capturing, bool can_time) {
    return static_cast<int>(fp8jax::autotune::Decide(cached, autotune, capturing, can_time));
  });
  m.def("_autotune_fastest", &fp8jax::autotune::Fastest);
  m.def("_autotune_tune", &fp8jax::TuneWith);
  m.def("_autotune_cache_contention", &fp8jax::CacheUnderContention, nb::arg("keys"),
        nb::arg("threads"), nb::arg("compute_ms"), nb::arg("failing"),
        nb::call_guard<nb::gil_scoped_release>());
  // Why a GPU (compute capability major) and cuBLASLt version cannot run a scale mode ("": can).
  m.def("_scale_mode_unsupported", &fp8jax::ScaleModeUnsupported, nb::arg("mode"),
        nb::arg("cc_major"), nb::arg("cublaslt_version"));
  // Where cuBLASLt reads block scale (r, kb) of a [rows, k] operand (common/block_scale_layout.h),
  // and how many it reads.
  m.def("_block_scale_index", [](int32_t mode, int64_t r, int64_t kb, int64_t rows, int64_t k) {
    return fp8jax::blockscale::ScaleIndex(mode, r, kb, rows, k);
  });
  m.def("_block_scale_count", [](int32_t mode, int64_t rows, int64_t k) {
    return fp8jax::blockscale::ScaleCount(mode, rows, k);
  });
  m.def("_cublaslt_constants", []() { return fp8jax::Pairs(fp8jax::CublasLtConstants()); });
  m.def("_probe_cublaslt_create", &fp8jax::ProbeCublasLtCreate);
}
