// The block-scaled casts: block_quantize, block_cast_transpose and its fused forms,
// block_cast_transpose_dbias, activation_block_cast_transpose,
// dactivation_block_cast_transpose_dbias and norm_block_cast_transpose (Python:
// fp8jax/ops/block/block_scaling.py, fused/block_fused.py), and rowwise_quantize, a block as long
// as the row (fp8jax/ops/block/rowwise.py). The checks they share (the blocks the
// kernels take, the scale grids of both layouts), then each op's target, signature (its Handle's
// parameters) and argument check, which fills the block::Cast its kernels run on; their
// computations are in cpu/cpu_block_scaling.cc and cuda/cuda_block_scaling.cu (ops/op.h says how
// the pieces fit).
#pragma once

#include <cstdint>
#include <string>

#include "common/activations.h"
#include "common/block_scale.h"
#include "common/ffi_checks.h"
#include "ops/activations.h"  // CheckAct
#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

// This family's entries of the X-list (common/op_table.h).
// clang-format off: one op a line
#define FP8JAX_BLOCK_CAST_OPS(X)                                                        \
  X(BlockQuantize, "fp8jax_block_quantize")                                             \
  X(BlockCastTranspose, "fp8jax_block_cast_transpose")                                  \
  X(BlockCastTransposeDbias, "fp8jax_block_cast_transpose_dbias")                       \
  X(ActivationBlockCastTranspose, "fp8jax_activation_block_cast_transpose")             \
  X(DActivationBlockCastTransposeDbias, "fp8jax_dactivation_block_cast_transpose_dbias") \
  X(NormBlockCastTranspose, "fp8jax_norm_block_cast_transpose")                       \
  X(RowwiseQuantize, "fp8jax_rowwise_quantize")
// clang-format on

namespace fp8jax {

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

// fp8jax_block_quantize (Fp8jaxBlockQuantizeCpu, Fp8jaxBlockQuantizeCuda): x [..., M, K];
// block_rows, block_cols, scale_mode, epsilon -> q (x's size), scale_inv (one scale per block).
struct BlockQuantize {
  static constexpr char kName[] = "block_quantize";
  sig::Any x;
  int64_t block_rows;
  int64_t block_cols;
  int64_t scale_mode;
  float epsilon;
  sig::AnyOut q;
  sig::AnyOut scale_inv;
  block::Cast c{};

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, attr::BlockRows block_rows,
                           attr::BlockCols block_cols, attr::ScaleMode scale_mode,
                           attr::Epsilon epsilon, sig::AnyOut q, sig::AnyOut scale_inv) {
    return Run(ctx,
               BlockQuantize{x, *block_rows, *block_cols, *scale_mode, *epsilon, q, scale_inv});
  }

  ffi::Error Check() {
    return CheckBlockCast(kName, x, block_rows, block_cols, scale_mode, epsilon, *q, *scale_inv,
                          &c);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_block_scaling.cu
};

// What the casts in both layouts below share: the block attributes, the four outputs (q and
// scale_inv of x, q_t and scale_inv_t of x.T) and the two casts their checks fill.
struct BlockCastBothCall {
  int64_t block_rows;
  int64_t block_cols;
  int64_t scale_mode;
  float epsilon;
  sig::AnyOut q;
  sig::AnyOut scale_inv;
  sig::AnyOut qt;
  sig::AnyOut scale_inv_t;
  block::Cast c{};
  block::Cast ct{};
};

// fp8jax_block_cast_transpose (Fp8jaxBlockCastTransposeCpu, Fp8jaxBlockCastTransposeCuda):
// x [..., M, K]; block_rows, block_cols, scale_mode, epsilon -> q, scale_inv, q_t, scale_inv_t.
struct BlockCastTranspose : BlockCastBothCall {
  static constexpr char kName[] = "block_cast_transpose";
  sig::Any x;

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, attr::BlockRows block_rows,
                           attr::BlockCols block_cols, attr::ScaleMode scale_mode,
                           attr::Epsilon epsilon, sig::AnyOut q, sig::AnyOut scale_inv,
                           sig::AnyOut qt, sig::AnyOut scale_inv_t) {
    return Run(ctx, BlockCastTranspose{{*block_rows, *block_cols, *scale_mode, *epsilon, q,
                                        scale_inv, qt, scale_inv_t},
                                       x});
  }

