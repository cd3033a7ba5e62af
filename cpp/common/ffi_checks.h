// The shape checks the ops' argument checks (cpp/ops/) are built from.
//
// The Python wrappers validate everything before a kernel runs; these checks
// are the second line, so that a malformed direct ffi_call gets an
// ffi::Error instead of a crash inside a kernel.
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

// Evaluates `expr` (an ffi::Error) and returns it from the enclosing function unless it is a
// success: the one spelling of "propagate a failed check" in every handler.
#define FP8JAX_RETURN_IF_ERROR(expr)                                      \
  do {                                                                    \
    if (::xla::ffi::Error fp8jax_err_ = (expr); !fp8jax_err_.success()) { \
      return fp8jax_err_;                                                 \
    }                                                                     \
  } while (false)

namespace fp8jax {

namespace ffi = xla::ffi;

enum class Fp8Kind { kE4M3, kE5M2, kInvalid };
enum class WideKind { kF32, kBF16, kF16, kInvalid };

inline Fp8Kind Fp8KindOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN:
      return Fp8Kind::kE4M3;
    case ffi::DataType::F8E5M2:
      return Fp8Kind::kE5M2;
    default:
      return Fp8Kind::kInvalid;
  }
}

inline WideKind WideKindOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32:
      return WideKind::kF32;
    case ffi::DataType::BF16:
      return WideKind::kBF16;
    case ffi::DataType::F16:
      return WideKind::kF16;
    default:
      return WideKind::kInvalid;
  }
}

inline ffi::Error BadArg(const std::string& op, const std::string& what) {
  return ffi::Error::InvalidArgument("fp8jax " + op + ": " + what);
}

// Shapes for a grouped elementwise op: `groups` independent tensors (one
// scale each, from vmap), each of `per_group` elements.
struct GroupShape {
  int64_t groups = 1;
  int64_t per_group = 0;
};

inline ffi::Error GroupShapeOf(const std::string& op, int64_t numel, int64_t groups,
                               GroupShape* out) {
  if (groups < 1) return BadArg(op, "scale must have at least one element");
  if (numel % groups != 0) {
    return BadArg(op, "tensor size " + std::to_string(numel) +
                          " is not a multiple of the number of scales " + std::to_string(groups));
  }
  out->groups = groups;
  out->per_group = numel / groups;
  return ffi::Error::Success();
}

// Shapes for cast_transpose: `matrices` row-major [rows, cols] matrices,
// `matrices / groups` of them share one scale.
using F32Buffer = ffi::Buffer<ffi::F32>;

struct MatrixShape {
  int64_t groups = 1;
  int64_t matrices = 1;
  int64_t rows = 0;
  int64_t cols = 0;
};

// The dbias workspace that XLA allocates for a dbias op (fp8jax.ops.base.opdef.OpDef.workspace: one
// more operand, aliased to one more result, so no handler allocates): float32 [matrices,
// row_tiles, cols], one partial column sum per tile of `tile_rows` rows (the platform's tiling).
inline int64_t DbiasWorkspaceElements(const MatrixShape& s, int64_t tile_rows) {
  return s.matrices * ((s.rows + tile_rows - 1) / tile_rows) * s.cols;
}

inline ffi::Error CheckDbiasWorkspace(const char* op, const MatrixShape& s, int64_t tile_rows,
                                      int64_t count) {
  if (count != DbiasWorkspaceElements(s, tile_rows)) {
    return BadArg(op, "the dbias workspace must be float32 [row_tiles, cols]");
  }
  return ffi::Error::Success();
}

inline ffi::Error MatrixShapeOf(const std::string& op, ffi::AnyBuffer::Dimensions dims,
                                int64_t groups, MatrixShape* out) {
  if (dims.size() < 2) return BadArg(op, "input must have rank >= 2");
  out->rows = dims[dims.size() - 2];
  out->cols = dims[dims.size() - 1];
  int64_t matrices = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) matrices *= dims[i];
  if (groups < 1 || matrices % groups != 0) {
    return BadArg(op, "leading dims are not a multiple of the number of scales");
  }
  out->groups = groups;
  out->matrices = matrices;
  return ffi::Error::Success();
}

// Shapes for a norm: x is `groups * rows` rows of `h` values (vmap's groups
// in front), gamma (and beta, when given) `groups` rows of `h`.
struct NormShape {
  int64_t groups = 1;
  int64_t rows = 0;
  int64_t h = 0;
};

