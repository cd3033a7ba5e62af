// The scheduler of cpp/testing/host_cuda.h (fibers, barriers, warp collectives) and its memory
// checks (shared memory, bank model, global memory; the instrumentation's callbacks). The CUDA
// runtime stubs the handlers call are host_cuda_stubs.cc's.
#include "testing/host_cuda.h"

#include <link.h>
#include <pthread.h>
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace fp8jax::host_cuda {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

enum class State { kRunnable, kBarrier, kWarp, kDone };

struct Fiber {
  ucontext_t ctx;     // the fresh context a block's thread starts in
  void* resume[5]{};  // where Yield left it (__builtin_setjmp's buffer)
  bool started = false;
  char* stack = nullptr;  // kStackBytes of Grid::stacks
  unsigned tid = 0;
  State state = State::kRunnable;
  WarpOp op = WarpOp::kShflXor;
  unsigned mask = 0;
  uint32_t bits = 0;
  std::unordered_map<uintptr_t, uint32_t> occurrences;  // per access site, since the barrier
};

// One byte of shared memory: who wrote and read it in which interval between barriers (stamps
// count the block starts and barriers of all launches), and the block that first wrote it.
struct ShadowByte {
  uint32_t written = 0;  // stamp of the last write
  uint32_t read = 0;     // stamp of the last read
  uint32_t block = 0;    // block serial of the first write in the block
  int16_t writer = -1;
  int16_t reader = -1;  // kManyReaders: two threads or more
};
constexpr int16_t kManyReaders = -2;

// One lane's access, for the bank model.
struct LaneAccess {
  unsigned lane;
  uintptr_t addr;
  unsigned size;
};

struct SiteKey {
  unsigned warp;
  uintptr_t pc;
  uint32_t occurrence;
  bool operator==(const SiteKey& o) const {
    return warp == o.warp && pc == o.pc && occurrence == o.occurrence;
  }
};

struct SiteHash {
  size_t operator()(const SiteKey& k) const {
    return std::hash<uintptr_t>()(k.pc) ^ (size_t{k.warp} << 40) ^ (size_t{k.occurrence} << 20);
  }
};

// The first memory fault of a launch, as the fiber that made it saw it: only recorded there (no
// allocation, no formatting on a fiber's stack), and made a message by RunGrid on its own.
struct SharedFault {
  const char* what = nullptr;  // nullptr: none
  bool global = false;         // offset is then a global address, else a shared variables' byte
  uintptr_t offset = 0;
  unsigned block = 0;
  unsigned tid = 0;
  unsigned other = ~0u;  // the other thread, if one
};

struct Grid {
  ucontext_t scheduler;     // swapcontext's place to save the scheduler (never resumed)
  void* to_scheduler[5]{};  // where a thread yields or returns to (Resume)
  std::vector<Fiber> fibers;
  Fiber* current = nullptr;
  unsigned block = 0;
  unsigned grid = 1;
  unsigned threads = 1;
  const std::function<void()>* body = nullptr;
  std::string error;
  SharedFault fault;
  std::vector<std::array<uint32_t, 32>> warp_values;
  uint32_t block_serial = 0;  // this block's, for ShadowByte::block
  bool banks = false;
  std::unordered_map<SiteKey, std::vector<LaneAccess>, SiteHash> sites;  // since the barrier
  // The threads' stacks (local memory), one block of threads * kStackBytes.
  std::unique_ptr<char[]> stacks;
  // The launching thread's stack, where the kernel's parameters are (a GPU's constant bank):
  // the threads read them as they start.
  uintptr_t launcher_lo = 0;
  uintptr_t launcher_hi = 0;
  // Global memory: the thread (block * 1024 + tid) that wrote each byte in this launch.
  std::unordered_map<uintptr_t, uint64_t> global_writers;
  bool Failed() const { return !error.empty() || fault.what != nullptr; }
};

std::string Num(uint64_t v) { return std::to_string(v); }

std::string Hex(uint32_t v) {
  std::string out;
  do {
    out.insert(out.begin(), "0123456789abcdef"[v & 0xFu]);
    v >>= 4;
  } while (v != 0);
  return out;
}

// The shadow of the shared section, and the stamp of the interval between barriers running now.
// Launches run one at a time (RunGrid's lock), so these are the running launch's.
std::vector<ShadowByte> g_shadow;
uint32_t g_stamp = 0;
uint32_t g_block_serial = 0;

// This module's TLS block in the calling thread (where host_cuda.h's `__shared__` variables are):
// [start, stop), found once per thread after g_grid (also in it) has made the thread allocate it.
struct TlsBlock {
  uintptr_t start = 0;
  uintptr_t stop = 0;
  // This module's loaded image (its PT_LOAD segments): static data, such as the coverage
  // build's gcov counters, which every thread of a kernel increments. Not global memory.
  uintptr_t image_lo = 0;
  uintptr_t image_hi = 0;
};
thread_local TlsBlock g_tls;

int FindTls(dl_phdr_info* info, size_t, void* data) {
  const auto here = reinterpret_cast<uintptr_t>(&FindTls);
  bool mine = false;
  size_t tls_bytes = 0;
  uintptr_t image_lo = ~uintptr_t{0}, image_hi = 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr) & ph = info->dlpi_phdr[i];
    const uintptr_t lo = info->dlpi_addr + ph.p_vaddr;
    if (ph.p_type == PT_LOAD) {
      if (here >= lo && here < lo + ph.p_memsz) mine = true;
      image_lo = std::min(image_lo, lo);
      image_hi = std::max(image_hi, lo + ph.p_memsz);
    }
    if (ph.p_type == PT_TLS) tls_bytes = ph.p_memsz;
  }
  if (!mine || info->dlpi_tls_data == nullptr) return 0;
  auto* out = static_cast<TlsBlock*>(data);
  out->start = reinterpret_cast<uintptr_t>(info->dlpi_tls_data);
  out->stop = out->start + tls_bytes;
  out->image_lo = image_lo;
  out->image_hi = image_hi;
  return 1;
}

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
    if (!g.Failed()) g.error = std::string("exception in the kernel: ") + e.what();
  } catch (...) {
    if (!g.Failed()) g.error = "exception in the kernel";
  }
  g.current->state = State::kDone;
  __builtin_longjmp(g.to_scheduler, 1);  // the thread's stack is done with
}

