// CUDA FFI handlers of fp8jax.ops.activation: activation, dactivation,
// activation_cast_transpose and dactivation_cast_transpose_dbias.
//
// The math is common/activations.h (the CPU kernels' too). The fused forms
// are, on CUDA, two steps for now: the activation (or its gradient) is
// written, rounded to the wide dtype, to a workspace from XLA's scratch
// allocator, then the cast_transpose kernel (and, for dbias, the
// deterministic column sums) of cuda_cast_transpose.cu run on it. So q is
// bit-identical to quantize(activation(x)) by construction; a prologue inside
// the cast_transpose tile loop, which saves the workspace round trip, is the
// next step (docs/performance.md). Handlers that allocate scratch are not
// declared command-buffer compatible.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/activations.h"
#include "common/ffi_checks.h"
#include "common/launch_plan.h"
#include "cuda/cuda_cast_transpose.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_util.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// y[row][c] = act(a) (* b) for x[row][k][n], rows of every matrix consecutive.
template <WideKind W, int A, bool G>
__global__ void __launch_bounds__(plan::kThreads)
    ActivationKernel(const void* __restrict__ x, void* __restrict__ y, int64_t rows, int64_t n) {
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / n;
    const int64_t c = i % n;
    const int64_t a0 = row * (G ? 2 : 1) * n + c;
    const float a = LoadOne<W>(x, a0);
    const float b = G ? LoadOne<W>(x, a0 + n) : 1.0f;
    StoreOne<W>(y, i, act::Forward<A, G>(a, b));
  }
}

// dx[row][0][c] = g * act'(a) (* b), dx[row][1][c] = g * act(a) (gated).
template <WideKind W, int A, bool G>
__global__ void __launch_bounds__(plan::kThreads)
    DActivationKernel(const void* __restrict__ g, const void* __restrict__ x, void* __restrict__ dx,
                      int64_t rows, int64_t n) {
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / n;
    const int64_t c = i % n;
    const int64_t a0 = row * (G ? 2 : 1) * n + c;
    const float gv = LoadOne<W>(g, i);
    const float a = LoadOne<W>(x, a0);
    const float b = G ? LoadOne<W>(x, a0 + n) : 1.0f;
    float da = 0.0f;
    float db = 0.0f;
    act::Backward<A, G>(gv, a, b, &da, &db);
    StoreOne<W>(dx, a0, da);
    if constexpr (G) StoreOne<W>(dx, a0 + n, db);
  }
}

// Enqueues the activation (forward, or its gradient when g != nullptr) of
// `rows` rows of n columns into out.
ffi::Error LaunchAct(const char* op, cudaStream_t stream, WideKind w, int64_t code, int64_t gated,
                     const void* g, const void* x, void* out, int64_t rows, int64_t n) {
  if (!act::Valid(code, gated)) return BadArg(op, "unknown activation (act, gated) attributes");
  const int64_t total = rows * n;
  if (total == 0) return ffi::Error::Success();
  return act::Dispatch(code, gated, [&]<int A, bool G>() -> ffi::Error {
    auto launch = [&]<WideKind W>() {
      auto grid = [total](int64_t resident) { return plan::GridFor(total, resident); };
      if (g == nullptr) {
        return PlanAndLaunch(op, ActivationKernel<W, A, G>, stream, grid, x, out, rows, n);
      }
      return PlanAndLaunch(op, DActivationKernel<W, A, G>, stream, grid, g, x, out, rows, n);
    };
    switch (w) {
      case WideKind::kF32:
        return launch.template operator()<WideKind::kF32>();
      case WideKind::kBF16:
        return launch.template operator()<WideKind::kBF16>();
      case WideKind::kF16:
        return launch.template operator()<WideKind::kF16>();
      default:
        return BadArg(op, "x must be float32, bfloat16 or float16");
    }
  });
}

ffi::Error CheckGradInputs(const char* op, ffi::AnyBuffer g, ffi::AnyBuffer x,
                           const MatrixShape& s) {
  if (g.element_type() != x.element_type()) return BadArg(op, "g and x must share a dtype");
  if (g.element_count() != s.matrices * s.rows * s.cols) {
    return BadArg(op, "g must have shape [m, n] of x's [m, k, n]");
  }
  return ffi::Error::Success();
}

ffi::Error Scratch(const char* op, ffi::ScratchAllocator& scratch, int64_t bytes, void** out) {
  *out = nullptr;
  if (bytes == 0) return ffi::Error::Success();
  auto mem = scratch.Allocate(static_cast<size_t>(bytes), 256);
  if (!mem.has_value()) {
    return ffi::Error::Internal(std::string("fp8jax ") + op + ": scratch allocation failed");
  }
  *out = *mem;
  return ffi::Error::Success();
}

int64_t WideBytes(WideKind w) { return w == WideKind::kF32 ? 4 : 2; }

