// The element conversions of the CUDA kernels, as __host__ __device__ helpers.
//
// The kernels in cpp/cuda/cuda_ops.cu call exactly these functions. They use
// the hardware conversions for the common finite case and fix the special
// values in software, so that they return the bits of the CPU definitions in
// fp8_numerics.h (docs/numerics.md). The fix-ups are needed because the
// hardware differs from the contract on special values:
//   - cvt.rn.satfinite to FP8 turns +-inf into +-max and every NaN into 0x7F;
//   - an FP32 multiply with a NaN operand returns the canonical NaN
//     0x7FFFFFFF (no sign, no payload), so x * scale loses a NaN's sign;
//   - cvt.f32.f16 and cvt.rn.f16.f32 return the canonical NaN too.
// The CUDA headers carry host implementations of these intrinsics that model
// the hardware (NaN canonicalisation included), so the same helpers compile
// for the host and tests/cpp/test_device_numerics.cc checks them there
// against fp8_numerics.h over every float32 and every 16-bit input.
//
// Only CUDA code and host tests with CUDA's include directory include this
// header; the CPU extension does not need the CUDA headers.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/fp8_numerics.h"

namespace fp8jax {

// Hardware round-to-nearest-even with finite saturation of a float to FP8
// (cvt.rn.satfinite.{e4m3,e5m2}x2.f32 on sm_89+). Matches FloatToFp8 on every
// finite input; +-inf and NaN must be fixed by the caller.
template <typename F>
FP8JAX_HD uint8_t CvtFp8Finite(float p) {
  constexpr __nv_fp8_interpretation_t kInterp = F::kMantissaBits == 3 ? __NV_E4M3 : __NV_E5M2;
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(p, __NV_SATFINITE, kInterp));
}

// The code of p = x * scale as the platform's multiply computed it: only the
// class of p (and the sign of an inf) is read when p is not finite, so a
// canonical NaN from the GPU's multiply gives the same code as the CPU's
// sign-keeping NaN. One compare and a rarely taken branch over the hardware
// conversion.
template <typename F>
FP8JAX_HD uint8_t CvtFp8FromProduct(float x, float scale, float p) {
  uint8_t code = CvtFp8Finite<F>(p);
  if ((FloatBits(p) & 0x7F800000u) == 0x7F800000u) code = Fp8OfNonFiniteProduct<F>(x, scale, p);
  return code;
}

// The quantize of one element on the device: QuantizeValue<F>(x, scale).
template <typename F>
FP8JAX_HD uint8_t CvtFp8(float x, float scale) {
  return CvtFp8FromProduct<F>(x, scale, x * scale);
}

// IEEE half bits -> float, exact (F16BitsToFloat): the hardware conversion,
// with a NaN rebuilt from the bits (sign and payload kept, quieted).
FP8JAX_HD float F16BitsToFloatFast(uint16_t h) {
  float v = __half2float(__ushort_as_half(h));
  if ((h & 0x7FFFu) > 0x7C00u) {
    v = BitsToFloat((static_cast<uint32_t>(h & 0x8000u) << 16) | 0x7FC00000u |
                    (static_cast<uint32_t>(h & 0x3FFu) << 13));
  }
  return v;
}

// float -> IEEE half bits, round to nearest even (FloatToF16Bits): the
// hardware conversion, with NaN -> sign|0x7E00.
FP8JAX_HD uint16_t FloatToF16BitsFast(float v) {
  uint16_t h = __half_as_ushort(__float2half_rn(v));
  const uint32_t u = FloatBits(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) h = static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u);
  return h;
}

// The hardware half conversions as a policy of common/wide.h's element access (ExactHalf's bits).
struct FastHalf {
  static FP8JAX_HD float Load(uint16_t h) { return F16BitsToFloatFast(h); }
  static FP8JAX_HD uint16_t Store(float v) { return FloatToF16BitsFast(v); }
};

}  // namespace fp8jax
