// CUDA FFI handlers: quantize, dequantize, cast_transpose, update_fp8_state.
//
// Same target names and numerics as cpp/cpu/cpu_ops.cc. Every handler takes
// XLA's stream from PlatformStream<cudaStream_t>, allocates nothing, never
// synchronises the host (so it is CUDA-graph compatible, and says so with
// kCmdBufferCompatible), and reports launch failures as ffi::Error.
//
// Grids, tiles, the vector/scalar choice and edge guards come from
// common/launch_plan.h, which the CPU extension also compiles so that the
// tests check them on the host; the kernels here are thin loops over it.
//
// amax is accumulated as the unsigned bits of |x| with atomicMax: for
// non-negative floats the unsigned order is the numeric order and NaN sorts
// above inf, so the result is a NaN-propagating max, like jnp.max(abs(x)).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"
#include "common/launch_plan.h"
#include "cuda/cuda_util.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr int kThreads = plan::kThreads;

// ------------------------------------------------------------ conversions

// The element conversions (CvtFp8(x, scale): the FP8 code of x * scale;
// F16BitsToFloatFast; FloatToF16BitsFast; DequantizeValue) are the
// __host__ __device__ helpers of common/fp8_device_convert.h and
// common/fp8_numerics.h, tested on the host against the CPU numerics
// (tests/cpp). CvtFp8 takes x and scale apart because the GPU's multiply
// drops a NaN's sign.

template <WideKind W>
__device__ __forceinline__ float LoadOne(const void* p, int64_t i) {
  if constexpr (W == WideKind::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (W == WideKind::kBF16) {
    return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16);
  } else {
    return F16BitsToFloatFast(static_cast<const uint16_t*>(p)[i]);
  }
}

// Loads 8 consecutive elements starting at i (16-byte aligned for 2-byte
// types, 32-byte aligned for float32).
template <WideKind W>
__device__ __forceinline__ void LoadEight(const void* p, int64_t i, float v[8]) {
  if constexpr (W == WideKind::kF32) {
    const float4* src = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
    const float4 a = src[0];
    const float4 b = src[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
    const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (W == WideKind::kBF16) {
        v[2 * k] = __uint_as_float(words[k] << 16);
        v[2 * k + 1] = __uint_as_float(words[k] & 0xFFFF0000u);
      } else {
        v[2 * k] = F16BitsToFloatFast(static_cast<uint16_t>(words[k] & 0xFFFFu));
        v[2 * k + 1] = F16BitsToFloatFast(static_cast<uint16_t>(words[k] >> 16));
      }
    }
  }
}

template <WideKind W>
__device__ __forceinline__ uint16_t WideBits(float v) {
  if constexpr (W == WideKind::kBF16) {
    return FloatToBf16Bits(v);
  } else {
    return FloatToF16BitsFast(v);
  }
}

template <WideKind W>
__device__ __forceinline__ void StoreOne(void* p, int64_t i, float v) {
  if constexpr (W == WideKind::kF32) {
    static_cast<float*>(p)[i] = v;
  } else {
    static_cast<uint16_t*>(p)[i] = WideBits<W>(v);
  }
}

template <WideKind W>
__device__ __forceinline__ void StoreEight(void* p, int64_t i, const float v[8]) {
  if constexpr (W == WideKind::kF32) {
    float4* dst = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
    dst[0] = make_float4(v[0], v[1], v[2], v[3]);
    dst[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      w[k] = static_cast<uint32_t>(WideBits<W>(v[2 * k])) |
             (static_cast<uint32_t>(WideBits<W>(v[2 * k + 1])) << 16);
    }
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Quantizes 8 values; returns them packed little-endian, updates amax bits.
template <typename F>
__device__ __forceinline__ uint64_t QuantizeEight(const float v[8], float scale, uint32_t& amax) {
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    amax = max(amax, AbsBits(v[j]));
    packed |= static_cast<uint64_t>(CvtFp8<F>(v[j], scale)) << (8 * j);
  }
  return packed;
}

// Max of an unsigned value over the block; the result is valid in thread 0.
__device__ __forceinline__ uint32_t BlockMaxU32(uint32_t v) {
  __shared__ uint32_t warp_max[kThreads / 32];
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_max[warp] = v;
  __syncthreads();
  uint32_t r = 0;
  if (warp == 0) {
    r = lane < static_cast<int>(blockDim.x / 32) ? warp_max[lane] : 0u;
    r = __reduce_max_sync(0xFFFFFFFFu, r);
  }
  __syncthreads();  // warp_max may be reused by a following call
  return r;
}

template <WideKind W>
constexpr int kWideBytes = W == WideKind::kF32 ? 4 : 2;

uint64_t Addr(const void* p) { return static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)); }

