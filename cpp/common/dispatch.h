// Runtime dtype -> template dispatch shared by the CPU and CUDA handlers.
#pragma once

#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"

namespace fp8jax {

// Calls fn.template operator()<W, F>() for the runtime high-precision kind W
// and FP8 format F; anything else becomes an InvalidArgument ffi::Error.
template <typename Fn>
ffi::Error DispatchWideFp8(const char* op, WideKind w, Fp8Kind f, Fn&& fn) {
  if (f == Fp8Kind::kInvalid) {
    return BadArg(op, "FP8 buffer must be float8_e4m3fn or float8_e5m2");
  }
  const bool e4 = f == Fp8Kind::kE4M3;
  switch (w) {
    case WideKind::kF32:
      return e4 ? fn.template operator()<WideKind::kF32, E4M3>()
                : fn.template operator()<WideKind::kF32, E5M2>();
    case WideKind::kBF16:
      return e4 ? fn.template operator()<WideKind::kBF16, E4M3>()
                : fn.template operator()<WideKind::kBF16, E5M2>();
    case WideKind::kF16:
      return e4 ? fn.template operator()<WideKind::kF16, E4M3>()
                : fn.template operator()<WideKind::kF16, E5M2>();
    default:
      return BadArg(op, "high-precision buffer must be float32, bfloat16 or float16");
  }
}

// Calls fn.template operator()<W>() for the runtime high-precision kind W.
template <typename Fn>
ffi::Error DispatchWide(const char* op, WideKind w, Fn&& fn) {
  switch (w) {
    case WideKind::kF32:
      return fn.template operator()<WideKind::kF32>();
    case WideKind::kBF16:
      return fn.template operator()<WideKind::kBF16>();
    case WideKind::kF16:
      return fn.template operator()<WideKind::kF16>();
    default:
      return BadArg(op, "high-precision buffer must be float32, bfloat16 or float16");
  }
}

}  // namespace fp8jax
