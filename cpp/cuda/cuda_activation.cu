// The CUDA computations of the activations (ops/activations.h): activation, dactivation,
// activation_cast_transpose and dactivation_cast_transpose_dbias.
//
// The math is common/activations.h (the CPU kernels' too). The fused forms
// are the cast_transpose kernel of cuda_cast_transpose.cuh with an activation
// prologue (ActSource, DActSource): each value is computed from x (and g),
// rounded to the wide dtype exactly as the activation ops store it, then
// quantized, transposed and (for dbias) summed, so x and g are read once and
// q is bit-identical to quantize(activation(x)). The prologue loads element
// by element (its inputs are not laid out like the quantized matrix).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/activations.h"
#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/launch_plan.h"
#include "common/wide.h"
#include "cuda/cuda_cast_transpose.cuh"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_util.h"
#include "ops/activations.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// y[row][c] = act(a) (* b) for x[row][k][n], rows of every matrix consecutive. Each thread
// takes 8-element chunks of a row (plan::RowChunkAt): one 16-byte access per operand and chunk
// when `vector` (n % 8 == 0 and every buffer 16-byte aligned, block-uniform), else element by
// element.
template <WideKind W, int A, bool G>
__global__ void __launch_bounds__(plan::kThreads, 1)
    ActivationKernel(const void* __restrict__ x, void* __restrict__ y, int64_t rows, int64_t n,
                     bool vector) {
  const int64_t chunks = plan::RowChunks(rows, n);
  for (int64_t ch = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; ch < chunks;
       ch += int64_t{gridDim.x} * blockDim.x) {
    const plan::RowChunk c = plan::RowChunkAt(ch, n);
    const int64_t a0 = c.row * (G ? 2 : 1) * n + c.col;
    float a[8], b[8], out[8];
    LoadChunk<W>(x, a0, c.count, vector, a);
    if constexpr (G) LoadChunk<W>(x, a0 + n, c.count, vector, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = act::Forward<A, G>(a[j], G ? b[j] : 1.0f);
    StoreChunk<W>(y, c.row * n + c.col, c.count, vector, out);
  }
}

// dx[row][0][c] = g * act'(a) (* b), dx[row][1][c] = g * act(a) (gated); chunks as above.
template <WideKind W, int A, bool G>
__global__ void __launch_bounds__(plan::kThreads, 1)
    DActivationKernel(const void* __restrict__ g, const void* __restrict__ x, void* __restrict__ dx,
                      int64_t rows, int64_t n, bool vector) {
  const int64_t chunks = plan::RowChunks(rows, n);
  for (int64_t ch = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; ch < chunks;
       ch += int64_t{gridDim.x} * blockDim.x) {
    const plan::RowChunk c = plan::RowChunkAt(ch, n);
    const int64_t a0 = c.row * (G ? 2 : 1) * n + c.col;
    float gv[8], a[8], b[8], da[8], db[8];
    LoadChunk<W>(g, c.row * n + c.col, c.count, vector, gv);
    LoadChunk<W>(x, a0, c.count, vector, a);
    if constexpr (G) LoadChunk<W>(x, a0 + n, c.count, vector, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      da[j] = db[j] = 0.0f;
      act::Backward<A, G>(gv[j], a[j], G ? b[j] : 1.0f, &da[j], &db[j]);
    }
    StoreChunk<W>(dx, a0, c.count, vector, da);
    if constexpr (G) StoreChunk<W>(dx, a0 + n, c.count, vector, db);
  }
}

// Prologue of activation_cast_transpose: element i of the [rows, n] matrix
// y (rows of every matrix consecutive) from x[rows, k, n].
template <WideKind W, int A, bool G>
struct ActSource {
  static constexpr bool kFast = false;
  const void* x;
  int64_t n;
  __device__ __forceinline__ void Chunk(int64_t i, int count, bool, float v[8]) const {
    const int64_t row = i / n;
    const int64_t a0 = row * (G ? 2 : 1) * n + (i - row * n);  // a chunk stays in its row
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < count) {
        const float a = LoadWide<W, FastHalf>(x, a0 + j);
        const float b = G ? LoadWide<W, FastHalf>(x, a0 + n + j) : 1.0f;
        v[j] = RoundWide<W, FastHalf>(act::Forward<A, G>(a, b));
      } else {
        v[j] = 0.0f;
      }
    }
  }
};