  ffi::Error Check() {
    return CheckBlockCastTranspose(kName, x, block_rows, block_cols, scale_mode, epsilon, *q,
                                   *scale_inv, *qt, *scale_inv_t, &c, &ct);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_block_scaling.cu
};

// fp8jax_block_cast_transpose_dbias (Fp8jaxBlockCastTransposeDbiasCpu,
// Fp8jaxBlockCastTransposeDbiasCuda): x, workspace; block_rows, block_cols, scale_mode, epsilon
// -> q, scale_inv, q_t, scale_inv_t, dbias (one value per column of each matrix) and the
// workspace (aliased: it arrives as the last operand and is written through the last result).
struct BlockCastTransposeDbias : BlockCastBothCall {
  static constexpr char kName[] = "block_cast_transpose_dbias";
  sig::Any x;
  sig::F32Out dbias;
  sig::F32Out workspace;

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::F32, attr::BlockRows block_rows,
                           attr::BlockCols block_cols, attr::ScaleMode scale_mode,
                           attr::Epsilon epsilon, sig::AnyOut q, sig::AnyOut scale_inv,
                           sig::AnyOut qt, sig::AnyOut scale_inv_t, sig::F32Out dbias,
                           sig::F32Out workspace) {
    return Run(ctx, BlockCastTransposeDbias{{*block_rows, *block_cols, *scale_mode, *epsilon, q,
                                             scale_inv, qt, scale_inv_t},
                                            x,
                                            dbias,
                                            workspace});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(CheckBlockCastTranspose(kName, x, block_rows, block_cols, scale_mode,
                                                   epsilon, *q, *scale_inv, *qt, *scale_inv_t, &c,
                                                   &ct));
    return CheckBlockDbias(kName, c, *dbias, workspace->element_count());
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_block_scaling.cu
};

// fp8jax_activation_block_cast_transpose (Fp8jaxActivationBlockCastTransposeCpu,
// Fp8jaxActivationBlockCastTransposeCuda): x [..., m, k, n] (k = 2 when gated); act, gated,
// block_rows, block_cols, scale_mode, epsilon -> the cast of act(x) [..., m, n] in both layouts.
struct ActivationBlockCastTranspose : BlockCastBothCall {
  static constexpr char kName[] = "activation_block_cast_transpose";
  sig::Any x;
  int64_t code;
  int64_t gated;

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, attr::Act code, attr::Gated gated,
                           attr::BlockRows block_rows, attr::BlockCols block_cols,
                           attr::ScaleMode scale_mode, attr::Epsilon epsilon, sig::AnyOut q,
                           sig::AnyOut scale_inv, sig::AnyOut qt, sig::AnyOut scale_inv_t) {
    return Run(ctx, ActivationBlockCastTranspose{{*block_rows, *block_cols, *scale_mode, *epsilon,
                                                  q, scale_inv, qt, scale_inv_t},
                                                 x,
                                                 *code,
                                                 *gated});
  }

