// CUDA FFI handlers of the norms: LayerNorm / RMSNorm forward, the forward
// fused with the FP8 cast (q; q_t by a second, byte-transpose pass), and the
// backward with deterministic dgamma/dbeta.
//
// Same target names and numerics as cpp/cpu/cpu_norm.cc: the per-element and
// per-row arithmetic is common/norm_row.h's, the grid, the row groups, the
// chunk each thread owns and the vector/scalar choice are common/norm_plan.h's
// (tested on the host). A row group (a warp, or up to 16 warps for long rows)
// works on one row at a time: pass 1 sums the row (layernorm), pass 2 sums the
// centred squares, pass 3 writes y (or q); passes 2 and 3 read the row again,
// from L1/L2 (each thread re-reads the chunks it read before). Sums: each
// thread adds its chunks in order, then a fixed xor-butterfly over the warp
// (every lane ends with the same bits, as a + b == b + a) and, for rows of
// several warps, the warps' sums in warp order through shared memory.
//
// Every handler allocates nothing (the backward's partial sums live in a
// workspace output), never synchronises the host and enqueues the same work
// for the same shapes, so it is CUDA-graph compatible (kCmdBufferCompatible).
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "common/norm_plan.h"
#include "common/norm_row.h"
#include "common/op_table.h"
#include "common/wide.h"
#include "cuda/cuda_column_totals.cuh"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_norm.h"
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
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (W == WideKind::kBF16) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
      } else {
        v[2 * k] = F16BitsToFloatFast(static_cast<uint16_t>(w[k] & 0xFFFFu));
        v[2 * k + 1] = F16BitsToFloatFast(static_cast<uint16_t>(w[k] >> 16));
      }
    }
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
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = static_cast<uint32_t>(WideBits<W, FastHalf>(v[2 * k])) |
             (static_cast<uint32_t>(WideBits<W, FastHalf>(v[2 * k + 1])) << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
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

// ------------------------------------------------------------------- forward

struct FwdArgs {
  const void* x;
  const void* gamma;
  const void* beta;  // null for rmsnorm
  WideKind gamma_kind, beta_kind;
  bool params_like_x;  // gamma (and beta) have x's dtype and, for vector rows, its alignment
  int zero_centered;
  float eps;
  int64_t rows;  // all rows (groups * rows per group)
  int64_t rows_per_group;
  int64_t h;
  void* y;              // forward: y; FP8 form: null
  uint8_t* q;           // FP8 form: q
  const float* scale;   // FP8 form: one per group
  uint32_t* amax_bits;  // FP8 form: one per group, zeroed before the launch
  float* scale_inv;     // FP8 form
  int64_t groups;
  float* mu;
  float* rs;
  plan::NormPlan p;
};

// F = void: the plain forward (writes y); else the FP8 form (writes q, amax).
// kVector: 16-byte accesses (aligned rows), else element by element.
template <WideKind W, bool kVector, bool kLayer, typename F>
__global__ void __launch_bounds__(kMaxThreads, 1) NormForwardKernel(FwdArgs a) {
  constexpr int VEC = 16 / (W == WideKind::kF32 ? 4 : 2);
  constexpr bool kFp8 = !std::is_void_v<F>;
  __shared__ float red[kMaxWarps];
  const plan::NormPlan p = a.p;
  const int grp = threadIdx.x / p.threads_per_row;
  const int t = threadIdx.x % p.threads_per_row;
  if constexpr (kFp8) {
    if (blockIdx.x == 0) {
      for (int64_t g = threadIdx.x; g < a.groups; g += blockDim.x) {
        a.scale_inv[g] = ScaleInverse(a.scale[g]);
      }
    }
  }
  uint32_t amax = 0;
  int64_t amax_group = -1;
  const int64_t iters = plan::NormIterations(p, a.rows);
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = plan::NormForwardRow(p, blockIdx.x, grp, it);
    const bool valid = row < a.rows;
    const int64_t base = row * a.h;
    const int64_t group = valid ? row / a.rows_per_group : 0;
    float mu = 0.0f;
    if constexpr (kLayer) {
      float s[1] = {0.0f};
      for (int k = 0; valid && k < p.chunks_per_thread && plan::NormChunkValid(p, t, k); ++k) {
        const int64_t c0 = plan::NormChunkStart(p, t, k);
        const int n = plan::NormChunkCount(p, a.h, c0);
        float v[VEC];
        LoadVec<W, kVector>(a.x, base + c0, n, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (j < n) s[0] = RnAdd(s[0], v[j]);
        }
      }
      GroupSum(s, p.threads_per_row, red);
      mu = RowMean(s[0], a.h);
    }
    float sq[1] = {0.0f};
    for (int k = 0; valid && k < p.chunks_per_thread && plan::NormChunkValid(p, t, k); ++k) {
      const int64_t c0 = plan::NormChunkStart(p, t, k);
      const int n = plan::NormChunkCount(p, a.h, c0);
      float v[VEC];
      LoadVec<W, kVector>(a.x, base + c0, n, v);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = NormCentred(v[j], mu);
        if (j < n) sq[0] = RnAdd(sq[0], RnMul(d, d));
      }
    }
    GroupSum(sq, p.threads_per_row, red);
    const float rs = RowRsigma(sq[0], a.h, a.eps);
    if (kFp8 && valid && group != amax_group) {  // warp-uniform: a warp works on one row
      FlushAmax(a.amax_bits, amax_group, amax);
      amax = 0;
      amax_group = group;
    }
    const int64_t pbase = group * a.h;
    const bool out = kFp8 || a.y != nullptr;  // else the statistics only (NormStats)
    for (int k = 0; out && valid && k < p.chunks_per_thread && plan::NormChunkValid(p, t, k); ++k) {
      const int64_t c0 = plan::NormChunkStart(p, t, k);
      const int n = plan::NormChunkCount(p, a.h, c0);
      float v[VEC], g[VEC], b[VEC];
      LoadVec<W, kVector>(a.x, base + c0, n, v);
      LoadParams<W, kVector>(a.gamma, a.gamma_kind, a.params_like_x, pbase + c0, n, g);
      if constexpr (kLayer) {
        LoadParams<W, kVector>(a.beta, a.beta_kind, a.params_like_x, pbase + c0, n, b);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        if (j < n) {
          v[j] = NormOut<kLayer>(v[j], mu, rs, NormGamma(g[j], a.zero_centered != 0),
                                 kLayer ? b[j] : 0.0f);
        }
      }
      if constexpr (kFp8) {
        const float sc = a.scale[group];
        uint8_t c[VEC];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float yw = RoundWide<W, FastHalf>(v[j]);  // y as norm_forward returns it
          if (j < n) amax = max(amax, AbsBits(yw));
          c[j] = CvtFp8<F>(yw, sc);
        }
        StoreCodes<kVector>(a.q, base + c0, n, c);
      } else {
        StoreVec<W, kVector>(a.y, base + c0, n, v);
      }
    }
    if (valid && t == 0) {
      a.mu[row] = mu;
      a.rs[row] = rs;
    }
  }
  if constexpr (kFp8) FlushAmax(a.amax_bits, amax_group, amax);
}

