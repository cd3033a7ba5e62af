// The scheduler of cpp/testing/host_cuda.h (fibers, barriers, warp collectives) and the CUDA
// runtime stubs the handlers call there.
#include "testing/host_cuda.h"

#include <ucontext.h>

#include <array>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

namespace fp8jax::host_cuda {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

enum class State { kRunnable, kBarrier, kWarp, kDone };

struct Fiber {
  ucontext_t ctx;
  std::unique_ptr<char[]> stack;
  unsigned tid = 0;
  State state = State::kRunnable;
  WarpOp op = WarpOp::kShflXor;
  unsigned mask = 0;
  uint32_t bits = 0;
};

struct Grid {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  unsigned block = 0;
  unsigned grid = 1;
  unsigned threads = 1;
  const std::function<void()>* body = nullptr;
  std::string error;
  std::vector<std::array<uint32_t, 32>> warp_values;
};

thread_local Grid* g_grid = nullptr;  // this thread's launch in progress (they do not nest)

Grid& Running() {
  if (g_grid == nullptr || g_grid->current == nullptr) {
    std::fprintf(stderr, "host_cuda: a CUDA builtin was used outside a kernel\n");
    std::abort();
  }
  return *g_grid;
}

void Entry() {
  Grid& g = *g_grid;
  try {
    (*g.body)();
  } catch (const std::exception& e) {
    if (g.error.empty()) g.error = std::string("exception in the kernel: ") + e.what();
  } catch (...) {
    if (g.error.empty()) g.error = "exception in the kernel";
  }
  g.current->state = State::kDone;  // uc_link returns to the scheduler
}

// Back to the scheduler; returns when the scheduler runs this fiber again.
void Yield() {
  Grid& g = Running();
  swapcontext(&g.current->ctx, &g.scheduler);
}

const char* Name(State s) {
  switch (s) {
    case State::kRunnable:
      return "running";
    case State::kBarrier:
      return "__syncthreads";
    case State::kWarp:
      return "a warp collective";
    case State::kDone:
      return "returned";
  }
  return "?";
}

// Releases what can go on: each warp whose lanes are all at the same collective, else a block
// barrier that every thread still running has reached. Returns false on a deadlock (with
// g.error set).
bool Release(Grid& g) {
  bool released = false;
  const unsigned warps = (g.threads + 31) / 32;
  for (unsigned w = 0; w < warps; ++w) {
    const unsigned first = w * 32;
    const unsigned last = first + 32 < g.threads ? first + 32 : g.threads;
    unsigned at_warp = 0;
    for (unsigned t = first; t < last; ++t) at_warp += g.fibers[t].state == State::kWarp;
    if (at_warp == 0) continue;
    // Between passes no thread is runnable: lanes elsewhere never reach this collective.
    if (last - first != 32 || at_warp != 32) {
      std::ostringstream msg;
      msg << "block " << g.block << ", warp " << w << ": " << at_warp << " of " << (last - first)
          << " lanes wait at a full-mask warp collective; the others:";
      for (unsigned t = first; t < last; ++t) {
        if (g.fibers[t].state != State::kWarp) {
          msg << " thread " << t << " " << Name(g.fibers[t].state) << ";";
        }
      }
      g.error = msg.str();
      return false;
    }
    const Fiber& lead = g.fibers[first];
    for (unsigned t = first; t < last; ++t) {
      const Fiber& f = g.fibers[t];
      if (f.op != lead.op || f.mask != 0xFFFFFFFFu) {
        std::ostringstream msg;
        msg << "block " << g.block << ", warp " << w
            << ": the lanes are at different warp collectives, or not with the full mask "
            << "(thread " << t << ", mask 0x" << std::hex << f.mask << ")";
        g.error = msg.str();
        return false;
      }
      g.warp_values[w][t - first] = f.bits;
    }
    for (unsigned t = first; t < last; ++t) g.fibers[t].state = State::kRunnable;
    ++GetStats().warp_collectives;
    released = true;
  }
  if (released) return true;
  bool all_at_barrier = true;
  bool any_at_barrier = false;
  for (const Fiber& f : g.fibers) {
    if (f.state == State::kDone) continue;
    any_at_barrier |= f.state == State::kBarrier;
    all_at_barrier &= f.state == State::kBarrier;
  }
  if (any_at_barrier && all_at_barrier) {
    for (Fiber& f : g.fibers) {
      if (f.state == State::kBarrier) f.state = State::kRunnable;
    }
    ++GetStats().barriers;
    return true;
  }
  std::ostringstream msg;
  msg << "block " << g.block << ": deadlock:";
  for (const Fiber& f : g.fibers) {
    if (f.state != State::kDone) msg << " thread " << f.tid << " at " << Name(f.state) << ";";
  }
  g.error = msg.str();
  return false;
}

bool RunBlock(Grid& g) {
  for (unsigned t = 0; t < g.threads; ++t) {
    Fiber& f = g.fibers[t];
    f.tid = t;
    f.state = State::kRunnable;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = &g.scheduler;
    makecontext(&f.ctx, Entry, 0);
  }
  const bool reverse = GetOptions().reverse;
  while (true) {
    for (unsigned i = 0; i < g.threads; ++i) {
      Fiber& f = g.fibers[reverse ? g.threads - 1 - i : i];
      if (f.state != State::kRunnable) continue;
      g.current = &f;
      swapcontext(&g.scheduler, &f.ctx);
      g.current = nullptr;
      if (!g.error.empty()) return false;
    }
    bool done = true;
    for (const Fiber& f : g.fibers) done &= f.state == State::kDone;
    if (done) return true;
    if (!Release(g)) return false;
  }
}

}  // namespace

