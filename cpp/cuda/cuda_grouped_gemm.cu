// The CUDA computation of the ragged grouped GEMM (ops/gemms.h): a correctness path with exact
// float32 sums on the CUDA cores (no tensor cores), the bits of cpp/cpu/cpu_grouped_gemm.cc (the
// numerics and the group walk are common/grouped_gemm.h's).
//
// One launch, no host synchronisation: the group sizes are read on the device. Each thread block
// walks output tiles of kTileRows x kTileCols (a grid-stride loop over as many blocks as the
// device holds at once): in the rows form, tile t is grouped::RowTileAt's (each group's rows cut
// into tiles, so no tile mixes two groups and no group computes another's rows; at most
// ceil(M / kTileRows) + G row tiles, the last ones past the sum written as +0); in the contracting
// form, (group, row tile, column tile) over the [G, K, N] output, each group's columns found by
// grouped::SpanOf. A tile walks its contraction in chunks of kDepth: the block's threads load
// the chunk of A and of B (32 consecutive codes of a row per warp), dequantize them as they load
// (grouped::Operand) and store them transposed in shared memory, [kDepth][kTileRows + 1] (the pad
// makes the transposed stores hit 32 banks); after a barrier each thread adds kDepth products into
// its 4 x 4 sums (rows ty + 16 i, columns tx + 16 j: each warp reads 2 words of A and 16 of B per
// step, no bank conflict), t ascending, with grouped::Accumulate. Elements past the matrix or past
// the group's columns load as 0: their sums are dropped, or the product 0 * 0 adds +0, which
// leaves every sum's bits as they were (a sum from +0 is never -0).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "common/grouped_gemm.h"
#include "common/launch_plan.h"
#include "common/wide.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_util.h"
#include "ops/gemms.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

using grouped::Gemm;
using grouped::Span;

constexpr int kTileRows = 64;
constexpr int kTileCols = 64;
constexpr int kDepth = 32;                          // one code per lane of a warp
constexpr int kLoadRows = plan::kThreads / kDepth;  // 8 rows per load pass
constexpr int kSide = 16;                           // 16 x 16 threads, 4 x 4 sums each
constexpr int kPer = kTileRows / kSide;             // 4
static_assert(kTileRows == kTileCols && kSide * kSide == plan::kThreads);

template <WideKind W, typename FA, typename FB>
__global__ void __launch_bounds__(plan::kThreads)
    GroupedGemmKernel(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                      const int32_t* __restrict__ sizes, const void* __restrict__ a_scale,
                      const void* __restrict__ b_scale, void* __restrict__ out, Gemm p,
                      int64_t tiles) {
  __shared__ float as[kDepth][kTileRows + 1];
  __shared__ float bs[kDepth][kTileCols + 1];
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % kSide, ty = tid / kSide;
  const int lt = tid % kDepth, lr = tid / kDepth;  // the load's contraction lane and first row
  const int64_t col_tiles = plan::CeilDiv(p.cols, kTileCols);
  const int64_t row_tiles = plan::CeilDiv(p.rows, kTileRows);
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t rt = tile / col_tiles, j0 = tile % col_tiles * kTileCols;
    int64_t g = 0, i0 = 0, rows = 0;
    Span s{0, p.depth, 0};
    if (p.form == grouped::kRows) {
      const grouped::RowTile t = grouped::RowTileAt(sizes, p.groups, p.ragged, kTileRows, rt);
      g = t.group;
      i0 = t.row0;
      rows = t.rows;
    } else {
      g = rt / row_tiles;
      i0 = rt % row_tiles * kTileRows;
      rows = p.rows - i0 < kTileRows ? p.rows - i0 : kTileRows;
      s = grouped::SpanOf(sizes, g, p.ragged, p.width);
    }
    if (rows <= 0) continue;  // a row tile past the last (the same for the whole block)
    const int64_t cols = p.cols - j0 < kTileCols ? p.cols - j0 : kTileCols;
    if (g == p.groups) {  // rows past the sum: +0
      for (int e = tid; e < rows * cols; e += plan::kThreads) {
        StoreWide<W, FastHalf>(out, grouped::OutIndex(p, 0, i0 + e / cols, j0 + e % cols), 0.0f);
      }
      continue;
    }
    float acc[kPer][kPer] = {};
    const int64_t end = s.begin + s.size;
    for (int64_t t0 = s.begin; t0 < end; t0 += kDepth) {
      const int64_t t = t0 + lt;
      for (int k = 0; k < kTileRows / kLoadRows; ++k) {
        const int r = lr + kLoadRows * k;
        float va = 0.0f, vb = 0.0f;
        if (t < end && r < rows) {
          const int64_t i = i0 + r;
          va = grouped::Operand<FA>(p, a[grouped::ACode(p, i, t)], a_scale,
                                    p.blocks ? grouped::AScale(p, s, i, t) : 0);
        }
        if (t < end && r < cols) {
          const int64_t j = j0 + r;
          vb = grouped::Operand<FB>(p, b[grouped::BCode(p, g, j, t)], b_scale,
                                    p.blocks ? grouped::BScale(p, s, g, j, t) : 0);
        }
        as[lt][r] = va;
        bs[lt][r] = vb;
      }
      __syncthreads();
#pragma unroll 4
      for (int k = 0; k < kDepth; ++k) {
        float va[kPer], vb[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) va[i] = as[k][ty + kSide * i];
#pragma unroll
        for (int j = 0; j < kPer; ++j) vb[j] = bs[k][tx + kSide * j];
#pragma unroll
        for (int i = 0; i < kPer; ++i) {
#pragma unroll
          for (int j = 0; j < kPer; ++j) acc[i][j] = grouped::Accumulate(acc[i][j], va[i], vb[j]);
        }
      }
      __syncthreads();
    }
    const float gs = grouped::GroupScale(p, static_cast<const float*>(a_scale),
                                         static_cast<const float*>(b_scale), g);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int r = ty + kSide * i, c = tx + kSide * j;
        if (r < rows && c < cols) {
          StoreWide<W, FastHalf>(out, grouped::OutIndex(p, g, i0 + r, j0 + c),
                                 grouped::Finish(p, acc[i][j], gs));
        }
      }
    }
  }
}

}  // namespace

ffi::Error GroupedGemm::Compute(CudaStream stream) {
  if (p.OutputSize() == 0) return ffi::Error::Success();
  const int64_t col_tiles = plan::CeilDiv(p.cols, kTileCols);
  const int64_t row_tiles = p.form == grouped::kRows
                                ? grouped::RowTiles(p.ragged, p.groups, kTileRows)
                                : p.groups * plan::CeilDiv(p.rows, kTileRows);
  const int64_t tiles = row_tiles * col_tiles;
  return Dispatch([&]<WideKind W, typename FA, typename FB>() {
    return PlanAndLaunch(
        kName, GroupedGemmKernel<W, FA, FB>, stream,
        [tiles](int64_t resident) { return plan::Clamp(tiles, 1, resident); },
        static_cast<const uint8_t*>(a.untyped_data()),
        static_cast<const uint8_t*>(b.untyped_data()),
        static_cast<const int32_t*>(group_sizes.untyped_data()), a_scale_inv.untyped_data(),
        b_scale_inv.untyped_data(), out->untyped_data(), p, tiles);
  });
}

// Command-buffer (CUDA graph) compatible: each call enqueues the same launch for the same shapes,
// with no allocation and no host synchronisation (the group sizes never leave the device).

}  // namespace fp8jax