// q [rows, cols] -> q_t [cols, rows] for each of `matrices` byte matrices,
// through a 64 x 64 shared tile (tiles from plan::NormTileAt).
__global__ void __launch_bounds__(plan::kNormTransposeThreads)
    NormTransposeKernel(const uint8_t* q, uint8_t* qt, int64_t matrices, int64_t rows,
                        int64_t cols) {
  constexpr int kT = plan::kNormTransposeTile;
  constexpr int kStep = plan::kNormTransposeThreads / kT;
  __shared__ uint8_t tile[kT][kT + 4];
  const int tx = threadIdx.x % kT;
  const int ty = threadIdx.x / kT;
  const int64_t tiles = plan::NormTiles(matrices, rows, cols);
  for (int64_t i = blockIdx.x; i < tiles; i += gridDim.x) {
    const plan::NormTile tl = plan::NormTileAt(i, rows, cols);
    const uint8_t* src = q + tl.matrix * rows * cols;
    uint8_t* dst = qt + tl.matrix * rows * cols;
    for (int r = ty; r < kT; r += kStep) {
      if (tl.row0 + r < rows && tl.col0 + tx < cols) {
        tile[r][tx] = src[(tl.row0 + r) * cols + tl.col0 + tx];
      }
    }
    __syncthreads();
    for (int c = ty; c < kT; c += kStep) {
      if (tl.col0 + c < cols && tl.row0 + tx < rows) {
        dst[(tl.col0 + c) * rows + tl.row0 + tx] = tile[tx][c];
      }
    }
    __syncthreads();
  }
}

