// The ragged grouped GEMM (Python: fp8jax/ops/gemms/grouped_gemm.py): the numerics and the group
// walk that the CPU kernel (cpu/cpu_grouped_gemm.cc) and the CUDA kernel
// (cuda/cuda_grouped_gemm.cu) share, so that both give the same bits.
//
// Both forms are one computation: out(g, i, j) = sum over t of A(i, t) * B(g, j, t), both operands
// row-major with the contraction t contiguous (the "NT" layout).
//   - rows (the forward GEMM, the dgrad): A = a [M, K], B(g) = b[g] [N, K]; row i belongs to the
//     group whose rows hold it, t runs over all of K; rows past the sum of the sizes are +0.
//   - contracting (the wgrad): A = a [K, M], B = b [N, M], out [G, K, N]; t runs over group g's
//     own columns of M; an empty group's sum is 0 (then scaled, as the reference does).
// An operand element is its code's value (per-group scales), or the code times its block's
// inverse scale (DequantizeValue: the reference's float32 product). Each output is the float32
// sum of the products in a fixed order, t ascending, each step acc + a * b with the product
// rounded before the add (RnMul, RnAdd: never fused on either platform), from +0; the per-group
// form then multiplies the sum by a_scale_inv[g] * b_scale_inv[g] (one product of the scales, as
// the reference computes it), and the result is rounded once to the output dtype (a NaN as the
// one quiet NaN 0x7FC00000, whatever NaN the platform's arithmetic made).
//
// The sizes are read where the kernels run (on the device for CUDA): clamped as the reference
// clamps them (a negative size counts as 0, the running sum stops at the ragged length), so no
// size can make a kernel read or write out of bounds.
#pragma once

#include <cstdint>

#include "common/fp8_numerics.h"
#include "common/launch_plan.h"  // plan::CeilDiv

namespace fp8jax::grouped {

enum Form : int64_t { kRows = 0, kContracting = 1 };

// One call, as the handler's check describes it to the kernels.
struct Gemm {
  int64_t form = kRows;
  int64_t groups = 1;
  int64_t rows = 0;          // rows of A: M (rows form) or K (contracting)
  int64_t cols = 0;          // rows of B (one group's in the rows form): N
  int64_t depth = 0;         // codes per row of A and B: K (rows form) or M (contracting)
  int64_t ragged = 0;        // the dim the sizes split: M (A's rows, or the contraction)
  bool blocks = false;       // block scales (else per-group ones)
  bool e8m0 = false;         // block scales stored as E8M0 exponents (MXFP8)
  int64_t width = 0;         // the blocks' width along the contraction
  int64_t b_block_rows = 1;  // rows form: b's block height
  int64_t a_grid_cols = 0;   // columns of a's scale grid
  int64_t b_grid_rows = 0;   // rows form: block rows of each group's b
  int64_t b_grid_cols = 0;   // columns of b's scale grid

  FP8JAX_HD int64_t OutputSize() const { return (form == kRows ? rows : groups * rows) * cols; }
};

// The part of the ragged dim that group g holds, [begin, begin + size), and (width > 0) the index
// of its first segment block: the blocks of the groups before it, ceil(size / width) each
// (grouped_scaling.segment_layout's layout).
struct Span {
  int64_t begin = 0;
  int64_t size = 0;
  int64_t first_block = 0;
};

FP8JAX_HD int64_t ClampedEnd(int64_t begin, int32_t size, int64_t limit) {
  const int64_t end = begin + (size > 0 ? size : 0);
  return end < limit ? end : limit;
}

FP8JAX_HD Span SpanOf(const int32_t* sizes, int64_t g, int64_t limit, int64_t width) {
  int64_t begin = 0, blocks = 0;
  for (int64_t h = 0; h < g; ++h) {
    const int64_t end = ClampedEnd(begin, sizes[h], limit);
    if (width > 0) blocks += plan::CeilDiv(end - begin, width);
    begin = end;
  }
  return {begin, ClampedEnd(begin, sizes[g], limit) - begin, blocks};
}

// The rows form's output row tiles: each group's rows cut into tiles of `tile_rows` (its last one
// partial), in group order, then the rows past the sum (group == groups: zeros). No tile mixes
// two groups, and there are at most RowTiles(...) of them; a tile index past the last gives
// rows == 0.
struct RowTile {
  int64_t group = 0;
  int64_t row0 = 0;
  int64_t rows = 0;
};

FP8JAX_HD int64_t RowTiles(int64_t ragged, int64_t groups, int64_t tile_rows) {
  return plan::CeilDiv(ragged, tile_rows) + groups;
}

FP8JAX_HD RowTile RowTileAt(const int32_t* sizes, int64_t groups, int64_t ragged, int64_t tile_rows,
                            int64_t t) {
  int64_t begin = 0, first = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t end = ClampedEnd(begin, sizes[g], ragged);
    const int64_t n = plan::CeilDiv(end - begin, tile_rows);
    if (t < first + n) {
      const int64_t row0 = begin + (t - first) * tile_rows;
      return {g, row0, end - row0 < tile_rows ? end - row0 : tile_rows};
    }
    first += n;
    begin = end;
  }
  const int64_t row0 = begin + (t - first) * tile_rows;
  const int64_t left = ragged - row0;
  return {groups, row0, left <= 0 ? 0 : (left < tile_rows ? left : tile_rows)};
}

