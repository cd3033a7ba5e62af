"""Flax NNX modules and the NNX train step of fp8jax.

- :class:`DenseGeneral`, :class:`LayerNorm`, :class:`LayerNormDenseGeneral`,
  :class:`LayerNormMLP`, :class:`MultiHeadAttention`, :class:`TransformerLayer`: the Linen
  modules of :mod:`fp8jax.flax` as ``nnx.Module``s (same math, params and init; sizes
  positional, options keyword-only, ``rngs=``).
- :class:`Fp8Meta` (delayed-scaling state) and :class:`Fp8Probe` (per-call observations, read
  through their gradient): ``nnx.Variable`` types, never seen by
  ``nnx.Optimizer(..., wrt=nnx.Param)``.
- :func:`diff_state`, :func:`update_fp8_state`, :func:`apply_gradients`,
  :func:`accumulate_gradients`, :func:`calibrate`, :func:`model_recipe`: the train step
  (see :mod:`fp8jax.nnx.train`).
"""

from fp8jax.nnx.layers import DenseGeneral, LayerNorm, LayerNormDenseGeneral, LayerNormMLP
from fp8jax.nnx.train import (
    accumulate_gradients,
    apply_gradients,
    calibrate,
    diff_state,
    model_recipe,
    update_fp8_state,
)
from fp8jax.nnx.transformer import MultiHeadAttention, TransformerLayer
from fp8jax.nnx.variables import Fp8Meta, Fp8Probe

__all__ = [
    "DenseGeneral",
    "Fp8Meta",
    "Fp8Probe",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MultiHeadAttention",
    "TransformerLayer",
    "accumulate_gradients",
    "apply_gradients",
    "calibrate",
    "diff_state",
    "model_recipe",
    "update_fp8_state",
]
