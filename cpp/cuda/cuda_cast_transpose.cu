// The CUDA computations of cast_transpose and cast_transpose_dbias (ops/casts.h), the kernel of
// cuda_cast_transpose.cuh reading x itself.
//
// Same numerics as the CPU computations. Each runs on XLA's stream, never synchronises the host,
// reports launch failures as ffi::Error, and allocates nothing (command-buffer compatible).
// cast_transpose_dbias reads g once: the cast_transpose kernel also writes
// each 128-row tile's column sums to a workspace (a buffer XLA allocates, the
// op's last operand, aliased to its last result), and a second, small kernel
// adds them in order (deterministic).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "cuda/cuda_cast_transpose.cuh"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "ops/casts.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

ffi::Error CastTranspose::Compute(CudaStream stream) {
  const char* op = kName;
  return DispatchWideFp8(op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return LaunchCastTransposeOf<W, F, false>(
                               op, stream, DirectSource<W>{x.untyped_data()},
                               Addr(x.untyped_data()), s, scale.typed_data(), q->untyped_data(),
                               qt->untyped_data(), scale_inv->typed_data(), amax->typed_data(),
                               nullptr);
                         });
}

// The kernel's 128-row tiles write the workspace's partial rows (kDbiasTileRows each).
ffi::Error CastTransposeDbias::Compute(CudaStream stream) {
  const char* op = kName;
  float* partial = workspace->typed_data();
  if (auto err = DispatchWideFp8(op, WideKindOf(g.element_type()), Fp8KindOf(q->element_type()),
                                 [&]<WideKind W, typename F>() {
                                   return LaunchCastTransposeOf<W, F, true>(
                                       op, stream, DirectSource<W>{g.untyped_data()},
                                       Addr(g.untyped_data()), s, scale.typed_data(),
                                       q->untyped_data(), qt->untyped_data(),
                                       scale_inv->typed_data(), amax->typed_data(), partial);
                                 });
      !err.success()) {
    return err;
  }
  return LaunchColumnTotals(op, stream, partial, s, dbias->typed_data());
}

// Both are command-buffer (CUDA graph) compatible: the same memset and
// launches for the same shapes, no allocation, no host synchronisation.

// transpose: tiles of kTransposeTile x kTransposeTile codes through shared memory, a grid-stride
// loop over (matrix, row tile, column tile). kVec: x's rows and x_t's rows are whole 4-byte words
// (cols and rows multiples of 4), so each thread moves words; otherwise bytes.
//
// The word path's tile is kTransposeTile rows of kTransposeWords words, word w of row r stored at
// w ^ ((r / 4) % kTransposeWords) (an XOR swizzle): a warp stores two rows' words (two halves of
// the banks), and reads byte rows 4w + b of one word column for eight w, which the swizzle puts in
// eight banks; four lanes share each word (the four bytes of a word of x_t's row). So no access
// has a bank conflict. The byte path pads its rows by a word: a warp stores one row's bytes and
// reads one column's, 32 rows 17 words apart.
namespace {

constexpr int kTransposeTile = 64;
constexpr int kTransposeWords = kTransposeTile / 4;

__device__ __forceinline__ int Swizzled(int r, int w) {
  return w ^ ((r >> 2) & (kTransposeWords - 1));
}

// The word path's read order: index i of a tile's kTransposeTile * kTransposeWords words of x_t
// -> (column c of the tile, word w of its transposed row): per warp, four columns (one word of
// x's rows) by eight words of x_t's rows.
struct ReadSlot {
  int c, w;
};
__device__ __forceinline__ ReadSlot ReadOrder(int i) {
  return {4 * (i / 64) + (i / 8) % 4, i % 8 + 8 * ((i / 32) % 2)};
}

// Where a tile's rows come from: x's rows [r0, r0 + kTransposeTile) clipped to `rows` (transpose),
// or a shared list of source rows, -1 for a row of zeros (transpose_padded).
struct SourceRows {
  const int64_t* list;  // nullptr: consecutive rows from r0
  int64_t r0, rows;
  __device__ __forceinline__ int64_t operator()(int r) const {
    if (list != nullptr) return list[r];
    return r0 + r < rows ? r0 + r : -1;
  }
};

// One tile of the word path: kTransposeTile of x's rows (`src_row`) into x_t's columns
// [t0, t0 + kTransposeTile) of its rows [c0, c0 + kTransposeTile).
__device__ __forceinline__ void WordTile(uint32_t (*tile)[kTransposeWords], const uint8_t* in,
                                         int64_t cols, int64_t c0, SourceRows src_row, uint8_t* out,
                                         int64_t out_ld, int64_t t0, int64_t t_end) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < kTransposeTile * kTransposeWords; i += plan::kThreads) {
    const int r = i / kTransposeWords, w = i % kTransposeWords;
    const int64_t from = src_row(r);
    if (c0 + 4 * w < cols) {
      tile[r][Swizzled(r, w)] =
          from < 0 ? 0u : *reinterpret_cast<const uint32_t*>(in + from * cols + c0 + 4 * w);
    }
  }
  __syncthreads();
  for (int i = tid; i < kTransposeTile * kTransposeWords; i += plan::kThreads) {
    const ReadSlot slot = ReadOrder(i);
    if (c0 + slot.c < cols && t0 + 4 * slot.w < t_end) {
      uint32_t v = 0;
      for (int b = 0; b < 4; ++b) {
        const int r = 4 * slot.w + b;
        const uint32_t word = tile[r][Swizzled(r, slot.c >> 2)];
        v |= ((word >> (8 * (slot.c & 3))) & 0xFFu) << (8 * b);
      }
      *reinterpret_cast<uint32_t*>(out + (c0 + slot.c) * out_ld + t0 + 4 * slot.w) = v;
    }
  }
}

