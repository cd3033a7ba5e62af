// Per-row LayerNorm / RMSNorm numerics shared by the CPU and CUDA kernels.
//
// The definition is fp8jax/ops/fused/norm.py's reference, in float32: the row mean
// is the row sum divided by h, the variance the sum of the centred squares
// divided by h (two passes, never E[x^2] - E[x]^2), rsigma = 1 / sqrt(var +
// epsilon), y = ((x - mu) * rsigma) * g + beta with g = gamma (or 1 + gamma),
// and the backward's closed form (norm_backward_reference). Only the order in
// which a row's (or a column's) values are summed differs between the CPU
// kernel, the CUDA kernel and XLA; every other operation is the same float
// operation in the same order, here.
//
// The sums: the CPU kernel adds element i of a row to lane i % kNormLanes of
// NormLanes and combines the lanes pairwise (NormLanes::Total), a fixed order
// that the compiler turns into SIMD adds without -ffast-math. The CUDA kernel
// gives each thread a fixed set of a row's elements and combines the threads
// by a fixed shuffle tree. Both orders depend only on h (and the launch plan,
// which depends only on the shapes), so every run gives the same bits.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/fp8_numerics.h"  // FP8JAX_HD

namespace fp8jax {

// The norm math uses the never-fused RnAdd, RnSub and RnMul (fp8_numerics.h).

// The kernels' norm_type attribute (fp8jax/ops/fused/norm.py _NORM_CODES).
enum class NormType : int64_t { kLayerNorm = 0, kRmsNorm = 1 };

// The scale applied: gamma, or 1 + gamma with zero_centered_gamma.
FP8JAX_HD float NormGamma(float gamma, bool zero_centered) {
  return zero_centered ? RnAdd(gamma, 1.0f) : gamma;
}

// mu = sum / h (the reference divides the float32 sum by float32(h)). On the
// device the division is __fdiv_rn, the same correctly rounded division
// without the slow-path call that '/' compiles to.
FP8JAX_HD float RowMean(float sum, int64_t h) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(sum, static_cast<float>(h));
#else
  return sum / static_cast<float>(h);
#endif
}

// rsigma = 1 / sqrt(sum_sq / h + epsilon), with sum_sq the sum of the centred
// squares (layernorm) or of the squares (rmsnorm). The device uses the
// correctly rounded reciprocal square root (__frsqrt_rn), which may differ
// from the host's two roundings (sqrt, then divide) by one ulp.
FP8JAX_HD float RowRsigma(float sum_sq, int64_t h, float epsilon) {
#if defined(__CUDA_ARCH__)
  return __frsqrt_rn(RnAdd(RowMean(sum_sq, h), epsilon));
#else
  return 1.0f / sqrtf(RnAdd(RowMean(sum_sq, h), epsilon));
#endif
}

// The centred value whose square the variance sums: x - mu (rmsnorm: mu = 0,
// and x - 0 is x exactly, signed zeros included).
FP8JAX_HD float NormCentred(float x, float mu) { return RnSub(x, mu); }

// y of one element, before its rounding to the output dtype. kBeta: layernorm
// adds beta; rmsnorm adds nothing (not even +0, which would turn -0 into +0).
template <bool kBeta>
FP8JAX_HD float NormOut(float x, float mu, float rsigma, float g, float beta) {
  const float v = RnMul(RnMul(NormCentred(x, mu), rsigma), g);
  if constexpr (kBeta) {
    return RnAdd(v, beta);
  } else {
    return v;
  }
}

// Backward, per element: xhat = (x - mu) * rsigma, dz = dy * g; per row
// c1 = sum(dz) / h (layernorm; 0 for rmsnorm), c2 = sum(dz * xhat) / h;
// dx = rsigma * ((dz - c1) - xhat * c2); dgamma += dy * xhat, dbeta += dy.
FP8JAX_HD float NormXhat(float x, float mu, float rsigma) {
  return RnMul(NormCentred(x, mu), rsigma);
}

FP8JAX_HD float NormDx(float dz, float xhat, float rsigma, float c1, float c2) {
  return RnMul(rsigma, RnSub(RnSub(dz, c1), RnMul(xhat, c2)));
}

// The CPU kernel's fixed-order sum: kNormLanes running sums, element i into
// lane i % kNormLanes, combined pairwise (lane j += lane j + w for w = 8, 4,
// 2, 1). Any row length works; the order depends only on the length.
constexpr int kNormLanes = 16;

struct NormLanes {
  float v[kNormLanes];

  FP8JAX_HD NormLanes() {
    for (int j = 0; j < kNormLanes; ++j) v[j] = 0.0f;
  }

  FP8JAX_HD float Total() {
    for (int w = kNormLanes / 2; w >= 1; w /= 2) {
      for (int j = 0; j < w; ++j) v[j] += v[j + w];
    }
    return v[0];
  }
};

// The backward's column sums (dgamma, dbeta) go through a workspace of
// `slots` partial rows per vmap group (fp8jax/ops/fused/norm.py
// norm_workspace_slots, an output of the custom call): the CPU kernel cuts a
// group's rows into at most `slots` blocks of NormRowsPerPartial consecutive
// rows, each block summing its rows in order into its own partial; a second
// pass adds each column's partials in block order. A function of the shapes
// only, never of the number of threads, so dgamma has the same bits on every
// run.
// (At least min_rows rows per block: fewer, larger partials cost less traffic
// through the workspace.)
FP8JAX_HD int64_t NormRowsPerPartial(int64_t rows, int64_t slots, int64_t min_rows) {
  const int64_t per = rows <= slots ? 1 : (rows + slots - 1) / slots;
  return per < min_rows ? min_rows : per;
}

FP8JAX_HD int64_t NormPartials(int64_t rows, int64_t slots, int64_t min_rows) {
  const int64_t per = NormRowsPerPartial(rows, slots, min_rows);
  return (rows + per - 1) / per;
}

}  // namespace fp8jax
