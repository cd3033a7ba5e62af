// The norms: layernorm and rmsnorm forward, their FP8 forms (the normalised output cast to FP8
// with its transpose) and the backward shared by both (Python: fp8jax/ops/fused/norm.py). Each op's
// target, signature (its Handle's parameters) and argument check; their computations are in
// cpu/cpu_norm.cc, cpu/cpu_norm_backward.cc, cuda/cuda_norm.cu and cuda/cuda_norm_backward.cu
// (ops/op.h says how the pieces fit). A layernorm and an rmsnorm op share one call (NormForward,
// NormForwardFp8), whose beta is null for rmsnorm.
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"
#include "common/norm_row.h"
#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

// This family's entries of the X-list (common/op_table.h).
#define FP8JAX_NORM_OPS(X)                               \
  X(LayerNormForward, "fp8jax_layernorm_forward")        \
  X(RmsNormForward, "fp8jax_rmsnorm_forward")            \
  X(LayerNormForwardFp8, "fp8jax_layernorm_forward_fp8") \
  X(RmsNormForwardFp8, "fp8jax_rmsnorm_forward_fp8")     \
  X(NormBackward, "fp8jax_norm_backward")

namespace fp8jax {

// A norm forward: x [..., h] with gamma (and beta, for layernorm) [groups, h] -> y (x's dtype and
// size), mean and rsigma (one value per row). beta points at the handler's argument.
struct NormForward {
  const char* op;
  bool layer;  // layernorm (beta read), else rmsnorm
  sig::Any x;
  sig::Any gamma;
  const sig::Any* beta;  // null for rmsnorm
  float eps;
  int64_t zero_centered;
  sig::AnyOut y;
  sig::F32Out mu;
  sig::F32Out rs;
  NormShape s{};

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, beta, &s));
    if (y->element_type() != x.element_type() || y->element_count() != x.element_count() ||
        static_cast<int64_t>(mu->element_count()) != s.groups * s.rows) {
      return BadArg(op, "outputs must be y like x and mu, rsigma with one value per row");
    }
    return ffi::Error::Success();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_norm.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_norm.cu
};

// fp8jax_layernorm_forward (Fp8jaxLayerNormForwardCpu, Fp8jaxLayerNormForwardCuda): x, gamma,
// beta; epsilon, zero_centered_gamma -> y, mean, rsigma.
struct LayerNormForward {
  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::Any gamma, sig::Any beta, attr::Epsilon eps,
                           attr::ZeroCenteredGamma zcg, sig::AnyOut y, sig::F32Out mu,
                           sig::F32Out rs) {
    return Run(ctx, NormForward{"layernorm_forward", true, x, gamma, &beta, *eps, *zcg, y, mu, rs});
  }
};

// fp8jax_rmsnorm_forward (Fp8jaxRmsNormForwardCpu, Fp8jaxRmsNormForwardCuda): x, gamma;
// epsilon, zero_centered_gamma -> y, mean (zeros), rsigma.
struct RmsNormForward {
  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::Any gamma, attr::Epsilon eps,
                           attr::ZeroCenteredGamma zcg, sig::AnyOut y, sig::F32Out mu,
                           sig::F32Out rs) {
    return Run(ctx,
               NormForward{"rmsnorm_forward", false, x, gamma, nullptr, *eps, *zcg, y, mu, rs});
  }
};

// A norm's FP8 forward: one scale per group; q and q_t like x in one FP8 dtype, scale_inv and
// amax one value per group, mean and rsigma one value per row.
struct NormForwardFp8 {
  const char* op;
  bool layer;  // layernorm (beta read), else rmsnorm
  sig::Any x;
  sig::Any gamma;
  const sig::Any* beta;  // null for rmsnorm
  sig::F32 scale;
  float eps;
  int64_t zero_centered;
  sig::AnyOut q;
  sig::AnyOut qt;
  sig::F32Out scale_inv;
  sig::F32Out amax;
  sig::F32Out mu;
  sig::F32Out rs;
  NormShape s{};

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(NormShapeOf(op, x.dimensions(), gamma, beta, &s));
    if (scale.element_count() != s.groups) return BadArg(op, "scale must hold one value per group");
    if (q->element_type() != qt->element_type() || q->element_count() != x.element_count() ||
        qt->element_count() != x.element_count() ||
        static_cast<int64_t>(mu->element_count()) != s.groups * s.rows) {
      return BadArg(op, "outputs must be q, q_t like x and mu, rsigma with one value per row");
    }
    return CheckScaleOutputs(op, scale_inv->element_count(), amax->element_count(), s.groups);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_norm.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_norm.cu
};

