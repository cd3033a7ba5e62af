// The CUDA computations of the block-scaled casts (ops/block_casts.h): block_quantize,
// block_cast_transpose and its fused forms, block_cast_transpose_dbias,
// activation_block_cast_transpose and dactivation_block_cast_transpose_dbias (same targets and bits
// as cpp/cpu/cpu_block_scaling.cc; the numerics and layouts are common/block_scale.h's, what the
// fused forms quantize and the dbias order common/block_sources.h's).
//
// One kernel, BlockCastKernel, writes one layout of the values of a source (x, or the activation
// of the MLP's first GEMM output or its gradient, computed as it is read): each thread block walks
// 128 x 128 tiles (whole blocks each, as block::KernelBlock requires) in three steps, with a
// barrier between them:
//   1. amax: the tile is cut into units of br rows x 32 columns, one warp per unit; each lane
//      takes the max down its column (a warp reads 32 consecutive elements of a row at a time)
//      and the lanes of one block combine theirs with xor shuffles; one lane per block and unit
//      stores the partial max in shared memory (each slot has one writer; no atomics);
//   2. scales: one thread per block combines its units' partial maxima (bc / 32 of them when
//      bc > 32), makes the scale, stores its inverse (or the E8M0 exponent) in the grid and the
//      scale in shared memory;
//   3. codes: row-major over the tile for the [M, K] layout; column by column for the transposed
//      [K, M] layout, so that a warp writes 32 consecutive codes (the reads hit the tile step 1
//      brought into the cache);
//   4. with dbias, in the [M, K] launch only: one thread per column adds the tile's rows in the
//      dbias order into the workspace (a warp reads 32 consecutive elements of a row at a time);
//      the column totals kernel of the other dbias ops adds the tiles.
// The two-layout ops launch it twice: the blocks br x bc into q, and bc x br transposed into q_t
// (a fused source is computed once per layout, never stored). Ragged edges: elements past the
// matrix count as 0 for the amax and are not written.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/block_scale.h"
#include "common/block_sources.h"
#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "common/wide.h"
#include "cuda/cuda_column_totals.cuh"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_norm.h"
#include "cuda/cuda_util.h"
#include "ops/block_casts.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

using block::ActSource;
using block::DActSource;
using block::DirectSource;
using block::NormSource;

constexpr int kTile = static_cast<int>(block::kTile);
constexpr int kBlockThreads = 256;
constexpr int kWarps = kBlockThreads / 32;
constexpr int kUnitCols = 32;

// The code of x under its block's scale (f32 modes: the scale; E8M0: the exponent's bits).
template <typename F>
__device__ __forceinline__ uint8_t BlockCode(float x, uint32_t scale_bits, bool e8m0) {
  const auto cvt = [](float v, float s) { return CvtFp8<F>(v, s); };
  if (!e8m0) return cvt(x, __uint_as_float(scale_bits));
  return block::MxQuantizeValue<F>(x, static_cast<uint8_t>(scale_bits), cvt);
}

// At least 4 resident blocks per SM (64 registers a thread): without the bound, ptxas for sm_121
// kept the float16 instances at 40 registers and spilled 4 bytes. 3 (85 registers) for the
// norm's source, whose y needs more: at 64, the compute_90 PTX JIT-compiled for sm_120/121 spilled
// 12 bytes in the float32 RMSNorm instances.
template <typename Source>
constexpr int kMinBlocks = 4;
template <WideKind W, typename H, bool kLayer>
constexpr int kMinBlocks<NormSource<W, H, kLayer>> = 3;