  ffi::Error Check() {
    MatrixShape s;
    FP8JAX_RETURN_IF_ERROR(ActShapeOf(kName, x.dimensions(), gated != 0, 1, &s));
    FP8JAX_RETURN_IF_ERROR(CheckBlockOutputs(kName, s.matrices, s.rows, s.cols, block_rows,
                                             block_cols, scale_mode, epsilon, *q, *scale_inv, &c));
    FP8JAX_RETURN_IF_ERROR(CheckBlockTransposed(kName, c, *q, *scale_inv, *qt, *scale_inv_t, &ct));
    return CheckAct(kName, code, gated);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_block_scaling.cu
};

// fp8jax_dactivation_block_cast_transpose_dbias (Fp8jaxDActivationBlockCastTransposeDbiasCpu,
// Fp8jaxDActivationBlockCastTransposeDbiasCuda): g [..., m, n], x [..., m, k, n], workspace; act,
// gated, block_rows, block_cols, scale_mode, epsilon -> the cast of each half j of the gradient
// ([m, n], matrix group * k + j) in both layouts: q [..., m, k, n] (the halves' rows
// interleaved), q_t [..., k, n, m]; dbias [..., k, n] and the workspace (aliased).
struct DActivationBlockCastTransposeDbias : BlockCastBothCall {
  static constexpr char kName[] = "dactivation_block_cast_transpose_dbias";
  sig::Any g;
  sig::Any x;
  int64_t code;
  int64_t gated;
  sig::F32Out dbias;
  sig::F32Out workspace;

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any g, sig::Any x, sig::F32, attr::Act code,
                           attr::Gated gated, attr::BlockRows block_rows,
                           attr::BlockCols block_cols, attr::ScaleMode scale_mode,
                           attr::Epsilon epsilon, sig::AnyOut q, sig::AnyOut scale_inv,
                           sig::AnyOut qt, sig::AnyOut scale_inv_t, sig::F32Out dbias,
                           sig::F32Out workspace) {
    return Run(ctx, DActivationBlockCastTransposeDbias{{*block_rows, *block_cols, *scale_mode,
                                                        *epsilon, q, scale_inv, qt, scale_inv_t},
                                                       g,
                                                       x,
                                                       *code,
                                                       *gated,
                                                       dbias,
                                                       workspace});
  }

  ffi::Error Check() {
    MatrixShape s;
    FP8JAX_RETURN_IF_ERROR(ActShapeOf(kName, x.dimensions(), gated != 0, 1, &s));
    FP8JAX_RETURN_IF_ERROR(CheckGradInputs(kName, g, x, s));
    const int64_t k = gated != 0 ? 2 : 1;
    FP8JAX_RETURN_IF_ERROR(CheckBlockOutputs(kName, s.matrices * k, s.rows, s.cols, block_rows,
                                             block_cols, scale_mode, epsilon, *q, *scale_inv, &c));
    c.interleave = k;
    FP8JAX_RETURN_IF_ERROR(CheckBlockTransposed(kName, c, *q, *scale_inv, *qt, *scale_inv_t, &ct));
    FP8JAX_RETURN_IF_ERROR(CheckBlockDbias(kName, c, *dbias, workspace->element_count()));
    return CheckAct(kName, code, gated);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_block_scaling.cu
};

// fp8jax_norm_block_cast_transpose (Fp8jaxNormBlockCastTransposeCpu,
// Fp8jaxNormBlockCastTransposeCuda): x [groups * rows, h] with gamma and beta [groups, h] (beta
// read by layernorm only); norm_type, norm_epsilon, zero_centered_gamma, block_rows, block_cols,
// scale_mode, epsilon -> the cast of the norm's output (each group's [rows, h] a matrix) in both
// layouts, and mu, rsigma (one per row).
struct NormBlockCastTranspose : BlockCastBothCall {
  static constexpr char kName[] = "norm_block_cast_transpose";
  sig::Any x;
  sig::Any gamma;
  sig::Any beta;
  int64_t norm_type;
  float norm_epsilon;
  int64_t zero_centered;
  sig::F32Out mu;
  sig::F32Out rsigma;
  NormShape s{};

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::Any gamma, sig::Any beta,
                           attr::NormType norm_type, attr::NormEpsilon norm_epsilon,
                           attr::ZeroCenteredGamma zero_centered, attr::BlockRows block_rows,
                           attr::BlockCols block_cols, attr::ScaleMode scale_mode,
                           attr::Epsilon epsilon, sig::AnyOut q, sig::AnyOut scale_inv,
                           sig::AnyOut qt, sig::AnyOut scale_inv_t, sig::F32Out mu,
                           sig::F32Out rsigma) {
    return Run(ctx, NormBlockCastTranspose{{*block_rows, *block_cols, *scale_mode, *epsilon, q,
                                            scale_inv, qt, scale_inv_t},
                                           x,
                                           gamma,
                                           beta,
                                           *norm_type,
                                           *norm_epsilon,
                                           *zero_centered,
                                           mu,
                                           rsigma});
  }

