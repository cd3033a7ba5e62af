// CUDA FFI handlers: quantize, dequantize, cast_transpose, update_fp8_state.
//
// Same target names and numerics as cpp/cpu/cpu_ops.cc. Every handler takes
// XLA's stream from PlatformStream<cudaStream_t>, allocates nothing, never
// synchronises the host (so it is CUDA-graph compatible), and reports launch
// failures as ffi::Error.
//
// amax is accumulated as the unsigned bits of |x| with atomicMax: for
// non-negative floats the unsigned order is the numeric order and NaN sorts
// above inf, so the result is a NaN-propagating max, like jnp.max(abs(x)).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridY = 65535;

// ------------------------------------------------------------ conversions

// The element conversions (CvtFp8(x, scale): the FP8 code of x * scale;
// F16BitsToFloatFast; FloatToF16BitsFast; DequantizeValue) are the
// __host__ __device__ helpers of common/fp8_device_convert.h and
// common/fp8_numerics.h, tested on the host against the CPU numerics
// (tests/cpp). CvtFp8 takes x and scale apart because the GPU's multiply
// drops a NaN's sign.

template <WideKind W>
__device__ __forceinline__ float LoadOne(const void* p, int64_t i) {
  if constexpr (W == WideKind::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (W == WideKind::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  } else {
    return F16BitsToFloatFast(static_cast<const uint16_t*>(p)[i]);
  }
}

// Loads 8 consecutive elements starting at i (16-byte aligned for 2-byte
// types, 32-byte aligned for float32).
template <WideKind W>
__device__ __forceinline__ void LoadEight(const void* p, int64_t i, float v[8]) {
  if constexpr (W == WideKind::kF32) {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = src[0];
    const float4 b = src[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (W == WideKind::kBF16) {
        v[2 * k] = __uint_as_float(words[k] << 16);
        v[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
      } else {
        v[2 * k] = F16BitsToFloatFast(static_cast<uint16_t>(words[k] & 0xFFFFu));
        v[2 * k + 1] = F16BitsToFloatFast(static_cast<uint16_t>(words[k] >> 16));
      }
    }
  }
}

template <WideKind W>
__device__ __forceinline__ uint16_t WideBits(float v) {
  if constexpr (W == WideKind::kBF16) {
    return FloatToBf16Bits(v);
  } else {
    return FloatToF16BitsFast(v);
  }
}

template <WideKind W>
__device__ __forceinline__ void StoreOne(void* p, int64_t i, float v) {
  if constexpr (W == WideKind::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = WideBits<W>(v);
  }
}

template <WideKind W>
__device__ __forceinline__ void StoreEight(void* p, int64_t i, const float v[8]) {
  if constexpr (W == WideKind::kF32) {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = static_cast<uint32_t>(WideBits<W>(v[2 * k])) |
             (static_cast<uint32_t>(WideBits<W>(v[2 * k + 1])) << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Quantizes 8 values; returns them packed little-endian, updates amax bits.
template <typename F>
__device__ __forceinline__ uint64_t QuantizeEight(const float v[8], float scale, uint32_t& amax) {
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    amax = max(amax, AbsBits(v[j]));
    packed |= static_cast<uint64_t>(CvtFp8<F>(v[j], scale)) << (8 * j);
  }
  return packed;
}

// Max of an unsigned value over the block; the result is valid in thread 0.
__device__ __forceinline__ uint32_t BlockMaxU32(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  uint32_t r = 0;
  if (warp == 0) {
    r = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0u;
    r = __reduce_max_sync(0xFFFFFFFFu, r);
  }
  __syncthreads();  // warp_max may be reused by a following call
  return r;
}

bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

int SmCount() {
  static int cache[128] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 128) return 132;
  if (cache[dev] == 0) {
    int n = 0;
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    cache[dev] = n > 0 ? n : 132;
  }
  return cache[dev];
}

int64_t BlocksFor(int64_t work, int64_t groups) {
  const int64_t want = (work + kThreads - 1) / kThreads;
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(SmCount()) * 8 / groups);
  return std::max<int64_t>(1, std::min(want, cap));
}

ffi::Error LastError(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("fp8jax ") + op + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------- quantize

template <WideKind W, typename F, bool kVec>
__global__ void __launch_bounds__(kThreads)
    QuantizeKernel(const void* __restrict__ x, const float* __restrict__ scale,
                   uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                   uint32_t* __restrict__ amax_bits, int64_t per_group) {
  const int64_t g = blockIdx.y;
  const float sc = scale[g];
  const int64_t base = g * per_group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  uint32_t m = 0;
  if constexpr (kVec) {
    const int64_t chunks = per_group / 8;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
         c += stride) {
      float v[8];
      LoadEight<W>(x, base + c * 8, v);
      *reinterpret_cast<uint64_t*>(q + base + c * 8) = QuantizeEight<F>(v, sc, m);
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per_group;
         i += stride) {
      const float v = LoadOne<W>(x, base + i);
      m = max(m, AbsBits(v));
      q[base + i] = CvtFp8<F>(v, sc);
    }
  }
  m = BlockMaxU32(m);
  if (threadIdx.x == 0) {
    atomicMax(amax_bits + g, m);
    if (blockIdx.x == 0) scale_inv[g] = 1.0f / sc;
  }
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  GroupShape s;
  if (auto err = GroupShapeOf("quantize", x.element_count(), scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (s.groups > kMaxGridY) return BadArg("quantize", "too many scales (vmapped groups)");
  if (q->element_count() != x.element_count()) return BadArg("quantize", "output size mismatch");
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax->typed_data());
  if (cudaMemsetAsync(amax_bits, 0, s.groups * sizeof(uint32_t), stream) != cudaSuccess) {
    return LastError("quantize");
  }
  const bool vec = s.per_group % 8 == 0 && Aligned(x.untyped_data(), 32) &&
                   Aligned(q->untyped_data(), 8);
  return DispatchWideFp8(
      "quantize", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        const int64_t work = vec ? s.per_group / 8 : s.per_group;
        const dim3 grid(static_cast<unsigned>(BlocksFor(work, s.groups)),
                        static_cast<unsigned>(s.groups));
        auto* qp = static_cast<uint8_t*>(q->untyped_data());
        if (vec) {
          QuantizeKernel<W, F, true><<<grid, kThreads, 0, stream>>>(
              x.untyped_data(), scale.typed_data(), qp, scale_inv->typed_data(), amax_bits,
              s.per_group);
        } else {
          QuantizeKernel<W, F, false><<<grid, kThreads, 0, stream>>>(
              x.untyped_data(), scale.typed_data(), qp, scale_inv->typed_data(), amax_bits,
              s.per_group);
        }
        return LastError("quantize");
      });
}

// -------------------------------------------------------------- dequantize

template <WideKind W, typename F, bool kVec>
__global__ void __launch_bounds__(kThreads)
    DequantizeKernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                     void* __restrict__ out, int64_t per_group) {
  const int64_t g = blockIdx.y;
  const float si = scale_inv[g];
  const int64_t base = g * per_group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (kVec) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
         c < per_group / 8; c += stride) {
      const uint64_t packed = *reinterpret_cast<const uint64_t*>(q + base + c * 8);
      float v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        v[j] = DequantizeValue<F>(static_cast<uint8_t>(packed >> (8 * j)), si);
      }
      StoreEight<W>(out, base + c * 8, v);
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < per_group;
         i += stride) {
      StoreOne<W>(out, base + i, DequantizeValue<F>(q[base + i], si));
    }
  }
}

ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer q,
                          ffi::Buffer<ffi::F32> scale_inv, ffi::Result<ffi::AnyBuffer> out) {
  GroupShape s;
  if (auto err = GroupShapeOf("dequantize", q.element_count(), scale_inv.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (s.groups > kMaxGridY) return BadArg("dequantize", "too many scales (vmapped groups)");
  if (out->element_count() != q.element_count()) {
    return BadArg("dequantize", "output size mismatch");
  }
  const bool vec = s.per_group % 8 == 0 && Aligned(q.untyped_data(), 8) &&
                   Aligned(out->untyped_data(), 32);
  return DispatchWideFp8(
      "dequantize", WideKindOf(out->element_type()), Fp8KindOf(q.element_type()),
      [&]<WideKind W, typename F>() {
        const int64_t work = vec ? s.per_group / 8 : s.per_group;
        const dim3 grid(static_cast<unsigned>(BlocksFor(work, s.groups)),
                        static_cast<unsigned>(s.groups));
        const auto* qp = static_cast<const uint8_t*>(q.untyped_data());
        if (vec) {
          DequantizeKernel<W, F, true><<<grid, kThreads, 0, stream>>>(
              qp, scale_inv.typed_data(), out->untyped_data(), s.per_group);
        } else {
          DequantizeKernel<W, F, false><<<grid, kThreads, 0, stream>>>(
              qp, scale_inv.typed_data(), out->untyped_data(), s.per_group);
        }
        return LastError("dequantize");
      });
}

// ---------------------------------------------------------- cast_transpose

// Fast path: rows and cols multiples of 8. A 64x64 tile per block; each
// thread loads 8 consecutive inputs, writes 8 FP8 codes of q directly and
// stages them in shared memory, then writes 8 consecutive codes of q_t.
constexpr int kTile = 64;

template <WideKind W, typename F>
__global__ void __launch_bounds__(kThreads)
    CastTransposeVecKernel(const void* __restrict__ x, const float* __restrict__ scale,
                           uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                           float* __restrict__ scale_inv, uint32_t* __restrict__ amax_bits,
                           int64_t rows, int64_t cols, int64_t mats_per_group, int64_t matrices) {
  __shared__ alignas(8) uint8_t tile[kTile][kTile + 8];
  const int t = threadIdx.x;
  const int chunk = t % 8;
  const int lane_row = t / 8;  // 0..31
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t mat = blockIdx.z; mat < matrices; mat += gridDim.z) {
    const int64_t g = mat / mats_per_group;
    const float sc = scale[g];
    const int64_t mat_base = mat * rows * cols;
    uint32_t m = 0;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int lr = lane_row + 32 * p;
      const int64_t gr = row0 + lr;
      const int64_t gc = col0 + chunk * 8;
      if (gr < rows && gc < cols) {
        float v[8];
        LoadEight<W>(x, mat_base + gr * cols + gc, v);
        const uint64_t packed = QuantizeEight<F>(v, sc, m);
        *reinterpret_cast<uint64_t*>(q + mat_base + gr * cols + gc) = packed;
        *reinterpret_cast<uint64_t*>(&tile[lr][chunk * 8]) = packed;
      }
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const int lc = lane_row + 32 * p;
      const int64_t gc = col0 + lc;
      const int64_t gr = row0 + chunk * 8;
      if (gc < cols && gr < rows) {
        uint64_t packed = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          packed |= static_cast<uint64_t>(tile[chunk * 8 + j][lc]) << (8 * j);
        }
        *reinterpret_cast<uint64_t*>(qt + mat_base + gc * rows + gr) = packed;
      }
    }
    m = BlockMaxU32(m);  // also separates this tile's reads from the next writes
    if (t == 0) {
      atomicMax(amax_bits + g, m);
      if (blockIdx.x == 0 && blockIdx.y == 0 && mat % mats_per_group == 0) {
        scale_inv[g] = 1.0f / sc;
      }
    }
  }
}

