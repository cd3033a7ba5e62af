// Where cuBLASLt reads each block scale of a block-scaled FP8 GEMM operand, as plain functions
// (host and device), so that the layouts are tested on a machine with no GPU
// (tests/ops/test_gemm_setup.py, against fp8jax.ops.block.block_scaling.cublaslt_scales).
//
// An operand is a row-major [rows, K] FP8 matrix, K-major as cuBLASLt's FP8 GEMM takes it (our a
// has rows = M, our b rows = N); its scales come in fp8jax's compact grid, one per block:
// scale[r][kb] for 1-row blocks (VEC128: 1 x 128; VEC32: 1 x 32) and scale[rb][kb] for 128 x 128
// tiles. cuBLASLt reads them (cuBLAS documentation, "Narrow precision data types usage"):
// - VEC128_32F: float32, "outer-dim-major": the rows of one K block are contiguous,
//   index kb * rows + r; the operand's rows must be a multiple of 4.
// - BLK128x128_32F: float32, K-major with a column stride that is a multiple of 4:
//   index rb * round_up(kblocks, 4) + kb.
// - VEC32_UE8M0 (MXFP8): E8M0, in tiles of 128 rows x 4 K blocks (512 bytes), tiles row-major
//   over [round_up(rows, 128), round_up(kblocks, 4)]; inside a tile, row r and K block kb sit at
//   (r % 32) * 16 + (r % 128 / 32) * 4 + kb % 4. The padding must be zero.
// - OUTER_VEC_32F (row-wise, Float8RowwiseScaling): float32, one scale per row for the whole of
//   K (cublasLt.h: a vector of M for cuBLASLt's A, N for its B; element (i, j) of the product is
//   multiplied by A's i-th and B's j-th scale): index r, `rows` of them.
#pragma once

#include <cstdint>

#include "common/launch_plan.h"

namespace fp8jax::blockscale {

// cuBLASLt's cublasLtMatmulMatrixScale_t values for the modes fp8jax uses.
enum Mode : int32_t {
  kScalar = 0,      // CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F: one float32 per tensor
  kVec32Ue8m0 = 2,  // CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0: MXFP8 (sm_100 and later)
  kOuterVec = 3,    // CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F: one per row (sm_90)
  kVec128 = 4,      // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F: 1 x 128 blocks (sm_90)
  kBlk128x128 = 5,  // CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F: 128 x 128 blocks (sm_90)
};

FP8JAX_PLAN_HD int64_t RoundUp(int64_t a, int64_t b) { return plan::CeilDiv(a, b) * b; }

// Elements along K per scale.
FP8JAX_PLAN_HD int64_t KBlock(int32_t mode) { return mode == kVec32Ue8m0 ? 32 : 128; }

// Scales cuBLASLt reads for a [rows, k] operand in `mode` (padding included); -1 for a mode it
// does not know.
FP8JAX_PLAN_HD int64_t ScaleCount(int32_t mode, int64_t rows, int64_t k) {
  const int64_t kblocks = plan::CeilDiv(k, KBlock(mode));
  switch (mode) {
    case kScalar:
      return 1;
    case kOuterVec:
      return rows;
    case kVec128:
      return kblocks * rows;
    case kBlk128x128:
      return plan::CeilDiv(rows, 128) * RoundUp(kblocks, 4);
    case kVec32Ue8m0:
      return RoundUp(rows, 128) * RoundUp(kblocks, 4);
    default:
      return -1;
  }
}

// Where cuBLASLt reads the scale of row (or 128-row tile, for kBlk128x128) `r` and K block
// `kb` of a [rows, k] operand in `mode` (kOuterVec: row `r`, whatever `kb`).
FP8JAX_PLAN_HD int64_t ScaleIndex(int32_t mode, int64_t r, int64_t kb, int64_t rows, int64_t k) {
  const int64_t kblocks = plan::CeilDiv(k, KBlock(mode));
  switch (mode) {
    case kOuterVec:
      return r;
    case kVec128:
      return kb * rows + r;
    case kBlk128x128:
      return r * RoundUp(kblocks, 4) + kb;
    case kVec32Ue8m0: {
      const int64_t tiles_k = plan::CeilDiv(kblocks, 4);
      return ((r / 128) * tiles_k + kb / 4) * 512 + (r % 32) * 16 + (r % 128 / 32) * 4 + kb % 4;
    }
    default:
      return 0;
  }
}

}  // namespace fp8jax::blockscale
