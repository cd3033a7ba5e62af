"""Flax Linen modules and the train-step helpers of fp8jax.

- :class:`DenseGeneral`: FP8 drop-in for ``flax.linen.DenseGeneral`` (same params), with
  optional logical axis names (``kernel_axes``, ``bias_axes``, ``output_axes``) and
  :data:`DEFAULT_RULES` for :func:`flax.linen.logical_axis_rules`.
- :class:`Fp8DotGeneral`: FP8 ``dot_general`` for ``nn.Dense(dot_general_cls=Fp8DotGeneral)``.
- :class:`Fp8Einsum`: FP8 two-operand ``jnp.einsum`` with a weight.
- :class:`LayerNorm`, :class:`LayerNormDenseGeneral`, :class:`LayerNormMLP`: norms and the norm
  fused into FP8 dense layers and a whole MLP block, with TransformerEngine's argument names.
- :class:`MoEBlock`: a mixture-of-experts MLP block (router, dispatch, FP8 experts on the
  ragged grouped GEMM, expert parallelism).
- :class:`TransformerLayer` (:class:`TransformerLayerType`): a whole encoder or decoder layer.
- :class:`Fp8TrainState`, :func:`update_fp8_variables`, :func:`zero_probes`,
  :func:`accumulate_gradients`, :func:`all_finite`: the train step (see
  :mod:`fp8jax.flax.train`).
- :class:`DotProductAttention`, :class:`MultiHeadAttention`, :class:`RelativePositionBiases`:
  attention with TransformerEngine's argument names (FP8 projections, high-precision core).
- :func:`calibrate`: FP8 scales for inference from a few forward passes.
- :func:`linen_twin`: the Linen module of an :mod:`fp8jax.nnx` layer's config.

FP8 state lives in the ``"fp8_meta"`` collection and one probe per call in ``"fp8_probe"``
(:data:`FP8_META`, :data:`FP8_PROBE`), never in ``params``; :func:`fp8_state_collection`
names another collection for the state (TransformerEngine-style train steps that take the
state's gradient as its next value, e.g. MaxText's ``"_overwrite_with_gradient"``).
"""

from fp8jax.flax._variables import FP8_META, FP8_PROBE, fp8_state_collection
from fp8jax.flax.attention import DotProductAttention, MultiHeadAttention, RelativePositionBiases
from fp8jax.flax.calibration import calibrate
from fp8jax.flax.dense import DEFAULT_RULES, DenseGeneral, Fp8DotGeneral, Fp8Einsum
from fp8jax.flax.layernorm import LayerNorm, LayerNormDenseGeneral
from fp8jax.flax.mlp import LayerNormMLP
from fp8jax.flax.moe import MoEBlock
from fp8jax.flax.train import (
    Fp8TrainState,
    accumulate_gradients,
    all_finite,
    update_fp8_variables,
    zero_probes,
)
from fp8jax.flax.transformer import TransformerLayer, TransformerLayerType
from fp8jax.flax.twin import linen_twin

__all__ = [
    "DEFAULT_RULES",
    "FP8_META",
    "FP8_PROBE",
    "DenseGeneral",
    "DotProductAttention",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8TrainState",
    "LayerNorm",
    "LayerNormDenseGeneral",
    "LayerNormMLP",
    "MoEBlock",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
    "accumulate_gradients",
    "all_finite",
    "calibrate",
    "fp8_state_collection",
    "linen_twin",
    "update_fp8_variables",
    "zero_probes",
]
