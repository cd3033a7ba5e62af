"""Input validation shared by the ops: clear TypeError/ValueError before any kernel runs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.recipe import FP8_DTYPES

__all__ = []  # internal to fp8jax.ops: none of its names is public API

WIDE_DTYPES: tuple[np.dtype, ...] = (
    jnp.dtype(jnp.float32),
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float16),
)


def fp8_dtype_arg(op: str, name: str, dtype: Any) -> np.dtype:
    """Normalises an FP8 dtype argument or raises TypeError naming it."""
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt not in FP8_DTYPES:
        raise TypeError(f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got {dtype!r}")
    return dt


def wide_dtype_arg(op: str, name: str, dtype: Any) -> np.dtype:
    """Normalises a high-precision dtype argument (f32/bf16/f16) or raises TypeError."""
    try:
        dt = jnp.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dt not in WIDE_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, bfloat16 or float16, got {dtype!r}")
    return dt


def array_arg(op: str, name: str, value: Any) -> jax.Array:
    """Converts to a jax array, naming the argument when that is impossible."""
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        try:
            value = jnp.asarray(value)
        except TypeError as e:
            raise TypeError(f"{op}: {name} must be an array, got {type(value).__name__}") from e
    return value


def wide_array(op: str, name: str, value: Any) -> jax.Array:
    value = array_arg(op, name, value)
    if value.dtype not in WIDE_DTYPES:
        raise TypeError(
            f"{op}: {name} must be float32, bfloat16 or float16, got dtype {value.dtype}"
        )
    return value


def fp8_array(op: str, name: str, value: Any) -> jax.Array:
    value = array_arg(op, name, value)
    if value.dtype not in FP8_DTYPES:
        raise TypeError(
            f"{op}: {name} must be float8_e4m3fn or float8_e5m2, got dtype {value.dtype}"
        )
    return value


def scalar_f32(op: str, name: str, value: Any) -> jax.Array:
    """A float32 scale-like value of shape () or (1,) (TransformerEngine keeps (1,))."""
    value = array_arg(op, name, value)
    if value.dtype != jnp.float32:
        raise TypeError(f"{op}: {name} must be float32, got dtype {value.dtype}")
    if value.shape not in ((), (1,)):
        raise ValueError(
            f"{op}: {name} must hold one value, with shape () or (1,), got shape {value.shape}"
        )
    return value


AMAX_REDUCTIONS = ("split", "mesh")


def amax_reduction_arg(op: str, value: Any) -> str:
    """``"split"`` or ``"mesh"`` (see :func:`fp8jax.ops.base.partition.amax_axes`)."""
    if not isinstance(value, str) or value not in AMAX_REDUCTIONS:
        raise ValueError(f"{op}: amax_reduction must be 'split' or 'mesh', got {value!r}")
    return value