// General path: any rows/cols. A 32x32 tile, one element per thread step.
constexpr int kSmallTile = 32;

template <WideKind W, typename F>
__global__ void __launch_bounds__(kThreads)
    CastTransposeKernel(const void* __restrict__ x, const float* __restrict__ scale,
                        uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                        float* __restrict__ scale_inv, uint32_t* __restrict__ amax_bits,
                        int64_t rows, int64_t cols, int64_t mats_per_group, int64_t matrices) {
  __shared__ uint8_t tile[kSmallTile][kSmallTile + 1];
  const int tx = threadIdx.x % kSmallTile;
  const int ty = threadIdx.x / kSmallTile;  // 0..7
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kSmallTile;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kSmallTile;
  for (int64_t mat = blockIdx.z; mat < matrices; mat += gridDim.z) {
    const int64_t g = mat / mats_per_group;
    const float sc = scale[g];
    const int64_t mat_base = mat * rows * cols;
    uint32_t m = 0;
    for (int i = ty; i < kSmallTile; i += kThreads / kSmallTile) {
      const int64_t gr = row0 + i;
      const int64_t gc = col0 + tx;
      if (gr < rows && gc < cols) {
        const float v = LoadOne<W>(x, mat_base + gr * cols + gc);
        m = max(m, AbsBits(v));
        const uint8_t code = CvtFp8<F>(v, sc);
        q[mat_base + gr * cols + gc] = code;
        tile[i][tx] = code;
      }
    }
    __syncthreads();
    for (int i = ty; i < kSmallTile; i += kThreads / kSmallTile) {
      const int64_t gc = col0 + i;
      const int64_t gr = row0 + tx;
      if (gc < cols && gr < rows) qt[mat_base + gc * rows + gr] = tile[tx][i];
    }
    m = BlockMaxU32(m);
    if (threadIdx.x == 0) {
      atomicMax(amax_bits + g, m);
      if (blockIdx.x == 0 && blockIdx.y == 0 && mat % mats_per_group == 0) {
        scale_inv[g] = 1.0f / sc;
      }
    }
  }
}

