// The ragged grouped GEMM on Hopper's tensor cores (sm90/grouped_gemm.cu): what each group
// of a call runs, as the device-side preparation kernel (cuda/cuda_grouped_tc_prep.cu) computes it
// from the group sizes before the CUTLASS grouped ("ptr-array") GEMM reads it, so that no size
// reaches the host. Plain __host__ __device__ code: the host run of the kernels tests it.
//
// The forms are common/grouped_gemm.h's, with the same clamped sizes (SpanOf):
//   - rows: group g is the GEMM (m, n, k) = (size_g, N, K) of a's rows [begin_g, begin_g + size_g)
//     with b[g] [N, K], into out's same rows; the rows past the sum are zeroed (ZeroTail).
//   - contracting: the operands come padded (grouped_scaling.segment_layout with `width`): group
//     g's columns start at first_block_g * width, a multiple of `width` (TMA needs 16-byte aligned
//     starts, so width >= 16), and its GEMM is (m, n, k) = (K, N, size_g) into out[g]; an empty
//     group's out[g] is zeroed.
// Each group's accumulator is scaled by alpha_g = a_scale_inv[g] * b_scale_inv[g] (per-group
// scales: the product the reference takes) in the epilogue, then rounded once to the output dtype.
// Block scales (Float8BlockScaling's 1 x 128 and 128 x 128): the mainloop applies them per 128-wide
// block of the contraction (alpha_g = 1), from the scale grids transposed to the MN-major layout
// CUTLASS's Hopper blockwise kernels read (the blocks along M, or N, contiguous):
//   - rows: a's [ceil(K / 128), M] (group g from column begin_g, leading dim M) and b's
//     [G, ceil(K / 128), ceil(N / 128)] (group g's own matrix);
//   - contracting (padded with width 128, so a group's segment blocks are the kernel's K blocks):
//     a's [nb, K] and b's [nb, N], group g from row first_block_g.
#pragma once

#include <cstdint>

#include "common/fp8_numerics.h"
#include "common/grouped_gemm.h"

namespace fp8jax::grouped_tc {

// One group's GEMM: its problem (m, n, k) and the element offsets of its operands and output.
struct Problem {
  int32_t m = 0;
  int32_t n = 0;
  int32_t k = 0;
  int64_t a_offset = 0;
  int64_t b_offset = 0;
  int64_t out_offset = 0;
  int64_t sfa_offset = 0;  // block scales: the group's first scale in each transposed grid
  int64_t sfb_offset = 0;
};

// `width`: the contracting form's padding (0 in the rows form).
FP8JAX_HD Problem ProblemOf(const grouped::Gemm& p, const int32_t* sizes, int64_t g,
                            int64_t width) {
  Problem q;
  if (p.form == grouped::kRows) {
    const grouped::Span s = grouped::SpanOf(sizes, g, p.ragged, 0);
    q.m = static_cast<int32_t>(s.size);
    q.n = static_cast<int32_t>(p.cols);
    q.k = static_cast<int32_t>(p.depth);
    q.a_offset = s.begin * p.depth;
    q.b_offset = g * p.cols * p.depth;
    q.out_offset = s.begin * p.cols;
    q.sfa_offset = s.begin;
    q.sfb_offset = g * p.b_grid_rows * p.b_grid_cols;
  } else {
    const grouped::Span s = grouped::SpanOf(sizes, g, p.ragged, width);
    q.m = static_cast<int32_t>(p.rows);
    q.n = static_cast<int32_t>(p.cols);
    q.k = static_cast<int32_t>(s.size);
    q.a_offset = s.first_block * width;
    q.b_offset = s.first_block * width;
    q.out_offset = g * p.rows * p.cols;
    q.sfa_offset = s.first_block * p.rows;
    q.sfb_offset = s.first_block * p.cols;
    // the caller pads for clamped sizes (they fit); past the padded columns nothing is read
    if (q.a_offset + q.k > p.depth)
      q.k = static_cast<int32_t>(q.a_offset < p.depth ? p.depth - q.a_offset : 0);
  }
  return q;
}

// The per-group scale of the epilogue (float32 [G] inverse scales, one product).
FP8JAX_HD float AlphaOf(const float* a_scale_inv, const float* b_scale_inv, int64_t g) {
  return RnMul(a_scale_inv[g], b_scale_inv[g]);
}

// The rows past the sum of the sizes (rows form): [begin, rows).
FP8JAX_HD int64_t TailBegin(const grouped::Gemm& p, const int32_t* sizes) {
  const grouped::Span last = grouped::SpanOf(sizes, p.groups - 1, p.ragged, 0);
  return last.begin + last.size;
}

// The workspace: the per-group arrays the preparation kernel writes, then CUTLASS's own, each at a
// 128-byte boundary. problems: int32 [G, 3] (CUTLASS's Shape<int, int, int>); a, b, out: the
// operands' pointers; alpha: float32 [G] and its pointers (CUTLASS's alpha_ptr_array); strides:
// CUTLASS's per-group strides of a, b and out (kStrideBytes each, written by sm90/); sfa, sfb: the
// block scales' pointers, and their layouts (kStrideBytes each, written by sm90/), unused under
// per-group scales.
inline constexpr int64_t kAlign = 128;
inline constexpr int64_t kStrideBytes = 32;  // sizeof any CUTLASS InternalStride (checked there)
// CUTLASS's own workspace (TMA descriptors per multiprocessor, the tile scheduler's) is at most
// this many bytes for every instantiation on a device of up to kMaxSms multiprocessors
// (sm90/grouped_gemm.cu checks it against Gemm::get_workspace_size, the handler against
// the device's).
inline constexpr int64_t kMaxSms = 1024;
inline constexpr int64_t kCutlassBytes = int64_t{1} << 20;

FP8JAX_HD constexpr int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Workspace {
  int64_t problems = 0;
  int64_t a = 0;
  int64_t b = 0;
  int64_t out = 0;
  int64_t alpha = 0;
  int64_t alpha_ptrs = 0;
  int64_t stride_a = 0;
  int64_t stride_b = 0;
  int64_t stride_out = 0;
  int64_t sfa = 0;
  int64_t sfb = 0;
  int64_t layout_sfa = 0;
  int64_t layout_sfb = 0;
  int64_t cutlass = 0;
  int64_t bytes = 0;
};

FP8JAX_HD constexpr Workspace WorkspaceOf(int64_t groups) {
  Workspace w;
  int64_t at = 0;
  const auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at = AlignUp(at + bytes);
    return here;
  };
  w.problems = take(groups * 3 * 4);
  w.a = take(groups * 8);
  w.b = take(groups * 8);
  w.out = take(groups * 8);
  w.alpha = take(groups * 4);
  w.alpha_ptrs = take(groups * 8);
  w.stride_a = take(groups * kStrideBytes);
  w.stride_b = take(groups * kStrideBytes);
  w.stride_out = take(groups * kStrideBytes);
  w.sfa = take(groups * 8);
  w.sfb = take(groups * 8);
  w.layout_sfa = take(groups * kStrideBytes);
  w.layout_sfb = take(groups * kStrideBytes);
  w.cutlass = take(kCutlassBytes);
  w.bytes = at;
  return w;
}

}  // namespace fp8jax::grouped_tc
