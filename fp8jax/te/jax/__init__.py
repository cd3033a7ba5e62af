"""TransformerEngine's ``transformer_engine.jax``, as far as fp8jax implements it.

Submodules at TE's paths: :mod:`~fp8jax.te.jax.dense`, :mod:`~fp8jax.te.jax.layernorm_dense`,
:mod:`~fp8jax.te.jax.layernorm_mlp`, :mod:`~fp8jax.te.jax.quantize`,
:mod:`~fp8jax.te.jax.cpp_extensions`, :mod:`~fp8jax.te.jax.sharding`,
:mod:`~fp8jax.te.jax.attention`, :mod:`~fp8jax.te.jax.flax`. ``autocast`` / ``fp8_autocast``
are fp8jax's.
"""

from __future__ import annotations

from fp8jax.autocast import autocast, fp8_autocast
from fp8jax.te.jax import (
    attention,
    cpp_extensions,
    dense,
    flax,
    layernorm_dense,
    layernorm_mlp,
    quantize,
    sharding,
)
from fp8jax.te.jax.sharding import MeshResource

__all__ = [
    "MeshResource",
    "attention",
    "autocast",
    "cpp_extensions",
    "dense",
    "flax",
    "fp8_autocast",
    "layernorm_dense",
    "layernorm_mlp",
    "quantize",
    "sharding",
]
