// CUDA cast_transpose family: cast_transpose, cast_transpose_dbias, and the
// launch functions the activation forms (cuda_activation.cu) reuse.
//
// Same target names and numerics as the CPU handlers. Every handler takes
// XLA's stream, never synchronises the host, and reports launch failures as
// ffi::Error. cast_transpose allocates nothing (command-buffer compatible);
// cast_transpose_dbias takes its [strips, cols] float32 workspace from XLA's
// scratch allocator.
//
// dbias is deterministic (no float atomics): ColumnPartialsKernel writes each
// 64-row strip's column sums, ColumnTotalsKernel adds them in strip order
// (plan::PartialSlot, plan::SumStrips in common/launch_plan.h, the order of
// the CPU engine too).
#include <cuda_runtime.h>

#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/launch_plan.h"
#include "cuda/cuda_cast_transpose.h"
#include "cuda/cuda_device.cuh"
#include "cuda/cuda_util.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// ---------------------------------------------------------- cast_transpose

// Fast path for a kBigTile x kBigTile tile inside an aligned matrix
// (plan::FastTileOk; the reasoning is in docs/performance.md). Each thread
// loads its 8 x 8 block (8 independent 16-byte loads for 2-byte inputs, 16
// for f32), writes 8 q words, transposes the block in registers and puts its
// 8 column words into the swizzled shared buffer; after one barrier each
// thread moves 4 x 16 bytes of q_t rows from shared memory to global memory.
template <WideKind W, typename F>
__device__ __forceinline__ void CastTransposeFastTile(
    const void* __restrict__ x, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
    uint64_t* __restrict__ words, const plan::TransposeArgs& a, const plan::MatTile& mt, float sc,
    uint32_t& m, int t) {
  const int rb = plan::FastRowBlock(t);
  const int cb = plan::FastColBlock(t);
  const int64_t mat_base = mt.mat * a.rows * a.cols;
  const int64_t first = mat_base + (mt.row0 + rb * plan::kVec) * a.cols + mt.col0 + cb * plan::kVec;
  float v[plan::kVec][8];
#pragma unroll
  for (int i = 0; i < plan::kVec; ++i) LoadEight<W>(x, first + i * a.cols, v[i]);
  uint64_t w[plan::kVec];
#pragma unroll
  for (int i = 0; i < plan::kVec; ++i) {
    w[i] = QuantizeEight<F>(v[i], sc, m);
    *reinterpret_cast<uint64_t*>(q + first + i * a.cols) = w[i];
  }
  plan::Transpose8x8(w);
#pragma unroll
  for (int j = 0; j < plan::kVec; ++j) words[plan::FastWord(cb * plan::kVec + j, rb)] = w[j];
  __syncthreads();
#pragma unroll
  for (int step = 0; step < plan::kFastReadSteps; ++step) {
    const int c = plan::FastReadCol(t, step);
    const int k = plan::FastReadPair(t);
    const ulonglong2 pair = *reinterpret_cast<const ulonglong2*>(&words[plan::FastReadWord(c, k)]);
    const bool swapped = plan::FastReadSwapped(c);
    const ulonglong2 out = swapped ? make_ulonglong2(pair.y, pair.x) : pair;
    const int64_t dst = mat_base + (mt.col0 + c) * a.rows + mt.row0 + 16 * k;
    *reinterpret_cast<ulonglong2*>(qt + dst) = out;
  }
  __syncthreads();  // this tile's reads before the next tile's writes
}

// Guarded path for one kTile x kTile sub-tile (edges, unaligned matrices).
// Load pass: each thread loads 8 consecutive inputs of a row (one vector
// access when aligned and inside the matrix, else element by element), writes
// their 8 codes to q and stages them in shared memory. Store pass: each
// thread gathers 8 codes of a tile column and writes them as 8 consecutive
// codes of a q_t row. Every chunk is guarded (plan::LoadChunk/StoreChunk).
template <WideKind W, typename F>
__device__ __forceinline__ void CastTransposeGuardedTile(
    const void* __restrict__ x, uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
    uint8_t (*tile)[plan::kTile + 8], const plan::TransposeArgs& a, const plan::MatTile& mt,
    float sc, uint32_t& m, int t) {
  plan::TileChunk in[2];
  float v[2][8];
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    in[p] = plan::LoadChunk(a, mt, t, p);
    LoadChunk<W>(x, in[p].offset, in[p].count, in[p].vector, v[p]);
  }
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const uint64_t packed = QuantizeEight<F>(v[p], sc, m);
    StoreCodes(q, in[p].offset, in[p].count, in[p].vector, packed);
    *reinterpret_cast<uint64_t*>(&tile[in[p].slot.row][in[p].slot.col]) = packed;
  }
  __syncthreads();
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    const plan::TileChunk out = plan::StoreChunk(a, mt, t, p);
    uint64_t packed = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      packed |= static_cast<uint64_t>(tile[out.slot.row + j][out.slot.col]) << (8 * j);
    }
    StoreCodes(qt, out.offset, out.count, out.vector, packed);
  }
  __syncthreads();  // this sub-tile's reads before the next writes
}

