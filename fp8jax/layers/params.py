"""A layer's params as data, and how both Flax APIs draw them alike.

A layer's config lists its params with :func:`param_specs`-style methods: ``{name:
ParamSpec(shape, dtype, init, axes, axes_arg)}`` in the order they are created. The Linen module
creates each with ``self.param(name, init, shape, dtype)`` (boxed with its logical axis names);
the NNX module draws ``init(key, shape, dtype)`` into an ``nnx.Param`` (the names as its
sharding metadata). The same key gives the same params in both APIs because the NNX module
derives each param's key as Linen does (:func:`param_key`): the ``params`` key of the call's
root, the names of the scopes down to the layer, and the param's number within the layer.

The initializers of TransformerEngine's layers and the composite ones (a flat draw reshaped, as
Flax's ``DenseGeneral`` draws its kernel; independent draws stacked or concatenated, as TE
initialises its gated and fused QKV kernels) live here too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import config as flax_config
from flax.core import meta

__all__ = [
    "Initializer",
    "ParamSpec",
    "concat_init",
    "default_embed_init",
    "default_kernel_init",
    "default_mha_kernel_init",
    "flat_init",
    "lecun_normal",
    "ones",
    "param_key",
    "stacked_init",
    "zeros",
]

Initializer = Callable[..., Any]
"""``init(key, shape, dtype) -> array``, as ``jax.nn.initializers`` builds them."""

zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones
lecun_normal = jax.nn.initializers.lecun_normal()  # Flax's DenseGeneral default
#: TransformerEngine's default kernel initializer: ``variance_scaling(1.0, "fan_in",
#: "truncated_normal")``.
default_kernel_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
#: TE's default QKV/output kernel initializer: ``variance_scaling(1.0, "fan_in", "normal")``.
default_mha_kernel_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal")
#: Flax's default embedding initializer (``flax.linen.linear.default_embed_init``).
default_embed_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class ParamSpec(NamedTuple):
    """One param of a layer: its shape and dtype, the initializer that draws it, its logical
    axis names (``()``: none) and the config field that gives them (for error messages)."""

    shape: tuple[int, ...]
    dtype: Any
    init: Initializer
    axes: tuple[str | None, ...] = ()
    axes_arg: str = ""


def flat_init(init: Initializer, flat_shape: tuple[int, ...]) -> Initializer:
    """Wraps ``init`` to draw a ``flat_shape`` tensor and reshape it (as Flax's DenseGeneral)."""

    def wrapped(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
        value = init(rng, flat_shape, dtype)
        if isinstance(value, meta.AxisMetadata):  # an initializer boxed by the user
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)

    return wrapped


def stacked_init(init: Initializer, n: int) -> Initializer:
    """``(hidden, n, inter)`` from ``n`` independent draws of ``init`` on ``(hidden, inter)``
    (one key each), so each slice has fan-in ``hidden``, as TE initialises ``wi_kernel``."""

    def wrapped(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
        keys = jax.random.split(rng, n)
        return jnp.stack([init(k, (shape[0], shape[2]), dtype) for k in keys], axis=-2)

    return wrapped


def concat_init(inits: Sequence[Initializer]) -> Initializer:
    """Draws a flat ``(hidden, n * f)`` kernel as ``n`` blocks ``(hidden, f)``, one key and one
    initializer each (so each block has fan-in ``hidden``); reshaped by the layer to
    ``(hidden, n, f)``, block ``i`` is ``kernel[:, i, :]`` (TE's fused QKV/KV init)."""

    def init(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        n = len(inits)
        f = shape[-1] // n
        keys = jax.random.split(rng, n)
        blocks = [fn(k, (*shape[:-1], f), dtype) for fn, k in zip(inits, keys, strict=True)]
        return jnp.concatenate(blocks, axis=-1)

    return init


def param_key(root: jax.Array, path: Sequence[str], number: int) -> jax.Array:
    """The key Linen's ``init(root)`` gives the ``number``-th param (from 1) created in the
    scope at ``path`` (the submodule names from the root): ``root`` folded with a 32-bit hash
    of the path and the number (the SHA-1 of their bytes, as Flax folds static data into its
    ``params`` stream, separators included when ``flax_fix_rng_separator`` is set)."""
    digest = hashlib.sha1()
    for item in (*path, number):
        if flax_config.flax_fix_rng_separator:
            digest.update(b"\0")
        if isinstance(item, str):
            digest.update(item.encode("utf-8"))
        else:
            digest.update(int(item).to_bytes((int(item).bit_length() + 7) // 8, "big"))
    word = int.from_bytes(digest.digest()[:4], "big")
    return jax.random.fold_in(root, jnp.uint32(word))
