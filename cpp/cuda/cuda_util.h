// Host-side CUDA helpers shared by the CUDA handlers: the stream's device,
// resident blocks per device from the occupancy API, and error reporting.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_checks.h"
#include "common/resident_cache.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

namespace ffi = xla::ffi;

inline ffi::Error CudaError(const char* op, const char* call, cudaError_t err) {
  return ffi::Error::Internal(std::string("fp8jax ") + op + ": " + call + " failed: " +
                              cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

// The device of XLA's stream for this call: the calling thread's current
// device, which XLA makes the stream's device before it calls a handler.
// Not cudaStreamGetDevice(stream): while XLA captures the stream into a CUDA
// graph (a command buffer: consecutive custom calls, loop bodies of
// scan/while), the runtime refuses it with cudaErrorStreamCaptureUnsupported
// (seen on an H200, CUDA 13, JAX 0.11.2). cudaGetDevice enqueues nothing and
// is allowed there.
inline ffi::Error CurrentDevice(const char* op, int* device) {
  if (const cudaError_t err = cudaGetDevice(device); err != cudaSuccess) {
    return CudaError(op, "cudaGetDevice", err);
  }
  return ffi::Error::Success();
}

// How many blocks of `kernel` (launched with `threads` threads and no dynamic
// shared memory) the current device runs at once: SMs x the occupancy
// API's blocks per SM, which accounts for the kernel's registers and shared
// memory on that architecture (a fixed "8 blocks per SM" does not). Cached per
// (device, kernel, threads) (common/resident_cache.h); every CUDA call is
// checked. The occupancy query is about the current device, which XLA makes
// the stream's device. These calls enqueue nothing on any stream, so they are
// allowed while XLA captures the stream into a CUDA graph.
inline ffi::Error ResidentBlocks(const char* op, const void* kernel, int threads, int64_t* out) {
  int device = 0;
  FP8JAX_RETURN_IF_ERROR(CurrentDevice(op, &device));
  static auto* cache = new ResidentCache();
  return cache->Get({device, kernel, threads}, out, [&](int64_t* count) -> ffi::Error {
    int sms = 0;
    if (const cudaError_t err =
            cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        err != cudaSuccess) {
      return CudaError(op, "cudaDeviceGetAttribute(MultiProcessorCount)", err);
    }
    int per_sm = 0;
    if (const cudaError_t err =
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
        err != cudaSuccess) {
      return CudaError(op, "cudaOccupancyMaxActiveBlocksPerMultiprocessor", err);
    }
    if (sms < 1 || per_sm < 1) {
      return ffi::Error::Internal(std::string("fp8jax ") + op +
                                  ": the kernel cannot run on device " + std::to_string(device) +
                                  " (" + std::to_string(sms) + " SMs, " + std::to_string(per_sm) +
                                  " resident blocks per SM)");
    }
    *count = static_cast<int64_t>(sms) * per_sm;
    return ffi::Error::Success();
  });
}

// Launches kernel<<<grid, threads, 0, stream>>>(args...) and reports this
// launch's own result. cudaLaunchKernelEx returns the launch's configuration
// errors (no kernel image for this GPU, bad grid, too many resources)
// directly. The old `<<<>>>` + cudaGetLastError pattern also returned, and
// cleared, any unrelated error an earlier runtime call on this thread had left
// (another library's), blaming this op for it and hiding it from its owner;
// cudaPeekAtLastError before and after cannot tell an old error from a new one
// of the same code either. Faults inside the kernel are asynchronous and
// surface, as for XLA's own kernels, at the next synchronisation. (The tests' host run of the
// kernels, cpp/testing/host_cuda.h, brings its own cudaLaunchKernelEx, which runs the blocks.)
template <typename... Params, typename... Args>
ffi::Error Launch(const char* op, void (*kernel)(Params...), int64_t grid, int threads,
                  cudaStream_t stream, Args&&... args) {
  if (grid < 1 || grid > 0x7FFFFFFF) {
    return ffi::Error::Internal(std::string("fp8jax ") + op + ": bad grid size " +
                                std::to_string(grid));
  }
  // gridDim, blockDim, dynamicSmemBytes, stream, attrs, numAttrs (in the host run of the kernels,
  // gridDim and blockDim name the running block's, so the members go unnamed here).
  const cudaLaunchConfig_t config = {dim3(static_cast<unsigned>(grid)),
                                     dim3(static_cast<unsigned>(threads)),
                                     0,
                                     stream,
                                     nullptr,
                                     0};
  if (const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
      err != cudaSuccess) {
    return CudaError(op, "kernel launch", err);
  }
  return ffi::Error::Success();
}

}  // namespace fp8jax