// One kBigTile x kBigTile tile per step (plan::WalkCastTranspose): the fast
// path when the tile lies inside an aligned matrix, else four guarded
// sub-tiles. One amax atomic per block and group.
// At least 2 resident blocks per SM (so one block's loads overlap the
// other's shared-memory phase): up to 128 registers per thread, which keeps
// the 64 loaded values in registers on every arch (without the bound, ptxas
// for sm_89 stopped at 80 registers and spilled).
template <WideKind W, typename F>
__global__ void __launch_bounds__(plan::kThreads, 2)
    CastTransposeKernel(const void* __restrict__ x, const float* __restrict__ scale,
                        uint8_t* __restrict__ q, uint8_t* __restrict__ qt,
                        float* __restrict__ scale_inv, uint32_t* __restrict__ amax_bits,
                        int64_t groups, plan::TransposeArgs a) {
  __shared__ alignas(16) uint64_t words[plan::kBigTile * plan::kBlocksPerEdge];
  static_assert(sizeof(words) >= plan::kTile * (plan::kTile + 8));
  auto* tile = reinterpret_cast<uint8_t (*)[plan::kTile + 8]>(words);
  WriteScaleInv(scale, scale_inv, groups);
  const int t = threadIdx.x;
  uint32_t m = 0;
  plan::WalkCastTranspose(
      a, blockIdx.x, gridDim.x,
      [&](int64_t g, const plan::MatTile& mt) {
        const float sc = scale[g];
        if (plan::FastTileOk(a, mt)) {  // block-uniform
          CastTransposeFastTile<W, F>(x, q, qt, words, a, mt, sc, m, t);
          return;
        }
        for (int sub = 0; sub < plan::kSubTiles; ++sub) {
          CastTransposeGuardedTile<W, F>(x, q, qt, tile, a, plan::SubTile(mt, sub), sc, m, t);
        }
      },
      [&](int64_t g) {
        FlushAmax(amax_bits, g, m);
        m = 0;
      });
}

// Pass 1 of dbias: partial[matrix][strip][col] = the strip's rows, added in order.
template <WideKind W>
__global__ void __launch_bounds__(plan::kThreads)
    ColumnPartialsKernel(const void* __restrict__ x, float* __restrict__ partial, int64_t matrices,
                         int64_t rows, int64_t cols) {
  const int64_t strips = plan::SumStrips(rows);
  const int64_t n = matrices * strips * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const plan::SumSlot s = plan::PartialSlot(i, strips, cols);
    const int64_t r0 = s.strip * plan::kSumRows;
    const int64_t r1 = r0 + plan::kSumRows < rows ? r0 + plan::kSumRows : rows;
    const int64_t base = s.matrix * rows * cols + s.col;
    float acc = 0.0f;
    for (int64_t r = r0; r < r1; ++r) acc = __fadd_rn(acc, LoadOne<W>(x, base + r * cols));
    partial[i] = acc;
  }
}

// Pass 2: dbias[matrix][col] = the strips' partials, added in strip order.
__global__ void __launch_bounds__(plan::kThreads)
    ColumnTotalsKernel(const float* __restrict__ partial, float* __restrict__ dbias,
                       int64_t matrices, int64_t strips, int64_t cols) {
  const int64_t n = matrices * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t m = i / cols;
    const int64_t c = i % cols;
    float acc = 0.0f;
    for (int64_t st = 0; st < strips; ++st) {
      acc = __fadd_rn(acc, partial[(m * strips + st) * cols + c]);
    }
    dbias[i] = acc;
  }
}

template <typename... Params, typename... Args>
ffi::Error LaunchGridStride(const char* op, void (*kernel)(Params...), cudaStream_t stream,
                            int64_t n, Args&&... args) {
  return PlanAndLaunch(
      op, kernel, stream, [n](int64_t resident) { return plan::GridFor(n, resident); },
      std::forward<Args>(args)...);
}

ffi::Error CastTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  const char* op = "cast_transpose";
  MatrixShape s;
  if (auto err = MatrixShapeOf(op, x.dimensions(), scale.element_count(), &s); !err.success()) {
    return err;
  }
  if (q->element_type() != qt->element_type() || q->element_count() != x.element_count() ||
      qt->element_count() != x.element_count()) {
    return BadArg(op, "outputs must match the input size and share an FP8 dtype");
  }
  return LaunchCastTranspose(op, stream, x.untyped_data(), WideKindOf(x.element_type()), s,
                             scale.typed_data(), q->untyped_data(), qt->untyped_data(),
                             Fp8KindOf(q->element_type()), scale_inv->typed_data(),
                             amax->typed_data());
}

