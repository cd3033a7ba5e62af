"""Flax Linen ``LayerNorm`` and ``LayerNormDenseGeneral`` with TransformerEngine's argument names.

``LayerNorm`` (``layernorm_type="layernorm"`` or ``"rmsnorm"``) has TE's params ``scale`` and
``ln_bias``; outside FP8 it computes exactly as ``flax.linen.LayerNorm``/``RMSNorm`` do, inside
``fp8jax.autocast(enabled=True)`` with fp8jax's norm kernels. ``LayerNormDenseGeneral`` is a
norm fused into an FP8 dense layer (:func:`fp8jax.layernorm_dense`): the normalised input goes
straight from the norm kernel to the GEMM in FP8.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import LayerNormDenseGeneral
>>> layer = LayerNormDenseGeneral(features=4)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
>>> jax.tree.map(jnp.shape, variables["params"])
{'kernel': (3, 4), 'ln_bias': (3,), 'scale': (3,)}
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fp8jax.flax._params import declare
from fp8jax.flax._variables import fp8_call
from fp8jax.layers.layernorm import LayerNormConfig, LayerNormDenseGeneralConfig
from fp8jax.layers.params import default_kernel_init

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "default_kernel_init"]


class LayerNorm(LayerNormConfig, nn.Module):
    """LayerNorm or RMSNorm over the last axis, with TransformerEngine's argument names.

    Params: ``scale`` ``(hidden,)`` and, for ``layernorm_type="layernorm"``, ``ln_bias``
    ``(hidden,)``. Outside FP8 the output equals ``flax.linen.LayerNorm`` (or ``RMSNorm``)
    with the same params bit for bit; inside ``fp8jax.autocast(enabled=True)`` fp8jax's norm
    kernel computes it (two-pass statistics in float32; equal within float32 rounding).

    Attributes:
      epsilon: added to the variance.
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: the scale applied is ``1 + scale`` (and ``scale`` starts at 0).
      scale_init: initializer of ``scale`` (default: ones, or zeros when zero-centred).
      scale_axes, bias_axes: logical axis names of ``scale``/``ln_bias`` (``()``: none).
      bias_init: initializer of ``ln_bias``.
      dtype: output dtype (default: promoted from the input and params, as in Flax).
      param_dtype: dtype of the params.
      transpose_batch_sequence: accepted for TE compatibility; a norm over the last axis does
        not depend on it.
    """

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.check(x)
        return self.forward(x, declare(self, "LayerNorm", self.param_specs(x.shape[-1])))


class LayerNormDenseGeneral(LayerNormDenseGeneralConfig, nn.Module):
    """A norm fused into an FP8 dense layer, with TransformerEngine's argument names.

    Computes ``norm(inputs) @ kernel (+ bias)`` over the last axis and returns ``(out,
    ln_output)``: ``ln_output`` is the norm's output when ``return_layernorm_output`` (the raw
    input when ``enable_layernorm=False``), else ``None``. Inside
    ``fp8jax.autocast(enabled=True, ...)`` it runs :func:`fp8jax.layernorm_dense` (the norm
    kernel writes the GEMM's FP8 input directly); outside, the same computation in high
    precision, equal to ``flax.linen.LayerNorm`` followed by ``flax.linen.DenseGeneral``.

    Params: ``scale``, ``ln_bias`` (as :class:`LayerNorm`; only with ``enable_layernorm``),
    ``kernel`` ``(hidden, *features)`` (drawn with the flat ``(hidden, prod(features))`` shape,
    as Flax's ``DenseGeneral`` draws it) and ``bias`` ``features`` (with ``use_bias``).
    The FP8 state has the 3 roles of a dense layer (input = the norm's output, kernel,
    output-grad).

    Differences from TE: ``dtype`` is the computation dtype with ``param_dtype`` for params, as
    in Flax; logical axis names default to none (``()``); ``transpose_batch_sequence`` has no
    effect (the norm and the GEMM act on the last axis only); ``dot_input_axes`` constrains
    the GEMM input only without the norm; LoRA and ``quantization_checkpoint_name`` are
    accepted at TE's defaults only (ValueError otherwise).

    Attributes:
      features: int or tuple of output features.
      enable_layernorm: normalise the input first (else an FP8 dense layer).
      layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes: as
        :class:`LayerNorm`; ln_bias_init, ln_bias_axes: its bias's.
      kernel_init: default :data:`default_kernel_init` (TE's). kernel_axes: logical names of
        the kernel's dims (``("embed", "mlp")``); ``()``: none.
      use_bias, bias_init, bias_axes: the GEMM's bias.
      return_layernorm_output: also return the norm's output (see above).
      axis: must be ``-1`` (the normalised and contracted axis).
      dtype, param_dtype: computation dtype (default: promoted from input and params), params'.
      layernorm_input_axes: logical axis names constraining the input (e.g. a sequence-split
        input for sequence parallelism); dot_input_axes: the GEMM's input, when
        ``enable_layernorm=False`` (with the norm, its output exists only inside the fused
        kernel); ``()``: none.
      depth_scaling: if set, the output is divided by it.
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha,
        quantization_checkpoint_name: TE's, at its defaults only (see above).
    """

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        owner = "LayerNormDenseGeneral"
        inputs, _ = self.check(inputs)
        params = declare(self, owner, self.param_specs(inputs.shape[-1]))
        fp8 = fp8_call(self)
        return self.forward(inputs, params, fp8, fp8.where)
