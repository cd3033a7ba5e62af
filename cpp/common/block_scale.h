// Block-scaled FP8 (Float8BlockScaling, MXFP8): the scale rules and the tile walk the CPU and CUDA
// kernels share. The definitions are fp8jax/ops/block/block_scaling.py's jnp references
// (docs/numerics.md, "Block scaling"); every function here computes the same float32 operations in
// the same order, so the kernels give the references' bits.
//
// A block-scaled cast quantizes a [M, K] matrix (one of G) in blocks of br x bc elements: a
// block's amax is the max |x| over its elements that exist (a ragged edge block is smaller; NaN is
// left out), its scale follows from the amax, and each element's code is QuantizeValue(x, scale).
// The scale grid is [ceil(M / br), ceil(K / bc)], row-major. A transposed cast writes the codes as
// [K, M] and the grid as [ceil(K / bc), ceil(M / br)]: x.T quantized with blocks bc x br.
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"  // WideKind
#include "common/fp8_numerics.h"

namespace fp8jax::block {

// How a block's scale is made from its amax (the op's "scale_mode" attribute).
enum class ScaleMode : int64_t {
  kF32 = 0,   // float32 fp8_max / amax (Float8BlockScaling with power_2_scale=False)
  kPow2 = 1,  // the same, rounded down to a power of two (Float8BlockScaling's default)
  kE8m0 = 2,  // MXFP8: a biased E8M0 exponent, amax / fp8_max rounded up to a power of two
};

inline constexpr float kSmallestNormal = 1.17549435e-38f;  // float32's, 2**-126

// The kernels take blocks whose dims are powers of two up to kTile, of at least kMinBlockElems
// elements; the CUDA kernel's tile (kTile x kTile) then holds whole blocks, at most kMaxTileBlocks.
inline constexpr int64_t kTile = 128;
inline constexpr int64_t kMinBlockElems = 32;
inline constexpr int64_t kMaxTileBlocks = kTile * kTile / kMinBlockElems;

// True when the kernels take br x bc blocks (see above).
FP8JAX_HD bool KernelBlock(int64_t br, int64_t bc) {
  const auto pow2 = [](int64_t d) { return d >= 1 && d <= kTile && (d & (d - 1)) == 0; };
  return pow2(br) && pow2(bc) && br * bc >= kMinBlockElems;
}

// An element's contribution to its block's amax: the bits of |x|, 0 for NaN (a NaN does not
// decide its block's scale; an inf does). The unsigned order of these bits is the numeric order.
FP8JAX_HD uint32_t AmaxBits(float x) {
  const uint32_t a = AbsBits(x);
  return a > 0x7F800000u ? 0u : a;
}

// 2**k as float32 from its bits, k in [-126, 127].
FP8JAX_HD float Pow2(int k) { return BitsToFloat(static_cast<uint32_t>(k + 127) << 23); }

// The largest finite value of the input dtype W, as float32: an overflowing scale becomes it.
template <WideKind W>
FP8JAX_HD float InputMax() {
  if constexpr (W == WideKind::kF32) return BitsToFloat(0x7F7FFFFFu);
  if constexpr (W == WideKind::kBF16) return BitsToFloat(0x7F7F0000u);
  return 65504.0f;
}

// Float8BlockScaling's scale (block_scaling.block_scale): amax raised to `epsilon`; an amax of 0,
// below float32's smallest normal, inf or NaN gives 1; else fp8_max / amax, an overflow to inf
// becoming `input_max` (the input dtype's largest value), kept to its exponent when `pow2`.
FP8JAX_HD float BlockScale(float amax, float fp8_max, float input_max, bool pow2, float epsilon) {
  if (amax < epsilon) amax = epsilon;
  if (!(amax >= kSmallestNormal) || !IsFinite(amax)) return 1.0f;
  float scale = RnDiv(fp8_max, amax);
  if (!IsFinite(scale)) scale = input_max;
  if (pow2) scale = BitsToFloat(FloatBits(scale) & 0xFF800000u);
  return scale;
}

// MXFP8's scale (block_scaling.e8m0_exponent): the biased exponent of amax / fp8_max rounded up
// to a power of two, clipped to [0, 254]; 255 (E8M0's NaN) for NaN, 254 for inf, 0 for an amax of
// 0 or below float32's smallest normal. The quotient is amax * (1 / fp8_max), computed 2**64
// higher when amax < 1 so that it is never subnormal.
FP8JAX_HD uint8_t E8m0Exponent(float amax, float fp8_max) {
  if (amax != amax) return 0xFF;
  if (!IsFinite(amax)) return 0xFE;
  if (!(amax >= kSmallestNormal)) return 0;
  const float rcp = RnDiv(1.0f, fp8_max);
  const bool small = amax < 1.0f;
  const float w = RnMul(amax, small ? RnMul(rcp, 18446744073709551616.0f) : rcp);
  const uint32_t bits = FloatBits(w);
  int biased = static_cast<int>((bits >> 23) & 0xFFu) + ((bits & 0x7FFFFFu) != 0 ? 1 : 0);
  if (small) biased -= 64;
  return static_cast<uint8_t>(biased < 0 ? 0 : (biased > 254 ? 254 : biased));
}

// The FP8 code of x under the E8M0 scale 2**(e - 127): x * 2**(127 - e), the multiplier applied
// as two normal factors 2**lo and 2**(k - lo) (lo = floor(k / 2)), each product exact unless it
// underflows; `quantize(v, scale)` is the platform's code of v * scale (the CPU's QuantizeValue,
// the GPU's conversion instruction: the same bits). e = 255 (NaN scale) gives the format's NaN.
template <typename F, typename Quantize>
FP8JAX_HD uint8_t MxQuantizeValue(float x, uint8_t e, Quantize quantize) {
  if (e == 0xFF) return F::kNanCode;
  const int k = 127 - static_cast<int>(e);
  const int lo = k >= 0 ? k / 2 : -((1 - k) / 2);
  return quantize(RnMul(x, Pow2(lo)), Pow2(k - lo));
}

// The float32 value of the inverse scale stored beside the codes: 1 / scale.
FP8JAX_HD float InverseScale(float scale) { return RnDiv(1.0f, scale); }

// One block-scaled cast, as the handlers describe it to the kernels.
struct Cast {
  int64_t groups = 0;  // G matrices
  int64_t rows = 0;    // M
  int64_t cols = 0;    // K
  int64_t br = 1;      // block rows
  int64_t bc = 1;      // block cols
  ScaleMode mode = ScaleMode::kPow2;
  float epsilon = 0.0f;
  bool transposed = false;  // codes [K, M], grid [ceil(K / bc), ceil(M / br)]
  // Untransposed layout only: matrices come in runs of `interleave` whose rows are interleaved,
  // [..., M, interleave, K] (a gated activation's gradient, [m, 2, n]); grid likewise.
  int64_t interleave = 1;