// The byte path's tile, likewise.
__device__ __forceinline__ void ByteTile(uint8_t (*tile)[kTransposeTile + 4], const uint8_t* in,
                                         int64_t cols, int64_t c0, SourceRows src_row, uint8_t* out,
                                         int64_t out_ld, int64_t t0, int64_t t_end) {
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < kTransposeTile * kTransposeTile; i += plan::kThreads) {
    const int r = i / kTransposeTile, c = i % kTransposeTile;
    const int64_t from = src_row(r);
    if (c0 + c < cols) tile[r][c] = from < 0 ? 0 : in[from * cols + c0 + c];
  }
  __syncthreads();
  for (int i = tid; i < kTransposeTile * kTransposeTile; i += plan::kThreads) {
    const int c = i / kTransposeTile, r = i % kTransposeTile;
    if (t0 + r < t_end && c0 + c < cols) out[(c0 + c) * out_ld + t0 + r] = tile[r][c];
  }
}

template <bool kVec>
__global__ void __launch_bounds__(plan::kThreads)
    TransposeKernel(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, MatrixShape s,
                    int64_t row_tiles, int64_t col_tiles) {
  __shared__ uint32_t words[kVec ? kTransposeTile : 1][kTransposeWords];
  __shared__ uint8_t bytes[kVec ? 1 : kTransposeTile][kTransposeTile + 4];
  const int64_t per_matrix = row_tiles * col_tiles;
  for (int64_t t = blockIdx.x; t < s.matrices * per_matrix; t += gridDim.x) {
    const int64_t m = t / per_matrix;
    const int64_t r0 = (t % per_matrix) / col_tiles * kTransposeTile;
    const int64_t c0 = (t % per_matrix) % col_tiles * kTransposeTile;
    const uint8_t* in = src + m * s.rows * s.cols;
    uint8_t* out = dst + m * s.rows * s.cols;
    const SourceRows src_row{nullptr, r0, s.rows};
    if constexpr (kVec) {
      WordTile(words, in, s.cols, c0, src_row, out, s.rows, r0, s.rows);
    } else {
      ByteTile(bytes, in, s.cols, c0, src_row, out, s.rows, r0, s.rows);
    }
    __syncthreads();
  }
}

}  // namespace

