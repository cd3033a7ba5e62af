// CPU FFI handlers: quantize, dequantize, cast_transpose, update_fp8_state.
//
// Layering (as in jax's examples/ffi): a typed compute loop, a dispatcher on
// the runtime dtypes that returns ffi::Error for anything unexpected, and the
// XLA_FFI_DEFINE_HANDLER_SYMBOL binding at the bottom.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// Loads element i of a wide (f32/bf16/f16) buffer as float.
template <WideKind W>
inline float LoadWide(const void* p, int64_t i) {
  if constexpr (W == WideKind::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (W == WideKind::kBF16) {
    return Bf16BitsToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return F16BitsToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

template <WideKind W>
inline void StoreWide(void* p, int64_t i, float v) {
  if constexpr (W == WideKind::kF32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (W == WideKind::kBF16) {
    static_cast<uint16_t*>(p)[i] = FloatToBf16Bits(v);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToF16Bits(v);
  }
}

// ---------------------------------------------------------------- quantize

template <WideKind W, typename F>
void QuantizeCompute(const void* x, const float* scale, uint8_t* q, float* scale_inv, float* amax,
                     GroupShape s) {
  for (int64_t g = 0; g < s.groups; ++g) {
    const float sc = scale[g];
    uint32_t amax_bits = 0;
    const int64_t base = g * s.per_group;
    for (int64_t i = base; i < base + s.per_group; ++i) {
      const float v = LoadWide<W>(x, i);
      amax_bits = std::max(amax_bits, AbsBits(v));
      q[i] = QuantizeValue<F>(v, sc);
    }
    amax[g] = BitsToFloat(amax_bits);
    scale_inv[g] = 1.0f / sc;
  }
}

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                        ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  GroupShape s;
  if (auto err = GroupShapeOf("quantize", x.element_count(), scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (q->element_count() != x.element_count()) return BadArg("quantize", "output size mismatch");
  return DispatchWideFp8("quantize", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           QuantizeCompute<W, F>(x.untyped_data(), scale.typed_data(),
                                                 static_cast<uint8_t*>(q->untyped_data()),
                                                 scale_inv->typed_data(), amax->typed_data(), s);
                           return ffi::Error::Success();
                         });
}

// -------------------------------------------------------------- dequantize

template <WideKind W, typename F>
void DequantizeCompute(const uint8_t* q, const float* scale_inv, void* out, GroupShape s) {
  for (int64_t g = 0; g < s.groups; ++g) {
    const float si = scale_inv[g];
    const int64_t base = g * s.per_group;
    for (int64_t i = base; i < base + s.per_group; ++i) {
      StoreWide<W>(out, i, DequantizeValue<F>(q[i], si));
    }
  }
}

ffi::Error DequantizeImpl(ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale_inv,
                          ffi::Result<ffi::AnyBuffer> out) {
  GroupShape s;
  if (auto err = GroupShapeOf("dequantize", q.element_count(), scale_inv.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (out->element_count() != q.element_count()) {
    return BadArg("dequantize", "output size mismatch");
  }
  return DispatchWideFp8("dequantize", WideKindOf(out->element_type()), Fp8KindOf(q.element_type()),
                         [&]<WideKind W, typename F>() {
                           DequantizeCompute<W, F>(static_cast<const uint8_t*>(q.untyped_data()),
                                                   scale_inv.typed_data(), out->untyped_data(), s);
                           return ffi::Error::Success();
                         });
}

// ---------------------------------------------------------- cast_transpose

template <WideKind W, typename F>
void CastTransposeCompute(const void* x, const float* scale, uint8_t* q, uint8_t* qt,
                          float* scale_inv, float* amax, MatrixShape s) {
  const int64_t per_group = s.matrices / s.groups;
  const int64_t mat_size = s.rows * s.cols;
  for (int64_t g = 0; g < s.groups; ++g) {
    const float sc = scale[g];
    uint32_t amax_bits = 0;
    for (int64_t m = g * per_group; m < (g + 1) * per_group; ++m) {
      const int64_t base = m * mat_size;
      for (int64_t r = 0; r < s.rows; ++r) {
        for (int64_t c = 0; c < s.cols; ++c) {
          const float v = LoadWide<W>(x, base + r * s.cols + c);
          amax_bits = std::max(amax_bits, AbsBits(v));
          const uint8_t code = QuantizeValue<F>(v, sc);
          q[base + r * s.cols + c] = code;
          qt[base + c * s.rows + r] = code;
        }
      }
    }
    amax[g] = BitsToFloat(amax_bits);
    scale_inv[g] = 1.0f / sc;
  }
}

ffi::Error CastTransposeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  MatrixShape s;
  if (auto err = MatrixShapeOf("cast_transpose", x.dimensions(), scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (q->element_type() != qt->element_type() || q->element_count() != x.element_count() ||
      qt->element_count() != x.element_count()) {
    return BadArg("cast_transpose", "outputs must match the input size and share an FP8 dtype");
  }
  return DispatchWideFp8(
      "cast_transpose", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        CastTransposeCompute<W, F>(x.untyped_data(), scale.typed_data(),
                                   static_cast<uint8_t*>(q->untyped_data()),
                                   static_cast<uint8_t*>(qt->untyped_data()),
                                   scale_inv->typed_data(), amax->typed_data(), s);
        return ffi::Error::Success();
      });
}

// -------------------------------------------------------- update_fp8_state

ffi::Error UpdateFp8StateImpl(ffi::Buffer<ffi::F32> history, ffi::Buffer<ffi::F32> scale,
                              ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::F32> fp8_max,
                              int64_t margin, int64_t algo,
                              ffi::Result<ffi::Buffer<ffi::F32>> new_history,
                              ffi::Result<ffi::Buffer<ffi::F32>> new_scale) {
  HistoryShape s;
  if (auto err = HistoryShapeOf(history.dimensions(), history.element_count(),
                                scale.element_count(), amax.element_count(),
                                fp8_max.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (auto err = CheckAlgo(algo); !err.success()) return err;
  const float margin_factor = std::ldexp(1.0f, -static_cast<int>(margin));
  const float* h = history.typed_data();
  float* nh = new_history->typed_data();
  for (int64_t r = 0; r < s.rows; ++r) {
    const float* hr = h + r * s.len;
    float* nr = nh + r * s.len;
    const float a = amax.typed_data()[r];
    if (!RecordsObservation(a)) {  // NaN or +-inf: the row stays exactly as it was
      std::copy(hr, hr + s.len, nr);
      new_scale->typed_data()[r] = scale.typed_data()[r];
      continue;
    }
    nr[0] = a;
    float red = a;
    for (int64_t i = 1; i < s.len; ++i) {
      nr[i] = hr[i - 1];
      if (algo == 0) red = NanMax(red, nr[i]);
    }
    new_scale->typed_data()[r] =
        ComputeScale(red, scale.typed_data()[r], fp8_max.typed_data()[r], margin_factor);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxQuantizeCpu, fp8jax::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxDequantizeCpu, fp8jax::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxCastTransposeCpu, fp8jax::CastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxUpdateFp8StateCpu, fp8jax::UpdateFp8StateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("margin")
                                  .Attr<int64_t>("algo")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
