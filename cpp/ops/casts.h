// The per-tensor casts: quantize, dequantize, cast_transpose and cast_transpose_dbias (Python:
// fp8jax/ops/casts/quantize.py, cast_transpose.py). Each op's target, signature (its Handle's
// parameters) and argument check; their computations are in cpu/cpu_ops.cc,
// cpu/cpu_cast_transpose.cc, cuda/cuda_ops.cu and cuda/cuda_cast_transpose.cu (ops/op.h says
// how the pieces fit).
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"
#include "common/grouped_gemm.h"
#include "common/launch_plan.h"
#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

// This family's entries of the X-list (common/op_table.h).
#define FP8JAX_CAST_OPS(X)                             \
  X(Quantize, "fp8jax_quantize")                       \
  X(Dequantize, "fp8jax_dequantize")                   \
  X(CastTranspose, "fp8jax_cast_transpose")            \
  X(CastTransposeDbias, "fp8jax_cast_transpose_dbias") \
  X(Transpose, "fp8jax_transpose")                     \
  X(TransposePadded, "fp8jax_transpose_padded")

namespace fp8jax {

// The rows of a tile of the dbias workspace, on every platform: the CUDA tile, and the CPU's
// strips of the same height (fp8jax.ops.casts.cast_transpose.DBIAS_TILE_ROWS).
inline constexpr int64_t kDbiasTileRows = plan::kBigTile;

// fp8jax_quantize (Fp8jaxQuantizeCpu, Fp8jaxQuantizeCuda): x, one scale per group of x -> q
// (x's size, FP8), scale_inv and amax (one per group).
struct Quantize {
  static constexpr char kName[] = "quantize";
  sig::Any x;
  sig::F32 scale;
  sig::AnyOut q;
  sig::F32Out scale_inv;
  sig::F32Out amax;
  GroupShape s{};  // x's groups

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::F32 scale, sig::AnyOut q,
                           sig::F32Out scale_inv, sig::F32Out amax) {
    return Run(ctx, Quantize{x, scale, q, scale_inv, amax});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(GroupShapeOf(kName, x.element_count(), scale.element_count(), &s));
    if (q->element_count() != x.element_count()) return BadArg(kName, "output size mismatch");
    return CheckScaleOutputs(kName, scale_inv->element_count(), amax->element_count(), s.groups);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_ops.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_ops.cu
};

// fp8jax_dequantize (Fp8jaxDequantizeCpu, Fp8jaxDequantizeCuda): q, one scale_inv per group of q
// -> out (q's size, a wide dtype).
struct Dequantize {
  static constexpr char kName[] = "dequantize";
  sig::Any q;
  sig::F32 scale_inv;
  sig::AnyOut out;
  GroupShape s{};  // q's groups

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any q, sig::F32 scale_inv, sig::AnyOut out) {
    return Run(ctx, Dequantize{q, scale_inv, out});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(GroupShapeOf(kName, q.element_count(), scale_inv.element_count(), &s));
    if (out->element_count() != q.element_count()) return BadArg(kName, "output size mismatch");
    return ffi::Error::Success();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_ops.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_ops.cu
};

// cast_transpose's check, shared with the fused forms: x [..., m, n], one scale per matrix group
// -> q, q_t (x's size, one FP8 dtype), scale_inv and amax (one per group).
inline ffi::Error CheckCastTranspose(const char* op, const ffi::AnyBuffer& x,
                                     const F32Buffer& scale, const ffi::AnyBuffer& q,
                                     const ffi::AnyBuffer& qt, const F32Buffer& scale_inv,
                                     const F32Buffer& amax, MatrixShape* s) {
  FP8JAX_RETURN_IF_ERROR(MatrixShapeOf(op, x.dimensions(), scale.element_count(), s));
  FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(op, q, qt, x.element_count()));
  return CheckScaleOutputs(op, scale_inv.element_count(), amax.element_count(), s->groups);
}

// fp8jax_cast_transpose (Fp8jaxCastTransposeCpu, Fp8jaxCastTransposeCuda): x, scale -> q, q_t,
// scale_inv, amax (cast_transpose's check above).
struct CastTranspose {
  static constexpr char kName[] = "cast_transpose";
  sig::Any x;
  sig::F32 scale;
  sig::AnyOut q;
  sig::AnyOut qt;
  sig::F32Out scale_inv;
  sig::F32Out amax;
  MatrixShape s{};  // x's matrices

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::F32 scale, sig::AnyOut q, sig::AnyOut qt,
                           sig::F32Out scale_inv, sig::F32Out amax) {
    return Run(ctx, CastTranspose{x, scale, q, qt, scale_inv, amax});
  }

  ffi::Error Check() { return CheckCastTranspose(kName, x, scale, *q, *qt, *scale_inv, *amax, &s); }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_cast_transpose.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_cast_transpose.cu
};