template <WideKind W, typename F, typename Source>
__global__ void __launch_bounds__(kBlockThreads, kMinBlocks<Source>)
    BlockCastKernel(Source src, uint8_t* __restrict__ q, void* __restrict__ scale_inv,
                    block::Cast c, float* __restrict__ partial) {
  __shared__ uint32_t maxima[block::kMaxTileBlocks];
  __shared__ uint32_t scale_bits[block::kMaxTileBlocks];
  const int br = static_cast<int>(c.br), bc = static_cast<int>(c.bc);
  const int lanes_per_block = bc < kUnitCols ? bc : kUnitCols;  // lanes of a unit in one block
  const int units = (kTile / br) * (kTile / kUnitCols);
  const int parts = bc > kUnitCols ? bc / kUnitCols : 1;  // units a block spans
  const int blocks_per_row = kTile / bc, tile_blocks = (kTile / br) * blocks_per_row;
  const bool e8m0 = c.mode == block::ScaleMode::kE8m0;
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t tiles_per_matrix = c.TileRows() * c.TileCols();
  for (int64_t t = blockIdx.x; t < c.Tiles(); t += gridDim.x) {
    const int64_t g = t / tiles_per_matrix;
    const int64_t r0 = (t % tiles_per_matrix) / c.TileCols() * kTile;
    const int64_t c0 = t % c.TileCols() * kTile;
    // 1. each unit's partial block maxima
    for (int u = warp; u < units; u += kWarps) {
      const int64_t row = r0 + u / (kTile / kUnitCols) * br;
      const int64_t col = c0 + u % (kTile / kUnitCols) * kUnitCols + lane;
      uint32_t m = 0;
      for (int r = 0; r < br; ++r) {
        if (row + r < c.rows && col < c.cols) {
          m = max(m, block::AmaxBits(src(g, row + r, col)));
        }
      }
      for (int width = 1; width < lanes_per_block; width *= 2) {
        const float other = __shfl_xor_sync(0xFFFFFFFFu, __uint_as_float(m), width);
        m = max(m, __float_as_uint(other));
      }
      if (lane % lanes_per_block == 0) {
        // slot (part k of block b) at k * tile_blocks + b: the lanes that store write
        // consecutive words, and step 2's threads read consecutive words
        const int i = u / (kTile / kUnitCols), col0 = u % (kTile / kUnitCols) * kUnitCols + lane;
        const int k = bc > kUnitCols ? col0 % bc / kUnitCols : 0;
        maxima[k * tile_blocks + i * blocks_per_row + col0 / bc] = m;
      }
    }
    __syncthreads();
    // 2. the scales: block b (row i, column j of the tile's blocks) has bc / 32 partial maxima
    // when bc > 32 (one per unit it spans), else one
    for (int b = static_cast<int>(threadIdx.x); b < tile_blocks; b += kBlockThreads) {
      const int i = b / blocks_per_row, j = b % blocks_per_row;
      uint32_t m = 0;
      for (int k = 0; k < parts; ++k) m = max(m, maxima[k * tile_blocks + b]);
      const float amax = __uint_as_float(m);
      const int64_t gi = r0 / br + i, gj = c0 / bc + j;
      const bool in_grid = gi < c.GridRows() && gj < c.GridCols();
      if (e8m0) {
        const uint8_t e = block::E8m0Exponent(amax, F::kMax);
        scale_bits[b] = e;
        if (in_grid) static_cast<uint8_t*>(scale_inv)[c.ScaleIndex(g, gi, gj)] = e;
      } else {
        const float s = block::BlockScale(amax, F::kMax, block::InputMax<W>(),
                                          c.mode == block::ScaleMode::kPow2, c.epsilon);
        scale_bits[b] = __float_as_uint(s);
        if (in_grid)
          static_cast<float*>(scale_inv)[c.ScaleIndex(g, gi, gj)] = block::InverseScale(s);
      }
    }
    __syncthreads();
    // 3. the codes, in the order of the layout written
    for (int e = static_cast<int>(threadIdx.x); e < kTile * kTile; e += kBlockThreads) {
      const int r = c.transposed ? e % kTile : e / kTile;
      const int col = c.transposed ? e / kTile : e % kTile;
      if (r0 + r < c.rows && c0 + col < c.cols) {
        const float v = src(g, r0 + r, c0 + col);
        const uint32_t s = scale_bits[r / br * blocks_per_row + col / bc];
        q[c.CodeIndex(g, r0 + r, c0 + col)] = BlockCode<F>(v, s, e8m0);
      }
    }
    // 4. with dbias (the untransposed launch): the tile's column sums, one thread per column
    if (partial != nullptr) {
      for (int col = static_cast<int>(threadIdx.x); col < kTile; col += kBlockThreads) {
        if (c0 + col < c.cols) {
          partial[(g * c.TileRows() + r0 / kTile) * c.cols + c0 + col] =
              block::TileColumnSum(src, g, r0, c.rows, c0 + col);
        }
      }
    }
    __syncthreads();  // the next tile reuses maxima and scale_bits
  }
}

// One layout of the cast of `src` (with `partial`: and the tiles' dbias partials).
template <WideKind W, typename F, typename Source>
ffi::Error BlockCast(cudaStream_t stream, const char* op, const Source& src, const block::Cast& c,
                     ffi::AnyBuffer& q, ffi::AnyBuffer& scale_inv, float* partial = nullptr) {
  if (c.Tiles() == 0) return ffi::Error::Success();
  auto* kernel = BlockCastKernel<W, F, Source>;
  int64_t resident = 0;
  FP8JAX_RETURN_IF_ERROR(
      ResidentBlocks(op, reinterpret_cast<const void*>(kernel), kBlockThreads, &resident));
  const int64_t grid = c.Tiles() < resident ? c.Tiles() : resident;
  return Launch(op, kernel, grid, kBlockThreads, stream, src,
                static_cast<uint8_t*>(q.untyped_data()), scale_inv.untyped_data(), c, partial);
}

