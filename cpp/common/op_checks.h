// The argument checks of each op's handler, shared by the CPU and CUDA handlers (each handler
// calls its op's check first, then only computes). Built from the shape checks of ffi_checks.h.
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"
#include "common/norm_row.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

using F32Buffer = ffi::Buffer<ffi::F32>;

// quantize: x, one scale per group -> q (x's size).
inline ffi::Error CheckQuantize(const ffi::AnyBuffer& x, const F32Buffer& scale,
                                const ffi::AnyBuffer& q, GroupShape* s) {
  FP8JAX_RETURN_IF_ERROR(GroupShapeOf("quantize", x.element_count(), scale.element_count(), s));
  if (q.element_count() != x.element_count()) return BadArg("quantize", "output size mismatch");
  return ffi::Error::Success();
}

// dequantize: q, one scale_inv per group -> out (q's size).
inline ffi::Error CheckDequantize(const ffi::AnyBuffer& q, const F32Buffer& scale_inv,
                                  const ffi::AnyBuffer& out, GroupShape* s) {
  FP8JAX_RETURN_IF_ERROR(
      GroupShapeOf("dequantize", q.element_count(), scale_inv.element_count(), s));
  if (out.element_count() != q.element_count()) {
    return BadArg("dequantize", "output size mismatch");
  }
  return ffi::Error::Success();
}

// update_fp8_state: history [rows, len], scale/amax/fp8_max one per row, a known algorithm.
inline ffi::Error CheckUpdateFp8State(const F32Buffer& history, const F32Buffer& scale,
                                      const F32Buffer& amax, const F32Buffer& fp8_max, int64_t algo,
                                      HistoryShape* s) {
  if (auto err =
          HistoryShapeOf(history.dimensions(), history.element_count(), scale.element_count(),
                         amax.element_count(), fp8_max.element_count(), s);
      !err.success()) {
    return err;
  }
  return CheckAlgo(algo);
}

// activation: x [..., m, k, n] (k = 2 when gated) -> y [..., m, n] in x's dtype.
inline ffi::Error CheckActivation(const ffi::AnyBuffer& x, int64_t gated, const ffi::AnyBuffer& y,
                                  MatrixShape* s) {
  const char* op = "activation";
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, 1, s));
  if (y.element_type() != x.element_type() ||
      y.element_count() != s->matrices * s->rows * s->cols) {
    return BadArg(op, "y must be [m, n] of x's [m, k, n], in x's dtype");
  }
  return ffi::Error::Success();
}

// The incoming gradient g of an activation of x: [..., m, n] in x's dtype.
inline ffi::Error CheckGradInputs(const char* op, const ffi::AnyBuffer& g, const ffi::AnyBuffer& x,
                                  const MatrixShape& s) {
  if (g.element_type() != x.element_type()) return BadArg(op, "g and x must share a dtype");
  if (g.element_count() != s.matrices * s.rows * s.cols) {
    return BadArg(op, "g must have shape [m, n] of x's [m, k, n]");
  }
  return ffi::Error::Success();
}

// dactivation: g, x -> dx (x's shape, g's dtype).
inline ffi::Error CheckDActivation(const ffi::AnyBuffer& g, const ffi::AnyBuffer& x, int64_t gated,
                                   const ffi::AnyBuffer& dx, MatrixShape* s) {
  const char* op = "dactivation";
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, 1, s));
  FP8JAX_RETURN_IF_ERROR(CheckGradInputs(op, g, x, *s));
  if (dx.element_type() != g.element_type() || dx.element_count() != x.element_count()) {
    return BadArg(op, "dx must have x's shape and g's dtype");
  }
  return ffi::Error::Success();
}

