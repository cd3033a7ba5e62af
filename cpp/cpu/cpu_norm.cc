// The CPU computations of the norms' forwards (ops/norms.h): LayerNorm / RMSNorm forward and the
// forward fused with the FP8 cast and transpose (the backward is cpu_norm_backward.cc).
//
// One row per work item, rows split over XLA's intra-op pool (ParallelFor).
// A row is widened to float32 once, into a scratch row that stays in L1/L2,
// and the passes of the two-pass mean/variance and the output pass read that
// scratch row; the per-element and per-row arithmetic is common/norm_row.h's
// (shared with the CUDA kernels). The row sums use NormLanes (16 lanes,
// combined pairwise), which the compiler vectorises without reassociating.
//
// The FP8 form rounds y to x's dtype into a scratch row and quantizes that
// with loops::QuantizeRange, the quantize kernel's own loop, so q and amax are
// bit-identical to quantize(norm_forward(x)); strips of 64 rows are then
// transposed from q, still in cache, into q_t (as in cast_transpose).
//
// The backward's dgamma/dbeta: every block of kNormRowsPerPartial rows (of one
// vmap group) writes its own partial row into a workspace, rows added in
// order; a second pass adds the partials of each column in block order. The
// order depends only on the shapes, so the bits do not depend on the threads.
//
// Shapes: x is [groups * rows, h] in memory (vmap's groups in front); gamma,
// beta are [groups, h]; the FP8 scale has one value per group.
#include "cpu/cpu_norm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/norm_row.h"
#include "cpu/cpu_handler.h"
#include "cpu/cpu_loops.h"
#include "cpu/cpu_parallel.h"
#include "cpu/cpu_transpose.h"
#include "ops/norms.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr int64_t kNormGrain = int64_t{1} << 15;  // elements per chunk of work (norm rows)
constexpr int64_t kStripRows = 64;                // rows per transpose strip (FP8 form)

// Element i of a float32/bf16/f16 buffer as float, whatever its runtime dtype
// (for the small gamma/beta vectors).
float LoadAny(const ffi::AnyBuffer& b, int64_t i) {
  switch (WideKindOf(b.element_type())) {
    case WideKind::kF32:
      return static_cast<const float*>(b.untyped_data())[i];
    case WideKind::kBF16:
      return Bf16BitsToFloat(static_cast<const uint16_t*>(b.untyped_data())[i]);
    default:
      return F16BitsToFloat(static_cast<const uint16_t*>(b.untyped_data())[i]);
  }
}

// gamma (as the scale applied: NormGamma) and beta (zeros when absent) of
// every group, in float32.
struct Params {
  std::vector<float> g, b;
};

Params ParamsOf(const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, bool zero_centered) {
  const int64_t n = gamma.element_count();
  Params p;
  p.g.resize(n);
  p.b.assign(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) p.g[i] = NormGamma(LoadAny(gamma, i), zero_centered);
  if (beta != nullptr) {
    for (int64_t i = 0; i < n; ++i) p.b[i] = LoadAny(*beta, i);
  }
  return p;
}

template <WideKind W>
FP8JAX_INLINE void StoreW(void* p, int64_t i, float v) {
  if constexpr (W == WideKind::kF32) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (W == WideKind::kBF16) {
    static_cast<uint16_t*>(p)[i] = FloatToBf16Bits(v);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToF16Bits(v);
  }
}

// ----------------------------------------------------------------- row loops

template <WideKind W>
FP8JAX_INLINE void WidenRow(const void* x, int64_t off, int64_t h, float* out) {
  for (int64_t i = 0; i < h; ++i) out[i] = BitsToFloat(loops::LoadBits<W>(x, off + i));
}

// Row `off` of x as float32: x itself when it is float32, else widened into
// `scratch`.
template <WideKind W>
FP8JAX_INLINE const float* RowF32(const void* x, int64_t off, int64_t h, float* scratch) {
  if constexpr (W == WideKind::kF32) {
    return static_cast<const float*>(x) + off;
  } else {
    WidenRow<W>(x, off, h, scratch);
    return scratch;
  }
}

// sum over i of f(i), in NormLanes order.
template <typename F>
FP8JAX_INLINE float LaneSum(int64_t h, const F& f) {
  NormLanes s;
  int64_t i = 0;
  for (; i + kNormLanes <= h; i += kNormLanes) {
    for (int j = 0; j < kNormLanes; ++j) s.v[j] += f(i + j);
  }
  for (int j = 0; i < h; ++i, ++j) s.v[j] += f(i);
  return s.Total();
}

