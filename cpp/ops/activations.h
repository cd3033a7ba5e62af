// The activations and their fused casts: activation, dactivation, activation_cast_transpose and
// dactivation_cast_transpose_dbias (Python: fp8jax/ops/fused/activation.py). Each op's target,
// signature (its Handle's parameters) and argument check; their computations are in
// cpu/cpu_activation.cc and cuda/cuda_activation.cu (ops/op.h says how the pieces fit).
#pragma once

#include <cstdint>

#include "common/activations.h"
#include "common/ffi_checks.h"
#include "ops/casts.h"  // kDbiasTileRows
#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

// This family's entries of the X-list (common/op_table.h).
#define FP8JAX_ACTIVATION_OPS(X)                                 \
  X(Activation, "fp8jax_activation")                             \
  X(DActivation, "fp8jax_dactivation")                           \
  X(ActivationCastTranspose, "fp8jax_activation_cast_transpose") \
  X(DActivationCastTransposeDbias, "fp8jax_dactivation_cast_transpose_dbias")

namespace fp8jax {

// (act, gated) must name an activation the kernels have (act::Valid).
inline ffi::Error CheckAct(const char* op, int64_t code, int64_t gated) {
  if (!act::Valid(code, gated)) return BadArg(op, "unknown activation (act, gated) attributes");
  return ffi::Error::Success();
}

// fp8jax_activation (Fp8jaxActivationCpu, Fp8jaxActivationCuda): x [..., m, k, n] (k = 2 when
// gated); act, gated -> y [..., m, n] in x's dtype.
struct Activation {
  static constexpr char kName[] = "activation";
  sig::Any x;
  int64_t code;
  int64_t gated;
  sig::AnyOut y;
  MatrixShape s{};  // y's matrices

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, attr::Act code, attr::Gated gated, sig::AnyOut y) {
    return Run(ctx, Activation{x, *code, *gated, y});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(ActShapeOf(kName, x.dimensions(), gated != 0, 1, &s));
    if (y->element_type() != x.element_type() ||
        y->element_count() != s.matrices * s.rows * s.cols) {
      return BadArg(kName, "y must be [m, n] of x's [m, k, n], in x's dtype");
    }
    return CheckAct(kName, code, gated);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_activation.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_activation.cu
};

// fp8jax_dactivation (Fp8jaxDActivationCpu, Fp8jaxDActivationCuda): g [..., m, n], x [..., m, k,
// n]; act, gated -> dx (x's shape, g's dtype).
struct DActivation {
  static constexpr char kName[] = "dactivation";
  sig::Any g;
  sig::Any x;
  int64_t code;
  int64_t gated;
  sig::AnyOut dx;
  MatrixShape s{};  // g's matrices

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any g, sig::Any x, attr::Act code, attr::Gated gated,
                           sig::AnyOut dx) {
    return Run(ctx, DActivation{g, x, *code, *gated, dx});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(ActShapeOf(kName, x.dimensions(), gated != 0, 1, &s));
    FP8JAX_RETURN_IF_ERROR(CheckGradInputs(kName, g, x, s));
    if (dx->element_type() != g.element_type() || dx->element_count() != x.element_count()) {
      return BadArg(kName, "dx must have x's shape and g's dtype");
    }
    return CheckAct(kName, code, gated);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_activation.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_activation.cu
};

// fp8jax_activation_cast_transpose (Fp8jaxActivationCastTransposeCpu,
// Fp8jaxActivationCastTransposeCuda): x [..., m, k, n], one scale per group of matrices; act,
// gated -> q, q_t of act(x) [..., m, n], scale_inv and amax (one per group).
struct ActivationCastTranspose {
  static constexpr char kName[] = "activation_cast_transpose";
  sig::Any x;
  sig::F32 scale;
  int64_t code;
  int64_t gated;
  sig::AnyOut q;
  sig::AnyOut qt;
  sig::F32Out scale_inv;
  sig::F32Out amax;
  MatrixShape s{};  // act(x)'s matrices

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::F32 scale, attr::Act code, attr::Gated gated,
                           sig::AnyOut q, sig::AnyOut qt, sig::F32Out scale_inv, sig::F32Out amax) {
    return Run(ctx, ActivationCastTranspose{x, scale, *code, *gated, q, qt, scale_inv, amax});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(
        ActShapeOf(kName, x.dimensions(), gated != 0, scale.element_count(), &s));
    FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(kName, *q, *qt, s.matrices * s.rows * s.cols));
    FP8JAX_RETURN_IF_ERROR(
        CheckScaleOutputs(kName, scale_inv->element_count(), amax->element_count(), s.groups));
    return CheckAct(kName, code, gated);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_activation.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_activation.cu
};

// fp8jax_dactivation_cast_transpose_dbias (Fp8jaxDActivationCastTransposeDbiasCpu,
// Fp8jaxDActivationCastTransposeDbiasCuda): g, x, scale, workspace; act, gated -> q, q_t of the
// gradient (x's size), scale_inv, amax, dbias [..., k, n] and the workspace (aliased, as for
// cast_transpose_dbias).
struct DActivationCastTransposeDbias {
  static constexpr char kName[] = "dactivation_cast_transpose_dbias";
  sig::Any g;
  sig::Any x;
  sig::F32 scale;
  int64_t code;
  int64_t gated;
  sig::AnyOut q;
  sig::AnyOut qt;
  sig::F32Out scale_inv;
  sig::F32Out amax;
  sig::F32Out dbias;
  sig::F32Out workspace;
  MatrixShape xs{};  // x's matrices [m, n] (of [m, k, n])
  MatrixShape qs{};  // the quantized gradient's matrices [m, k * n]

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any g, sig::Any x, sig::F32 scale, sig::F32,
                           attr::Act code, attr::Gated gated, sig::AnyOut q, sig::AnyOut qt,
                           sig::F32Out scale_inv, sig::F32Out amax, sig::F32Out dbias,
                           sig::F32Out workspace) {
    return Run(ctx, DActivationCastTransposeDbias{g, x, scale, *code, *gated, q, qt, scale_inv,
                                                  amax, dbias, workspace});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(
        ActShapeOf(kName, x.dimensions(), gated != 0, scale.element_count(), &xs));
    FP8JAX_RETURN_IF_ERROR(CheckGradInputs(kName, g, x, xs));
    FP8JAX_RETURN_IF_ERROR(CheckFp8Outputs(kName, *q, *qt, x.element_count()));
    FP8JAX_RETURN_IF_ERROR(
        CheckScaleOutputs(kName, scale_inv->element_count(), amax->element_count(), xs.groups));
    qs = xs;
    qs.cols = (gated != 0 ? 2 : 1) * xs.cols;
    if (dbias->element_count() != qs.matrices * qs.cols) {
      return BadArg(kName, "dbias must have shape [k, n]");
    }
    FP8JAX_RETURN_IF_ERROR(
        CheckDbiasWorkspace(kName, qs, kDbiasTileRows, workspace->element_count()));
    return CheckAct(kName, code, gated);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_activation.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_activation.cu
};

}  // namespace fp8jax