ffi::Error CastTransposeDbiasImpl(cudaStream_t stream, ffi::ScratchAllocator scratch,
                                  ffi::AnyBuffer g, ffi::Buffer<ffi::F32> scale,
                                  ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                                  ffi::Result<ffi::Buffer<ffi::F32>> amax,
                                  ffi::Result<ffi::Buffer<ffi::F32>> dbias) {
  const char* op = "cast_transpose_dbias";
  MatrixShape s;
  if (auto err = MatrixShapeOf(op, g.dimensions(), scale.element_count(), &s); !err.success()) {
    return err;
  }
  if (q->element_type() != qt->element_type() || q->element_count() != g.element_count() ||
      qt->element_count() != g.element_count()) {
    return BadArg(op, "outputs must match the input size and share an FP8 dtype");
  }
  if (dbias->element_count() != s.matrices * s.cols) {
    return BadArg(op, "dbias must have one element per column of each matrix");
  }
  const WideKind w = WideKindOf(g.element_type());
  if (auto err =
          LaunchCastTranspose(op, stream, g.untyped_data(), w, s, scale.typed_data(),
                              q->untyped_data(), qt->untyped_data(), Fp8KindOf(q->element_type()),
                              scale_inv->typed_data(), amax->typed_data());
      !err.success()) {
    return err;
  }
  return LaunchColumnSums(op, stream, scratch, g.untyped_data(), w, s, dbias->typed_data());
}

}  // namespace

ffi::Error LaunchCastTranspose(const char* op, cudaStream_t stream, const void* x, WideKind w,
                               const MatrixShape& s, const float* scale, void* q, void* qt,
                               Fp8Kind f, float* scale_inv, float* amax) {
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax);
  if (auto err = MemsetAsync(op, amax_bits, s.groups * sizeof(uint32_t), stream); !err.success()) {
    return err;
  }
  // Always launched, even for an empty matrix: the kernel writes scale_inv
  // for every group before (and independently of) its tiles.
  return DispatchWideFp8(op, w, f, [&]<WideKind W, typename F>() {
    auto* qp = static_cast<uint8_t*>(q);
    auto* qtp = static_cast<uint8_t*>(qt);
    plan::TransposeArgs a;
    a.rows = s.rows;
    a.cols = s.cols;
    a.mats_per_group = s.matrices / s.groups;
    a.x_addr = Addr(x);
    a.wide_bytes = kWideBytes<W>;
    a.q_addr = Addr(qp);
    a.qt_addr = Addr(qtp);
    a.fast = plan::FastEligible(s.rows, s.cols, a.x_addr, a.wide_bytes, a.q_addr, a.qt_addr);
    return PlanAndLaunch(
        op, CastTransposeKernel<W, F>, stream,
        [&](int64_t resident) {
          const plan::TransposePlan p =
              plan::PlanCastTranspose(s.matrices, s.rows, s.cols, resident);
          a.row_tiles = p.row_tiles;
          a.col_tiles = p.col_tiles;
          a.tiles = p.tiles;
          return p.grid;
        },
        x, scale, qp, qtp, scale_inv, amax_bits, s.groups, a);
  });
}

ffi::Error LaunchColumnSums(const char* op, cudaStream_t stream, ffi::ScratchAllocator& scratch,
                            const void* x, WideKind w, const MatrixShape& s, float* dbias) {
  const int64_t strips = plan::SumStrips(s.rows);
  const int64_t n_partial = s.matrices * strips * s.cols;
  const int64_t n_total = s.matrices * s.cols;
  if (n_total == 0) return ffi::Error::Success();
  float* partial = nullptr;
  if (n_partial > 0) {
    auto mem = scratch.Allocate(static_cast<size_t>(n_partial) * sizeof(float), 256);
    if (!mem.has_value()) return ffi::Error::Internal(std::string("fp8jax ") + op + ": no scratch");
    partial = static_cast<float*>(*mem);
    ffi::Error err = ffi::Error::Success();
    switch (w) {
      case WideKind::kF32:
        err = LaunchGridStride(op, ColumnPartialsKernel<WideKind::kF32>, stream, n_partial, x,
                               partial, s.matrices, s.rows, s.cols);
        break;
      case WideKind::kBF16:
        err = LaunchGridStride(op, ColumnPartialsKernel<WideKind::kBF16>, stream, n_partial, x,
                               partial, s.matrices, s.rows, s.cols);
        break;
      case WideKind::kF16:
        err = LaunchGridStride(op, ColumnPartialsKernel<WideKind::kF16>, stream, n_partial, x,
                               partial, s.matrices, s.rows, s.cols);
        break;
      default:
        return BadArg(op, "input must be float32, bfloat16 or float16");
    }
    if (!err.success()) return err;
  }
  // With no rows (strips == 0) the totals loop adds nothing: dbias = 0.
  return LaunchGridStride(op, ColumnTotalsKernel, stream, n_total,
                          static_cast<const float*>(partial), dbias, s.matrices, strips, s.cols);
}

}  // namespace fp8jax

namespace ffi = xla::ffi;

// cast_transpose is command-buffer (CUDA graph) compatible: the same memset
// and launch for the same shapes, no allocation, no host synchronisation.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxCastTransposeCuda, fp8jax::CastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

// cast_transpose_dbias allocates its workspace from XLA's scratch allocator
// at run time, so it is not declared command-buffer compatible.
XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxCastTransposeDbiasCuda, fp8jax::CastTransposeDbiasImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