// ------------------------------------------------------------------ backward

struct BwdArgs {
  const void* dy;
  const void* x;
  const float* mu;
  const float* rs;
  const void* gamma;
  WideKind gamma_kind;
  bool params_like_x;  // as FwdArgs
  int zero_centered;
  int64_t groups;
  int64_t rows;  // per group
  int64_t h;
  int64_t ws_slots;  // workspace rows per group
  void* dx;
  float* ws;  // [groups, ws_slots, 2, h]
  plan::NormPlan p;
};

// Each row group is one slot: for every vmap group it runs rows slot, slot +
// slots, ... in order, writes dx, and keeps its columns' dgamma/dbeta in
// registers (plan: at most kNormMaxThreadElems per thread), then writes them
// as its partial row of the workspace.
template <WideKind W, bool kVector, bool kLayer>
__global__ void __launch_bounds__(kMaxThreads, 1) NormBackwardKernel(BwdArgs a) {
  constexpr int VEC = 16 / (W == WideKind::kF32 ? 4 : 2);
  constexpr int kMaxK = plan::kNormMaxThreadElems / VEC;
  __shared__ float red[2 * kMaxWarps];
  const plan::NormPlan p = a.p;
  const int grp = threadIdx.x / p.threads_per_row;
  const int t = threadIdx.x % p.threads_per_row;
  const int64_t slot = plan::NormSlot(p, blockIdx.x, grp);
  const int64_t iters = plan::CeilDiv(a.rows, p.slots);
  for (int64_t g = 0; g < a.groups; ++g) {
    float dg[kMaxK][VEC];
    float db[kMaxK][VEC];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) dg[k][j] = db[k][j] = 0.0f;
    }
    const int64_t pbase = g * a.h;
    // This group's gamma of the thread's chunks, loaded once for all its rows.
    float gm[kMaxK][VEC];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) gm[k][j] = 0.0f;
      if (k < p.chunks_per_thread && plan::NormChunkValid(p, t, k)) {
        const int64_t c0 = plan::NormChunkStart(p, t, k);
        LoadParams<W, kVector>(a.gamma, a.gamma_kind, a.params_like_x, pbase + c0,
                               plan::NormChunkCount(p, a.h, c0), gm[k]);
#pragma unroll
        for (int j = 0; j < VEC; ++j) gm[k][j] = NormGamma(gm[k][j], a.zero_centered != 0);
      }
    }
    for (int64_t it = 0; it < iters; ++it) {
      const int64_t r = slot + it * p.slots;
      const bool valid = r < a.rows;
      const int64_t row = g * a.rows + r;
      const int64_t base = row * a.h;
      const float mu = valid && kLayer ? a.mu[row] : 0.0f;
      const float rs = valid ? a.rs[row] : 0.0f;
      float s[2] = {0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < kMaxK; ++k) {
        if (valid && k < p.chunks_per_thread && plan::NormChunkValid(p, t, k)) {
          const int64_t c0 = plan::NormChunkStart(p, t, k);
          const int n = plan::NormChunkCount(p, a.h, c0);
          float x[VEC], dy[VEC];
          LoadVec<W, kVector>(a.x, base + c0, n, x);
          LoadVec<W, kVector>(a.dy, base + c0, n, dy);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            if (j < n) {
              const float dz = RnMul(dy[j], gm[k][j]);
              s[0] = RnAdd(s[0], dz);
              s[1] = RnAdd(s[1], RnMul(dz, NormXhat(x[j], mu, rs)));
            }
          }
        }
      }
      GroupSum(s, p.threads_per_row, red);
      const float c1 = kLayer ? RowMean(s[0], a.h) : 0.0f;
      const float c2 = RowMean(s[1], a.h);
