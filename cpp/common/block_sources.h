// What a block-scaled cast quantizes, and the column sums it may fuse, shared by the CPU and CUDA
// kernels (cpp/cpu/cpu_block_scaling.cc, cpp/cuda/cuda_block_scaling.cu).
//
// A source gives element (r, col) of matrix g of the [rows, cols] matrices being cast, as float32
// holding a value of the input dtype W: x itself (block_cast_transpose), or a prologue computed
// from the op's inputs and rounded to W once (activation_block_cast_transpose: the activation of
// the MLP's first GEMM output; dactivation_block_cast_transpose_dbias: its gradient;
// norm_block_cast_transpose on CUDA: the norm's output from its row statistics), so a fused cast
// quantizes exactly what the unfused ops would.
// H is the half conversion: ExactHalf on the CPU, FastHalf on the GPU (the same bits).
#pragma once

#include <cstdint>

#include "common/activations.h"
#include "common/block_scale.h"
#include "common/fp8_numerics.h"
#include "common/launch_plan.h"
#include "common/norm_row.h"
#include "common/wide.h"

namespace fp8jax::block {

// x [groups, rows, cols] itself.
template <WideKind W, typename H>
struct DirectSource {
  const void* x;
  int64_t rows;
  int64_t cols;
  FP8JAX_HD float operator()(int64_t g, int64_t r, int64_t col) const {
    return LoadWide<W, H>(x, (g * rows + r) * cols + col);
  }
};

// act(x[..., 0, :]) (* x[..., 1, :] when gated) of x [groups, rows, k, n], rounded to W: row r of
// the [rows, n] activation (common/activations.h's math).
template <WideKind W, typename H, int A, bool G>
struct ActSource {
  const void* x;
  int64_t rows;
  int64_t n;
  FP8JAX_HD float operator()(int64_t g, int64_t r, int64_t col) const {
    const int64_t a0 = (g * rows + r) * (G ? 2 : 1) * n;
    const float a = LoadWide<W, H>(x, a0 + col);
    const float b = G ? LoadWide<W, H>(x, a0 + n + col) : 1.0f;
    return RoundWide<W, H>(act::Forward<A, G>(a, b));
  }
};

// The activation's gradient from g [groups, rows, n] and x [groups, rows, k, n], rounded to W:
// matrix gg = group * k + j is the gradient's half j ([rows, n]; da, and db when gated), as
// dactivation computes it (common/activations.h's act::Backward).
template <WideKind W, typename H, int A, bool G>
struct DActSource {
  const void* g;
  const void* x;
  int64_t rows;
  int64_t n;
  FP8JAX_HD float operator()(int64_t gg, int64_t r, int64_t col) const {
    constexpr int64_t k = G ? 2 : 1;
    const int64_t row = gg / k * rows + r;
    const float gv = LoadWide<W, H>(g, row * n + col);
    const float a = LoadWide<W, H>(x, row * k * n + col);
    if (G && gg % k != 0) return RoundWide<W, H>(act::BackwardB<A>(gv, a));  // only the half asked
    const float b = G ? LoadWide<W, H>(x, row * k * n + n + col) : 1.0f;
    return RoundWide<W, H>(act::BackwardA<A, G>(gv, a, b));
  }
};

// The norm's output of x [groups, rows, cols] from its row statistics (mu, rsigma: one per row
// of all groups, as the norm kernels write them) and gamma, beta ([groups, cols] or [cols], any
// wide dtype), rounded to W: common/norm_row.h's NormOut, as the CUDA norm forward writes y.
// kLayer: layernorm (beta added), else rmsnorm.
template <WideKind W, typename H, bool kLayer>
struct NormSource {
  const void* x;
  const float* mu;
  const float* rsigma;
  const void* gamma;
  const void* beta;
  WideKind gamma_kind;
  WideKind beta_kind;
  bool zero_centered;
  bool grouped_params;  // gamma, beta [groups, cols], else [cols]
  int64_t rows;
  int64_t cols;
  FP8JAX_HD float operator()(int64_t g, int64_t r, int64_t col) const {
    const int64_t row = g * rows + r;
    const int64_t p = grouped_params ? g * cols + col : col;
    const float gm = NormGamma(LoadWideOf<H>(gamma, gamma_kind, p), zero_centered);
    const float b = kLayer ? LoadWideOf<H>(beta, beta_kind, p) : 0.0f;
    const float v = LoadWide<W, H>(x, row * cols + col);
    return RoundWide<W, H>(NormOut<kLayer>(v, mu[row], rsigma[row], gm, b));
  }
};

static_assert(kTile == plan::kBigTile, "dbias tiles are the cast tiles");

// The dbias partial of column `col` of matrix g over the kTile-row tile starting at row r0, in
// the order every dbias kernel uses (docs/numerics.md, "dbias: a fixed summation order"): groups
// of plan::kSumGroup rows, each added in row order from +0, the tile's groups added in order from
// +0. Rows past `rows` do not exist (a ragged last tile has fewer groups).
template <typename Source>
FP8JAX_HD float TileColumnSum(const Source& src, int64_t g, int64_t r0, int64_t rows, int64_t col) {
  float tile = 0.0f;
  for (int64_t q0 = r0; q0 < r0 + kTile && q0 < rows; q0 += plan::kSumGroup) {
    float group = 0.0f;
    for (int64_t r = q0; r < q0 + plan::kSumGroup && r < rows; ++r) {
      group = RnAdd(group, src(g, r, col));
    }
    tile = RnAdd(tile, group);
  }
  return tile;
}

}  // namespace fp8jax::block
