"""NNX ``LayerNormMLP``: a native ``nnx.Module`` over :class:`~fp8jax.layers.LayerNormMLPConfig`,
computing with :func:`fp8jax.layernorm_mlp` (as :mod:`fp8jax.nnx.dense` describes for
``DenseGeneral``).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from fp8jax.layers.checks import positive_int
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.nnx._base import Fp8Module, Keys, keys_for, make_config
from fp8jax.nnx._probe import fp8_use

__all__ = ["LayerNormMLP"]


class LayerNormMLP(Fp8Module):
    """An FP8 Transformer MLP block (:class:`fp8jax.flax.LayerNormMLP`): norm, FC1,
    activation, dropout, FC2; returns ``(out, ln_output)``.

    Args:
      in_features: the model width (last axis of the input and of the output).
      intermediate_dim: the hidden width.
      **config: the twin's other attributes (``activations``, ``use_bias``,
        ``intermediate_dropout_rate`` (default 0.0, as TE), ``kernel_axes_1``, ...).
      deterministic: dropout off (``model.eval()`` sets it, ``model.train()`` clears it).
      rngs: ``rngs.params()`` draws the init key; the dropout stream
        (``intermediate_dropout_rng_name``, default ``"dropout"``) is forked and kept.
    """

    def __init__(
        self,
        in_features: int,
        *,
        intermediate_dim: int = 2048,
        deterministic: bool = False,
        rngs: nnx.Rngs | None = None,
        _config: LayerNormMLPConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNormMLP"
        in_features = positive_int(owner, "in_features", in_features)
        if _config is None:
            if "axis" in config:
                raise TypeError(f"{owner}: unexpected keyword argument 'axis'")
            _config = make_config(owner, LayerNormMLPConfig, config,
                                  intermediate_dim=intermediate_dim)  # fmt: skip
        self.config = _config
        _config.check_config()
        self._draw(owner, _config.param_specs(in_features), keys_for(owner, rngs, _keys))
        self._fp8_state(_config.n_roles)
        self.in_features = in_features
        self._dropout_stream(rngs, _config.intermediate_dropout_rng_name, deterministic)

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs`` ``[..., in_features]``; ``deterministic`` (default: the
        attribute) turns dropout off; ``rngs`` overrides the kept dropout stream."""
        owner, cfg = "LayerNormMLP", self.config
        inputs, acts = cfg.check(inputs)
        deterministic = self._deterministic(deterministic)
        key = self._dropout_key(rngs) if cfg.dropout_on(deterministic) else None
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        names = ("scale", "ln_bias", "wi_kernel", "wo_kernel", "wi_bias", "wo_bias")
        return cfg.forward(inputs, self._values(names), acts, fp8, owner, key)