// Switching between the scheduler and the threads: a thread starts with swapcontext (its own
// stack), and every switch after that is a __builtin_setjmp / __builtin_longjmp pair, which keeps
// the registers and stack only (swapcontext also saves and restores the signal mask, a system
// call each way: most of a barrier's cost when blocks have many short tiles).

// Back to the scheduler; returns when the scheduler runs this fiber again.
__attribute__((noinline)) void Yield() {
  Grid& g = Running();
  if (__builtin_setjmp(g.current->resume) == 0) __builtin_longjmp(g.to_scheduler, 1);
}

// Runs `f` until it yields or returns.
__attribute__((noinline)) void Resume(Grid& g, Fiber& f) {
  if (__builtin_setjmp(g.to_scheduler) == 0) {
    if (f.started) __builtin_longjmp(f.resume, 1);
    f.started = true;
    swapcontext(&g.scheduler, &f.ctx);
  }
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

// The wavefronts of one warp-wide shared-memory instruction: lanes in phases of 128 bytes of
// requests (32 lanes of up to 4 bytes, 16 of 8, 8 of 16); in each phase, the most distinct
// 4-byte words that fall in one of the 32 banks (lanes reading one word share it).
void CountWavefronts(const std::vector<LaneAccess>& lanes) {
  unsigned size = 1;
  for (const LaneAccess& a : lanes) size = std::max(size, a.size);
  const unsigned per_phase = size <= 4 ? 32 : 128 / size;
  int64_t waves = 0, ideal = 0;
  for (unsigned first = 0; first < 32; first += per_phase) {
    std::array<std::vector<uintptr_t>, 32> words;
    bool active = false;
    for (const LaneAccess& a : lanes) {
      if (a.lane < first || a.lane >= first + per_phase) continue;
      active = true;
      for (uintptr_t w = a.addr / 4; w <= (a.addr + a.size - 1) / 4; ++w) {
        auto& bank = words[w % 32];
        if (std::find(bank.begin(), bank.end(), w) == bank.end()) bank.push_back(w);
      }
    }
    if (!active) continue;
    size_t most = 0;
    for (const auto& bank : words) most = std::max(most, bank.size());
    waves += static_cast<int64_t>(most);
    ++ideal;
  }
  Stats& s = GetStats();
  ++s.shared_requests;
  s.shared_wavefronts += waves;
  s.shared_ideal += ideal;
}

// A barrier (or the block's end): the accesses so far become ordered before what follows.
void NewInterval(Grid& g) {
  ++g_stamp;
  for (const auto& [key, lanes] : g.sites) CountWavefronts(lanes);
  g.sites.clear();
  for (Fiber& f : g.fibers) f.occurrences.clear();
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
      std::string msg = "block " + Num(g.block) + ", warp " + Num(w) + ": " + Num(at_warp) +
                        " of " + Num(last - first) +
                        " lanes wait at a full-mask warp collective; the others:";
      for (unsigned t = first; t < last; ++t) {
        if (g.fibers[t].state != State::kWarp) {
          msg += " thread " + Num(t) + " " + Name(g.fibers[t].state) + ";";
        }
      }
      g.error = msg;
      return false;
    }
    const Fiber& lead = g.fibers[first];
    for (unsigned t = first; t < last; ++t) {
      const Fiber& f = g.fibers[t];
      if (f.op != lead.op || f.mask != 0xFFFFFFFFu) {
        g.error = "block " + Num(g.block) + ", warp " + Num(w) +
                  ": the lanes are at different warp collectives, or not with the full mask " +
                  "(thread " + Num(t) + ", mask 0x" + Hex(f.mask) + ")";
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
    NewInterval(g);
    ++GetStats().barriers;
    return true;
  }
  std::string msg = "block " + Num(g.block) + ": deadlock:";
  for (const Fiber& f : g.fibers) {
    if (f.state != State::kDone) msg += " thread " + Num(f.tid) + " at " + Name(f.state) + ";";
  }
  g.error = msg;
  return false;
}

bool RunBlock(Grid& g) {
  g.block_serial = ++g_block_serial;
  NewInterval(g);
  for (unsigned t = 0; t < g.threads; ++t) {
    Fiber& f = g.fibers[t];
    f.tid = t;
    f.state = State::kRunnable;
    f.started = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;  // Entry never returns
    makecontext(&f.ctx, Entry, 0);
  }
  const bool reverse = GetOptions().reverse;
  while (true) {
    for (unsigned i = 0; i < g.threads; ++i) {
      Fiber& f = g.fibers[reverse ? g.threads - 1 - i : i];
      if (f.state != State::kRunnable) continue;
      g.current = &f;
      Resume(g, f);
      g.current = nullptr;
      if (g.Failed()) return false;
    }
    bool done = true;
    for (const Fiber& f : g.fibers) done &= f.state == State::kDone;
    if (done) {
      NewInterval(g);
      return true;
    }
    if (!Release(g)) return false;
  }
}

}  // namespace

