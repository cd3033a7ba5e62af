"""``block_gemm``: the block-scaled FP8 GEMM, cuBLASLt on a GPU that has the scale modes, beside
its XLA reference (:func:`~fp8jax.ops.block.block_scaling.block_scaled_matmul`).

``a_q`` [M, K] and ``b_q`` [N, K] are K-major FP8 codes, each with its compact scale grid (as
:func:`~fp8jax.ops.block.block_scaling.block_quantize` and ``mxfp8_quantize`` return it) and its
block; ``out[M, N]`` is every element dequantized with its block's scale, products summed in
float32 (docs/numerics.md, "Block scaling").

Per platform (:func:`jax.lax.platform_dependent`):

- CPU, and any platform but CUDA: the reference, XLA's dequantize and float32 dot.
- CUDA, with the ``"gemm"`` family's ``"kernel"`` implementation: the ``fp8jax_gemm`` custom call
  (cuBLASLt) with the operands' scale modes (``VEC128_32F`` for 1 x 128 blocks,
  ``BLK128x128_32F`` for 128 x 128, ``VEC32_UE8M0`` for MXFP8) and split accumulation; K, M and N
  are zero-padded to multiples of 16 (zero codes add exact zeros; a 1-row-block operand's scale
  grid gets rows of 1 for its padded rows), the scales are laid out as cuBLASLt reads them
  (:func:`~fp8jax.ops.block.block_scaling.cublaslt_scales`) and the result is sliced back. A GPU
  without a mode (1 x 128 or 128 x 128 blocks need sm_90; MXFP8 needs sm_100 or later) runs the
  reference instead, decided when the function is traced from the first GPU's compute
  capability; the handler checks the device again and fails with kUnimplemented, never a wrong
  result, if it lacks the mode.

On a mesh (the CUDA kernel path), each dim stays split as it is where every device holds whole
blocks of it (else it is gathered first): ``a``'s rows (M: data and sequence parallelism) and
``b``'s rows (N: tensor parallelism, the weight's output features), each device multiplying its
own tile of the output with no collective; and K (the wgrad GEMM's tokens under data
parallelism), each device multiplying its own K blocks in float32, summed with one ``psum`` (as
the per-tensor GEMM's plan does: the same value in another summation order).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import _ffi, _support
from fp8jax.ops.base import partition, switch
from fp8jax.ops.block.block_scaling import (
    CUBLASLT_SCALE_MODES,
    block_scaled_matmul,
    check_block,
    cublaslt_scales,
)
from fp8jax.ops.gemms.gemm import PAD_MULTIPLE, WORKSPACE_BYTES, round_up
from fp8jax.ops.gemms.gemm_options import get_gemm_options

__all__ = ["block_gemm"]

switch.register_family("gemm", "block_gemm")


def scale_mode_unsupported(mode: int, cc_major: int) -> str:
    """Why a GPU of compute capability ``cc_major``.x cannot run cuBLASLt scale mode ``mode``
    (``""``: it can); the handler's own check (``ScaleModeUnsupported``, cpp/cuda/gemm_cublaslt.cc),
    less the cuBLAS version, which the build fixes (13.1)."""
    if mode in (4, 5) and cc_major != 9:
        return "1 x 128 and 128 x 128 block scales need an sm_90 (Hopper) GPU"
    if mode == 2 and cc_major < 10:
        return "MXFP8 (VEC32_UE8M0) scales need an sm_100 or later GPU"
    if mode == 3 and cc_major != 9:
        return "row-wise (OUTER_VEC_32F) scales need an sm_90 (Hopper) GPU"
    return ""


def gpu_runs(modes: tuple[int, int]) -> bool:
    """Whether this process's GPU runs both scale modes; ``True`` when it has no GPU (a program
    lowered for CUDA elsewhere: the handler checks the device it runs on)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return True
    cc = _support.capability(devices[0])
    return cc is None or not any(scale_mode_unsupported(m, cc[0]) for m in modes)


def _pad_to(x: jax.Array, rows: int, cols: int, value: Any = 0) -> jax.Array:
    pad = ((0, rows - x.shape[0]), (0, cols - x.shape[1]))
    return x if pad == ((0, 0), (0, 0)) else jnp.pad(x, pad, constant_values=value)


def _operand(q, scale, block, rows_p, k_p):
    """One operand padded to ``rows_p`` x ``k_p`` with its scales in cuBLASLt's layout. Padding
    to multiples of 16 adds no block along K, nor along the rows of 128-row blocks; a 1-row-block
    grid gets one row of scale 1 per padded row (E8M0: 127, i.e. 1)."""
    q = _pad_to(q, rows_p, k_p)
    if block[0] == 1 and scale.dtype == jnp.float8_e8m0fnu:  # padded as bits: 127 is 2**0
        bits = _pad_to(lax.bitcast_convert_type(scale, jnp.uint8), rows_p, scale.shape[1], 127)
        scale = lax.bitcast_convert_type(bits, scale.dtype)
    elif block[0] == 1:
        scale = _pad_to(scale, rows_p, scale.shape[1], np.float32(1))
    return q, cublaslt_scales(scale, block, rows_p, k_p)


