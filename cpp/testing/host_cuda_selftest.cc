// Kernels with known shared- and global-memory behaviour, for the tests of host_cuda's own checks
// (tests/ops/test_host_cuda.py): compiled like the kernels of cpp/cuda/ (host_cuda.h first,
// instrumented), so that what these show the real kernels' runs would show too.
#include "testing/host_cuda.h"
// The runtime first.
#include <stdexcept>
#include <string>
#include <vector>

namespace fp8jax::host_cuda {
namespace {

// Each thread writes its word, then (with `barrier`) after a barrier, reads its neighbour's.
__global__ void NeighbourKernel(bool barrier, float* out) {
  __shared__ float s[1024];
  const unsigned t = threadIdx.x;
  s[t] = static_cast<float>(t);
  if (barrier) __syncthreads();
  out[t] = s[(t + 1) % blockDim.x];
}

// Thread 0 reads a word no thread has written.
__global__ void UnwrittenKernel(float* out) {
  __shared__ float s[32];
  if (threadIdx.x == 0) out[0] = s[5];
}

// Thread 0 reads word 0, thread 1 then writes it, with no barrier in between.
__global__ void WriteAfterReadKernel(float* out) {
  __shared__ float s[32];
  if (threadIdx.x == 0) s[0] = 1.0f;
  __syncthreads();
  if (threadIdx.x == 0) out[0] = s[0];
  if (threadIdx.x == 1) s[0] = 2.0f;
}

// Each lane stores one float at word lane * stride: a stride of 2^k (k <= 5) is a 2^k-way
// bank conflict, an odd stride none.
__global__ void StrideKernel(int stride) {
  __shared__ float s[32 * 33];
  s[(threadIdx.x % 32) * stride] = 1.0f;
}

// Each lane stores 8 bytes at lane * 8 (2 phases of 16 lanes, no conflict) or 16 bytes at
// lane * 16 (4 phases of 8 lanes).
__global__ void WideKernel(int bytes) {
  __shared__ __align__(16) uint64_t s[64];
  if (bytes == 8) s[threadIdx.x % 32] = 1;
  if (bytes == 16) reinterpret_cast<ulonglong2*>(s)[threadIdx.x % 32] = make_ulonglong2(1, 2);
}

// Global memory, by `mode`: 0: each thread stores its word twice, and all take atomicMax of one
// word (allowed); 1: threads 2k and 2k + 1 store the same word; 2: thread 0 stores 8 bytes at a
// 4-byte aligned address.
__global__ void GlobalKernel(int mode, float* out) {
  const unsigned t = threadIdx.x;
  if (mode == 0) {
    out[t + 1] = 1.0f;
    out[t + 1] = 2.0f;
    atomicMax(reinterpret_cast<unsigned*>(out), t);
  }
  if (mode == 1) out[t / 2] = 1.0f;
  if (mode == 2 && t == 0) *reinterpret_cast<uint64_t*>(out + 1) = 1;
}

}  // namespace

// Runs one of the kernels above (one block of `threads` threads); returns the launch's error.
std::string RunSelfTest(const std::string& kind, int threads, int param) {
  // Global memory (the heap, 16-byte aligned), not the launching thread's stack.
  std::vector<float> buffer(1025, 0.0f);
  float* out = buffer.data();
  if (threads < 1 || threads > 1024) throw std::invalid_argument("threads: 1 to 1024");
  if (kind == "neighbour") return RunGrid(1, threads, [&] { NeighbourKernel(param != 0, out); });
  if (kind == "unwritten") return RunGrid(1, threads, [&] { UnwrittenKernel(out); });
  if (kind == "write_after_read") return RunGrid(1, threads, [&] { WriteAfterReadKernel(out); });
  if (kind == "stride") return RunGrid(1, threads, [&] { StrideKernel(param); });
  if (kind == "global") return RunGrid(1, threads, [&] { GlobalKernel(param, out); });
  if (kind == "wide") return RunGrid(1, threads, [&] { WideKernel(param); });
  throw std::invalid_argument("unknown self-test kernel " + kind);
}

}  // namespace fp8jax::host_cuda
