// Scalar numerics shared by the CPU and CUDA kernels.
//
// Every function here is the definition of the numerics contract in
// DESIGN.md: saturating round-to-nearest-even to FP8 (E4M3FN, E5M2), exact
// FP8 -> float, and RNE float -> bf16 / f16. The CPU kernels use these
// functions directly; the CUDA kernels use them too, except for the hot FP8
// conversion, which uses the sm_89+ hardware instruction with identical
// semantics (cvt.rn.satfinite). The Python tests compare both against the
// jnp reference over every code, midpoint and special value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FP8JAX_HD __host__ __device__ __forceinline__
#else
#define FP8JAX_HD inline
#endif

namespace fp8jax {

// Traits of the two FP8 formats. kMaxCode is the largest finite magnitude
// code, kNanCode the quiet NaN produced for NaN inputs (sign is OR-ed in).
struct E4M3 {
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr uint8_t kMaxCode = 0x7E;
  static constexpr uint8_t kNanCode = 0x7F;
  static constexpr bool kHasInf = false;
};

struct E5M2 {
  static constexpr int kMantissaBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr uint8_t kMaxCode = 0x7B;
  static constexpr uint8_t kNanCode = 0x7E;
  static constexpr bool kHasInf = true;
};

FP8JAX_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FP8JAX_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// Bits of |x|. For non-negative floats the unsigned order of the bits is the
// numeric order, and every NaN sorts above +inf, so an unsigned max over these
// bits is a NaN-propagating max of |x| (matching jnp.max(jnp.abs(x))).
FP8JAX_HD uint32_t AbsBits(float x) { return FloatBits(x) & 0x7FFFFFFFu; }

// Round-to-nearest-even of a non-negative float to an integer (as float).
FP8JAX_HD float RoundHalfEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// float -> FP8 code: saturate(round_to_nearest_even(x)). NaN -> NaN; finite
// values and +-inf beyond the largest finite value saturate to +-max.
template <typename F>
FP8JAX_HD uint8_t FloatToFp8(float x) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | F::kNanCode;
  const float af = BitsToFloat(a);
  if (af >= F::kMax) return sign | F::kMaxCode;
  // Smallest normal of the target format is 2^(1 - bias).
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - F::kBias) << 23;
  if (a >= kMinNormalBits) {
    constexpr int kShift = 23 - F::kMantissaBits;
    uint32_t r = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
    r >>= kShift;
    r -= static_cast<uint32_t>(127 - F::kBias) << F::kMantissaBits;
    return sign | static_cast<uint8_t>(r);
  }
  // Target subnormal: value = m * 2^(1 - bias - mantissa_bits), m in [0, 2^mb].
  // The scaling is by a power of two and exact; m == 2^mb is the min normal.
  constexpr int kScaleExp = F::kBias - 1 + F::kMantissaBits;
  const float scaled = af * static_cast<float>(1u << kScaleExp);
  return sign | static_cast<uint8_t>(RoundHalfEven(scaled));
}

// FP8 code -> float, exact.
template <typename F>
FP8JAX_HD float Fp8ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t mag = code & 0x7Fu;
  const uint32_t exp = mag >> F::kMantissaBits;
  const uint32_t man = mag & ((1u << F::kMantissaBits) - 1u);
  constexpr uint32_t kExpMax = (1u << (7 - F::kMantissaBits)) - 1u;
  if (F::kHasInf) {
    if (exp == kExpMax) return BitsToFloat(sign | (man == 0 ? 0x7F800000u : 0x7FC00000u));
  } else if (mag == 0x7Fu) {
    return BitsToFloat(sign | 0x7FC00000u);
  }
  if (exp == 0) {
    constexpr int kScaleExp = F::kBias - 1 + F::kMantissaBits;
    const float v = static_cast<float>(man) / static_cast<float>(1u << kScaleExp);
    return BitsToFloat(sign | FloatBits(v));
  }
  const uint32_t bits = ((exp + 127u - F::kBias) << 23) | (man << (23 - F::kMantissaBits));
  return BitsToFloat(sign | bits);
}

// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN.
FP8JAX_HD uint16_t FloatToBf16Bits(float x) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

FP8JAX_HD float Bf16BitsToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// float -> IEEE half bits, round to nearest even; overflow -> inf.
FP8JAX_HD uint16_t FloatToF16Bits(float x) {
  const uint32_t u = FloatBits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                       // >= 2^-14, normal half
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
    r >>= 13;
    r -= 112u << 10;  // rebias 127 -> 15
    return sign | static_cast<uint16_t>(r);
  }
  const float scaled = BitsToFloat(a) * 16777216.0f;  // 2^24: half subnormal unit
  return sign | static_cast<uint16_t>(RoundHalfEven(scaled));
}

FP8JAX_HD float F16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return BitsToFloat(sign | 0x7F800000u | (man << 13));
  if (exp == 0) {
    const float v = static_cast<float>(man) / 16777216.0f;
    return BitsToFloat(sign | FloatBits(v));
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

// max(a, b) that propagates NaN, like jnp.max.
FP8JAX_HD float NanMax(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  return b > a ? b : a;
}

// The delayed-scaling scale update for one tensor (DESIGN.md): reduced amax
// -> scale = (fp8_max / amax) * 2^-margin; keep the old scale when the
// reduced amax is not a positive normal finite number (0, subnormal, inf,
// NaN: XLA:CPU treats subnormals as zero, so this keeps CPU and GPU equal);
// clamp an overflowing scale to FLT_MAX.
FP8JAX_HD float ComputeScale(float amax, float old_scale, float fp8_max, float margin_factor) {
  if (!(amax >= 1.175494351e-38f) || !(amax <= 3.402823466e38f)) return old_scale;
  float s = (fp8_max / amax) * margin_factor;
  if (s > 3.402823466e38f) s = 3.402823466e38f;
  return s;
}

}  // namespace fp8jax
