// The CUDA cast_transpose kernel, templated on where its values come from
// (x itself, or an activation prologue: cuda_activation.cu) and on whether it
// also writes each tile's column sums (dbias). Included by
// cuda_cast_transpose.cu and cuda_activation.cu only.
//
// dbias is deterministic, with no float atomics: the kernel writes each
// 128-row tile's column sums (groups of 8 rows, in the order of
// common/launch_plan.h, which the CPU engine follows too) to a workspace
// [matrices, row_tiles, cols] (a buffer XLA allocates: no allocation in the
// handler, which stays command-buffer compatible), and ColumnTotalsKernel
// (cuda_column_totals.cuh) adds the tiles in the plan's order.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/ffi_checks.h"
#include "common/launch_plan.h"
#include "cuda/cuda_column_totals.cuh"
#include "cuda/cuda_device.cuh"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// Fast path for a kBigTile x kBigTile tile inside an aligned matrix
// (plan::FastTileOk; the reasoning is in docs/performance.md). Each thread
// loads its 8 x 8 block (8 independent 16-byte loads for 2-byte inputs, 16
// for f32), writes 8 q words, transposes the block in registers and puts its
// 8 column words into the swizzled shared buffer; after one barrier each
// thread moves 4 x 16 bytes of q_t rows from shared memory to global memory.
template <typename F, bool kDbias, typename Source>
__device__ __forceinline__ void CastTransposeFastTile(
    const Source& src, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
    uint64_t* __restrict__ words, float* __restrict__ colpart, const plan::TransposeArgs& a,
    const plan::MatTile& mt, float sc, uint32_t& m, int t) {
  const int rb = plan::FastRowBlock(t);
  const int cb = plan::FastColBlock(t);
  const int64_t mat_base = mt.mat * a.rows * a.cols;
  const int64_t first = mat_base + (mt.row0 + rb * plan::kVec) * a.cols + mt.col0 + cb * plan::kVec;
  // The rows are loaded in batches of 128 bytes a thread: all 8 rows of a 2-byte type, 4 of
  // float32 (whose 8 rows in registers, 64 of them, made ptxas spill at the 128-register bound
  // when the driver JIT-compiled the compute_90 PTX for sm_121). Each batch's rows are held at
  // their own width and widened one by one.
  constexpr int kBatch = sizeof(typename Source::Raw) > 16 ? plan::kVec / 2 : plan::kVec;
  uint64_t w[plan::kVec];
  // dbias: this thread's 8 rows are one group, added row by row as each row
  // is quantized (plan: dbias order), in shared memory: every row dies as
  // early as without dbias and no register is added (the 8 sums as registers
  // spill on sm_89, and on sm_121 from the compute_90 PTX). plan::ColpartIndex
  // keeps the warp's stores in distinct banks at no register cost (one base).
#pragma unroll
  for (int i0 = 0; i0 < plan::kVec; i0 += kBatch) {
    typename Source::Raw raw[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) raw[i] = src.RawEight(first + (i0 + i) * a.cols);
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      float v[8];
      src.Widen(raw[i], v);
      w[i0 + i] = QuantizeEight<F>(v, sc, m);
      *reinterpret_cast<uint64_t*>(q + first + (i0 + i) * a.cols) = w[i0 + i];
      if constexpr (kDbias) {
        float* sums = colpart + plan::ColpartIndex(rb, cb * plan::kVec);
#pragma unroll
        for (int j = 0; j < 8; ++j) sums[j] = __fadd_rn(i0 + i == 0 ? 0.0f : sums[j], v[j]);
      }
    }
  }
  plan::Transpose8x8(w);
#pragma unroll
  for (int j = 0; j < plan::kVec; ++j) words[plan::FastWord(cb * plan::kVec + j, rb)] = w[j];
  __syncthreads();
#pragma unroll
  for (int step = 0; step < plan::kFastReadSteps; ++step) {
    const int c = plan::FastReadCol(t, step);
    const int k = plan::FastReadPair(t);
    const ulonglong2 pair = *reinterpret_cast<const ulonglong2*>(&words[plan::FastReadWord(c, k)]);
    const bool swapped = plan::FastReadSwapped(c);
    const ulonglong2 out = swapped ? make_ulonglong2(pair.y, pair.x) : pair;
    const int64_t dst = mat_base + (mt.col0 + c) * a.rows + mt.row0 + 16 * k;
    *reinterpret_cast<ulonglong2*>(qt + dst) = out;
  }
  __syncthreads();  // this tile's reads before the next tile's writes
}

