// nanobind module `fp8jax._fp8jax_host_cuda`, built only for the tests (FP8JAX_TESTING=ON, where
// the CUDA toolkit's headers are found): every CUDA handler of cpp/cuda/ with its kernels,
// compiled by the host compiler on the runtime of host_cuda.h and bound for XLA's CPU platform.
// tests/ops/test_host_cuda.py registers them under "fp8jax_host_cuda_*" targets and runs the ops
// on them, so every __global__ body executes without a GPU.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "testing/host_cuda.h"
// The runtime first.
#include "common/op_table.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace fp8jax::host_cuda {
std::string RunSelfTest(const std::string& kind, int threads, int param);  // host_cuda_selftest.cc
}

#define FP8JAX_DECLARE_HOST_CUDA_HANDLER_(Stem, target) \
  XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jax##Stem##HostCuda);
FP8JAX_OPS(FP8JAX_DECLARE_HOST_CUDA_HANDLER_)
#undef FP8JAX_DECLARE_HOST_CUDA_HANDLER_

NB_MODULE(_fp8jax_host_cuda, m) {
  namespace hc = fp8jax::host_cuda;
  m.doc() = "fp8jax CUDA handlers and kernels run on the host (tests only)";
  // The real target name -> the host handler's capsule.
  m.def("registrations", []() {
    nb::dict d;
#define FP8JAX_REGISTER_(Stem, target) \
  d[target] = nb::capsule(reinterpret_cast<void*>(Fp8jax##Stem##HostCuda));
    FP8JAX_OPS(FP8JAX_REGISTER_)
#undef FP8JAX_REGISTER_
    return d;
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
