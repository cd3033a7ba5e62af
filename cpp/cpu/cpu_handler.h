// The CPU platform of the ops (ops/op.h): a CPU handler's context, CpuPool, and the definition of
// each op's CPU handler symbol, Fp8jax<Stem>Cpu (cpu/module_cpu.cc defines them all from the
// X-list, common/op_table.h).
#pragma once

#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

namespace fp8jax {

// A CPU handler's context: XLA's intra-op thread pool; a computation hands `&pool` (an
// ffi::ThreadPool*) to ParallelFor (cpu/cpu_parallel.h).
struct CpuPool : ffi::ThreadPool {
  CpuPool(ffi::ThreadPool pool) : ffi::ThreadPool(pool) {}  // NOLINT: XLA's decoded pool converts
};

}  // namespace fp8jax

namespace xla::ffi {

// A handler parameter of type CpuPool binds XLA's thread pool (ffi::Ffi::BindTo).
template <>
struct CtxBinding<fp8jax::CpuPool> {
  using Ctx = ThreadPool;
};

}  // namespace xla::ffi

// Defines Fp8jax<Stem>Cpu, the CPU handler of the X-list entry (Stem, target): Stem::Handle with
// the thread pool first, its binding derived from its parameters.
#define FP8JAX_DEFINE_CPU_HANDLER(Stem, target)                                        \
  extern "C" XLA_FFI_Error* Fp8jax##Stem##Cpu(XLA_FFI_CallFrame* call_frame) {         \
    static auto* handler =                                                             \
        ::xla::ffi::Ffi::BindTo(&::fp8jax::Stem::Handle<::fp8jax::CpuPool>).release(); \
    return handler->Call(call_frame);                                                  \
  }