unsigned AtomicMax(unsigned* p, unsigned v) {
  const unsigned old = *p;
  if (v > old) *p = v;
  return old;
}

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
  s.shared_accesses = 0;
  s.shared_requests = 0;
  s.shared_wavefronts = 0;
  s.shared_ideal = 0;
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
  g.stacks.reset(new char[size_t{threads} * kStackBytes]);
  for (unsigned t = 0; t < threads; ++t) g.fibers[t].stack = g.stacks.get() + t * kStackBytes;
  g.warp_values.resize((threads + 31) / 32);
  g.banks = GetOptions().banks;
  pthread_attr_t attr;
  if (pthread_getattr_np(pthread_self(), &attr) == 0) {
    void* stack = nullptr;
    size_t bytes = 0;
    if (pthread_attr_getstack(&attr, &stack, &bytes) == 0) {
      g.launcher_lo = reinterpret_cast<uintptr_t>(stack);
      g.launcher_hi = g.launcher_lo + bytes;
    }
    pthread_attr_destroy(&attr);
  }
  g_grid = &g;
  if (g_tls.start == 0) dl_iterate_phdr(FindTls, &g_tls);
  if (g_shadow.size() != g_tls.stop - g_tls.start) g_shadow.assign(g_tls.stop - g_tls.start, {});
  Stats& stats = GetStats();
  ++stats.launches;
  const bool reverse = GetOptions().reverse;
  for (unsigned i = 0; i < grid && !g.Failed(); ++i) {
    g.block = reverse ? grid - 1 - i : i;
    ++stats.blocks;
    stats.threads += threads;
    RunBlock(g);
  }
  g_grid = nullptr;
  if (g.error.empty() && g.fault.what != nullptr) {
    const SharedFault& f = g.fault;
    const std::string other =
        f.other == ~0u ? std::string()
        : f.global     ? ", block " + Num(f.other / 1024) + " thread " + Num(f.other % 1024)
                       : ", thread " + Num(f.other);
    g.error = "block " + Num(f.block) + ": thread " + Num(f.tid) + " " + f.what +
              (f.global ? " (global address 0x" + Hex(f.offset) : " (byte " + Num(f.offset)) +
              (f.global ? std::string() : " of the shared variables") + other + ")";
  }
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