Options& GetOptions() {
  static Options options;
  return options;
}

Stats& GetStats() {
  static Stats stats;
  return stats;
}

void ResetStats() {
  Stats& s = GetStats();
  s.launches = 0;
  s.blocks = 0;
  s.threads = 0;
  s.barriers = 0;
  s.warp_collectives = 0;
}

std::string RunGrid(unsigned grid, unsigned threads, const std::function<void()>& body) {
  if (g_grid != nullptr) return "a kernel launched from a kernel";
  // One launch at a time: `__shared__` variables are statics of the process.
  static std::mutex one_launch;
  std::lock_guard<std::mutex> lock(one_launch);
  if (grid < 1 || threads < 1 || threads > 1024) return "bad launch configuration";
  Grid g;
  g.grid = grid;
  g.threads = threads;
  g.body = &body;
  g.fibers.resize(threads);
  for (Fiber& f : g.fibers) f.stack.reset(new char[kStackBytes]);
  g.warp_values.resize((threads + 31) / 32);
  g_grid = &g;
  Stats& stats = GetStats();
  ++stats.launches;
  const bool reverse = GetOptions().reverse;
  for (unsigned i = 0; i < grid && g.error.empty(); ++i) {
    g.block = reverse ? grid - 1 - i : i;
    ++stats.blocks;
    stats.threads += threads;
    RunBlock(g);
  }
  g_grid = nullptr;
  return g.error;
}

uint3 ThreadIdx() { return make_uint3(Running().current->tid, 0, 0); }
uint3 BlockIdx() { return make_uint3(Running().block, 0, 0); }
dim3 BlockDim() { return dim3(Running().threads); }
dim3 GridDim() { return dim3(Running().grid); }

void SyncThreads() {
  Running().current->state = State::kBarrier;
  Yield();
}

void WarpExchange(WarpOp op, unsigned mask, uint32_t bits, uint32_t all[32]) {
  Grid& g = Running();
  Fiber& f = *g.current;
  f.op = op;
  f.mask = mask;
  f.bits = bits;
  f.state = State::kWarp;
  Yield();
  const auto& values = g.warp_values[f.tid / 32];
  for (int i = 0; i < 32; ++i) all[i] = values[i];
}

}  // namespace fp8jax::host_cuda

// ---- The CUDA runtime calls of the handlers, for the host ----

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

const char* cudaGetErrorName(cudaError_t) { return "cudaErrorHostStub"; }
const char* cudaGetErrorString(cudaError_t) { return "a CUDA runtime stub of host_cuda failed"; }

}  // extern "C"
