// The device-side preparation of the tensor-core grouped GEMM (sm90/grouped_gemm.cu): one
// launch writes each group's problem shape, operand pointers and epilogue scale into the
// workspace from the group sizes (common/grouped_tc.h), and zeroes the output the GEMM will not
// write (the rows form's rows past the sum, an empty group's out[g] in the contracting form). The
// sizes never leave the device: no host synchronisation, CUDA-graph compatible. Plain CUDA (no
// CUTLASS), so the host run of the kernels executes it.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/grouped_gemm.h"
#include "common/grouped_tc.h"
#include "common/launch_plan.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_grouped_tc_prep.h"
#include "cuda/cuda_util.h"

namespace fp8jax::grouped_tc {
namespace {

// Group g per thread (a grid-stride loop): its problem, pointers and alpha.
__global__ void __launch_bounds__(plan::kThreads)
    PrepareKernel(PrepArgs args, const int32_t* __restrict__ sizes,
                  const float* __restrict__ a_scale_inv, const float* __restrict__ b_scale_inv) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < args.p.groups;
       g += stride) {
    const Problem q = ProblemOf(args.p, sizes, g, args.width);
    args.problems[3 * g] = q.m;
    args.problems[3 * g + 1] = q.n;
    args.problems[3 * g + 2] = q.k;
    // an empty problem's pointers are never read (CUTLASS skips a group with no tiles)
    args.a_ptrs[g] = args.a + q.a_offset * args.a_bytes;
    args.b_ptrs[g] = args.b + q.b_offset * args.b_bytes;
    args.out_ptrs[g] = args.out + q.out_offset * args.out_bytes;
    args.alpha[g] = args.p.blocks ? 1.0f : AlphaOf(a_scale_inv, b_scale_inv, g);
    args.alpha_ptrs[g] = args.alpha + g;
    if (args.p.blocks) {
      args.sfa_ptrs[g] = args.sfa + q.sfa_offset;
      args.sfb_ptrs[g] = args.sfb + q.sfb_offset;
    }
  }
}

// The output the GEMM leaves alone, zeroed: the rows form's rows [sum, M), each empty group's
// out[g] in the contracting form. Byte-wise, a grid-stride loop over the output.
__global__ void __launch_bounds__(plan::kThreads)
    ZeroKernel(PrepArgs args, const int32_t* __restrict__ sizes) {
  const grouped::Gemm& p = args.p;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p.form == grouped::kRows) {
    const int64_t begin = TailBegin(p, sizes) * p.cols * args.out_bytes;
    const int64_t end = p.rows * p.cols * args.out_bytes;
    for (int64_t i = begin + first; i < end; i += stride) args.out[i] = 0;
    return;
  }
  const int64_t per_group = p.rows * p.cols * args.out_bytes;
  int64_t begin = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    const int64_t end = grouped::ClampedEnd(begin, sizes[g], p.ragged);
    if (end == begin) {
      for (int64_t i = first; i < per_group; i += stride) args.out[g * per_group + i] = 0;
    }
    begin = end;
  }
}

}  // namespace

ffi::Error Prepare(const char* op, cudaStream_t stream, const PrepArgs& args, const int32_t* sizes,
                   const float* a_scale_inv, const float* b_scale_inv) {
  const int64_t groups = args.p.groups;
  FP8JAX_RETURN_IF_ERROR(PlanAndLaunch(
      op, PrepareKernel, stream,
      [groups](int64_t resident) {
        return plan::Clamp(plan::CeilDiv(groups, plan::kThreads), 1, resident);
      },
      args, sizes, a_scale_inv, b_scale_inv));
  const int64_t bytes = args.p.OutputSize() * args.out_bytes;
  return PlanAndLaunch(
      op, ZeroKernel, stream,
      [bytes](int64_t resident) {
        return plan::Clamp(plan::CeilDiv(bytes, plan::kThreads), 1, resident);
      },
      args, sizes);
}

}  // namespace fp8jax::grouped_tc
