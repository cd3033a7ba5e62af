// Splitting a CPU kernel's loop over XLA's intra-op thread pool.
//
// XLA:CPU runs its own large elementwise loops on the intra-op (Eigen) thread
// pool, which an FFI handler reaches through ffi::ThreadPool. The pool gives
// no guarantee that scheduled tasks run in parallel, or at all before the
// caller returns (it may have one thread, the caller's own), so the calling
// thread never waits for a task to start: work is cut into chunks claimed from
// a shared counter, the caller claims chunks too, and it waits only for chunks
// that a helper has claimed and not finished. A helper that starts after all
// chunks are gone returns at once; the state it touches is shared-owned, so it
// may outlive the handler call.
//
// The floating-point environment of the caller (on x86 the MXCSR: flush-to-zero,
// denormals-are-zero, rounding mode, which XLA:CPU sets for its own code) is
// copied to the helper threads for the duration of a chunk, so that every
// multiply rounds exactly as the caller's would.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <immintrin.h>
#define FP8JAX_X86 1
#endif

#include "xla/ffi/api/ffi.h"

namespace fp8jax {

namespace ffi = xla::ffi;

// Elements per chunk of work handed to a thread: large enough that the
// scheduling cost (microseconds) is small against it, small enough that a
// 2048 x 2048 tensor is split over every thread.
constexpr int64_t kGrain = int64_t{1} << 16;

// Lock-free max of amax bits shared by the chunks of one group.
inline void AtomicMaxBits(std::atomic<uint32_t>& a, uint32_t v) {
  uint32_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
  }
}

// Saves the caller's floating-point control state and applies it on another thread.
class FpEnv {
 public:
#if defined(FP8JAX_X86)
  FpEnv() : csr_(_mm_getcsr()) {}
  unsigned Apply() const {
    const unsigned old = _mm_getcsr();
    if (old != csr_) _mm_setcsr(csr_);
    return old;
  }
  static void Restore(unsigned old) {
    if (_mm_getcsr() != old) _mm_setcsr(old);
  }

 private:
  unsigned csr_;
#else
  unsigned Apply() const { return 0; }
  static void Restore(unsigned) {}
#endif
};

// Calls body(begin, end) over [0, n) in chunks of about `grain` items, on the
// calling thread and on up to pool->num_threads() helpers. Returns when every
// chunk is done. `pool` may be null (everything runs on the caller).
template <typename Body>
void ParallelFor(ffi::ThreadPool* pool, int64_t n, int64_t grain, const Body& body) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t threads = pool != nullptr ? pool->num_threads() : 0;
  const int64_t helpers = std::min<int64_t>(threads, chunks - 1);
  if (helpers <= 0) {
    body(int64_t{0}, n);
    return;
  }
  // Equal chunks (the last may be shorter), at least `grain` items each.
  const int64_t step = (n + chunks - 1) / chunks;

  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t chunks = 0;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  state->chunks = chunks;
  const FpEnv env;

  // Runs chunks until none is left. `body` lives on the caller's stack; it is
  // only used for a claimed chunk, and the caller waits for every claimed chunk.
  auto drain = [state, &body, n, step](bool helper, const FpEnv& fp) {
    unsigned saved = 0;
    bool applied = false;
    for (;;) {
      const int64_t c = state->next.fetch_add(1, std::memory_order_relaxed);
      if (c >= state->chunks) break;
      if (helper && !applied) {
        saved = fp.Apply();
        applied = true;
      }
      const int64_t begin = c * step;
      body(begin, std::min(n, begin + step));
      if (state->done.fetch_add(1, std::memory_order_acq_rel) + 1 == state->chunks) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
    if (applied) FpEnv::Restore(saved);
  };

  for (int64_t h = 0; h < helpers; ++h) {
    // The helper holds its own reference to `state`; `body` is reached only
    // through claimed chunks, which finish before the caller returns.
    pool->Schedule([state, drain, env]() { drain(true, env); });
  }
  drain(false, env);
  if (state->done.load(std::memory_order_acquire) != chunks) {
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done.load(std::memory_order_acquire) == chunks; });
  }
}

}  // namespace fp8jax
