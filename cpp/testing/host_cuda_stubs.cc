// The CUDA runtime calls of cpp/cuda/'s handlers, for the host runtime of host_cuda.h: a device of
// Options::sms multiprocessors, an occupancy of Options::blocks_per_sm (0: 2048 / threads),
// cudaMemsetAsync as memset, and the error text of a failed host launch.
#include <cstring>
#include <string>

#include "testing/host_cuda.h"

namespace fp8jax::host_cuda {

std::string& LastLaunchError() {
  thread_local std::string message;
  return message;
}

}  // namespace fp8jax::host_cuda

extern "C" {

cudaError_t cudaGetDevice(int* device) {
  *device = fp8jax::host_cuda::GetOptions().device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  if (attr != cudaDevAttrMultiProcessorCount) return cudaErrorInvalidValue;
  *value = fp8jax::host_cuda::GetOptions().sms;
  return cudaSuccess;
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void*, int threads,
                                                          size_t) {
  const int set = fp8jax::host_cuda::GetOptions().blocks_per_sm;
  *blocks = set > 0 ? set : (threads > 0 ? (2048 / threads > 0 ? 2048 / threads : 1) : 0);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (bytes > 0) std::memset(p, value, bytes);
  return cudaSuccess;
}

// A failed host launch (LaunchKernelEx) reports RunGrid's message.
const char* cudaGetErrorName(cudaError_t err) {
  return err == cudaErrorLaunchFailure ? "cudaErrorLaunchFailure" : "cudaErrorHostStub";
}
const char* cudaGetErrorString(cudaError_t err) {
  if (err == cudaErrorLaunchFailure) return fp8jax::host_cuda::LastLaunchError().c_str();
  return "a CUDA runtime stub of host_cuda failed";
}

}  // extern "C"