void SharedAccessError(Grid& g, const char* what, uintptr_t offset, unsigned other) {
  if (g.Failed()) return;
  g.fault = SharedFault{what, false, offset, g.block, g.current->tid, other};
}

// A kernel thread's load or store of `size` bytes of global memory at `addr` (neither shared
// memory, nor a thread's stack, nor this module's static data, nor the launching thread's stack):
// it must be aligned to its size (a GPU faults on a misaligned access), and no byte may be written
// by two threads of one launch (atomics excepted: they are host_cuda.cc's, uninstrumented).
void GlobalAccess(Grid& g, uintptr_t addr, unsigned size, bool write) {
  const auto stacks = reinterpret_cast<uintptr_t>(g.stacks.get());
  if (addr >= stacks && addr < stacks + size_t{g.threads} * kStackBytes) return;
  if (addr >= g_tls.image_lo && addr < g_tls.image_hi) return;  // the module's own statics
  if (addr >= g.launcher_lo && addr < g.launcher_hi) return;    // the kernel's parameters
  const unsigned tid = g.current->tid;
  if (addr % size != 0 && !g.Failed()) {
    g.fault = SharedFault{"makes a misaligned access to global memory", true, addr, g.block, tid};
  }
  if (!write) return;
  const uint64_t who = uint64_t{g.block} * 1024 + tid;
  for (uintptr_t b = addr; b < addr + size; ++b) {
    const auto [it, first] = g.global_writers.try_emplace(b, who);
    if (!first && it->second != who && !g.Failed()) {
      g.fault = SharedFault{"writes a global byte that another thread of the launch wrote",
                            true,
                            b,
                            g.block,
                            tid,
                            static_cast<unsigned>(it->second)};
    }
  }
}