// Where the codes and the outputs are.
FP8JAX_HD int64_t ACode(const Gemm& p, int64_t i, int64_t t) { return i * p.depth + t; }
FP8JAX_HD int64_t BCode(const Gemm& p, int64_t g, int64_t j, int64_t t) {
  return ((p.form == kRows ? g * p.cols : 0) + j) * p.depth + t;
}
FP8JAX_HD int64_t OutIndex(const Gemm& p, int64_t g, int64_t i, int64_t j) {
  return ((p.form == kRows ? 0 : g * p.rows) + i) * p.cols + j;
}

// The scale grid entry of an element (block scales): rows form, a's grid [M, ceil(K / w)] and
// b's [G, ceil(N / br), ceil(K / w)]; contracting, both [rows, nb] of segment blocks that restart
// at each group's first column (s: group g's span).
FP8JAX_HD int64_t AScale(const Gemm& p, const Span& s, int64_t i, int64_t t) {
  if (p.form == kRows) return i * p.a_grid_cols + t / p.width;
  return i * p.a_grid_cols + s.first_block + (t - s.begin) / p.width;
}
FP8JAX_HD int64_t BScale(const Gemm& p, const Span& s, int64_t g, int64_t j, int64_t t) {
  if (p.form == kRows)
    return (g * p.b_grid_rows + j / p.b_block_rows) * p.b_grid_cols + t / p.width;
  return j * p.b_grid_cols + s.first_block + (t - s.begin) / p.width;
}

// Entry i of a scale grid as float32 (block_scaling._scale_values): float32 as stored; an E8M0
// exponent e as 2**(e - 127) (e = 0: the subnormal 2**-127), 255 as NaN.
FP8JAX_HD float ScaleValue(const void* grid, bool e8m0, int64_t i) {
  if (!e8m0) return static_cast<const float*>(grid)[i];
  const uint32_t e = static_cast<const uint8_t*>(grid)[i];
  if (e == 0xFFu) return BitsToFloat(0x7FC00000u);
  return BitsToFloat(e == 0 ? 0x00400000u : e << 23);
}

// An operand element's float32 value: the code's (per-group scales), or the code times its
// block's inverse scale, grid entry `si` (block scales).
template <typename F>
FP8JAX_HD float Operand(const Gemm& p, uint8_t code, const void* grid, int64_t si) {
  if (!p.blocks) return Fp8ToFloat<F>(code);
  return DequantizeValue<F>(code, ScaleValue(grid, p.e8m0, si));
}

// One step of an output's sum: the product rounded to float32, then added.
FP8JAX_HD float Accumulate(float acc, float a, float b) { return RnAdd(acc, RnMul(a, b)); }

// Group g's factor of the finished sum: a_scale_inv[g] * b_scale_inv[g] (per-group scales), 1
// (block scales: every element was scaled).
FP8JAX_HD float GroupScale(const Gemm& p, const float* a_scale, const float* b_scale, int64_t g) {
  return p.blocks ? 1.0f : RnMul(a_scale[g], b_scale[g]);
}

// The output before its rounding to the output dtype. A NaN is 0x7FC00000 on both platforms (a
// GPU's arithmetic makes its canonical NaN, the CPU's keeps an operand's sign and payload), as the
// column sums do (fp8_numerics.h's CanonicalNan).
FP8JAX_HD float Finish(const Gemm& p, float acc, float group_scale) {
  return CanonicalNan(p.blocks ? acc : RnMul(acc, group_scale));
}

// The padded layout of grouped_scaling.segment_layout: each group's positions start at a multiple
// of `width` (its first segment block's), zeros between; SegmentBlocks(...) * width positions in
// all.
FP8JAX_HD int64_t SegmentBlocks(int64_t ragged, int64_t groups, int64_t width) {
  const int64_t nb = plan::CeilDiv(ragged, width) + groups - 1;
  return nb > 1 ? nb : 1;
}

// The unpadded position padded position `p` holds, or -1 (a zero between or after the groups).
// Index: int64_t, or int32_t where every position fits (the CUDA kernel: a 32-bit division is
// inline, a 64-bit one a call whose stack spills).
template <typename Index = int64_t>
FP8JAX_HD Index PaddedSource(const int32_t* sizes, Index groups, Index ragged, Index width,
                             Index p) {
  Index begin = 0, start = 0;
  for (Index g = 0; g < groups; ++g) {
    const Index end = static_cast<Index>(ClampedEnd(begin, sizes[g], ragged));
    const Index n = end - begin;
    const Index extent = (n + width - 1) / width * width;
    if (p < start + extent) return p - start < n ? begin + p - start : Index{-1};
    start += extent;
    begin = end;
  }
  return Index{-1};
}

}  // namespace fp8jax::grouped
