"""TransformerEngine's ``transformer_engine.jax.flax``: the TE Linen names fp8jax has (its own
modules) and :class:`~fp8jax.te.jax.flax.module.TransformerEngineBase`."""

from __future__ import annotations

from fp8jax.flax import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from fp8jax.te.jax.flax import module, transformer
from fp8jax.te.jax.flax.module import TransformerEngineBase
from fp8jax.te.jax.flax.transformer import (
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)

__all__ = [
    "DenseGeneral",
    "DotProductAttention",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerEngineBase",
    "TransformerLayer",
    "TransformerLayerType",
    "module",
    "transformer",
]
