// A CUDA-semantics runtime for the host compiler: the unchanged kernels and handlers of cpp/cuda/
// compile with g++/clang and run on the CPU, so the tests execute every __global__ body without
// a GPU (tests/ops/test_host_cuda.py).
//
// Included first by each translation unit CMake generates for a cpp/cuda/*.cu (this header, then
// the source, unchanged), and by module_host_cuda.cc, which binds every op's CUDA handler for XLA's
// CPU platform (no stream). The sources need no switch: cuda/cuda_util.h's Launch calls
// cudaLaunchKernelEx, which this header defines as LaunchKernelEx below (RunGrid on the host).
//
// The model, and what it checks:
// - Launches run one at a time (whatever thread XLA calls a handler on), and a launch runs its
//   blocks one at a time (ascending, or descending in the reverse order); each CUDA thread of a
//   block is a fiber (started by ucontext, switched by setjmp/longjmp) with its own stack, and
//   threadIdx, blockIdx, blockDim and gridDim read the running fiber's.
// - `__shared__` is `static thread_local`: one instance shared by every thread of the running
//   block (a launch runs on one OS thread, its blocks one at a time), in this module's TLS block,
//   which holds nothing else the kernels touch. The kernels' translation units are compiled with
//   the compiler's thread-sanitizer instrumentation (-fsanitize=thread, without its runtime): the
//   runtime here receives every load and store, and checks those that fall in that block
//   (host_cuda.cc): a read of a byte no thread of the block has written yet (shared memory does
//   not outlive a block), and a race: a byte written by one thread and read or written by
//   another with no __syncthreads in between, or read by one and then written by another. Each
//   fails the launch with the threads, the block and the offset. With Options::banks it also
//   counts shared-memory wavefronts: the lanes' accesses of one instruction (the same site, the
//   same occurrence since the last barrier) in 32 banks of 4 bytes, 8- and 16-byte accesses in
//   half- and quarter-warp phases (a 16-byte vector access may reach it as two 8-byte ones).
// - Between synchronisation points the threads of a block run one after another, in lane order
//   or in reverse lane order (Options::reverse): a thread that reads a shared word another thread
//   wrote without a barrier in between sees a different value in the two orders, which the
//   tests compare.
// - __syncthreads waits for every thread of the block that has not returned. A warp collective
//   (__shfl_xor_sync, __reduce_max_sync) waits for all 32 lanes of the warp, which must all be
//   at the same collective with the full mask; a warp collective with a lane that returned, or
//   threads of a block waiting at different kinds of synchronisation with none able to go on,
//   is an error (a deadlock or undefined behaviour on a GPU), reported by the launch.
// - Global memory (what is neither shared, nor a thread's stack, nor the launching thread's
//   stack, where the kernel's parameters are, nor the module's own static data such as the
//   coverage build's counters): every access must be aligned to its size, as a GPU requires,
//   and no byte may be stored by two threads of one launch (a write-write race, or a tile walk
//   that visits an element twice); either fails the launch. (The host compiler splits and
//   merges accesses its own way, so a host run does not show which of a kernel's accesses are
//   vectors on a GPU: that is the launch plan's choice, tested on its own.)
// - atomicMax is a plain read-modify-write (one OS thread runs everything), outside the checks.
// - The element conversions are the CUDA headers' host implementations and the common headers'
//   host paths (without __CUDA_ARCH__), which tests/cpp/test_device_numerics.py checks against
//   the hardware's definition over all inputs.
// - The CUDA runtime calls of the handlers are stubs (host_cuda_stubs.cc): the device has
//   Options::sms multiprocessors and each kernel Options::blocks_per_sm resident blocks per SM
//   (0: 2048 / threads), the current device is Options::device, cudaMemsetAsync is memset.
#pragma once

#if defined(__CUDACC__)
#error "cpp/testing/host_cuda.h is for the host compiler, never for nvcc"
#endif

