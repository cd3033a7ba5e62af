"""Flax Linen ``LayerNormMLP``: a Transformer MLP block in FP8, with TransformerEngine's
argument names and params (``scale``, ``ln_bias``, ``wi_kernel``, ``wi_bias``, ``wo_kernel``,
``wo_bias``).

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import LayerNormMLP
>>> block = LayerNormMLP(intermediate_dim=8, activations=("silu", "linear"),
...                      intermediate_dropout_rate=0.0)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = block.init(jax.random.key(0), jnp.ones((2, 4)))
>>> jax.tree.map(jnp.shape, variables["params"])  # doctest: +NORMALIZE_WHITESPACE
{'ln_bias': (4,), 'scale': (4,), 'wi_kernel': (4, 2, 8), 'wo_kernel': (8, 4)}
>>> jax.tree.map(jnp.shape, variables["fp8_meta"])  # 6 roles: fc1 and fc2
{'amax_history': (6, 8), 'scale': (6,)}
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fp8jax.flax._params import declare
from fp8jax.flax._variables import fp8_call
from fp8jax.layers.mlp import LayerNormMLPConfig

__all__ = ["LayerNormMLP"]


class LayerNormMLP(LayerNormMLPConfig, nn.Module):
    """``norm -> Dense (+bias) -> activation -> dropout -> Dense (+bias)``, in FP8.

    Returns ``(out, ln_output)`` like TE's module: ``out`` has the input's shape;
    ``ln_output`` is the norm's output when ``return_layernorm_output`` (the raw input when
    ``enable_layernorm=False``), else ``None``. Inside ``fp8jax.autocast(enabled=True, ...)`` it
    runs :func:`fp8jax.layernorm_mlp` (norm and activation fused with their FP8 casts, every
    GEMM FP8 both ways); outside it is the same block in high precision, equal to
    ``flax.linen.LayerNorm -> DenseGeneral -> activation -> Dense`` with the same params.

    Params: ``scale``/``ln_bias`` ``(hidden,)`` (as :class:`~fp8jax.flax.LayerNorm`; with
    ``enable_layernorm``), ``wi_kernel`` ``(hidden, len(activations), intermediate_dim)`` (each
    ``[:, i, :]`` slice drawn by ``kernel_init`` with its own key), ``wo_kernel``
    ``(intermediate_dim, hidden)``, and with ``use_bias`` ``wi_bias`` ``(len(activations),
    intermediate_dim)`` and ``wo_bias`` ``(hidden,)``. The FP8 state has the 6 roles of
    :data:`fp8jax.functional.mlp.MLP_ROLES`.

    Differences from TE: ``dtype``/``param_dtype`` as in Flax; logical axis names default to
    none (``()``; TE's are ``kernel_axes_1=("embed", "act", "mlp")``,
    ``kernel_axes_2=("mlp", "embed")``); activations are names only (no callables); dropout
    keeps the fused FP8 activation path only when inactive (rate 0 or ``deterministic``):
    with an active dropout the activation and its FP8 cast run as two passes;
    ``transpose_batch_sequence`` has no effect; ``ffn1_ckpt_name`` names nothing (the FC1
    output exists only inside the fused block; :data:`fp8jax.save_fp8_operands` saves its FP8
    operands); LoRA, ``activation_params``, ``dot_1_input_axes``, ``dot_2_input_axes`` and
    ``quantization_checkpoint_name`` are accepted at TE's defaults only (ValueError
    otherwise).

    Attributes:
      intermediate_dim: width of the hidden layer.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: the norm (see :class:`~fp8jax.flax.LayerNormDenseGeneral`).
      kernel_init: default TE's ``variance_scaling(1.0, "fan_in", "truncated_normal")``.
      kernel_axes_1, kernel_axes_2: logical names of ``wi_kernel`` (3) and ``wo_kernel`` (2).
      use_bias, bias_init, bias_axes_1, bias_axes_2: the two GEMMs' biases.
      return_layernorm_output: also return the norm's output.
      activations: ``("gelu",)`` (tanh approximation), ``"gelu_exact"``, ``"relu"``,
        ``"silu"``/``"swish"``, ``"linear"``, or a gated pair ``(act, "linear")``.
      intermediate_dropout_rng_name, intermediate_dropout_rate,
        intermediate_hidden_dropout_dims: dropout on the activation's output (the dims listed
        share one mask value, as ``nn.Dropout``'s ``broadcast_dims``).
      axis: must be ``-1``.
      dtype, param_dtype: computation dtype (default: promoted from input and params), params'.
      layernorm_input_axes: logical names constraining the input.
      ffn1_ckpt_name, ffn2_ckpt_name: TE's checkpoint names; the output carries
        ``ffn2_ckpt_name`` (:func:`jax.ad_checkpoint.checkpoint_name`), ``ffn1_ckpt_name`` has
        no effect (see above).
      activation_params, enable_low_rank_adaptation, low_rank_adaptation_dim,
        low_rank_adaptation_alpha, dot_1_input_axes, dot_2_input_axes,
        quantization_checkpoint_name: TE's, at its defaults only (see above).
    """

    @nn.compact
    def __call__(
        self, inputs: jax.Array, deterministic: bool = False
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs`` ``[..., hidden]``; dropout is off when ``deterministic``."""
        inputs, acts = self.check(inputs)
        params = declare(self, "LayerNormMLP", self.param_specs(inputs.shape[-1]))
        fp8 = fp8_call(self, self.n_roles)
        key = None
        if self.dropout_on(deterministic):
            key = self.make_rng(self.intermediate_dropout_rng_name)
        return self.forward(inputs, params, acts, fp8, fp8.where, key)
