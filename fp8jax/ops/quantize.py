"""``quantize`` and ``dequantize``: the FP8 casts, as FFI kernels beside their jnp references.

Numerics contract (DESIGN.md): ``q = saturate(round_to_nearest_even(x * scale))``, computed in
float32. Finite values beyond the format's largest value, and +-inf, saturate to +-max (the
``satfinite`` choice of NVIDIA's hardware); NaN stays NaN; signed zeros keep their sign.
``amax = max(|x|)`` of the *unscaled* input, NaN-propagating (like :func:`jnp.max`).
``scale_inv = 1 / scale`` travels with ``q``.

The kernels are bit-identical to the references on CPU and GPU. Under :func:`jax.vmap` each
batch element is its own tensor with its own scale and amax; the kernels take a leading group
dimension natively, so a vmapped call is still one launch.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import _ffi
from fp8jax.ops import _checks
from fp8jax.recipe import fp8_max

__all__ = ["dequantize", "dequantize_reference", "quantize", "quantize_reference"]


def _saturating_cast(y: jax.Array, fp8_dtype: Any) -> jax.Array:
    """float32 -> FP8 with saturation of finite overflow and inf; NaN stays NaN."""
    m = fp8_max(fp8_dtype)
    return jnp.clip(y, -m, m).astype(fp8_dtype)


def _amax(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """NaN-propagating max(|x|) as a max over the unsigned bits of |x|.

    For non-negative floats the unsigned order of the bits is the numeric order and every NaN
    sorts above inf, so this is exact and propagates NaN. (XLA:CPU's float max-reduction does not
    reliably propagate NaN over large inputs, so a plain ``jnp.max`` is not a usable reference.)
    """
    mag = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.uint32)
    a = jnp.max(mag, initial=jnp.uint32(0))
    return jnp.reshape(jax.lax.bitcast_convert_type(a, jnp.float32), shape)


def quantize_reference(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`quantize` (the definition of its numerics)."""
    y = x.astype(jnp.float32) * jnp.reshape(scale, ())
    q = _saturating_cast(y, fp8_dtype)
    return q, (1.0 / scale).astype(jnp.float32), _amax(x, scale.shape)


def quantize(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes ``x`` to FP8 with ``scale``; returns ``(q, scale_inv, amax)``.

    Args:
      x: float32, bfloat16 or float16 array of any rank.
      scale: float32, shape ``()`` or ``(1,)``.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.

    Returns:
      ``q`` (``x.shape``, ``fp8_dtype``), ``scale_inv`` and ``amax`` (float32, ``scale.shape``).

    >>> import jax.numpy as jnp, fp8jax
    >>> q, s_inv, amax = fp8jax.ops.quantize(jnp.array([1.0, -500.0]), jnp.float32(1.0),
    ...                                      jnp.float8_e4m3fn)
    >>> q.tolist(), float(amax)
    ([1.0, -448.0], 500.0)
    """
    op = "quantize"
    x = _checks.wide_array(op, "x", x)
    scale = _checks.scalar_f32(op, "scale", scale)
    dt = _checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    _ffi.ensure_registered()
    out = (
        jax.ShapeDtypeStruct(x.shape, dt),
        jax.ShapeDtypeStruct(scale.shape, jnp.float32),
        jax.ShapeDtypeStruct(scale.shape, jnp.float32),
    )
    call = jax.ffi.ffi_call("fp8jax_quantize", out, vmap_method="broadcast_all")
    q, scale_inv, amax = call(x, scale)
    return q, scale_inv, amax


def dequantize_reference(q: jax.Array, scale_inv: jax.Array, out_dtype: Any) -> jax.Array:
    """Pure-jnp reference of :func:`dequantize`: ``(float32(q) * scale_inv).astype(out_dtype)``."""
    return (q.astype(jnp.float32) * jnp.reshape(scale_inv, ())).astype(out_dtype)


def dequantize(q: jax.Array, scale_inv: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """Dequantizes FP8 ``q``: ``(float32(q) * scale_inv)`` rounded to ``out_dtype``.

    Args:
      q: ``float8_e4m3fn`` or ``float8_e5m2`` array of any rank.
      scale_inv: float32, shape ``()`` or ``(1,)``.
      out_dtype: float32, bfloat16 or float16.
    """
    op = "dequantize"
    q = _checks.fp8_array(op, "q", q)
    scale_inv = _checks.scalar_f32(op, "scale_inv", scale_inv)
    dt = _checks.wide_dtype_arg(op, "out_dtype", out_dtype)
    _ffi.ensure_registered()
    out = jax.ShapeDtypeStruct(q.shape, dt)
    return jax.ffi.ffi_call("fp8jax_dequantize", out, vmap_method="broadcast_all")(q, scale_inv)
