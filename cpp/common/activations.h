// The activation math of fp8jax.ops.activation, shared by the CPU and CUDA
// kernels (and the definition their tests check against the jnp references).
//
// Every value is float32 math on float32 inputs in exactly the order of the
// jnp reference (fp8jax/ops/fused/activation.py); only tanhf, erfcf and expf are
// the platform's own (the C library on the host, CUDA's on the device), so
// CPU, CUDA and XLA agree to a few float32 ulps, not bit for bit. Products and
// sums go through Mul/Add, which on the device are __fmul_rn/__fadd_rn: nvcc
// would otherwise contract a * b + c into one FMA (one rounding fewer than the
// reference), and might do so differently in different kernels. The host
// build never contracts (no FMA in the baseline or AVX2 targets).
//
// Activation codes (the `act` FFI attribute): 0 linear, 1 gelu (tanh
// approximation), 2 gelu_exact (erfc), 3 relu, 4 silu. `gated`: the layout
// [m, 2, n], y = act(a) * b with a = x[:, 0], b = x[:, 1]; else [m, 1, n],
// y = act(a).
#pragma once

#include <math.h>

#include <cstdint>

#include "common/fp8_numerics.h"

namespace fp8jax::act {

enum Code : int { kLinear = 0, kGelu = 1, kGeluExact = 2, kRelu = 3, kSilu = 4 };
constexpr int kNumCodes = 5;

// The float32 constants of the reference (each the float nearest the real).
constexpr float kSqrt2OverPi = static_cast<float>(0.79788456080286535588);
constexpr float kGeluCubic = 0.044715f;
constexpr float kGeluCubic3 = 3.0f * kGeluCubic;  // rounded once, as numpy does
constexpr float kInvSqrt2 = static_cast<float>(0.70710678118654752440);
constexpr float kInvSqrt2Pi = static_cast<float>(0.39894228040143267794);

// act(a).
template <int A>
FP8JAX_HD float Act(float a) {
  if constexpr (A == kGelu) {
    const float inner = RnMul(kSqrt2OverPi, RnAdd(a, RnMul(kGeluCubic, RnMul(RnMul(a, a), a))));
    return RnMul(RnMul(0.5f, a), RnAdd(1.0f, tanhf(inner)));
  } else if constexpr (A == kGeluExact) {
    return RnMul(RnMul(0.5f, a), erfcf(RnMul(-a, kInvSqrt2)));
  } else if constexpr (A == kRelu) {
    // jnp.maximum(a, 0): NaN stays NaN.
    return a > 0.0f ? a : (a != a ? a : 0.0f);
  } else if constexpr (A == kSilu) {
    return RnDiv(a, RnAdd(1.0f, expf(-a)));
  } else {
    return a;
  }
}

// act'(a).
template <int A>
FP8JAX_HD float DAct(float a) {
  if constexpr (A == kGelu) {
    const float a2 = RnMul(a, a);
    const float t = tanhf(RnMul(kSqrt2OverPi, RnAdd(a, RnMul(kGeluCubic, RnMul(a2, a)))));
    const float du = RnMul(kSqrt2OverPi, RnAdd(1.0f, RnMul(kGeluCubic3, a2)));
    return RnAdd(RnMul(0.5f, RnAdd(1.0f, t)),
                 RnMul(RnMul(0.5f, a), RnMul(RnSub(1.0f, RnMul(t, t)), du)));
  } else if constexpr (A == kGeluExact) {
    const float cdf = RnMul(0.5f, erfcf(RnMul(-a, kInvSqrt2)));
    return RnAdd(cdf, RnMul(a, RnMul(kInvSqrt2Pi, expf(RnMul(-0.5f, RnMul(a, a))))));
  } else if constexpr (A == kRelu) {
    return a > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (A == kSilu) {
    const float s = RnDiv(1.0f, RnAdd(1.0f, expf(-a)));
    return RnMul(s, RnAdd(1.0f, RnMul(a, RnSub(1.0f, s))));
  } else {
    return 1.0f;
  }
}

// The forward value: act(a) * b (gated) or act(a).
template <int A, bool G>
FP8JAX_HD float Forward(float a, float b) {
  if constexpr (G) {
    return RnMul(Act<A>(a), b);
  } else {
    return Act<A>(a);
  }
}

// The gradient's first half for output gradient g: g * act'(a) * b (gated),
// or g * act'(a).
template <int A, bool G>
FP8JAX_HD float BackwardA(float g, float a, float b) {
  const float d = RnMul(g, DAct<A>(a));
  if constexpr (G) {
    return RnMul(d, b);
  } else {
    return d;
  }
}

// A gated gradient's second half: g * act(a).
template <int A>
FP8JAX_HD float BackwardB(float g, float a) {
  return RnMul(g, Act<A>(a));
}

// The gradient for output gradient g: *da = BackwardA, and *db = BackwardB
// when gated.
template <int A, bool G>
FP8JAX_HD void Backward(float g, float a, float b, float* da, float* db) {
  *da = BackwardA<A, G>(g, a, b);
  if constexpr (G) *db = BackwardB<A>(g, a);
}

// Whether (act, gated) is an activation the kernels have: a known code, and
// a gated pair's first member not linear (the Python wrapper rejects it).
inline bool Valid(int64_t code, int64_t gated) {
  return code >= 0 && code < kNumCodes && (gated == 0 || gated == 1) &&
         !(gated == 1 && code == kLinear);
}

// Calls fn.template operator()<A, G>() for runtime (code, gated), which the
// caller has checked with Valid.
template <typename Fn>
decltype(auto) Dispatch(int64_t code, int64_t gated, Fn&& fn) {
  const bool g = gated != 0;
  switch (code) {
    case kGelu:
      return g ? fn.template operator()<kGelu, true>() : fn.template operator()<kGelu, false>();
    case kGeluExact:
      return g ? fn.template operator()<kGeluExact, true>()
               : fn.template operator()<kGeluExact, false>();
    case kRelu:
      return g ? fn.template operator()<kRelu, true>() : fn.template operator()<kRelu, false>();
    case kSilu:
      return g ? fn.template operator()<kSilu, true>() : fn.template operator()<kSilu, false>();
    default:
      return fn.template operator()<kLinear, false>();
  }
}

}  // namespace fp8jax::act