// The FP8 outputs of a fused cast-transpose: q and q_t of `count` codes each, one FP8 dtype.
inline ffi::Error CheckFp8Outputs(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                  int64_t count) {
  if (q.element_type() != qt.element_type() || q.element_count() != count ||
      qt.element_count() != count) {
    return BadArg(op, "q and q_t must have the quantized size and share an FP8 dtype");
  }
  return ffi::Error::Success();
}

// activation_cast_transpose: x [..., m, k, n], one scale per group -> q, q_t of [m, n].
inline ffi::Error CheckActivationCastTranspose(const ffi::AnyBuffer& x, const F32Buffer& scale,
                                               int64_t gated, const ffi::AnyBuffer& q,
                                               const ffi::AnyBuffer& qt, MatrixShape* s) {
  const char* op = "activation_cast_transpose";
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, scale.element_count(), s));
  return CheckFp8Outputs(op, q, qt, s->matrices * s->rows * s->cols);
}

// dactivation_cast_transpose_dbias: g, x -> q, q_t (x's size), dbias [k, n], and the dbias
// workspace of `workspace_count` elements for tiles of `tile_rows` rows. `xs` gets x's shape, `s`
// the quantized matrix's ([m, k * n]).
inline ffi::Error CheckDActivationCastTransposeDbias(
    const ffi::AnyBuffer& g, const ffi::AnyBuffer& x, const F32Buffer& scale, int64_t gated,
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt, const F32Buffer& dbias,
    int64_t workspace_count, int64_t tile_rows, MatrixShape* xs, MatrixShape* s) {
  const char* op = "dactivation_cast_transpose_dbias";
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, scale.element_count(), xs));
  FP8JAX_RETURN_IF_ERROR(CheckGradInputs(op, g, x, *xs));
  FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(op, q, qt, x.element_count()));
  *s = *xs;
  s->cols = (gated != 0 ? 2 : 1) * xs->cols;
  if (dbias.element_count() != s->matrices * s->cols) {
    return BadArg(op, "dbias must have shape [k, n]");
  }
  return CheckDbiasWorkspace(op, *s, tile_rows, workspace_count);
}

// A norm's forward outputs: y like x, mean and rsigma one value per row.
inline ffi::Error CheckNormForward(const char* op, const ffi::AnyBuffer& x,
                                   const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                                   const ffi::AnyBuffer& y, int64_t n_stats, NormShape* s) {
  FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, beta, s));
  if (y.element_type() != x.element_type() || y.element_count() != x.element_count() ||
      n_stats != s->groups * s->rows) {
    return BadArg(op, "outputs must be y like x and mu, rsigma with one value per row");
  }
  return ffi::Error::Success();
}

// norm_backward: dy, dx like x; mean, rsigma one per row; dgamma, dbeta like gamma.
inline ffi::Error CheckNormBackward(const ffi::AnyBuffer& dy, const ffi::AnyBuffer& x,
                                    const F32Buffer& mu, const F32Buffer& rs,
                                    const ffi::AnyBuffer& gamma, int64_t norm_type,
                                    const ffi::AnyBuffer& dx, const F32Buffer& dgamma,
                                    const F32Buffer& dbeta, NormShape* s) {
  const char* op = "norm_backward";
  FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, nullptr, s));
  if (norm_type != static_cast<int64_t>(NormType::kLayerNorm) &&
      norm_type != static_cast<int64_t>(NormType::kRmsNorm)) {
    return BadArg(op, "norm_type must be 0 (layernorm) or 1 (rmsnorm)");
  }
  const int64_t n_rows = s->groups * s->rows;
  if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count() ||
      dx.element_type() != x.element_type() || dx.element_count() != x.element_count() ||
      mu.element_count() != n_rows || rs.element_count() != n_rows ||
      dgamma.element_count() != gamma.element_count() ||
      dbeta.element_count() != gamma.element_count()) {
    return BadArg(op,
                  "dy, dx must be like x; mu, rsigma one value per row; dgamma, dbeta like gamma");
  }
  return ffi::Error::Success();
}

}  // namespace fp8jax
