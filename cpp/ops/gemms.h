// fp8jax's own GEMM kernels: the ragged grouped GEMM, grouped_gemm (Python:
// fp8jax/ops/gemms/grouped_gemm.py). Its target, signature (its Handle's parameters) and argument
// check, which fills the grouped::Gemm its kernels run on (common/grouped_gemm.h, their shared
// numerics); the computations are in cpu/cpu_grouped_gemm.cc and cuda/cuda_grouped_gemm.cu
// (ops/op.h says how the pieces fit). The dense FP8 GEMM is cuBLASLt's (cuda/gemm_cublaslt.cc), not
// listed here.
#pragma once

#include <cstdint>

#include "common/dispatch.h"
#include "common/ffi_checks.h"
#include "common/fp8_numerics.h"
#include "common/grouped_gemm.h"
#include "common/launch_plan.h"
#include "ops/op.h"
#include "xla/ffi/api/ffi.h"

// This family's entry of the X-list (common/op_table.h).
#define FP8JAX_GEMM_OPS(X) X(GroupedGemm, "fp8jax_grouped_gemm")

namespace fp8jax {

// fp8jax_grouped_gemm (Fp8jaxGroupedGemmCpu, Fp8jaxGroupedGemmCuda): a, b (FP8 codes, not both
// E5M2), group_sizes (int32 [G]), a_scale_inv, b_scale_inv (float32 [G] each, or block scale
// grids, float32 or E8M0); ragged (0: rows, a [M, K], b [G, N, K] -> out [M, N]; 1: contracting,
// a [K, M], b [N, M] -> out [G, K, N]), a_block_rows, a_block_cols, b_block_rows, b_block_cols
// (all 0: per-group scales) -> out (float32, bfloat16 or float16).
struct GroupedGemm {
  static constexpr char kName[] = "grouped_gemm";
  sig::Any a;
  sig::Any b;
  sig::Any group_sizes;
  sig::Any a_scale_inv;
  sig::Any b_scale_inv;
  int64_t ragged;
  int64_t a_block_rows;
  int64_t a_block_cols;
  int64_t b_block_rows;
  int64_t b_block_cols;
  sig::AnyOut out;
  grouped::Gemm p{};

  template <typename Ctx>
  static ffi::Error Handle(Ctx ctx, sig::Any a, sig::Any b, sig::Any group_sizes,
                           sig::Any a_scale_inv, sig::Any b_scale_inv, attr::Ragged ragged,
                           attr::ABlockRows a_block_rows, attr::ABlockCols a_block_cols,
                           attr::BBlockRows b_block_rows, attr::BBlockCols b_block_cols,
                           sig::AnyOut out) {
    return Run(ctx, GroupedGemm{a, b, group_sizes, a_scale_inv, b_scale_inv, *ragged, *a_block_rows,
                                *a_block_cols, *b_block_rows, *b_block_cols, out});
  }

  ffi::Error Check() {
    const Fp8Kind fa = Fp8KindOf(a.element_type()), fb = Fp8KindOf(b.element_type());
    if (fa == Fp8Kind::kInvalid) return BadArg(kName, "a must be float8_e4m3fn or float8_e5m2");
    if (fb == Fp8Kind::kInvalid) return BadArg(kName, "b must be float8_e4m3fn or float8_e5m2");
    if (fa == Fp8Kind::kE5M2 && fb == Fp8Kind::kE5M2) {
      return BadArg(kName, "a and b cannot both be float8_e5m2");
    }
    if (WideKindOf(out->element_type()) == WideKind::kInvalid) {
      return BadArg(kName, "out must be float32, bfloat16 or float16");
    }
    if (ragged != grouped::kRows && ragged != grouped::kContracting) {
      return BadArg(kName, "ragged must be 0 (rows) or 1 (contracting)");
    }
    const auto gs = group_sizes.dimensions();
    if (group_sizes.element_type() != ffi::DataType::S32 || gs.size() != 1 || gs[0] < 1) {
      return BadArg(kName, "group_sizes must be int32 [G], G >= 1");
    }
    p.form = ragged;
    p.groups = gs[0];
    FP8JAX_RETURN_IF_ERROR(CheckShapes());
    return CheckScales();
  }
  ffi::Error Compute(CpuPool pool);       // cpu/cpu_grouped_gemm.cc
  ffi::Error Compute(CudaStream stream);  // cuda/cuda_grouped_gemm.cu