// fp8jax_cast_transpose_dbias (Fp8jaxCastTransposeDbiasCpu, Fp8jaxCastTransposeDbiasCuda): g,
// scale, workspace -> cast_transpose's outputs, dbias (one value per column of each matrix) and
// the workspace. The workspace arrives as the last operand and leaves, aliased, as the last
// result (fp8jax.ops.base.opdef.OpDef.workspace): it is written through the result.
struct CastTransposeDbias {
  static constexpr char kName[] = "cast_transpose_dbias";
  sig::Any g;
  sig::F32 scale;
  sig::AnyOut q;
  sig::AnyOut qt;
  sig::F32Out scale_inv;
  sig::F32Out amax;
  sig::F32Out dbias;
  sig::F32Out workspace;
  MatrixShape s{};  // g's matrices

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any g, sig::F32 scale, sig::F32, sig::AnyOut q,
                           sig::AnyOut qt, sig::F32Out scale_inv, sig::F32Out amax,
                           sig::F32Out dbias, sig::F32Out workspace) {
    return Run(ctx, CastTransposeDbias{g, scale, q, qt, scale_inv, amax, dbias, workspace});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(CheckCastTranspose(kName, g, scale, *q, *qt, *scale_inv, *amax, &s));
    if (dbias->element_count() != s.matrices * s.cols) {
      return BadArg(kName, "dbias must have one element per column of each matrix");
    }
    return CheckDbiasWorkspace(kName, s, kDbiasTileRows, workspace->element_count());
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_cast_transpose.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_cast_transpose.cu
};

// fp8jax_transpose (Fp8jaxTransposeCpu, Fp8jaxTransposeCuda): x [..., m, n] of one-byte codes (FP8
// or uint8) -> x_t [..., n, m], the same dtype: a GEMM's K-major operand from a row-major one (a
// mixture of experts' wgrad operands), at a copy's bandwidth.
struct Transpose {
  static constexpr char kName[] = "transpose";
  sig::Any x;
  sig::AnyOut xt;
  MatrixShape s{};  // x's matrices

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::AnyOut xt) {
    return Run(ctx, Transpose{x, xt});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(MatrixShapeOf(kName, x.dimensions(), 1, &s));
    const ffi::DataType t = x.element_type();
    if (t != ffi::DataType::F8E4M3FN && t != ffi::DataType::F8E5M2 && t != ffi::DataType::U8 &&
        t != ffi::DataType::S8) {
      return BadArg(kName, "x must hold one-byte codes (float8_e4m3fn, float8_e5m2 or uint8)");
    }
    if (xt->element_type() != t || xt->element_count() != x.element_count()) {
      return BadArg(kName, "x_t must have x's dtype and size");
    }
    return ffi::Error::Success();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_cast_transpose.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_cast_transpose.cu
};

// fp8jax_transpose_padded (Fp8jaxTransposePaddedCpu, Fp8jaxTransposePaddedCuda): x [..., m, n] of
// one-byte codes whose rows are ragged groups (group_sizes int32 [..., G], read where the kernel
// runs), width -> x_t [..., n, SegmentBlocks(m, G, width) * width]: each matrix transposed with
// each group's columns starting at a multiple of `width`, zeros between
// (grouped_scaling.segment_layout): the tensor-core grouped GEMM's wgrad operand, in one pass.
struct TransposePadded {
  static constexpr char kName[] = "transpose_padded";
  sig::Any x;
  sig::Any group_sizes;
  int64_t width;
  sig::AnyOut xt;
  MatrixShape s{};  // x's matrices (one group_sizes row each)
  int64_t groups = 0, padded = 0;

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::Any group_sizes, attr::Width width,
                           sig::AnyOut xt) {
    return Run(ctx, TransposePadded{x, group_sizes, *width, xt});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(MatrixShapeOf(kName, x.dimensions(), 1, &s));
    const ffi::DataType t = x.element_type();
    if (t != ffi::DataType::F8E4M3FN && t != ffi::DataType::F8E5M2 && t != ffi::DataType::U8 &&
        t != ffi::DataType::S8) {
      return BadArg(kName, "x must hold one-byte codes (float8_e4m3fn, float8_e5m2 or uint8)");
    }
    const auto gs = group_sizes.dimensions();
    if (group_sizes.element_type() != ffi::DataType::S32 || gs.size() < 1 || gs.back() < 1 ||
        group_sizes.element_count() != s.matrices * gs.back()) {
      return BadArg(kName, "group_sizes must be int32 [..., G], one row per matrix of x, G >= 1");
    }
    if (width < 1) return BadArg(kName, "width must be positive");
    groups = gs.back();
    padded = grouped::SegmentBlocks(s.rows, groups, width) * width;
    if (xt->element_type() != t || xt->element_count() != s.matrices * s.cols * padded) {
      return BadArg(kName, "x_t must be x's dtype, [..., n, SegmentBlocks(m, G, width) * width]");
    }
    return ffi::Error::Success();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_cast_transpose.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_cast_transpose.cu
};

}  // namespace fp8jax