  ffi::Error Check() {
    if (norm_type != 0 && norm_type != 1) return BadArg(kName, "norm_type must be 0 or 1");
    if (WideKindOf(x.element_type()) == WideKind::kInvalid) {
      return BadArg(kName, "x must be float32, bfloat16 or float16");
    }
    FP8JAX_RETURN_IF_ERROR(NormShapeOf(kName, x.dimensions(), gamma, &beta, &s));
    if (static_cast<int64_t>(mu->element_count()) != s.groups * s.rows ||
        static_cast<int64_t>(rsigma->element_count()) != s.groups * s.rows) {
      return BadArg(kName, "mu and rsigma must have one value per row");
    }
    FP8JAX_RETURN_IF_ERROR(CheckBlockOutputs(kName, s.groups, s.rows, s.h, block_rows, block_cols,
                                             scale_mode, epsilon, *q, *scale_inv, &c));
    return CheckBlockTransposed(kName, c, *q, *scale_inv, *qt, *scale_inv_t, &ct);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_block_scaling.cu
};

// fp8jax_rowwise_quantize (Fp8jaxRowwiseQuantizeCpu, Fp8jaxRowwiseQuantizeCuda): x [..., K];
// scale_mode (0 or 1: float32 or power-of-two scales), epsilon -> q (x's size), scale_inv (one
// float32 per row). Each row is one 1 x K block of the block cast's numerics (its check fills a
// block::Cast of one matrix [rows, K] with br = 1, bc = K), of any length: the block kernels'
// bound on the block (block::KernelBlock) does not apply, so the row has its own kernels
// (cpu/cpu_block_scaling.cc, cuda/cuda_rowwise.cu).
struct RowwiseQuantize {
  static constexpr char kName[] = "rowwise_quantize";
  sig::Any x;
  int64_t scale_mode;
  float epsilon;
  sig::AnyOut q;
  sig::AnyOut scale_inv;
  block::Cast c{};

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, attr::ScaleMode scale_mode, attr::Epsilon epsilon,
                           sig::AnyOut q, sig::AnyOut scale_inv) {
    return Run(ctx, RowwiseQuantize{x, *scale_mode, *epsilon, q, scale_inv});
  }

  ffi::Error Check() {
    const auto dims = x.dimensions();
    if (dims.size() < 1) return BadArg(kName, "x must have at least one dim");
    if (scale_mode != 0 && scale_mode != 1) return BadArg(kName, "scale_mode must be 0 or 1");
    if (!(epsilon >= 0.0f) || !IsFinite(epsilon)) return BadArg(kName, "epsilon must be >= 0");
    c.groups = 1;
    c.cols = dims[dims.size() - 1];
    c.rows = 1;
    for (size_t i = 0; i + 1 < dims.size(); ++i) c.rows *= dims[i];
    c.br = 1;
    c.bc = c.cols > 0 ? c.cols : 1;
    c.mode = static_cast<block::ScaleMode>(scale_mode);
    c.epsilon = epsilon;
    if (q->element_count() != x.element_count()) return BadArg(kName, "q must have x's size");
    if (scale_inv->element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>(scale_inv->element_count()) != c.rows) {
      return BadArg(kName, "scale_inv must hold one float32 scale per row");
    }
    return ffi::Error::Success();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_block_scaling.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_rowwise.cu
};

}  // namespace fp8jax