  // Calls fn.template operator()<W, FA, FB>() for the output dtype and the two FP8 formats (after
  // Check: E5M2 x E5M2 is not among them). Not const: the oldest supported JAX's ffi::Result has
  // no const operator-> (its headers refuse out-> here in a const member).
  template <typename Fn>
  ffi::Error Dispatch(Fn&& fn) {
    const bool a4 = Fp8KindOf(a.element_type()) == Fp8Kind::kE4M3;
    const bool b4 = Fp8KindOf(b.element_type()) == Fp8Kind::kE4M3;
    return DispatchWide(kName, WideKindOf(out->element_type()), [&]<WideKind W>() {
      if (a4 && b4) return fn.template operator()<W, E4M3, E4M3>();
      if (a4) return fn.template operator()<W, E4M3, E5M2>();
      return fn.template operator()<W, E5M2, E4M3>();
    });
  }

 private:
  ffi::Error CheckShapes() {
    const auto da = a.dimensions(), db = b.dimensions(), dout = out->dimensions();
    if (p.form == grouped::kRows) {
      if (da.size() != 2 || db.size() != 3 || db[0] != p.groups || db[2] != da[1]) {
        return BadArg(kName, "ragged rows takes a [M, K] and b [G, N, K]");
      }
      p.rows = p.ragged = da[0];
      p.depth = da[1];
      p.cols = db[1];
      if (dout.size() != 2 || dout[0] != p.rows || dout[1] != p.cols) {
        return BadArg(kName, "out must be [M, N]");
      }
    } else {
      if (da.size() != 2 || db.size() != 2 || db[1] != da[1]) {
        return BadArg(kName, "ragged contracting takes a [K, M] and b [N, M]");
      }
      p.rows = da[0];
      p.depth = p.ragged = da[1];
      p.cols = db[0];
      if (dout.size() != 3 || dout[0] != p.groups || dout[1] != p.rows || dout[2] != p.cols) {
        return BadArg(kName, "out must be [G, K, N]");
      }
    }
    return ffi::Error::Success();
  }

  ffi::Error CheckScales() {
    p.blocks = a_block_rows != 0 || a_block_cols != 0 || b_block_rows != 0 || b_block_cols != 0;
    if (!p.blocks) {
      if (a_scale_inv.element_type() != ffi::DataType::F32 ||
          a_scale_inv.element_count() != p.groups) {
        return BadArg(kName, "a_scale_inv must be float32 [G] (one inverse scale per group)");
      }
      if (b_scale_inv.element_type() != ffi::DataType::F32 ||
          b_scale_inv.element_count() != p.groups) {
        return BadArg(kName, "b_scale_inv must be float32 [G] (one inverse scale per group)");
      }
      return ffi::Error::Success();
    }
    if (a_block_rows != 1 || a_block_cols < 1) {
      return BadArg(kName, "a_block must be 1 x w, w >= 1");
    }
    const bool rows = p.form == grouped::kRows;
    if (b_block_cols != a_block_cols || b_block_rows < 1 || (!rows && b_block_rows != 1)) {
      return BadArg(kName, rows ? "b_block must be br x w (a_block's w)"
                                : "b_block must be a_block (1 x w segment blocks)");
    }
    p.width = a_block_cols;
    p.b_block_rows = b_block_rows;
    const ffi::DataType st = a_scale_inv.element_type();
    p.e8m0 = st == ffi::DataType::F8E8M0FNU;
    if ((st != ffi::DataType::F32 && !p.e8m0) || b_scale_inv.element_type() != st) {
      return BadArg(kName,
                    "a_scale_inv and b_scale_inv must both be float32 or both float8_e8m0fnu");
    }
    int64_t a_grid_rows = p.rows;
    if (rows) {
      p.a_grid_cols = p.b_grid_cols = plan::CeilDiv(p.depth, p.width);
      p.b_grid_rows = plan::CeilDiv(p.cols, p.b_block_rows);
    } else {  // grouped_scaling.segment_grid_size
      const int64_t nb = plan::CeilDiv(p.ragged, p.width) + p.groups - 1;
      p.a_grid_cols = p.b_grid_cols = nb > 1 ? nb : 1;
      p.b_grid_rows = p.cols;
    }
    if (a_scale_inv.element_count() != a_grid_rows * p.a_grid_cols) {
      return BadArg(kName, "a_scale_inv must hold one scale per block of a");
    }
    const int64_t b_grid = (rows ? p.groups : 1) * p.b_grid_rows * p.b_grid_cols;
    if (b_scale_inv.element_count() != b_grid) {
      return BadArg(kName, "b_scale_inv must hold one scale per block of b");
    }
    return ffi::Error::Success();
  }
};

}  // namespace fp8jax
