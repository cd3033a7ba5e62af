"""How fp8jax's Linen modules declare their params, shared by all of them: an initializer drawn
in a flat (2-D) shape and reshaped, as Flax's ``DenseGeneral`` draws its kernel, and logical axis
names (the boxing of an initializer, the sharding constraint of an activation)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from flax.typing import Initializer

__all__ = ["annotated", "as_tuple", "check_names", "constrain", "flat_init"]


def as_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(value)


def flat_init(init: Initializer, flat_shape: tuple[int, ...]) -> Any:
    """Wraps ``init`` to draw a ``flat_shape`` tensor and reshape it (as Flax's DenseGeneral)."""

    def wrapped(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
        value = init(rng, flat_shape, dtype)
        if isinstance(value, meta.AxisMetadata):
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)

    return wrapped


def check_names(owner: str, name: str, names: Any, ndim: int) -> tuple[str | None, ...]:
    """``names`` as a tuple of ``ndim`` logical axis names (str or None); ValueError otherwise."""
    if isinstance(names, str):
        names = (names,)
    try:
        out = tuple(names)
    except TypeError:
        raise TypeError(
            f"{owner}: {name} must be a tuple of axis names (str or None), got {names!r}"
        ) from None
    if any(n is not None and not isinstance(n, str) for n in out):
        raise TypeError(f"{owner}: {name} must hold str or None, got {names!r}")
    if len(out) != ndim:
        raise ValueError(f"{owner}: {name}={names!r} must name {ndim} dims, got {len(out)}")
    return out


def constrain(owner: str, name: str, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` with logical axis ``names`` as a sharding constraint (nothing when empty)."""
    if not names:
        return x
    return nn.with_logical_constraint(x, check_names(owner, name, names, x.ndim))


def annotated(owner: str, name: str, init: Any, names: Any, ndim: int) -> Any:
    """``init`` boxed with logical axis ``names``; ``init`` itself when ``names`` is empty."""
    if not names:
        return init
    return nn.with_logical_partitioning(init, check_names(owner, name, names, ndim))