// fp8jax_layernorm_forward_fp8 (Fp8jaxLayerNormForwardFp8Cpu, Fp8jaxLayerNormForwardFp8Cuda): x,
// gamma, beta, scale; epsilon, zero_centered_gamma -> q, q_t, scale_inv, amax, mean, rsigma.
struct LayerNormForwardFp8 {
  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::Any gamma, sig::Any beta, sig::F32 scale,
                           attr::Epsilon eps, attr::ZeroCenteredGamma zcg, sig::AnyOut q,
                           sig::AnyOut qt, sig::F32Out scale_inv, sig::F32Out amax, sig::F32Out mu,
                           sig::F32Out rs) {
    return Run(ctx, NormForwardFp8{"layernorm_forward_fp8", true, x, gamma, &beta, scale, *eps,
                                   *zcg, q, qt, scale_inv, amax, mu, rs});
  }
};

// fp8jax_rmsnorm_forward_fp8 (Fp8jaxRmsNormForwardFp8Cpu, Fp8jaxRmsNormForwardFp8Cuda): x,
// gamma, scale; epsilon, zero_centered_gamma -> q, q_t, scale_inv, amax, mean (zeros), rsigma.
struct RmsNormForwardFp8 {
  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any x, sig::Any gamma, sig::F32 scale, attr::Epsilon eps,
                           attr::ZeroCenteredGamma zcg, sig::AnyOut q, sig::AnyOut qt,
                           sig::F32Out scale_inv, sig::F32Out amax, sig::F32Out mu,
                           sig::F32Out rs) {
    return Run(ctx, NormForwardFp8{"rmsnorm_forward_fp8", false, x, gamma, nullptr, scale, *eps,
                                   *zcg, q, qt, scale_inv, amax, mu, rs});
  }
};

// fp8jax_norm_backward (Fp8jaxNormBackwardCpu, Fp8jaxNormBackwardCuda): dy, x, mean, rsigma,
// gamma; norm_type, zero_centered_gamma -> dx (x's dtype and size), dgamma, dbeta (like gamma)
// and the workspace [groups, ws_slots, 2, h] of partial column sums.
struct NormBackward {
  static constexpr char kName[] = "norm_backward";
  sig::Any dy;
  sig::Any x;
  sig::F32 mu;
  sig::F32 rs;
  sig::Any gamma;
  int64_t norm_type;
  int64_t zero_centered;
  sig::AnyOut dx;
  sig::F32Out dgamma;
  sig::F32Out dbeta;
  sig::F32Out workspace;
  NormShape s{};
  int64_t ws_slots = 0;  // the workspace's partial sums per group and column

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any dy, sig::Any x, sig::F32 mu, sig::F32 rs,
                           sig::Any gamma, attr::NormType norm_type, attr::ZeroCenteredGamma zcg,
                           sig::AnyOut dx, sig::F32Out dgamma, sig::F32Out dbeta,
                           sig::F32Out workspace) {
    return Run(ctx,
               NormBackward{dy, x, mu, rs, gamma, *norm_type, *zcg, dx, dgamma, dbeta, workspace});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(NormShapeOf(kName, x.dimensions(), gamma, nullptr, &s));
    if (norm_type != static_cast<int64_t>(NormType::kLayerNorm) &&
        norm_type != static_cast<int64_t>(NormType::kRmsNorm)) {
      return BadArg(kName, "norm_type must be 0 (layernorm) or 1 (rmsnorm)");
    }
    const int64_t n_rows = s.groups * s.rows;
    if (dy.element_type() != x.element_type() || dy.element_count() != x.element_count() ||
        dx->element_type() != x.element_type() || dx->element_count() != x.element_count() ||
        mu.element_count() != n_rows || rs.element_count() != n_rows ||
        dgamma->element_count() != gamma.element_count() ||
        dbeta->element_count() != gamma.element_count()) {
      return BadArg(
          kName, "dy, dx must be like x; mu, rsigma one value per row; dgamma, dbeta like gamma");
    }
    ws_slots = workspace->element_count() / (s.groups * 2 * s.h);  // NormShapeOf: groups, h >= 1
    if (ws_slots < 1 || workspace->element_count() != s.groups * ws_slots * 2 * s.h) {
      return BadArg(kName, "workspace must be [groups, slots, 2, h]");
    }
    return ffi::Error::Success();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_norm_backward.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_norm_backward.cu
};

}  // namespace fp8jax