// Loads the `count` (0..8) elements of a chunk at element i into v[0..7] (the
// missing ones as 0, which leaves amax unchanged): one vector access when
// `vector`, else element by element (the scalar head and tail).
template <WideKind W>
__device__ __forceinline__ void LoadChunk(const void* p, int64_t i, int count, bool vector,
                                          float v[8]) {
  if (vector) {
    LoadEight<W>(p, i, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < count ? LoadOne<W>(p, i + j) : 0.0f;
}

template <WideKind W>
__device__ __forceinline__ void StoreChunk(void* p, int64_t i, int count, bool vector,
                                           const float v[8]) {
  if (vector) {
    StoreEight<W>(p, i, v);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < count) StoreOne<W>(p, i + j, v[j]);
  }
}

// FP8 codes of a chunk, packed little-endian in a uint64.
__device__ __forceinline__ uint64_t LoadCodes(const uint8_t* p, int64_t i, int count, bool vector) {
  if (vector) return *reinterpret_cast<const uint64_t*>(p + i);
  uint64_t packed = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < count) packed |= static_cast<uint64_t>(p[i + j]) << (8 * j);
  }
  return packed;
}

__device__ __forceinline__ void StoreCodes(uint8_t* p, int64_t i, int count, bool vector,
                                           uint64_t packed) {
  if (vector) {
    *reinterpret_cast<uint64_t*>(p + i) = packed;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < count) p[i + j] = static_cast<uint8_t>(packed >> (8 * j));
  }
}

// scale_inv = 1 / scale for every group, by a grid-stride loop over all
// threads: written even when the tensor is empty and no tile has work.
__device__ __forceinline__ void WriteScaleInv(const float* __restrict__ scale,
                                              float* __restrict__ scale_inv, int64_t groups) {
  plan::WalkGroups(groups, blockIdx.x, gridDim.x, threadIdx.x,
                   [&](int64_t g) { scale_inv[g] = 1.0f / scale[g]; });
}

// One atomic per block and group: the block's max of m into amax_bits[group].
// Called at block-uniform points (it synchronises the block).
__device__ __forceinline__ void FlushAmax(uint32_t* __restrict__ amax_bits, int64_t group,
                                          uint32_t m) {
  m = BlockMaxU32(m);
  if (threadIdx.x == 0) atomicMax(amax_bits + group, m);
}

ffi::Error MemsetAsync(const char* op, void* p, size_t bytes, cudaStream_t stream) {
  if (const cudaError_t err = cudaMemsetAsync(p, 0, bytes, stream); err != cudaSuccess) {
    return CudaError(op, "cudaMemsetAsync", err);
  }
  return ffi::Error::Success();
}

// Launches `kernel` on as many blocks as `plan_grid(resident blocks)` says.
template <typename PlanGrid, typename... Params, typename... Args>
ffi::Error PlanAndLaunch(const char* op, void (*kernel)(Params...), cudaStream_t stream,
                         PlanGrid&& plan_grid, Args&&... args) {
  int64_t resident = 0;
  if (auto err = ResidentBlocks(op, stream, reinterpret_cast<const void*>(kernel), plan::kThreads,
                                &resident);
      !err.success()) {
    return err;
  }
  return Launch(op, kernel, plan_grid(resident), plan::kThreads, stream,
                std::forward<Args>(args)...);
}

// The launch arguments of an elementwise kernel over `s.groups` groups of `s.per_group`
// elements: `wide` is the float32/bf16/f16 side (`wide_bytes` per element), `narrow` the FP8
// codes. The grid-dependent fields are filled by ElementwisePlanner once the occupancy is known.
plan::ElementwiseArgs ElementwiseArgsOf(const GroupShape& s, const void* wide, int wide_bytes,
                                        const void* narrow) {
  plan::ElementwiseArgs a;
  a.groups = s.groups;
  a.per_group = s.per_group;
  a.wide_addr = Addr(wide);
  a.wide_bytes = wide_bytes;
  a.narrow_addr = Addr(narrow);
  return a;
}

// PlanAndLaunch's planner for an elementwise kernel: fills `a`'s tiling for `resident` blocks
// and returns the grid.
auto ElementwisePlanner(plan::ElementwiseArgs& a) {
  return [&a](int64_t resident) {
    const plan::ElementwisePlan p = plan::PlanElementwise(a.groups, a.per_group, resident);
    a.tiles_per_group = p.tiles_per_group;
    a.tiles = p.tiles;
    return p.grid;
  };
}

// ---------------------------------------------------------------- quantize

