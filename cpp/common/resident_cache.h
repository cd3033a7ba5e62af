// How many blocks of a kernel a device runs at once, cached per (device, kernel, block size).
//
// The block size is part of the key: the occupancy of one kernel differs with its block size
// (a norm kernel is launched with 128, 256 or 512 threads), so an entry made for one size must
// not answer for another. Host-only and free of CUDA, so that tests/ops/test_launch_plan.py checks
// the caching without a GPU; cuda/cuda_util.h's ResidentBlocks is its CUDA user.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <mutex>

namespace fp8jax {

class ResidentCache {
 public:
  struct Key {
    int device = 0;
    const void* kernel = nullptr;
    int threads = 0;
    auto operator<=>(const Key&) const = default;
  };

  // The cached count of `key`, else `query(out)`'s, kept when the query succeeds. `query`
  // returns an error type with success() and a static Success() (ffi::Error).
  template <typename Query>
  auto Get(const Key& key, int64_t* out, Query&& query) -> decltype(query(out)) {
    using Result = decltype(query(out));
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = map_.find(key); it != map_.end()) {
      *out = it->second;
      return Result::Success();
    }
    Result result = query(out);
    if (result.success()) map_.emplace(key, *out);
    return result;
  }

 private:
  std::mutex mu_;
  std::map<Key, int64_t> map_;
};

}  // namespace fp8jax
