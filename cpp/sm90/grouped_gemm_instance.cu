// One instantiation of the tensor-core grouped GEMM: entry FP8JAX_SM90_INSTANCE of
// sm90/variants.h (CMakeLists.txt compiles this file once per entry, each its own translation
// unit). Defines RunInstance<I> and InstanceInfo<I>, which sm90/grouped_gemm.cu dispatches to.
#include "sm90/grouped_gemm_variant.cuh"
#include "sm90/variants.h"

#ifndef FP8JAX_SM90_INSTANCE
#error "compile with -DFP8JAX_SM90_INSTANCE=<index into FP8JAX_SM90_VARIANTS>"
#endif
static_assert(FP8JAX_SM90_INSTANCE >= 0 && FP8JAX_SM90_INSTANCE < FP8JAX_SM90_INSTANCES);

namespace fp8jax::grouped_tc {

// The entry's Variant: Pick<I>::type for the one entry whose index is I.
template <int I>
struct Pick;
#define FP8JAX_SM90_PICK_(I, A, B, O, F, N, na, nb, no)                       \
  template <>                                                                 \
  struct Pick<I> {                                                            \
    using type = Variant<A, B, O, F == 1, N>;                                 \
    static VariantInfo Info() { return InfoOf<type>(na, nb, no, F == 1, N); } \
  };
FP8JAX_SM90_VARIANTS(FP8JAX_SM90_PICK_)
#undef FP8JAX_SM90_PICK_

template <>
ffi::Error RunInstance<FP8JAX_SM90_INSTANCE>(cudaStream_t stream, Call& c) {
  return RunVariant<typename Pick<FP8JAX_SM90_INSTANCE>::type>(stream, c);
}

template <>
VariantInfo InstanceInfo<FP8JAX_SM90_INSTANCE>() {
  return Pick<FP8JAX_SM90_INSTANCE>::Info();
}

}  // namespace fp8jax::grouped_tc
