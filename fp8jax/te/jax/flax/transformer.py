"""TransformerEngine's ``transformer_engine.jax.flax.transformer``: fp8jax's Linen layers.

These are fp8jax's own modules (:mod:`fp8jax.flax`), which follow TE's Linen API; their FP8
state is in fp8jax's collections (:data:`fp8jax.flax.FP8_META` by default, or the one the
module's ``fp8_collection`` names) and is updated as fp8jax's train step does
(docs/porting-from-te.md).
"""

from __future__ import annotations

from fp8jax.flax import (
    DotProductAttention,
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
]
