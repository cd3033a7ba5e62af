"""``rowwise_gemm``: the row-wise scaled FP8 GEMM (``Float8RowwiseScaling``, issue 49), cuBLASLt's
outer-vector scale mode on a Hopper GPU when asked for, beside its XLA reference
(:func:`~fp8jax.ops.block.rowwise.rowwise_scaled_matmul`).

``a_q`` [M, K] and ``b_q`` [N, K] are K-major FP8 codes with one float32 inverse scale per row
(``[M, 1]`` and ``[N, 1]``, as :func:`~fp8jax.ops.block.rowwise.rowwise_quantize` returns them);
``out[M, N] = (a8 @ b8.T) * sa[:, None] * sb[None, :]``, products summed in float32.

Per platform (:func:`jax.lax.platform_dependent`):

- CPU, and any platform but CUDA: the reference, XLA's float32 dot scaled by the outer product of
  the scales (bit for bit what ``rowwise_scaled_matmul`` gives).
- CUDA, with the ``"gemm"`` family's ``"kernel"`` implementation **and** the opt-in
  ``fp8jax.ops.gemm_options(rowwise_cublaslt=True)``: the ``fp8jax_gemm`` custom call (cuBLASLt)
  with ``CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`` (scale mode 3) for both operands and split
  accumulation; M, N and K are zero-padded to multiples of 16 (zero codes add exact zeros, a
  padded row's scale is 1), the scales go as flat float32 vectors of M and N and the result is
  sliced back. The mode is documented for Hopper (sm_90, cuBLAS 12.9); any other GPU runs the
  reference, decided when the function is traced from the first GPU's compute capability, and
  the handler checks the device again (kUnimplemented, never a wrong result).

Opt-in because no GPU has run it yet: without ``rowwise_cublaslt=True`` (its default is
``False``) the reference runs on every platform, whatever the implementation choice; with it,
``implementation="xla"`` (or the family's ``"xla"``) still forces the reference.

On a mesh (the CUDA path), as :func:`~fp8jax.ops.gemms.blockwise.block_gemm`'s plan: ``a``'s rows
(M: data and sequence parallelism) and ``b``'s rows (N: tensor parallelism) stay split, each
device multiplying its own output tile with its rows' scales and no collective; a split K (the
wgrad's tokens under data parallelism) stays split, each device's float32 partial product (its K
slice, scaled by the same row scales) summed with one ``psum`` (the same value in another
summation order). Every row scale covers the whole row, so no split can cut a scale's block.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import _ffi
from fp8jax.ops.base import partition, switch
from fp8jax.ops.block.rowwise import rowwise_scaled_matmul
from fp8jax.ops.gemms.blockwise import gpu_runs
from fp8jax.ops.gemms.gemm import PAD_MULTIPLE, WORKSPACE_BYTES, round_up
from fp8jax.ops.gemms.gemm_options import get_gemm_options

__all__ = ["rowwise_gemm"]

switch.register_family("gemm", "rowwise_gemm")

# cuBLASLt's CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F (cublasLt.h; blockscale::kOuterVec).
ROWWISE_SCALE_MODE = 3


def _padded(q: jax.Array, s: jax.Array, rows_p: int, k_p: int) -> tuple[jax.Array, jax.Array]:
    """Codes padded with zeros to ``rows_p`` x ``k_p``; the scales a flat vector of ``rows_p``,
    1 for a padded row."""
    rows, k = q.shape
    if (rows, k) != (rows_p, k_p):
        q = jnp.pad(q, ((0, rows_p - rows), (0, k_p - k)))
    s = jnp.reshape(s, (rows,))
    if rows != rows_p:
        s = jnp.pad(s, (0, rows_p - rows), constant_values=np.float32(1))
    return q, s


def _cuda_2d(a_q, a_s, b_q, b_s, *, out_dtype, autotune=True):
    """One device's GEMM on cuBLASLt: padded operands, OUTER_VEC_32F for both."""
    (m, k), n = a_q.shape, b_q.shape[0]
    m_p, n_p, k_p = (round_up(d, PAD_MULTIPLE) for d in (m, n, k))
    a_q, a_v = _padded(a_q, a_s, m_p, k_p)
    b_q, b_v = _padded(b_q, b_s, n_p, k_p)
    out_types = (
        jax.ShapeDtypeStruct((m_p, n_p), out_dtype),
        jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8),
    )
    out, _ = jax.ffi.ffi_call("fp8jax_gemm", out_types)(
        a_q, b_q, a_v, b_v, jnp.zeros((0,), out_dtype),
        has_bias=np.int64(0), fast_accum=np.int64(0), a_scale_mode=np.int64(ROWWISE_SCALE_MODE),
        b_scale_mode=np.int64(ROWWISE_SCALE_MODE), autotune=np.int64(autotune),
    )  # fmt: skip
    return out[:m, :n]


