// Byte-matrix transpose of a strip of rows (host only), for cast_transpose.
//
// The strip [r0, r1) of a rows x cols byte matrix `src` (row-major) is written
// transposed into `dst` (cols x rows): dst[c * rows + r] = src[r * cols + c].
// Full 16 x 16 blocks go through SSE2 registers (16 loads, 64 byte/word
// interleaves, 16 stores; SSE2 is part of every x86-64 CPU); the ragged edges
// and other architectures use a scalar loop.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace fp8jax {

inline void TransposeScalar(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols,
                            int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) {
    for (int64_t r = r0; r < r1; ++r) dst[c * rows + r] = src[r * cols + c];
  }
}

#if defined(__SSE2__)
// One 16 x 16 block: rows src + i * src_stride (16 bytes each) become rows
// dst + j * dst_stride. Four rounds of interleaving, each doubling the width
// of the units that are already in transposed order (1, 2, 4, 8 bytes).
inline void Transpose16x16(const uint8_t* src, int64_t src_stride, uint8_t* dst,
                           int64_t dst_stride) {
  __m128i r[16];
  for (int i = 0; i < 16; ++i) {
    r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  }
  // Round 1: pairs of rows (2k, 2k + 1); lo holds columns 0-7, hi 8-15, as
  // 2-byte units (row 2k, row 2k + 1).
  __m128i a[16];
  for (int k = 0; k < 8; ++k) {
    a[k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
    a[8 + k] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
  }
  // Round 2: 4-byte units of rows 4j..4j+3. b[4 * j + q] holds columns
  // 4q..4q+3 of row group j.
  __m128i b[16];
  for (int j = 0; j < 4; ++j) {
    b[4 * j + 0] = _mm_unpacklo_epi16(a[2 * j], a[2 * j + 1]);
    b[4 * j + 1] = _mm_unpackhi_epi16(a[2 * j], a[2 * j + 1]);
    b[4 * j + 2] = _mm_unpacklo_epi16(a[8 + 2 * j], a[8 + 2 * j + 1]);
    b[4 * j + 3] = _mm_unpackhi_epi16(a[8 + 2 * j], a[8 + 2 * j + 1]);
  }
  // Round 3: 8-byte units of rows 8h..8h+7. d[8 * h + p] holds columns
  // 2p, 2p + 1 of row half h.
  __m128i d[16];
  for (int h = 0; h < 2; ++h) {
    for (int q = 0; q < 4; ++q) {
      d[8 * h + 2 * q] = _mm_unpacklo_epi32(b[4 * (2 * h) + q], b[4 * (2 * h + 1) + q]);
      d[8 * h + 2 * q + 1] = _mm_unpackhi_epi32(b[4 * (2 * h) + q], b[4 * (2 * h + 1) + q]);
    }
  }
  // Round 4: whole columns: column 2p from the low halves, 2p + 1 from the high.
  for (int p = 0; p < 8; ++p) {
    const __m128i lo = _mm_unpacklo_epi64(d[p], d[8 + p]);
    const __m128i hi = _mm_unpackhi_epi64(d[p], d[8 + p]);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * p) * dst_stride), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * p + 1) * dst_stride), hi);
  }
}
#endif

inline void TransposeRows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols, int64_t r0,
                          int64_t r1) {
#if defined(__SSE2__)
  const int64_t rfull = r0 + (r1 - r0) / 16 * 16;
  const int64_t cfull = cols / 16 * 16;
  for (int64_t c = 0; c < cfull; c += 16) {
    for (int64_t r = r0; r < rfull; r += 16) {
      Transpose16x16(src + r * cols + c, cols, dst + c * rows + r, rows);
    }
  }
  TransposeScalar(src, dst, rows, cols, rfull, r1, 0, cols);
  TransposeScalar(src, dst, rows, cols, r0, rfull, cfull, cols);
#else
  TransposeScalar(src, dst, rows, cols, r0, r1, 0, cols);
#endif
}

}  // namespace fp8jax
