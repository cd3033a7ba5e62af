// Branch-free, auto-vectorisable loops of the CPU kernels (host only).
//
// Each loop computes exactly what the scalar functions of
// cpp/common/fp8_numerics.h compute, element by element, with the same float
// operations in the same order (so the same rounding under the caller's
// floating-point environment), but with selects instead of branches so that
// the compiler turns the loop into SIMD code. Rare inputs that the selects do
// not cover (a non-finite product in quantize) make the block fall back to the
// scalar function, which stays the definition.
//
// Each loop is instantiated twice: for the baseline ISA, and for AVX2 (called
// only when the CPU has it, checked once at run time), so a wheel built
// without -march flags still uses 256-bit vectors where they exist. Neither
// build uses -ffast-math, and the AVX2 target does not enable FMA, so no
// multiply is fused with an add.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>

#include "common/dispatch.h"
#include "common/fp8_numerics.h"

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define FP8JAX_MULTIVERSION 1
#define FP8JAX_AVX2 __attribute__((target("avx2")))
#define FP8JAX_INLINE inline __attribute__((always_inline))
#else
#define FP8JAX_INLINE inline
#endif

namespace fp8jax {
namespace loops {

// Bits of element i of a wide input, widened to float32 bits (bf16/f16 exact).
template <WideKind W>
FP8JAX_INLINE uint32_t LoadBits(const void* p, int64_t i) {
  if constexpr (W == WideKind::kF32) {
    uint32_t u;
    std::memcpy(&u, static_cast<const char*>(p) + 4 * i, 4);
    return u;
  } else if constexpr (W == WideKind::kBF16) {
    return static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
  } else {
    return FloatBits(F16BitsToFloat(static_cast<const uint16_t*>(p)[i]));
  }
}

// FloatToFp8<F>(p) for a finite product p given as bits (the caller routes
// non-finite products to QuantizeValue): saturation, the normal rounding on
// the bits, and the subnormal rounding of FloatToFp8 done by adding 2^23
// (exact round-to-nearest-even of a float in [0, 2^23), like nearbyint).
template <typename F>
FP8JAX_INLINE uint8_t FiniteFp8(uint32_t pb) {
  const uint32_t sign = (pb >> 24) & 0x80u;
  const uint32_t a = pb & 0x7FFFFFFFu;
  constexpr int kShift = 23 - F::kMantissaBits;
  constexpr uint32_t kMinNormalBits = static_cast<uint32_t>(127 + 1 - F::kBias) << 23;
  constexpr uint32_t kRebias = static_cast<uint32_t>(127 - F::kBias) << F::kMantissaBits;
  const uint32_t rn =
      ((a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u)) >> kShift) - kRebias;
  constexpr int kScaleExp = F::kBias - 1 + F::kMantissaBits;
  const float scaled = BitsToFloat(a) * static_cast<float>(1u << kScaleExp);
  const uint32_t rs = FloatBits(scaled + 8388608.0f) - 0x4B000000u;
  // A mask, not a select: the float operations above must stay unconditional
  // for the compiler to vectorise the loop (it does not speculate a float
  // operation that it has sunk into one arm, as the FP exceptions it might
  // raise are observable).
  const uint32_t normal = 0u - static_cast<uint32_t>(a >= kMinNormalBits);
  uint32_t r = (rn & normal) | (rs & ~normal);
  // af >= kMax, on the bits (a is finite and non-negative here).
  constexpr uint32_t kMaxBits = std::bit_cast<uint32_t>(F::kMax);
  const uint32_t big = 0u - static_cast<uint32_t>(a >= kMaxBits);
  r = (r & ~big) | (static_cast<uint32_t>(F::kMaxCode) & big);
  return static_cast<uint8_t>(sign | r);
}

// Quantizes x[begin, end) with scale sc into q (same indices); returns the
// unsigned max of |x| bits, max-ed into `amax_bits`. Blocks with a non-finite
// product are redone with the scalar QuantizeValue.
template <WideKind W, typename F>
FP8JAX_INLINE void QuantizeRangeBody(const void* x, float sc, uint8_t* q, int64_t begin,
                                     int64_t end, uint32_t* amax_bits) {
  constexpr int64_t kBlock = 512;
  uint32_t amax = *amax_bits;
  for (int64_t b = begin; b < end; b += kBlock) {
    const int64_t e = std::min(end, b + kBlock);
    uint32_t nonfinite = 0;
    for (int64_t i = b; i < e; ++i) {
      const uint32_t xb = LoadBits<W>(x, i);
      const uint32_t ax = xb & 0x7FFFFFFFu;
      amax = ax > amax ? ax : amax;
      const uint32_t pb = FloatBits(BitsToFloat(xb) * sc);
      nonfinite |= (pb & 0x7F800000u) == 0x7F800000u ? 1u : 0u;
      q[i] = FiniteFp8<F>(pb);
    }
    if (nonfinite != 0) {
      for (int64_t i = b; i < e; ++i) q[i] = QuantizeValue<F>(BitsToFloat(LoadBits<W>(x, i)), sc);
    }
  }
  *amax_bits = amax;
}

// out[i] = the output-dtype bits of DequantizeValue<F>(q[i], si), from a
// 256-entry table built with that same function.
template <WideKind W>
FP8JAX_INLINE void TableRangeBody(const uint8_t* q, const uint32_t* table, void* out, int64_t begin,
                                  int64_t end) {
  if constexpr (W == WideKind::kF32) {
    uint32_t* o = static_cast<uint32_t*>(out);
    for (int64_t i = begin; i < end; ++i) o[i] = table[q[i]];
  } else {
    uint16_t* o = static_cast<uint16_t*>(out);
    for (int64_t i = begin; i < end; ++i) o[i] = static_cast<uint16_t>(table[q[i]]);
  }
}

// The two instantiations and the run-time choice between them.
template <WideKind W, typename F>
void QuantizeRangeBase(const void* x, float sc, uint8_t* q, int64_t b, int64_t e, uint32_t* m) {
  QuantizeRangeBody<W, F>(x, sc, q, b, e, m);
}

template <WideKind W>
void TableRangeBase(const uint8_t* q, const uint32_t* t, void* out, int64_t b, int64_t e) {
  TableRangeBody<W>(q, t, out, b, e);
}

#if defined(FP8JAX_MULTIVERSION)
template <WideKind W, typename F>
FP8JAX_AVX2 void QuantizeRangeAvx2(const void* x, float sc, uint8_t* q, int64_t b, int64_t e,
                                   uint32_t* m) {
  QuantizeRangeBody<W, F>(x, sc, q, b, e, m);
}

template <WideKind W>
FP8JAX_AVX2 void TableRangeAvx2(const uint8_t* q, const uint32_t* t, void* out, int64_t b,
                                int64_t e) {
  TableRangeBody<W>(q, t, out, b, e);
}

inline bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

template <WideKind W, typename F>
void QuantizeRange(const void* x, float sc, uint8_t* q, int64_t b, int64_t e, uint32_t* m) {
#if defined(FP8JAX_MULTIVERSION)
  if (HasAvx2()) return QuantizeRangeAvx2<W, F>(x, sc, q, b, e, m);
#endif
  QuantizeRangeBase<W, F>(x, sc, q, b, e, m);
}

template <WideKind W>
void TableRange(const uint8_t* q, const uint32_t* t, void* out, int64_t b, int64_t e) {
#if defined(FP8JAX_MULTIVERSION)
  if (HasAvx2()) return TableRangeAvx2<W>(q, t, out, b, e);
#endif
  TableRangeBase<W>(q, t, out, b, e);
}

}  // namespace loops
}  // namespace fp8jax
