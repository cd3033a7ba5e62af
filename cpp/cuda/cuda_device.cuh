// Device helpers shared by the CUDA kernels (cuda_ops.cu, cuda_cast_transpose.cu,
// cuda_activation.cu): 8-element wide loads and stores, 8-element FP8 packing, the
// block amax reduction, and launch plumbing. Included only by .cu files.
#pragma once

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
#include "common/wide.h"
#include "cuda/cuda_util.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

constexpr int kThreads = plan::kThreads;

// ------------------------------------------------------------ conversions

// The element conversions (CvtFp8(x, scale): the FP8 code of x * scale;
// F16BitsToFloatFast; FloatToF16BitsFast; DequantizeValue) are the
// __host__ __device__ helpers of common/fp8_device_convert.h and
// common/fp8_numerics.h, tested on the host against the CPU numerics
// (tests/cpp). CvtFp8 takes x and scale apart because the GPU's multiply
// drops a NaN's sign. One element of a wide buffer: LoadWide / StoreWide of
// common/wide.h with FastHalf (the hardware half conversions).

// Bytes per element of a wide dtype.
template <WideKind W>
constexpr int kWideBytes = W == WideKind::kF32 ? 4 : 2;

// The 16 or 32 bytes of 8 consecutive elements, as loaded (RawEight), and
// their float values (WidenEight). Kept apart so a kernel holding many rows
// in registers holds them at their own width (2-byte types: 4 registers per
// 8 elements, not 8) and widens each row where it is used.
template <WideKind W>
struct RawEightT {
  uint4 words[W == WideKind::kF32 ? 2 : 1];
};

// Loads 8 consecutive elements starting at i (16-byte aligned for 2-byte
// types, 32-byte aligned for float32).
template <WideKind W>
__device__ __forceinline__ RawEightT<W> RawEight(const void* p, int64_t i) {
  RawEightT<W> r;
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(p) +
                                                    i * static_cast<int64_t>(kWideBytes<W>));
#pragma unroll
  for (int k = 0; k < (W == WideKind::kF32 ? 2 : 1); ++k) r.words[k] = src[k];
  return r;
}

template <WideKind W>
__device__ __forceinline__ void WidenEight(const RawEightT<W>& r, float v[8]) {
  if constexpr (W == WideKind::kF32) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      v[4 * k] = __uint_as_float(r.words[k].x), v[4 * k + 1] = __uint_as_float(r.words[k].y);
      v[4 * k + 2] = __uint_as_float(r.words[k].z), v[4 * k + 3] = __uint_as_float(r.words[k].w);
    }
  } else {
    const uint32_t words[4] = {r.words[0].x, r.words[0].y, r.words[0].z, r.words[0].w};
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
__device__ __forceinline__ void LoadEight(const void* p, int64_t i, float v[8]) {
  WidenEight<W>(RawEight<W>(p, i), v);
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
      w[k] = static_cast<uint32_t>(WideBits<W, FastHalf>(v[2 * k])) |
             (static_cast<uint32_t>(WideBits<W, FastHalf>(v[2 * k + 1])) << 16);
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

inline uint64_t Addr(const void* p) {
  return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
}

// Loads the `count` (0..8) elements of a chunk at element i into v[0..7] (the
// missing ones as 0, which leaves amax unchanged): one vector access when
// `vector`, else element by element (the scalar head and tail).
template <WideKind W>
__device__ __forceinline__ void LoadChunk(const void* p, int64_t i, int count, bool vector,
                                          float v[8]) {
  if (vector) {
    LoadEight<W>(p, i, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < count ? LoadWide<W, FastHalf>(p, i + j) : 0.0f;
}

template <WideKind W>
__device__ __forceinline__ void StoreChunk(void* p, int64_t i, int count, bool vector,
                                           const float v[8]) {
  if (vector) {
    StoreEight<W>(p, i, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < count) StoreWide<W, FastHalf>(p, i + j, v[j]);
  }
}

// FP8 codes of a chunk, packed little-endian in a uint64.
__device__ __forceinline__ uint64_t LoadCodes(const uint8_t* p, int64_t i, int count, bool vector) {
  if (vector) return *reinterpret_cast<const uint64_t*>(p + i);
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < count) packed |= static_cast<uint64_t>(p[i + j]) << (8 * j);
  }
  return packed;
}

__device__ __forceinline__ void StoreCodes(uint8_t* p, int64_t i, int count, bool vector,
                                           uint64_t packed) {
  if (vector) {
    *reinterpret_cast<uint64_t*>(p + i) = packed;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < count) p[i + j] = static_cast<uint8_t>(packed >> (8 * j));
  }
}

// scale_inv = 1 / scale for every group, by a grid-stride loop over all
// threads: written even when the tensor is empty and no tile has work.
__device__ __forceinline__ void WriteScaleInv(const float* __restrict__ scale,
                                              float* __restrict__ scale_inv, int64_t groups) {
  plan::WalkGroups(groups, blockIdx.x, gridDim.x, threadIdx.x,
                   [&](int64_t g) { scale_inv[g] = ScaleInverse(scale[g]); });
}

// One atomic per block and group: the block's max of m into amax_bits[group].
// Called at block-uniform points (it synchronises the block).
__device__ __forceinline__ void FlushAmax(uint32_t* __restrict__ amax_bits, int64_t group,
                                          uint32_t m) {
  m = BlockMaxU32(m);
  if (threadIdx.x == 0) atomicMax(amax_bits + group, m);
}

inline ffi::Error MemsetAsync(const char* op, void* p, size_t bytes, cudaStream_t stream) {
  if (const cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream); err != cudaSuccess) {
    return CudaError(op, "cudaMemsetAsync", err);
  }
  return ffi::Error::Success();
}

// Launches `kernel` on as many blocks as `plan_grid(resident blocks)` says.
template <typename PlanGrid, typename... Params, typename... Args>
ffi::Error PlanAndLaunch(const char* op, void (*kernel)(Params...), cudaStream_t stream,
                         PlanGrid&& plan_grid, Args&&... args) {
  int64_t resident = 0;
  FP8JAX_RETURN_IF_ERROR(
      ResidentBlocks(op, reinterpret_cast<const void*>(kernel), plan::kThreads, &resident));
  return Launch(op, kernel, plan_grid(resident), plan::kThreads, stream,
                std::forward<Args>(args)...);
}

// The launch arguments of an elementwise kernel over `s.groups` groups of `s.per_group`
// elements: `wide` is the float32/bf16/f16 side (`wide_bytes` per element), `narrow` the FP8
// codes. The grid-dependent fields are filled by ElementwisePlanner once the occupancy is known.
inline plan::ElementwiseArgs ElementwiseArgsOf(const GroupShape& s, const void* wide,
                                               int wide_bytes, const void* narrow) {
  plan::ElementwiseArgs a;
  a.groups = s.groups;
  a.per_group = s.per_group;
  a.wide_addr = Addr(wide);
  a.wide_bytes = wide_bytes;
  a.narrow_addr = Addr(narrow);
  return a;
}

// PlanAndLaunch's planner for an elementwise kernel: fills `a`'s tiling for `resident` blocks
// and returns the grid.
inline auto ElementwisePlanner(plan::ElementwiseArgs& a) {
  return [&a](int64_t resident) {
    const plan::ElementwisePlan p = plan::PlanElementwise(a.groups, a.per_group, resident);
    a.tiles_per_group = p.tiles_per_group;
    a.tiles = p.tiles;
    return p.grid;
  };
}

}  // namespace fp8jax