ffi::Error Transpose::Compute(CudaStream stream) {
  if (x.element_count() == 0) return ffi::Error::Success();
  const int64_t row_tiles = plan::CeilDiv(s.rows, kTransposeTile);
  const int64_t col_tiles = plan::CeilDiv(s.cols, kTransposeTile);
  const int64_t tiles = s.matrices * row_tiles * col_tiles;
  const auto* src = static_cast<const uint8_t*>(x.untyped_data());
  auto* dst = static_cast<uint8_t*>(xt->untyped_data());
  const auto grid = [tiles](int64_t resident) { return plan::Clamp(tiles, 1, resident); };
  const bool words = s.rows % 4 == 0 && s.cols % 4 == 0 && Addr(src) % 4 == 0 && Addr(dst) % 4 == 0;
  if (words) {
    return PlanAndLaunch(kName, TransposeKernel<true>, stream, grid, src, dst, s, row_tiles,
                         col_tiles);
  }
  return PlanAndLaunch(kName, TransposeKernel<false>, stream, grid, src, dst, s, row_tiles,
                       col_tiles);
}

// transpose_padded: the same tiles over (padded row position, column); each tile first finds the
// source row of each of its kTransposeTile padded positions (grouped::PaddedSource, one walk of the
// groups per position), then loads those rows (zeros for the padding) and writes them transposed.
namespace {

template <bool kVec>
__global__ void __launch_bounds__(plan::kThreads)
    TransposePaddedKernel(const uint8_t* __restrict__ x, uint8_t* __restrict__ xt,
                          const int32_t* __restrict__ all_sizes, MatrixShape s, int64_t groups,
                          int64_t width, int64_t padded, int64_t col_tiles) {
  __shared__ uint32_t words[kVec ? kTransposeTile : 1][kTransposeWords];
  __shared__ uint8_t bytes[kVec ? 1 : kTransposeTile][kTransposeTile + 4];
  __shared__ int64_t from[kTransposeTile];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t rows = s.rows, cols = s.cols;
  const int64_t per_matrix = plan::CeilDiv(padded, kTransposeTile) * col_tiles;
  for (int64_t t = blockIdx.x; t < s.matrices * per_matrix; t += gridDim.x) {
    const int64_t m = t / per_matrix;
    const uint8_t* src = x + m * rows * cols;
    uint8_t* dst = xt + m * cols * padded;
    const int32_t* sizes = all_sizes + m * groups;
    const int64_t p0 = (t % per_matrix) / col_tiles * kTransposeTile;
    const int64_t c0 = (t % per_matrix) % col_tiles * kTransposeTile;
    if (tid < kTransposeTile) {  // 32-bit positions: the handler checked that they fit
      const auto i32 = [](int64_t v) { return static_cast<int32_t>(v); };
      from[tid] = p0 + tid < padded ? grouped::PaddedSource<int32_t>(sizes, i32(groups), i32(rows),
                                                                     i32(width), i32(p0 + tid))
                                    : -1;
    }
    __syncthreads();
    const SourceRows src_row{from, 0, 0};
    if constexpr (kVec) {  // cols and padded multiples of 4: words
      WordTile(words, src, cols, c0, src_row, dst, padded, p0, padded);
    } else {
      ByteTile(bytes, src, cols, c0, src_row, dst, padded, p0, padded);
    }
    __syncthreads();
  }
}

}  // namespace

ffi::Error TransposePadded::Compute(CudaStream stream) {
  if (xt->element_count() == 0) return ffi::Error::Success();
  if (padded >= (int64_t{1} << 31) || groups >= (int64_t{1} << 31)) {
    return BadArg(kName, "the padded layout must have fewer than 2^31 positions on CUDA");
  }
  const int64_t col_tiles = plan::CeilDiv(s.cols, kTransposeTile);
  const int64_t tiles = s.matrices * plan::CeilDiv(padded, kTransposeTile) * col_tiles;
  const auto* src = static_cast<const uint8_t*>(x.untyped_data());
  auto* dst = static_cast<uint8_t*>(xt->untyped_data());
  const auto* sizes = static_cast<const int32_t*>(group_sizes.untyped_data());
  const auto grid = [tiles](int64_t resident) { return plan::Clamp(tiles, 1, resident); };
  if (s.cols % 4 == 0 && padded % 4 == 0 && Addr(src) % 4 == 0 && Addr(dst) % 4 == 0) {
    return PlanAndLaunch(kName, TransposePaddedKernel<true>, stream, grid, src, dst, sizes, s,
                         groups, width, padded, col_tiles);
  }
  return PlanAndLaunch(kName, TransposePaddedKernel<false>, stream, grid, src, dst, sizes, s,
                       groups, width, padded, col_tiles);
}

}  // namespace fp8jax