@functools.cache
def _partitioned_cuda(out_dtype, autotune=True):
    """The CUDA path, split along ``a``'s and ``b``'s rows and K on a mesh (module docstring)."""

    def local(a_q, a_s, b_q, b_s):
        return (_cuda_2d(a_q, a_s, b_q, b_s, out_dtype=out_dtype, autotune=autotune),)

    def k_split(k_axes, a_q, a_s, b_q, b_s):  # each device's K slice, then one psum
        part = _cuda_2d(a_q, a_s, b_q, b_s, out_dtype=jnp.dtype(jnp.float32), autotune=autotune)
        return (jax.lax.psum(part, k_axes).astype(out_dtype),)

    def plan(mesh, arg_shapes):
        a, b = arg_shapes[0], arg_shapes[2]

        def axes(x, dim, taken=()):
            found = partition.dim_axes(x.sharding, x.shape)[dim]
            found = tuple(v for v in found if v not in taken)
            # an uneven split is gathered (each device must hold whole rows, whole K columns)
            return found if partition.whole_blocks(mesh, found, x.shape[dim], 1) else ()

        m_axes = axes(a, 0)
        n_axes = axes(b, 0, m_axes)
        k_axes = axes(a, 1, m_axes + n_axes)
        a_sh, b_sh = (partition.named(mesh, (d, k_axes)) for d in (m_axes, n_axes))
        a_s_sh, b_s_sh = (partition.named(mesh, (d, ())) for d in (m_axes, n_axes))
        out = partition.named(mesh, (m_axes, n_axes))
        fn = functools.partial(k_split, k_axes) if k_axes else local
        return [a_sh, a_s_sh, b_sh, b_s_sh], [out], fn

    call = partition.partitioned(local, plan, "m k, m i, n k, n j -> m n",
                                 need_replication=("i", "j"))  # fmt: skip
    return lambda *args: call(*args)[0]


def rowwise_gemm(
    a_q: jax.Array,
    a_scale_inv: jax.Array,
    b_q: jax.Array,
    b_scale_inv: jax.Array,
    out_dtype: Any = jnp.float32,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """``a @ b.T`` of row-wise scaled K-major FP8 codes (see the module docstring): the
    arguments and the result of :func:`~fp8jax.ops.block.rowwise.rowwise_scaled_matmul`, on
    cuBLASLt's outer-vector scale mode where opted in (``gemm_options(rowwise_cublaslt=True)``)
    and the GPU has it.

    Args:
      a_q: FP8 ``[M, K]``.
      a_scale_inv: float32 ``[M, 1]``, one inverse scale per row of ``a_q``.
      b_q: FP8 ``[N, K]``.
      b_scale_inv: float32 ``[N, 1]``.
      out_dtype: float32, bfloat16 or float16.
      implementation: ``"kernel"`` or ``"xla"`` (the reference on every platform); default: the
        enclosing :func:`fp8jax.ops.implementation` choice for ``"gemm"``. ``"kernel"`` runs
        cuBLASLt only under ``gemm_options(rowwise_cublaslt=True)``.

    Returns:
      ``out_dtype`` ``[M, N]``.

    Raises:
      ValueError: operands that are not FP8 matrices with the same K, scales not float32 of one
        per row, a bad ``out_dtype`` or ``implementation`` (each naming the argument).
    """
    impl = switch.choose("rowwise_gemm", "gemm", implementation)
    args = (a_q, a_scale_inv, b_q, b_scale_inv)
    if (
        impl == "xla"
        or not get_gemm_options().rowwise_cublaslt
        or not gpu_runs((ROWWISE_SCALE_MODE, ROWWISE_SCALE_MODE))
    ):
        return rowwise_scaled_matmul(*args, out_dtype)

    def reference(a_q, a_s, b_q, b_s):
        return rowwise_scaled_matmul(a_q, a_s, b_q, b_s, out_dtype)

    out_dt = jax.eval_shape(reference, *args).dtype  # the argument checks
    _ffi.ensure_registered()
    cuda = _partitioned_cuda(jnp.dtype(out_dt), get_gemm_options().autotune)

    def by_platform(*xs):
        return lax.platform_dependent(*xs, cuda=cuda, default=reference)

    if not partition.explicit_mesh():
        return by_platform(*args)
    # Explicit sharding: both branches typed with the sharding the GEMM's rule gives the result
    # (custom partitioning wants the mesh axes automatic inside).
    out_spec = partition.explicit_matmul_spec(a_q, b_q, b_rows_are_n=True)
    return jax.sharding.auto_axes(by_platform, out_sharding=out_spec)(*args)
