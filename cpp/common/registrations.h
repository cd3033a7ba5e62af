// What the nanobind modules share: `registrations`, the dict of target name -> handler capsule
// that fp8jax/_ffi.py hands to jax.ffi.register_ffi_target.
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>
#include <utility>

#include "xla/ffi/api/c_api.h"

namespace fp8jax {

// One platform's handler of one op: its target name and its symbol.
using HandlerEntry = std::pair<const char*, XLA_FFI_Handler*>;

inline nanobind::dict Registrations(std::initializer_list<HandlerEntry> handlers) {
  nanobind::dict d;
  for (const auto& [target, handler] : handlers) {
    d[target] = nanobind::capsule(reinterpret_cast<void*>(handler));
  }
  return d;
}

}  // namespace fp8jax
