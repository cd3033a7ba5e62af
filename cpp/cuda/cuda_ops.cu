// The CUDA computations of quantize, dequantize (ops/casts.h) and update_fp8_state
// (ops/scaling.h); the cast_transpose family is in cuda_cast_transpose.cu and cuda_activation.cu,
// the device helpers they share in cuda_device.cuh.
//
// Same numerics as cpp/cpu/cpu_ops.cc. Every computation runs on XLA's stream, allocates nothing,
// never synchronises the host (so the handlers are CUDA-graph compatible, and say so with
// kCmdBufferCompatible), and reports launch failures as ffi::Error.
//
// Grids, tiles, the vector/scalar choice and edge guards come from
// common/launch_plan.h, which the CPU extension also compiles so that the
// tests check them on the host; the kernels here are thin loops over it.
//
// amax is accumulated as the unsigned bits of |x| with atomicMax: for
// non-negative floats the unsigned order is the numeric order and NaN sorts
// above inf, so the result is a NaN-propagating max, like jnp.max(abs(x)).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "common/launch_plan.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_util.h"
#include "ops/casts.h"
#include "ops/scaling.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// ---------------------------------------------------------------- quantize

// Each block walks its tiles (plan::WalkElementwise): per tile, each thread
// loads its kChunksPerThread chunks first (independent loads in flight), then
// converts and stores them; vector chunks use one or two 16-byte loads and one
// 8-byte store, the head and tail chunks of a group go element by element.
template <WideKind W, typename F>
__global__ void __launch_bounds__(plan::kThreads)
    QuantizeKernel(const void* __restrict__ x, const float* __restrict__ scale,
                   uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                   uint32_t* __restrict__ amax_bits, plan::ElementwiseArgs a) {
  WriteScaleInv(scale, scale_inv, a.groups);
  uint32_t m = 0;
  plan::WalkElementwise(
      a, blockIdx.x, gridDim.x, threadIdx.x,
      [&](int64_t g, int64_t base, const plan::ChunkElems* chunks) {
        const float sc = scale[g];
        float v[plan::kChunksPerThread][8];
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          LoadChunk<W>(x, base + chunks[k].first, chunks[k].count, chunks[k].vector, v[k]);
        }
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          const uint64_t packed = QuantizeEight<F>(v[k], sc, m);
          StoreCodes(q, base + chunks[k].first, chunks[k].count, chunks[k].vector, packed);
        }
      },
      [&](int64_t g) {
        FlushAmax(amax_bits, g, m);
        m = 0;
      });
}

}  // namespace

ffi::Error Quantize::Compute(CudaStream stream) {
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax->typed_data());
  FP8JAX_RETURN_IF_ERROR(MemsetAsync("quantize", amax_bits, s.groups * sizeof(uint32_t), stream));
  return DispatchWideFp8(
      "quantize", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        auto* qp = static_cast<uint8_t*>(q->untyped_data());
        plan::ElementwiseArgs a = ElementwiseArgsOf(s, x.untyped_data(), kWideBytes<W>, qp);
        return PlanAndLaunch("quantize", QuantizeKernel<W, F>, stream, ElementwisePlanner(a),
                             x.untyped_data(), scale.typed_data(), qp, scale_inv->typed_data(),
                             amax_bits, a);
      });
}

namespace {

// -------------------------------------------------------------- dequantize

template <WideKind W, typename F>
__global__ void __launch_bounds__(plan::kThreads)
    DequantizeKernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                     void* __restrict__ out, plan::ElementwiseArgs a) {
  plan::WalkElementwise(
      a, blockIdx.x, gridDim.x, threadIdx.x,
      [&](int64_t g, int64_t base, const plan::ChunkElems* chunks) {
        const float si = scale_inv[g];
        uint64_t packed[plan::kChunksPerThread];
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          packed[k] = LoadCodes(q, base + chunks[k].first, chunks[k].count, chunks[k].vector);
        }
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          float v[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            v[j] = DequantizeValue<F>(static_cast<uint8_t>(packed[k] >> (8 * j)), si);
          }
          StoreChunk<W>(out, base + chunks[k].first, chunks[k].count, chunks[k].vector, v);
        }
      },
      [](int64_t) {});
}

}  // namespace

ffi::Error Dequantize::Compute(CudaStream stream) {
  return DispatchWideFp8(
      "dequantize", WideKindOf(out->element_type()), Fp8KindOf(q.element_type()),
      [&]<WideKind W, typename F>() {
        const auto* qp = static_cast<const uint8_t*>(q.untyped_data());
        plan::ElementwiseArgs a = ElementwiseArgsOf(s, out->untyped_data(), kWideBytes<W>, qp);
        return PlanAndLaunch("dequantize", DequantizeKernel<W, F>, stream, ElementwisePlanner(a),
                             qp, scale_inv.typed_data(), out->untyped_data(), a);
      });
}

namespace {

// -------------------------------------------------------- update_fp8_state

// One block per state row: shift the history by one (newest at index 0),
// reduce it, and compute the new scale. All rows in one launch. A row whose
// observation is not finite is copied unchanged (RecordsObservation).
__global__ void __launch_bounds__(kThreads)
    UpdateFp8StateKernel(const float* __restrict__ history, const float* __restrict__ scale,
                         const float* __restrict__ amax, const float* __restrict__ fp8_max,
                         int64_t len, int algo, float margin_factor,
                         float* __restrict__ new_history, float* __restrict__ new_scale) {
  __shared__ float partial[kThreads];
  const int64_t r = blockIdx.x;
  const float a = amax[r];
  if (!RecordsObservation(a)) {  // the same for the whole block: it returns before any barrier
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      new_history[r * len + i] = history[r * len + i];
    }
    if (threadIdx.x == 0) new_scale[r] = scale[r];
    return;
  }
  float red = a;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float v = i == 0 ? a : history[r * len + i - 1];
    new_history[r * len + i] = v;
    if (algo == 0) red = NanMax(red, v);
  }
  partial[threadIdx.x] = red;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      partial[threadIdx.x] = NanMax(partial[threadIdx.x], partial[threadIdx.x + width]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    new_scale[r] = ComputeScale(partial[0], scale[r], fp8_max[r], margin_factor);
  }
}

}  // namespace

ffi::Error UpdateFp8State::Compute(CudaStream stream) {
  if (s.rows == 0) return ffi::Error::Success();
  if (s.rows > INT32_MAX) return BadArg("update_fp8_state", "too many state rows");
  const float margin_factor = std::ldexp(1.0f, -static_cast<int>(margin));
  return Launch("update_fp8_state", UpdateFp8StateKernel, s.rows, kThreads, stream,
                history.typed_data(), scale.typed_data(), amax.typed_data(), fp8_max.typed_data(),
                s.len, static_cast<int>(algo), margin_factor, new_history->typed_data(),
                new_scale->typed_data());
}

// Each computation above is command-buffer (CUDA graph) compatible: each call enqueues the same
// work for the same shapes (a memset and one kernel launch), with no allocation and no host
// synchronisation.

}  // namespace fp8jax
