"""TransformerEngine's ``transformer_engine.jax.flax.transformer``: fp8jax's Linen layers.

These are fp8jax's own modules (:mod:`fp8jax.flax`), which follow TE's Linen API; their FP8
state is in fp8jax's collections (``"fp8_meta"`` by default, or the one
:func:`fp8jax.flax.fp8_state_collection` names, e.g. for a train step that takes the state's
gradient as its next value) with a probe per call in ``"fp8_probe"`` (docs/porting-from-te.md).
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
