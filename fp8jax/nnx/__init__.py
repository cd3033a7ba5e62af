"""Flax NNX modules and the NNX train step of fp8jax.

- :class:`DenseGeneral`, :class:`LayerNorm`, :class:`LayerNormDenseGeneral`,
  :class:`LayerNormMLP`, :class:`MoEBlock`, :class:`MultiHeadAttention`,
  :class:`TransformerLayer` (and :class:`DotProductAttention`, the attention core): native
  ``nnx.Module``s over fp8jax's layer spec (:mod:`fp8jax.layers`) and functional layers,
  with the params, init and names of the Linen modules of :mod:`fp8jax.flax` (which are built
  on the same spec; sizes positional, options keyword-only, ``rngs=``). Each holds its config
  as ``config``; :func:`fp8jax.flax.linen_twin` gives the Linen module of that config.
  The composites hold the leaf layers as typed attributes (``layer.mlp``,
  ``layer.attention.qkv``, ...), which may be replaced by modules of your own.
- :class:`Fp8MetaVariable` (delayed-scaling state) and :class:`Fp8Probe` (per-call
  observations, read through their gradient): ``nnx.Variable`` types, never seen by
  ``nnx.Optimizer(..., wrt=nnx.Param)``.
- :func:`diff_state`, :func:`update_fp8_variables`, :func:`apply_gradients`,
  :func:`accumulate_gradients`, :func:`calibrate`, :func:`model_recipe`: the train step
  (see :mod:`fp8jax.nnx.train`).

``Fp8Meta`` and ``update_fp8_state`` are the deprecated names of :class:`Fp8MetaVariable` and
:func:`update_fp8_variables` (a DeprecationWarning; removed in the next release).
"""

from __future__ import annotations

import warnings
from typing import Any

from fp8jax.nnx.attention import DotProductAttention, MultiHeadAttention
from fp8jax.nnx.dense import DenseGeneral
from fp8jax.nnx.layernorm import LayerNorm, LayerNormDenseGeneral
from fp8jax.nnx.mlp import LayerNormMLP
from fp8jax.nnx.moe import MoEBlock
from fp8jax.nnx.relative_position import RelativePositionBiases
from fp8jax.nnx.train import (
    accumulate_gradients,
    apply_gradients,
    calibrate,
    diff_state,
    model_recipe,
    update_fp8_variables,
)
from fp8jax.nnx.transformer import TransformerLayer
from fp8jax.nnx.variables import Fp8MetaVariable, Fp8Probe

__all__ = [
    "DenseGeneral",
    "DotProductAttention",
    "Fp8MetaVariable",
    "Fp8Probe",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MoEBlock",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "accumulate_gradients",
    "apply_gradients",
    "calibrate",
    "diff_state",
    "model_recipe",
    "update_fp8_variables",
]

#: Old name -> (new name, object, what the old name clashed with): importable for one release.
_DEPRECATED = {
    "Fp8Meta": ("Fp8MetaVariable", Fp8MetaVariable, "the NamedTuple fp8jax.Fp8Meta"),
    "update_fp8_state": (
        "update_fp8_variables",
        update_fp8_variables,
        "the per-tensor op fp8jax.ops.update_fp8_state",
    ),
}


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        new, value, clash = _DEPRECATED[name]
        warnings.warn(
            f"fp8jax.nnx.{name} is deprecated (it clashes with {clash}); use "
            f"fp8jax.nnx.{new}. The old name will be removed in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return value
    raise AttributeError(f"module 'fp8jax.nnx' has no attribute {name!r}")
