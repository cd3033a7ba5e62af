// nanobind module `fp8jax._fp8jax_host_cuda`, built only for the tests (FP8JAX_TESTING=ON, where
// the CUDA toolkit's headers are found): every op's CUDA handler with the computations and kernels
// of cpp/cuda/, compiled by the host compiler on the runtime of host_cuda.h and bound for XLA's
// CPU platform (Fp8jax<Stem>HostCuda).
// tests/ops/test_host_cuda.py registers them under "fp8jax_host_cuda_*" targets and runs the ops
// on them, so every __global__ body executes without a GPU.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>

#include "testing/host_cuda.h"
// The runtime first.
#include "common/grouped_gemm.h"
#include "common/grouped_tc.h"
#include "common/op_table.h"
#include "common/registrations.h"
#include "cuda/cuda_grouped_tc_prep.h"
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
  // The tensor-core grouped GEMM's preparation kernels (cuda/cuda_grouped_tc_prep.cu) run on the
  // host: for group sizes and scales, each group's problem, operand and output offsets (in
  // elements, from the pointers the kernel wrote), alpha, whether its alpha pointer is its own,
  // and (block scales: b_grid_rows > 0, the scales as the grids) its scale offsets, else -1; and
  // which output bytes it zeroed (the output starts as 0xFF bytes).
  m.def(
      "grouped_tc_prepare",
      [](nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig> sizes,
         nb::ndarray<const float, nb::ndim<1>, nb::c_contig> a_scale_inv,
         nb::ndarray<const float, nb::ndim<1>, nb::c_contig> b_scale_inv, int64_t form,
         int64_t rows, int64_t cols, int64_t depth, int64_t width, int64_t out_bytes,
         int64_t b_grid_rows, int64_t b_grid_cols) {
        namespace gt = fp8jax::grouped_tc;
        const int64_t groups = static_cast<int64_t>(sizes.shape(0));
        fp8jax::grouped::Gemm p;
        p.form = form;
        p.groups = groups;
        p.rows = rows;
        p.cols = cols;
        p.depth = depth;
        p.ragged = form == fp8jax::grouped::kRows ? rows : depth;
        p.blocks = b_grid_rows > 0;  // block scales: their pointers too
        p.b_grid_rows = b_grid_rows;
        p.b_grid_cols = b_grid_cols;
        std::vector<int32_t> problems(3 * groups);
        std::vector<const void*> a_ptrs(groups), b_ptrs(groups);
        std::vector<void*> out_ptrs(groups);
        std::vector<float> alpha(groups);
        std::vector<const float*> alpha_ptrs(groups), sfa_ptrs(groups), sfb_ptrs(groups);
        std::vector<uint8_t> out(p.OutputSize() * out_bytes, 0xFF);
        // a and b are only offset, never read: any base will do
        static const uint8_t base_a = 0, base_b = 0;
        gt::PrepArgs args;
        args.p = p;
        args.width = width;
        args.a = &base_a;
        args.b = &base_b;
        args.out = out.data();
        args.out_bytes = out_bytes;
        args.problems = problems.data();
        args.a_ptrs = a_ptrs.data();
        args.b_ptrs = b_ptrs.data();
        args.out_ptrs = out_ptrs.data();
        args.alpha = alpha.data();
        args.alpha_ptrs = alpha_ptrs.data();
        // the scale grids are only offset, never read, by the preparation
        args.sfa = a_scale_inv.data();
        args.sfb = b_scale_inv.data();
        args.sfa_ptrs = sfa_ptrs.data();
        args.sfb_ptrs = sfb_ptrs.data();
        const ::xla::ffi::Error err = gt::Prepare("grouped_tc_prepare", nullptr, args, sizes.data(),
                                                  a_scale_inv.data(), b_scale_inv.data());
        if (!err.success()) throw nb::value_error(std::string(err.message()).c_str());
        nb::list per_group;
        for (int64_t g = 0; g < groups; ++g) {
          const auto* o = static_cast<const uint8_t*>(out_ptrs[g]);
          per_group.append(nb::make_tuple(problems[3 * g], problems[3 * g + 1], problems[3 * g + 2],
                                          static_cast<const uint8_t*>(a_ptrs[g]) - &base_a,
                                          static_cast<const uint8_t*>(b_ptrs[g]) - &base_b,
                                          (o - out.data()) / out_bytes, alpha[g],
                                          alpha_ptrs[g] == alpha.data() + g,
                                          p.blocks ? sfa_ptrs[g] - a_scale_inv.data() : -1,
                                          p.blocks ? sfb_ptrs[g] - b_scale_inv.data() : -1));
        }
        std::vector<int64_t> zeroed;
        for (size_t i = 0; i < out.size(); ++i) {
          if (out[i] == 0) zeroed.push_back(static_cast<int64_t>(i));
        }
        return nb::make_tuple(per_group, zeroed);
      },
      nb::arg("sizes"), nb::arg("a_scale_inv"), nb::arg("b_scale_inv"), nb::arg("form"),
      nb::arg("rows"), nb::arg("cols"), nb::arg("depth"), nb::arg("width"), nb::arg("out_bytes"),
      nb::arg("b_grid_rows") = 0, nb::arg("b_grid_cols") = 0);
  m.def("grouped_tc_workspace", [](int64_t groups) {
    const auto w = fp8jax::grouped_tc::WorkspaceOf(groups);
    nb::dict d;
    d["problems"] = w.problems;
    d["a"] = w.a;
    d["b"] = w.b;
    d["out"] = w.out;
    d["alpha"] = w.alpha;
    d["alpha_ptrs"] = w.alpha_ptrs;
    d["stride_a"] = w.stride_a;
    d["stride_b"] = w.stride_b;
    d["stride_out"] = w.stride_out;
    d["sfa"] = w.sfa;
    d["sfb"] = w.sfb;
    d["layout_sfa"] = w.layout_sfa;
    d["layout_sfb"] = w.layout_sfb;
    d["cutlass"] = w.cutlass;
    d["bytes"] = w.bytes;
    return d;
  });
  m.def("_self_test", &hc::RunSelfTest, nb::arg("kind"), nb::arg("threads"), nb::arg("param") = 0,
        "Runs one of host_cuda_selftest.cc's kernels; returns the launch's error (\"\": none).");
}