inline ffi::Error NormShapeOf(const std::string& op, ffi::AnyBuffer::Dimensions dims,
                              const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta,
                              NormShape* out) {
  if (dims.size() < 2 || dims[dims.size() - 1] < 1) {
    return BadArg(op, "x must have rank >= 2 and a non-empty last dim");
  }
  int64_t numel = 1;
  for (size_t i = 0; i < dims.size(); ++i) numel *= dims[i];
  const int64_t h = dims[dims.size() - 1];
  const int64_t n = gamma.element_count();
  if (n < h || n % h != 0 || (numel / h) % (n / h) != 0) {
    return BadArg(op, "gamma must hold h values per group of rows");
  }
  if (beta != nullptr && beta->element_count() != n) {
    return BadArg(op, "beta must have gamma's size");
  }
  if (WideKindOf(gamma.element_type()) == WideKind::kInvalid ||
      (beta != nullptr && WideKindOf(beta->element_type()) == WideKind::kInvalid)) {
    return BadArg(op, "gamma and beta must be float32, bfloat16 or float16");
  }
  out->h = h;
  out->groups = n / h;
  out->rows = numel / h / out->groups;
  return ffi::Error::Success();
}

// Shapes for the activation ops: x is [..., m, k, n] with k = 1 (or 2 when
// gated); `matrices` is the product of the leading (vmap) dims, `rows` = m,
// `cols` = n. `groups` (the number of scales; 1 for the ops without one)
// must divide `matrices`.
inline ffi::Error ActShapeOf(const std::string& op, ffi::AnyBuffer::Dimensions dims, bool gated,
                             int64_t groups, MatrixShape* out) {
  if (dims.size() < 3) return BadArg(op, "x must have rank >= 3 ([m, k, n])");
  const int64_t k = dims[dims.size() - 2];
  if (k != (gated ? 2 : 1)) return BadArg(op, "x's k dim must be 2 when gated, else 1");
  out->rows = dims[dims.size() - 3];
  out->cols = dims[dims.size() - 1];
  int64_t matrices = 1;
  for (size_t i = 0; i + 3 < dims.size(); ++i) matrices *= dims[i];
  if (groups < 1 || matrices % groups != 0) {
    return BadArg(op, "leading dims are not a multiple of the number of scales");
  }
  out->groups = groups;
  out->matrices = matrices;
  return ffi::Error::Success();
}

// The amax-history update: `rows` independent states of length `len`.
struct HistoryShape {
  int64_t rows = 0;
  int64_t len = 0;
};

inline ffi::Error HistoryShapeOf(ffi::AnyBuffer::Dimensions hist_dims, int64_t hist_numel,
                                 int64_t n_scale, int64_t n_amax, int64_t n_max,
                                 HistoryShape* out) {
  const std::string op = "update_fp8_state";
  if (hist_dims.size() < 1 || hist_dims[hist_dims.size() - 1] < 1) {
    return BadArg(op, "amax_history must have rank >= 1 and a non-empty last dim");
  }
  out->len = hist_dims[hist_dims.size() - 1];
  out->rows = hist_numel / out->len;
  if (n_scale != out->rows || n_amax != out->rows || n_max != out->rows) {
    return BadArg(op, "scale, amax and fp8_max must have one element per history row");
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckAlgo(int64_t algo) {
  if (algo != 0 && algo != 1) {
    return BadArg("update_fp8_state", "algo must be 0 (max) or 1 (most_recent)");
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

// The FP8 outputs of a fused cast-transpose: q and q_t of `count` codes each, one FP8 dtype.
inline ffi::Error CheckFp8Outputs(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& qt,
                                  int64_t count) {
  if (q.element_type() != qt.element_type() || q.element_count() != count ||
      qt.element_count() != count) {
    return BadArg(op, "q and q_t must have the quantized size and share an FP8 dtype");
  }
  return ffi::Error::Success();
}

// The scale outputs of a cast: scale_inv and amax, one value per scale (per group). The kernels
// write one of each per group, so a shorter buffer would be written out of bounds.
inline ffi::Error CheckScaleOutputs(const char* op, int64_t scale_inv_count, int64_t amax_count,
                                    int64_t groups) {
  if (scale_inv_count != groups || amax_count != groups) {
    return BadArg(
        op, "scale_inv and amax must have one value per scale (" + std::to_string(groups) + ")");
  }
  return ffi::Error::Success();
}

}  // namespace fp8jax