// One row: xr (float32) -> y (x's dtype, at element y_off of y), mu, rsigma.
template <WideKind W, bool kLayer>
FP8JAX_INLINE void NormRow(const float* xr, int64_t h, const float* g, const float* b, float eps,
                           void* y, int64_t y_off, float* mu_out, float* rs_out) {
  float mu = 0.0f;
  if constexpr (kLayer) mu = RowMean(LaneSum(h, [&](int64_t i) { return xr[i]; }), h);
  const float sq = LaneSum(h, [&](int64_t i) {
    const float d = NormCentred(xr[i], mu);
    return d * d;
  });
  const float rs = RowRsigma(sq, h, eps);
  for (int64_t i = 0; i < h; ++i) {
    StoreW<W>(y, y_off + i, NormOut<kLayer>(xr[i], mu, rs, g[i], b[i]));
  }
  *mu_out = mu;
  *rs_out = rs;
}

// The forward over rows [r0, r1) of a [groups * rows, h] x.
struct FwdArgs {
  const void* x;
  const float* g;  // [groups, h]
  const float* b;  // [groups, h]
  float eps;
  int64_t rows;  // per group
  int64_t h;
  void* y;
  float* mu;
  float* rs;
};

template <WideKind W, bool kLayer>
FP8JAX_INLINE void ForwardRowsBody(const FwdArgs& a, int64_t r0, int64_t r1, float* scratch) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t grp = r / a.rows;
    const float* xr = RowF32<W>(a.x, r * a.h, a.h, scratch);
    NormRow<W, kLayer>(xr, a.h, a.g + grp * a.h, a.b + grp * a.h, a.eps, a.y, r * a.h, a.mu + r,
                       a.rs + r);
  }
}

// The FP8 form over one strip [r0, r1) of one group's matrix: y rows into
// ybuf (x's dtype), quantized into q; then the strip transposed into q_t.
struct Fp8Args {
  FwdArgs f;
  float scale;
  uint8_t* q;   // this group's [rows, h]
  uint8_t* qt;  // this group's [h, rows]
};

template <WideKind W, typename F, bool kLayer>
FP8JAX_INLINE uint32_t Fp8StripBody(const Fp8Args& a, int64_t grp, int64_t r0, int64_t r1,
                                    float* scratch, void* ybuf) {
  const FwdArgs& f = a.f;
  uint32_t amax = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row = grp * f.rows + r;
    const float* xr = RowF32<W>(f.x, row * f.h, f.h, scratch);
    NormRow<W, kLayer>(xr, f.h, f.g + grp * f.h, f.b + grp * f.h, f.eps, ybuf, 0, f.mu + row,
                       f.rs + row);
    loops::QuantizeRange<W, F>(ybuf, a.scale, a.q + r * f.h, 0, f.h, &amax);
  }
  TransposeRows(a.q, a.qt, f.rows, f.h, r0, r1);
  return amax;
}

// Instantiated for the baseline ISA and for AVX2 (no FMA: nothing is fused).
template <WideKind W, bool kLayer>
void ForwardRowsBase(const FwdArgs& a, int64_t r0, int64_t r1, float* s) {
  ForwardRowsBody<W, kLayer>(a, r0, r1, s);
}
template <WideKind W, typename F, bool kLayer>
uint32_t Fp8StripBase(const Fp8Args& a, int64_t g, int64_t r0, int64_t r1, float* s, void* yb) {
  return Fp8StripBody<W, F, kLayer>(a, g, r0, r1, s, yb);
}
#if defined(FP8JAX_MULTIVERSION)
template <WideKind W, bool kLayer>
FP8JAX_AVX2 void ForwardRowsAvx2(const FwdArgs& a, int64_t r0, int64_t r1, float* s) {
  ForwardRowsBody<W, kLayer>(a, r0, r1, s);
}
template <WideKind W, typename F, bool kLayer>
FP8JAX_AVX2 uint32_t Fp8StripAvx2(const Fp8Args& a, int64_t g, int64_t r0, int64_t r1, float* s,
                                  void* yb) {
  return Fp8StripBody<W, F, kLayer>(a, g, r0, r1, s, yb);
}
#endif

template <WideKind W, bool kLayer>
void ForwardRows(const FwdArgs& a, int64_t r0, int64_t r1, float* s) {
#if defined(FP8JAX_MULTIVERSION)
  if (loops::HasAvx2()) return ForwardRowsAvx2<W, kLayer>(a, r0, r1, s);
#endif
  ForwardRowsBase<W, kLayer>(a, r0, r1, s);
}

