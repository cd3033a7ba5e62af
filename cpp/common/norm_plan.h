// Launch planning and index math of the CUDA norm kernels, as plain functions
// (compiled into the CPU extension too, and checked by tests/ops/test_norm_plan.py
// on a machine with no GPU; see common/launch_plan.h for the pattern).
//
// A row of h elements is handled by a *row group* of threads_per_row threads
// (a warp for short rows, up to 16 warps for long ones), rows_per_cta groups
// per block. The row is cut into chunks of `vec` = 16 / elem_bytes elements:
// one 16-byte access each when every row starts 16-byte aligned (`vector`),
// else element by element, the last chunk of a row then partial (the scalar
// tail). Thread t owns chunks t, t + tpr, t + 2 tpr, ... of every row it works
// on, so its share of a column sum (dgamma, dbeta) stays in its registers.
#pragma once

#include <cstdint>

#include "common/launch_plan.h"

namespace fp8jax::plan {

constexpr int kNormMinThreads = 128;     // threads per block at least
constexpr int kNormMaxRowThreads = 512;  // threads per row group at most
constexpr int kNormTargetChunks = 4;     // chunks per thread a plan aims for
constexpr int kNormMaxThreadElems = 16;  // backward: column-sum registers per thread
constexpr int kNormTransposeTile = 64;   // q -> q_t byte-transpose tile edge
constexpr int kNormTransposeThreads = 256;

struct NormPlan {
  int vec = 8;          // elements per chunk: 16 bytes of the wide dtype
  bool vector = false;  // one 16-byte access per chunk (else element by element)
  int threads_per_row = 32;
  int threads = kNormMinThreads;  // per block
  int rows_per_cta = 1;
  int64_t chunks = 0;  // per row
  int chunks_per_thread = 0;
  int64_t grid = 1;         // blocks
  int64_t slots = 1;        // row groups in the grid (grid * rows_per_cta)
  bool backward_ok = true;  // the backward's registers suffice (elements per thread <= 16)
};

// rows: rows of the whole call (all vmap groups) for the forward, rows per
// group for the backward. aligned: every row of every wide buffer (and of q)
// starts 16-byte aligned, i.e. h * elem_bytes % 16 == 0 and the base pointers
// are. resident: blocks the device runs at once (forward); max_slots: the
// backward's workspace rows (0 for the forward), which bound the grid so that
// the backward's partial sums do not depend on the device.
FP8JAX_PLAN_HD NormPlan PlanNorm(int64_t rows, int64_t h, int elem_bytes, bool aligned,
                                 int64_t resident, int64_t max_slots) {
  NormPlan p;
  p.vec = 16 / elem_bytes;
  p.vector = aligned;
  p.chunks = CeilDiv(h, p.vec);
  // The backward keeps every chunk's column sums in registers: fewer chunks.
  int target = kNormTargetChunks;
  if (max_slots > 0) target = kNormMaxThreadElems / p.vec > 0 ? kNormMaxThreadElems / p.vec : 1;
  int tpr = 32;
  while (tpr < kNormMaxRowThreads && p.chunks > int64_t{tpr} * target) tpr *= 2;
  p.threads_per_row = tpr;
  p.threads = tpr > kNormMinThreads ? tpr : kNormMinThreads;
  p.rows_per_cta = p.threads / tpr;
  p.chunks_per_thread = static_cast<int>(CeilDiv(p.chunks, tpr));
  p.backward_ok = int64_t{p.chunks_per_thread} * p.vec <= kNormMaxThreadElems;
  const int64_t needed = CeilDiv(rows > 0 ? rows : 1, p.rows_per_cta);
  int64_t cap = resident > 0 ? resident : 1;
  if (max_slots > 0) {
    cap = max_slots / p.rows_per_cta;
    if (cap < 1) cap = 1;
  }
  p.grid = Clamp(needed < cap ? needed : cap, 1, kMaxGridX);
  p.slots = p.grid * p.rows_per_cta;
  return p;
}

// The backward's partial rows fit a workspace of ws_slots rows per group. A plan's blocks hold
// rows_per_cta row groups each, so a workspace of fewer rows than that (possible only for a direct
// FFI call; fp8jax passes at least 256) gets more slots than it has: the handler refuses
// it.
FP8JAX_PLAN_HD bool NormWorkspaceFits(const NormPlan& p, int64_t ws_slots) {
  return p.slots <= ws_slots;
}

// The first element of chunk k of thread t (of its row group); the chunk is
// valid when k * tpr + t < chunks, and holds NormChunkCount elements.
FP8JAX_PLAN_HD int64_t NormChunkStart(const NormPlan& p, int t, int k) {
  return (int64_t{k} * p.threads_per_row + t) * p.vec;
}

FP8JAX_PLAN_HD int NormChunkCount(const NormPlan& p, int64_t h, int64_t start) {
  return h - start < p.vec ? static_cast<int>(h - start) : p.vec;
}

FP8JAX_PLAN_HD bool NormChunkValid(const NormPlan& p, int t, int k) {
  return int64_t{k} * p.threads_per_row + t < p.chunks;
}

// Forward: the row that row group `grp` of block `cta` works on in its
// iteration `it` (rows >= the total are idle; every group of a block runs
// the same iterations, since the kernel synchronises the block per row).
FP8JAX_PLAN_HD int64_t NormForwardRow(const NormPlan& p, int64_t cta, int grp, int64_t it) {
  return (it * p.grid + cta) * p.rows_per_cta + grp;
}

// Iterations of a block: while its first group still has a row.
FP8JAX_PLAN_HD int64_t NormIterations(const NormPlan& p, int64_t rows) {
  return CeilDiv(rows, p.slots);
}

// Backward: the slot of row group `grp` of block `cta`; it sums rows slot,
// slot + slots, ... of each group, in that order, into its partial row.
FP8JAX_PLAN_HD int64_t NormSlot(const NormPlan& p, int64_t cta, int grp) {
  return cta * p.rows_per_cta + grp;
}

// The q -> q_t transpose: tile `tile` of `matrices` [rows, cols] byte matrices.
struct NormTile {
  int64_t matrix = 0;
  int64_t row0 = 0;
  int64_t col0 = 0;
};

FP8JAX_PLAN_HD int64_t NormTiles(int64_t matrices, int64_t rows, int64_t cols) {
  return matrices * CeilDiv(rows, kNormTransposeTile) * CeilDiv(cols, kNormTransposeTile);
}

FP8JAX_PLAN_HD NormTile NormTileAt(int64_t tile, int64_t rows, int64_t cols) {
  const int64_t tr = CeilDiv(rows, kNormTransposeTile);
  const int64_t tc = CeilDiv(cols, kNormTransposeTile);
  NormTile t;
  t.matrix = tile / (tr * tc);
  const int64_t in = tile % (tr * tc);
  t.row0 = (in / tc) * kNormTransposeTile;
  t.col0 = (in % tc) * kNormTransposeTile;
  return t;
}

}  // namespace fp8jax::plan
