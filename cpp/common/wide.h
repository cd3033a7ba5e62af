// Element access of a wide (float32, bfloat16 or float16) buffer, shared by the CPU and CUDA
// kernels: element i as float, and v rounded to the wide dtype (round to nearest even).
//
// H converts IEEE half bits: ExactHalf (fp8_numerics.h, the default: the CPU kernels', in
// software) or FastHalf (fp8_device_convert.h: the CUDA kernels', the hardware conversion with the
// same bits, tested on the host over every input in tests/cpp). bfloat16 needs no policy: its
// conversions (fp8_numerics.h) are a shift and integer rounding on either side.
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"    // WideKind
#include "common/fp8_numerics.h"  // FP8JAX_HD, ExactHalf

namespace fp8jax {

// Element i of a wide buffer, as float.
template <WideKind W, typename H = ExactHalf>
FP8JAX_HD float LoadWide(const void* p, int64_t i) {
  if constexpr (W == WideKind::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (W == WideKind::kBF16) {
    return Bf16BitsToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return H::Load(static_cast<const uint16_t*>(p)[i]);
  }
}

// Element i of a wide buffer whose dtype is known at run time only (a small vector: gamma, beta).
template <typename H = ExactHalf>
FP8JAX_HD float LoadWideOf(const void* p, WideKind k, int64_t i) {
  if (k == WideKind::kF32) return LoadWide<WideKind::kF32, H>(p, i);
  if (k == WideKind::kBF16) return LoadWide<WideKind::kBF16, H>(p, i);
  return LoadWide<WideKind::kF16, H>(p, i);
}

// The bits of v rounded to a 2-byte wide dtype (bfloat16 or float16).
template <WideKind W, typename H = ExactHalf>
FP8JAX_HD uint16_t WideBits(float v) {
  static_assert(W == WideKind::kBF16 || W == WideKind::kF16);
  if constexpr (W == WideKind::kBF16) {
    return FloatToBf16Bits(v);
  } else {
    return H::Store(v);
  }
}

// v rounded to the wide dtype, stored as element i.
template <WideKind W, typename H = ExactHalf>
FP8JAX_HD void StoreWide(void* p, int64_t i, float v) {
  if constexpr (W == WideKind::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = WideBits<W, H>(v);
  }
}

// v rounded to the wide dtype and back: what StoreWide then LoadWide give.
template <WideKind W, typename H = ExactHalf>
FP8JAX_HD float RoundWide(float v) {
  if constexpr (W == WideKind::kF32) {
    return v;
  } else if constexpr (W == WideKind::kBF16) {
    return Bf16BitsToFloat(FloatToBf16Bits(v));
  } else {
    return H::Load(H::Store(v));
  }
}

}  // namespace fp8jax