  FP8JAX_HD int64_t GridRows() const { return (rows + br - 1) / br; }
  FP8JAX_HD int64_t GridCols() const { return (cols + bc - 1) / bc; }
  FP8JAX_HD int64_t GridSize() const { return GridRows() * GridCols(); }
  // Where block (i, j) of matrix g keeps its scale.
  FP8JAX_HD int64_t ScaleIndex(int64_t g, int64_t i, int64_t j) const {
    if (transposed) return g * GridSize() + j * GridRows() + i;
    const int64_t run = g / interleave, k = g % interleave;
    return ((run * GridRows() + i) * interleave + k) * GridCols() + j;
  }
  // Where element (r, c) of matrix g keeps its code.
  FP8JAX_HD int64_t CodeIndex(int64_t g, int64_t r, int64_t c) const {
    if (transposed) return g * rows * cols + c * rows + r;
    const int64_t run = g / interleave, k = g % interleave;
    return ((run * rows + r) * interleave + k) * cols + c;
  }
  // The CUDA kernel's kTile x kTile tiles.
  FP8JAX_HD int64_t TileRows() const { return (rows + kTile - 1) / kTile; }
  FP8JAX_HD int64_t TileCols() const { return (cols + kTile - 1) / kTile; }
  FP8JAX_HD int64_t Tiles() const { return groups * TileRows() * TileCols(); }
};

}  // namespace fp8jax::block
