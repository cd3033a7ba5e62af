// The norm kernels' row access and reductions, shared by cuda_norm.cu (the forward and its FP8
// form) and cuda_norm_backward.cu: chunks of a row loaded and stored by one 16-byte access or
// element by element, gamma/beta in x's dtype or another, sums over a row group, and the
// handlers' alignment choice. Included by CUDA translation units only (file-local names).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>

#include "common/norm_plan.h"
#include "common/wide.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_util.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr int kMaxThreads = plan::kNormMaxRowThreads;  // a block has at most this many
constexpr int kMaxWarps = kMaxThreads / 32;

// ------------------------------------------------------------ element access

// One element: LoadWide / StoreWide / RoundWide of common/wide.h with the hardware half
// conversions (FastHalf).

// The `count` (1..VEC) elements of a chunk at i into v (the missing ones as
// 0): one 16-byte access when kVector (the plan chose it only for 16-byte
// aligned rows, where every chunk is whole), else element by element.
template <WideKind W, bool kVector, int VEC>
__device__ __forceinline__ void LoadVec(const void* p, int64_t i, int count, float (&v)[VEC]) {
  if constexpr (!kVector) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = j < count ? LoadWide<W, FastHalf>(p, i + j) : 0.0f;
  } else if constexpr (W == WideKind::kF32) {
    static_assert(VEC == 4);
    const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
  } else {
    static_assert(VEC == 8);
    LoadEight<W>(p, i, v);  // one 16-byte load
  }
}

template <WideKind W, bool kVector, int VEC>
__device__ __forceinline__ void StoreVec(void* p, int64_t i, int count, const float (&v)[VEC]) {
  if constexpr (!kVector) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (j < count) StoreWide<W, FastHalf>(p, i + j, v[j]);
    }
  } else if constexpr (W == WideKind::kF32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p) + i) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    static_assert(VEC == 8);
    StoreEight<W>(p, i, v);  // one 16-byte store
  }
}

// The `count` FP8 codes of a chunk at i: one VEC-byte access when kVector
// (q's rows are then VEC-byte aligned), else byte by byte.
template <bool kVector, int VEC>
__device__ __forceinline__ void StoreCodes(uint8_t* p, int64_t i, int count,
                                           const uint8_t (&c)[VEC]) {
  if constexpr (!kVector) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (j < count) p[i + j] = c[j];
    }
  } else if constexpr (VEC == 4) {
    *reinterpret_cast<uint32_t*>(p + i) =
        static_cast<uint32_t>(c[0]) | (static_cast<uint32_t>(c[1]) << 8) |
        (static_cast<uint32_t>(c[2]) << 16) | (static_cast<uint32_t>(c[3]) << 24);
  } else {
    uint64_t w = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(c[j]) << (8 * j);
    *reinterpret_cast<uint64_t*>(p + i) = w;
  }
}

// The `count` gamma (or beta) values of a chunk at i. like_x (block-uniform): the parameter has
// x's dtype, and is 16-byte aligned where kVector, so the chunk is x's kind of access (one
// 16-byte load when kVector); else element by element through LoadWideOf (a block-uniform
// switch on the dtype; the vectors are small and stay in L1/L2).
template <WideKind W, bool kVector, int VEC>
__device__ __forceinline__ void LoadParams(const void* p, WideKind k, bool like_x, int64_t i,
                                           int count, float (&v)[VEC]) {
  if (like_x) {
    LoadVec<W, kVector>(p, i, count, v);
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) v[j] = j < count ? LoadWideOf<FastHalf>(p, k, i + j) : 0.0f;
  }
}

// ---------------------------------------------------------------- reductions

// Sums each v[n] over the row group (threads_per_row threads, whole warps);
// every thread of the group gets the same bits. Called by every thread of the
// block at the same point (it synchronises the block when a row spans warps).
template <int N>
__device__ __forceinline__ void GroupSum(float (&v)[N], int threads_per_row, float* red) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v[n] = RnAdd(v[n], __shfl_xor_sync(0xFFFFFFFFu, v[n], o));
  }
  if (threads_per_row == 32) return;  // block-uniform
  const int warp = threadIdx.x / 32;
  const int warps = threads_per_row / 32;
  const int first = warp / warps * warps;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) red[n * kMaxWarps + warp] = v[n];
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float s = red[n * kMaxWarps + first];
    for (int w = 1; w < warps; ++w) s = RnAdd(s, red[n * kMaxWarps + first + w]);
    v[n] = s;
  }
  __syncthreads();  // red may be written again by the next call
}

// The warp's max of m into amax_bits[group] (one atomic per warp); every lane
// of the warp calls it with the same group.
__device__ __forceinline__ void FlushAmax(uint32_t* amax_bits, int64_t group, uint32_t m) {
  m = __reduce_max_sync(0xFFFFFFFFu, m);
  if (threadIdx.x % 32 == 0 && group >= 0) atomicMax(amax_bits + group, m);
}

// ---------------------------------------------------------------- the handlers' choices

inline bool RowsAligned(int64_t h, int elem_bytes, std::initializer_list<const void*> ptrs) {
  if ((h * elem_bytes) % 16 != 0) return false;
  for (const void* p : ptrs) {
    if (Addr(p) % 16 != 0) return false;
  }
  return true;
}

inline int ElemBytes(ffi::DataType t) { return WideKindOf(t) == WideKind::kF32 ? 4 : 2; }

// LoadParams' like_x: gamma (and beta) in x's dtype and, where the rows take 16-byte accesses,
// 16-byte aligned.
inline bool ParamsLikeX(ffi::DataType x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                        bool aligned) {
  for (const ffi::AnyBuffer* p : {&gamma, beta}) {
    if (p == nullptr) continue;
    if (p->element_type() != x || (aligned && Addr(p->untyped_data()) % 16 != 0)) return false;
  }
  return true;
}

}  // namespace
}  // namespace fp8jax
