// The argument checks of the block-scaled cast ops (common/op_table.h declares their targets and
// signatures): the blocks the kernels take, the scale grids of both layouts, the fused forms'
// extra inputs and outputs. Each fills the block::Cast its kernels run on.
#pragma once

#include <cstdint>
#include <string>

#include "common/block_scale.h"
#include "common/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// Op names in error messages, one spelling for an op's check and its CPU and CUDA handlers.
inline constexpr char kBlockQuantizeOp[] = "block_quantize";
inline constexpr char kBlockCastTransposeOp[] = "block_cast_transpose";
inline constexpr char kBlockCastTransposeDbiasOp[] = "block_cast_transpose_dbias";
inline constexpr char kActivationBlockCastTransposeOp[] = "activation_block_cast_transpose";
inline constexpr char kDActivationBlockCastTransposeDbiasOp[] =
    "dactivation_block_cast_transpose_dbias";
inline constexpr char kNormBlockCastTransposeOp[] = "norm_block_cast_transpose";

// A block-scaled cast of `groups` matrices [rows, cols] (common/block_scale.h): the blocks the
// kernels take, a known scale mode, `q_count` codes (one per element) and one scale per block
// (float32, or E8M0 for MXFP8). Fills `c` (untransposed).
inline ffi::Error CheckBlockOutputs(const char* op, int64_t groups, int64_t rows, int64_t cols,
                                    int64_t block_rows, int64_t block_cols, int64_t scale_mode,
                                    float epsilon, const ffi::AnyBuffer& q,
                                    const ffi::AnyBuffer& scale_inv, block::Cast* c) {
  if (!block::KernelBlock(block_rows, block_cols)) {
    return BadArg(op, "block dims must be powers of two up to 128, of at least 32 elements");
  }
  if (scale_mode < 0 || scale_mode > 2) return BadArg(op, "scale_mode must be 0, 1 or 2");
  if (!(epsilon >= 0.0f) || !IsFinite(epsilon)) return BadArg(op, "epsilon must be >= 0");
  c->groups = groups;
  c->rows = rows;
  c->cols = cols;
  c->br = block_rows;
  c->bc = block_cols;
  c->mode = static_cast<block::ScaleMode>(scale_mode);
  c->epsilon = epsilon;
  const ffi::DataType want =
      c->mode == block::ScaleMode::kE8m0 ? ffi::DataType::F8E8M0FNU : ffi::DataType::F32;
  if (q.element_count() != groups * rows * cols) return BadArg(op, "q must have x's size");
  if (scale_inv.element_type() != want || scale_inv.element_count() != c->groups * c->GridSize()) {
    return BadArg(op, "scale_inv must hold one scale per block (float32, E8M0 for scale_mode 2)");
  }
  return ffi::Error::Success();
}

// The block-scaled cast of x [..., M, K] (leading dims: separate matrices; a vector is one row).
inline ffi::Error CheckBlockCast(const char* op, const ffi::AnyBuffer& x, int64_t block_rows,
                                 int64_t block_cols, int64_t scale_mode, float epsilon,
                                 const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale_inv,
                                 block::Cast* c) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return BadArg(op, "x must have at least one dim");
  int64_t groups = 1;
  for (size_t i = 0; i + 2 < dims.size(); ++i) groups *= dims[i];
  return CheckBlockOutputs(op, groups, dims.size() >= 2 ? dims[dims.size() - 2] : 1,
                           dims[dims.size() - 1], block_rows, block_cols, scale_mode, epsilon, q,
                           scale_inv, c);
}

// The transposed layout of the cast `c`: q_t like q and scale_inv_t one scale per block of x.T
// (blocks block_cols x block_rows of x). Fills `ct`.
inline ffi::Error CheckBlockTransposed(const char* op, const block::Cast& c,
                                       const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale_inv,
                                       const ffi::AnyBuffer& qt, const ffi::AnyBuffer& scale_inv_t,
                                       block::Cast* ct) {
  *ct = c;
  ct->br = c.bc;
  ct->bc = c.br;
  ct->transposed = true;
  if (qt.element_type() != q.element_type() || qt.element_count() != q.element_count()) {
    return BadArg(op, "q_t must be like q");
  }
  if (scale_inv_t.element_type() != scale_inv.element_type() ||
      scale_inv_t.element_count() != ct->groups * ct->GridSize()) {
    return BadArg(op, "scale_inv_t must hold one scale per block of x.T");
  }
  return ffi::Error::Success();
}

// block_cast_transpose (and its dbias form): the cast of x [..., M, K] in both layouts.
inline ffi::Error CheckBlockCastTranspose(
    const char* op, const ffi::AnyBuffer& x, int64_t block_rows, int64_t block_cols,
    int64_t scale_mode, float epsilon, const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale_inv,
    const ffi::AnyBuffer& qt, const ffi::AnyBuffer& scale_inv_t, block::Cast* c, block::Cast* ct) {
  if (x.dimensions().size() < 2) return BadArg(op, "x must have at least two dims");
  FP8JAX_RETURN_IF_ERROR(
      CheckBlockCast(op, x, block_rows, block_cols, scale_mode, epsilon, q, scale_inv, c));
  return CheckBlockTransposed(op, *c, q, scale_inv, qt, scale_inv_t, ct);
}