ffi::Error CastTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  MatrixShape s;
  if (auto err = MatrixShapeOf("cast_transpose", x.dimensions(), scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (q->element_type() != qt->element_type() || q->element_count() != x.element_count() ||
      qt->element_count() != x.element_count()) {
    return BadArg("cast_transpose", "outputs must match the input size and share an FP8 dtype");
  }
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax->typed_data());
  if (cudaMemsetAsync(amax_bits, 0, s.groups * sizeof(uint32_t), stream) != cudaSuccess) {
    return LastError("cast_transpose");
  }
  // scale_inv is written by a block of each group's first matrix; with an
  // empty matrix no block runs, so write it up front from the host side of
  // the stream (a tiny kernel is not worth it: the empty case is rare).
  const bool vec = s.rows % 8 == 0 && s.cols % 8 == 0 && Aligned(x.untyped_data(), 32) &&
                   Aligned(q->untyped_data(), 8) && Aligned(qt->untyped_data(), 8);
  const int tile = vec ? kTile : kSmallTile;
  const int64_t gx = (s.cols + tile - 1) / tile;
  const int64_t gy = (s.rows + tile - 1) / tile;
  if (gx > INT32_MAX || gy > kMaxGridY) {
    return BadArg("cast_transpose", "matrix too large for one launch");
  }
  const int64_t gz = std::min<int64_t>(s.matrices, kMaxGridY);
  const int64_t mats_per_group = s.matrices / s.groups;
  return DispatchWideFp8(
      "cast_transpose", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        if (s.rows == 0 || s.cols == 0 || s.matrices == 0) return ffi::Error::Success();
        const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(gy),
                        static_cast<unsigned>(gz));
        auto* qp = static_cast<uint8_t*>(q->untyped_data());
        auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
        if (vec) {
          CastTransposeVecKernel<W, F><<<grid, kThreads, 0, stream>>>(
              x.untyped_data(), scale.typed_data(), qp, qtp, scale_inv->typed_data(), amax_bits,
              s.rows, s.cols, mats_per_group, s.matrices);
        } else {
          CastTransposeKernel<W, F><<<grid, kThreads, 0, stream>>>(
              x.untyped_data(), scale.typed_data(), qp, qtp, scale_inv->typed_data(), amax_bits,
              s.rows, s.cols, mats_per_group, s.matrices);
        }
        return LastError("cast_transpose");
      });
}

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

