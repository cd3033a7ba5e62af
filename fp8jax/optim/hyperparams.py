"""Checks of the optimizers' hyperparameters, shared by :mod:`fp8jax.optim.adam` and
:mod:`fp8jax.optim.rounding`.

A hyperparameter arrives as a Python number, a numpy scalar (``np.float32(1e-3)``), a jax array
(what ``optax.inject_hyperparams`` passes, a tracer under ``jit``), a schedule, or, from a config
file, a string. Numbers, numpy scalars and concrete scalar arrays go through the same range
check; a tracer is the caller's (its value is not known while tracing); anything else is a
TypeError naming the argument, before the value reaches numpy or XLA.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["check_bool", "check_int", "check_scalar"]

#: What to pass to ``optax.inject_hyperparams`` so that it leaves the integers alone.
STATIC_ARGS = ("block_size", "seed")


def _describe(value: Any) -> str:
    """``str '1e-3'``: the type's name and the value, for error messages."""
    if isinstance(value, jax.Array | np.ndarray) and not isinstance(value, np.generic):
        kind = "numpy array" if isinstance(value, np.ndarray) else "jax array"
        if isinstance(value, jax.core.Tracer):
            kind = "traced jax array"
        return f"a {kind} of dtype {value.dtype} and shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _is_bool(value: Any) -> bool:
    if isinstance(value, bool | np.bool_):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and np.dtype(dtype) == np.bool_


def check_scalar(
    owner: str,
    name: str,
    value: Any,
    lo: float,
    hi: float | None = None,
    *,
    schedule: bool = False,
) -> None:
    """Check a real hyperparameter: finite and in ``[lo, hi)`` (``>= lo`` without ``hi``).

    Python and numpy numbers and concrete scalar arrays are range-checked by value; a tracer
    passes (its value is not known); a callable passes where ``schedule`` allows one.

    Raises:
      TypeError: a bool, a string, a complex or any other non-number (a callable where no
        schedule is allowed), named with its type.
      ValueError: a value out of range or not finite, or an array that is not a scalar.
    """
    kinds = "a number, a schedule or a jax array" if schedule else "a number or a jax array"
    if _is_bool(value) or (callable(value) and not schedule):
        raise TypeError(f"{owner}: {name} must be {kinds}, got {_describe(value)}")
    if callable(value):
        return
    if isinstance(value, jax.Array | np.ndarray) and not isinstance(value, np.generic):
        if not jnp.issubdtype(value.dtype, jnp.integer) and not jnp.issubdtype(
            value.dtype, jnp.floating
        ):
            raise TypeError(f"{owner}: {name} must be {kinds}, got {_describe(value)}")
        if value.ndim != 0:
            raise ValueError(f"{owner}: {name} must be a scalar, got {_describe(value)}")
        if isinstance(value, jax.core.Tracer):
            return
    elif not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be {kinds}, got {_describe(value)}")
    x = float(value)
    if not math.isfinite(x) or x < lo or (hi is not None and x >= hi):
        want = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        hint = ""
        dtype = getattr(value, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
            hint = (
                f" ({dtype} rounds it; optax.inject_hyperparams gives the hyperparameters the "
                "params' dtype unless told hyperparam_dtype=jnp.float32)"
            )
        raise ValueError(f"{owner}: {name} must be a finite number {want}, got {value!r}{hint}")


def check_int(owner: str, name: str, value: Any, lo: int | None = None) -> int:
    """A Python or numpy integer hyperparameter as a Python ``int`` (at least ``lo``).

    Raises:
      TypeError: a bool, a float, a string, a jax array (``optax.inject_hyperparams`` turns an
        int into one unless it is among its ``static_args``) or any other non-integer.
      ValueError: an integer below ``lo``.
    """
    want = "a positive int" if lo == 1 else "an int"
    if isinstance(value, jax.Array) and not _is_bool(value):
        raise TypeError(
            f"{owner}: {name} must be {want}, got {_describe(value)}: it cannot be traced. "
            "optax.inject_hyperparams turns numbers into arrays unless they are static: "
            f"optax.inject_hyperparams(fp8jax.optim.adamw, static_args={STATIC_ARGS})"
        )
    if _is_bool(value) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{owner}: {name} must be {want}, got {_describe(value)}")
    if lo is not None and value < lo:
        raise ValueError(f"{owner}: {name} must be {want}, got {value!r}")
    return int(value)


def check_bool(owner: str, name: str, value: Any) -> bool:
    """A Python or numpy bool as a Python ``bool``; TypeError for anything else."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{owner}: {name} must be a bool, got {_describe(value)}")
    return bool(value)
