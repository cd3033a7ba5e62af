"""The NNX layer of a child config: how the composites (``MultiHeadAttention``,
``TransformerLayer``) build their typed children from their config's child configs."""

from __future__ import annotations

from typing import Any

from flax import nnx

from fp8jax.layers.dense import DenseGeneralConfig
from fp8jax.layers.layernorm import LayerNormConfig, LayerNormDenseGeneralConfig
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.moe import MoEBlockConfig
from fp8jax.nnx._base import Keys
from fp8jax.nnx.dense import DenseGeneral
from fp8jax.nnx.layernorm import LayerNorm, LayerNormDenseGeneral
from fp8jax.nnx.mlp import LayerNormMLP
from fp8jax.nnx.moe import MoEBlock

__all__ = ["child_layer"]


def child_layer(
    config: Any, in_features: int, keys: Keys, rngs: nnx.Rngs, deterministic: bool
) -> Any:
    """The NNX layer of a child config, ``in_features`` wide."""
    kw = dict(_config=config, _keys=keys)
    if isinstance(config, LayerNormDenseGeneralConfig):
        return LayerNormDenseGeneral(in_features, 0, **kw)
    if isinstance(config, DenseGeneralConfig):
        return DenseGeneral(in_features, 0, **kw)
    if isinstance(config, LayerNormMLPConfig):
        return LayerNormMLP(in_features, rngs=rngs, deterministic=deterministic, **kw)
    if isinstance(config, LayerNormConfig):
        return LayerNorm(in_features, **kw)
    if isinstance(config, MoEBlockConfig):
        return MoEBlock(in_features, rngs=rngs, **kw)
    raise TypeError(f"no NNX layer for {type(config).__name__}")