ffi::Error UpdateFp8StateImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> history,
                              ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> amax,
                              ffi::Buffer<ffi::F32> fp8_max, int64_t margin, int64_t algo,
                              ffi::Result<ffi::Buffer<ffi::F32>> new_history,
                              ffi::Result<ffi::Buffer<ffi::F32>> new_scale) {
  HistoryShape s;
  if (auto err = HistoryShapeOf(history.dimensions(), history.element_count(),
                                scale.element_count(), amax.element_count(),
                                fp8_max.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (auto err = CheckAlgo(algo); !err.success()) return err;
  if (s.rows == 0) return ffi::Error::Success();
  if (s.rows > INT32_MAX) return BadArg("update_fp8_state", "too many state rows");
  const float margin_factor = std::ldexp(1.0f, -static_cast<int>(margin));
  UpdateFp8StateKernel<<<static_cast<unsigned>(s.rows), kThreads, 0, stream>>>(
      history.typed_data(), scale.typed_data(), amax.typed_data(), fp8_max.typed_data(), s.len,
      static_cast<int>(algo), margin_factor, new_history->typed_data(), new_scale->typed_data());
  return LastError("update_fp8_state");
}

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxQuantizeCuda, fp8jax::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxDequantizeCuda, fp8jax::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxCastTransposeCuda, fp8jax::CastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxUpdateFp8StateCuda, fp8jax::UpdateFp8StateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("margin")
                                  .Attr<int64_t>("algo")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
