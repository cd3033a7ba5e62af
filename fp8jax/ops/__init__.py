"""fp8jax ops: each a pure-jnp reference beside its XLA FFI kernel binding. No Flax here.

:func:`implementation` chooses, per op family, the kernel or XLA's compilation of the reference;
:func:`gemm_options` how the FP8 GEMMs run on a GPU (autotuning, the MLP's fused epilogues, the
size below which a layer stays in high precision).
"""

from fp8jax.ops._block_gemm import block_gemm
from fp8jax.ops._implementation import get_implementation, implementation
from fp8jax.ops.activation import (
    activation,
    activation_cast_transpose,
    activation_cast_transpose_reference,
    activation_reference,
    dactivation,
    dactivation_cast_transpose_dbias,
    dactivation_cast_transpose_dbias_reference,
    dactivation_reference,
)
from fp8jax.ops.block_fused import (
    activation_block_cast_transpose,
    activation_block_cast_transpose_reference,
    activation_mxfp8_cast_transpose,
    block_cast_transpose_dbias,
    block_cast_transpose_dbias_reference,
    dactivation_block_cast_transpose_dbias,
    dactivation_block_cast_transpose_dbias_reference,
    dactivation_mxfp8_cast_transpose_dbias,
    mxfp8_cast_transpose_dbias,
    norm_block_cast_transpose,
    norm_block_cast_transpose_reference,
    norm_mxfp8_cast_transpose,
)
from fp8jax.ops.block_scaling import (
    block_cast_transpose,
    block_cast_transpose_reference,
    block_dequantize,
    block_quantize,
    block_quantize_reference,
    block_scaled_matmul,
    mxfp8_cast_transpose,
    mxfp8_quantize,
)
from fp8jax.ops.cast_transpose import (
    cast_transpose,
    cast_transpose_dbias,
    cast_transpose_dbias_reference,
    cast_transpose_reference,
)
from fp8jax.ops.gemm import gemm, gemm_reference
from fp8jax.ops.gemm_options import GemmOptions, gemm_options, get_gemm_options
from fp8jax.ops.norm import (
    norm_backward,
    norm_backward_reference,
    norm_forward,
    norm_forward_fp8,
    norm_forward_fp8_reference,
    norm_forward_reference,
)
from fp8jax.ops.norm_autodiff import layernorm, rmsnorm
from fp8jax.ops.quantize import (
    cast_to_representable,
    dequantize,
    dequantize_reference,
    quantize,
    quantize_reference,
)
from fp8jax.ops.scaling import update_fp8_state, update_fp8_states, update_fp8_states_reference

__all__ = [
    "GemmOptions",
    "activation",
    "activation_block_cast_transpose",
    "activation_block_cast_transpose_reference",
    "activation_cast_transpose",
    "activation_cast_transpose_reference",
    "activation_mxfp8_cast_transpose",
    "activation_reference",
    "block_cast_transpose",
    "block_cast_transpose_dbias",
    "block_cast_transpose_dbias_reference",
    "block_cast_transpose_reference",
    "block_dequantize",
    "block_gemm",
    "block_quantize",
    "block_quantize_reference",
    "block_scaled_matmul",
    "cast_to_representable",
    "cast_transpose",
    "cast_transpose_dbias",
    "cast_transpose_dbias_reference",
    "cast_transpose_reference",
    "dactivation",
    "dactivation_block_cast_transpose_dbias",
    "dactivation_block_cast_transpose_dbias_reference",
    "dactivation_cast_transpose_dbias",
    "dactivation_cast_transpose_dbias_reference",
    "dactivation_mxfp8_cast_transpose_dbias",
    "dactivation_reference",
    "dequantize",
    "dequantize_reference",
    "gemm",
    "gemm_options",
    "gemm_reference",
    "get_gemm_options",
    "get_implementation",
    "implementation",
    "layernorm",
    "mxfp8_cast_transpose",
    "mxfp8_cast_transpose_dbias",
    "mxfp8_quantize",
    "norm_backward",
    "norm_backward_reference",
    "norm_block_cast_transpose",
    "norm_block_cast_transpose_reference",
    "norm_forward",
    "norm_forward_fp8",
    "norm_forward_fp8_reference",
    "norm_forward_reference",
    "norm_mxfp8_cast_transpose",
    "quantize",
    "quantize_reference",
    "rmsnorm",
    "update_fp8_state",
    "update_fp8_states",
    "update_fp8_states_reference",
]