template <WideKind W, typename F, bool kLayer>
uint32_t Fp8Strip(const Fp8Args& a, int64_t g, int64_t r0, int64_t r1, float* s, void* yb) {
#if defined(FP8JAX_MULTIVERSION)
  if (loops::HasAvx2()) return Fp8StripAvx2<W, F, kLayer>(a, g, r0, r1, s, yb);
#endif
  return Fp8StripBase<W, F, kLayer>(a, g, r0, r1, s, yb);
}

// ------------------------------------------------------------------ forward

}  // namespace

void NormForwardInto(ffi::ThreadPool* pool, bool layer, const ffi::AnyBuffer& x,
                     const ffi::AnyBuffer& gamma, const ffi::AnyBuffer* beta, float eps,
                     bool zero_centered, const NormShape& s, void* y, float* mu, float* rs) {
  const Params p = ParamsOf(gamma, beta, zero_centered);
  const FwdArgs a{x.untyped_data(), p.g.data(), p.b.data(), eps, s.rows, s.h, y, mu, rs};
  const int64_t grain = std::max<int64_t>(1, kNormGrain / s.h);
  DispatchWide("norm_forward", WideKindOf(x.element_type()), [&]<WideKind W>() {
    ParallelFor(pool, s.groups * s.rows, grain, [&](int64_t r0, int64_t r1) {
      std::vector<float> scratch(s.h);
      if (layer) {
        ForwardRows<W, true>(a, r0, r1, scratch.data());
      } else {
        ForwardRows<W, false>(a, r0, r1, scratch.data());
      }
    });
    return ffi::Error::Success();
  });
}

ffi::Error NormForward::Compute(CpuPool pool) {
  NormForwardInto(&pool, layer, x, gamma, beta, eps, zero_centered != 0, s, y->untyped_data(),
                  mu->typed_data(), rs->typed_data());
  return ffi::Error::Success();
}

// ------------------------------------------------------------ forward, FP8

ffi::Error NormForwardFp8::Compute(CpuPool pool) {
  const Params p = ParamsOf(gamma, beta, zero_centered != 0);
  const FwdArgs f{x.untyped_data(), p.g.data(),       p.b.data(),      eps, s.rows, s.h,
                  nullptr,          mu->typed_data(), rs->typed_data()};
  uint8_t* q8 = static_cast<uint8_t*>(q->untyped_data());
  uint8_t* qt8 = static_cast<uint8_t*>(qt->untyped_data());
  const float* sc = scale.typed_data();
  const int64_t strips = (s.rows + kStripRows - 1) / kStripRows;
  std::unique_ptr<std::atomic<uint32_t>[]> amax_bits(new std::atomic<uint32_t>[s.groups]());
  const int64_t grain = std::max<int64_t>(1, kNormGrain / std::max<int64_t>(1, kStripRows * s.h));
  const int64_t wide_bytes = WideKindOf(x.element_type()) == WideKind::kF32 ? 4 : 2;
  auto err = DispatchWideFp8(
      op, WideKindOf(x.element_type()), Fp8KindOf(q->element_type()),
      [&]<WideKind W, typename F>() {
        ParallelFor(&pool, s.groups * strips, grain, [&](int64_t begin, int64_t end) {
          std::vector<float> scratch(s.h);
          std::vector<uint8_t> ybuf(s.h * wide_bytes);
          for (int64_t item = begin; item < end; ++item) {
            const int64_t grp = item / strips;
            const int64_t r0 = (item % strips) * kStripRows;
            const int64_t r1 = std::min(s.rows, r0 + kStripRows);
            const Fp8Args a{f, sc[grp], q8 + grp * s.rows * s.h, qt8 + grp * s.rows * s.h};
            const uint32_t m =
                layer ? Fp8Strip<W, F, true>(a, grp, r0, r1, scratch.data(), ybuf.data())
                      : Fp8Strip<W, F, false>(a, grp, r0, r1, scratch.data(), ybuf.data());
            uint32_t cur = amax_bits[grp].load(std::memory_order_relaxed);
            while (m > cur && !amax_bits[grp].compare_exchange_weak(cur, m)) {
            }
          }
        });
        return ffi::Error::Success();
      });
  if (!err.success()) return err;
  for (int64_t g = 0; g < s.groups; ++g) {
    amax->typed_data()[g] = BitsToFloat(amax_bits[g].load(std::memory_order_relaxed));
    scale_inv->typed_data()[g] = ScaleInverse(sc[g]);
  }
  return ffi::Error::Success();
}

}  // namespace fp8jax
