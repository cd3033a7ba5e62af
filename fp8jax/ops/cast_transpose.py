"""``cast_transpose``: one pass that writes an FP8 tensor and its transpose (last two dims).

Hopper's FP8 GEMM wants both operands K-major, so the backward pass needs the transposed FP8
copies of the activations and weights; producing them in the same pass as the cast saves a full
read of the high-precision tensor. Numerics are exactly those of :func:`fp8jax.ops.quantize`.

Sharding: under :func:`jax.jit` on a mesh, ``q`` keeps the sharding of ``x`` and ``q_t`` gets it
with the last two dimensions' shardings swapped (each device transposes its own block, which is
the matching block of the global transpose), so nothing is gathered; ``amax`` is the global max,
made so by one all-reduce over exactly the mesh axes that split ``x``. Inside a ``shard_map``
body ``amax`` is the local block's own, as for :func:`~fp8jax.ops.quantize`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import _ffi
from fp8jax.ops import _checks, _partition
from fp8jax.ops.quantize import quantize_reference

__all__ = ["cast_transpose", "cast_transpose_reference"]


def cast_transpose_reference(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`cast_transpose`."""
    q, scale_inv, amax = quantize_reference(x, scale, fp8_dtype)
    return q, jnp.swapaxes(q, -1, -2), scale_inv, amax


def cast_transpose(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any, *, amax_reduction: str = "split"
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantizes ``x`` and also returns the transpose; ``(q, q_t, scale_inv, amax)``.

    Args:
      x: float32, bfloat16 or float16 array of rank >= 2; ``q_t`` swaps its last two dims.
      scale: float32, shape ``()`` or ``(1,)``; one scale for the whole tensor.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      amax_reduction: ``"split"`` (default) or ``"mesh"``, as for
        :func:`~fp8jax.ops.quantize`.

    Returns:
      ``q`` (``x.shape``), ``q_t`` (``x.shape[:-2] + (x.shape[-1], x.shape[-2])``), both
      ``fp8_dtype``, and float32 ``scale_inv`` and ``amax`` of ``scale.shape``.
    """
    op = "cast_transpose"
    x = _checks.wide_array(op, "x", x)
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 2 to be transposed, got shape {x.shape}")
    scale = _checks.scalar_f32(op, "scale", scale)
    dt = _checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    reduction = _checks.amax_reduction_arg(op, amax_reduction)
    _ffi.ensure_registered()
    q, q_t, scale_inv, amax = _cast_transpose_call(x, scale, dt, reduction)
    return q, q_t, scale_inv, amax


# ------------------------------------------------------------------ partitioned kernel call
# ``n_batch`` counts the leading batch dimensions that vmap added (see fp8jax.ops._partition).


def _kernel(fp8_dtype: Any) -> Any:
    def kernel(x, scale):
        t_shape = (*x.shape[:-2], x.shape[-1], x.shape[-2])
        out = (
            _partition.result(x.shape, fp8_dtype, x),
            _partition.result(t_shape, fp8_dtype, x, transpose=True),
            _partition.result(scale.shape, jnp.float32, scale),
            _partition.result(scale.shape, jnp.float32, scale),
        )
        call = jax.ffi.ffi_call("fp8jax_cast_transpose", out, vmap_method="broadcast_all")
        return call(x, scale)

    return kernel


def _rule(n_batch: int, x_ndim: int, scale_ndim: int) -> str:
    """The Shardy rule, e.g. ``"m n, s -> m n, n m, s, s"`` for a matrix and a ``(1,)`` scale."""
    lead = _partition.factors("g", n_batch) + _partition.factors("d", x_ndim - n_batch - 2)
    x = " ".join([*lead, "m", "n"])
    t = " ".join([*lead, "n", "m"])
    s = " ".join(_partition.factors("g", n_batch) + ["s"] * (scale_ndim - n_batch))
    return f"{x}, {s} -> {x}, {t}, {s}, {s}"


@functools.cache
def _partitioned(fp8_dtype: Any, reduction: str, n_batch: int, x_ndim: int, scale_ndim: int) -> Any:
    def plan(mesh, arg_shapes):
        x, scale = arg_shapes
        dims = _partition.dim_axes(x.sharding, x.shape)
        xs = _partition.named(mesh, dims)
        ts = _partition.named(mesh, (*dims[:-2], dims[-1], dims[-2]))
        ss = _partition.named(mesh, _partition.batch_only(dims, n_batch, scale.ndim))
        amax_axes = _partition.amax_axes(mesh, dims[n_batch:], reduction)
        local = _partition.pmax_outputs(kernel, ((), (), (), amax_axes))
        return (xs, ss), (xs, ts, ss, ss), local

    kernel = _kernel(fp8_dtype)
    return _partition.partitioned(kernel, plan, _rule(n_batch, x_ndim, scale_ndim))


def _op(fp8_dtype: Any, reduction: str, n_batch: int) -> Any:
    return lambda x, s: _partitioned(fp8_dtype, reduction, n_batch, x.ndim, s.ndim)(x, s)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _cast_transpose_call(x, scale, fp8_dtype, reduction):
    return _partition.batchable_call(functools.partial(_op, fp8_dtype, reduction), x, scale)
