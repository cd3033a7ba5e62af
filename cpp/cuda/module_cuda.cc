// nanobind module `fp8jax._fp8jax_cuda`: the CUDA FFI handlers as PyCapsules,
// under the same target names as the CPU ones. Loaded only when JAX has a
// CUDA backend (see fp8jax/_ffi.py); loading it runs no CUDA call.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda/gemm_setup.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxDequantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxCastTransposeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxUpdateFp8StateCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxLayerNormForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxRmsNormForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxLayerNormForwardFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxRmsNormForwardFp8Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxNormBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmInitializeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGemmCuda);

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

ffi::DataType DataTypeOf(const std::string& name) {
  if (name == "float8_e4m3fn") return ffi::DataType::F8E4M3FN;
  if (name == "float8_e5m2") return ffi::DataType::F8E5M2;
  if (name == "float32") return ffi::DataType::F32;
  if (name == "bfloat16") return ffi::DataType::BF16;
  if (name == "float16") return ffi::DataType::F16;
  if (name == "int8") return ffi::DataType::S8;
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

nb::dict GemmSetup(const std::string& a, const std::string& b, const std::string& out, int64_t m,
                   int64_t n, int64_t k, int64_t has_bias, int64_t fast_accum,
                   const std::string& bias, int64_t bias_count) {
  fp8jax::GemmProblem p;
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
  std::vector<std::pair<std::string, int64_t>> report;
  if (auto err = fp8jax::DescribeGemmSetup(p, &report); !err.success()) Raise(err);
  return Pairs(report);
}

}  // namespace

NB_MODULE(_fp8jax_cuda, m) {
  m.doc() = "fp8jax CUDA kernels (XLA FFI handlers)";
  // A capsule (execute stage only) or a dict of XLA FFI stage -> capsule.
  m.def("registrations", []() {
    nb::dict d;
    d["fp8jax_quantize"] = Capsule(Fp8jaxQuantizeCuda);
    d["fp8jax_dequantize"] = Capsule(Fp8jaxDequantizeCuda);
    d["fp8jax_cast_transpose"] = Capsule(Fp8jaxCastTransposeCuda);
    d["fp8jax_update_fp8_state"] = Capsule(Fp8jaxUpdateFp8StateCuda);
    d["fp8jax_layernorm_forward"] = Capsule(Fp8jaxLayerNormForwardCuda);
    d["fp8jax_rmsnorm_forward"] = Capsule(Fp8jaxRmsNormForwardCuda);
    d["fp8jax_layernorm_forward_fp8"] = Capsule(Fp8jaxLayerNormForwardFp8Cuda);
    d["fp8jax_rmsnorm_forward_fp8"] = Capsule(Fp8jaxRmsNormForwardFp8Cuda);
    d["fp8jax_norm_backward"] = Capsule(Fp8jaxNormBackwardCuda);
    // The GEMM's initialize stage creates the cuBLASLt handle and runs the
    // heuristic query outside CUDA-graph capture; execute only calls cublasLtMatmul.
    nb::dict gemm;
    gemm["initialize"] = Capsule(Fp8jaxGemmInitializeCuda);
    gemm["execute"] = Capsule(Fp8jaxGemmCuda);
    d["fp8jax_gemm"] = gemm;
    return d;
  });
  // XLA FFI handler traits to register each target with (the registration,
  // not the handler, tells XLA): every fp8jax CUDA handler may be captured
  // into a CUDA graph (XLA command buffer).
  m.def("traits", []() {
    nb::dict d;
    const auto compatible = static_cast<int64_t>(XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE);
    for (const char* name : {"fp8jax_quantize", "fp8jax_dequantize", "fp8jax_cast_transpose",
                             "fp8jax_update_fp8_state", "fp8jax_gemm", "fp8jax_layernorm_forward",
                             "fp8jax_rmsnorm_forward", "fp8jax_layernorm_forward_fp8",
                             "fp8jax_rmsnorm_forward_fp8", "fp8jax_norm_backward"}) {
      d[name] = compatible;
    }
    return d;
  });
  // Private, for tests/ops/test_gemm_setup.py: the cuBLASLt setup of one GEMM,
  // built on the host with placeholder device pointers (no GPU needed).
  m.def("_gemm_setup", &GemmSetup, nb::arg("a"), nb::arg("b"), nb::arg("out"), nb::arg("m"),
        nb::arg("n"), nb::arg("k"), nb::arg("has_bias"), nb::arg("fast_accum"),
        nb::arg("bias") = "none", nb::arg("bias_count") = 0);
  m.def("_cublaslt_constants", []() { return Pairs(fp8jax::CublasLtConstants()); });
  m.def("_probe_cublaslt_create", &fp8jax::ProbeCublasLtCreate);
}
