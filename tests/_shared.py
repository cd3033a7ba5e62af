"""Helpers shared by the test files: random inputs and the device meshes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

MESHES = {"8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model"))}
"""The meshes of the distributed tests, by name: (shape, axis names)."""


def normal(rng, shape, dtype=jnp.float32, scale=1.0, shift=0.0) -> jax.Array:
    """Normal values times ``scale`` plus ``shift``, drawn in float64, rounded to float32, then
    cast to ``dtype``. ``rng``: a ``np.random.Generator`` (its stream goes on: several draws
    from one seed) or a seed."""
    rng = np.random.default_rng(rng)  # a Generator comes back as itself
    return jnp.asarray((rng.standard_normal(shape) * scale + shift).astype(np.float32), dtype)


def rand(shape, seed=0, scale=1.0) -> jax.Array:
    """float32 standard normal values times ``scale``, from ``seed``."""
    return normal(seed, shape, jnp.float32, scale)


def make_mesh(name="2x4", *, names=None, explicit=False) -> Mesh:
    """A mesh on the first devices: ``name`` is one of :data:`MESHES` or a shape (then the axes
    are ``("data", "model")``, as many as it has dims); ``names`` overrides the axis names.
    ``explicit``: ``AxisType.Explicit`` axes (shardings are part of the types, what
    ``jax.make_mesh`` gives by default), else automatic ones; skips the test on a JAX without
    explicit sharding (no ``jax.sharding.AxisType`` or ``jax.set_mesh``)."""
    if isinstance(name, str):
        shape, default_names = MESHES[name]
    else:
        shape, default_names = tuple(name), ("data", "model")[: len(name)]
    names = tuple(names or default_names)
    devices = jax.devices()[: math.prod(shape)]
    if not explicit:
        return Mesh(np.array(devices).reshape(shape), names)
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None or not hasattr(jax, "set_mesh"):
        pytest.skip("this JAX has no explicit sharding mode")
    return jax.make_mesh(
        shape, names, axis_types=(axis_type.Explicit,) * len(shape), devices=devices
    )
