"""Helpers shared by the test files: random inputs and the device meshes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

MESHES = {"8": ((8,), ("data",)), "2x4": ((2, 4), ("data", "model"))}
"""The meshes of the distributed tests, by name: (shape, axis names)."""


def rand(shape, seed=0, scale=1.0) -> jax.Array:
    """float32 standard normal values times ``scale``, from ``seed``."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, jnp.float32)


def make_mesh(name: str = "2x4") -> Mesh:
    """The mesh ``name`` of :data:`MESHES` on the first devices (automatic axes)."""
    shape, names = MESHES[name]
    return Mesh(np.array(jax.devices()[: math.prod(shape)]).reshape(shape), names)
