// nanobind module `fp8jax._fp8jax_host_cuda`, built only for the tests (FP8JAX_TESTING=ON, where
// the CUDA toolkit's headers are found): every op's CUDA handler with the computations and kernels
// of cpp/cuda/, compiled by the host compiler on the runtime of host_cuda.h and bound for XLA's
// CPU platform (Fp8jax<Stem>HostCuda).
// tests/ops/test_host_cuda.py registers them under "fp8jax_host_cuda_*" targets and runs the ops
// on them, so every __global__ body executes without a GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>
#include <utility>

#include "testing/host_cuda.h"
// The runtime first.
#include "common/op_table.h"
#include "common/registrations.h"
#include "cuda/cuda_handler.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace fp8jax::host_cuda {

std::string RunSelfTest(const std::string& kind, int threads, int param);  // host_cuda_selftest.cc

// An op's CUDA handler body, Handle<CudaStream>, bound for XLA's CPU platform: no context, a null
// stream (the kernels run on the host and launch nothing on it).
template <auto kHandle>
struct WithoutStream;

template <typename... Params, ffi::Error (*kHandle)(CudaStream, Params...)>
struct WithoutStream<kHandle> {
  static ffi::Error Call(Params... params) {
    return kHandle(CudaStream(nullptr), std::move(params)...);
  }
};

}  // namespace fp8jax::host_cuda

// Fp8jax<Stem>HostCuda, for every op of the X-list.
#define FP8JAX_DEFINE_HOST_CUDA_HANDLER_(Stem, target)                                    \
  extern "C" XLA_FFI_Error* Fp8jax##Stem##HostCuda(XLA_FFI_CallFrame* call_frame) {       \
    static auto* handler =                                                                \
        ::xla::ffi::Ffi::BindTo(&::fp8jax::host_cuda::WithoutStream<                      \
                                    &::fp8jax::Stem::Handle<::fp8jax::CudaStream>>::Call) \
            .release();                                                                   \
    return handler->Call(call_frame);                                                     \
  }
FP8JAX_OPS(FP8JAX_DEFINE_HOST_CUDA_HANDLER_)
#undef FP8JAX_DEFINE_HOST_CUDA_HANDLER_

NB_MODULE(_fp8jax_host_cuda, m) {
  namespace hc = fp8jax::host_cuda;
  m.doc() = "fp8jax CUDA handlers and kernels run on the host (tests only)";
  // The real target name -> the host handler's capsule.
  m.def("registrations", []() {
#define FP8JAX_ENTRY_(Stem, target) {target, Fp8jax##Stem##HostCuda},
    return fp8jax::Registrations({FP8JAX_OPS(FP8JAX_ENTRY_)});
#undef FP8JAX_ENTRY_
  });
  m.def(
      "set_options",
      [](bool reverse, int sms, int blocks_per_sm, int device, bool banks) {
        if (sms < 1 || blocks_per_sm < 0 || device < 0) {
          throw nb::value_error("need sms >= 1, blocks_per_sm >= 0 and device >= 0");
        }
        hc::GetOptions() = hc::Options{reverse, sms, blocks_per_sm, device, banks};
      },
      nb::arg("reverse") = false, nb::arg("sms") = 2, nb::arg("blocks_per_sm") = 0,
      nb::arg("device") = 0, nb::arg("banks") = false,
      "The launches that follow: thread and block order, SMs, resident blocks per SM (0: 2048 / "
      "threads), the current device (the occupancy is cached per device), whether to count "
      "shared-memory wavefronts.");
  m.def("stats", []() {
    const hc::Stats& s = hc::GetStats();
    nb::dict d;
    d["launches"] = s.launches.load();
    d["blocks"] = s.blocks.load();
    d["threads"] = s.threads.load();
    d["barriers"] = s.barriers.load();
    d["warp_collectives"] = s.warp_collectives.load();
    d["shared_accesses"] = s.shared_accesses.load();
    d["shared_requests"] = s.shared_requests.load();
    d["shared_wavefronts"] = s.shared_wavefronts.load();
    d["shared_ideal"] = s.shared_ideal.load();
    return d;
  });
  m.def("reset_stats", []() { hc::ResetStats(); });
  m.def("_self_test", &hc::RunSelfTest, nb::arg("kind"), nb::arg("threads"), nb::arg("param") = 0,
        "Runs one of host_cuda_selftest.cc's kernels; returns the launch's error (\"\": none).");
}
