// Pass 2 of the deterministic column sums: dbias of the cast_transpose family
// (the tiles' partial rows) and dgamma/dbeta of the norm backward (the slots'
// partial rows), in the order of plan::kColumnLanes (common/launch_plan.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/fp8_numerics.h"
#include "common/launch_plan.h"
#include "cuda/cuda_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// Where pass 2 reads and writes. in: `matrices` blocks of `stride_rows` rows
// of `cols` floats, of which the first `rows` are added. Column c of matrix m
// goes to out0[m * split + c] when c < split, else to
// out1[m * (cols - split) + c - split] (the norm's [dgamma | dbeta] rows).
struct TotalsArgs {
  const float* in = nullptr;
  int64_t matrices = 0;
  int64_t stride_rows = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t split = 0;
  float* out0 = nullptr;
  float* out1 = nullptr;
};

// One item (kTotalsColumns columns of a matrix) per block and step: thread
// (lane, c) adds its lane's rows of column c, the lane sums meet in shared
// memory (a warp's two lanes hit 32 distinct banks) and lane 0 adds them in
// order. The item loop is block-uniform, so the barriers are reached by all.
// (A template, so that every .cu including this header may instantiate it.)
template <int kUnused = 0>
__global__ void __launch_bounds__(plan::kThreads) ColumnTotalsKernel(TotalsArgs a) {
  __shared__ float lanes[plan::kColumnLanes][plan::kTotalsColumns];
  const int c = threadIdx.x % plan::kTotalsColumns;
  const int lane = threadIdx.x / plan::kTotalsColumns;
  const int64_t items = plan::TotalsItems(a.matrices, a.cols);
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const plan::TotalsSlot ts = plan::TotalsSlotAt(item, a.cols);
    const int64_t col = ts.col + c;
    float acc = 0.0f;
    if (col < a.cols) {
      const float* p = a.in + ts.mat * a.stride_rows * a.cols + col;
      for (int64_t r = lane; r < a.rows; r += plan::kColumnLanes)
        acc = __fadd_rn(acc, p[r * a.cols]);
    }
    lanes[lane][c] = acc;
    __syncthreads();
    if (lane == 0 && col < a.cols) {
      float total = 0.0f;
#pragma unroll
      for (int l = 0; l < plan::kColumnLanes; ++l) total = __fadd_rn(total, lanes[l][c]);
      total = CanonicalNan(total);
      if (col < a.split) {
        a.out0[ts.mat * a.split + col] = total;
      } else {
        a.out1[ts.mat * (a.cols - a.split) + col - a.split] = total;
      }
    }
    __syncthreads();  // these reads before the next item's writes
  }
}

// Enqueues pass 2 (nothing to do without columns).
inline ffi::Error LaunchColumnTotals(const char* op, cudaStream_t stream, const TotalsArgs& a) {
  const int64_t items = plan::TotalsItems(a.matrices, a.cols);
  if (items == 0) return ffi::Error::Success();
  return PlanAndLaunch(
      op, ColumnTotalsKernel<>, stream,
      [items](int64_t resident) {
        return plan::Clamp(items, 1, plan::Clamp(resident, 1, plan::kMaxGridX));
      },
      a);
}

}  // namespace fp8jax
