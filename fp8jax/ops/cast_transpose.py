"""``cast_transpose``: one pass that writes an FP8 tensor and its transpose (last two dims).

Hopper's FP8 GEMM wants both operands K-major, so the backward pass needs the transposed FP8
copies of the activations and weights; producing them in the same pass as the cast saves a full
read of the high-precision tensor. Numerics are exactly those of :func:`fp8jax.ops.quantize`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import _ffi
from fp8jax.ops import _checks
from fp8jax.ops.quantize import quantize_reference

__all__ = ["cast_transpose", "cast_transpose_reference"]


def cast_transpose_reference(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`cast_transpose`."""
    q, scale_inv, amax = quantize_reference(x, scale, fp8_dtype)
    return q, jnp.swapaxes(q, -1, -2), scale_inv, amax


def cast_transpose(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantizes ``x`` and also returns the transpose; ``(q, q_t, scale_inv, amax)``.

    Args:
      x: float32, bfloat16 or float16 array of rank >= 2; ``q_t`` swaps its last two dims.
      scale: float32, shape ``()`` or ``(1,)``; one scale for the whole tensor.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

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
    _ffi.ensure_registered()
    t_shape = (*x.shape[:-2], x.shape[-1], x.shape[-2])
    out = (
        jax.ShapeDtypeStruct(x.shape, dt),
        jax.ShapeDtypeStruct(t_shape, dt),
        jax.ShapeDtypeStruct(scale.shape, jnp.float32),
        jax.ShapeDtypeStruct(scale.shape, jnp.float32),
    )
    call = jax.ffi.ffi_call("fp8jax_cast_transpose", out, vmap_method="broadcast_all")
    q, q_t, scale_inv, amax = call(x, scale)
    return q, q_t, scale_inv, amax