#pragma unroll
      for (int k = 0; k < kMaxK; ++k) {
        if (valid && k < p.chunks_per_thread && plan::NormChunkValid(p, t, k)) {
          const int64_t c0 = plan::NormChunkStart(p, t, k);
          const int n = plan::NormChunkCount(p, a.h, c0);
          float x[VEC], dy[VEC];
          LoadVec<W, kVector>(a.x, base + c0, n, x);
          LoadVec<W, kVector>(a.dy, base + c0, n, dy);
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            if (j < n) {
              const float xhat = NormXhat(x[j], mu, rs);
              dg[k][j] = RnAdd(dg[k][j], RnMul(dy[j], xhat));
              if constexpr (kLayer) db[k][j] = RnAdd(db[k][j], dy[j]);
              x[j] = NormDx(RnMul(dy[j], gm[k][j]), xhat, rs, c1, c2);
            }
          }
          StoreVec<W, kVector>(a.dx, base + c0, n, x);
        }
      }
    }
    float* part = a.ws + (g * a.ws_slots + slot) * 2 * a.h;
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) {
      if (k < p.chunks_per_thread && plan::NormChunkValid(p, t, k)) {
        const int64_t c0 = plan::NormChunkStart(p, t, k);
        const int n = plan::NormChunkCount(p, a.h, c0);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          if (j < n) {
            part[c0 + j] = dg[k][j];
            part[a.h + c0 + j] = db[k][j];
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ handlers

// Plans for `rows` rows, queries the occupancy for the planned block size and
// plans again with it (forward kernels).
template <typename Kernel>
ffi::Error PlanForward(const char* op, Kernel kernel, cudaStream_t stream, int64_t rows, int64_t h,
                       int elem_bytes, bool aligned, plan::NormPlan* out) {
  plan::NormPlan p = plan::PlanNorm(rows, h, elem_bytes, aligned, 1, 0);
  int64_t resident = 0;
  if (auto err = ResidentBlocks(op, reinterpret_cast<const void*>(kernel), p.threads, &resident);
      !err.success()) {
    return err;
  }
  *out = plan::PlanNorm(rows, h, elem_bytes, aligned, resident, 0);
  return ffi::Error::Success();
}

template <WideKind W, bool kLayer, typename F, bool kVector>
ffi::Error LaunchForward(const char* op, cudaStream_t stream, FwdArgs a, bool aligned) {
  auto* kernel = NormForwardKernel<W, kVector, kLayer, F>;
  FP8JAX_RETURN_IF_ERROR(
      PlanForward(op, kernel, stream, a.rows, a.h, kWideBytes<W>, aligned, &a.p));
  return Launch(op, kernel, a.p.grid, a.p.threads, stream, a);
}

template <WideKind W, bool kLayer, typename F>
ffi::Error LaunchForwardAny(const char* op, cudaStream_t stream, const FwdArgs& a, bool aligned) {
  return aligned ? LaunchForward<W, kLayer, F, true>(op, stream, a, true)
                 : LaunchForward<W, kLayer, F, false>(op, stream, a, false);
}

bool RowsAligned(int64_t h, int elem_bytes, std::initializer_list<const void*> ptrs) {
  if ((h * elem_bytes) % 16 != 0) return false;
  for (const void* p : ptrs) {
    if (Addr(p) % 16 != 0) return false;
  }
  return true;
}

int ElemBytes(ffi::DataType t) { return WideKindOf(t) == WideKind::kF32 ? 4 : 2; }

// LoadParams' like_x: gamma (and beta) in x's dtype and, where the rows take 16-byte accesses,
// 16-byte aligned.
bool ParamsLikeX(ffi::DataType x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                 bool aligned) {
  for (const ffi::AnyBuffer* p : {&gamma, beta}) {
    if (p == nullptr) continue;
    if (p->element_type() != x || (aligned && Addr(p->untyped_data()) % 16 != 0)) return false;
  }
  return true;
}

// The plain forward of x (shape `s`, checked) into y, mu and rs; y null: mu and rs only.
ffi::Error LaunchPlainForward(const char* op, bool layer, cudaStream_t stream,
                              const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma,
                              const ffi::AnyBuffer* beta, float eps, bool zero_centered,
                              const NormShape& s, void* y, float* mu, float* rs) {
  if (s.groups * s.rows == 0) return ffi::Error::Success();
  FwdArgs a{};
  a.x = x.untyped_data();
  a.gamma = gamma.untyped_data();
  a.beta = beta != nullptr ? beta->untyped_data() : nullptr;
  a.gamma_kind = WideKindOf(gamma.element_type());
  a.beta_kind = beta != nullptr ? WideKindOf(beta->element_type()) : WideKind::kF32;
  a.zero_centered = zero_centered;
  a.eps = eps;
  a.rows = s.groups * s.rows;
  a.rows_per_group = s.rows;
  a.h = s.h;
  a.y = y;
  a.groups = s.groups;
  a.mu = mu;
  a.rs = rs;
  const bool aligned = RowsAligned(s.h, ElemBytes(x.element_type()), {a.x, a.y});
  a.params_like_x = ParamsLikeX(x.element_type(), gamma, beta, aligned);
  return DispatchWide(op, WideKindOf(x.element_type()), [&]<WideKind W>() {
    return layer ? LaunchForwardAny<W, true, void>(op, stream, a, aligned)
                 : LaunchForwardAny<W, false, void>(op, stream, a, aligned);
  });
}

ffi::Error ForwardImpl(const char* op, bool layer, cudaStream_t stream, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, float eps,
                       int64_t zero_centered, ffi::AnyBuffer& y, float* mu, float* rs,
                       int64_t n_stats) {
  NormShape s;
  FP8JAX_RETURN_IF_ERROR(CheckNormForward(op, x, gamma, beta, y, n_stats, &s));
  return LaunchPlainForward(op, layer, stream, x, gamma, beta, eps, zero_centered != 0, s,
                            y.untyped_data(), mu, rs);
}

using F32Out = ffi::Result<ffi::Buffer<ffi::F32>>;
using Stream = ffi::PlatformStream<cudaStream_t>;

ffi::Error LayerNormForward(cudaStream_t stream, sig::Any x, sig::Any gamma, sig::Any beta,
                            float eps, int64_t zcg, sig::AnyOut y, F32Out mu, F32Out rs) {
  return ForwardImpl("layernorm_forward", true, stream, x, gamma, &beta, eps, zcg, *y,
                     mu->typed_data(), rs->typed_data(), mu->element_count());
}

ffi::Error RmsNormForward(cudaStream_t stream, sig::Any x, sig::Any gamma, float eps, int64_t zcg,
                          sig::AnyOut y, F32Out mu, F32Out rs) {
  return ForwardImpl("rmsnorm_forward", false, stream, x, gamma, nullptr, eps, zcg, *y,
                     mu->typed_data(), rs->typed_data(), mu->element_count());
}

ffi::Error ForwardFp8Impl(const char* op, bool layer, cudaStream_t stream, const ffi::AnyBuffer& x,
                          const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                          const ffi::Buffer<ffi::F32>& scale, float eps, int64_t zero_centered,
                          ffi::AnyBuffer& q, ffi::AnyBuffer& qt, F32Out& scale_inv_out,
                          F32Out& amax_out, float* mu, float* rs, int64_t n_stats) {
  NormShape s;
  FP8JAX_RETURN_IF_ERROR(CheckNormForwardFp8(op, x, gamma, beta, scale, q, qt,
                                             scale_inv_out->element_count(),
                                             amax_out->element_count(), n_stats, &s));
  float* scale_inv = scale_inv_out->typed_data();
  float* amax = amax_out->typed_data();
  if (const cudaError_t err = cudaMemsetAsync(amax, 0, s.groups * sizeof(float), stream);
      err != cudaSuccess) {
    return CudaError(op, "cudaMemsetAsync", err);
  }
  FwdArgs a{};
  a.x = x.untyped_data();
  a.gamma = gamma.untyped_data();
  a.beta = beta != nullptr ? beta->untyped_data() : nullptr;
  a.gamma_kind = WideKindOf(gamma.element_type());
  a.beta_kind = beta != nullptr ? WideKindOf(beta->element_type()) : WideKind::kF32;
  a.zero_centered = zero_centered != 0;
  a.eps = eps;
  a.rows = s.groups * s.rows;
  a.rows_per_group = s.rows;
  a.h = s.h;
  a.q = static_cast<uint8_t*>(q.untyped_data());
  a.scale = scale.typed_data();
  a.amax_bits = reinterpret_cast<uint32_t*>(amax);
  a.scale_inv = scale_inv;
  a.groups = s.groups;
  a.mu = mu;
  a.rs = rs;
  const bool aligned = RowsAligned(s.h, ElemBytes(x.element_type()), {a.x, a.q});
  a.params_like_x = ParamsLikeX(x.element_type(), gamma, beta, aligned);
  // The row kernel runs even for empty tensors: it writes scale_inv.
  auto err = DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q.element_type()),
                             [&]<WideKind W, typename F>() {
                               return layer ? LaunchForwardAny<W, true, F>(op, stream, a, aligned)
                                            : LaunchForwardAny<W, false, F>(op, stream, a, aligned);
                             });
  if (!err.success()) return err;
  const int64_t tiles = plan::NormTiles(s.groups, s.rows, s.h);
  if (tiles == 0) return ffi::Error::Success();
  int64_t resident = 0;
  if (auto e = ResidentBlocks(op, reinterpret_cast<const void*>(NormTransposeKernel),
                              plan::kNormTransposeThreads, &resident);
      !e.success()) {
    return e;
  }
  return Launch(op, NormTransposeKernel, tiles < resident ? tiles : resident,
                plan::kNormTransposeThreads, stream, static_cast<const uint8_t*>(q.untyped_data()),
                static_cast<uint8_t*>(qt.untyped_data()), s.groups, s.rows, s.h);
}

ffi::Error LayerNormForwardFp8(cudaStream_t stream, sig::Any x, sig::Any gamma, sig::Any beta,
                               sig::F32 scale, float eps, int64_t zcg, sig::AnyOut q,
                               sig::AnyOut qt, F32Out scale_inv, F32Out amax, F32Out mu,
                               F32Out rs) {
  return ForwardFp8Impl("layernorm_forward_fp8", true, stream, x, gamma, &beta, scale, eps, zcg, *q,
                        *qt, scale_inv, amax, mu->typed_data(), rs->typed_data(),
                        mu->element_count());
}

ffi::Error RmsNormForwardFp8(cudaStream_t stream, sig::Any x, sig::Any gamma, sig::F32 scale,
                             float eps, int64_t zcg, sig::AnyOut q, sig::AnyOut qt,
                             F32Out scale_inv, F32Out amax, F32Out mu, F32Out rs) {
  return ForwardFp8Impl("rmsnorm_forward_fp8", false, stream, x, gamma, nullptr, scale, eps, zcg,
                        *q, *qt, scale_inv, amax, mu->typed_data(), rs->typed_data(),
                        mu->element_count());
}

template <WideKind W, bool kLayer, bool kVector>
ffi::Error LaunchBackward(const char* op, cudaStream_t stream, const BwdArgs& a) {
  return Launch(op, NormBackwardKernel<W, kVector, kLayer>, a.p.grid, a.p.threads, stream, a);
}

ffi::Error NormBackward(cudaStream_t stream, sig::Any dy, sig::Any x, sig::F32 mu, sig::F32 rs,
                        sig::Any gamma, int64_t norm_type, int64_t zero_centered, sig::AnyOut dx,
                        F32Out dgamma, F32Out dbeta, F32Out workspace) {
  const char* op = kNormBackwardOp;
  NormShape s;
  FP8JAX_RETURN_IF_ERROR(
      CheckNormBackward(dy, x, mu, rs, gamma, norm_type, *dx, *dgamma, *dbeta, &s));
  const int64_t ws_slots = workspace->element_count() / (s.groups * 2 * s.h);
  if (ws_slots < 1 || workspace->element_count() != s.groups * ws_slots * 2 * s.h) {
    return BadArg(op, "workspace must be [groups, slots, 2, h]");
  }
  const int eb = ElemBytes(x.element_type());
  const bool aligned =
      RowsAligned(s.h, eb, {dy.untyped_data(), x.untyped_data(), dx->untyped_data()});
  BwdArgs a{};
  a.dy = dy.untyped_data();
  a.x = x.untyped_data();
  a.mu = mu.typed_data();
  a.rs = rs.typed_data();
  a.gamma = gamma.untyped_data();
  a.gamma_kind = WideKindOf(gamma.element_type());
  a.params_like_x = ParamsLikeX(x.element_type(), gamma, nullptr, aligned);
  a.zero_centered = zero_centered != 0;
  a.groups = s.groups;
  a.rows = s.rows;
  a.h = s.h;
  a.ws_slots = ws_slots;
  a.dx = dx->untyped_data();
  a.ws = workspace->typed_data();
  a.p = plan::PlanNorm(s.rows, s.h, eb, aligned, 0, ws_slots);
  if (!a.p.backward_ok) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      "fp8jax norm_backward: hidden size " + std::to_string(s.h) +
                          " is too large for the CUDA kernel (at most " +
                          std::to_string(plan::kNormMaxThreadElems * plan::kNormMaxRowThreads) +
                          "); use implementation='xla' for the norm family");
  }
  if (s.rows > 0 && !plan::NormWorkspaceFits(a.p, ws_slots)) {
    return BadArg(op, "workspace must have at least " + std::to_string(a.p.slots) +
                          " slots per group for h = " + std::to_string(s.h) + " (got " +
                          std::to_string(ws_slots) + ")");
  }
  const bool layer = norm_type == static_cast<int64_t>(NormType::kLayerNorm);
  if (s.rows > 0) {
    auto err = DispatchWide(op, WideKindOf(x.element_type()), [&]<WideKind W>() {
      if (!a.p.vector) {
        return layer ? LaunchBackward<W, true, false>(op, stream, a)
                     : LaunchBackward<W, false, false>(op, stream, a);
      }
      return layer ? LaunchBackward<W, true, true>(op, stream, a)
                   : LaunchBackward<W, false, true>(op, stream, a);
    });
    if (!err.success()) return err;
  }
  // dgamma/dbeta: each group's [slots, 2h] partials, summed per column (no rows: zeros).
  TotalsArgs t;
  t.in = a.ws;
  t.matrices = s.groups;
  t.stride_rows = ws_slots;
  t.rows = s.rows > 0 ? a.p.slots : 0;
  t.cols = 2 * s.h;
  t.split = s.h;
  t.out0 = dgamma->typed_data();
  t.out1 = dbeta->typed_data();
  return LaunchColumnTotals(op, stream, t);
}

}  // namespace

ffi::Error NormStats(const char* op, bool layer, cudaStream_t stream, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, float eps,
                     bool zero_centered, const NormShape& s, float* mu, float* rsigma) {
  return LaunchPlainForward(op, layer, stream, x, gamma, beta, eps, zero_centered, s, nullptr, mu,
                            rsigma);
}

}  // namespace fp8jax

FP8JAX_CUDA_HANDLER(LayerNormForward, fp8jax::LayerNormForward);
FP8JAX_CUDA_HANDLER(RmsNormForward, fp8jax::RmsNormForward);
FP8JAX_CUDA_HANDLER(LayerNormForwardFp8, fp8jax::LayerNormForwardFp8);
FP8JAX_CUDA_HANDLER(RmsNormForwardFp8, fp8jax::RmsNormForwardFp8);
FP8JAX_CUDA_HANDLER(NormBackward, fp8jax::NormBackward);
