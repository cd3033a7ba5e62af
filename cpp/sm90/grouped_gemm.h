// What the CUDA extension knows of the tensor-core grouped GEMM (sm90/grouped_gemm.cu):
// its handler symbols and, for the tests, its instantiations.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGroupedGemmSm90InitializeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Fp8jaxGroupedGemmSm90Cuda);

namespace fp8jax::grouped_tc {

// One compiled instantiation: the dtypes of a, b and out, its accumulation, its scales (block_n:
// 0 per group; else block scales, b's block rows), CUTLASS's workspace on a device of
// grouped_tc::kMaxSms multiprocessors for 256 groups, and the sizes of its strides.
struct VariantInfo {
  std::string a, b, out;
  bool fast_accum;
  int block_n;
  size_t cutlass_workspace;
  size_t stride_a, stride_b, stride_d;
};

std::vector<VariantInfo> Sm90Variants();

}  // namespace fp8jax::grouped_tc
