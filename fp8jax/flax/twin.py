"""The Linen twin of an fp8jax NNX layer: the Linen module with the same config, whose
``init``/``apply`` take the NNX layer's ``linen_variables()`` (e.g. to run or save an NNX model
through Linen code)."""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn

from fp8jax.flax.attention import MultiHeadAttention, RelativePositionBiases
from fp8jax.flax.dense import DenseGeneral
from fp8jax.flax.layernorm import LayerNorm, LayerNormDenseGeneral
from fp8jax.flax.mlp import LayerNormMLP
from fp8jax.flax.moe import MoEBlock
from fp8jax.flax.transformer import TransformerLayer

__all__ = ["linen_twin"]

_MODULES = (
    DenseGeneral,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MoEBlock,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
)


def linen_twin(module: Any) -> nn.Module:
    """The :mod:`fp8jax.flax` module configured as the :mod:`fp8jax.nnx` layer ``module``
    (its ``config``); TypeError for anything else.

    >>> import jax, jax.numpy as jnp, fp8jax
    >>> from flax import nnx
    >>> layer = fp8jax.nnx.DenseGeneral(3, 4, rngs=nnx.Rngs(0))
    >>> twin = fp8jax.flax.linen_twin(layer)
    >>> y = twin.apply(layer.linen_variables(), jnp.ones((2, 3)))
    >>> bool(jnp.array_equal(y, layer(jnp.ones((2, 3)))))
    True
    """
    config = getattr(module, "config", None)
    for cls in _MODULES:
        if type(config) in cls.__bases__:
            return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    raise TypeError(f"linen_twin: {type(module).__name__} is not an fp8jax.nnx layer")