// Guarded path for one kTile x kTile sub-tile (edges, unaligned matrices).
// Load pass: each thread loads 8 consecutive inputs of a row (one vector
// access when aligned and inside the matrix, else element by element), writes
// their 8 codes to q and stages them in shared memory. Store pass: each
// thread gathers 8 codes of a tile column and writes them as 8 consecutive
// codes of a q_t row. Every chunk is guarded (plan::LoadChunk/StoreChunk).
template <typename F, bool kDbias, typename Source>
__device__ __forceinline__ void CastTransposeGuardedTile(
    const Source& src, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
    uint8_t* __restrict__ tile, float* __restrict__ vals, float* __restrict__ colpart,
    const plan::TransposeArgs& a, const plan::MatTile& mt, int sub, float sc, uint32_t& m, int t) {
  plan::TileChunk in[2];
  float v[2][8];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    in[p] = plan::LoadChunk(a, mt, t, p);
    src.Chunk(in[p].offset, in[p].count, in[p].vector, v[p]);
    if constexpr (kDbias) {  // missing elements are 0 and add nothing
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        vals[plan::GuardedValsIndex(in[p].slot.row, in[p].slot.col + j)] = v[p][j];
      }
    }
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const uint64_t packed = QuantizeEight<F>(v[p], sc, m);
    StoreCodes(q, in[p].offset, in[p].count, in[p].vector, packed);
    *reinterpret_cast<uint64_t*>(tile + plan::GuardedTileIndex(in[p].slot.row, in[p].slot.col)) =
        packed;
  }
  __syncthreads();
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const plan::TileChunk out = plan::StoreChunk(a, mt, t, p);
    // The chunk's 8 rows share a row block: one swizzled column for all 8.
    const uint8_t* column = tile + plan::GuardedTileIndex(out.slot.row, out.slot.col);
    uint64_t packed = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) packed |= static_cast<uint64_t>(column[j * plan::kTile]) << (8 * j);
    StoreCodes(qt, out.offset, out.count, out.vector, packed);
  }
  if constexpr (kDbias) {  // each group of 8 rows of the sub-tile, rows in order
#pragma unroll
    for (int k = 0; k < plan::kGuardedSlotsPerThread; ++k) {
      const plan::GroupSlot gs = plan::GuardedGroupSlot(t, k);
      float acc = 0.0f;
#pragma unroll
      for (int i = 0; i < plan::kSumGroup; ++i) {
        acc = __fadd_rn(acc, vals[plan::GuardedValsIndex(gs.group * plan::kSumGroup + i, gs.col)]);
      }
      colpart[plan::ColpartIndex(plan::SubTileGroup0(sub) + gs.group,
                                 plan::SubTileCol0(sub) + gs.col)] = acc;
    }
  }
  __syncthreads();  // this sub-tile's reads before the next writes
}

// A tile's column sums (dbias): its groups, in order, into the workspace.
// After the tile's last barrier (colpart complete); ends with a barrier.
__device__ __forceinline__ void FlushTileColumns(const float* __restrict__ colpart,
                                                 float* __restrict__ partial,
                                                 const plan::TransposeArgs& a,
                                                 const plan::MatTile& mt, int t) {
  if (t < plan::kBigTile && mt.col0 + t < a.cols) {
    float acc = 0.0f;
    const float* col = colpart + plan::ColpartIndex(0, t);
#pragma unroll
    for (int g = 0; g < plan::kRowGroups; ++g) {
      acc = __fadd_rn(acc, col[g * plan::kColpartStride]);
    }
    partial[plan::PartialIndex(mt.mat, mt.row0 / plan::kBigTile, a.row_tiles, a.cols,
                               mt.col0 + t)] = acc;
  }
  __syncthreads();  // these reads before the next tile's writes
}

// One kBigTile x kBigTile tile per step (plan::WalkCastTranspose): the fast
// path when the tile lies inside an aligned matrix, else four guarded
// sub-tiles. One amax atomic per block and group. With kDbias, each tile's
// column sums go to `partial` (plan: dbias order).
// At least 2 resident blocks per SM (so one block's loads overlap the
// other's shared-memory phase): up to 128 registers per thread, which keeps
// the 64 loaded values in registers on every arch, at their own width
// (without the bound, ptxas for sm_89 stopped at 80 registers and spilled).
template <typename F, bool kDbias, typename Source>
__global__ void __launch_bounds__(plan::kThreads, 2)
    CastTransposeKernel(Source src, const float* __restrict__ scale, uint8_t* __restrict__ q,
                        uint8_t* __restrict__ qt, float* __restrict__ scale_inv,
                        uint32_t* __restrict__ amax_bits, int64_t groups, plan::TransposeArgs a,
                        float* __restrict__ partial) {
  __shared__ __align__(16) uint64_t words[plan::kBigTile * plan::kBlocksPerEdge];
  static_assert(sizeof(words) >= plan::kTile * plan::kTile);
  constexpr int kSumRows = kDbias ? plan::kRowGroups : 1;
  constexpr int kValRows = kDbias ? plan::kTile : 1;
  __shared__ float colpart[kSumRows * plan::kColpartStride];
  __shared__ float vals[kValRows * plan::kValsStride];
  auto* tile = reinterpret_cast<uint8_t*>(words);
  WriteScaleInv(scale, scale_inv, groups);
  const int t = threadIdx.x;
  uint32_t m = 0;
  plan::WalkCastTranspose(
      a, blockIdx.x, gridDim.x,
      [&](int64_t g, const plan::MatTile& mt) {
        const float sc = scale[g];
        bool fast = false;
        if constexpr (Source::kFast) fast = plan::FastTileOk(a, mt);  // block-uniform
        if (fast) {
          if constexpr (Source::kFast) {
            CastTransposeFastTile<F, kDbias>(src, q, qt, words, colpart, a, mt, sc, m, t);
          }
        } else {
          for (int sub = 0; sub < plan::kSubTiles; ++sub) {
            CastTransposeGuardedTile<F, kDbias>(src, q, qt, tile, vals, colpart, a,
                                                plan::SubTile(mt, sub), sub, sc, m, t);
          }
        }
        if constexpr (kDbias) FlushTileColumns(colpart, partial, a, mt, t);
      },
      [&](int64_t g) {
        FlushAmax(amax_bits, g, m);
        m = 0;
      });
}

