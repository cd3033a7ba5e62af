"""The framework-neutral layer spec that both Flax front-ends are built on.

Each layer has a config dataclass here (``DenseGeneralConfig``, ``LayerNormConfig``,
``LayerNormDenseGeneralConfig``, ``LayerNormMLPConfig``, ``MoEBlockConfig``,
``MultiHeadAttentionConfig``, ``RelativePositionBiasesConfig``, ``TransformerLayerConfig``):
TransformerEngine's field names and
defaults, every refusal of a call (``check``, ``check_decode``, ...), its params as data
(``param_specs``: name -> shape, dtype, initializer, logical axes), a composite's children as
configs, and the forward on given params or children. A Linen module of :mod:`fp8jax.flax` *is*
its config (it inherits the fields) and declares the params with ``self.param``; an NNX module
of :mod:`fp8jax.nnx` holds its config as ``config`` and draws the params itself, with the keys
Linen would use (:func:`fp8jax.layers.params.param_key`), so the same key gives the same params
in both APIs and the two cannot drift apart in what they accept or compute.

Also here: the attention core (:mod:`fp8jax.layers.attention_core`; with ``fp8_dpa``, what it
does where FP8 attention cannot run: :class:`Fp8AttentionFallback`,
:func:`strict_fp8_attention`; with TE's ``context_parallel_*`` arguments,
:mod:`fp8jax.layers.context_parallel`), the key/value cache step,
the argument checks (:mod:`fp8jax.layers.checks`) and the activation layout helpers
(:mod:`fp8jax.layers.layout`). Nothing here is a Flax module.
"""

from fp8jax.layers.attention import MultiHeadAttentionConfig
from fp8jax.layers.attention_backend import Fp8AttentionFallback, strict_fp8_attention
from fp8jax.layers.dense import DenseGeneralConfig
from fp8jax.layers.layernorm import LayerNormConfig, LayerNormDenseGeneralConfig
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.moe import MoEBlockConfig
from fp8jax.layers.params import ParamSpec
from fp8jax.layers.relative_position import RelativePositionBiasesConfig
from fp8jax.layers.transformer import TransformerLayerConfig, TransformerLayerType

__all__ = [
    "DenseGeneralConfig",
    "Fp8AttentionFallback",
    "LayerNormConfig",
    "LayerNormDenseGeneralConfig",
    "LayerNormMLPConfig",
    "MoEBlockConfig",
    "MultiHeadAttentionConfig",
    "ParamSpec",
    "RelativePositionBiasesConfig",
    "TransformerLayerConfig",
    "TransformerLayerType",
    "strict_fp8_attention",
]
