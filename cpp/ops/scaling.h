// The delayed-scaling state update, update_fp8_state (Python: fp8jax/ops/casts/scaling.py): its
// target, signature (its Handle's parameters) and argument check; its computation is in
// cpu/cpu_ops.cc and cuda/cuda_ops.cu (ops/op.h says how the pieces fit).
#pragma once

#include <cstdint>

#include "common/ffi_checks.h"
#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

// This family's entry of the X-list (common/op_table.h).
#define FP8JAX_SCALING_OPS(X) X(UpdateFp8State, "fp8jax_update_fp8_state")

namespace fp8jax {

// fp8jax_update_fp8_state (Fp8jaxUpdateFp8StateCpu, Fp8jaxUpdateFp8StateCuda): history [rows,
// len], scale, amax, fp8_max (one per row); margin, algo -> the new history and scale.
struct UpdateFp8State {
  static constexpr char kName[] = "update_fp8_state";
  sig::F32 history;
  sig::F32 scale;
  sig::F32 amax;
  sig::F32 fp8_max;
  int64_t margin;
  int64_t algo;
  sig::F32Out new_history;
  sig::F32Out new_scale;
  HistoryShape s{};

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::F32 history, sig::F32 scale, sig::F32 amax,
                           sig::F32 fp8_max, attr::Margin margin, attr::Algo algo,
                           sig::F32Out new_history, sig::F32Out new_scale) {
    return Run(
        ctx, UpdateFp8State{history, scale, amax, fp8_max, *margin, *algo, new_history, new_scale});
  }

  ffi::Error Check() {
    FP8JAX_RETURN_IF_ERROR(HistoryShapeOf(history.dimensions(), history.element_count(),
                                          scale.element_count(), amax.element_count(),
                                          fp8_max.element_count(), &s));
    return CheckAlgo(algo);
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_ops.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_ops.cu
};

}  // namespace fp8jax
