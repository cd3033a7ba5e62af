// Host test of the CUDA kernels' element conversions (cpp/common/fp8_device_convert.h)
// against the CPU numerics (cpp/common/fp8_numerics.h), the definition of the contract.
//
// The device helpers are compiled here for the host, where the CUDA headers' host
// implementations of the intrinsics (__nv_cvt_float_to_fp8, __float2half_rn, __half2float)
// model the hardware, NaN canonicalisation included. A GPU's FP32 multiply returns the
// canonical NaN 0x7FFFFFFF for a NaN operand; the host's keeps the operand's sign, so every
// NaN input is also checked with the product replaced by the canonical NaN.
//
// Usage: test_device_numerics [--full | --stride S] [--threads N]
//   default: every 4099th float32 input plus every input near a rounding boundary (well under a
//            second); --full: all 2^32 float32 inputs; --stride S: every S-th input.
// Prints one line per check and exits 1 on any mismatch.
#include <cuda_bf16.h>

#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/fp8_device_convert.h"
#include "common/fp8_numerics.h"

namespace {

using fp8jax::BitsToFloat;
using fp8jax::E4M3;
using fp8jax::E5M2;
using fp8jax::FloatBits;

constexpr float kCanonicalNanGpu = __builtin_bit_cast(float, 0x7FFFFFFFu);

std::mutex g_print_mu;
std::atomic<uint64_t> g_failures{0};

void Fail(const char* what, uint32_t input, float scale, unsigned got, unsigned want) {
  if (g_failures.fetch_add(1) < 20) {
    std::lock_guard<std::mutex> lock(g_print_mu);
    std::printf("MISMATCH %s: input 0x%08" PRIx32 " scale %a: got 0x%x, want 0x%x\n", what, input,
                static_cast<double>(scale), got, want);
  }
}

bool IsNanBits(uint32_t u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }

// Every check on one float32 input x with scale 1 (the kernels multiply by the scale first;
// other scales are checked in CheckScaled).
inline void CheckOne(uint32_t u) {
  const float x = BitsToFloat(u);
  const uint8_t want4 = fp8jax::FloatToFp8<E4M3>(x);
  const uint8_t want5 = fp8jax::FloatToFp8<E5M2>(x);
  const uint8_t got4 = fp8jax::CvtFp8<E4M3>(x, 1.0f);
  const uint8_t got5 = fp8jax::CvtFp8<E5M2>(x, 1.0f);
  if (got4 != want4) Fail("CvtFp8<E4M3>", u, 1.0f, got4, want4);
  if (got5 != want5) Fail("CvtFp8<E5M2>", u, 1.0f, got5, want5);
  const uint16_t h = fp8jax::FloatToF16BitsFast(x);
  const uint16_t hw = fp8jax::FloatToF16Bits(x);
  if (h != hw) Fail("FloatToF16BitsFast", u, 1.0f, h, hw);
  if (IsNanBits(u)) {  // the GPU's multiply: the product is the canonical NaN
    const uint8_t c4 = fp8jax::CvtFp8FromProduct<E4M3>(x, 1.0f, kCanonicalNanGpu);
    const uint8_t c5 = fp8jax::CvtFp8FromProduct<E5M2>(x, 1.0f, kCanonicalNanGpu);
    if (c4 != want4) Fail("CvtFp8FromProduct<E4M3> (GPU NaN)", u, 1.0f, c4, want4);
    if (c5 != want5) Fail("CvtFp8FromProduct<E5M2> (GPU NaN)", u, 1.0f, c5, want5);
  } else {
    // bf16 output: the kernels use FloatToBf16Bits itself; it must be the hardware's RNE.
    const uint16_t b = fp8jax::FloatToBf16Bits(x);
    const uint16_t bh = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    if (b != bh) Fail("FloatToBf16Bits vs __float2bfloat16_rn", u, 1.0f, b, bh);
  }
}

// quantize with a scale: the device form (host multiply, and the GPU's canonical NaN) vs
// QuantizeValue, the CPU kernel's.
inline void CheckScaled(float x, float scale) {
  const uint32_t u = FloatBits(x);
  const float p = x * scale;
  const float p_gpu = IsNanBits(FloatBits(p)) ? kCanonicalNanGpu : p;
  const uint8_t want4 = fp8jax::QuantizeValue<E4M3>(x, scale);
  const uint8_t want5 = fp8jax::QuantizeValue<E5M2>(x, scale);
  const uint8_t g4 = fp8jax::CvtFp8<E4M3>(x, scale);
  const uint8_t g5 = fp8jax::CvtFp8<E5M2>(x, scale);
  const uint8_t c4 = fp8jax::CvtFp8FromProduct<E4M3>(x, scale, p_gpu);
  const uint8_t c5 = fp8jax::CvtFp8FromProduct<E5M2>(x, scale, p_gpu);
  if (g4 != want4) Fail("CvtFp8<E4M3>", u, scale, g4, want4);
  if (g5 != want5) Fail("CvtFp8<E5M2>", u, scale, g5, want5);
  if (c4 != want4) Fail("CvtFp8FromProduct<E4M3> (GPU NaN)", u, scale, c4, want4);
  if (c5 != want5) Fail("CvtFp8FromProduct<E5M2> (GPU NaN)", u, scale, c5, want5);
}

// Runs fn(begin, end) over [0, n) split into chunks over `threads` threads.
template <typename Fn>
void Parallel(uint64_t n, int threads, Fn fn) {
  std::vector<std::thread> pool;
  std::atomic<uint64_t> next{0};
  constexpr uint64_t kChunk = 1u << 20;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (uint64_t b = next.fetch_add(kChunk); b < n; b = next.fetch_add(kChunk)) {
        fn(b, b + kChunk < n ? b + kChunk : n);
      }
    });
  }
  for (auto& th : pool) th.join();
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Every rounding boundary of the conversions: for each of the 2^11 sign/exponent/top-mantissa
// prefixes, the low 21 bits at each tie (bit 12, 15, 19, 20 set: half an ulp of f16, bf16,
// E4M3, E5M2 normals; higher ties are covered by the prefixes) and one either side of it.
std::vector<uint32_t> BoundaryInputs() {
  std::vector<uint32_t> lows = {0, 1, 0x1FFFFF};
  for (int bit = 0; bit <= 20; ++bit) {
    const uint32_t tie = 1u << bit;
    lows.insert(lows.end(), {tie - 1, tie, tie + 1, tie | 0x1FFFFFu >> (21 - bit)});
  }
  std::vector<uint32_t> out;
  for (uint32_t hi = 0; hi < (1u << 11); ++hi) {
    for (uint32_t lo : lows) out.push_back((hi << 21) | (lo & 0x1FFFFFu));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t stride = 4099;  // odd and prime: every low-bit residue is visited
  int threads = static_cast<int>(std::thread::hardware_concurrency());
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--full") == 0) {
      stride = 1;
    } else if (std::strcmp(argv[i], "--stride") == 0 && i + 1 < argc) {
      stride = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--full | --stride S] [--threads N]\n", argv[0]);
      return 2;
    }
  }
  if (threads < 1) threads = 1;
  if (stride < 1) stride = 1;
  const bool full = stride == 1;

  // 1. float32 -> FP8 (scale 1) and float32 -> f16 / bf16, all or a strided subset.
  auto t0 = std::chrono::steady_clock::now();
  const uint64_t n = ((uint64_t{1} << 32) + stride - 1) / stride;
  Parallel(n, threads, [&](uint64_t b, uint64_t e) {
    for (uint64_t i = b; i < e; ++i) CheckOne(static_cast<uint32_t>(i * stride));
  });
  const std::vector<uint32_t> boundary = BoundaryInputs();
  for (uint32_t u : boundary) CheckOne(u);
  std::printf("float32 -> E4M3/E5M2/f16/bf16: %s%" PRIu64
              " inputs + %zu boundary inputs, %d threads, "
              "%.1f s\n",
              full ? "all " : "strided subset of ", n, boundary.size(), threads, Seconds(t0));

  // 2. quantize with other scales (specials included), on the boundary inputs.
  t0 = std::chrono::steady_clock::now();
  const float scales[] = {0.7f,
                          3.3f,
                          1e-3f,
                          1024.0f,
                          1e30f,
                          -2.0f,
                          0.0f,
                          -0.0f,
                          __builtin_inff(),
                          -__builtin_inff(),
                          __builtin_nanf(""),
                          -__builtin_nanf(""),
                          1.2e-38f};
  for (float s : scales) {
    for (uint32_t u : boundary) CheckScaled(BitsToFloat(u), s);
  }
  std::printf("quantize with %zu scales: %zu inputs each, %.1f s\n", std::size(scales),
              boundary.size(), Seconds(t0));

  // 3. Every bf16 and f16 input through the kernels' load path, then the conversion.
  t0 = std::chrono::steady_clock::now();
  for (uint32_t b = 0; b < (1u << 16); ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float want = fp8jax::F16BitsToFloat(h);
    const float got = fp8jax::F16BitsToFloatFast(h);
    if (FloatBits(got) != FloatBits(want)) {
      Fail("F16BitsToFloatFast", b, 1.0f, FloatBits(got), FloatBits(want));
    }
    if (!IsNanBits(FloatBits(want))) {  // the hardware load is exact on every non-NaN
      const float hw = __half2float(__ushort_as_half(h));
      if (FloatBits(hw) != FloatBits(want)) Fail("__half2float", b, 1.0f, FloatBits(hw), 0);
    }
    for (float s : scales) {
      CheckScaled(got, s);
      CheckScaled(fp8jax::Bf16BitsToFloat(h), s);
    }
    // and back: the widening is exact, so the f16 output path returns the bits.
    const uint16_t back = fp8jax::FloatToF16BitsFast(got);
    const uint16_t want_back = fp8jax::FloatToF16Bits(want);
    if (back != want_back) Fail("f16 round trip", b, 1.0f, back, want_back);
  }
  std::printf("bf16 and f16 inputs: all 65536 each through load + quantize (%zu scales), %.1f s\n",
              std::size(scales), Seconds(t0));

  // 4. dequantize: every code x scale_inv, to float32 and through the f16 / bf16 output path.
  uint64_t deq = 0;
  for (float si : scales) {
    for (uint32_t c = 0; c < 256; ++c, ++deq) {
      const uint8_t code = static_cast<uint8_t>(c);
      for (int fmt = 0; fmt < 2; ++fmt) {
        const float v = fmt == 0 ? fp8jax::DequantizeValue<E4M3>(code, si)
                                 : fp8jax::DequantizeValue<E5M2>(code, si);
        const float exact =
            fmt == 0 ? fp8jax::Fp8ToFloat<E4M3>(code) * si : fp8jax::Fp8ToFloat<E5M2>(code) * si;
        const uint32_t vb = FloatBits(v);
        if (IsNanBits(vb)) {
          const uint32_t sign = ((c << 24) ^ FloatBits(si)) & 0x80000000u;
          if (vb != (sign | 0x7FC00000u))
            Fail("DequantizeValue NaN", c, si, vb, sign | 0x7FC00000u);
        } else if (vb != FloatBits(exact)) {
          Fail("DequantizeValue", c, si, vb, FloatBits(exact));
        }
        const uint16_t h = fp8jax::FloatToF16BitsFast(v);
        if (h != fp8jax::FloatToF16Bits(v)) Fail("dequantize f16", c, si, h, 0);
      }
    }
  }
  std::printf("dequantize: %" PRIu64 " (code, scale_inv) pairs per format\n", deq);

  const uint64_t failures = g_failures.load();
  std::printf("%s: %" PRIu64 " mismatches\n", failures ? "FAILED" : "OK", failures);
  return failures ? 1 : 0;
}