// The 8 wide values at element i of x itself (a vector access on the fast
// path, guarded chunks elsewhere).
template <WideKind W>
struct DirectSource {
  static constexpr bool kFast = true;  // the fast path's 8 x 8 register blocks
  using Raw = RawEightT<W>;
  const void* x;
  __device__ __forceinline__ Raw RawEight(int64_t i) const { return fp8jax::RawEight<W>(x, i); }
  __device__ __forceinline__ void Widen(const Raw& r, float v[8]) const { WidenEight<W>(r, v); }
  __device__ __forceinline__ void Chunk(int64_t i, int count, bool vector, float v[8]) const {
    LoadChunk<W>(x, i, count, vector, v);
  }
};

// Enqueues the cast_transpose of `s` at `src` (a DirectSource, or a prologue
// with kFast false and a Chunk member: values at element i of the [rows, cols]
// matrices, rounded to the wide dtype; a prologue always
// takes the guarded path: 64 activation values per thread would not fit in
// registers beside the fast path's 8 x 8 block). x_addr: the address the fast path's
// alignment is judged by (0 for a prologue, which loads element by element).
// partial: the dbias workspace [matrices, row_tiles, cols] when kDbias.
template <WideKind W, typename F, bool kDbias, typename Source>
ffi::Error LaunchCastTransposeOf(const char* op, cudaStream_t stream, const Source& src,
                                 uint64_t x_addr, const MatrixShape& s, const float* scale, void* q,
                                 void* qt, float* scale_inv, float* amax, float* partial) {
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax);
  FP8JAX_RETURN_IF_ERROR(MemsetAsync(op, amax_bits, s.groups * sizeof(uint32_t), stream));
  auto* qp = static_cast<uint8_t*>(q);
  auto* qtp = static_cast<uint8_t*>(qt);
  plan::TransposeArgs a;
  a.rows = s.rows;
  a.cols = s.cols;
  a.mats_per_group = s.matrices / s.groups;
  a.x_addr = x_addr;
  a.wide_bytes = kWideBytes<W>;
  a.q_addr = Addr(qp);
  a.qt_addr = Addr(qtp);
  a.fast = plan::FastEligible(s.rows, s.cols, a.x_addr, a.wide_bytes, a.q_addr, a.qt_addr);
  // Always launched, even for an empty matrix: the kernel writes scale_inv
  // for every group before (and independently of) its tiles.
  return PlanAndLaunch(
      op, CastTransposeKernel<F, kDbias, Source>, stream,
      [&](int64_t resident) {
        const plan::TransposePlan p = plan::PlanCastTranspose(s.matrices, s.rows, s.cols, resident);
        a.row_tiles = p.row_tiles;
        a.col_tiles = p.col_tiles;
        a.tiles = p.tiles;
        return p.grid;
      },
      src, scale, qp, qtp, scale_inv, amax_bits, s.groups, a, partial);
}

// Enqueues pass 2 of dbias (after a kDbias cast_transpose wrote `partial`):
// dbias[mat][col] = the row tiles' sums, in plan::ColumnLane order.
inline ffi::Error LaunchColumnTotals(const char* op, cudaStream_t stream, const float* partial,
                                     const MatrixShape& s, float* dbias) {
  TotalsArgs t;
  t.in = partial;
  t.matrices = s.matrices;
  t.stride_rows = t.rows = plan::CeilDiv(s.rows, plan::kBigTile);
  t.cols = t.split = s.cols;
  t.out0 = dbias;
  return LaunchColumnTotals(op, stream, t);
}

}  // namespace fp8jax
