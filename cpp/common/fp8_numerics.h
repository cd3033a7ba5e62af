// Scalar numerics shared by the CPU and CUDA kernels.
//
// Every function here is the definition of the numerics contract in
// docs/numerics.md: round-to-nearest-even to FP8 (E4M3FN, E5M2) with finite
// overflow saturating to +-max, NaN keeping its sign and +-inf staying
// non-finite; exact FP8 -> float; RNE float -> bf16 / f16. The CPU kernels use
// these functions directly. The CUDA kernels use the hardware conversions for
// the common finite case through cpp/common/fp8_device_convert.h, whose
// __host__ __device__ helpers are tested against these functions over every
// float32 input (tests/cpp). The Python tests compare the kernels with the jnp
// references over every code, midpoint and special value.
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
// code, kNanCode the NaN produced for NaN inputs and kInfCode the code of an
// infinite input (the sign is OR-ed into each). E4M3FN has no infinity, so
// its kInfCode is its NaN. These are the codes ml_dtypes and XLA's convert
// give for NaN and +-inf.
struct E4M3 {
  static constexpr int kMantissaBits = 3;
  static constexpr int kBias = 7;
  static constexpr float kMax = 448.0f;
  static constexpr uint8_t kMaxCode = 0x7E;
  static constexpr uint8_t kNanCode = 0x7F;
  static constexpr uint8_t kInfCode = 0x7F;
  static constexpr bool kHasInf = false;
};

