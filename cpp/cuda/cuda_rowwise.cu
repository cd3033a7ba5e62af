// The CUDA computation of rowwise_quantize (ops/block_casts.h; same target and bits as its CPU
// computation in cpp/cpu/cpu_block_scaling.cc): one float32 scale per row of x [rows, K], the
// block cast's numerics (common/block_scale.h) with one 1 x K block a row, any K.
//
// One warp per row, the warps of the grid striding over the rows (no shared memory, no barrier):
//   1. amax: each lane takes the max of block::AmaxBits over its columns, and the warp combines
//      its lanes' with one max reduction, which every lane receives;
//   2. scale: every lane computes block::BlockScale of the amax (the same float32 operations as
//      the CPU); lane 0 stores its inverse;
//   3. codes: each lane converts its columns again (the second read of the row hits the cache the
//      first brought it into).
// A lane's columns: 8 consecutive elements per access (one 16- or 32-byte load, one 8-byte store
// of codes; a warp covers 256 consecutive elements) when K is a multiple of 8 and the buffers are
// aligned for it, else one element per access (a warp covers 32 consecutive elements).
// A row shorter than 32 leaves lanes idle; the rows of a wide matrix stream through once for the
// amax and once for the codes, as the block kernels' tiles do.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/block_scale.h"
#include "common/block_sources.h"
#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "common/wide.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_handler.h"
#include "cuda/cuda_util.h"
#include "ops/block_casts.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

using block::DirectSource;

constexpr int kRowThreads = 256;
constexpr int kRowWarps = kRowThreads / 32;

// At least 4 resident blocks per SM (64 registers a thread): without a minimum, ptxas for sm_90
// kept the float32 instances at 32 registers and spilled 8 bytes (the block kernels' finding too).
template <WideKind W, typename F>
__global__ void __launch_bounds__(kRowThreads, 4)
    RowwiseKernel(DirectSource<W, FastHalf> src, uint8_t* __restrict__ q,
                  float* __restrict__ scale_inv, block::Cast c, bool vector) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowWarps;
  for (int64_t r = warp; r < c.rows; r += warps) {
    const int64_t row = r * c.cols;
    // 1. the row's amax (NaN left out), over the warp
    uint32_t m = 0;
    if (vector) {
      for (int64_t col = 8 * lane; col < c.cols; col += 8 * 32) {
        float v[8];
        LoadEight<W>(src.x, row + col, v);
#pragma unroll
        for (int j = 0; j < 8; ++j) m = max(m, block::AmaxBits(v[j]));
      }
    } else {
      for (int64_t col = lane; col < c.cols; col += 32) {
        m = max(m, block::AmaxBits(src(0, r, col)));
      }
    }
    m = __reduce_max_sync(0xFFFFFFFFu, m);
    // 2. its scale, the same in every lane
    const float s = block::BlockScale(__uint_as_float(m), F::kMax, block::InputMax<W>(),
                                      c.mode == block::ScaleMode::kPow2, c.epsilon);
    if (lane == 0) scale_inv[r] = block::InverseScale(s);
    // 3. the codes
    if (vector) {
      for (int64_t col = 8 * lane; col < c.cols; col += 8 * 32) {
        float v[8];
        LoadEight<W>(src.x, row + col, v);
        uint32_t unused = 0;
        StoreCodes(q, row + col, 8, true, QuantizeEight<F>(v, s, unused));
      }
    } else {
      for (int64_t col = lane; col < c.cols; col += 32) {
        q[row + col] = CvtFp8<F>(src(0, r, col), s);
      }
    }
  }
}

// The launch: enough blocks for one warp per row, at most what the device holds at once.
template <WideKind W, typename F>
ffi::Error RowwiseCast(cudaStream_t stream, const char* op, const block::Cast& c, const void* x,
                       void* q, void* scale_inv) {
  if (c.rows == 0) return ffi::Error::Success();
  auto* kernel = RowwiseKernel<W, F>;
  int64_t resident = 0;
  FP8JAX_RETURN_IF_ERROR(
      ResidentBlocks(op, reinterpret_cast<const void*>(kernel), kRowThreads, &resident));
  const int64_t need = (c.rows + kRowWarps - 1) / kRowWarps;
  const DirectSource<W, FastHalf> src{x, c.rows, c.cols};
  // 8 elements a lane per access where every row starts aligned for it
  const bool vector = c.cols % 8 == 0 && Addr(x) % (8 * kWideBytes<W>) == 0 && Addr(q) % 8 == 0;
  return Launch(op, kernel, need < resident ? need : resident, kRowThreads, stream, src,
                static_cast<uint8_t*>(q), static_cast<float*>(scale_inv), c, vector);
}

}  // namespace

ffi::Error RowwiseQuantize::Compute(CudaStream stream) {
  return DispatchWideFp8(kName, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           return RowwiseCast<W, F>(stream, kName, c, x.untyped_data(),
                                                    q->untyped_data(), scale_inv->untyped_data());
                         });
}

}  // namespace fp8jax