// block_cast_transpose_dbias: block_cast_transpose's, plus dbias one value per column of each
// matrix and the dbias workspace of `workspace_count` elements (tiles of block::kTile rows).
inline ffi::Error CheckBlockDbias(const char* op, const block::Cast& c, const F32Buffer& dbias,
                                  int64_t workspace_count) {
  if (dbias.element_count() != c.groups * c.cols) {
    return BadArg(op, "dbias must have one element per column of each matrix");
  }
  MatrixShape s;
  s.groups = s.matrices = c.groups;
  s.rows = c.rows;
  s.cols = c.cols;
  return CheckDbiasWorkspace(op, s, block::kTile, workspace_count);
}

// activation_block_cast_transpose: x [..., m, k, n] (k = 2 when gated) -> the cast of act(x)
// [..., m, n] in both layouts (the handler checks the activation code).
inline ffi::Error CheckActivationBlockCastTranspose(
    const ffi::AnyBuffer& x, int64_t gated, int64_t block_rows, int64_t block_cols,
    int64_t scale_mode, float epsilon, const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale_inv,
    const ffi::AnyBuffer& qt, const ffi::AnyBuffer& scale_inv_t, block::Cast* c, block::Cast* ct) {
  const char* op = kActivationBlockCastTransposeOp;
  MatrixShape s;
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, 1, &s));
  FP8JAX_RETURN_IF_ERROR(CheckBlockOutputs(op, s.matrices, s.rows, s.cols, block_rows, block_cols,
                                           scale_mode, epsilon, q, scale_inv, c));
  return CheckBlockTransposed(op, *c, q, scale_inv, qt, scale_inv_t, ct);
}

// dactivation_block_cast_transpose_dbias: g [..., m, n] and x [..., m, k, n] -> the cast of each
// half j of the gradient ([m, n], matrix group * k + j) in both layouts: q [..., m, k, n] (the
// halves' rows interleaved), q_t [..., k, n, m]; dbias [..., k, n] and its workspace.
inline ffi::Error CheckDActivationBlockCastTransposeDbias(
    const ffi::AnyBuffer& g, const ffi::AnyBuffer& x, int64_t gated, int64_t block_rows,
    int64_t block_cols, int64_t scale_mode, float epsilon, const ffi::AnyBuffer& q,
    const ffi::AnyBuffer& scale_inv, const ffi::AnyBuffer& qt, const ffi::AnyBuffer& scale_inv_t,
    const F32Buffer& dbias, int64_t workspace_count, block::Cast* c, block::Cast* ct) {
  const char* op = kDActivationBlockCastTransposeDbiasOp;
  MatrixShape s;
  FP8JAX_RETURN_IF_ERROR(ActShapeOf(op, x.dimensions(), gated != 0, 1, &s));
  FP8JAX_RETURN_IF_ERROR(CheckGradInputs(op, g, x, s));
  const int64_t k = gated != 0 ? 2 : 1;
  FP8JAX_RETURN_IF_ERROR(CheckBlockOutputs(op, s.matrices * k, s.rows, s.cols, block_rows,
                                           block_cols, scale_mode, epsilon, q, scale_inv, c));
  c->interleave = k;
  FP8JAX_RETURN_IF_ERROR(CheckBlockTransposed(op, *c, q, scale_inv, qt, scale_inv_t, ct));
  return CheckBlockDbias(op, *c, dbias, workspace_count);
}

// norm_block_cast_transpose: x [groups * rows, h] with gamma and beta [groups, h] (beta read by
// layernorm only) -> the cast of the norm's output, each group's [rows, h] a matrix, in both
// layouts, and mu, rsigma one per row. Fills `s` too.
inline ffi::Error CheckNormBlockCastTranspose(
    const ffi::AnyBuffer& x, const ffi::AnyBuffer& gamma, const ffi::AnyBuffer& beta,
    int64_t norm_type, int64_t block_rows, int64_t block_cols, int64_t scale_mode, float epsilon,
    const ffi::AnyBuffer& q, const ffi::AnyBuffer& scale_inv, const ffi::AnyBuffer& qt,
    const ffi::AnyBuffer& scale_inv_t, int64_t mu_count, int64_t rsigma_count, NormShape* s,
    block::Cast* c, block::Cast* ct) {
  const char* op = kNormBlockCastTransposeOp;
  if (norm_type != 0 && norm_type != 1) return BadArg(op, "norm_type must be 0 or 1");
  if (WideKindOf(x.element_type()) == WideKind::kInvalid) {
    return BadArg(op, "x must be float32, bfloat16 or float16");
  }
  FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, &beta, s));
  if (mu_count != s->groups * s->rows || rsigma_count != s->groups * s->rows) {
    return BadArg(op, "mu and rsigma must have one value per row");
  }
  FP8JAX_RETURN_IF_ERROR(CheckBlockOutputs(op, s->groups, s->rows, s->h, block_rows, block_cols,
                                           scale_mode, epsilon, q, scale_inv, c));
  return CheckBlockTransposed(op, *c, q, scale_inv, qt, scale_inv_t, ct);
}

}  // namespace fp8jax
