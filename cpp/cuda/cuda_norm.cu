// The CUDA computations of the norms' forwards (ops/norms.h): LayerNorm / RMSNorm, and the forward
// fused with the FP8 cast (q; q_t by a second, byte-transpose pass). The backward is
// cuda_norm_backward.cu's, the row access and reductions both use cuda_norm_row.cuh's.
//
// Same numerics as cpp/cpu/cpu_norm.cc: the per-element and
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
// Every computation allocates nothing, never synchronises the host and enqueues the same work
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
#include "common/wide.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_norm.h"
#include "cuda/cuda_norm_row.cuh"
#include "cuda/cuda_util.h"
#include "ops/norms.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

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

}  // namespace

ffi::Error NormForward::Compute(CudaStream stream) {
  return LaunchPlainForward(op, layer, stream, x, gamma, beta, eps, zero_centered != 0, s,
                            y->untyped_data(), mu->typed_data(), rs->typed_data());
}

ffi::Error NormForwardFp8::Compute(CudaStream stream) {
  float* scale_inv_out = scale_inv->typed_data();
  float* amax_out = amax->typed_data();
  if (const cudaError_t err = cudaMemsetAsync(amax_out, 0, s.groups * sizeof(float), stream);
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
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.scale = scale.typed_data();
  a.amax_bits = reinterpret_cast<uint32_t*>(amax_out);
  a.scale_inv = scale_inv_out;
  a.groups = s.groups;
  a.mu = mu->typed_data();
  a.rs = rs->typed_data();
  const bool aligned = RowsAligned(s.h, ElemBytes(x.element_type()), {a.x, a.q});
  a.params_like_x = ParamsLikeX(x.element_type(), gamma, beta, aligned);
  // The row kernel runs even for empty tensors: it writes scale_inv.
  auto err = DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
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
                plan::kNormTransposeThreads, stream, static_cast<const uint8_t*>(q->untyped_data()),
                static_cast<uint8_t*>(qt->untyped_data()), s.groups, s.rows, s.h);
}

ffi::Error NormStats(const char* op, bool layer, cudaStream_t stream, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, float eps,
                     bool zero_centered, const NormShape& s, float* mu, float* rsigma) {
  return LaunchPlainForward(op, layer, stream, x, gamma, beta, eps, zero_centered, s, nullptr, mu,
                            rsigma);
}

}  // namespace fp8jax