// Each block walks its tiles (plan::WalkElementwise): per tile, each thread
// loads its kChunksPerThread chunks first (independent loads in flight), then
// converts and stores them; vector chunks use one or two 16-byte loads and one
// 8-byte store, the head and tail chunks of a group go element by element.
template <WideKind W, typename F>
__global__ void __launch_bounds__(plan::kThreads)
    QuantizeKernel(const void* __restrict__ x, const float* __restrict__ scale,
                   uint8_t* __restrict__ q, float* __restrict__ scale_inv,
                   uint32_t* __restrict__ amax_bits, plan::ElementwiseArgs a) {
  WriteScaleInv(scale, scale_inv, a.groups);
  uint32_t m = 0;
  plan::WalkElementwise(
      a, blockIdx.x, gridDim.x, threadIdx.x,
      [&](int64_t g, int64_t base, const plan::ChunkElems* chunks) {
        const float sc = scale[g];
        float v[plan::kChunksPerThread][8];
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          LoadChunk<W>(x, base + chunks[k].first, chunks[k].count, chunks[k].vector, v[k]);
        }
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          const uint64_t packed = QuantizeEight<F>(v[k], sc, m);
          StoreCodes(q, base + chunks[k].first, chunks[k].count, chunks[k].vector, packed);
        }
      },
      [&](int64_t g) {
        FlushAmax(amax_bits, g, m);
        m = 0;
      });
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  GroupShape s;
  if (auto err = GroupShapeOf("quantize", x.element_count(), scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (q->element_count() != x.element_count()) return BadArg("quantize", "output size mismatch");
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax->typed_data());
  if (auto err = MemsetAsync("quantize", amax_bits, s.groups * sizeof(uint32_t), stream);
      !err.success()) {
    return err;
  }
  return DispatchWideFp8(
      "quantize", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        auto* qp = static_cast<uint8_t*>(q->untyped_data());
        plan::ElementwiseArgs a = ElementwiseArgsOf(s, x.untyped_data(), kWideBytes<W>, qp);
        return PlanAndLaunch("quantize", QuantizeKernel<W, F>, stream, ElementwisePlanner(a),
                             x.untyped_data(), scale.typed_data(), qp, scale_inv->typed_data(),
                             amax_bits, a);
      });
}

// -------------------------------------------------------------- dequantize

template <WideKind W, typename F>
__global__ void __launch_bounds__(plan::kThreads)
    DequantizeKernel(const uint8_t* __restrict__ q, const float* __restrict__ scale_inv,
                     void* __restrict__ out, plan::ElementwiseArgs a) {
  plan::WalkElementwise(
      a, blockIdx.x, gridDim.x, threadIdx.x,
      [&](int64_t g, int64_t base, const plan::ChunkElems* chunks) {
        const float si = scale_inv[g];
        uint64_t packed[plan::kChunksPerThread];
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          packed[k] = LoadCodes(q, base + chunks[k].first, chunks[k].count, chunks[k].vector);
        }
#pragma unroll
        for (int k = 0; k < plan::kChunksPerThread; ++k) {
          float v[8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            v[j] = DequantizeValue<F>(static_cast<uint8_t>(packed[k] >> (8 * j)), si);
          }
          StoreChunk<W>(out, base + chunks[k].first, chunks[k].count, chunks[k].vector, v);
        }
      },
      [](int64_t) {});
}