struct E5M2 {
  static constexpr int kMantissaBits = 2;
  static constexpr int kBias = 15;
  static constexpr float kMax = 57344.0f;
  static constexpr uint8_t kMaxCode = 0x7B;
  static constexpr uint8_t kNanCode = 0x7E;
  static constexpr uint8_t kInfCode = 0x7C;
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

// The column sums (dbias, dgamma, dbeta) return NaN as 0x7FC00000 on every platform: a CPU add
// keeps an operand NaN's sign and payload, a GPU's returns 0x7FFFFFFF, so both kernels store this.
constexpr uint32_t kCanonicalNanBits = 0x7FC00000u;
FP8JAX_HD float CanonicalNan(float x) { return x != x ? BitsToFloat(kCanonicalNanBits) : x; }

// Round-to-nearest-even of a non-negative float to an integer (as float).
FP8JAX_HD float RoundHalfEven(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return std::nearbyint(x);
#endif
}

// True when x is neither inf nor NaN (an exponent field below all ones).
FP8JAX_HD bool IsFinite(float x) { return (FloatBits(x) & 0x7F800000u) != 0x7F800000u; }

// Float arithmetic that is never fused, for the definitions the references compute step by
// step: on the device the _rn intrinsics, which nvcc does not contract into an FMA (its default
// --fmad=true would otherwise fuse a * b + c differently in different kernels); on the host the
// plain operators (the CPU build enables no FMA).
FP8JAX_HD float RnAdd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FP8JAX_HD float RnSub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FP8JAX_HD float RnMul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FP8JAX_HD float RnDiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// scale_inv = 1 / scale, with the NaN rule of x86's divss (what the CPU reference computes): a
// NaN scale gives that NaN, quieted, sign and payload kept. CUDA's division would give the
// canonical NaN (0x7fffffff); every kernel writes its scale_inv through this.
FP8JAX_HD float ScaleInverse(float scale) {
  if (scale != scale) return BitsToFloat(FloatBits(scale) | 0x00400000u);
  return 1.0f / scale;
}

// float -> FP8 code: round_to_nearest_even(x), finite values beyond the
// largest finite value saturating to +-max. NaN -> sign|kNanCode (the sign of
// the NaN kept); +-inf -> sign|kInfCode (E5M2: +-inf; E4M3: NaN, it has no
// inf), so a non-finite input always gives a non-finite code.
template <typename F>
FP8JAX_HD uint8_t FloatToFp8(float x) {
  const uint32_t u = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | F::kNanCode;
  if (a == 0x7F800000u) return sign | F::kInfCode;
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

// The FP8 code of a non-finite product p = x * scale (the caller checked that
// p is inf or NaN). Only p's class and, for inf, its sign are used: a GPU
// returns one canonical NaN (0x7FFFFFFF) from any multiply with a NaN operand,
// so the NaN's sign is taken from the operands, as the sign of their product
// (sign(x) XOR sign(scale); for the usual positive scale, the sign of x).
// An inf made by the multiply from finite x and scale is a finite value
// beyond the range: it saturates to +-max.
template <typename F>
FP8JAX_HD uint8_t Fp8OfNonFiniteProduct(float x, float scale, float p) {
  const uint32_t pb = FloatBits(p);
  if ((pb & 0x7FFFFFFFu) != 0x7F800000u) {  // NaN
    const uint32_t sign = ((FloatBits(x) ^ FloatBits(scale)) >> 24) & 0x80u;
    return static_cast<uint8_t>(sign | F::kNanCode);
  }
  const uint8_t sign = static_cast<uint8_t>((pb >> 24) & 0x80u);
  if (IsFinite(x) && IsFinite(scale)) return sign | F::kMaxCode;
  return sign | F::kInfCode;
}

// The quantize of one element: the FP8 code of x * scale, computed in
// float32 (see FloatToFp8; NaN and overflow of the multiply as in
// Fp8OfNonFiniteProduct).
template <typename F>
FP8JAX_HD uint8_t QuantizeValue(float x, float scale) {
  const float p = x * scale;
  if (!IsFinite(p)) return Fp8OfNonFiniteProduct<F>(x, scale, p);
  return FloatToFp8<F>(p);
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

// The dequantize of one element before its rounding to the output type:
// float(code) * scale_inv in float32. A NaN result is the quiet NaN
// 0x7FC00000 with the sign of the product (sign(code) XOR sign(scale_inv)),
// whatever the platform's multiply does with NaN signs.
template <typename F>
FP8JAX_HD float DequantizeValue(uint8_t code, float scale_inv) {
  const float p = Fp8ToFloat<F>(code) * scale_inv;
  if ((FloatBits(p) & 0x7FFFFFFFu) <= 0x7F800000u) return p;
  const uint32_t sign = ((static_cast<uint32_t>(code) << 24) ^ FloatBits(scale_inv)) & 0x80000000u;
  return BitsToFloat(sign | 0x7FC00000u);
}

// float -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN with
// its sign.
FP8JAX_HD uint16_t FloatToBf16Bits(float x) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

FP8JAX_HD float Bf16BitsToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// float -> IEEE half bits, round to nearest even; overflow -> inf; NaN ->
// sign|0x7E00.
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

// IEEE half bits -> float, exact. A NaN keeps its sign and payload and is
// quieted (as XLA's f16 -> f32 convert does), so the amax of a float16 input
// holding a signalling NaN has the bits of the jnp reference's.
FP8JAX_HD float F16BitsToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) {
    const uint32_t quiet = man != 0 ? 0x00400000u : 0u;
    return BitsToFloat(sign | 0x7F800000u | quiet | (man << 13));
  }
  if (exp == 0) {
    const float v = static_cast<float>(man) / 16777216.0f;
    return BitsToFloat(sign | FloatBits(v));
  }
  return BitsToFloat(sign | ((exp + 112u) << 23) | (man << 13));
}

// The IEEE half conversions above as a policy of common/wide.h's element access (the CPU
// kernels'; the CUDA kernels use FastHalf, fp8_device_convert.h, with the same bits).
struct ExactHalf {
  static FP8JAX_HD float Load(uint16_t h) { return F16BitsToFloat(h); }
  static FP8JAX_HD uint16_t Store(float v) { return FloatToF16Bits(v); }
};

// max(a, b) that propagates NaN, like jnp.max.
FP8JAX_HD float NanMax(float a, float b) {
  if (a != a) return a;
  if (b != b) return b;
  return b > a ? b : a;
}

// Whether the delayed-scaling update records an observed amax: only a finite
// one. A NaN or +-inf observation leaves that tensor's history and scale
// exactly as they were (not even shifted), so one bad step cannot freeze the
// scale for a whole history length (docs/numerics.md).
FP8JAX_HD bool RecordsObservation(float amax) { return IsFinite(amax); }

// The delayed-scaling scale update for one tensor (docs/numerics.md): reduced amax
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
