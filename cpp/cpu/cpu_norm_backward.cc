// The CPU computation of the norms' backward, norm_backward (ops/norms.h; LayerNorm and RMSNorm).
//
// Rows are split into at most `slots` blocks of NormRowsPerPartial rows
// (common/norm_row.h) per vmap group; the blocks are the work items spread
// over XLA's intra-op pool, each with its own partial rows in the workspace
// (an output of the custom call, [groups, slots, 2, h]).
// For each row of its block an item widens dy and x to float32 scratch rows,
// sums dz = dy * g and dz * xhat in NormLanes order, writes dx, and adds
// dy * xhat and dy into its own partial dgamma/dbeta rows (rows in order).
// A second pass adds each column's partials in block order. Nothing depends
// on how many threads run the items, so dgamma and dbeta are deterministic.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/norm_row.h"
#include "cpu/cpu_handler.h"
#include "cpu/cpu_loops.h"
#include "cpu/cpu_parallel.h"
#include "ops/norms.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {
namespace {

constexpr int64_t kBackwardGrain = int64_t{1} << 15;  // elements per chunk of work
constexpr int64_t kMinRowsPerPartial = 16;            // rows summed into one partial row, at least

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

struct BwdArgs {
  const void* dy;
  const void* x;
  const float* mu;
  const float* rs;
  const float* g;  // [groups, h], NormGamma applied
  int64_t rows;    // per group
  int64_t h;
  int64_t per;       // rows per block
  int64_t partials;  // blocks per group
  int64_t slots;     // workspace rows per group
  void* dx;
  float* ws;  // [groups, slots, 2, h]
};

// One block of rows: dx, and this block's partial dgamma (ws row 0) and dbeta
// (ws row 1).
template <WideKind W, bool kLayer>
FP8JAX_INLINE void BackwardBlockBody(const BwdArgs& a, int64_t item, float* x_scratch,
                                     float* dy_scratch) {
  const int64_t grp = item / a.partials;
  const int64_t r0 = (item % a.partials) * a.per;
  const int64_t r1 = std::min(a.rows, r0 + a.per);
  const float* g = a.g + grp * a.h;
  float* dg = a.ws + (grp * a.slots + item % a.partials) * 2 * a.h;
  float* db = dg + a.h;
  std::fill(dg, dg + 2 * a.h, 0.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row = grp * a.rows + r;
    const int64_t off = row * a.h;
    const float* xr = static_cast<const float*>(a.x) + off;  // float32: read in place
    const float* dyr = static_cast<const float*>(a.dy) + off;
    if constexpr (W != WideKind::kF32) {
      for (int64_t i = 0; i < a.h; ++i) {
        x_scratch[i] = BitsToFloat(loops::LoadBits<W>(a.x, off + i));
        dy_scratch[i] = BitsToFloat(loops::LoadBits<W>(a.dy, off + i));
      }
      xr = x_scratch;
      dyr = dy_scratch;
    }
    const float mu = kLayer ? a.mu[row] : 0.0f;
    const float rs = a.rs[row];
    float c1 = 0.0f;
    if constexpr (kLayer) c1 = RowMean(LaneSum(a.h, [&](int64_t i) { return dyr[i] * g[i]; }), a.h);
    const float c2 = RowMean(
        LaneSum(a.h, [&](int64_t i) { return (dyr[i] * g[i]) * NormXhat(xr[i], mu, rs); }), a.h);
    for (int64_t i = 0; i < a.h; ++i) {
      const float xhat = NormXhat(xr[i], mu, rs);
      StoreW<W>(a.dx, off + i, NormDx(dyr[i] * g[i], xhat, rs, c1, c2));
      dg[i] += dyr[i] * xhat;
      if constexpr (kLayer) db[i] += dyr[i];
    }
  }
}

template <WideKind W, bool kLayer>
void BackwardBlockBase(const BwdArgs& a, int64_t item, float* xr, float* dyr) {
  BackwardBlockBody<W, kLayer>(a, item, xr, dyr);
}
#if defined(FP8JAX_MULTIVERSION)
template <WideKind W, bool kLayer>
FP8JAX_AVX2 void BackwardBlockAvx2(const BwdArgs& a, int64_t item, float* xr, float* dyr) {
  BackwardBlockBody<W, kLayer>(a, item, xr, dyr);
}
#endif

template <WideKind W, bool kLayer>
void BackwardBlock(const BwdArgs& a, int64_t item, float* xr, float* dyr) {
#if defined(FP8JAX_MULTIVERSION)
  if (loops::HasAvx2()) return BackwardBlockAvx2<W, kLayer>(a, item, xr, dyr);
#endif
  BackwardBlockBase<W, kLayer>(a, item, xr, dyr);
}

}  // namespace

ffi::Error NormBackward::Compute(CpuPool pool) {
  std::vector<float> g(gamma.element_count());
  for (size_t i = 0; i < g.size(); ++i) g[i] = NormGamma(LoadAny(gamma, i), zero_centered != 0);
  const int64_t slots = ws_slots;
  const int64_t per = NormRowsPerPartial(s.rows, slots, kMinRowsPerPartial);
  const int64_t partials = NormPartials(s.rows, slots, kMinRowsPerPartial);
  float* ws = workspace->typed_data();
  const BwdArgs a{dy.untyped_data(),
                  x.untyped_data(),
                  mu.typed_data(),
                  rs.typed_data(),
                  g.data(),
                  s.rows,
                  s.h,
                  per,
                  partials,
                  slots,
                  dx->untyped_data(),
                  ws};
  const bool layer = norm_type == static_cast<int64_t>(NormType::kLayerNorm);
  const int64_t items = s.groups * partials;
  const int64_t grain = std::max<int64_t>(1, kBackwardGrain / (per * s.h));
  auto err = DispatchWide(kName, WideKindOf(x.element_type()), [&]<WideKind W>() {
    ParallelFor(&pool, items, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> xr(s.h), dyr(s.h);
      for (int64_t item = begin; item < end; ++item) {
        if (layer) {
          BackwardBlock<W, true>(a, item, xr.data(), dyr.data());
        } else {
          BackwardBlock<W, false>(a, item, xr.data(), dyr.data());
        }
      }
    });
    return ffi::Error::Success();
  });
  if (!err.success()) return err;
  // Second pass: each column's partials added in block order.
  float* dg = dgamma->typed_data();
  float* db = dbeta->typed_data();
  const int64_t cols = s.groups * s.h;
  ParallelFor(&pool, cols, std::max<int64_t>(1, kBackwardGrain / std::max<int64_t>(1, partials)),
              [&](int64_t c0, int64_t c1) {
                while (c0 < c1) {  // one group's columns at a time
                  const int64_t grp = c0 / s.h;
                  const int64_t stop = std::min(c1, (grp + 1) * s.h);
                  const float* base = ws + grp * slots * 2 * s.h - grp * s.h;
                  std::fill(dg + c0, dg + stop, 0.0f);
                  std::fill(db + c0, db + stop, 0.0f);
                  for (int64_t p = 0; p < partials; ++p) {
                    const float* wg = base + p * 2 * s.h;
                    for (int64_t c = c0; c < stop; ++c) dg[c] += wg[c];
                    for (int64_t c = c0; c < stop; ++c) db[c] += wg[c + s.h];
                  }
                  for (int64_t c = c0; c < stop; ++c) {
                    dg[c] = CanonicalNan(dg[c]);
                    db[c] = CanonicalNan(db[c]);
                  }
                  c0 = stop;
                }
              });
  return ffi::Error::Success();
}

}  // namespace fp8jax
