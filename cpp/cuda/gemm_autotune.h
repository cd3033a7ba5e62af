// Choosing a cuBLASLt algorithm by timing (cpp/cuda/gemm_cublaslt.cc): the rules, without CUDA.
//
// On its first run outside a CUDA-graph capture, a GEMM problem (its AlgoKey, gemm_setup.h) asks
// cuBLASLt's heuristic for up to kMaxCandidates algorithms, times each on the stream (one
// warm-up, then kTimedRuns runs between two events) and keeps the fastest for the life of the
// process. What decides, in order (Decide):
//   - a cached choice is used as it is: nothing is timed or queried twice;
//   - inside a capture (cudaStreamIsCapturing), or with timing impossible (no scratch memory for
//     the outputs, no events), or with autotuning off, the heuristic's first answer runs; it is
//     cached only when autotuning is off (else a later run outside a capture still tunes);
//   - otherwise the candidates are timed and the fastest (ties: the heuristic's order) is cached.
// The ranking, the capture rule and the once-per-key cache are plain C++ here, so the tests run
// them on the host with injected timings (cpp/testing/module_cuda_testing.cc).
#pragma once

#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace fp8jax::autotune {

// How many of the heuristic's answers are timed, and how.
inline constexpr int kMaxCandidates = 8;
inline constexpr int kTimedRuns = 3;  // after one untimed warm-up run

// What one call does to get its algorithm.
enum class Action {
  kUseCached = 0,   // the key's choice is cached
  kTime = 1,        // time the candidates, cache the fastest
  kFirstCache = 2,  // the heuristic's first answer, cached (autotuning off)
  kFirstOnly = 3,   // the heuristic's first answer, not cached (a capture, or no timing)
};

// The rule above. `capturing`: the stream is being captured into a CUDA graph (or its capture
// status is unknown); `can_time`: scratch memory for the outputs and the events exist.
inline Action Decide(bool cached, bool autotune, bool capturing, bool can_time) {
  if (cached) return Action::kUseCached;
  if (!autotune) return Action::kFirstCache;
  if (capturing || !can_time) return Action::kFirstOnly;
  return Action::kTime;
}

// The index of the fastest candidate: the smallest time that is finite and >= 0 (a negative or
// non-finite time is a candidate that failed), the earlier one on a tie (the heuristic's order);
// -1 when every candidate failed.
inline int Fastest(const std::vector<float>& ms) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(ms.size()); ++i) {
    if (!std::isfinite(ms[i]) || ms[i] < 0.0f) continue;
    if (best < 0 || ms[i] < ms[best]) best = i;
  }
  return best;
}

// Times candidates 0..n-1 with `time_one(i) -> float` (milliseconds per run, negative on
// failure), each once, and returns (the winner, whether any candidate ran); the winner is 0 (the
// heuristic's first answer) when none did.
template <typename TimeFn>
std::pair<int, bool> Tune(int n, TimeFn&& time_one) {
  std::vector<float> ms;
  ms.reserve(n);
  for (int i = 0; i < n; ++i) ms.push_back(time_one(i));
  const int best = Fastest(ms);
  return {best < 0 ? 0 : best, best >= 0};
}

// A thread-safe cache that computes each key's value at most once at a time: callers of one key
// wait for the first (and take its value), callers of other keys do not wait for it (each GPU of
// a process tunes its own problems in parallel). A failed computation caches nothing.
template <typename Key, typename Value>
class OnceCache {
 public:
  // The cached value of `key`, if any (never waits for a computation in progress).
  std::optional<Value> Find(const Key& key) {
    std::shared_ptr<Slot> slot = SlotOf(key, /*create=*/false);
    if (slot == nullptr) return std::nullopt;
    std::unique_lock<std::mutex> lock(slot->mu, std::try_to_lock);
    if (!lock.owns_lock() || !slot->value.has_value()) return std::nullopt;
    return slot->value;
  }

  // The cached value of `key`, else `compute()` (returning std::optional<Value>; nullopt: failed,
  // nothing cached), run while holding the key's lock only.
  template <typename Fn>
  std::optional<Value> GetOrCompute(const Key& key, Fn&& compute) {
    std::shared_ptr<Slot> slot = SlotOf(key, /*create=*/true);
    std::lock_guard<std::mutex> lock(slot->mu);
    if (!slot->value.has_value()) slot->value = compute();
    return slot->value;
  }

  // Drops every entry (tests only).
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    slots_.clear();
  }

 private:
  struct Slot {
    std::mutex mu;
    std::optional<Value> value;
  };

  std::shared_ptr<Slot> SlotOf(const Key& key, bool create) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(key);
    if (it != slots_.end()) return it->second;
    if (!create) return nullptr;
    auto slot = std::make_shared<Slot>();
    slots_.emplace(key, slot);
    return slot;
  }

  std::mutex mu_;
  std::map<Key, std::shared_ptr<Slot>> slots_;
};

}  // namespace fp8jax::autotune
