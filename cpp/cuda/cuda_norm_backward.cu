// CUDA FFI handler of the norms' backward (LayerNorm and RMSNorm): dx, and dgamma/dbeta summed in a
// fixed order (deterministic). Same target name and numerics as cpp/cpu/cpu_norm_backward.cc.
//
// Each row group (common/norm_plan.h) is a slot: it runs its rows in order, writes dx, and keeps
// its columns' dgamma/dbeta partials in registers, then writes them as its row of a workspace;
// the column-totals kernel (cuda_column_totals.cuh) adds the slots. The handler allocates
// nothing and enqueues the same work for the same shapes (CUDA-graph compatible).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/norm_plan.h"
#include "common/norm_row.h"
#include "common/wide.h"
#include "cuda/cuda_column_totals.cuh"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_norm_row.cuh"
#include "cuda/cuda_util.h"
#include "ops/norms.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

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

// ------------------------------------------------------------------ handler

template <WideKind W, bool kLayer, bool kVector>
ffi::Error LaunchBackward(const char* op, cudaStream_t stream, const BwdArgs& a) {
  return Launch(op, NormBackwardKernel<W, kVector, kLayer>, a.p.grid, a.p.threads, stream, a);
}

}  // namespace

ffi::Error NormBackward::Compute(CudaStream stream) {
  const char* op = kName;
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

}  // namespace fp8jax