// Prologue of dactivation_cast_transpose_dbias: element i of the [rows, k * n]
// matrix dx from g[rows, n] and x[rows, k, n].
template <WideKind W, int A, bool G>
struct DActSource {
  static constexpr bool kFast = false;
  const void* g;
  const void* x;
  int64_t n;
  __device__ __forceinline__ void Chunk(int64_t i, int count, bool, float v[8]) const {
    const int64_t kn = (G ? 2 : 1) * n;
    const int64_t row = i / kn;
    const int64_t cc = i - row * kn;  // a chunk stays in its row, may cross from a to b
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < count) {
        const bool second = G && cc + j >= n;
        const int64_t c = second ? cc + j - n : cc + j;
        const float gv = LoadWide<W, FastHalf>(g, row * n + c);
        const float a = LoadWide<W, FastHalf>(x, row * kn + c);
        const float b = G ? LoadWide<W, FastHalf>(x, row * kn + n + c) : 1.0f;
        float da = 0.0f;
        float db = 0.0f;
        act::Backward<A, G>(gv, a, b, &da, &db);
        v[j] = RoundWide<W, FastHalf>(second ? db : da);
      } else {
        v[j] = 0.0f;
      }
    }
  }
};

// Calls fn.template operator()<W, F, A, G>() for the runtime kinds ((act, gated) checked by the
// op).
template <typename Fn>
ffi::Error DispatchFused(const char* op, WideKind w, Fp8Kind f, int64_t code, int64_t gated,
                         Fn&& fn) {
  return act::Dispatch(code, gated, [&]<int A, bool G>() {
    return DispatchWideFp8(
        op, w, f, [&]<WideKind W, typename F>() { return fn.template operator()<W, F, A, G>(); });
  });
}

// Enqueues the activation (forward, or its gradient when g != nullptr) of
// `rows` rows of n columns into out ((act, gated) checked by the op).
ffi::Error LaunchAct(const char* op, cudaStream_t stream, WideKind w, int64_t code, int64_t gated,
                     const void* g, const void* x, void* out, int64_t rows, int64_t n) {
  const int64_t chunks = plan::RowChunks(rows, n);
  if (chunks == 0) return ffi::Error::Success();
  const bool vector = n % plan::kVec == 0 && Addr(x) % 16 == 0 && Addr(out) % 16 == 0 &&
                      (g == nullptr || Addr(g) % 16 == 0);
  return act::Dispatch(code, gated, [&]<int A, bool G>() -> ffi::Error {
    auto launch = [&]<WideKind W>() {
      auto grid = [chunks](int64_t resident) { return plan::GridFor(chunks, resident); };
      if (g == nullptr) {
        return PlanAndLaunch(op, ActivationKernel<W, A, G>, stream, grid, x, out, rows, n, vector);
      }
      return PlanAndLaunch(op, DActivationKernel<W, A, G>, stream, grid, g, x, out, rows, n,
                           vector);
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

}  // namespace

ffi::Error Activation::Compute(CudaStream stream) {
  return LaunchAct(kName, stream, WideKindOf(x.element_type()), code, gated, nullptr,
                   x.untyped_data(), y->untyped_data(), s.matrices * s.rows, s.cols);
}

ffi::Error DActivation::Compute(CudaStream stream) {
  return LaunchAct(kName, stream, WideKindOf(x.element_type()), code, gated, g.untyped_data(),
                   x.untyped_data(), dx->untyped_data(), s.matrices * s.rows, s.cols);
}

ffi::Error ActivationCastTranspose::Compute(CudaStream stream) {
  return DispatchFused(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()), code,
                       gated, [&]<WideKind W, typename F, int A, bool G>() {
                         const ActSource<W, A, G> src{x.untyped_data(), s.cols};
                         return LaunchCastTransposeOf<W, F, false>(
                             kName, stream, src, 0, s, scale.typed_data(), q->untyped_data(),
                             qt->untyped_data(), scale_inv->typed_data(), amax->typed_data(),
                             nullptr);
                       });
}

ffi::Error DActivationCastTransposeDbias::Compute(CudaStream stream) {
  float* partial = workspace->typed_data();
  if (auto err = DispatchFused(
          kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()), code, gated,
          [&]<WideKind W, typename F, int A, bool G>() {
            const DActSource<W, A, G> src{g.untyped_data(), x.untyped_data(), xs.cols};
            return LaunchCastTransposeOf<W, F, true>(
                kName, stream, src, 0, qs, scale.typed_data(), q->untyped_data(),
                qt->untyped_data(), scale_inv->typed_data(), amax->typed_data(), partial);
          });
      !err.success()) {
    return err;
  }
  return LaunchColumnTotals(kName, stream, partial, qs, dbias->typed_data());
}

// Every computation allocates nothing (dbias's workspace is a buffer XLA
// allocates): command-buffer compatible.

}  // namespace fp8jax