ffi::Error ActivationImpl(cudaStream_t stream, ffi::AnyBuffer x, int64_t code, int64_t gated,
                          ffi::Result<ffi::AnyBuffer> y) {
  const char* op = "activation";
  MatrixShape s;
  if (auto err = ActShapeOf(op, x.dimensions(), gated != 0, 1, &s); !err.success()) return err;
  if (y->element_type() != x.element_type() || y->element_count() != s.matrices * s.rows * s.cols) {
    return BadArg(op, "y must be [m, n] of x's [m, k, n], in x's dtype");
  }
  return LaunchAct(op, stream, WideKindOf(x.element_type()), code, gated, nullptr, x.untyped_data(),
                   y->untyped_data(), s.matrices * s.rows, s.cols);
}

ffi::Error DActivationImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer x, int64_t code,
                           int64_t gated, ffi::Result<ffi::AnyBuffer> dx) {
  const char* op = "dactivation";
  MatrixShape s;
  if (auto err = ActShapeOf(op, x.dimensions(), gated != 0, 1, &s); !err.success()) return err;
  if (auto err = CheckGradInputs(op, g, x, s); !err.success()) return err;
  if (dx->element_type() != g.element_type() || dx->element_count() != x.element_count()) {
    return BadArg(op, "dx must have x's shape and g's dtype");
  }
  return LaunchAct(op, stream, WideKindOf(x.element_type()), code, gated, g.untyped_data(),
                   x.untyped_data(), dx->untyped_data(), s.matrices * s.rows, s.cols);
}

ffi::Error ActivationCastTransposeImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                       ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, int64_t code,
                                       int64_t gated, ffi::Result<ffi::AnyBuffer> q,
                                       ffi::Result<ffi::AnyBuffer> qt,
                                       ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                                       ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  const char* op = "activation_cast_transpose";
  MatrixShape s;
  if (auto err = ActShapeOf(op, x.dimensions(), gated != 0, scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  const int64_t count = s.matrices * s.rows * s.cols;
  if (q->element_type() != qt->element_type() || q->element_count() != count ||
      qt->element_count() != count) {
    return BadArg(op, "q and q_t must be [m, n] of x's [m, k, n] and share an FP8 dtype");
  }
  const WideKind w = WideKindOf(x.element_type());
  void* y = nullptr;
  if (auto err = Scratch(op, scratch, count * WideBytes(w), &y); !err.success()) return err;
  if (auto err = LaunchAct(op, stream, w, code, gated, nullptr, x.untyped_data(), y,
                           s.matrices * s.rows, s.cols);
      !err.success()) {
    return err;
  }
  return LaunchCastTranspose(op, stream, y, w, s, scale.typed_data(), q->untyped_data(),
                             qt->untyped_data(), Fp8KindOf(q->element_type()),
                             scale_inv->typed_data(), amax->typed_data());
}

ffi::Error DActivationCastTransposeDbiasImpl(
    cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::AnyBuffer g, ffi::AnyBuffer x,
    ffi::Buffer<ffi::F32> scale, int64_t code, int64_t gated, ffi::Result<ffi::AnyBuffer> q,
    ffi::Result<ffi::AnyBuffer> qt, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
    ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> dbias) {
  const char* op = "dactivation_cast_transpose_dbias";
  MatrixShape xs;
  if (auto err = ActShapeOf(op, x.dimensions(), gated != 0, scale.element_count(), &xs);
      !err.success()) {
    return err;
  }
  if (auto err = CheckGradInputs(op, g, x, xs); !err.success()) return err;
  if (q->element_type() != qt->element_type() || q->element_count() != x.element_count() ||
      qt->element_count() != x.element_count()) {
    return BadArg(op, "q and q_t must have x's size and share an FP8 dtype");
  }
  MatrixShape s = xs;  // the quantized matrix: [m, k * n]
  s.cols = (gated != 0 ? 2 : 1) * xs.cols;
  if (dbias->element_count() != s.matrices * s.cols) {
    return BadArg(op, "dbias must have shape [k, n]");
  }
  const WideKind w = WideKindOf(x.element_type());
  void* dx = nullptr;
  if (auto err = Scratch(op, scratch, x.element_count() * WideBytes(w), &dx); !err.success()) {
    return err;
  }
  if (auto err = LaunchAct(op, stream, w, code, gated, g.untyped_data(), x.untyped_data(), dx,
                           xs.matrices * xs.rows, xs.cols);
      !err.success()) {
    return err;
  }
  if (auto err = LaunchCastTranspose(op, stream, dx, w, s, scale.typed_data(), q->untyped_data(),
                                     qt->untyped_data(), Fp8KindOf(q->element_type()),
                                     scale_inv->typed_data(), amax->typed_data());
      !err.success()) {
    return err;
  }
  return LaunchColumnSums(op, stream, scratch, dx, w, s, dbias->typed_data());
}

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

// activation and dactivation allocate nothing: command-buffer compatible.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxActivationCuda, fp8jax::ActivationImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("act")
                                  .Attr<int64_t>("gated")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxDActivationCuda, fp8jax::DActivationImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("act")
                                  .Attr<int64_t>("gated")
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxActivationCastTransposeCuda,
                              fp8jax::ActivationCastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("act")
                                  .Attr<int64_t>("gated")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxDActivationCastTransposeDbiasCuda,
                              fp8jax::DActivationCastTransposeDbiasImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("act")
                                  .Attr<int64_t>("gated")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