// Before the CUDA headers, which keep a definition they find (crt/host_defines.h).
#define __global__
#define __device__
#define __host__
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace fp8jax::host_cuda {

struct Options {
  bool reverse = false;   // blocks and the threads of a block in descending order
  int sms = 2;            // cudaDevAttrMultiProcessorCount
  int blocks_per_sm = 0;  // the occupancy query's answer; 0: 2048 / threads
  int device = 0;         // cudaGetDevice's (ResidentBlocks caches its answers per device)
  bool banks = false;     // count shared-memory requests and wavefronts (Stats)
};

// The options of the launches that follow.
Options& GetOptions();

// What the launches since the last ResetStats did (XLA may run two custom calls at once, on two
// threads: each launch runs on its caller's thread, and these counters are atomic).
struct Stats {
  std::atomic<int64_t> launches{0};
  std::atomic<int64_t> blocks{0};
  std::atomic<int64_t> threads{0};
  std::atomic<int64_t> barriers{0};
  std::atomic<int64_t> warp_collectives{0};
  std::atomic<int64_t> shared_accesses{0};  // lane accesses to shared memory
  // With Options::banks: warp-wide shared-memory instructions, the wavefronts they take, and
  // the fewest they could take (one per phase with an active lane).
  std::atomic<int64_t> shared_requests{0};
  std::atomic<int64_t> shared_wavefronts{0};
  std::atomic<int64_t> shared_ideal{0};
};

Stats& GetStats();
void ResetStats();

// Runs `body` as a kernel of `grid` blocks of `threads` threads; returns "" or what went wrong
// (a deadlock, a divergent warp collective, an exception in the body).
std::string RunGrid(unsigned grid, unsigned threads, const std::function<void()>& body);

uint3 ThreadIdx();
uint3 BlockIdx();
dim3 BlockDim();
dim3 GridDim();
void SyncThreads();

// The warp collectives' common step: every lane of the running thread's warp hands in `bits`;
// returns the 32 lanes' values in `all` once each has.
enum class WarpOp { kShflXor, kReduceMax };
void WarpExchange(WarpOp op, unsigned mask, uint32_t bits, uint32_t all[32]);

// atomicMax, out of line in host_cuda.cc (uninstrumented: an atomic is no race, and the global
// memory check's one-writer rule does not hold for it).
unsigned AtomicMax(unsigned* p, unsigned v);

// The running thread's lane.
inline unsigned Lane() { return ThreadIdx().x % 32; }

// The message of this thread's last failed launch (what cudaGetErrorString reports for it).
std::string& LastLaunchError();

// cudaLaunchKernelEx on the host: runs `kernel`'s grid with RunGrid, the arguments converted to
// the kernel's parameter types as at a launch (the stream is not used: launches run one at a
// time). A failed run returns cudaErrorLaunchFailure, its message kept for cudaGetErrorString.
template <typename... Params, typename... Args>
cudaError_t LaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...),
                           Args&&... args) {
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  std::string err =
      RunGrid(config->gridDim.x, config->blockDim.x, [&] { std::apply(kernel, params); });
  if (err.empty()) return cudaSuccess;
  LastLaunchError() = std::move(err);
  return cudaErrorLaunchFailure;
}

}  // namespace fp8jax::host_cuda

// After the CUDA headers (which define the real one): every launch of the sources runs on the host.
#define cudaLaunchKernelEx ::fp8jax::host_cuda::LaunchKernelEx

#define threadIdx (::fp8jax::host_cuda::ThreadIdx())
#define blockIdx (::fp8jax::host_cuda::BlockIdx())
#define blockDim (::fp8jax::host_cuda::BlockDim())
#define gridDim (::fp8jax::host_cuda::GridDim())

inline void __syncthreads() { ::fp8jax::host_cuda::SyncThreads(); }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Round-to-nearest float arithmetic: the host's IEEE operations (no flush to zero, like the
// _rn intrinsics).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }

inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

inline unsigned atomicMax(unsigned* p, unsigned v) { return ::fp8jax::host_cuda::AtomicMax(p, v); }

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
  uint32_t all[32];
  ::fp8jax::host_cuda::WarpExchange(::fp8jax::host_cuda::WarpOp::kShflXor, width == 32 ? mask : 0u,
                                    __float_as_uint(v), all);
  return __uint_as_float(
      all[(::fp8jax::host_cuda::Lane() ^ static_cast<unsigned>(lane_mask)) % 32]);
}

inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  uint32_t all[32];
  ::fp8jax::host_cuda::WarpExchange(::fp8jax::host_cuda::WarpOp::kReduceMax, mask, v, all);
  unsigned m = 0;
  for (unsigned x : all) m = x > m ? x : m;
  return m;
}