def _cuda_2d(a_q, a_s, b_q, b_s, *, a_block, b_block, out_dtype, autotune=True):
    (m, k), n = a_q.shape, b_q.shape[0]
    m_p, n_p, k_p = (round_up(d, PAD_MULTIPLE) for d in (m, n, k))
    a_q, a_sl = _operand(a_q, a_s, a_block, m_p, k_p)
    b_q, b_sl = _operand(b_q, b_s, b_block, n_p, k_p)
    out_types = (
        jax.ShapeDtypeStruct((m_p, n_p), out_dtype),
        jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8),
    )
    out, _ = jax.ffi.ffi_call("fp8jax_gemm", out_types)(
        a_q, b_q, a_sl, b_sl, jnp.zeros((0,), out_dtype),
        has_bias=np.int64(0), fast_accum=np.int64(0),
        a_scale_mode=np.int64(CUBLASLT_SCALE_MODES[a_block]),
        b_scale_mode=np.int64(CUBLASLT_SCALE_MODES[b_block]), autotune=np.int64(autotune),
    )  # fmt: skip
    return out[:m, :n]


@functools.cache
def _partitioned_cuda(a_block, b_block, out_dtype, autotune=True):
    """The CUDA path, split along ``a``'s and ``b``'s rows on a mesh (see the module
    docstring)."""

    def local(a_q, a_s, b_q, b_s):
        return (_cuda_2d(a_q, a_s, b_q, b_s, a_block=a_block, b_block=b_block,
                         out_dtype=out_dtype, autotune=autotune),)  # fmt: skip

    def k_split(k_axes, a_q, a_s, b_q, b_s):  # each device's K blocks, then one psum
        part = _cuda_2d(a_q, a_s, b_q, b_s, a_block=a_block, b_block=b_block,
                        out_dtype=jnp.dtype(jnp.float32), autotune=autotune)  # fmt: skip
        return (jax.lax.psum(part, k_axes).astype(out_dtype),)

    def plan(mesh, arg_shapes):
        a, b = arg_shapes[0], arg_shapes[2]

        def axes(x, dim, size, block, taken=()):
            found = partition.dim_axes(x.sharding, x.shape)[dim]
            found = tuple(v for v in found if v not in taken)
            # a device would hold part of a block: gather the dim
            return found if partition.whole_blocks(mesh, found, size, block) else ()

        m_axes = axes(a, 0, a.shape[0], a_block[0])
        n_axes = axes(b, 0, b.shape[0], b_block[0], m_axes)
        k_axes = axes(a, 1, a.shape[1], a_block[1], m_axes + n_axes)
        a_sh, b_sh = (partition.named(mesh, (d, k_axes)) for d in (m_axes, n_axes))
        out = partition.named(mesh, (m_axes, n_axes))
        fn = functools.partial(k_split, k_axes) if k_axes else local
        return [a_sh, a_sh, b_sh, b_sh], [out], fn

    rule = "m k, ma ka, n k, nb kb -> m n"
    call = partition.partitioned(local, plan, rule)
    return lambda *args: call(*args)[0]


def block_gemm(
    a_q: jax.Array,
    a_scale_inv: jax.Array,
    a_block: tuple[int, int],
    b_q: jax.Array,
    b_scale_inv: jax.Array,
    b_block: tuple[int, int],
    out_dtype: Any = jnp.float32,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``a @ b.T`` of block-scaled K-major FP8 codes (see the module docstring): the arguments
    and the result of :func:`~fp8jax.ops.block.block_scaling.block_scaled_matmul`, on cuBLASLt where
    the GPU has the scale modes. ``implementation``: ``"kernel"`` or ``"xla"`` (the reference on
    every platform); default: the enclosing :func:`fp8jax.ops.implementation` choice for
    ``"gemm"``."""
    a_block = check_block("block_gemm", a_block)
    b_block = check_block("block_gemm", b_block)
    impl = switch.choose("block_gemm", "gemm", implementation)
    modes = (CUBLASLT_SCALE_MODES.get(a_block), CUBLASLT_SCALE_MODES.get(b_block))
    supported = None not in modes and a_block[1] == b_block[1]
    if impl == "xla" or not supported or not gpu_runs(modes):
        return block_scaled_matmul(a_q, a_scale_inv, a_block, b_q, b_scale_inv, b_block,
                                   out_dtype)  # fmt: skip

    def reference(a_q, a_s, b_q, b_s):
        return block_scaled_matmul(a_q, a_s, a_block, b_q, b_s, b_block, out_dtype)

    jax.eval_shape(reference, a_q, a_scale_inv, b_q, b_scale_inv)  # the argument checks
    _ffi.ensure_registered()
    cuda = _partitioned_cuda(a_block, b_block, jnp.dtype(out_dtype), get_gemm_options().autotune)

    def by_platform(*args):
        return lax.platform_dependent(*args, cuda=cuda, default=reference)

    args = (a_q, a_scale_inv, b_q, b_scale_inv)
    if not partition.explicit_mesh():
        return by_platform(*args)
    # Explicit sharding: both branches typed with the sharding the GEMM's rule gives the result
    # (custom partitioning wants the mesh axes automatic inside).
    out_spec = partition.explicit_matmul_spec(a_q, b_q, b_rows_are_n=True)
    return jax.sharding.auto_axes(by_platform, out_sharding=out_spec)(*args)