// Both layouts of the cast of `src`, and with `dbias` its column sums (the partials from the
// first launch, then the column totals kernel of the other dbias ops: the same order).
template <WideKind W, typename F, typename Source>
ffi::Error BlockCastBoth(cudaStream_t stream, const char* op, const Source& src,
                         const block::Cast& c, const block::Cast& ct, ffi::AnyBuffer& q,
                         ffi::AnyBuffer& scale_inv, ffi::AnyBuffer& qt, ffi::AnyBuffer& scale_inv_t,
                         float* dbias = nullptr, float* partial = nullptr) {
  const auto rows = BlockCast<W, F>(stream, op, src, c, q, scale_inv, partial);
  FP8JAX_RETURN_IF_ERROR(rows);
  const auto cols = BlockCast<W, F>(stream, op, src, ct, qt, scale_inv_t);
  FP8JAX_RETURN_IF_ERROR(cols);
  if (dbias == nullptr) return ffi::Error::Success();
  TotalsArgs t;
  t.in = partial;
  t.matrices = c.groups;
  t.stride_rows = t.rows = c.TileRows();
  t.cols = t.split = c.cols;
  t.out0 = dbias;
  return LaunchColumnTotals(op, stream, t);
}

}  // namespace

ffi::Error BlockQuantize::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           const DirectSource<W, FastHalf> src{x.untyped_data(), c.rows, c.cols};
                           return BlockCast<W, F>(stream, op, src, c, *q, *scale_inv);
                         });
}

ffi::Error BlockCastTranspose::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           const DirectSource<W, FastHalf> src{x.untyped_data(), c.rows, c.cols};
                           return BlockCastBoth<W, F>(stream, op, src, c, ct, *q, *scale_inv, *qt,
                                                      *scale_inv_t);
                         });
}

ffi::Error BlockCastTransposeDbias::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           const DirectSource<W, FastHalf> src{x.untyped_data(), c.rows, c.cols};
                           return BlockCastBoth<W, F>(stream, op, src, c, ct, *q, *scale_inv, *qt,
                                                      *scale_inv_t, dbias->typed_data(),
                                                      workspace->typed_data());
                         });
}

ffi::Error ActivationBlockCastTranspose::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(
      op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        return act::Dispatch(code, gated, [&]<int A, bool G>() {
          const ActSource<W, FastHalf, A, G> src{x.untyped_data(), c.rows, c.cols};
          return BlockCastBoth<W, F>(stream, op, src, c, ct, *q, *scale_inv, *qt, *scale_inv_t);
        });
      });
}

ffi::Error DActivationBlockCastTransposeDbias::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return act::Dispatch(code, gated, [&]<int A, bool G>() {
                             const DActSource<W, FastHalf, A, G> src{
                                 g.untyped_data(), x.untyped_data(), c.rows, c.cols};
                             return BlockCastBoth<W, F>(stream, op, src, c, ct, *q, *scale_inv, *qt,
                                                        *scale_inv_t, dbias->typed_data(),
                                                        workspace->typed_data());
                           });
                         });
}

// The norm's statistics (cuda_norm.cu's forward kernel, writing no y), then the cast of y as the
// block kernel computes it from them (NormSource): y never goes to memory.
ffi::Error NormBlockCastTranspose::Compute(CudaStream stream) {
  const char* op = kName;
  const bool layer = norm_type == static_cast<int64_t>(NormType::kLayerNorm);
  FP8JAX_RETURN_IF_ERROR(NormStats(op, layer, stream, x, gamma, layer ? &beta : nullptr,
                                   norm_epsilon, zero_centered != 0, s, mu->typed_data(),
                                   rsigma->typed_data()));
  const auto cast = [&]<WideKind W, typename F, bool kLayer>() {
    const NormSource<W, FastHalf, kLayer> src{x.untyped_data(),
                                              mu->typed_data(),
                                              rsigma->typed_data(),
                                              gamma.untyped_data(),
                                              beta.untyped_data(),
                                              WideKindOf(gamma.element_type()),
                                              WideKindOf(beta.element_type()),
                                              zero_centered != 0,
                                              gamma.element_count() > s.h,
                                              c.rows,
                                              c.cols};
    return BlockCastBoth<W, F>(stream, op, src, c, ct, *q, *scale_inv, *qt, *scale_inv_t);
  };
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return layer ? cast.template operator()<W, F, true>()
                                        : cast.template operator()<W, F, false>();
                         });
}

}  // namespace fp8jax
