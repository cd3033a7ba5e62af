// The CPU computations of quantize, dequantize (ops/casts.h) and update_fp8_state
// (ops/scaling.h); the cast_transpose family is in cpu_cast_transpose.cc and cpu_activation.cc.
//
// Layering (as in jax's examples/ffi): a typed compute loop, then the op's Compute, which
// dispatches on the runtime dtypes and returns ffi::Error for anything unexpected (the op's
// handler has checked the arguments).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/wide.h"
#include "cpu/cpu_cast_transpose.h"
#include "cpu/cpu_handler.h"
#include "cpu/cpu_loops.h"
#include "cpu/cpu_parallel.h"
#include "ops/casts.h"
#include "ops/scaling.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

// Calls seg(g, begin, end) for each run of [begin, end) that lies in one group
// of `per_group` consecutive elements.
template <typename Seg>
inline void ForEachGroupSegment(int64_t begin, int64_t end, int64_t per_group, const Seg& seg) {
  while (begin < end) {
    const int64_t g = begin / per_group;
    const int64_t stop = std::min(end, (g + 1) * per_group);
    seg(g, begin, stop);
    begin = stop;
  }
}

// ---------------------------------------------------------------- quantize

template <WideKind W, typename F>
void QuantizeCompute(ffi::ThreadPool* pool, const void* x, const float* scale, uint8_t* q,
                     float* scale_inv, float* amax, GroupShape s) {
  std::unique_ptr<std::atomic<uint32_t>[]> amax_bits(new std::atomic<uint32_t>[s.groups]());
  ParallelFor(pool, s.groups * s.per_group, kGrain, [&](int64_t begin, int64_t end) {
    ForEachGroupSegment(begin, end, s.per_group, [&](int64_t g, int64_t b, int64_t e) {
      uint32_t local = 0;
      loops::QuantizeRange<W, F>(x, scale[g], q, b, e, &local);
      AtomicMaxBits(amax_bits[g], local);
    });
  });
  for (int64_t g = 0; g < s.groups; ++g) {
    amax[g] = BitsToFloat(amax_bits[g].load(std::memory_order_relaxed));
    scale_inv[g] = ScaleInverse(scale[g]);
  }
}

}  // namespace

ffi::Error Quantize::Compute(CpuPool pool) {
  return DispatchWideFp8("quantize", WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
                         [&]<WideKind W, typename F>() {
                           QuantizeCompute<W, F>(&pool, x.untyped_data(), scale.typed_data(),
                                                 static_cast<uint8_t*>(q->untyped_data()),
                                                 scale_inv->typed_data(), amax->typed_data(), s);
                           return ffi::Error::Success();
                         });
}

namespace {

// -------------------------------------------------------------- dequantize

// Below this many elements of one group a 256-entry table costs more than it saves.
constexpr int64_t kMinTableRun = 1024;

// The output-dtype bits of DequantizeValue<F>(code, si) for every code.
template <WideKind W, typename F>
void DequantizeTable(float si, uint32_t* table) {
  for (int c = 0; c < 256; ++c) {
    const float v = DequantizeValue<F>(static_cast<uint8_t>(c), si);
    if constexpr (W == WideKind::kF32) {
      table[c] = FloatBits(v);
    } else if constexpr (W == WideKind::kBF16) {
      table[c] = FloatToBf16Bits(v);
    } else {
      table[c] = FloatToF16Bits(v);
    }
  }
}

template <WideKind W, typename F>
void DequantizeCompute(ffi::ThreadPool* pool, const uint8_t* q, const float* scale_inv, void* out,
                       GroupShape s) {
  ParallelFor(pool, s.groups * s.per_group, kGrain, [&](int64_t begin, int64_t end) {
    ForEachGroupSegment(begin, end, s.per_group, [&](int64_t g, int64_t b, int64_t e) {
      const float si = scale_inv[g];
      if (e - b < kMinTableRun) {
        for (int64_t i = b; i < e; ++i) StoreWide<W>(out, i, DequantizeValue<F>(q[i], si));
        return;
      }
      uint32_t table[256];
      DequantizeTable<W, F>(si, table);
      loops::TableRange<W>(q, table, out, b, e);
    });
  });
}

}  // namespace

ffi::Error Dequantize::Compute(CpuPool pool) {
  return DispatchWideFp8("dequantize", WideKindOf(out->element_type()), Fp8KindOf(q.element_type()),
                         [&]<WideKind W, typename F>() {
                           DequantizeCompute<W, F>(&pool,
                                                   static_cast<const uint8_t*>(q.untyped_data()),
                                                   scale_inv.typed_data(), out->untyped_data(), s);
                           return ffi::Error::Success();
                         });
}

// -------------------------------------------------------- update_fp8_state

ffi::Error UpdateFp8State::Compute(CpuPool) {
  const float margin_factor = std::ldexp(1.0f, -static_cast<int>(margin));
  const float* h = history.typed_data();
  float* nh = new_history->typed_data();
  for (int64_t r = 0; r < s.rows; ++r) {
    const float* hr = h + r * s.len;
    float* nr = nh + r * s.len;
    const float a = amax.typed_data()[r];
    if (!RecordsObservation(a)) {  // NaN or +-inf: the row stays exactly as it was
      std::copy(hr, hr + s.len, nr);
      new_scale->typed_data()[r] = scale.typed_data()[r];
      continue;
    }
    nr[0] = a;
    float red = a;
    for (int64_t i = 1; i < s.len; ++i) {
      nr[i] = hr[i - 1];
      if (algo == 0) red = NanMax(red, nr[i]);
    }
    new_scale->typed_data()[r] =
        ComputeScale(red, scale.typed_data()[r], fp8_max.typed_data()[r], margin_factor);
  }
  return ffi::Error::Success();
}

}  // namespace fp8jax