// A load or store of `size` bytes at `p` by the running thread, from the access site `pc`.
void SharedAccess(const void* p, unsigned size, bool write, uintptr_t pc) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  Grid* gp = g_grid;
  if (gp == nullptr || gp->current == nullptr) return;
  Grid& g = *gp;
  const uintptr_t start = g_tls.start;
  const uintptr_t stop = g_tls.stop;
  if (addr < start || addr >= stop) {
    GlobalAccess(g, addr, size, write);
    return;
  }
  const auto tid = static_cast<int16_t>(g.current->tid);
  ++GetStats().shared_accesses;
  for (uintptr_t b = addr; b < addr + size && b < stop; ++b) {
    ShadowByte& s = g_shadow[b - start];
    if (write) {
      if (s.written == g_stamp && s.writer != tid) {
        SharedAccessError(g,
                          "writes a shared byte that another thread wrote since the last "
                          "__syncthreads",
                          b - start, static_cast<unsigned>(s.writer));
      } else if (s.read == g_stamp && s.reader != tid) {
        SharedAccessError(g,
                          "writes a shared byte that another thread read since the last "
                          "__syncthreads",
                          b - start,
                          s.reader == kManyReaders ? ~0u : static_cast<unsigned>(s.reader));
      }
      s.written = g_stamp;
      s.writer = tid;
      if (s.block != g.block_serial) s.block = g.block_serial;
    } else {
      if (s.block != g.block_serial) {
        SharedAccessError(g, "reads a shared byte that no thread of the block has written",
                          b - start, ~0u);
      } else if (s.written == g_stamp && s.writer != tid) {
        SharedAccessError(g,
                          "reads a shared byte that another thread wrote since the last "
                          "__syncthreads",
                          b - start, static_cast<unsigned>(s.writer));
      }
      if (s.read != g_stamp) {
        s.read = g_stamp;
        s.reader = tid;
      } else if (s.reader != tid) {
        s.reader = kManyReaders;
      }
    }
  }
  if (g.banks) {
    const uint32_t occ = g.current->occurrences[pc]++;
    g.sites[SiteKey{g.current->tid / 32, pc, occ}].push_back(
        LaneAccess{g.current->tid % 32, addr, size});
  }
}

}  // namespace fp8jax::host_cuda

// ---- The loads and stores of the kernels' translation units (compiled with -fsanitize=thread,
// linked without its runtime: these are the instrumentation's callbacks) ----

#define FP8JAX_TSAN_ACCESS_(name, size, write)                                                 \
  extern "C" __attribute__((visibility("hidden"))) void name(void* p) {                        \
    fp8jax::host_cuda::SharedAccess(p, size, write,                                            \
                                    reinterpret_cast<uintptr_t>(__builtin_return_address(0))); \
  }
FP8JAX_TSAN_ACCESS_(__tsan_read1, 1, false)
FP8JAX_TSAN_ACCESS_(__tsan_read2, 2, false)
FP8JAX_TSAN_ACCESS_(__tsan_read4, 4, false)
FP8JAX_TSAN_ACCESS_(__tsan_read8, 8, false)
FP8JAX_TSAN_ACCESS_(__tsan_read16, 16, false)
FP8JAX_TSAN_ACCESS_(__tsan_write1, 1, true)
FP8JAX_TSAN_ACCESS_(__tsan_write2, 2, true)
FP8JAX_TSAN_ACCESS_(__tsan_write4, 4, true)
FP8JAX_TSAN_ACCESS_(__tsan_write8, 8, true)
FP8JAX_TSAN_ACCESS_(__tsan_write16, 16, true)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_read2, 2, false)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_read4, 4, false)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_read8, 8, false)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_read16, 16, false)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_write2, 2, true)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_write4, 4, true)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_write8, 8, true)
FP8JAX_TSAN_ACCESS_(__tsan_unaligned_write16, 16, true)
#undef FP8JAX_TSAN_ACCESS_

extern "C" __attribute__((visibility("hidden"))) void __tsan_read_range(void* p, unsigned long n) {
  for (unsigned long i = 0; i < n; ++i) {
    fp8jax::host_cuda::SharedAccess(static_cast<char*>(p) + i, 1, false,
                                    reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
  }
}
extern "C" __attribute__((visibility("hidden"))) void __tsan_write_range(void* p, unsigned long n) {
  for (unsigned long i = 0; i < n; ++i) {
    fp8jax::host_cuda::SharedAccess(static_cast<char*>(p) + i, 1, true,
                                    reinterpret_cast<uintptr_t>(__builtin_return_address(0)));
  }
}
extern "C" __attribute__((visibility("hidden"))) void __tsan_init() {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_vptr_update(void**, void*) {}
// The handlers' atomics (std::once_flag and the like), carried out as they are written.
extern "C" __attribute__((visibility("hidden"))) char __tsan_atomic8_load(const volatile char* p,
                                                                          int) {
  return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_entry(void*) {}
extern "C" __attribute__((visibility("hidden"))) void __tsan_func_exit() {}
