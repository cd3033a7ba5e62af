// Launch planning and tile indexing for the CUDA kernels, as plain functions.
//
// Everything a CUDA kernel decides about *which* elements a thread touches,
// *whether* it may use a vector access, and *how many* blocks to launch lives
// here, so that the CPU extension compiles the very same code and the Python
// tests check it (tests/ops/test_launch_plan.py) on a machine with no GPU.
// The kernels in cpp/cuda/cuda_ops.cu are thin loops over these helpers.
//
// All counts are int64_t: a tensor may hold more than 2^31 elements, a batch
// more than 65535 groups, a matrix more than 65535 row tiles. Only the grid
// size is narrowed (to gridDim.x, at most 2^31 - 1); every kernel walks its
// tiles with a grid-stride loop, so no problem size is limited by the grid.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FP8JAX_PLAN_HD __host__ __device__ __forceinline__
#define FP8JAX_UNROLL _Pragma("unroll")
#else
#define FP8JAX_PLAN_HD inline
#define FP8JAX_UNROLL
#endif

namespace fp8jax::plan {

constexpr int kThreads = 256;        // threads per block, every kernel
constexpr int kVec = 8;              // elements per chunk (one vector access)
constexpr int kChunksPerThread = 4;  // independent chunks per thread per tile (loads in flight)
constexpr int64_t kChunksPerTile = int64_t{kThreads} * kChunksPerThread;
constexpr uint64_t kWideAlign = 16;   // 8 x 2-byte = one 16-byte access; 8 x f32 = two
constexpr uint64_t kNarrowAlign = 8;  // 8 FP8 codes = one 8-byte access
constexpr int kTile = 64;             // cast_transpose guarded sub-tile edge (elements)
constexpr int kTileRowsPerPass = kThreads / (kTile / kVec);  // 32
constexpr int kBigTile = 128;  // cast_transpose tile edge: 16 x 16 blocks of 8 x 8
constexpr int kBlocksPerEdge = kBigTile / kVec;                     // 16
constexpr int kSubTiles = (kBigTile / kTile) * (kBigTile / kTile);  // 4 guarded sub-tiles
constexpr int64_t kMaxGridX = 0x7FFFFFFF;

FP8JAX_PLAN_HD int64_t CeilDiv(int64_t a, int64_t b) {  // a >= 0, b > 0
  return a / b + (a % b != 0 ? 1 : 0);
}

FP8JAX_PLAN_HD int64_t Clamp(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// ------------------------------------------------- elementwise (quantize)

// How one contiguous run of n elements (a vmapped group) is cut into chunks of
// kVec elements. Chunk c covers elements [start + 8c, start + 8c + 8) clipped
// to [0, n); start in [-7, 0] is chosen so that every chunk lying fully inside
// [0, n) starts at an address where both the wide (f32/bf16/f16) and the
// narrow (FP8) side allow one vector access. Only the first and last chunk can
// be partial; they are done element by element (the scalar head and tail).
// When no such start exists (the two pointers are misaligned relative to each
// other, which XLA's buffers never are) the whole run is scalar, 8 elements
// per chunk.
struct ChunkSplit {
  int64_t start = 0;
  int64_t chunks = 0;
  bool vector = false;
};

FP8JAX_PLAN_HD ChunkSplit SplitChunks(uint64_t wide_addr, int wide_bytes, uint64_t narrow_addr,
                                      int64_t n) {
  ChunkSplit s;
  if (n <= 0) return s;
  s.chunks = CeilDiv(n, kVec);
  if (wide_bytes <= 0 || wide_addr % static_cast<uint64_t>(wide_bytes) != 0) return s;
  for (int h = 0; h < kVec; ++h) {
    const uint64_t w = wide_addr + static_cast<uint64_t>(h) * static_cast<uint64_t>(wide_bytes);
    if (w % kWideAlign == 0 && (narrow_addr + static_cast<uint64_t>(h)) % kNarrowAlign == 0) {
      s.start = h == 0 ? 0 : h - kVec;
      s.chunks = CeilDiv(n - s.start, kVec);
      s.vector = true;
      return s;
    }
  }
  return s;
}

// The elements of chunk c: [first, first + count), and whether one vector
// access covers them (count == kVec and aligned).
struct ChunkElems {
  int64_t first = 0;
  int count = 0;
  bool vector = false;
};

FP8JAX_PLAN_HD ChunkElems ChunkAt(const ChunkSplit& s, int64_t c, int64_t n) {
  const int64_t lo = s.start + c * kVec;
  const int64_t first = lo < 0 ? 0 : lo;
  const int64_t hi = lo + kVec < n ? lo + kVec : n;
  ChunkElems e;
  e.first = first;
  e.count = hi > first ? static_cast<int>(hi - first) : 0;
  e.vector = s.vector && lo >= 0 && e.count == kVec;
  return e;
}

// Grid for `groups` runs of `per_group` elements. A tile is kChunksPerTile
// chunks of one group; each group has at least one tile (so an empty group is
// still visited), and tiles are numbered group-major. `resident_blocks` is
// what the device holds at once (SMs x blocks per SM from the occupancy API);
// the grid never exceeds it, and blocks loop over tiles.
struct ElementwisePlan {
  int64_t tiles_per_group = 1;
  int64_t tiles = 0;
  int64_t grid = 1;
  int block = kThreads;
};

inline ElementwisePlan PlanElementwise(int64_t groups, int64_t per_group, int64_t resident_blocks) {
  ElementwisePlan p;
  // At most ceil((per_group + 7) / 8) chunks, whatever start SplitChunks picks.
  const int64_t max_chunks = per_group > 0 ? CeilDiv(per_group + kVec - 1, kVec) : 0;
  p.tiles_per_group = max_chunks > 0 ? CeilDiv(max_chunks, kChunksPerTile) : 1;
  p.tiles = groups > 0 ? groups * p.tiles_per_group : 0;
  p.grid = Clamp(p.tiles, 1, Clamp(resident_blocks, 1, kMaxGridX));
  return p;
}

struct GroupTile {
  int64_t group = 0;
  int64_t first_chunk = 0;
};

FP8JAX_PLAN_HD GroupTile GroupTileAt(int64_t tile, int64_t tiles_per_group) {
  return {tile / tiles_per_group, (tile % tiles_per_group) * kChunksPerTile};
}

// Everything an elementwise kernel needs to find its chunks.
struct ElementwiseArgs {
  int64_t groups = 0;
  int64_t per_group = 0;
  int64_t tiles_per_group = 1;
  int64_t tiles = 0;
  uint64_t wide_addr = 0;  // address of the wide (f32/bf16/f16) tensor
  int wide_bytes = 4;
  uint64_t narrow_addr = 0;  // address of the FP8 tensor
};

// Chunk handled by thread `t` in step `k` (0 <= k < kChunksPerThread) of a
// tile: consecutive threads take consecutive chunks (coalesced).
FP8JAX_PLAN_HD int64_t ThreadChunk(const GroupTile& gt, int k, int t) {
  return gt.first_chunk + static_cast<int64_t>(k) * kThreads + t;
}

// The tile loop of one block of an elementwise CUDA kernel (quantize, dequantize;
// run on the host by tests/ops/test_host_cuda_walks.py). For every
// tile the block owns (grid-stride: block, block + grid, ...) it calls
// on_tile(group, base, chunks), where base is the group's first element and
// chunks[k] the thread's k-th chunk (count 0 past the group's end); it calls
// on_group_end(group) when the block moves on to another group and after its
// last tile. Both calls are block-uniform, so on_group_end may synchronise.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename OnTile, typename OnGroupEnd>
FP8JAX_PLAN_HD void WalkElementwise(const ElementwiseArgs& a, int64_t block, int64_t grid,
                                    int thread, OnTile&& on_tile, OnGroupEnd&& on_group_end) {
  int64_t current = -1;
  for (int64_t tile = block; tile < a.tiles; tile += grid) {
    const GroupTile gt = GroupTileAt(tile, a.tiles_per_group);
    if (gt.group != current) {
      if (current >= 0) on_group_end(current);
      current = gt.group;
    }
    const int64_t base = gt.group * a.per_group;
    const ChunkSplit split =
        SplitChunks(a.wide_addr + static_cast<uint64_t>(base) * static_cast<uint64_t>(a.wide_bytes),
                    a.wide_bytes, a.narrow_addr + static_cast<uint64_t>(base), a.per_group);
    ChunkElems chunks[kChunksPerThread];
    FP8JAX_UNROLL
    for (int k = 0; k < kChunksPerThread; ++k) {
      const int64_t c = ThreadChunk(gt, k, thread);
      chunks[k] = c < split.chunks ? ChunkAt(split, c, a.per_group) : ChunkElems{};
    }
    on_tile(gt.group, base, chunks);
  }
  if (current >= 0) on_group_end(current);
}

// ------------------------------------------------------ cast_transpose

// `matrices` row-major [rows, cols] matrices cut into kBigTile x kBigTile
// tiles, numbered column-tile fastest, then row tile, then matrix. A tile
// fully inside an aligned matrix takes the fast path (FastTileOk: 8 x 8
// register transposes, a swizzled shared-memory exchange of 8-byte words,
// docs/performance.md); any other tile is done as four kTile x kTile
// sub-tiles whose every 8-element chunk is guarded (LoadChunk/StoreChunk).
struct TransposePlan {
  int64_t row_tiles = 0;
  int64_t col_tiles = 0;
  int64_t tiles = 0;
  int64_t grid = 1;
  int block = kThreads;
};

inline TransposePlan PlanCastTranspose(int64_t matrices, int64_t rows, int64_t cols,
                                       int64_t resident_blocks) {
  TransposePlan p;
  p.row_tiles = rows > 0 ? CeilDiv(rows, kBigTile) : 0;
  p.col_tiles = cols > 0 ? CeilDiv(cols, kBigTile) : 0;
  p.tiles = matrices > 0 ? matrices * p.row_tiles * p.col_tiles : 0;
  p.grid = Clamp(p.tiles, 1, Clamp(resident_blocks, 1, kMaxGridX));
  return p;
}

struct MatTile {
  int64_t mat = 0;
  int64_t row0 = 0;
  int64_t col0 = 0;
};

FP8JAX_PLAN_HD MatTile MatTileAt(int64_t tile, int64_t row_tiles, int64_t col_tiles) {
  const int64_t per_mat = row_tiles * col_tiles;
  const int64_t in_mat = tile % per_mat;
  return {tile / per_mat, (in_mat / col_tiles) * kBigTile, (in_mat % col_tiles) * kBigTile};
}

// Guarded sub-tile `sub` (0..3, row-major) of a kBigTile tile.
FP8JAX_PLAN_HD MatTile SubTile(const MatTile& mt, int sub) {
  return {mt.mat, mt.row0 + (sub / 2) * kTile, mt.col0 + (sub % 2) * kTile};
}

// Position (inside the tile) of the 8-element chunk thread t handles in pass
// p (0 or 1). Load pass: 8 consecutive columns of one row (a row of x and q).
// Store pass: 8 consecutive rows of one column (a row of q_t).
struct TileSlot {
  int row = 0;
  int col = 0;
};

FP8JAX_PLAN_HD TileSlot LoadSlot(int t, int p) {
  return {t / (kTile / kVec) + kTileRowsPerPass * p, (t % (kTile / kVec)) * kVec};
}

FP8JAX_PLAN_HD TileSlot StoreSlot(int t, int p) {
  return {(t % (kTile / kVec)) * kVec, t / (kTile / kVec) + kTileRowsPerPass * p};
}

// The guarded sub-tile's shared bytes: a dense kTile x kTile array of codes whose 8-code chunks
// are swizzled, chunk c of row r stored as chunk c ^ ((r / 8) % 8). The load pass stores a
// warp's 4 rows x 8 chunks (8 bytes each) in distinct banks; the store pass gathers, for each of
// its 8 steps j, the byte at row 8 * k + j (k = 0..7, the lanes' row blocks) of one column
// (4 lanes each), and the swizzle puts those 8 words in 8 distinct banks (without it, rows 8
// apart sit 2 banks apart for any 8-byte-multiple row stride: a 4-way conflict).
FP8JAX_PLAN_HD int GuardedTileIndex(int row, int col) {
  return row * kTile + (((col / kVec) ^ ((row / kVec) % (kTile / kVec))) * kVec) + col % kVec;
}

// The dbias staging of a guarded sub-tile: float values [kTile][kValsStride], column c stored at
// c ^ 4 in the right half (c >= 32). A warp's load-pass stores (4 rows x 8 chunks, element j of
// each) then fall in 32 distinct banks (without it, chunks 32 columns apart collide: 2-way);
// the sums read 32 consecutive columns of a row, which the swizzle only permutes.
constexpr int kValsStride = kTile + 1;
FP8JAX_PLAN_HD int GuardedValsIndex(int row, int col) {
  return row * kValsStride + (col ^ ((col / 8) & 4));
}

// How many of the 8 elements [start, start + 8) lie below limit (0..8).
FP8JAX_PLAN_HD int ChunkCount(int64_t start, int64_t limit) {
  const int64_t n = limit - start;
  return n <= 0 ? 0 : (n >= kVec ? kVec : static_cast<int>(n));
}

// The activation kernels' work item: chunk `ch` of a matrix of rows of n elements, cut into
// ceil(n / kVec) chunks of kVec per row (the last one of a row partial): its row, first column
// and element count. One division per 8 elements.
struct RowChunk {
  int64_t row = 0;
  int64_t col = 0;
  int count = 0;
};

FP8JAX_PLAN_HD int64_t RowChunks(int64_t rows, int64_t n) { return rows * CeilDiv(n, kVec); }

FP8JAX_PLAN_HD RowChunk RowChunkAt(int64_t ch, int64_t n) {
  const int64_t per_row = CeilDiv(n, kVec);
  RowChunk c;
  c.row = ch / per_row;
  c.col = (ch - c.row * per_row) * kVec;
  c.count = ChunkCount(c.col, n);
  return c;
}

FP8JAX_PLAN_HD bool IsAligned(uint64_t addr, uint64_t bytes) { return addr % bytes == 0; }

// One thread's 8-element chunk of a tile pass: global element offset (of x
// and q in the load pass, of q_t in the store pass), how many of the 8
// elements exist, whether one vector access may cover them, and where the
// chunk sits in the shared-memory tile.
struct TileChunk {
  int64_t offset = 0;
  int count = 0;
  bool vector = false;
  TileSlot slot;
};

struct TransposeArgs {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t mats_per_group = 1;
  int64_t row_tiles = 0;
  int64_t col_tiles = 0;
  int64_t tiles = 0;
  uint64_t x_addr = 0;
  int wide_bytes = 4;
  uint64_t q_addr = 0;
  uint64_t qt_addr = 0;
  bool fast = false;  // FastEligible: interior tiles may take the fast path
};

// Whether interior tiles may take the fast path: every x row starts 16-byte
// aligned (8 elements = one or two 16-byte loads), every q row 8-byte aligned,
// every q_t row 16-byte aligned (16 codes = one 16-byte store).
FP8JAX_PLAN_HD bool FastEligible(int64_t rows, int64_t cols, uint64_t x_addr, int wide_bytes,
                                 uint64_t q_addr, uint64_t qt_addr) {
  return rows % 16 == 0 && cols % kVec == 0 && IsAligned(x_addr, kWideAlign) &&
         IsAligned(q_addr, kNarrowAlign) && IsAligned(qt_addr, 16) &&
         (static_cast<uint64_t>(cols) * static_cast<uint64_t>(wide_bytes)) % kWideAlign == 0;
}

FP8JAX_PLAN_HD bool FastTileOk(const TransposeArgs& a, const MatTile& mt) {
  return a.fast && mt.row0 + kBigTile <= a.rows && mt.col0 + kBigTile <= a.cols;
}

// ---- the fast path, per thread t of a kBigTile x kBigTile tile:
// thread (rb, cb) = (t / 16, t % 16) owns the 8 x 8 block of rows 8rb..8rb+7
// and columns 8cb..8cb+7: 8 row loads of 8 elements, 8 q stores of 8 codes,
// one 8 x 8 byte transpose in registers (Transpose8x8), then 8 words (the
// block's columns, 8 codes each) into shared memory at FastWord(c, rb).
FP8JAX_PLAN_HD int FastRowBlock(int t) { return t / kBlocksPerEdge; }
FP8JAX_PLAN_HD int FastColBlock(int t) { return t % kBlocksPerEdge; }

// Shared-memory word (8 bytes) holding codes of tile column c, row block rb.
// Row c of q_t's tile is words c*16 .. c*16+15, its row blocks permuted by
// XOR with c / 8: the 16 threads of a half-warp (one rb, cb = 0..15) then
// write 16 distinct bank pairs, no conflict.
FP8JAX_PLAN_HD int FastWord(int c, int rb) {
  return c * kBlocksPerEdge + (rb ^ ((c / kVec) % kBlocksPerEdge));
}

// Read phase: per step s (0..3), thread t reads 16 codes of q_t's tile row
// c = 32s + t / 8, rows 16k..16k+15 (k = t % 8): one 16-byte shared load of
// words FastReadWord(c, k) and +1 (the two row blocks 2k, 2k+1, swapped when
// FastReadSwapped(c)), one 16-byte global store. 8 threads cover one
// 128-byte q_t row segment: coalesced, and conflict-free in shared memory.
constexpr int kFastReadSteps = kBigTile * kBlocksPerEdge / 2 / kThreads;  // 4
FP8JAX_PLAN_HD int FastReadCol(int t, int step) { return step * (kThreads / 8) + t / 8; }
FP8JAX_PLAN_HD int FastReadPair(int t) { return t % 8; }
FP8JAX_PLAN_HD int FastReadWord(int c, int k) {
  return c * kBlocksPerEdge + ((2 * k) ^ (((c / kVec) % kBlocksPerEdge) & ~1));
}
FP8JAX_PLAN_HD bool FastReadSwapped(int c) { return ((c / kVec) & 1) != 0; }

// Transposes an 8 x 8 byte matrix held as 8 little-endian words (w[i] byte j
// = element (i, j)) in place, by swapping 4 x 4, then 2 x 2, then 1 x 1
// off-diagonal blocks: 24 shift/xor/and steps, no shared memory.
FP8JAX_PLAN_HD void Transpose8x8(uint64_t w[8]) {
  constexpr uint64_t kMask4 = 0x00000000FFFFFFFFull;
  constexpr uint64_t kMask2 = 0x0000FFFF0000FFFFull;
  constexpr uint64_t kMask1 = 0x00FF00FF00FF00FFull;
  FP8JAX_UNROLL
  for (int i = 0; i < 4; ++i) {  // rows i, i + 4: 4 x 4 blocks
    const uint64_t x = ((w[i] >> 32) ^ w[i + 4]) & kMask4;
    w[i + 4] ^= x;
    w[i] ^= x << 32;
  }
  FP8JAX_UNROLL
  for (int p = 0; p < 4; ++p) {  // rows i, i + 2 for i = 0, 1, 4, 5: 2 x 2 blocks
    const int i = (p & 1) + (p >> 1) * 4;
    const uint64_t x = ((w[i] >> 16) ^ w[i + 2]) & kMask2;
    w[i + 2] ^= x;
    w[i] ^= x << 16;
  }
  FP8JAX_UNROLL
  for (int p = 0; p < 4; ++p) {  // rows i, i + 1 for even i: single bytes
    const int i = 2 * p;
    const uint64_t x = ((w[i] >> 8) ^ w[i + 1]) & kMask1;
    w[i + 1] ^= x;
    w[i] ^= x << 8;
  }
}

// Load pass: 8 columns of one row of x (and q); vector when all 8 exist and
// both x and q are aligned there.
FP8JAX_PLAN_HD TileChunk LoadChunk(const TransposeArgs& a, const MatTile& mt, int t, int p) {
  TileChunk c;
  c.slot = LoadSlot(t, p);
  const int64_t r = mt.row0 + c.slot.row;
  const int64_t col = mt.col0 + c.slot.col;
  c.count = r < a.rows ? ChunkCount(col, a.cols) : 0;
  c.offset = mt.mat * a.rows * a.cols + r * a.cols + col;
  c.vector = c.count == kVec &&
             IsAligned(a.x_addr + static_cast<uint64_t>(c.offset) * a.wide_bytes, kWideAlign) &&
             IsAligned(a.q_addr + static_cast<uint64_t>(c.offset), kNarrowAlign);
  return c;
}

// Store pass: 8 rows of one column of x, i.e. 8 consecutive codes of one row
// of q_t ([cols, rows] per matrix).
FP8JAX_PLAN_HD TileChunk StoreChunk(const TransposeArgs& a, const MatTile& mt, int t, int p) {
  TileChunk c;
  c.slot = StoreSlot(t, p);
  const int64_t r = mt.row0 + c.slot.row;
  const int64_t col = mt.col0 + c.slot.col;
  c.count = col < a.cols ? ChunkCount(r, a.rows) : 0;
  c.offset = mt.mat * a.rows * a.cols + col * a.rows + r;
  c.vector =
      c.count == kVec && IsAligned(a.qt_addr + static_cast<uint64_t>(c.offset), kNarrowAlign);
  return c;
}

// The tile loop of one block of cast_transpose (see WalkElementwise):
// on_tile(group, tile) for every tile the block owns, on_group_end(group)
// when the block moves to another group's scale and after its last tile.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename OnTile, typename OnGroupEnd>
FP8JAX_PLAN_HD void WalkCastTranspose(const TransposeArgs& a, int64_t block, int64_t grid,
                                      OnTile&& on_tile, OnGroupEnd&& on_group_end) {
  int64_t current = -1;
  for (int64_t tile = block; tile < a.tiles; tile += grid) {
    const MatTile mt = MatTileAt(tile, a.row_tiles, a.col_tiles);
    const int64_t group = mt.mat / a.mats_per_group;
    if (group != current) {
      if (current >= 0) on_group_end(current);
      current = group;
    }
    on_tile(group, mt);
  }
  if (current >= 0) on_group_end(current);
}

// ---------------------------------------------------- scale_inv writers

// Every kernel that produces scale_inv writes all `groups` entries with a
// grid-stride loop over threads, independent of the tiles, so that empty
// tensors (no tile does any work) still get scale_inv = 1 / scale:
// fn(group) for each group thread `thread` of block `block` owns.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <typename Fn>
FP8JAX_PLAN_HD void WalkGroups(int64_t groups, int64_t block, int64_t grid, int thread, Fn&& fn) {
  const int64_t stride = grid * kThreads;
  for (int64_t g = block * kThreads + thread; g < groups; g += stride) fn(g);
}

// ------------------------------------------------- column sums (dbias)

// The order of dbias, the float32 column sums of a [rows, cols] matrix, on
// CPU and CUDA alike (so both give the same bits, every run): rows are cut
// into tiles of kBigTile (128) rows, each tile into kRowGroups groups of
// kSumGroup (8) consecutive rows. A group's sum adds its rows in order; a
// tile's sum adds its groups in order; dbias adds the tiles in the column
// totals' order (below); every sum starts from +0 (rows past the end add
// nothing). On CUDA the cast_transpose
// kernel writes each tile's column sums to a workspace [matrices, row_tiles,
// cols] (fast tiles: each thread's 8 x 8 block is one group; guarded
// sub-tiles: groups are summed from a shared-memory copy of the values,
// GuardedGroupSlot) and a second kernel adds the tiles (ColumnTotalsKernel).
constexpr int kSumGroup = kVec;                    // rows per group
constexpr int kRowGroups = kBigTile / kSumGroup;   // 16 groups per tile
constexpr int kGuardedGroups = kTile / kSumGroup;  // 8 groups per guarded sub-tile
constexpr int kGuardedSlotsPerThread = kGuardedGroups * kTile / kThreads;  // 2

// Workspace index of tile row `row_tile`, column `col` of matrix `mat`.
FP8JAX_PLAN_HD int64_t PartialIndex(int64_t mat, int64_t row_tile, int64_t row_tiles, int64_t cols,
                                    int64_t col) {
  return (mat * row_tiles + row_tile) * cols + col;
}

// The (group, column) of a guarded sub-tile that thread t sums in step k
// (0 .. kGuardedSlotsPerThread - 1): consecutive threads, consecutive columns.
struct GroupSlot {
  int group = 0;
  int col = 0;
};

FP8JAX_PLAN_HD GroupSlot GuardedGroupSlot(int t, int k) {
  const int idx = t + kThreads * k;
  return {idx / kTile, idx % kTile};
}

// The shared-memory index of a tile's group sum (group g, column c of the
// tile): one unused float after every 32 columns, so that a warp's accesses
// fall in distinct banks: the fast tile's stores (lane L: group
// FastRowBlock, columns FastColBlock * 8 + j: the pad shifts each run of 4
// lanes by one bank, the next group by four), the guarded sums' and the
// flush's 32 consecutive columns. The dense [group][col] layout put 8 lanes
// of the fast tile's stores in each bank it used. kColpartStride per group.
constexpr int kColpartStride = kBigTile + kBigTile / 32;  // 132
FP8JAX_PLAN_HD int ColpartIndex(int g, int c) { return g * kColpartStride + c + c / 32; }

// Row `sub`'s groups of a guarded sub-tile start at this group of the tile,
// its columns at this column of the tile (SubTile's layout).
FP8JAX_PLAN_HD int SubTileGroup0(int sub) { return (sub / 2) * kGuardedGroups; }
FP8JAX_PLAN_HD int SubTileCol0(int sub) { return (sub % 2) * kTile; }

// ------------------------------------------------- column totals (pass 2)

// The order of a column total of `rows` partial rows (dbias's tiles; the norm
// backward's slots), on CPU and CUDA alike: kColumnLanes interleaved sums
// (lane l adds rows l, l + kColumnLanes, ... in order, from +0), then the
// lanes added in order, from +0. Up to kColumnLanes rows that is the rows
// added in order. On CUDA a block of kThreads threads takes kTotalsColumns
// consecutive columns of one matrix, one thread per (lane, column), and adds
// the lanes in shared memory: every thread walks rows / kColumnLanes rows.
constexpr int kColumnLanes = 16;
constexpr int kTotalsColumns = kThreads / kColumnLanes;  // 16 columns per block

// The lane that adds row r of a column.
FP8JAX_PLAN_HD int ColumnLane(int64_t r) { return static_cast<int>(r % kColumnLanes); }

// Work items of pass 2 (one per block at a time): kTotalsColumns columns of one matrix.
FP8JAX_PLAN_HD int64_t TotalsItems(int64_t matrices, int64_t cols) {
  return matrices * CeilDiv(cols, kTotalsColumns);
}

// Item `item`'s matrix and first column.
struct TotalsSlot {
  int64_t mat = 0;
  int64_t col = 0;
};

FP8JAX_PLAN_HD TotalsSlot TotalsSlotAt(int64_t item, int64_t cols) {
  const int64_t per_mat = CeilDiv(cols, kTotalsColumns);
  return {item / per_mat, (item % per_mat) * kTotalsColumns};
}

// Rows a thread of pass 2 adds in sequence (the pass's serial depth).
FP8JAX_PLAN_HD int64_t TotalsSteps(int64_t rows) { return CeilDiv(rows, kColumnLanes); }

// Blocks for a grid-stride loop over n items (at least 1, at most kMaxGridX).
FP8JAX_PLAN_HD int64_t GridFor(int64_t n, int64_t resident) {
  return Clamp(CeilDiv(n, kThreads), 1, Clamp(resident, 1, kMaxGridX));
}

}  // namespace fp8jax::plan
