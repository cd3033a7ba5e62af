// The launcher of the tensor-core grouped GEMM's device-side preparation
// (cuda/cuda_grouped_tc_prep.cu), for sm90/grouped_gemm.cu and the host run of the kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/grouped_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax::grouped_tc {

namespace ffi = xla::ffi;

// Where the preparation writes (the workspace's arrays, common/grouped_tc.h's Workspace) and what
// it reads: the call (p), the contracting form's padding (width), the operands' and the output's
// bases and element sizes; under block scales (p.blocks) alpha is 1 (the blocks' scales are
// applied in the mainloop) and each group's scale pointers are written.
struct PrepArgs {
  grouped::Gemm p{};
  int64_t width = 0;
  const uint8_t* a = nullptr;
  const uint8_t* b = nullptr;
  uint8_t* out = nullptr;
  int64_t a_bytes = 1;
  int64_t b_bytes = 1;
  int64_t out_bytes = 2;
  int32_t* problems = nullptr;
  const void** a_ptrs = nullptr;
  const void** b_ptrs = nullptr;
  void** out_ptrs = nullptr;
  float* alpha = nullptr;
  const float** alpha_ptrs = nullptr;
  // block scales (p.blocks): the transposed scale grids (common/grouped_tc.h) and each group's
  // pointers into them
  const float* sfa = nullptr;
  const float* sfb = nullptr;
  const float** sfa_ptrs = nullptr;
  const float** sfb_ptrs = nullptr;
};

// Enqueues the preparation and the zeroing on `stream` (two launches; nothing else).
ffi::Error Prepare(const char* op, cudaStream_t stream, const PrepArgs& args, const int32_t* sizes,
                   const float* a_scale_inv, const float* b_scale_inv);

}  // namespace fp8jax::grouped_tc