ffi::Error DequantizeImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::F32> scale_inv,
                          ffi::Result<ffi::AnyBuffer> out) {
  GroupShape s;
  if (auto err = GroupShapeOf("dequantize", q.element_count(), scale_inv.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (out->element_count() != q.element_count()) {
    return BadArg("dequantize", "output size mismatch");
  }
  return DispatchWideFp8(
      "dequantize", WideKindOf(out->element_type()), Fp8KindOf(q.element_type()),
      [&]<WideKind W, typename F>() {
        const auto* qp = static_cast<const uint8_t*>(q.untyped_data());
        plan::ElementwiseArgs a = ElementwiseArgsOf(s, out->untyped_data(), kWideBytes<W>, qp);
        return PlanAndLaunch("dequantize", DequantizeKernel<W, F>, stream, ElementwisePlanner(a),
                             qp, scale_inv.typed_data(), out->untyped_data(), a);
      });
}

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

ffi::Error CastTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                             ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_inv,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  MatrixShape s;
  if (auto err = MatrixShapeOf("cast_transpose", x.dimensions(), scale.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (q->element_type() != qt->element_type() || q->element_count() != x.element_count() ||
      qt->element_count() != x.element_count()) {
    return BadArg("cast_transpose", "outputs must match the input size and share an FP8 dtype");
  }
  uint32_t* amax_bits = reinterpret_cast<uint32_t*>(amax->typed_data());
  if (auto err = MemsetAsync("cast_transpose", amax_bits, s.groups * sizeof(uint32_t), stream);
      !err.success()) {
    return err;
  }
  // Always launched, even for an empty matrix: the kernel writes scale_inv
  // for every group before (and independently of) its tiles.
  return DispatchWideFp8("cast_transpose", WideKindOf(x.element_type()),
                         Fp8KindOf(q->element_type()), [&]<WideKind W, typename F>() {
                           auto* qp = static_cast<uint8_t*>(q->untyped_data());
                           auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
                           plan::TransposeArgs a;
                           a.rows = s.rows;
                           a.cols = s.cols;
                           a.mats_per_group = s.matrices / s.groups;
                           a.x_addr = Addr(x.untyped_data());
                           a.wide_bytes = kWideBytes<W>;
                           a.q_addr = Addr(qp);
                           a.qt_addr = Addr(qtp);
                           a.fast = plan::FastEligible(s.rows, s.cols, a.x_addr, a.wide_bytes,
                                                       a.q_addr, a.qt_addr);
                           return PlanAndLaunch(
                               "cast_transpose", CastTransposeKernel<W, F>, stream,
                               [&](int64_t resident) {
                                 const plan::TransposePlan p =
                                     plan::PlanCastTranspose(s.matrices, s.rows, s.cols, resident);
                                 a.row_tiles = p.row_tiles;
                                 a.col_tiles = p.col_tiles;
                                 a.tiles = p.tiles;
                                 return p.grid;
                               },
                               x.untyped_data(), scale.typed_data(), qp, qtp,
                               scale_inv->typed_data(), amax_bits, s.groups, a);
                         });
}

// -------------------------------------------------------- update_fp8_state

// One block per state row: shift the history by one (newest at index 0),
// reduce it, and compute the new scale. All rows in one launch. A row whose
// observation is not finite is copied unchanged (RecordsObservation).
__global__ void __launch_bounds__(kThreads)
    UpdateFp8StateKernel(const float* __restrict__ history, const float* __restrict__ scale,
                         const float* __restrict__ amax, const float* __restrict__ fp8_max,
                         int64_t len, int algo, float margin_factor,
                         float* __restrict__ new_history, float* __restrict__ new_scale) {
  __shared__ float partial[kThreads];
  const int64_t r = blockIdx.x;
  const float a = amax[r];
  if (!RecordsObservation(a)) {  // the same for the whole block: it returns before any barrier
    for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
      new_history[r * len + i] = history[r * len + i];
    }
    if (threadIdx.x == 0) new_scale[r] = scale[r];
    return;
  }
  float red = a;
  for (int64_t i = threadIdx.x; i < len; i += blockDim.x) {
    const float v = i == 0 ? a : history[r * len + i - 1];
    new_history[r * len + i] = v;
    if (algo == 0) red = NanMax(red, v);
  }
  partial[threadIdx.x] = red;
  __syncthreads();
  for (int width = kThreads / 2; width > 0; width /= 2) {
    if (threadIdx.x < width) {
      partial[threadIdx.x] = NanMax(partial[threadIdx.x], partial[threadIdx.x + width]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    new_scale[r] = ComputeScale(partial[0], scale[r], fp8_max[r], margin_factor);
  }
}

ffi::Error UpdateFp8StateImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> history,
                              ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> amax,
                              ffi::Buffer<ffi::F32> fp8_max, int64_t margin, int64_t algo,
                              ffi::Result<ffi::Buffer<ffi::F32>> new_history,
                              ffi::Result<ffi::Buffer<ffi::F32>> new_scale) {
  HistoryShape s;
  if (auto err =
          HistoryShapeOf(history.dimensions(), history.element_count(), scale.element_count(),
                         amax.element_count(), fp8_max.element_count(), &s);
      !err.success()) {
    return err;
  }
  if (auto err = CheckAlgo(algo); !err.success()) return err;
  if (s.rows == 0) return ffi::Error::Success();
  if (s.rows > INT32_MAX) return BadArg("update_fp8_state", "too many state rows");
  const float margin_factor = std::ldexp(1.0f, -static_cast<int>(margin));
  return Launch("update_fp8_state", UpdateFp8StateKernel, s.rows, kThreads, stream,
                history.typed_data(), scale.typed_data(), amax.typed_data(), fp8_max.typed_data(),
                s.len, static_cast<int>(algo), margin_factor, new_history->typed_data(),
                new_scale->typed_data());
}

}  // namespace
}  // namespace fp8jax

namespace ffi = xla::ffi;

// Every handler is command-buffer (CUDA graph) compatible: each call enqueues
// the same work for the same shapes (a memset and one kernel launch), with no
// allocation and no host synchronisation. (module_cuda.cc passes the same
// trait to the registration.)

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxQuantizeCuda, fp8jax::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxDequantizeCuda, fp8jax::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

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

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8jaxUpdateFp8StateCuda, fp8jax::UpdateFp8StateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("margin")
                                  .Attr<int64_t>("algo")
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>(),
                              {ffi::Traits::kCmdBufferCompatible});
