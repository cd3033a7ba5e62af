// The CPU computations of the activations (ops/activations.h): activation, dactivation, and the
// fused activation_cast_transpose and dactivation_cast_transpose_dbias, whose
// rows come from a prologue (cpu_cast_transpose.h) computing the activation
// (or its gradient) of each row, rounded to the wide dtype, with the math of
// common/activations.h.
#include <cstdint>

#include "common/activations.h"
#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/wide.h"
#include "cpu/cpu_cast_transpose.h"
#include "cpu/cpu_handler.h"
#include "cpu/cpu_parallel.h"
#include "ops/activations.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// Row r of y[rows, n] from x[rows, k, n] (rows of every matrix, consecutive).
template <WideKind W, int A, bool G>
struct ActRows {
  static constexpr bool kDirect = false;
  const void* x;
  int64_t rows;
  int64_t n;
  void Row(int64_t matrix, int64_t r, void* out) const {
    const int64_t a0 = (matrix * rows + r) * (G ? 2 : 1) * n;
    for (int64_t c = 0; c < n; ++c) {
      const float a = LoadWide<W>(x, a0 + c);
      const float b = G ? LoadWide<W>(x, a0 + n + c) : 1.0f;
      StoreWide<W>(out, c, act::Forward<A, G>(a, b));
    }
  }
};

// Row r of dx[rows, k * n] from g[rows, n] and x[rows, k, n].
template <WideKind W, int A, bool G>
struct DActRows {
  static constexpr bool kDirect = false;
  const void* g;
  const void* x;
  int64_t rows;
  int64_t n;
  void Row(int64_t matrix, int64_t r, void* out) const {
    const int64_t row = matrix * rows + r;
    const int64_t a0 = row * (G ? 2 : 1) * n;
    for (int64_t c = 0; c < n; ++c) {
      const float gv = LoadWide<W>(g, row * n + c);
      const float a = LoadWide<W>(x, a0 + c);
      const float b = G ? LoadWide<W>(x, a0 + n + c) : 1.0f;
      float da = 0.0f;
      float db = 0.0f;
      act::Backward<A, G>(gv, a, b, &da, &db);
      StoreWide<W>(out, c, da);
      if constexpr (G) StoreWide<W>(out, n + c, db);
    }
  }
};

// Writes every row of a source into `out` (rows of `row_elems` wide values).
template <WideKind W, typename Source>
void WriteRows(ffi::ThreadPool* pool, const Source& src, int64_t total_rows, int64_t row_elems,
               void* out) {
  const int64_t grain = std::max<int64_t>(1, kGrain / 8 / std::max<int64_t>(1, row_elems));
  ParallelFor(pool, total_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      src.Row(0, r, static_cast<char*>(out) + r * row_elems * kWideSize<W>);
    }
  });
}

// Calls fn.template operator()<W, A, G>() for a float dtype and activation ((act, gated) checked
// by the op).
template <typename Fn>
ffi::Error DispatchWideAct(const char* op, ffi::DataType t, int64_t code, int64_t gated, Fn&& fn) {
  return act::Dispatch(code, gated, [&]<int A, bool G>() {
    switch (WideKindOf(t)) {
      case WideKind::kF32:
        return fn.template operator()<WideKind::kF32, A, G>();
      case WideKind::kBF16:
        return fn.template operator()<WideKind::kBF16, A, G>();
      case WideKind::kF16:
        return fn.template operator()<WideKind::kF16, A, G>();
      default:
        return BadArg(op, "x must be float32, bfloat16 or float16");
    }
  });
}

}  // namespace

ffi::Error Activation::Compute(CpuPool pool) {
  return DispatchWideAct(kName, x.element_type(), code, gated, [&]<WideKind W, int A, bool G>() {
    const ActRows<W, A, G> src{x.untyped_data(), s.matrices * s.rows, s.cols};
    WriteRows<W>(&pool, src, s.matrices * s.rows, s.cols, y->untyped_data());
    return ffi::Error::Success();
  });
}

ffi::Error DActivation::Compute(CpuPool pool) {
  const int64_t k = gated != 0 ? 2 : 1;
  return DispatchWideAct(kName, x.element_type(), code, gated, [&]<WideKind W, int A, bool G>() {
    const DActRows<W, A, G> src{g.untyped_data(), x.untyped_data(), s.matrices * s.rows, s.cols};
    WriteRows<W>(&pool, src, s.matrices * s.rows, k * s.cols, dx->untyped_data());
    return ffi::Error::Success();
  });
}

namespace {

// The fused forms: the engine with an activation prologue. `s` is the shape
// of the quantized matrix ([m, n] forward; [m, k * n] backward).
template <typename MakeSource>
ffi::Error FusedCastTranspose(const char* op, ffi::ThreadPool* pool, ffi::DataType wide,
                              int64_t code, int64_t gated, ffi::Result<ffi::AnyBuffer>& q,
                              const MatrixShape& s, const CastTransposeOut& o, MakeSource&& make) {
  const Fp8Kind f = Fp8KindOf(q->element_type());
  return DispatchWideAct(op, wide, code, gated, [&]<WideKind W, int A, bool G>() {
    return DispatchWideFp8(op, W, f, [&]<WideKind W2, typename F>() {
      if constexpr (W2 == W) {
        CastTransposeRows<W, F>(pool, make.template operator()<W, A, G>(), o, s);
      }
      return ffi::Error::Success();
    });
  });
}

}  // namespace

ffi::Error ActivationCastTranspose::Compute(CpuPool pool) {
  const CastTransposeOut o{scale.typed_data(),
                           static_cast<uint8_t*>(q->untyped_data()),
                           static_cast<uint8_t*>(qt->untyped_data()),
                           scale_inv->typed_data(),
                           amax->typed_data(),
                           nullptr,
                           nullptr};
  return FusedCastTranspose(kName, &pool, x.element_type(), code, gated, q, s, o,
                            [&]<WideKind W, int A, bool G>() {
                              return ActRows<W, A, G>{x.untyped_data(), s.rows, s.cols};
                            });
}

ffi::Error DActivationCastTransposeDbias::Compute(CpuPool pool) {
  const CastTransposeOut o{scale.typed_data(),
                           static_cast<uint8_t*>(q->untyped_data()),
                           static_cast<uint8_t*>(qt->untyped_data()),
                           scale_inv->typed_data(),
                           amax->typed_data(),
                           dbias->typed_data(),
                           workspace->typed_data()};
  return FusedCastTranspose(
      kName, &pool, x.element_type(), code, gated, q, qs, o, [&]<WideKind W, int A, bool G>() {
        return DActRows<W, A, G>{g.untyped_data(), x.untyped_data(), xs.rows, xs.cols};
      });
}

}  // namespace fp8jax
